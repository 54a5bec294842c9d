"""Sessions: a bash session (a process per run of the trusted bash, exit status from the
shim's waitpid) and a Python session (a driver per session, per-run pipes)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import signal
import socket
import struct
import time
from dataclasses import dataclass

from dsec.aio import wait_for
from dsec.backends.base import ChannelGroup, SandboxHandle
from dsec.backends.shim import Launch
from dsec.edge.process import PipeReader, Spawned, exit_code, feed_pipe, kill_except, release_group, spawn
from dsec.edge.sessions.bashstate import (
    DUMP_PIPE,
    DUMP_WATCH,
    MAX_DUMP,
    BadDump,
    BashState,
    _prelude,
    parse_dump,
)
from dsec.edge.sessions.pydriver import PY_DRIVER, PY_DRIVER_STREAM
from dsec.edge.sessions.tools import HOST_BASH, TRUSTED_BASH, ansi_c_quote, prepare_tools
from dsec.errors import InternalError, InvalidRequest, SessionNotFound
from dsec.isolation.cgroups import CgroupHost, ExecGroup
from dsec.isolation.procs import fd_ready, sealed_memfd
from dsec.models import SessionKind, SessionResult

# --- the sessions --------------------------------------------------------------------------


@dataclass
class Runner:
    """What every process of a session is started with."""

    handle: SandboxHandle
    cgroups: CgroupHost
    uid: int
    gid: int

    async def spawn(
        self, name: str, argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int]
    ) -> Spawned:
        launch = Launch(argv, env, cwd=cwd, uid=self.uid, gid=self.gid)
        return await spawn(self.handle, self.cgroups, name, launch, stdio=stdio)


def _script_fd(script: bytes) -> int:
    """A sealed memfd holding a run's script: bash reads it from the descriptor itself (never
    through a path such as /dev/fd/3, which the sandbox's root can replace), and closes it
    before the code runs."""
    return sealed_memfd("dsec-session-run", script)


def _host_pid(group: ExecGroup, ns_pid: int) -> int | None:
    """The host pid of the process of `group` whose innermost pid is `ns_pid`."""
    for pid in group.procs():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    if int(line.split()[-1]) == ns_pid:
                        return pid
                    break
    return None


class Session:
    id: str
    kind: SessionKind

    def __init__(self, sid: str, kind: SessionKind, runner: Runner) -> None:
        self.id = sid
        self.kind = kind
        self.runner = runner
        self.lock = asyncio.Lock()
        self.created_at = time.time()
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    async def run(self, code: str, timeout: float, cap: int) -> SessionResult:
        if not self.alive:
            raise SessionNotFound(f"session {self.id} has ended; open a new one")
        async with self.lock:
            if not self.alive:
                raise SessionNotFound(f"session {self.id} has ended; open a new one")
            return await self._run(code, timeout, cap)

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        raise NotImplementedError

    def close(self, *, kill: bool = True) -> None:
        raise NotImplementedError


class _Dump:
    """A run's dump pipe, read once its shell has exited (one read, instead of a wakeup of
    the edge for each builtin the dump runs) or, in a run still going after DUMP_WATCH
    seconds, as it comes (a dump larger than the pipe holds would block the shell)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.reader: PipeReader | None = None
        self.timer = asyncio.get_running_loop().call_later(DUMP_WATCH, self.watch)

    def watch(self) -> PipeReader:
        if self.reader is None:
            self.reader = PipeReader(self.fd, MAX_DUMP)
        return self.reader

    def take(self) -> bytes | None:
        reader = self.watch()
        reader.drain()
        return None if reader.truncated else bytes(reader.buf)

    def close(self) -> None:
        self.timer.cancel()
        if self.reader is not None:
            self.reader.close()
        elif self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


