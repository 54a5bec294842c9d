"""The edge's end of a sandbox's control socket: the protocol of dsec-shim (see dsec-shim.c).

One SOCK_SEQPACKET datagram per request: S (spawn, with the stdio and cgroup fds), W (a
charged write: copy a pipe into a file from inside), K (signal), P (ping); the shim answers
R (started: pid), F (failed: errno), X (exited: wait status), p (pong)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsec.aio import wait_for
from dsec.errors import CapacityExhausted, InternalError, InvalidRequest

_HDR = struct.Struct("<IiiHHB")
MAX_LAUNCH_STRINGS = 65_535  # argv + environment items (+ cwd) of one spawn message
_REPLY = struct.Struct("<Ii")


@dataclass(frozen=True, slots=True)
class Launch:
    """A process to start in a sandbox: its command line and environment, where, as whom
    (ids inside the sandbox)."""

    argv: Sequence[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int


def launch_strings(launch: Launch) -> tuple[list[str], list[str]]:
    """The environment as NAME=value items, and every string of a spawn message (cwd,
    argv, environment): none may hold a NUL byte."""
    env_items = [f"{k}={v}" for k, v in launch.env.items()]
    strings = [launch.cwd, *launch.argv, *env_items]
    if any("\0" in s for s in strings):
        raise InvalidRequest("arguments, environment and cwd must not contain NUL bytes")
    if len(strings) > MAX_LAUNCH_STRINGS:  # the messages count them in 16 bits
        raise InvalidRequest(
            f"{len(launch.argv)} arguments and {len(env_items)} environment variables: at most "
            f"{MAX_LAUNCH_STRINGS} in all; pass large data through stdin or a file"
        )
    return env_items, strings


class ShimChannel:
    """The edge's end of a sandbox's control socket."""

    passes_fds = True  # a spawn's stdio reaches the process as the descriptors given

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._next = random.randrange(1 << 30, 1 << 31)
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def _new_id(self) -> int:
        self._next = (self._next + 1) & 0x7FFFFFFF
        return self._next

    def _on_readable(self) -> None:
        while True:
            try:
                msg = self.sock.recv(64)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:
                self.close()
                return
            ident, value = _REPLY.unpack_from(msg, 1)
            self._reply(msg[:1], ident, value)

    def _reply(self, kind: bytes, ident: int, value: int) -> None:
        """One answer of the init: R started (its pid), F failed to start (errno), X exited
        (wait status), p pong."""
        if kind == b"F":
            self._exited.pop(ident, None)
            failed = self._started.pop(ident, None)
            if failed and not failed.done():
                failed.set_exception(OSError(value, os.strerror(value)))
            return
        waiting = {b"R": self._started, b"X": self._exited}.get(kind)
        if waiting is not None:
            fut = waiting.pop(ident, None)
            if fut and not fut.done():
                fut.set_result(value)
        elif kind == b"p":
            pong = self._pongs.pop(ident, None)
            if pong and not pong.done():
                pong.set_result(None)

    def _send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if self.closed:
            raise InternalError("the sandbox's control channel is closed")
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.send(data)
        except BlockingIOError as e:
            raise CapacityExhausted("the sandbox's control channel is congested; retry") from e

    def _send_ping(self, ident: int) -> None:
        self._send(b"P" + struct.pack("<I", ident))

    async def ping(self, timeout: float = 5.0) -> None:
        ident = self._new_id()
        fut: asyncio.Future[None] = self._loop.create_future()
        self._pongs[ident] = fut
        self._send_ping(ident)
        try:
            await wait_for(fut, timeout)
        finally:
            self._pongs.pop(ident, None)

    async def spawn(
        self, launch: Launch, *, stdio: tuple[int, int, int], cgroup_fds: Sequence[int] = ()
    ) -> tuple[int, int, asyncio.Future[int]]:
        """Start a process; returns (message id, pid inside, future of its wait status)."""
        env_items, strings = launch_strings(launch)
        ident = self._new_id()
        payload = b"S" + _HDR.pack(
            ident, launch.uid, launch.gid, len(launch.argv), len(env_items), len(cgroup_fds)
        )
        payload += b"".join(s.encode() + b"\0" for s in strings)
        if len(payload) > 262_000:
            raise InvalidRequest(
                "command line and environment exceed 256 KiB; pass large data through stdin or a file"
            )
        started: asyncio.Future[int] = self._loop.create_future()
        exited: asyncio.Future[int] = self._loop.create_future()
        self._started[ident] = started
        self._exited[ident] = exited
        try:
            self._send(payload, [*stdio, *cgroup_fds])
            pid = await started
        except BaseException:
            self._started.pop(ident, None)
            self._exited.pop(ident, None)
            raise
        return ident, pid, exited

    async def fill(self, src: int, dst: int, timeout: float = 5.0) -> tuple[int, asyncio.Future[int]]:
        """Have a child of the shim (inside the sandbox's cgroups) copy pipe `src` into the
        regular file `dst` until EOF; returns (message id, future of its wait status). The
        caller keeps its own copies of both fds. An init too old to know 'W' never answers:
        that is a TimeoutError after `timeout`."""
        ident = self._new_id()
        started: asyncio.Future[int] = self._loop.create_future()
        exited: asyncio.Future[int] = self._loop.create_future()
        self._started[ident] = started
        self._exited[ident] = exited
        try:
            self._send(b"W" + struct.pack("<I", ident), [src, dst])
            await wait_for(started, timeout)
        except BaseException:
            self._started.pop(ident, None)
            self._exited.pop(ident, None)
            raise
        return ident, exited

    def signal(self, ident: int, sig: int) -> None:
        with contextlib.suppress(InternalError, OSError):
            self._send(b"K" + struct.pack("<Ii", ident, sig))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self.sock.fileno())
        self._unwatch()
        self.sock.close()
        waiting = [f for futs in (self._started, self._exited, self._pongs) for f in futs.values()]
        for futs in (self._started, self._exited, self._pongs):
            futs.clear()
        err = InternalError("the sandbox stopped")
        for f in [*waiting, *self._more_waiting()]:
            if not f.done():
                f.set_exception(err)
                f.exception()  # mark retrieved: nobody may be waiting any more

    def _unwatch(self) -> None:
        """More to let go of when the channel closes (a subclass's)."""

    def _more_waiting(self) -> list[asyncio.Future[Any]]:
        """Futures besides the processes' and pings' that the close fails (a subclass's)."""
        return []
