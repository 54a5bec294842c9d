"""The sync client's socket fast path (client/_wire.py) against a real local HTTP/1.1 server:
keep-alive reuse, server-side closes, chunked bodies, timeouts, refused connections, one
write per request, and when the SDK must not take it (proxies, TLS, custom transports)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from dsec import errors
from dsec.client import AsyncClient, Client, _base, _calls
from dsec.client._wire import AsyncWire, Wire, usable


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    connections: list[int] = []
    seen: list[dict[str, Any]] = []

    def setup(self) -> None:
        super().setup()
        Handler.connections.append(self.client_address[1])

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def do_DELETE(self) -> None:
        self._route()

    def _route(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        Handler.seen.append(
            {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
        )
        if self.path.startswith("/v1/chunked"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b'{"a": ', b"[1, 2, 3]", b"}"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/v1/close"):
            self._reply(200, b'{"closing": true}', {"Connection": "close"})
            self.close_connection = True
        elif self.path.startswith("/v1/drop"):  # answer, then close without saying so
            self._reply(200, b'{"dropped": true}')
            self.close_connection = True
        elif self.path.startswith("/v1/slow"):
            time.sleep(0.5)
            self._reply(200, b"{}")
        elif self.path.startswith("/v1/missing"):
            self._reply(404, json.dumps({"error": {"code": "sandbox_not_found", "message": "no"}}).encode())
        elif self.path.startswith("/v1/sandboxes") and self.command == "DELETE":
            self.send_response(204)
            self.end_headers()
        else:
            self._reply(200, json.dumps({"path": self.path, "len": len(body)}).encode())


class Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out leaves a broken pipe behind: expected here


@pytest.fixture
def server() -> Iterator[str]:
    Handler.connections.clear()
    Handler.seen.clear()
    srv = Server(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def wire(url: str) -> Wire:
    return Wire(url, {"Authorization": "Bearer t"}, max_keepalive=4)


def call(w: Wire, method: str, path: str, read_timeout: float = 2.0, **kw: Any) -> httpx.Response:
    return w.request(w.payload(method, path, **kw), 2.0, read_timeout)


def test_keep_alive_reuses_one_connection(server: str) -> None:
    w = wire(server)
    for i in range(5):
        r = call(w, "POST", "/v1/x", json_body={"i": i, "s": "é"})
        assert r.status_code == 200 and r.json()["path"] == "/v1/x"
    assert len(Handler.connections) == 1
    first = Handler.seen[0]
    assert json.loads(first["body"]) == {"i": 0, "s": "é"}
    assert first["headers"]["Content-Type"] == "application/json"
    assert first["headers"]["Authorization"] == "Bearer t"
    assert first["headers"]["Host"] == server.removeprefix("http://")
    w.close()


def test_query_params_and_bodies(server: str) -> None:
    w = wire(server)
    r = call(w, "GET", "/v1/files", params=[("path", "/work/a b&c"), ("x", "1")])
    assert r.json()["path"] == "/v1/files?path=%2Fwork%2Fa+b%26c&x=1"
    r = call(w, "POST", "/v1/raw", content=b"\x00\x01binary")
    assert r.json()["len"] == 8
    r = call(w, "POST", "/v1/empty")  # a POST without a body still says Content-Length: 0
    assert Handler.seen[-1]["headers"]["Content-Length"] == "0"
    w.close()


def test_chunked_and_empty_responses(server: str) -> None:
    w = wire(server)
    assert call(w, "GET", "/v1/chunked").json() == {"a": [1, 2, 3]}
    r = call(w, "DELETE", "/v1/sandboxes/n0-x")
    assert r.status_code == 204 and r.content == b""
    assert call(w, "GET", "/v1/after").status_code == 200
    assert len(Handler.connections) == 1  # chunked and 204 both kept the connection
    w.close()


def test_server_closes(server: str) -> None:
    w = wire(server)
    assert call(w, "GET", "/v1/close").json() == {"closing": True}
    assert call(w, "GET", "/v1/drop").json() == {"dropped": True}  # closed after answering
    time.sleep(0.05)
    assert call(w, "GET", "/v1/next").status_code == 200  # the dead idle one is not reused
    assert len(Handler.connections) == 3
    w.close()


def test_idle_connections_expire(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import dsec.client._wire as wire_mod

    w = wire(server)
    call(w, "GET", "/v1/a")
    monkeypatch.setattr(wire_mod, "KEEPALIVE_EXPIRY_S", 0.0)
    call(w, "GET", "/v1/b")
    assert len(Handler.connections) == 2
    w.close()


def test_timeouts_and_refusals(server: str) -> None:
    w = wire(server)
    with pytest.raises(httpx.ReadTimeout):
        call(w, "GET", "/v1/slow", read_timeout=0.1)
    assert call(w, "GET", "/v1/ok").status_code == 200  # the timed-out connection was dropped
    w.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(httpx.ConnectError):
        call(wire(f"http://127.0.0.1:{port}"), "GET", "/v1/x")


def test_the_sdk_takes_the_fast_path_and_maps_errors(server: str) -> None:
    with Client(server, "tok", retries=0) as c:
        assert c._wire is not None
        with pytest.raises(errors.SandboxNotFound):
            c._call(_missing())  # a 404 with a wire error becomes the SDK's typed error
        assert c.health()["path"] == "/v1/health"
    assert Handler.seen[-1]["headers"]["X-Request-ID"]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with Client(f"http://127.0.0.1:{port}", "tok", retries=0) as c, pytest.raises(errors.Unavailable):
        c.health()


def _missing() -> _base.Call[Any]:
    return _base.Call(_base.Request("GET", "/v1/missing"), _calls._json)


def test_when_the_fast_path_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(k, raising=False)
    assert usable("http://127.0.0.1:8420")
    assert not usable("https://dsec.example:443")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not usable("http://dsec.example:8420")
    monkeypatch.setenv("NO_PROXY", "dsec.example")
    assert usable("http://dsec.example:8420")
    with Client("http://dsec.test", "t", transport=httpx.MockTransport(lambda r: httpx.Response(200))) as c:
        assert c._wire is None


# --------------------------------------------------------------------------- asyncio


async def acall(w: AsyncWire, method: str, path: str, read_timeout: float = 2.0, **kw: Any) -> httpx.Response:
    return await w.request(w.payload(method, path, **kw), 2.0, read_timeout)


@pytest.mark.asyncio
async def test_async_keep_alive_chunked_and_closes(server: str) -> None:
    w = AsyncWire(server, {"Authorization": "Bearer t"}, max_keepalive=4, max_connections=8)
    for i in range(3):
        r = await acall(w, "POST", "/v1/x", json_body={"i": i})
        assert r.json() == {"path": "/v1/x", "len": len(json.dumps({"i": i}, separators=(",", ":")))}
    assert (await acall(w, "GET", "/v1/chunked")).json() == {"a": [1, 2, 3]}
    assert (await acall(w, "DELETE", "/v1/sandboxes/n0-x")).status_code == 204
    assert len(Handler.connections) == 1
    assert (await acall(w, "GET", "/v1/close")).json() == {"closing": True}
    assert (await acall(w, "GET", "/v1/drop")).json() == {"dropped": True}
    await asyncio.sleep(0.05)
    assert (await acall(w, "GET", "/v1/next")).status_code == 200
    assert len(Handler.connections) == 3
    await w.aclose()


@pytest.mark.asyncio
async def test_async_timeouts_cancellation_and_refusals(server: str) -> None:
    w = AsyncWire(server, {}, max_keepalive=4, max_connections=8)
    with pytest.raises(httpx.ReadTimeout):
        await acall(w, "GET", "/v1/slow", read_timeout=0.1)
    task = asyncio.create_task(acall(w, "GET", "/v1/slow"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # neither the timed-out nor the cancelled connection is reused: a late answer on them
    # must never be read as the answer to a later request
    assert (await acall(w, "GET", "/v1/ok")).json()["path"] == "/v1/ok"
    assert len(Handler.connections) == 3
    await w.aclose()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(httpx.ConnectError):
        await acall(
            AsyncWire(f"http://127.0.0.1:{port}", {}, max_keepalive=1, max_connections=1), "GET", "/v1/x"
        )


@pytest.mark.asyncio
async def test_the_async_sdk_takes_the_fast_path_and_maps_errors(server: str) -> None:
    async with AsyncClient(server, "tok", retries=0) as c:
        assert c._wire is not None
        with pytest.raises(errors.SandboxNotFound):
            await c._call(_missing())
        assert (await c.health())["path"] == "/v1/health"
    assert Handler.seen[-1]["headers"]["Authorization"] == "Bearer tok"


# The first loop ends with connections open (a client used across two asyncio.run calls, not
# closed in between): the second one must not reuse them; their sockets go with the GC.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_async_connection_limit_and_a_second_event_loop(server: str) -> None:
    w = AsyncWire(server, {}, max_keepalive=8, max_connections=2)

    async def burst() -> list[int]:
        rs = await asyncio.gather(*(acall(w, "GET", "/v1/slow") for _ in range(4)))
        return [r.status_code for r in rs]

    t = time.monotonic()
    assert asyncio.run(burst()) == [200] * 4
    assert time.monotonic() - t >= 0.95  # two at a time: two rounds of 0.5 s
    assert len(Handler.connections) == 2
    # a later asyncio.run: the first loop's connections are not reused (nor crash)
    assert asyncio.run(acall(w, "GET", "/v1/again")).status_code == 200
    assert len(Handler.connections) == 3
    asyncio.run(w.aclose())
    gc.collect()  # the first loop's sockets, here rather than in some later test


def test_a_token_with_a_line_break_is_refused_before_any_io() -> None:
    with pytest.raises(errors.InvalidRequest, match="line break"):
        Client("http://127.0.0.1:9", "tok\r\nX-Evil: 1")


def test_many_open_fds_do_not_stop_connection_reuse(server: str) -> None:
    spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # push sockets past fd 1024
    try:
        w = wire(server)
        for _ in range(3):
            assert call(w, "GET", "/v1/x").status_code == 200
        assert len(Handler.connections) == 1
        w.close()
    finally:
        for fd in spare:
            os.close(fd)
