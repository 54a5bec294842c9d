"""The clients' fast path: HTTP/1.1 keep-alive straight over sockets (sync and asyncio).

A sandbox call is one small JSON request and one small JSON response on a local
keep-alive connection, made by the thousand per RL step. Through ``httpx.Client``
such a call costs ~0.5 ms of client CPU on a warm machine and ~1.2 ms after the
CPU idled a few milliseconds (request and URL models, cookie handling, h11, and
headers and body written in two ``send`` calls: two wake-ups of the server). This
path writes the request in one write and parses the response with ``httptools``
(llhttp, the parser uvicorn uses): ~0.1 ms warm, ~0.35 ms after idling for the sync
client; the asyncio one (a Protocol feeding the parser) 0.2 / 0.55 ms against
httpx.AsyncClient's 0.7 / 1.7 ms (bench/bench_service.py; docs/benchmarks.md).

It returns ``httpx.Response`` objects and raises httpx's transport exceptions, so
the SDK's parsing, error mapping and retries are the same on both paths. It serves
plain ``http://`` without a proxy and without a caller-supplied transport; streams
(SSE) and everything else go through httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
import urllib.request
from typing import Any, cast
from urllib.parse import urlencode, urlsplit

import httptools
import httpx

from dsec import errors

KEEPALIVE_EXPIRY_S = 5.0  # as httpx's default: far below the server's keep-alive (service.py)
_BUF = 65536


class _Parsed:
    """httptools callbacks collecting one response."""

    __slots__ = ("body", "complete", "headers", "keep_alive", "parser")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False
        self.keep_alive = False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # reset once the message completes

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def response(self) -> httpx.Response:
        return httpx.Response(
            self.parser.get_status_code(), headers=self.headers, content=b"".join(self.body)
        )


class _Conn:
    __slots__ = ("idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since = 0.0

    def reusable(self, now: float) -> bool:
        """Idle briefly enough, and the server has not closed it (nothing to read on it)."""
        if now - self.idle_since >= KEEPALIVE_EXPIRY_S:
            return False
        try:
            self.sock.settimeout(0.0)  # with a timeout, Python would wait for data to peek at
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # end of stream (the server closed it) or bytes nobody asked for

    def close(self) -> None:
        self.sock.close()


def usable(url: str) -> bool:
    """Whether the fast path may serve ``url`` (plain HTTP, no proxy from the environment)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies_environment()
    if not any(k in proxies for k in ("http", "all")):
        return True
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    return bool(bypass(parts.hostname, proxies))


