"""Thin ctypes wrappers for the Linux syscalls Python's os module lacks."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

# Same numbers on x86_64 and the generic table (aarch64) for these new calls.
SYS_PIDFD_GETFD = 438
SYS_OPENAT2 = 437
if platform.machine() not in ("x86_64", "aarch64"):
    raise ImportError(f"dsec supports x86_64 and aarch64 hosts, not {platform.machine()}")

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MNT_DETACH = 2

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode(), target.encode(), fstype.encode(), flags, data.encode() if data else None
        ),
        f"mount {fstype} on {target}",
    )


def umount(target: str, detach: bool = False) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH if detach else 0), f"umount {target}")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): open `path` relative to `dirfd` under the `resolve` rules."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    while True:
        ret = _libc.syscall(SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
        if ret >= 0:
            return int(ret)
        err = ctypes.get_errno()
        if err not in (11, 4):  # EAGAIN (a rename raced the lookup), EINTR: retry
            raise OSError(err, os.strerror(err), path)


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants (sandbox inits, once the runtime exits) become our children."""
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def pidfd_getfd(pidfd: int, targetfd: int) -> int:
    """Duplicate file descriptor `targetfd` of the process behind `pidfd` into ours."""
    return _check(int(_libc.syscall(SYS_PIDFD_GETFD, pidfd, targetfd, 0)), "pidfd_getfd")


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, to tell a process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19])
