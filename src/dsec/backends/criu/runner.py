"""Running CRIU in a sandbox's namespaces (a helper process that joins them), and turning
its failures into coded reasons."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from dsec.backends.base import SandboxHandle
from dsec.backends.criu.criu import _NAMESPACES, criu_argv
from dsec.backends.criu.paths import detached_clone
from dsec.errors import UnsupportedOperation
from dsec.isolation.procs import run_process_quick

# --- running CRIU in a sandbox's namespaces ----------------------------------------------

# argv[1]: JSON {ns: {name: fd}, user: fd | null, cgroups: [path], last_pid: fd | null,
# min_pid: int, exe: [argv with @IMG@], img: fd}. Kept small: started with -S -I.
_HELPER = r"""
import ctypes, json, os, sys
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def setns(fd, what):
    if libc.setns(fd, 0) != 0:
        e = ctypes.get_errno()
        sys.exit(f"dsec-criu-helper: setns {what}: {os.strerror(e)}")
    os.close(fd)
for p in a["cgroups"]:
    with open(p, "w") as f:
        f.write("0")
for name, fd in a["ns"].items():
    setns(fd, name)
if a["user"] is not None:
    setns(a["user"], "user")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    try:
        os.setgroups([])
    except OSError:
        pass
if a["last_pid"] is not None:
    # In the pid namespace: move its cursor past every pid the images need.
    # Best effort (a write here has been seen to fail with EINVAL once in a while): without
    # it CRIU still gets its pids unless another process took one, which it then reports.
    for attempt in range(3):
        pid = os.fork()
        if pid == 0:
            fd = a["last_pid"]
            try:
                cur = int(os.pread(fd, 32, 0) or b"0")
                if cur < a["min_pid"]:
                    os.pwrite(fd, str(a["min_pid"]).encode(), 0)
            except OSError:
                os._exit(1)
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        if st == 0:
            break
    os.close(a["last_pid"])
pid = os.fork()
if pid == 0:
    os.setsid()
    img = f"/proc/self/fd/{a['img']}"
    argv = [x.replace("@IMG@", img) for x in a["exe"]]
    os.execv(argv[0], argv)
_, st = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(st))
"""


# At most this much of a run's output is read back: CRIU's errors come first, and a restored
# process that got hold of the log (CRIU's stdout, through a swapped path) may grow it.
LOG_LIMIT = 256 << 10


async def _run_criu(
    container: SandboxHandle,
    criu: Path,
    images: Path,
    args: list[str],
    *,
    as_userns_root: bool,
    cgroups: Sequence[Path] = (),
    min_pid: int | None = None,
) -> tuple[int, str]:
    """Run `criu ARGS` in the sandbox's namespaces; CRIU's exit code and its log.

    ``@IMG@`` in ARGS names the images directory (read-only for a restore). CRIU reaches its
    tree and the images only through detached mounts (see detached_clone) and logs to its
    stdout (``-o -``): the helper's and CRIU's output go to a memfd, so the edge opens no
    file by name where CRIU, or a process it restores, could write."""
    if not container.alive():
        raise UnsupportedOperation(f"sandbox {container.id} is not running", reason="not_running")
    fds: list[int] = []

    def keep(fd: int) -> int:
        fds.append(fd)
        os.set_inheritable(fd, True)
        return fd

    try:
        ns = {n: keep(os.open(f"/proc/{container.pid}/ns/{n}", os.O_RDONLY)) for n in _NAMESPACES}
        user = keep(os.open(f"/proc/{container.pid}/ns/user", os.O_RDONLY)) if as_userns_root else None
        if not container.alive():  # the pid could have been reused between the check and the opens
            raise UnsupportedOperation(f"sandbox {container.id} is not running", reason="not_running")
        root = keep(detached_clone(criu, readonly=True))
        img = keep(detached_clone(images, readonly=as_userns_root))
        last = keep(os.open("/proc/sys/kernel/ns_last_pid", os.O_RDWR)) if min_pid is not None else None
        spec = {
            "ns": ns,
            "user": user,
            "cgroups": [str(p) for p in cgroups],
            "last_pid": last,
            "min_pid": min_pid or 0,
            "img": img,
            "exe": criu_argv(f"/proc/self/fd/{root}", *args, "-o", "-"),
        }
        argv = [sys.executable, "-S", "-I", "-c", _HELPER, json.dumps(spec)]
        log = os.memfd_create("dsec-criu-log", os.MFD_CLOEXEC)  # no host file in CRIU's fd table
        try:
            rc = await run_process_quick(argv, log, fds)
            text = os.pread(log, LOG_LIMIT, 0).decode(errors="replace")
        finally:
            os.close(log)
        return rc, text
    finally:
        for fd in fds:
            os.close(fd)


_REASONS = [
    (
        r"Connected TCP socket|TCP connection|tcp-established",
        "tcp_connection",
        "a process has an established TCP connection; close it before the checkpoint",
    ),
    (
        r"[Uu]nix socket|unix-sk|ext-unix-sk|external socket",
        "external_socket",
        "a process holds a Unix socket connected outside the dumped processes",
    ),
    (
        r"bad size|has bad mode|Can't open file",
        "file_changed",
        "a file the processes hold changed or vanished since the checkpoint; restore into a new sandbox",
    ),
    (
        r"Can't fork for \d+.*File exists|pid .* busy",
        "pid_in_use",
        "a pid the checkpointed processes need is taken in the target sandbox",
    ),
    (
        r"inotify|fanotify|perf_event|bpf|io_uring|userfaultfd|vfio|Can't dump.*tty|tty",
        "unsupported_resource",
        "a process holds a kernel object CRIU cannot checkpoint",
    ),
]


def _criu_error(log: str, what: str, sandbox: str) -> UnsupportedOperation:
    """The coded refusal for a failed CRIU run, from its log (see _run_criu)."""
    lines = [ln for ln in log.splitlines() if "Error" in ln or "dsec-criu-helper" in ln]
    # Noise of CRIU's probes in a sandbox, and the generic last words.
    noise = r"tun\.c|RLIMIT_NOFILE|cgroupd|kerndat|FAILED|killed by signal|Unable to detach"
    errs = [ln.split("): ", 1)[-1].strip() for ln in lines if not re.search(noise, ln)]
    detail = "; ".join(dict.fromkeys(errs[:3])) or "no error in the log"
    for pattern, reason, why in _REASONS:
        if any(re.search(pattern, e) for e in errs):
            return UnsupportedOperation(
                f"cannot {what} sandbox {sandbox}: {why} (CRIU: {detail}). "
                "Use pause() to keep the processes in memory, or snapshot()/fork() to keep only the files",
                reason=reason,
            )
    return UnsupportedOperation(
        f"cannot {what} sandbox {sandbox}: CRIU failed ({detail}). "
        "Use pause() to keep the processes in memory, or snapshot()/fork() to keep only the files",
        reason="criu_failed",
    )
