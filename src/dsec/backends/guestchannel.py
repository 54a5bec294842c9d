"""The edge's end of a microVM guest agent's port: the shim's protocol, framed on a stream.

A guest agent (dsec-guest.c) cannot take descriptors: the virtio-serial port is a byte
stream. So this channel keeps the stdio descriptors `spawn` is given and carries their bytes
in frames (u8 type, u32 id, u32 len, payload): stdin is read here and sent as 'I', stdout
and stderr come back as 'O' and 'E' and are written into the descriptors. The exit of a
process is reported only once its output has been written and its pipes closed, so a
reader sees what it would see from a container: the output, EOF, then the exit status.
The rest is ShimChannel's interface (spawn, signal, ping, close), so the edge's exec path
does not know which one it drives.

Output a reader does not take is held up to OUT_CAP bytes per stream and then dropped (the
edge caps what it keeps of an exec's output far below that); the guest stops reading its
processes' pipes when the port backs up, so nothing inside can make the edge hold more.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import socket
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.aio import wait_for
from dsec.backends.shim import Launch, ShimChannel, launch_strings
from dsec.errors import CapacityExhausted, InternalError, InvalidRequest

_FRAME = struct.Struct("<cII")
_SPAWN = struct.Struct("<iiHHB")
_EXIT = struct.Struct("<iIQQ")  # status, disk full, disk bytes used, disk inodes used
OUT_CAP = 16 << 20
SEND_CAP = 64 << 20
MAX_FRAME = 1 << 20  # the agent sends at most 32 KiB of output per frame
STDIN_HIGH = 1 << 20  # stop reading stdin pipes while this much waits for the guest


@dataclass
class _Stream:
    fd: int
    buf: bytearray = field(default_factory=bytearray)
    eof: bool = False  # the guest said the stream ended: close once buf is written
    writer: bool = False  # a writer callback is registered
    limit: int | None = None  # bytes the stream may carry in all (an archive's); past it: killed
    taken: int = 0
    over: bool = False


@dataclass
class _Proc:
    stdin: int  # -1 once sent in full
    out: _Stream
    err: _Stream
    status: int | None = None
    stdin_file: bool = False  # stdin is a regular file (a session's script): read, not watched


class GuestChannel(ShimChannel):
    """The shim protocol over a connected stream socket to a guest agent."""

    passes_fds = False  # stdio is carried as bytes: a descriptor's other properties stay here

    def __init__(self, sock: socket.socket) -> None:  # no super(): another framing
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        # (ids a guest restored from a checkpoint may still run its old processes under are
        # unlikely to come up again)
        self._next = (1 << 20) + secrets.randbelow(1 << 30)
        self._over: dict[int, bool] = {}  # archives cut off at their limit
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._procs: dict[int, _Proc] = {}
        self._rbuf = bytearray()
        self._wbuf = bytearray()
        self._writing = False
        self._stalled: set[int] = set()  # stdin readers paused while the guest is behind
        self.hello: asyncio.Future[None] = self._loop.create_future()
        self._setup: asyncio.Future[int] | None = None
        self._quiesced: asyncio.Future[int] | None = None
        self._resumed: asyncio.Future[int] | None = None
        self._killed: asyncio.Future[int] | None = None
        self.closed = False
        self.disk = (0, 0, False)  # (bytes, inodes) used on the guest's writable disk, and full
        self._loop.add_reader(sock.fileno(), self._on_readable)

    # --- frames ---------------------------------------------------------------------

    def _frame(self, kind: bytes, ident: int, body: bytes = b"") -> None:
        if self.closed:
            raise InternalError("the sandbox's control channel is closed")
        if len(self._wbuf) > SEND_CAP:
            raise CapacityExhausted("the sandbox's control channel is congested; retry")
        self._wbuf += _FRAME.pack(kind, ident, len(body)) + body
        self._flush()

    def _flush(self) -> None:
        while self._wbuf:
            try:
                n = self.sock.send(self._wbuf)
            except BlockingIOError:
                break
            except OSError:
                self.close()
                return
            del self._wbuf[:n]
        if len(self._wbuf) < STDIN_HIGH // 4 and self._stalled:
            for ident in self._stalled:
                proc = self._procs.get(ident)
                if proc is not None and proc.stdin >= 0:
                    if proc.stdin_file:
                        self._loop.call_soon(self._pump_stdin, ident)
                    else:
                        self._loop.add_reader(proc.stdin, self._pump_stdin, ident)
            self._stalled.clear()
        if self._wbuf and not self._writing:
            self._loop.add_writer(self.sock.fileno(), self._flush)
            self._writing = True
        elif not self._wbuf and self._writing:
            self._loop.remove_writer(self.sock.fileno())
            self._writing = False

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 18)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self._rbuf += data
        off = 0
        while len(self._rbuf) - off >= _FRAME.size:
            kind, ident, n = _FRAME.unpack_from(self._rbuf, off)
            if n > MAX_FRAME:
                # Not what the agent sends: the guest is not ours any more. Holding a frame
                # it says is this large would let it fill the edge's memory.
                self.close()
                return
            if len(self._rbuf) - off - _FRAME.size < n:
                break
            body = bytes(self._rbuf[off + _FRAME.size : off + _FRAME.size + n])
            off += _FRAME.size + n
            self._dispatch(kind, ident, body)
        del self._rbuf[:off]

    def _dispatch(self, kind: bytes, ident: int, body: bytes) -> None:
        value = struct.unpack_from("<i", body)[0] if len(body) >= 4 else 0
        if kind in (b"H", b"m", b"q", b"z", b"u"):
            self._answer(kind, value)
        elif kind in (b"O", b"E"):
            proc = self._procs.get(ident)
            if proc is not None:
                self._output(ident, proc.out if kind == b"O" else proc.err, body)
        elif kind == b"X":  # reported once its output is written and its pipes closed
            if len(body) >= _EXIT.size:  # the guest's writable disk, as of this exit
                _, full, used, inodes = _EXIT.unpack_from(body)
                self.disk = (used, inodes, bool(full))
            proc = self._procs.get(ident)
            if proc is not None:
                proc.status = value
                self._maybe_exited(ident)
        else:  # R, F, p: as from a container's init
            if kind == b"F":
                self._drop(ident)
            self._reply(kind, ident, value)

    def _answer(self, kind: bytes, value: int) -> None:
        if kind == b"H":
            if not self.hello.done():
                self.hello.set_result(None)
            return
        waiting = {b"m": self._setup, b"q": self._quiesced, b"z": self._resumed, b"u": self._killed}[kind]
        if waiting is not None and not waiting.done():
            waiting.set_result(value)

    # --- stdio ----------------------------------------------------------------------

    def _output(self, ident: int, s: _Stream, data: bytes) -> None:
        if s.fd < 0:
            return
        if not data:
            s.eof = True
        elif s.limit is not None:  # everything or nothing: an archive is not cut short quietly
            s.taken += len(data)
            if s.taken > s.limit:
                if not s.over:
                    s.over = True
                    self.signal(ident, 9)
            else:
                s.buf += data
        elif len(s.buf) < OUT_CAP:
            s.buf += data
        self._write_stream(ident, s)

    def _write_stream(self, ident: int, s: _Stream) -> None:
        while s.buf and s.fd >= 0:
            try:
                n = os.write(s.fd, s.buf)
            except BlockingIOError:
                if not s.writer:
                    self._loop.add_writer(s.fd, self._write_stream, ident, s)
                    s.writer = True
                return
            except OSError:  # the reader went away: nothing more to deliver
                s.buf.clear()
                s.eof = True
                break
            del s.buf[:n]
        if s.writer:
            self._loop.remove_writer(s.fd)
            s.writer = False
        if s.eof and s.fd >= 0:
            os.close(s.fd)
            s.fd = -1
            self._maybe_exited(ident)

    def _maybe_exited(self, ident: int) -> None:
        proc = self._procs.get(ident)
        if proc is None or proc.status is None or proc.out.fd >= 0 or proc.err.fd >= 0:
            return
        self._drop(ident)
        fut = self._exited.pop(ident, None)
        if fut and not fut.done():
            fut.set_result(proc.status)

    def _pump_stdin(self, ident: int) -> None:
        """Send what the process's stdin holds while the guest keeps up: a pipe's ready bytes
        (called when it is readable), or a regular file (a memfd: epoll watches no files)
        from its offset to its end; at the end, an empty frame."""
        proc = self._procs.get(ident)
        while proc is not None and proc.stdin >= 0:
            if len(self._wbuf) > STDIN_HIGH:  # the guest reads slowly: wait for it (see _flush)
                if not proc.stdin_file:
                    self._loop.remove_reader(proc.stdin)
                self._stalled.add(ident)
                return
            try:
                data = os.read(proc.stdin, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            with contextlib.suppress(InternalError, CapacityExhausted):
                self._frame(b"I", ident, data)
            if not data:
                self._close_stdin(proc)
            elif not proc.stdin_file:
                return  # (a pipe: again once it is readable)

    def _close_stdin(self, proc: _Proc) -> None:
        if proc.stdin >= 0:
            if not proc.stdin_file:
                with contextlib.suppress(ValueError, OSError):
                    self._loop.remove_reader(proc.stdin)
            os.close(proc.stdin)
            proc.stdin = -1

    def _drop(self, ident: int) -> None:
        proc = self._procs.pop(ident, None)
        if proc is None:
            return
        if proc.out.over:
            self._over[ident] = True
        self._close_stdin(proc)
        for s in (proc.out, proc.err):
            if s.writer:
                self._loop.remove_writer(s.fd)
            if s.fd >= 0:
                os.close(s.fd)
                s.fd = -1

    # --- the ShimChannel interface ----------------------------------------------------

    async def setup(self, body: bytes, timeout: float = 60.0) -> None:
        """Send the guest's setup ('M') and wait for its answer."""
        self._setup = self._loop.create_future()
        self._frame(b"M", 0, body)
        err = await wait_for(self._setup, timeout)
        if err:
            raise InternalError(f"the guest could not set up the sandbox: {os.strerror(err)}")

    async def quiesce(self, freeze: bool, timeout: float = 60.0) -> None:
        """Have the guest flush its writable disk and hold its writers (or let them go)."""
        self._quiesced = self._loop.create_future()
        self._frame(b"Q", 0, b"\x01" if freeze else b"\x00")
        err = await wait_for(self._quiesced, timeout)
        if err:
            raise InternalError(
                f"the guest could not {'freeze' if freeze else 'thaw'} its disk: {os.strerror(err)}"
            )

    async def _ask(self, kind: bytes, body: bytes, what: str, timeout: float) -> None:
        fut: asyncio.Future[int] = self._loop.create_future()
        if kind == b"Z":
            self._resumed = fut
        else:
            self._killed = fut
        self._frame(kind, 0, body)
        err = await wait_for(fut, timeout)
        if err:
            raise InternalError(f"the guest could not {what}: {os.strerror(err)}")

    async def resumed(self, body: bytes, timeout: float = 30.0) -> None:
        """Tell a guest restored from a memory checkpoint: fresh entropy, the clock and its
        name ('Z'); what ran for the old host loses its stdio."""
        await self._ask(b"Z", body, "resume", timeout)

    async def kill_all(self, timeout: float = 30.0) -> None:
        """Kill every sandbox process in the guest ('U')."""
        await self._ask(b"U", b"", "kill its processes", timeout)

    async def archive(self, out: int, limit: int, timeout: float = 600.0, *, path: str | None = None) -> None:
        """Have the agent write the sandbox's writable layer as a tar (an OCI layer: see
        dsec-guest.c), or the tree at `path` of the sandbox's own view (dsec-guest.c's
        tar_path: FileNotFoundError where no link-free path leads), to `out`, a regular
        file: `limit` bytes at most (past them it is killed and this fails), in `timeout`
        seconds. Its own code, none of the image's."""
        body = _SPAWN.pack(0, 0, 1 if path is None else 2, 0, 1) + b"\0dsec-archive\0"
        if path is not None:
            if "\0" in path:
                raise InvalidRequest("a path cannot hold NUL bytes")
            body += path.encode() + b"\0"
        with open(os.devnull, "rb") as null, open(os.devnull, "wb") as sink:
            ident, _, exited = await self._spawn(body, (null.fileno(), out, sink.fileno()), limit)
        try:
            status = await wait_for(exited, timeout)
        except TimeoutError:
            self.signal(ident, 9)
            raise InternalError(f"archiving the writable disk took over {timeout:.0f} s") from None
        if self._over.pop(ident, False):
            raise CapacityExhausted(f"the archive of the writable disk exceeded {limit >> 20} MiB")
        if status:
            code = status >> 8 if status & 0x7F == 0 else status
            if path is not None and code in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                raise FileNotFoundError(code, f"{path}: {os.strerror(code)}")
            raise InternalError(f"archiving {path or 'the writable disk'} failed: {os.strerror(code)}")

    def _send_ping(self, ident: int) -> None:
        self._frame(b"P", ident)

    async def spawn(
        self, launch: Launch, *, stdio: tuple[int, int, int], cgroup_fds: Sequence[int] = ()
    ) -> tuple[int, int, asyncio.Future[int]]:
        env_items, strings = launch_strings(launch)
        body = _SPAWN.pack(launch.uid, launch.gid, len(launch.argv), len(env_items), 0)
        body += b"".join(s.encode() + b"\0" for s in strings)
        if len(body) > 262_000:
            raise InvalidRequest(
                "command line and environment exceed 256 KiB; pass large data through stdin or a file"
            )
        return await self._spawn(body, stdio)

    async def _spawn(
        self, body: bytes, stdio: tuple[int, int, int], limit: int | None = None
    ) -> tuple[int, int, asyncio.Future[int]]:
        ident = self._new_id()
        fds = [os.dup(fd) for fd in stdio]  # the caller closes its own
        proc = _Proc(fds[0], _Stream(fds[1], limit=limit), _Stream(fds[2]))
        for s in (proc.out, proc.err):
            if stat.S_ISFIFO(os.fstat(s.fd).st_mode):
                os.set_blocking(s.fd, False)
        started: asyncio.Future[int] = self._loop.create_future()
        exited: asyncio.Future[int] = self._loop.create_future()
        self._started[ident], self._exited[ident], self._procs[ident] = started, exited, proc
        try:
            self._frame(b"S", ident, body)
            mode = os.fstat(proc.stdin).st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                os.set_blocking(proc.stdin, False)
                self._loop.add_reader(proc.stdin, self._pump_stdin, ident)
            elif stat.S_ISREG(mode):  # a file (a memfd): its bytes from its offset, then its end
                proc.stdin_file = True
                self._pump_stdin(ident)
            else:  # /dev/null: nothing to wait for
                self._frame(b"I", ident, b"")
                self._close_stdin(proc)
            pid = await started
        except BaseException:
            self._started.pop(ident, None)
            self._exited.pop(ident, None)
            self._drop(ident)
            raise
        return ident, pid, exited

    async def fill(self, src: int, dst: int, timeout: float = 5.0) -> tuple[int, asyncio.Future[int]]:
        raise InternalError("a guest agent takes no host descriptors (no charged writes)")

    def signal(self, ident: int, sig: int) -> None:
        with contextlib.suppress(InternalError, CapacityExhausted, OSError):
            self._frame(b"K", ident, struct.pack("<i", sig))

    def _unwatch(self) -> None:
        if self._writing:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self.sock.fileno())
        for ident in list(self._procs):
            self._drop(ident)

    def _more_waiting(self) -> list[asyncio.Future[Any]]:
        return [self.hello, *(f for f in (self._setup, self._quiesced) if f is not None)]
