"""The paths a restore opens by name, checked against the sandbox's files as they are now,
what restored processes hold, and detached read-only mounts for CRIU's own files."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.base import SandboxHandle
from dsec.backends.criu.images import _entries, _fields
from dsec.errors import InternalError, UnsupportedOperation
from dsec.isolation import linux

# --- the paths a restore opens by name ------------------------------------------------

_RESOLVE_STRICT = linux.RESOLVE_BENEATH | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS


@dataclass
class RecordedFile:
    id: int
    name: str  # absolute, as the sandbox saw it at dump time
    mode: int | None  # st_mode at dump time, when CRIU recorded it


def recorded_files(images: Path) -> list[RecordedFile]:
    """Every regular-file entry of a dump (files.img: open files, cwd, root, executables,
    mapped files, fifos): the paths CRIU opens by name when it restores."""
    try:
        data = (images / "files.img").read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for entry in _entries(data, 2):
        for num, _, v in _fields(entry):
            if num != 3 or not isinstance(v, bytes):  # file_entry.reg
                continue
            fid, name, mode = 0, None, None
            for f, _, x in _fields(v):
                if f == 1 and isinstance(x, int):
                    fid = x
                elif f == 6 and isinstance(x, bytes):
                    name = os.fsdecode(x)
                elif f == 10 and isinstance(x, int):
                    mode = x
            if name is not None:
                out.append(RecordedFile(fid, name, mode))
    return out


def _remapped_ids(images: Path) -> set[int]:
    """Ids of files CRIU recreates itself (deleted files kept as ghosts, or linked)."""
    try:
        data = (images / "remap-fpath.img").read_bytes()
    except FileNotFoundError:
        return set()
    return {v for e in _entries(data, 2) for num, _, v in _fields(e) if num == 1 and isinstance(v, int)}


def _changed(root_fd: int, f: RecordedFile, remapped: set[int]) -> str | None:
    """Why recorded file `f` no longer resolves to what was dumped, seen from the
    sandbox's root without following any link; None when it does."""
    rel = f.name.lstrip("/") or "."
    if f.id in remapped:  # recreated by CRIU at that name: its directory must be genuine
        rel, want = os.path.dirname(rel) or ".", stat.S_IFDIR
    else:
        want = stat.S_IFMT(f.mode) if f.mode else 0
    try:
        fd = linux.openat2(root_fd, rel, os.O_PATH | os.O_NOFOLLOW, 0, _RESOLVE_STRICT)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EXDEV):
            return f"{f.name} now goes through a symbolic link"
        return f"{f.name}: {os.strerror(e.errno or 0)}"
    try:
        got = stat.S_IFMT(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if want and got != want:
        return f"{f.name} is no longer the same kind of file"
    return None


def check_recorded_paths(images: Path, root_fd: int, what: str, sandbox: str) -> None:
    """Refuse (reason file_changed) a dump whose recorded paths the sandbox changed, e.g. a
    dumped directory swapped for a symlink to /proc/self/cwd/.. or a symlinked parent."""
    remapped = _remapped_ids(images)
    for f in recorded_files(images):
        why = _changed(root_fd, f, remapped)
        if why is not None:
            raise UnsupportedOperation(
                f"cannot {what} sandbox {sandbox}: a file the processes hold changed since they were "
                f"dumped ({why}). Restore into a new sandbox from an untouched checkpoint, or take a new one",
                reason="file_changed",
            )


def taken_pids(root_fd: int, pids: Sequence[int]) -> dict[int, str]:
    """Which of `pids` live in the sandbox now, with their command lines, as its own /proc
    shows them (a restore in place needs them free). Opened beneath the sandbox's root
    following no link, like every path the edge resolves in a sandbox."""
    try:
        proc = linux.openat2(root_fd, "proc", os.O_PATH | os.O_DIRECTORY, 0, _RESOLVE_STRICT)
    except OSError:
        return {}
    out = {}
    try:
        for pid in pids:
            try:
                fd = linux.openat2(proc, f"{pid}/cmdline", os.O_RDONLY | os.O_NONBLOCK, 0, _RESOLVE_STRICT)
            except OSError:
                continue
            try:
                raw = os.read(fd, 4096) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            except OSError:
                raw = b""
            finally:
                os.close(fd)
            out[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200] or "?"
    finally:
        os.close(proc)
    return out


def _open_root(container: SandboxHandle) -> int:
    """An O_PATH handle on the sandbox's root directory, in its mount namespace."""
    try:
        return os.open(f"/proc/{container.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise UnsupportedOperation(f"sandbox {container.id} is not running", reason="not_running") from e


def _mnt_id(fdinfo: str) -> int | None:
    try:
        with open(fdinfo) as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _shm_mnt_id() -> int | None:
    """The kernel's internal mount of memfds and SysV shared memory (in no namespace)."""
    fd = os.memfd_create("dsec-probe", os.MFD_CLOEXEC)
    try:
        return _mnt_id(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)


def foreign_holdings(container: SandboxHandle, pids: Sequence[int]) -> list[str]:
    """Every cwd, root or path descriptor of `pids` (host pids of the sandbox's processes)
    on a mount outside the sandbox's mount namespace: a host directory or file, or a
    detached mount of the platform's. Pipes, sockets and anonymous inodes have no path;
    memfds live on the kernel's internal shm mount."""
    with open(f"/proc/{container.pid}/mountinfo") as f:
        allowed = {int(line.split()[0]) for line in f}
    shm = _shm_mnt_id()
    if shm is not None:
        allowed.add(shm)
    bad = []
    for pid in pids:
        links = ["cwd", "root"]
        with contextlib.suppress(OSError):
            links += [f"fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")]
        for link in links:
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if not target.startswith("/"):
                continue
            if link.startswith("fd/"):
                mnt = _mnt_id(f"/proc/{pid}/fdinfo/{link[3:]}")
            else:
                try:
                    fd = os.open(f"/proc/{pid}/{link}", os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    mnt = _mnt_id(f"/proc/self/fdinfo/{fd}")
                finally:
                    os.close(fd)
            if mnt is not None and mnt not in allowed:
                bad.append(f"process {pid} {link} -> {target}")
    return bad


# --- detached mounts ------------------------------------------------------------------

_SYS_OPEN_TREE = 428
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_AT_FDCWD = -100
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def detached_clone(path: Path, *, readonly: bool) -> int:
    """A detached bind mount of `path` (open_tree(OPEN_TREE_CLONE)), nosuid and nodev, as
    a close-on-exec fd. Its root is a mount root with no parent: ``..`` stays there, so
    nothing walked from it reaches the host's tree."""
    fd = int(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(path), _OPEN_TREE_CLONE | os.O_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise InternalError(f"open_tree({path}): {os.strerror(e)}")
    flags = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (_MOUNT_ATTR_RDONLY if readonly else 0)
    attr = _MountAttr(flags, 0, 0, 0)
    size = ctypes.sizeof(attr)
    if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), size) < 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise InternalError(f"mount_setattr({path}): {os.strerror(e)}")
    return fd
