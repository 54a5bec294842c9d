"""The synchronous client's fast path: HTTP/1.1 keep-alive straight over sockets.

A sandbox call is one small JSON request and one small JSON response on a local
keep-alive connection, made by the thousand per RL step. Through ``httpx.Client``
such a call costs ~0.5 ms of client CPU on a warm machine and ~1.2 ms after the
CPU idled a few milliseconds (request and URL models, cookie handling, h11, and
headers and body written in two ``send`` calls: two wake-ups of the server). This
path writes the request in one ``sendall`` and parses the response with
``httptools`` (llhttp, the parser uvicorn uses): ~0.1 ms warm, ~0.35 ms after idling
(bench/bench_service.py; docs/benchmarks.md).

It returns ``httpx.Response`` objects and raises httpx's transport exceptions, so
the SDK's parsing, error mapping and retries are the same on both paths. It serves
plain ``http://`` without a proxy and without a caller-supplied transport; streams
(SSE) and everything else go through ``httpx.Client``.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urlencode, urlsplit

import httptools
import httpx

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


class _Conn:
    __slots__ = ("idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since = 0.0

    def reusable(self, now: float) -> bool:
        """Idle briefly enough, and the server has not closed it (nothing readable)."""
        if now - self.idle_since >= KEEPALIVE_EXPIRY_S:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

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


class Wire:
    """Keep-alive connections to one ``http://host:port[/prefix]``; thread-safe."""

    def __init__(self, url: str, headers: dict[str, str], *, max_keepalive: int) -> None:
        parts = urlsplit(url)
        self._addr = (parts.hostname or "localhost", parts.port or 80)
        self._prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        fixed = {"Host": host, "Accept": "*/*", "Accept-Encoding": "identity", **headers}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._max_keepalive = max_keepalive
        self._closed = False

    def request(
        self,
        method: str,
        path: str,
        *,
        params: list[tuple[str, str]] | None,
        json_body: Any,
        content: bytes | str | None,
        headers: dict[str, str],
        connect_timeout: float,
        read_timeout: float,
    ) -> httpx.Response:
        target = self._prefix + path
        if params:
            target += "?" + urlencode(params)
        if json_body is not None:
            body = json.dumps(json_body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            headers = {"Content-Type": "application/json", **headers}
        elif content is not None:
            body = content.encode() if isinstance(content, str) else bytes(content)
        else:
            body = b""
        head = f"{method} {target} HTTP/1.1\r\n{self._head}" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()
        )
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"Content-Length: {len(body)}\r\n"
        payload = (head + "\r\n").encode("latin-1") + body
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
        response = httpx.Response(parser.get_status_code(), headers=got.headers, content=b"".join(got.body))
        return response, got.keep_alive

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