class BashSession(Session):
    def __init__(self, sid: str, runner: Runner, cwd: str, env: dict[str, str]) -> None:
        super().__init__(sid, SessionKind.BASH, runner)
        self.state = BashState.initial(cwd, env)
        self.home_cwd = cwd
        self.groups: list[ExecGroup] = []  # runs' cgroups that may still hold background jobs
        self.dump: bytes | None = None  # the last run's dump, parsed when the next run starts
        self.dumped = b""  # the dump self.state was parsed from
        self._n = 0

    def _take_dump(self) -> None:
        """Take the previous run's dump as the state (or keep the state if it is bad). The
        shell wrote it before it exited, so it is complete or never will be; a dump that is
        the same as the last one is the same state (parsed once)."""
        data, self.dump = self.dump, None
        if data is None or data == self.dumped:
            return
        try:
            st = parse_dump(data)
        except BadDump:
            return
        if st is not None:
            self.state = st
            self.dumped = data

    def _reap_groups(self) -> None:
        keep: list[ExecGroup] = []
        for g in self.groups:
            if isinstance(g, ChannelGroup):  # no host cgroup (gVisor, a VM): only the init can
                keep.append(g)  # tell whether jobs of that run live on; it ends them at close
                continue
            try:
                g.path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                keep.append(g)
        self.groups = keep[-256:]
        for g in keep[:-256]:  # a session that leaves hundreds of jobs behind loses the oldest
            if not isinstance(g, ChannelGroup):  # (one of those is a run, with jobs or not)
                g.kill()
                release_group(g)

    async def _start(self, code: str) -> tuple[Spawned, PipeReader, _Dump]:
        script = self.state.script(code)
        env = self.state.env()
        argv = [TRUSTED_BASH, "--noprofile", "--norc", "-c", _prelude(self.id), "/bin/bash"]
        for cwd in dict.fromkeys([self.state.cwd, self.home_cwd, "/"]):
            code_r = _script_fd(script)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            dump_r, dump_w = os.pipe2(os.O_CLOEXEC)
            with contextlib.suppress(OSError):  # room for the dump of a large state
                fcntl.fcntl(dump_w, fcntl.F_SETPIPE_SZ, DUMP_PIPE)
            self._n += 1
            try:
                proc = await self.runner.spawn(
                    f"dsec-{self.id}-r{self._n}", argv, {**env, "PWD": cwd}, cwd, (code_r, out_w, dump_w)
                )
            except InvalidRequest as e:
                for fd in (out_r, dump_r):
                    os.close(fd)
                if "working directory" in str(e) and cwd != "/":
                    continue  # the directory is gone: start where the session started, or in /
                raise InvalidRequest(
                    f"cannot start the session's shell: {e.message}"
                    + ("" if os.path.exists(HOST_BASH) else "; the edge needs bash-static (install.sh)")
                ) from e
            except BaseException:
                for fd in (out_r, dump_r):
                    os.close(fd)
                raise
            break
        else:  # pragma: no cover - the loop always ends with "/"
            raise InternalError("no directory to start the session's shell in")
        self.groups.append(proc.group)
        return proc, PipeReader(out_r, 0), _Dump(dump_r)

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        t0 = time.perf_counter()
        if "\0" in code:
            raise InvalidRequest("bash session input must not contain NUL bytes")
        self._take_dump()
        self._reap_groups()
        proc, out, dump = await self._start(code)
        out.cap = cap
        loop = asyncio.get_running_loop()
        timed_out = False
        status: int | None = None
        try:
            try:
                status = await wait_for(asyncio.shield(proc.exited), timeout)
            except TimeoutError:
                timed_out = True
                # Kill what the code runs, give the shell a moment to save its state, then all.
                keep = await loop.run_in_executor(None, _host_pid, proc.group, proc.pid)
                await loop.run_in_executor(None, kill_except, proc.group, keep)
                with contextlib.suppress(TimeoutError):
                    status = await wait_for(asyncio.shield(proc.exited), 1.0)
                if status is None:
                    await loop.run_in_executor(None, proc.group.kill)
                    with contextlib.suppress(TimeoutError):
                        status = await wait_for(asyncio.shield(proc.exited), 5.0)
            if not out.eof.done():
                # What the shell wrote is in the pipe; its background jobs may hold the pipe
                # open, so wait for EOF only briefly. Then the pipe is closed: what they
                # write later goes nowhere, never into a later run.
                with contextlib.suppress(TimeoutError):
                    await wait_for(asyncio.shield(out.eof), 0.01)
            out.drain()
            if status is not None:  # the shell wrote its dump before it exited
                self.dump = dump.take()
        finally:
            out.close()
            dump.close()  # what a background job writes into it later goes nowhere
        output = bytes(out.buf)
        rc = exit_code(status) if status is not None else 137
        return SessionResult(
            output=output.decode(errors="replace"),
            exit_code=124 if timed_out else rc,
            duration=time.perf_counter() - t0,
            timed_out=timed_out,
            truncated=out.truncated,
        )

    def close(self, *, kill: bool = True) -> None:
        self.closed = True
        self.dump = None
        if kill:
            for g in self.groups:
                with contextlib.suppress(OSError):
                    g.kill()
                release_group(g)
        self.groups = []


_REPLY_HEAD = 4 + 16 + 4