class Endpoint:
    """One ``http://host:port[/prefix]`` and the fixed part of every request's head."""

    def __init__(self, url: str, headers: dict[str, str], *, max_keepalive: int) -> None:
        parts = urlsplit(url)
        self._addr = (parts.hostname or "localhost", parts.port or 80)
        self._prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        fixed = {"Host": host, "Accept": "*/*", "Accept-Encoding": "identity", **headers}
        for k, v in fixed.items():
            if any(c in f"{k}{v}" for c in "\r\n\0"):
                raise errors.InvalidRequest(
                    f"header {k!r} contains a line break or NUL; check the token and URL"
                )
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._max_keepalive = max_keepalive
        self._closed = False

    def payload(
        self,
        method: str,
        path: str,
        *,
        params: list[tuple[str, str]] | None = None,
        json_body: Any = None,
        content: bytes | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """The whole request, head and body, for one write."""
        target = self._prefix + path
        if params:
            target += "?" + urlencode(params)
        headers = headers or {}
        if json_body is not None:
            body = json.dumps(json_body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            headers = {"Content-Type": "application/json", **headers}
        elif content is not None:
            body = content.encode() if isinstance(content, str) else bytes(content)
        else:
            body = b""
        head = f"{method} {target} HTTP/1.1\r\n{self._head}"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"Content-Length: {len(body)}\r\n"
        return (head + "\r\n").encode("latin-1") + body


class Wire(Endpoint):
    """Blocking keep-alive connections to one endpoint; thread-safe."""

    def __init__(self, url: str, headers: dict[str, str], *, max_keepalive: int) -> None:
        super().__init__(url, headers, max_keepalive=max_keepalive)
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()

    def request(self, payload: bytes, connect_timeout: float, read_timeout: float) -> httpx.Response:
        """Send one request made by :meth:`payload`; its response."""
        conn = self._checkout(connect_timeout)
        try:
            response, keep = self._exchange(conn, payload, read_timeout)
        except BaseException:
            conn.close()
            raise
        if keep:
            self._checkin(conn)
        else:
            conn.close()
        return response

    # ------------------------------------------------------------------ I/O

    def _checkout(self, connect_timeout: float) -> _Conn:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.reusable(now):
                    return conn
                conn.close()
        try:
            sock = socket.create_connection(self._addr, timeout=connect_timeout)
        except TimeoutError as e:
            raise httpx.ConnectTimeout(str(e) or "timed out connecting") from e
        except OSError as e:
            raise httpx.ConnectError(str(e) or type(e).__name__) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock)

    def _checkin(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self._closed and len(self._idle) < self._max_keepalive:
                self._idle.append(conn)
                return
        conn.close()

    @staticmethod
    def _exchange(conn: _Conn, payload: bytes, read_timeout: float) -> tuple[httpx.Response, bool]:
        sock = conn.sock
        try:
            sock.settimeout(read_timeout)
            sock.sendall(payload)  # headers and body in one write
        except TimeoutError as e:
            raise httpx.WriteTimeout(str(e) or "timed out sending the request") from e
        except OSError as e:
            raise httpx.WriteError(str(e) or type(e).__name__) from e
        got = _Parsed()
        parser = got.parser
        buf = bytearray(_BUF)
        view = memoryview(buf)
        try:
            while not got.complete:
                n = sock.recv_into(buf)
                if n == 0:
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection without a complete response"
                    )
                parser.feed_data(view[:n])
        except TimeoutError as e:
            raise httpx.ReadTimeout(str(e) or "timed out waiting for the response") from e
        except httptools.HttpParserError as e:
            raise httpx.RemoteProtocolError(f"malformed response: {e}") from e
        except OSError as e:
            raise httpx.ReadError(str(e) or type(e).__name__) from e
        return got.response(), got.keep_alive

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Protocol(asyncio.Protocol):
    """One connection of :class:`AsyncWire`: feeds the parser as data arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.got: _Parsed | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, though they are ones)
        self.transport = cast(asyncio.Transport, transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        got, waiter = self.got, self.waiter
        if got is None or waiter is None or waiter.done():
            self.lost = True  # bytes nobody asked for: this connection cannot be trusted again
            return
        try:
            got.parser.feed_data(data)
        except httptools.HttpParserError as e:
            waiter.set_exception(httpx.RemoteProtocolError(f"malformed response: {e}"))
            return
        if got.complete:
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(
                httpx.ReadError(str(exc))
                if exc
                else httpx.RemoteProtocolError("the server closed the connection")
            )

    def quiet(self) -> bool:
        """Nothing arrived on this idle connection that the loop has yet to deliver. A server
        that died (kill -9) closed it; a request written there would be lost with it, and could
        not be told from one the server took, so a fresh connection is made instead."""
        assert self.transport is not None
        poller = select.poll()
        poller.register(self.transport.get_extra_info("socket").fileno(), select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class AsyncWire(Endpoint):
    """Keep-alive connections to one endpoint, at most `max_connections` at once (callers past
    that wait, as in httpx's pool). Connections belong to an event loop: used from another
    loop (a second ``asyncio.run``), the client drops the old loop's and starts afresh."""

    def __init__(
        self, url: str, headers: dict[str, str], *, max_keepalive: int, max_connections: int
    ) -> None:
        super().__init__(url, headers, max_keepalive=max_keepalive)
        self._idle: list[_Protocol] = []
        self._max_connections = max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(max_connections)

    async def request(self, payload: bytes, connect_timeout: float, read_timeout: float) -> httpx.Response:
        """Send one request made by :meth:`payload`; its response."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._drop_idle()  # they belong to a loop that is gone
            self._loop, self._slots = loop, asyncio.Semaphore(self._max_connections)
        async with self._slots:
            return await self._exchange(loop, payload, connect_timeout, read_timeout)

    async def _exchange(
        self, loop: asyncio.AbstractEventLoop, payload: bytes, connect_timeout: float, read_timeout: float
    ) -> httpx.Response:
        proto = await self._checkout(loop, connect_timeout)
        got = proto.got = _Parsed()
        waiter = proto.waiter = loop.create_future()
        timer = loop.call_later(read_timeout, _expire, waiter)
        try:
            assert proto.transport is not None
            proto.transport.write(payload)  # head and body in one write
            await waiter
        except BaseException:  # errors, timeouts and cancellation: the connection is done for
            proto.close()
            raise
        finally:
            timer.cancel()
            proto.got = proto.waiter = None
        if got.keep_alive and not proto.lost and not self._closed and len(self._idle) < self._max_keepalive:
            proto.idle_since = time.monotonic()
            self._idle.append(proto)
        else:
            proto.close()
        return got.response()

    async def _checkout(self, loop: asyncio.AbstractEventLoop, connect_timeout: float) -> _Protocol:
        now = time.monotonic()
        while self._idle:
            proto = self._idle.pop()
            if not proto.lost and now - proto.idle_since < KEEPALIVE_EXPIRY_S and proto.quiet():
                return proto
            proto.close()
        try:
            async with asyncio.timeout(connect_timeout):
                _, proto = await loop.create_connection(_Protocol, *self._addr)
        except TimeoutError as e:
            raise httpx.ConnectTimeout("timed out connecting") from e
        except OSError as e:
            raise httpx.ConnectError(str(e) or type(e).__name__) from e
        return proto

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for proto in idle:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                proto.close()

    async def aclose(self) -> None:
        self._closed = True
        self._drop_idle()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("timed out waiting for the response"))
