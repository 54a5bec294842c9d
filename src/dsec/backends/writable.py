"""A sandbox's writable layer on disk: an ext4 file system of its own, on a loop device over a
file that has no name (docs/ARCHITECTURE.md, "The writable layer").

Per sandbox (`WritableDisks.attach`, ~1-2 ms)::

    O_TMPFILE in disk_dir            an unnamed sparse file of the layer's size: nothing to
                                     leak, its blocks are freed with its last user
      <- the data extents of a blank ext4 made once per (size, inodes) (~90 KiB)
    LOOP_CONFIGURE (autoclear, direct I/O) on a free /dev/loopN
    -> the launcher (dsec-shim crun-wrap / runsc-keep) mounts it as the overlay's upper in the
       sandbox's own mount namespace, holds an O_PATH on it (fd 5, the edge takes a copy)
    the edge closes its descriptors once the launcher has mounted it

From then on the mount is the device's only user: when the sandbox's mount namespace is gone
and the edge has closed its copy of fd 5, the file system is unmounted, the loop device clears
itself (autoclear) and the file's blocks are freed. A crashed edge, a killed shim or a failed
create leave nothing behind: no name, no mount in the host's table, no bound device.

Why ext4 on a loop device (bench/bench_disk_candidates.py): ENOSPC at the sandbox's disk_mb and
an inode limit of its own, statvfs inside showing its own size, a file system nobody else
writes (a fresh one from a template: no block of another sandbox's is ever readable), and
its pages reclaimable by writeback, so files do not count against memory_mb as a tmpfs's do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dsec.backends.writable")

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = "=5Q4I64s64s32s2Q"  # struct loop_info64 (lo_file_name: the 64 bytes after lo_flags)
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
_EBUSY_TRIES = 64
_INODE_BYTES = 256  # ext4's default inode size: the inode tables take inodes * 256
_MIB = 1 << 20

# The upper's mount options (with the device): no lazy inode table zeroing (the tables of a
# sparse file read as zeros already), no cache flushes sent to the host's disk for a sandbox's
# fsyncs (nothing survives a host crash: the sandbox does not either).
MOUNT_OPTIONS = "noinit_itable,nobarrier"


def image_mb(disk_mb: int, inodes: int) -> int:
    """The file's size for a layer whose files can take `disk_mb`: the inode tables and the
    blocks ext4 keeps for its own metadata (2%, at most 16 MiB) come on top."""
    tables = -(-inodes * _INODE_BYTES // _MIB)
    return disk_mb + tables + min(disk_mb // 50 + 1, 17) + 1


@dataclass
class Template:
    """A blank ext4 image of one size, open, with where its bytes are (the rest are holes)."""

    fd: int
    size: int
    extents: tuple[tuple[int, int], ...]


@dataclass
class LoopDisk:
    """One sandbox's layer until the launcher has mounted it: the bound device (held open
    here so that autoclear does not free it before the mount)."""

    fd: int
    device: str

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WritableDisks:
    """Writable layers on disk for the sandboxes of one host (see the module)."""

    def __init__(self, disk_dir: Path) -> None:
        self.dir = disk_dir
        self._templates: dict[tuple[int, int], Template] = {}
        self._lock = threading.Lock()

    def ready(self, disk_mb: int, inodes: int) -> bool:
        return (disk_mb, inodes) in self._templates

    def template(self, disk_mb: int, inodes: int) -> Template:
        """The blank image of that shape, made once per host (mkfs: ~20 ms), kept open."""
        key = (disk_mb, inodes)
        with self._lock:
            t = self._templates.get(key)
            if t is None:
                path = make_blank(self.dir, image_mb(disk_mb, inodes), inodes)
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                t = self._templates[key] = Template(fd, os.fstat(fd).st_size, tuple(data_extents(fd)))
            return t

    def attach(self, disk_mb: int, inodes: int, name: str) -> LoopDisk:
        """A fresh file system of that shape on a loop device of its own (see the module),
        named `name` (the sandbox's id: `loop_devices_of` tells whose a device is)."""
        t = self.template(disk_mb, inodes)
        fd = os.open(self.dir, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, t.size)
            for start, length in t.extents:
                done = 0
                while done < length:
                    n = os.copy_file_range(t.fd, fd, length - done, start + done, start + done)
                    if n <= 0:
                        raise OSError(f"copying the blank ext4 image stopped at {start + done}")
                    done += n
            return bind_loop(fd, name)
        finally:
            os.close(fd)  # the loop device holds the file from here

    def close(self) -> None:
        for t in self._templates.values():
            os.close(t.fd)
        self._templates.clear()


def bind_loop(fd: int, name: str) -> LoopDisk:
    """A free loop device bound to `fd`: autoclear (it unbinds itself when its last user
    closes it), direct I/O (the backing file's pages are not cached a second time)."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(_EBUSY_TRIES):  # another process may take the free one first
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            device = f"/dev/loop{n}"
            lfd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            # struct loop_config: fd, block_size, struct loop_info64, 64 reserved bytes
            info = struct.pack(
                _LOOP_INFO64, 0, 0, 0, 0, 0, 0, 0, 0,
                LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, name.encode()[:63], b"", b"", 0, 0,
            )  # fmt: skip
            config = struct.pack("=II", fd, 4096) + info + bytes(64)
            try:
                fcntl.ioctl(lfd, LOOP_CONFIGURE, config)
            except OSError as e:
                os.close(lfd)
                if e.errno == 16:  # EBUSY
                    continue
                raise
            return LoopDisk(lfd, device)
    finally:
        os.close(ctl)
    raise OSError(16, "no free loop device after many tries")


def make_blank(cache: Path, size_mb: int, inodes: int) -> Path:
    """A blank ext4 image of `size_mb` with `inodes` inodes, made once under `cache`: no journal
    (nothing of it outlives its host's crash), no blocks reserved for root (a sandbox's root is
    not the host's), no resize inode (~1 MiB less to copy per sandbox)."""
    features, extended = "^has_journal,^resize_inode", "lazy_itable_init=1,nodiscard"
    options = ["-b", "4096", "-N", str(inodes), "-m", "0", "-O", features, "-E", extended, "-L", "dsec-upper"]
    return mkfs_once(cache / f"upper-{size_mb}m-{inodes}i.ext4", size_mb, options)


def mkfs_once(target: Path, size_mb: int, options: list[str]) -> Path:
    """`target`, a sparse file of `size_mb` made an ext4 by mkfs.ext4 with `options`, unless it
    exists (made under a temporary name, then renamed: concurrent makers are harmless)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
    tmp.unlink(missing_ok=True)
    with open(tmp, "wb") as f:
        f.truncate(size_mb * _MIB)
    argv = ["mkfs.ext4", "-q", "-F", *options, str(tmp)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"mkfs.ext4 failed: {r.stderr[-800:]}")
    os.replace(tmp, target)
    return target


def data_extents(fd: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of data in a sparse file."""
    out: list[tuple[int, int]] = []
    off, end = 0, os.fstat(fd).st_size
    while off < end:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole from here
            break
        stop = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, stop - start))
        off = stop
    return out


def loop_devices_of(disk_dir: Path) -> dict[str, str]:
    """The loop devices bound to a file of `disk_dir`: device -> the name it was given (a
    sandbox's id; for tests and operators: a stopped sandbox leaves none)."""
    out = {}
    with contextlib.suppress(FileNotFoundError):
        for dev in Path("/sys/block").iterdir():
            with contextlib.suppress(OSError):
                backing = (dev / "loop" / "backing_file").read_text().strip()
                if not backing.startswith(f"{disk_dir}/"):
                    continue
                fd = os.open(f"/dev/{dev.name}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    info = bytearray(struct.calcsize(_LOOP_INFO64))
                    fcntl.ioctl(fd, LOOP_GET_STATUS64, info)
                finally:
                    os.close(fd)
                name = struct.unpack(_LOOP_INFO64, info)[9]
                out[f"/dev/{dev.name}"] = name.rstrip(b"\0").decode(errors="replace")
    return out