class _Unused:
    """The stray output of a run over the stream transport: it comes in the reply."""

    buf = b""
    truncated = False

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Stream:
    """A Python session's driver over its stdio, where the sandbox's init carries no
    descriptors (a microVM's agent): runs framed on its stdin, replies on its stdout (see
    dsec.edge.sessions.pydriver). Each run reads its reply through a reader of its own, at
    most its limit: what the driver wrote between runs comes first and breaks that reply (the
    session is reported broken); the guest channel holds at most OUT_CAP of it meanwhile."""

    def __init__(self, requests: int, replies: int) -> None:
        self.requests, self.replies = requests, replies

    def send(
        self, nonce: bytes, cap: int, code: bytes, limit: int
    ) -> tuple[PipeReader, asyncio.Future[None] | None]:
        """Start a run: a reader of its reply, and its request written (at once where the
        pipe holds it all; else by the future returned)."""
        if self.replies < 0:
            raise OSError("the session's driver has ended")
        reply = PipeReader(os.dup(self.replies), limit)
        view = memoryview(b"DSRQ" + nonce + struct.pack("<QI", max(cap, 0), len(code)) + code)
        with contextlib.suppress(BlockingIOError):
            view = view[os.write(self.requests, view) :]
        return reply, asyncio.ensure_future(_write_all(self.requests, bytes(view))) if view else None

    def close(self) -> None:
        for fd in (self.requests, self.replies):
            if fd >= 0:
                os.close(fd)
        self.requests = self.replies = -1


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    with contextlib.suppress(OSError):
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                with fd_ready(fd, write=True) as writable:
                    await writable


class PythonSession(Session):
    def __init__(
        self, sid: str, runner: Runner, proc: Spawned, ctl: socket.socket | None, stream: _Stream | None
    ) -> None:
        super().__init__(sid, SessionKind.PYTHON, runner)
        self.proc = proc
        self.ctl = ctl  # the control socket (an init that passes descriptors), or
        self.stream = stream  # the driver's stdio (one that does not)

    @property
    def alive(self) -> bool:
        return not self.closed and not self.proc.exited.done()

    def _broken(self, why: str) -> SessionNotFound:
        return SessionNotFound(f"session {self.id} {why}; it is closed: open a new one")

    def _send(
        self, nonce: bytes, cap: int, code: bytes
    ) -> tuple[PipeReader, PipeReader | _Unused, asyncio.Future[None] | None]:
        """Hand the run to the driver: (its reply, its stray output, the code's feeder)."""
        fields = 3 if self.stream is None else 4
        # The driver caps each field at `cap` characters (at most 4 bytes each in UTF-8).
        limit = _REPLY_HEAD + 1 + fields * (4 + 4 * max(cap, 1)) + 64
        if self.stream is not None:
            try:
                reply, feeder = self.stream.send(nonce, cap, code, limit)
                return reply, _Unused(), feeder
            except OSError as e:
                raise self._broken("has ended") from e
        assert self.ctl is not None
        code_r, code_w = os.pipe2(os.O_CLOEXEC)
        reply_r, reply_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        msg = nonce + struct.pack("<QI", max(cap, 0), 0)
        try:
            socket.send_fds(self.ctl, [msg], [code_r, reply_w, out_w])
        except OSError as e:
            for fd in (code_w, reply_r, out_r):
                os.close(fd)
            raise self._broken("has ended") from e
        finally:
            for fd in (code_r, reply_w, out_w):
                os.close(fd)
        feeder = asyncio.ensure_future(feed_pipe(code_w, code))
        return PipeReader(reply_r, limit), PipeReader(out_r, cap), feeder

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        t0 = time.perf_counter()
        nonce = secrets.token_bytes(16)
        reply, stray, feeder = self._send(nonce, cap, code.encode(errors="surrogateescape"))

        def done() -> bool:
            n = length_of(reply.buf)
            return reply.truncated or reply.fd < 0 or (n is not None and len(reply.buf) >= n)

        async def wait(t: float) -> bool:
            end = time.monotonic() + t
            while not done():
                reply.changed.clear()
                left = end - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await wait_for(reply.changed.wait(), left)
            return True

        timed_out = False
        try:
            if not await wait(timeout):
                timed_out = True
                self.runner.handle.channel.signal(self.proc.ident, signal.SIGINT)
                if not await wait(2.0):
                    self.closed = True
                    await asyncio.get_running_loop().run_in_executor(None, self.proc.group.kill)
                    raise self._broken("did not answer after its timeout")
            stray.drain()
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()
            data = bytes(reply.buf)
            reply.close()
            stray.close()
        n = length_of(data)
        if (n is None or len(data) < n) and not data and self.proc.exited.done():
            self.close()
            raise self._broken("ended while running the code")
        if n is None or len(data) != n or data[:4] != b"DSEC" or data[4:20] != nonce:
            self.closed = True
            self.close()
            raise self._broken("broke its protocol (its reply was not the driver's)")
        try:
            reply_fields = _parse_reply(data[_REPLY_HEAD:], self.stream is not None)
            failed, truncated, stdout, stderr, error, late = reply_fields
        except ValueError as e:
            self.close()
            raise self._broken("broke its protocol (a malformed reply)") from e
        stderr = (late or stray.buf.decode(errors="replace")) + stderr
        return SessionResult(
            output=stdout[:cap],
            stderr=stderr[:cap],
            error=error if failed else None,
            exit_code=124 if timed_out else (1 if failed else 0),
            duration=time.perf_counter() - t0,
            timed_out=timed_out,
            truncated=truncated or len(stdout) > cap or len(stderr) > cap or stray.truncated,
        )

    def close(self, *, kill: bool = True) -> None:
        self.closed = True
        if self.ctl is not None:
            with contextlib.suppress(OSError):
                self.ctl.close()
        if self.stream is not None:
            self.stream.close()
        if kill:
            with contextlib.suppress(OSError):
                self.proc.group.kill()
            release_group(self.proc.group)


