"""Helper processes and mounts of the host: started without a fork of this (large) process,
awaited through pidfds on the event loop, and the runtime's strays reaped.

Shared by every backend and by the edge's own helpers (copies, trusted execs, CRIU)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from dsec.isolation import linux

# Children this process waits for by pid (helpers being awaited, sandbox inits); any other
# child that exits is a stray: crun's intermediate processes, which the edge inherits as a
# child subreaper when their parents exit, and which nobody else would ever reap.
_awaited: set[int] = set()


def children_of(pid: int) -> set[int]:
    """The child processes of `pid` (of every one of its threads)."""
    kids: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(int(x) for x in f.read().split())
    return kids


def reap_strays(comms: frozenset[str] = frozenset({"crun", "runc"})) -> int:
    """Reap exited runtime processes nobody waits for; how many. Only zombies whose command
    is the runtime's are taken: other children (subprocess.run in a worker thread, say) are
    waited for by their owners, who must get their exit status."""
    n = 0
    for pid in children_of(os.getpid()) - _awaited:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, _, rest = stat.partition("(")[2].rpartition(")")
        if rest.split()[:1] != ["Z"] or comm not in comms:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                n += 1
    return n


def sealed_memfd(name: str, data: bytes) -> int:
    """A memfd holding `data`, sealed (nothing can change it), read from its start: how a
    helper gets what no path or /proc entry may show (a session run's script, a trusted
    exec's options)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def spawn_quick(
    argv: Sequence[str],
    out_fd: int,
    err_fd: int,
    inherit: Sequence[int] = (),
    *,
    stdin_fd: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """Start a helper program (with this process's environment, or `env`); its (pid, pidfd).

    posix_spawn (vfork under glibc) and a pidfd watched by the event loop: no
    fork of this large process and no child-watcher thread per process, which
    cost several ms per sandbox start under load (and more under uvloop).
    """
    # No stdin is an empty pipe, never the host's /dev/null: the OCI runtime chowns the
    # container process's stdio to the sandbox's root, and would so hand it the host's
    # /dev/null (chmod 000 from inside would then break every host program).
    empty = None
    if stdin_fd is None:
        empty = os.pipe2(os.O_CLOEXEC)
        os.close(empty[1])
        stdin_fd = empty[0]
    for fd in inherit:
        os.set_inheritable(fd, True)
    try:
        pid = os.posix_spawnp(
            argv[0],
            list(argv),
            os.environ if env is None else env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                (os.POSIX_SPAWN_DUP2, out_fd, 1),
                (os.POSIX_SPAWN_DUP2, err_fd, 2),
            ],
        )
    finally:
        for fd in inherit:
            os.set_inheritable(fd, False)
        if empty is not None:
            os.close(empty[0])
    _awaited.add(pid)
    return pid, os.pidfd_open(pid)


async def wait_quick(pid: int, pidfd: int) -> int:
    """Wait for a process started by spawn_quick (closes its pidfd); its exit code."""
    try:
        with fd_ready(pidfd) as exited:
            await exited
    finally:
        os.close(pidfd)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        _awaited.discard(pid)


async def run_process_quick(
    argv: Sequence[str], log_fd: int, inherit: Sequence[int] = (), *, grace_s: float = 5.0
) -> int:
    """Run a helper program with stdout and stderr on `log_fd` and wait for it; its exit code.

    Cancelled, it still waits for the helper to end (`grace_s`, then kills it) and reaps it
    before the cancellation goes on: a helper left running raced the cleanup that follows
    (`crun delete` while `crun run` still ran) and stayed a zombie of this process."""
    pid, pidfd = spawn_quick(argv, log_fd, log_fd, inherit)
    waiting = asyncio.ensure_future(wait_quick(pid, pidfd))
    waiting.add_done_callback(_retrieved)  # a second cancellation leaves it to reap alone
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        _, pending = await asyncio.wait({waiting}, timeout=grace_s)
        if pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await asyncio.wait({waiting})
        raise


def _retrieved(fut: asyncio.Future[int]) -> None:
    if not fut.cancelled():
        fut.exception()


def resolve_once(fut: asyncio.Future[None]) -> None:
    """Event-loop callback: mark `fut` done unless it already is."""
    if not fut.done():
        fut.set_result(None)


@contextlib.contextmanager
def fd_ready(fd: int, *, write: bool = False) -> Iterator[asyncio.Future[None]]:
    """A future of the event loop done once `fd` is readable (with `write`: writable), watched
    while the block runs."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    if write:
        loop.add_writer(fd, resolve_once, ready)
    else:
        loop.add_reader(fd, resolve_once, ready)
    try:
        yield ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def mounts_under(prefix: Path) -> list[str]:
    out = []
    p = str(prefix).rstrip("/") + "/"
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target.startswith(p):
                out.append(target)
    return out


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest mount point prefix)."""
    p = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            target = fields[1].replace("\\040", " ")
            inside = p == target or p.startswith(target.rstrip("/") + "/")
            if inside and len(target) >= len(best):
                best, kind = target, fields[2]
    return kind


def unmount_all(target: Path) -> None:
    """Unmount `target` (stacked mounts included); ignore it if nothing is mounted."""
    for _ in range(8):
        try:
            linux.umount(str(target))
        except OSError as e:
            if e.errno in (22, 2):  # EINVAL: not a mount point; ENOENT
                return
            if e.errno == 16:  # EBUSY: still referenced somewhere; detach lazily
                linux.umount(str(target), detach=True)
            else:
                raise
