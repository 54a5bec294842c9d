"""Running one process in a sandbox: pipes, caps, timeouts, process-tree kill."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from dsec.aio import wait_for
from dsec.backends.base import SandboxHandle
from dsec.backends.shim import Launch
from dsec.errors import InternalError, InvalidRequest, QuotaExceeded
from dsec.isolation.cgroups import CgroupHost, ExecGroup, keyed_value, sigkill_each
from dsec.isolation.procs import fd_ready
from dsec.models import ExecResult

if TYPE_CHECKING:
    from dsec.edge.outputs import Hold


class Valve(Protocol):
    """Room to keep more output: a call's budget (dsec.edge.outputs.Hold), a stream's flow."""

    def room(self) -> int: ...
    def when_room(self, wake: Callable[[], None]) -> None: ...


class PipeReader:
    """Collects a non-blocking pipe into a buffer capped at `cap` bytes. Bytes kept are
    charged to `hold`; with no room in it or in `flow` the pipe is not read (the writer
    blocks once it is full) until room comes back. Past the cap nothing is kept or waited for."""

    def __init__(
        self,
        fd: int,
        cap: int,
        on_cap: Callable[[], None] | None = None,
        sink: Callable[[bytes], None] | None = None,
        *,
        hold: Hold | None = None,
        flow: Valve | None = None,
    ) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.cap = cap
        self.buf = bytearray()
        self.truncated = False
        self.total = 0
        # With tail_cap > 0, the last tail_cap bytes past the cap are kept (a session's end
        # marker must be found even after a flood that was cut).
        self.tail_cap = 0
        self.tail = b""
        self.eof = asyncio.get_running_loop().create_future()
        self.changed = asyncio.Event()
        self.paused = False
        self._on_cap = on_cap
        self._sink = sink
        self._hold = hold
        self._valves: tuple[Valve, ...] = tuple(v for v in (hold, flow) if v is not None)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._read)

    def _room(self) -> int:
        return min(v.room() for v in self._valves) if self._valves else 65536

    def _read(self, force: bool = False) -> None:
        while True:
            want = 65536
            if len(self.buf) < self.cap and not force:
                want = min(want, self._room())
                if want <= 0:
                    self._pause()
                    break
            try:
                chunk = os.read(self.fd, want)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                break
            self.total += len(chunk)
            room = self.cap - len(self.buf)
            if self._hold is not None and room > 0:
                self._hold.take(min(room, len(chunk)))
            if self._sink is not None and room > 0:
                self._sink(chunk[:room])
            if len(chunk) > room:
                self.buf += chunk[: max(room, 0)]
                if self.tail_cap:
                    self.tail = (self.tail + chunk[max(room, 0) :])[-self.tail_cap :]
                if not self.truncated:
                    self.truncated = True
                    if self._on_cap is not None:
                        self._on_cap()
            else:
                self.buf += chunk
        self.changed.set()

    def _pause(self) -> None:
        if not self.paused:
            self.paused = True
            self._loop.remove_reader(self.fd)
        for valve in self._valves:
            valve.when_room(self._wake)

    def _wake(self) -> None:
        if self.paused and self.fd >= 0:
            if self._room() <= 0:
                self._pause()
                return
            self.paused = False
            self._loop.add_reader(self.fd, self._read)

    def drain(self) -> None:
        """Read what is in the pipe now, room or not (after the writer's end: at most the
        pipe's capacity)."""
        if self.fd >= 0:
            self._read(force=True)

    def close(self) -> None:
        if self.fd < 0:
            return
        if not self.paused:
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1
        # no cycle back through the callbacks (Outputs.settle): freed the moment it is dropped,
        # not at the next collection, with whatever its buffer holds
        self._on_cap = self._sink = None
        self._hold, self._valves = None, ()
        if not self.eof.done():
            self.eof.set_result(None)
        self.changed.set()


class Capture:
    """What else a call's output meets besides its buffers (see PipeReader): its budget
    `hold`, a stream's `flow`, and `sink`, given each piece kept as it comes. It is passed
    where a sink is, and is one."""

    __slots__ = ("flow", "hold", "sink")

    def __init__(
        self,
        hold: Hold | None = None,
        sink: Callable[[str, bytes], None] | None = None,
        flow: Valve | None = None,
    ) -> None:
        self.hold = hold
        self.sink = sink
        self.flow = flow

    def __call__(self, kind: str, chunk: bytes) -> None:
        if self.sink is not None:
            self.sink(kind, chunk)


class Outputs:
    """A command's stdout and stderr, each read into a buffer capped at `cap` (`sink`: each
    piece kept, as it comes; a `Capture` brings its hold and flow too), and the one future that
    settles the wait for the command: either buffer reaching its cap, and, while `watching`,
    its exit or the timeout."""

    def __init__(self, out_r: int, err_r: int, cap: int, sink: Callable[[str, bytes], None] | None) -> None:
        hold: Hold | None = None
        flow: Valve | None = None
        if isinstance(sink, Capture):
            hold, flow, sink = sink.hold, sink.flow, sink.sink
        self.settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.out = PipeReader(
            out_r, cap, self.settle, (lambda b: sink("stdout", b)) if sink else None, hold=hold, flow=flow
        )
        self.err = PipeReader(
            err_r, cap, self.settle, (lambda b: sink("stderr", b)) if sink else None, hold=hold, flow=flow
        )

    def settle(self, _: object = None) -> None:
        if not self.settled.done():
            self.settled.set_result(None)

    @property
    def truncated(self) -> bool:
        return self.out.truncated or self.err.truncated

    @contextlib.contextmanager
    def watching(
        self, exited: asyncio.Future[Any], timeout: float, in_w: int, stdin: bytes | None
    ) -> Iterator[None]:
        """While the block runs, `exited` done or `timeout` seconds passed settle the wait,
        and `stdin` is fed into `in_w` (if any: -1 for none)."""
        exited.add_done_callback(self.settle)
        timer = asyncio.get_running_loop().call_later(timeout, self.settle)
        feeder = asyncio.ensure_future(feed_pipe(in_w, stdin or b"")) if in_w >= 0 else None
        try:
            yield
        finally:
            timer.cancel()
            exited.remove_done_callback(self.settle)
            if feeder is not None:
                feeder.cancel()

    def drain(self) -> None:
        self.out.drain()
        self.err.drain()

    def close(self) -> None:
        self.out.close()
        self.err.close()


def exit_code(status: int) -> int:
    """A shell-style exit code: the exit status, or 128 + the signal number."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@dataclass
class RawResult:
    # The readers' own buffers, never copied: bytearrays, which every reader of a result
    # uses as bytes (decode, split, slices, len).
    stdout: bytes
    stderr: bytes
    exit_code: int
    duration: float
    truncated: bool
    timed_out: bool
    pids_limit_hits: int = 0  # forks refused in this call's cgroup

    def to_exec_result(self) -> ExecResult:
        return self.meta(self.stdout.decode(errors="replace"), self.stderr.decode(errors="replace"))

    def meta(self, stdout: str = "", stderr: str = "") -> ExecResult:
        """The ExecResult, without the output unless given (it stays bytes: dsec.edge.outputs)."""
        return ExecResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=self.exit_code,
            duration=self.duration,
            truncated=self.truncated,
            timed_out=self.timed_out,
        )


@dataclass
class Spawned:
    ident: int
    pid: int
    exited: asyncio.Future[int]
    group: ExecGroup


async def spawn(
    container: SandboxHandle,
    cgroups: CgroupHost,
    group_name: str,
    launch: Launch,
    *,
    stdio: tuple[int, int, int],
) -> Spawned:
    """Start `launch` in its own cgroup under the sandbox's; closes the stdio fds given."""
    try:
        group = container.exec_group(cgroups, group_name)
    except OSError as e:
        for fd in set(stdio):
            os.close(fd)
        raise InternalError(f"cannot create an exec cgroup: {e}") from e
    try:
        cgroup_fds = group.fds()  # (v1: the user's freezer group too: see CgroupHost.freeze_user)
        ident, pid, exited = await container.channel.spawn(launch, stdio=stdio, cgroup_fds=cgroup_fds)
        group.bind(ident)
    except OSError as e:
        group.remove()
        if e.errno == errno.ENOENT:
            raise InvalidRequest(
                f"cannot run {launch.argv[0]!r}: no such program or working directory "
                f"{launch.cwd!r} in the sandbox"
            ) from e
        if e.errno == errno.ENOTDIR:
            raise InvalidRequest(
                f"cannot run {launch.argv[0]!r}: the working directory {launch.cwd!r} (or a parent of "
                "it, or of the program's path) is not a directory in the sandbox; give a directory as cwd"
            ) from e
        if e.errno in (errno.EACCES, errno.ENOEXEC):
            raise InvalidRequest(f"cannot run {launch.argv[0]!r}: {e.strerror}") from e
        if e.errno == errno.EAGAIN:
            raise QuotaExceeded(
                "the sandbox is at its pids limit (something inside keeps forking); "
                "kill those processes or stop the sandbox"
            ) from e
        raise InternalError(f"starting {launch.argv[0]!r} failed: {e.strerror}") from e
    except BaseException:
        group.remove()
        raise
    finally:
        for fd in set(stdio):
            os.close(fd)
    group.close_fd()
    return Spawned(ident, pid, exited, group)


def release_group(group: ExecGroup) -> None:
    """Remove an exec cgroup unless background processes still live in it."""
    with contextlib.suppress(OSError):
        group.path.rmdir()


async def run_process(
    container: SandboxHandle,
    cgroups: CgroupHost,
    group_name: str,
    launch: Launch,
    *,
    stdin: bytes | None,
    timeout: float,
    cap: int,
    sink: Callable[[str, bytes], None] | None = None,
) -> RawResult:
    t0 = time.perf_counter()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    if stdin:
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
    else:  # nothing to feed: /dev/null, as a runtime gives a detached process (no pipe, no task)
        in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
    loop = asyncio.get_running_loop()
    try:
        proc = await spawn(container, cgroups, group_name, launch, stdio=(in_r, out_w, err_w))
    except BaseException:
        for fd in (in_w, out_r, err_r):
            if fd >= 0:
                os.close(fd)
        raise
    outputs = Outputs(out_r, err_r, cap, sink)
    out, err = outputs.out, outputs.err
    timed_out = False
    status: int | None = None
    try:
        with outputs.watching(proc.exited, timeout, in_w, stdin):
            await outputs.settled
            if not proc.exited.done():
                timed_out = not outputs.truncated
                await loop.run_in_executor(None, proc.group.kill)
                with contextlib.suppress(TimeoutError):
                    status = await wait_for(asyncio.shield(proc.exited), 5.0)
            else:
                status = proc.exited.result()
                if not (out.eof.done() and err.eof.done()):
                    # Output already written sits in the pipes; background children may keep
                    # them open, so wait for EOF only briefly.
                    with contextlib.suppress(TimeoutError):
                        await wait_for(asyncio.gather(out.eof, err.eof), 0.01)
            outputs.drain()
    finally:
        outputs.close()
        code = exit_code(status) if status is not None else 137
        # A refused fork is counted in the cgroup of the task that tried (v1), which goes now;
        # read whatever the exit status (a program may catch EAGAIN from fork and exit 0).
        refused = keyed_value(proc.group.path / "pids.events", "max")
        release_group(proc.group)
    return RawResult(
        stdout=cast(bytes, out.buf),
        stderr=cast(bytes, err.buf),
        exit_code=code,
        duration=time.perf_counter() - t0,
        truncated=outputs.truncated,
        timed_out=timed_out,
        pids_limit_hits=refused,
    )


async def feed_pipe(fd: int, data: bytes) -> None:
    """Write `data` to a pipe (a child's stdin) without blocking the loop, then close it (EOF)."""
    try:
        if data:
            os.set_blocking(fd, False)
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                except BlockingIOError:
                    with fd_ready(fd, write=True) as writable:
                        await writable
                except BrokenPipeError:
                    break
    finally:
        os.close(fd)


def kill_except(group: ExecGroup, keep_pid: int | None) -> None:
    """SIGKILL every process of a cgroup but `keep_pid` (a session run's shell), if any."""
    for _ in range(50):
        victims = [p for p in group.procs() if p != keep_pid]
        if not victims:
            return
        sigkill_each(victims)
        time.sleep(0.002)