def length_of(data: bytes | bytearray) -> int | None:
    if len(data) < _REPLY_HEAD:
        return None
    return _REPLY_HEAD + int.from_bytes(data[20:24], "little")


def _parse_reply(body: bytes, stream: bool) -> tuple[bool, bool, str, str, str, str]:
    """(failed, truncated, stdout, stderr, error, stray output) of a reply body; the stray
    output and its truncation byte come in it over the stream transport only."""
    if not body:
        raise ValueError("empty")
    flags, pos, out = body[0], 1, []
    for _ in range(4 if stream else 3):
        if pos + 4 > len(body):
            raise ValueError("short")
        n = int.from_bytes(body[pos : pos + 4], "little")
        pos += 4
        if pos + n > len(body):
            raise ValueError("short")
        out.append(body[pos : pos + n].decode(errors="replace"))
        pos += n
    over = False
    if stream:
        if pos >= len(body) or body[pos] > 1:
            raise ValueError("no truncation byte")
        over, pos = body[pos] == 1, pos + 1
    if pos != len(body) or flags & ~3:
        raise ValueError("trailing bytes")
    return bool(flags & 1), bool(flags & 2) or over, out[0], out[1], out[2], out[3] if stream else ""


async def open_session(sid: str, kind: SessionKind, runner: Runner, env: dict[str, str], cwd: str) -> Session:
    """Start a session; a bash session runs once (an empty command) to check that its shell
    starts in `cwd` as its user."""
    if kind is SessionKind.BASH:
        s = BashSession(sid, runner, cwd, env)
        try:
            r = await s.run("", 30.0, 4096)
        except InvalidRequest:
            s.close()
            raise
        if r.exit_code != 0:
            s.close()
            raise InvalidRequest(f"the session's shell did not start: {r.output.strip()[:500]}")
        return s
    if not runner.handle.channel.passes_fds:
        return await _open_stream(sid, runner, env, cwd)
    edge_end, driver_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    nul = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        fd = driver_end.detach()
        proc = await runner.spawn(f"dsec-{sid}", ["python3", "-u", "-c", PY_DRIVER], env, cwd, (fd, nul, nul))
    except BaseException:
        edge_end.close()
        raise
    # The edge only writes to the control socket: whatever the session writes into it is
    # refused (EPIPE) instead of queued.
    with contextlib.suppress(OSError):
        edge_end.shutdown(socket.SHUT_RD)
    edge_end.setblocking(False)
    return PythonSession(sid, runner, proc, edge_end, None)


async def _open_stream(sid: str, runner: Runner, env: dict[str, str], cwd: str) -> PythonSession:
    """A Python session whose driver speaks over its stdio (see _Stream)."""
    req_r, req_w = os.pipe2(os.O_CLOEXEC)
    rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
    nul = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        argv = ["python3", "-u", "-c", PY_DRIVER_STREAM]
        proc = await runner.spawn(f"dsec-{sid}", argv, env, cwd, (req_r, rep_w, nul))
    except BaseException:
        os.close(req_w)
        os.close(rep_r)
        raise
    os.set_blocking(req_w, False)
    return PythonSession(sid, runner, proc, None, _Stream(req_w, rep_r))


def check_kind(kind: str) -> SessionKind:
    try:
        return SessionKind(kind)
    except ValueError as e:
        raise InvalidRequest(f"unknown session kind {kind!r}: use 'bash' or 'python'") from e


__all__ = [
    "BashSession",
    "PythonSession",
    "Runner",
    "Session",
    "ansi_c_quote",
    "check_kind",
    "open_session",
    "prepare_tools",
]
