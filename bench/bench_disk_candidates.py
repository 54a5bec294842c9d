"""What a disk-backed writable layer costs per sandbox, for each candidate design, measured on
this host with the kernel's own interfaces (no dsec): the numbers behind the choice in
docs/ARCHITECTURE.md ("The writable layer"). Run as root:

    .venv/bin/python bench/bench_disk_candidates.py [--rounds 40] [--density 64]

Candidates, each create + mount + umount + destroy of one sandbox's writable layer:
- tmpfs: today's upper (the baseline; its pages are memory).
- ext4-mkfs: a sparse file, mkfs.ext4, a loop device (LOOP_CONFIGURE), mount.
- ext4-template (dsec's, dsec.backends.writable): an O_TMPFILE (no name, so nothing to leak)
  filled with the data extents of a blank ext4 image made once per size, LOOP_CONFIGURE with
  autoclear + direct I/O, mount; the umount alone frees the loop device and the file.
- btrfs: one loop-mounted btrfs per edge with quotas on; per sandbox a subvolume (ioctl) and
  a qgroup limit (ioctl), destroyed with its subvolume (and the qgroup).
Density: kernel memory (slab, stacks, per-cpu, page tables, buffers) and kernel threads per
idle mounted layer holding one small file (MemAvailable too: noisy on a shared machine).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from _common import pct

from dsec.backends.writable import MOUNT_OPTIONS, WritableDisks, bind_loop, image_mb, make_blank

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_NOSUID, MS_NODEV = 2, 4
SIZE_MB, INODES = 2048, 262144


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


BTRFS_IOC_SUBVOL_CREATE = _ioc(1, 14, 4096)
BTRFS_IOC_SNAP_DESTROY = _ioc(1, 15, 4096)
BTRFS_IOC_INO_LOOKUP = _ioc(3, 18, 4096)
BTRFS_IOC_QGROUP_LIMIT = _ioc(2, 43, 48)


def mount(src: str, target: str, fstype: str, opts: str) -> None:
    if libc.mount(src.encode(), target.encode(), fstype.encode(), MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {fstype} {src}")


def umount(target: str) -> None:
    if libc.umount2(target.encode(), 0) != 0:
        raise OSError(ctypes.get_errno(), f"umount {target}")


def blank(dirpath: Path) -> Path:
    return make_blank(dirpath, image_mb(SIZE_MB, INODES), INODES)


class Ext4Template:
    """dsec's own (dsec.backends.writable): an O_TMPFILE filled from the template's extents,
    LOOP_CONFIGURE with autoclear and direct I/O, then the mount the shim makes."""

    def __init__(self, work: Path) -> None:
        self.disks = WritableDisks(work)
        self.disks.template(SIZE_MB, INODES)

    def create(self, mnt: str) -> None:
        disk = self.disks.attach(SIZE_MB, INODES, os.path.basename(mnt))
        mount(disk.device, mnt, "ext4", MOUNT_OPTIONS)
        disk.close()  # the mount holds the device now; its umount frees it (autoclear)

    def destroy(self, mnt: str) -> None:
        umount(mnt)


def loop_attach(fd: int) -> tuple[int, str]:
    disk = bind_loop(fd, "bench")
    return disk.fd, disk.device


class Ext4Mkfs:
    def __init__(self, work: Path) -> None:
        self.work = work

    def create(self, mnt: str) -> None:
        path = self.work / f"mkfs-{os.path.basename(mnt)}"
        with open(path, "wb") as f:
            f.truncate(SIZE_MB << 20)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-N", str(INODES), "-m", "0", "-O", "^has_journal,^resize_inode",
             "-E", "lazy_itable_init=1,nodiscard", str(path)], check=True,
        )  # fmt: skip
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        path.unlink()
        lfd, dev = loop_attach(fd)
        os.close(fd)
        mount(dev, mnt, "ext4", "noinit_itable")
        os.close(lfd)

    def destroy(self, mnt: str) -> None:
        umount(mnt)


class Tmpfs:
    def create(self, mnt: str) -> None:
        mount("dsec-upper", mnt, "tmpfs", f"size={SIZE_MB}m,nr_inodes={INODES},mode=0755")

    def destroy(self, mnt: str) -> None:
        umount(mnt)


class Btrfs:
    """One btrfs per edge (a loop-mounted sparse file), quotas on; a subvolume per sandbox."""

    def __init__(self, work: Path) -> None:
        self.root = work / "btrfs"
        self.root.mkdir(exist_ok=True)
        img = work / "edge.btrfs"
        with open(img, "wb") as f:
            f.truncate(256 << 30)
        subprocess.run(["mkfs.btrfs", "-q", "-f", str(img)], check=True, stderr=subprocess.DEVNULL)
        fd = os.open(img, os.O_RDWR | os.O_CLOEXEC)
        img.unlink()
        lfd, dev = loop_attach(fd)
        os.close(fd)
        mount(dev, str(self.root), "btrfs", "")
        os.close(lfd)
        subprocess.run(["btrfs", "quota", "enable", str(self.root)], check=True)
        self.dirfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)

    def create(self, mnt: str) -> None:
        name = os.path.basename(mnt).encode()
        fcntl.ioctl(self.dirfd, BTRFS_IOC_SUBVOL_CREATE, bytearray(struct.pack("=q4088s", 0, name)))
        sub = os.open(self.root / name.decode(), os.O_RDONLY | os.O_DIRECTORY)
        try:
            buf = bytearray(struct.pack("=QQ4080s", 0, 256, b""))
            fcntl.ioctl(sub, BTRFS_IOC_INO_LOOKUP, buf)
            root_id = struct.unpack_from("=Q", buf)[0]
            limit = struct.pack("=Q5Q", root_id, 2, 0, SIZE_MB << 20, 0, 0)  # MAX_EXCL
            fcntl.ioctl(sub, BTRFS_IOC_QGROUP_LIMIT, bytearray(limit))
        finally:
            os.close(sub)

    def destroy(self, mnt: str) -> None:
        name = os.path.basename(mnt).encode()
        fcntl.ioctl(self.dirfd, BTRFS_IOC_SNAP_DESTROY, bytearray(struct.pack("=q4088s", 0, name)))

    def close(self) -> None:
        os.close(self.dirfd)
        umount(str(self.root))


def meminfo(*keys: str) -> int:
    """Bytes: the sum of these /proc/meminfo fields."""
    total = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        if name in keys:
            total += int(value.split()[0]) * 1024
    return total


KERNEL = ("Slab", "KernelStack", "Percpu", "PageTables", "Buffers")  # a mount's and a device's own


def kthreads() -> int:
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _is_kthread(p))


def _is_kthread(p: Path) -> bool:
    try:
        return int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[6]) & 0x00200000 != 0
    except (OSError, IndexError, ValueError):
        return False


def main(rounds: int, density: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="dsec-diskbench-", dir="/var/lib/dsec"))
    mnts = Path(tempfile.mkdtemp(prefix="dsec-diskbench-", dir="/run"))
    t = time.perf_counter()
    blank(work)
    mkfs_once = time.perf_counter() - t
    cands: dict[str, object] = {
        "tmpfs": Tmpfs(),
        "ext4-template": Ext4Template(work),
        "ext4-mkfs": Ext4Mkfs(work),
        "btrfs": Btrfs(work),
    }
    create: dict[str, list[float]] = {k: [] for k in cands}
    destroy: dict[str, list[float]] = {k: [] for k in cands}
    try:
        for i in range(rounds):  # alternating: the host's noise falls on each alike
            for name, c in cands.items():
                if name == "ext4-mkfs" and i >= max(5, rounds // 8):
                    continue
                m = mnts / f"{name}-{i}"
                m.mkdir()
                t = time.perf_counter()
                c.create(str(m))  # type: ignore[attr-defined]
                create[name].append(time.perf_counter() - t)
                t = time.perf_counter()
                c.destroy(str(m))  # type: ignore[attr-defined]
                destroy[name].append(time.perf_counter() - t)
                m.rmdir()
        base = pct(create["tmpfs"], 0.5) + pct(destroy["tmpfs"], 0.5)
        print(
            f"blank ext4 of {SIZE_MB} MiB, {INODES} inodes (once per size): {mkfs_once * 1000:.1f} ms, "
            f"{sum(n for _, n in WritableDisks(work).template(SIZE_MB, INODES).extents) >> 10} KiB to copy"
        )
        print("| candidate | create p50 ms | create p95 ms | destroy p50 ms | total vs tmpfs |")
        print("|---|---|---|---|---|")
        for name in cands:
            tot = pct(create[name], 0.5) + pct(destroy[name], 0.5)
            print(
                f"| {name} | {pct(create[name], 0.5):.2f} | {pct(create[name], 0.95):.2f} | "
                f"{pct(destroy[name], 0.5):.2f} | +{tot - base:.2f} ms |"
            )
        print()
        print(
            f"| candidate | kernel memory per idle layer (KiB, {density} mounted) | "
            "MemAvailable drop per layer (KiB, noisy) | kernel threads per layer |"
        )
        print("|---|---|---|---|")
        for name in ("tmpfs", "ext4-template", "btrfs"):
            c = cands[name]
            subprocess.run(["sync"], check=True)
            m0, n0, k0 = meminfo("MemAvailable"), meminfo(*KERNEL), kthreads()
            made = []
            for i in range(density):
                m = mnts / f"d-{name}-{i}"
                m.mkdir()
                c.create(str(m))  # type: ignore[attr-defined]
                (c.root / m.name if isinstance(c, Btrfs) else m).joinpath("f").write_bytes(b"x")
                made.append(m)
            time.sleep(1.0)
            m1, n1, k1 = meminfo("MemAvailable"), meminfo(*KERNEL), kthreads()
            print(
                f"| {name} | {(n1 - n0) / density / 1024:.0f} | {(m0 - m1) / density / 1024:.0f} | "
                f"{(k1 - k0) / density:.2f} |"
            )
            for m in made:
                c.destroy(str(m))  # type: ignore[attr-defined]
                m.rmdir()
    finally:
        cands["btrfs"].close()  # type: ignore[attr-defined]
        subprocess.run(["rm", "-rf", str(work), str(mnts)], check=False)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--density", type=int, default=64)
    a = p.parse_args()
    main(a.rounds, a.density)
