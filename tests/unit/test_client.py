"""The SDK against a mocked transport: request paths and bodies, typed results, errors, retries, SSE."""

from __future__ import annotations

import base64
import io
import json
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import errors
from dsec.client import (
    AsyncClient,
    AsyncSandbox,
    Client,
    ExecResult,
    FileStat,
    Sandbox,
    SandboxInfo,
    SessionResult,
    _base,
    _stream,
    config,
)
from dsec.models import Entry, Trajectory

URL = "http://dsec.test"
REAL_BACKOFF = _base.backoff_delay
Handler = Callable[[httpx.Request], httpx.Response]


# --------------------------------------------------------------------------- a fake server


def info(sid: str = "sb1", state: str = "running", **spec: Any) -> dict[str, Any]:
    return {
        "id": sid,
        "state": state,
        "spec": {"image": "python", **spec},
        "edge": "n0",
        "created_at": 1.0,
        "last_active": 2.0,
    }


def exec_result(stdout: str = "hi\n", exit_code: int = 0) -> dict[str, Any]:
    return {"stdout": stdout, "stderr": "", "exit_code": exit_code, "duration": 0.01}


def wire_error(status: int, code: str, message: str = "nope") -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


def stat_entry(path: str, type_: str = "file") -> dict[str, Any]:
    return {
        "path": path,
        "name": path.rsplit("/", 1)[-1],
        "type": type_,
        "size": 5,
        "mode": 0o644,
        "mtime": 1.0,
        "uid": 0,
        "gid": 0,
    }


class FakeDsec:
    """Routes (method, path) to a handler, a fixed response, or a list of responses used in turn."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler | httpx.Response | list[httpx.Response]] = {}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, reply: Handler | httpx.Response | list[httpx.Response]) -> None:
        self.routes[(method, path)] = reply

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        reply = self.routes.get((request.method, request.url.path))
        if reply is None:
            return wire_error(404, "not_found", f"no route {request.method} {request.url.path}")
        if isinstance(reply, list):
            return reply.pop(0)
        if isinstance(reply, httpx.Response):
            return reply
        return reply(request)

    def calls(self, method: str | None = None, path: str | None = None) -> list[httpx.Request]:
        return [
            r
            for r in self.requests
            if (method is None or r.method == method) and (path is None or r.url.path == path)
        ]

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def body(request: httpx.Request) -> Any:
    return json.loads(request.content)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("DSEC_URL", "DSEC_TOKEN", "DSEC_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(_base, "backoff_delay", lambda attempt: 0.0)


@pytest.fixture
def fake() -> FakeDsec:
    return FakeDsec()


@pytest.fixture
def client(fake: FakeDsec) -> Iterator[Client]:
    with Client(URL, "tok", transport=fake.transport(), retries=2) as c:
        yield c


# --------------------------------------------------------------------------- config


def test_config_default_without_env_or_file() -> None:
    assert config.resolve(None, None) == ("http://127.0.0.1:8420", None)


def test_config_precedence_args_env_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "home" / ".config" / "dsec" / "config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps({"url": "http://file:1/", "token": "file-tok"}))
    assert config.resolve(None, None) == ("http://file:1", "file-tok")

    monkeypatch.setenv("DSEC_URL", "http://env:2")
    assert config.resolve(None, None) == ("http://env:2", "file-tok")
    monkeypatch.setenv("DSEC_TOKEN", "env-tok")
    assert config.resolve(None, None) == ("http://env:2", "env-tok")

    assert config.resolve("http://arg:3", None) == ("http://arg:3", "env-tok")
    assert config.resolve("http://arg:3", "arg-tok") == ("http://arg:3", "arg-tok")


def test_config_file_from_dsec_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "elsewhere.json"
    cfg.write_text(json.dumps({"url": "http://custom:9", "token": "t9"}))
    monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    assert config.resolve(None, None) == ("http://custom:9", "t9")
    assert config.resolve(None, "mine") == ("http://custom:9", "mine")


def test_config_file_invalid_json_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.json"
    cfg.write_text("{not json")
    monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    with pytest.raises(errors.InvalidRequest, match="not valid JSON"):
        config.resolve(None, None)
    # both given: the file is not needed, so not read
    assert config.resolve("http://a", "b") == ("http://a", "b")


def test_client_uses_resolved_config(monkeypatch: pytest.MonkeyPatch, fake: FakeDsec) -> None:
    monkeypatch.setenv("DSEC_URL", "http://from-env:1234")
    monkeypatch.setenv("DSEC_TOKEN", "env-tok")
    fake.on("GET", "/v1/version", httpx.Response(200, json={"version": "1.2.3"}))
    with Client(transport=fake.transport()) as c:
        assert c.url == "http://from-env:1234"
        assert c.version() == "1.2.3"
    (req,) = fake.requests
    assert str(req.url) == "http://from-env:1234/v1/version"
    assert req.headers["Authorization"] == "Bearer env-tok"


# --------------------------------------------------------------------------- sync flow


def test_headers_request_id_and_no_token(fake: FakeDsec) -> None:
    fake.on("GET", "/v1/health", httpx.Response(200, json={"status": "ok"}))
    with Client(URL, transport=fake.transport()) as c:
        assert c.health() == {"status": "ok"}
        c.health()
    first, second = fake.requests
    assert "Authorization" not in first.headers
    assert uuid.UUID(first.headers["X-Request-ID"]) != uuid.UUID(second.headers["X-Request-ID"])
    assert first.headers["User-Agent"].startswith("dsec-python/")


def test_create_exec_files_session_stop(client: Client, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes", httpx.Response(201, json=info(cpu=2.0, labels={"a": "b"})))
    fake.on("POST", "/v1/sandboxes/sb1/exec", httpx.Response(200, json=exec_result("hi\n")))
    fake.on("PUT", "/v1/sandboxes/sb1/files", httpx.Response(204))
    fake.on(
        "GET",
        "/v1/sandboxes/sb1/files",
        httpx.Response(200, json={"path": "/work/a.txt", "content": "hello", "encoding": "utf-8", "size": 5}),
    )
    fake.on("POST", "/v1/sandboxes/sb1/files/edit", httpx.Response(200, json={"size": 7}))
    fake.on(
        "GET", "/v1/sandboxes/sb1/files/list", httpx.Response(200, json={"entries": [stat_entry("/work/a")]})
    )
    fake.on("GET", "/v1/sandboxes/sb1/files/stat", httpx.Response(200, json=stat_entry("/work/a")))
    fake.on("DELETE", "/v1/sandboxes/sb1/files", httpx.Response(204))
    fake.on("POST", "/v1/sandboxes/sb1/sessions", httpx.Response(201, json={"id": "s1", "kind": "python"}))
    fake.on(
        "POST",
        "/v1/sandboxes/sb1/sessions/s1/run",
        httpx.Response(200, json={"output": "3\n", "exit_code": 0, "duration": 0.1}),
    )
    fake.on("DELETE", "/v1/sandboxes/sb1/sessions/s1", httpx.Response(204))
    fake.on("DELETE", "/v1/sandboxes/sb1", httpx.Response(204))

    sb = client.create("python", cpu=2.0, labels={"a": "b"}, env={"X": "1"})
    assert isinstance(sb, Sandbox) and sb.id == "sb1"
    assert isinstance(sb.info, SandboxInfo) and sb.info.spec.cpu == 2.0
    spec = body(fake.calls("POST", "/v1/sandboxes")[0])
    assert spec["image"] == "python" and spec["cpu"] == 2.0 and spec["env"] == {"X": "1"}
    assert spec["labels"] == {"a": "b"} and spec["memory_mb"] == 1024
    assert spec["workdir"] is None and spec["user"] is None  # the image's (else /work, root): the edge's call

    res = sb.exec(["echo", "hi"], stdin="in", env={"A": "b"}, cwd="/tmp", timeout=5)
    assert isinstance(res, ExecResult) and res.stdout == "hi\n" and res.exit_code == 0
    sent = body(fake.calls("POST", "/v1/sandboxes/sb1/exec")[0])
    assert sent["cmd"] == ["echo", "hi"] and sent["stdin"] == "in" and sent["env"] == {"A": "b"}
    assert sent["cwd"] == "/tmp" and sent["timeout"] == 5 and sent["max_output_bytes"] == 1 << 20

    sb.files.write("/work/a.txt", "hello")
    sb.files.write("/work/b.bin", b"\x00\xff", mode=0o600)
    text_write, bin_write = (body(r) for r in fake.calls("PUT", "/v1/sandboxes/sb1/files"))
    assert text_write == {"path": "/work/a.txt", "content": "hello", "encoding": "utf-8", "mode": 0o644}
    assert bin_write["encoding"] == "base64" and base64.b64decode(bin_write["content"]) == b"\x00\xff"
    assert bin_write["mode"] == 0o600

    assert sb.files.read("/work/a.txt") == "hello"
    assert sb.files.read_bytes("/work/a.txt") == b"hello"
    assert fake.calls("GET", "/v1/sandboxes/sb1/files")[0].url.params["path"] == "/work/a.txt"
    assert sb.files.edit("/work/a.txt", "hello", "goodbye") == 7
    assert body(fake.calls("POST", "/v1/sandboxes/sb1/files/edit")[0]) == {
        "path": "/work/a.txt",
        "old": "hello",
        "new": "goodbye",
    }
    entries = sb.files.list("/work")
    assert isinstance(entries[0], FileStat) and entries[0].name == "a"
    assert sb.files.stat("/work/a").type == "file"
    sb.files.delete("/work/d", recursive=True)
    (delete,) = fake.calls("DELETE", "/v1/sandboxes/sb1/files")
    assert dict(delete.url.params) == {"path": "/work/d", "recursive": "true"}

    session = sb.session("python", env={"P": "1"})
    assert session.id == "s1" and session.kind == "python"
    assert body(fake.calls("POST", "/v1/sandboxes/sb1/sessions")[0]) == {
        "kind": "python",
        "env": {"P": "1"},
        "cwd": None,
        "user": None,
    }
    out = session.run("1 + 2", timeout=3)
    assert isinstance(out, SessionResult) and out.output == "3\n"
    assert body(fake.calls("POST", "/v1/sandboxes/sb1/sessions/s1/run")[0])["code"] == "1 + 2"
    session.close()

    sb.stop()
    assert len(fake.calls("DELETE", "/v1/sandboxes/sb1")) == 1


def test_read_of_binary_file_asks_for_read_bytes(client: Client, fake: FakeDsec) -> None:
    raw = bytes(range(256))
    fake.on(
        "GET",
        "/v1/sandboxes/sb1/files",
        httpx.Response(
            200,
            json={"path": "/b", "content": base64.b64encode(raw).decode(), "encoding": "base64", "size": 256},
        ),
    )
    sb = client.sandbox("sb1")
    with pytest.raises(errors.InvalidRequest, match="read_bytes"):
        sb.files.read("/b")
    assert sb.files.read_bytes("/b") == raw


def test_oversized_write_is_refused_before_sending(client: Client, fake: FakeDsec) -> None:
    files = client.sandbox("sb1").files
    with pytest.raises(errors.PayloadTooLarge, match="upload") as ei:
        files.write("/work/big", b"x" * (100 * 1024 * 1024))  # 133 MiB as base64
    assert isinstance(ei.value, errors.InvalidRequest)
    with pytest.raises(errors.PayloadTooLarge):
        files.write("/work/big", "x" * (128 * 1024 * 1024 + 1))
    assert fake.requests == []


def test_get_list_and_cluster_calls(client: Client, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/sb1", httpx.Response(200, json=info()))
    fake.on("GET", "/v1/sandboxes", httpx.Response(200, json={"sandboxes": [info(), info("sb2")]}))
    fake.on("GET", "/v1/images", httpx.Response(200, json={"images": [{"name": "python", "layers": ["l1"]}]}))
    fake.on("POST", "/v1/pools/prewarm", httpx.Response(200, json={"name": "p", "ready": 4}))
    fake.on("GET", "/v1/edges", httpx.Response(200, json={"edges": []}))

    sb = client.get("sb1")
    assert sb.info is not None and sb.info.state == "running"
    assert sb.refresh().id == "sb1"
    listed = client.list(project="p1", labels={"team": "rl", "run": "7"})
    assert [i.id for i in listed] == ["sb1", "sb2"]
    req = fake.calls("GET", "/v1/sandboxes")[0]
    assert req.url.params.get_list("label") == ["team=rl", "run=7"] and req.url.params["project"] == "p1"
    assert client.images() == [{"name": "python", "layers": ["l1"]}]
    assert client.edges() == []
    assert client.prewarm(4, "python", cpu=0.5) == {"name": "p", "ready": 4}
    assert body(fake.calls("POST", "/v1/pools/prewarm")[0])["spec"]["cpu"] == 0.5
    # a handle makes no request
    n = len(fake.requests)
    assert client.sandbox("zz").info is None and len(fake.requests) == n


def test_ids_are_escaped_in_paths(client: Client, fake: FakeDsec) -> None:
    with pytest.raises(errors.NotFound):
        client.sandbox("../v1/admin").stop()
    assert fake.requests[0].url.raw_path == b"/v1/sandboxes/..%2Fv1%2Fadmin"
    with pytest.raises(errors.InvalidRequest):
        client.sandbox("..").stop()


def test_invalid_arguments_fail_before_any_request(client: Client, fake: FakeDsec) -> None:
    with pytest.raises(errors.InvalidRequest, match="cpu"):
        client.create(cpu=0)
    with pytest.raises(errors.InvalidRequest):
        client.sandbox("sb1").exec([])
    with pytest.raises(errors.InvalidRequest, match="unknown sandbox option"):
        client.create_many(2, cores=3)  # type: ignore[call-arg]
    assert fake.requests == []


def test_long_exec_extends_the_read_timeout(client: Client, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes/sb1/exec", httpx.Response(200, json=exec_result()))
    client.sandbox("sb1").exec("sleep 500", timeout=600)
    client.sandbox("sb1").exec("true", timeout=1)
    long, short = fake.requests
    assert long.extensions["timeout"]["read"] == 630
    assert short.extensions["timeout"]["read"] == 120


# --------------------------------------------------------------------------- errors


def test_error_mapping_by_code(client: Client, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/gone", wire_error(404, "sandbox_not_found", "sandbox gone does not exist"))
    with pytest.raises(errors.SandboxNotFound, match="gone does not exist") as ei:
        client.get("gone")
    assert isinstance(ei.value, LookupError) and isinstance(ei.value, errors.NotFound)


def test_unknown_code_falls_back_by_status(client: Client, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/a", wire_error(409, "brand_new_conflict", "later server"))
    fake.on("GET", "/v1/sandboxes/b", httpx.Response(400, text="plain text"))
    with pytest.raises(errors.Conflict, match="later server"):
        client.get("a")
    with pytest.raises(errors.InvalidRequest, match="plain text"):
        client.get("b")


def test_malformed_success_body_is_an_internal_error(client: Client, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/sb1", httpx.Response(200, json={"id": "sb1"}))
    with pytest.raises(errors.InternalError, match="unexpected response"):
        client.get("sb1")


def test_stop_is_idempotent(client: Client, fake: FakeDsec) -> None:
    fake.on("DELETE", "/v1/sandboxes/sb1", wire_error(404, "sandbox_not_found"))
    client.sandbox("sb1").stop()
    fake.on("DELETE", "/v1/sandboxes/sb1", wire_error(403, "forbidden"))
    with pytest.raises(errors.Forbidden):
        client.sandbox("sb1").stop()


# --------------------------------------------------------------------------- retries


def test_get_is_retried_on_503_then_succeeds(client: Client, fake: FakeDsec) -> None:
    fake.on(
        "GET",
        "/v1/sandboxes/sb1",
        [wire_error(503, "unavailable"), httpx.Response(502), httpx.Response(200, json=info())],
    )
    assert client.get("sb1").id == "sb1"
    attempts = fake.calls("GET", "/v1/sandboxes/sb1")
    assert len(attempts) == 3
    assert len({r.headers["X-Request-ID"] for r in attempts}) == 1  # one logical call


def test_retries_are_bounded(client: Client, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/sb1", wire_error(503, "capacity_exhausted"))
    with pytest.raises(errors.CapacityExhausted):
        client.get("sb1")
    assert len(fake.requests) == 3  # the first try and retries=2


def test_non_retryable_errors_are_not_retried(client: Client, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/sb1", wire_error(500, "internal"))
    with pytest.raises(errors.InternalError):
        client.get("sb1")
    assert len(fake.requests) == 1


def test_exec_is_not_retried_and_create_is_with_one_idempotency_key(client: Client, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes/sb1/exec", wire_error(503, "unavailable"))
    fake.on("POST", "/v1/sandboxes", wire_error(503, "unavailable"))
    with pytest.raises(errors.Unavailable):
        client.sandbox("sb1").exec("true")
    assert len(fake.requests) == 1
    with pytest.raises(errors.Unavailable):
        client.create()
    creates = fake.requests[1:]
    assert len(creates) == 3  # the first try and retries=2, all with the same key
    keys = {r.headers["Idempotency-Key"] for r in creates}
    assert len(keys) == 1 and len(keys.pop()) >= 32
    with pytest.raises(errors.Unavailable):
        client.create(idempotency_key="step-7-env-3")
    assert fake.requests[-1].headers["Idempotency-Key"] == "step-7-env-3"


def test_several_urls_fail_over_for_idempotent_calls(fake: FakeDsec) -> None:
    """A call that cannot reach one apiserver goes on to the next at once (and stays there);
    DSEC_URL may list several."""
    tried: list[str] = []

    def route(request: httpx.Request) -> httpx.Response:
        tried.append(request.url.host)
        if request.url.host == "down.test":
            raise httpx.ConnectError("connection refused", request=request)
        return fake(request)

    fake.on("GET", "/v1/version", httpx.Response(200, json={"version": "1.2.3"}))
    with Client(["http://down.test", URL], "tok", transport=httpx.MockTransport(route)) as c:
        assert c.version() == "1.2.3"
        assert c.version() == "1.2.3"
        assert c.url == URL
    assert tried == ["down.test", "dsec.test", "dsec.test"]
    # one URL: no failover, the usual backoff retries
    tried.clear()
    one = Client("http://down.test", "tok", transport=httpx.MockTransport(route), retries=1)
    with one, pytest.raises(errors.Unavailable):
        one.version()
    assert tried == ["down.test", "down.test"]


def test_transport_error_is_unavailable_and_retried_when_nothing_can_run_twice(fake: FakeDsec) -> None:
    """A refused connection sent nothing: any call is retried. A connection cut after the
    request went out may have run it: only an idempotent call is sent again."""
    cut = False

    def fail(request: httpx.Request) -> httpx.Response:
        fake.requests.append(request)
        if cut:
            raise httpx.ReadError("connection reset by peer", request=request)
        raise httpx.ConnectError("connection refused", request=request)

    with Client(URL, transport=httpx.MockTransport(fail), retries=3) as c:
        with pytest.raises(errors.Unavailable, match=f"cannot reach dsec at {URL}: connection refused") as ei:
            c.list()
        assert isinstance(ei.value.__cause__, httpx.ConnectError)
        assert len(fake.requests) == 4
        with pytest.raises(errors.Unavailable):
            c.sandbox("sb1").exec("true")
        assert len(fake.requests) == 8
        cut = True
        with pytest.raises(errors.Unavailable, match="connection reset"):
            c.sandbox("sb1").exec("true")
        assert len(fake.requests) == 9
        with pytest.raises(errors.Unavailable, match="connection reset"):
            c.list()
        assert len(fake.requests) == 13


def test_backoff_is_exponential_with_jitter_and_capped() -> None:
    for attempt, top in [(0, 0.05), (1, 0.1), (3, 0.4), (10, 2.0)]:
        for _ in range(20):
            assert top / 2 <= REAL_BACKOFF(attempt) <= top


# --------------------------------------------------------------------------- create_many / stop_many


def batch_handler(fail_on: int | None = None, partial_on: int | None = None) -> Handler:
    """Answers batches with ids b<call>-<i>; call number ``fail_on`` fails, ``partial_on`` half-fails."""
    seen = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal seen
        index, seen = seen, seen + 1
        count = body(request)["count"]
        if index == fail_on:
            return wire_error(429, "quota_exceeded", "project quota")
        if index == partial_on:
            made = [info(f"b{index}-{i}") for i in range(count // 2)]
            return httpx.Response(
                200, json={"sandboxes": made, "errors": [{"code": "capacity_exhausted", "message": "full"}]}
            )
        return httpx.Response(
            200, json={"sandboxes": [info(f"b{index}-{i}") for i in range(count)], "errors": []}
        )

    return handle


def stop_handler(stopped: list[str]) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        ids = body(request)["ids"]
        stopped.extend(ids)
        return httpx.Response(200, json={"stopped": ids, "errors": {}})

    return handle


def test_create_many_chunks_by_256(client: Client, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes/batch", batch_handler())
    sandboxes = client.create_many(600, "python", concurrency=1, memory_mb=256)
    assert len(sandboxes) == 600 and all(isinstance(s, Sandbox) for s in sandboxes)
    sent = [body(r) for r in fake.calls("POST", "/v1/sandboxes/batch")]
    assert [b["count"] for b in sent] == [256, 256, 88]
    assert all(b["spec"]["memory_mb"] == 256 for b in sent)
    assert sandboxes[0].id == "b0-0" and sandboxes[-1].id == "b2-87"
    assert client.create_many(0) == []


def test_create_many_stops_what_it_created_on_failure(client: Client, fake: FakeDsec) -> None:
    stopped: list[str] = []
    fake.on("POST", "/v1/sandboxes/batch", batch_handler(fail_on=1))
    fake.on("POST", "/v1/sandboxes/batch_stop", stop_handler(stopped))
    with pytest.raises(errors.QuotaExceeded, match="project quota"):
        client.create_many(600, concurrency=1)
    # concurrency=1: batch 0 succeeded, batch 1 failed, batch 2 was never sent
    assert len(fake.calls("POST", "/v1/sandboxes/batch")) == 2
    assert sorted(stopped) == sorted(f"b0-{i}" for i in range(256))


def test_create_many_partial_batch_counts_as_failure(client: Client, fake: FakeDsec) -> None:
    stopped: list[str] = []
    fake.on("POST", "/v1/sandboxes/batch", batch_handler(partial_on=0))
    fake.on("POST", "/v1/sandboxes/batch_stop", stop_handler(stopped))
    with pytest.raises(errors.CapacityExhausted, match="full"):
        client.create_many(10, concurrency=4)
    assert sorted(stopped) == sorted(f"b0-{i}" for i in range(5))


def test_stop_many_ignores_already_gone(client: Client, fake: FakeDsec) -> None:
    fake.on(
        "POST",
        "/v1/sandboxes/batch_stop",
        [
            httpx.Response(
                200, json={"stopped": ["a"], "errors": {"b": {"code": "sandbox_not_found", "message": ""}}}
            ),
            httpx.Response(
                200, json={"stopped": [], "errors": {"c": {"code": "forbidden", "message": "not yours"}}}
            ),
        ],
    )
    client.stop_many(["a", "b"])
    with pytest.raises(errors.Forbidden, match="not yours"):
        client.stop_many(["c"])


# --------------------------------------------------------------------------- exec_stream (SSE)

SSE = (
    b": keep-alive\n\n"
    b'event: stdout\ndata: "line 1\\n"\n\n'
    b'event: stderr\r\ndata: "warn"\r\n\r\n'
    b"event: ping\ndata: {}\n\n"
    b'event: stdout\ndata: "line 2\\n"\n\n'
    b'event: result\ndata: {"stdout": "line 1\\nline 2\\n", "stderr": "warn", '
    b'"exit_code": 3, "duration": 0.5}\n\n'
)


def sse(content: bytes, status: int = 200) -> httpx.Response:
    return httpx.Response(status, headers={"Content-Type": "text/event-stream"}, content=content)


def test_exec_stream_parses_events(client: Client, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes/sb1/exec/stream", sse(SSE))
    events = list(client.sandbox("sb1").exec_stream("make", timeout=10))
    assert events[:3] == [("stdout", "line 1\n"), ("stderr", "warn"), ("stdout", "line 2\n")]
    kind, result = events[3]
    assert kind == "result" and isinstance(result, ExecResult) and result.exit_code == 3
    assert len(events) == 4
    (req,) = fake.requests
    assert body(req)["cmd"] == "make" and req.headers["Accept"] == "text/event-stream"


def test_exec_stream_errors(client: Client, fake: FakeDsec) -> None:
    sb = client.sandbox("sb1")
    fake.on("POST", "/v1/sandboxes/sb1/exec/stream", wire_error(409, "sandbox_not_running"))
    with pytest.raises(errors.SandboxNotRunning):
        list(sb.exec_stream("x"))
    fake.on("POST", "/v1/sandboxes/sb1/exec/stream", sse(b'event: stdout\ndata: "a"\n\n'))
    with pytest.raises(errors.Unavailable, match="ended before its result"):
        list(sb.exec_stream("x"))
    error_event = b'event: error\ndata: {"error": {"code": "exec_timeout", "message": "too slow"}}\n\n'
    fake.on("POST", "/v1/sandboxes/sb1/exec/stream", sse(error_event))
    with pytest.raises(errors.ExecTimeout, match="too slow"):
        list(sb.exec_stream("x"))
    assert len(fake.requests) == 3  # streams are never retried


def test_sse_decoder_multiline_data() -> None:
    decoder = _stream.SSEDecoder()
    lines = ["event: result", "data: {", 'data: "a": 1}', ""]
    events = [e for e in (decoder.feed(line) for line in lines) if e is not None]
    assert events == [_stream.SSEEvent("result", '{\n"a": 1}')]
    assert decoder.flush() is None


# --------------------------------------------------------------------------- context managers


def test_sandbox_context_manager_stops(client: Client, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes", httpx.Response(201, json=info()))
    fake.on("DELETE", "/v1/sandboxes/sb1", httpx.Response(204))
    with pytest.raises(RuntimeError), client.create() as sb:
        assert sb.id == "sb1"
        raise RuntimeError("boom")
    assert len(fake.calls("DELETE", "/v1/sandboxes/sb1")) == 1


def test_client_close_closes_the_pool(fake: FakeDsec) -> None:
    c = Client(URL, transport=fake.transport())
    with c:
        pass
    assert c._http.is_closed


# --------------------------------------------------------------------------- archives


def make_tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_upload_tars_a_directory(client: Client, fake: FakeDsec, tmp_path: Path) -> None:
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "one.txt").write_text("1")
    fake.on("PUT", "/v1/sandboxes/sb1/archive", httpx.Response(204))
    files = client.sandbox("sb1").files
    files.upload(src, "/work")
    files.upload(str(tmp_path / "one.txt"), "/work/sub")
    first, second = fake.requests
    assert first.url.params["path"] == "/work" and first.headers["Content-Type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(first.content)) as tf:
        assert {"proj", "proj/pkg", "proj/pkg/m.py"} <= set(tf.getnames())
    with tarfile.open(fileobj=io.BytesIO(second.content)) as tf:
        assert tf.getnames() == ["one.txt"]
    with pytest.raises(FileNotFoundError):
        files.upload(tmp_path / "missing", "/work")


def test_download_extracts_safely(client: Client, fake: FakeDsec, tmp_path: Path) -> None:
    fake.on("GET", "/v1/sandboxes/sb1/archive", httpx.Response(200, content=make_tar({"out/r.txt": b"ok"})))
    files = client.sandbox("sb1").files
    files.download("/work/out", tmp_path / "dl")
    assert (tmp_path / "dl" / "out" / "r.txt").read_bytes() == b"ok"
    assert fake.requests[0].url.params["path"] == "/work/out"

    fake.on("GET", "/v1/sandboxes/sb1/archive", httpx.Response(200, content=make_tar({"../evil": b"x"})))
    with pytest.raises(errors.PathEscape):  # dsec's own checks (tests/unit/test_archive_downloads.py)
        files.download("/work/out", tmp_path / "dl2")
    assert not (tmp_path / "evil").exists()


# --------------------------------------------------------------------------- async twin


@pytest.fixture
async def aclient(fake: FakeDsec) -> Any:
    async with AsyncClient(URL, "tok", transport=fake.transport(), retries=2) as c:
        yield c


async def test_async_create_exec_files_session_stop(aclient: AsyncClient, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes", httpx.Response(201, json=info()))
    fake.on("POST", "/v1/sandboxes/sb1/exec", httpx.Response(200, json=exec_result("out")))
    fake.on("PUT", "/v1/sandboxes/sb1/files", httpx.Response(204))
    fake.on(
        "GET",
        "/v1/sandboxes/sb1/files",
        httpx.Response(200, json={"path": "/a", "content": "hey", "encoding": "utf-8", "size": 3}),
    )
    fake.on("POST", "/v1/sandboxes/sb1/sessions", httpx.Response(201, json={"id": "s1", "kind": "bash"}))
    fake.on(
        "POST",
        "/v1/sandboxes/sb1/sessions/s1/run",
        httpx.Response(200, json={"output": "x\n", "exit_code": 0, "duration": 0.1}),
    )
    fake.on("DELETE", "/v1/sandboxes/sb1/sessions/s1", wire_error(404, "session_not_found"))
    fake.on("DELETE", "/v1/sandboxes/sb1", httpx.Response(204))

    async with await aclient.create("python", memory_mb=512) as sb:
        assert isinstance(sb, AsyncSandbox)
        assert body(fake.calls("POST", "/v1/sandboxes")[0])["memory_mb"] == 512
        assert (await sb.exec("echo out")).stdout == "out"
        await sb.files.write("/a", "hey")
        assert await sb.files.read("/a") == "hey"
        session = await sb.session()
        assert session.kind == "bash"
        assert (await session.run("export X=1")).output == "x\n"
        await session.close()  # already gone: swallowed
    assert [r.method + " " + r.url.path for r in fake.requests][-1] == "DELETE /v1/sandboxes/sb1"
    assert fake.requests[0].headers["Authorization"] == "Bearer tok"


async def test_async_errors_and_retries(aclient: AsyncClient, fake: FakeDsec) -> None:
    fake.on("GET", "/v1/sandboxes/sb1", [wire_error(503, "unavailable"), httpx.Response(200, json=info())])
    fake.on("POST", "/v1/sandboxes/sb1/exec", wire_error(503, "unavailable"))
    fake.on("GET", "/v1/sandboxes/gone", wire_error(404, "sandbox_not_found"))
    assert (await aclient.get("sb1")).id == "sb1"
    assert len(fake.calls("GET", "/v1/sandboxes/sb1")) == 2
    with pytest.raises(errors.Unavailable):
        await aclient.sandbox("sb1").exec("true")
    assert len(fake.calls("POST", "/v1/sandboxes/sb1/exec")) == 1
    with pytest.raises(LookupError):
        await aclient.get("gone")


async def test_async_transport_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with AsyncClient(URL, transport=httpx.MockTransport(refuse), retries=1) as c:
        with pytest.raises(errors.Unavailable, match="cannot reach dsec") as ei:
            await c.health()
        assert isinstance(ei.value.__cause__, httpx.ConnectError)


async def test_async_create_many_and_cleanup(aclient: AsyncClient, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes/batch", batch_handler())
    made = await aclient.create_many(300, concurrency=8)
    assert len(made) == 300 and made[-1].id == "b1-43"
    assert sorted(body(r)["count"] for r in fake.calls("POST", "/v1/sandboxes/batch")) == [44, 256]

    stopped: list[str] = []
    fake.on("POST", "/v1/sandboxes/batch", batch_handler(fail_on=2))
    fake.on("POST", "/v1/sandboxes/batch_stop", stop_handler(stopped))
    with pytest.raises(errors.QuotaExceeded):
        await aclient.create_many(1000, concurrency=2)
    created = {f"b{i}-{j}" for i in (0, 1, 3) for j in range(256)}
    assert set(stopped) <= created and {f"b{i}-{j}" for i in (0, 1) for j in range(256)} <= set(stopped)


async def test_async_exec_stream(aclient: AsyncClient, fake: FakeDsec) -> None:
    fake.on("POST", "/v1/sandboxes/sb1/exec/stream", sse(SSE))
    events = [e async for e in aclient.sandbox("sb1").exec_stream(["make", "-j4"])]
    assert [k for k, _ in events] == ["stdout", "stderr", "stdout", "result"]
    assert isinstance(events[-1][1], ExecResult)
    fake.on("POST", "/v1/sandboxes/sb1/exec/stream", wire_error(404, "sandbox_not_found"))
    with pytest.raises(errors.SandboxNotFound):
        async for _ in aclient.sandbox("sb1").exec_stream("x"):
            pass


async def test_async_upload_download(aclient: AsyncClient, fake: FakeDsec, tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("data")
    fake.on("PUT", "/v1/sandboxes/sb1/archive", httpx.Response(204))
    fake.on("GET", "/v1/sandboxes/sb1/archive", httpx.Response(200, content=make_tar({"f.txt": b"data"})))
    files = aclient.sandbox("sb1").files
    await files.upload(tmp_path / "f.txt", "/work")
    await files.download("/work/f.txt", tmp_path / "back")
    assert (tmp_path / "back" / "f.txt").read_text() == "data"
    assert await files.download_tar("/work/f.txt") == make_tar({"f.txt": b"data"})


def test_trajectory_is_typed_and_reads_as_before(client: Client, fake: FakeDsec) -> None:
    entry = {
        "sandbox_id": "sb1",
        "seq": 1,
        "kind": "exec",
        "action": {"cmd": "true"},
        "observation": {"exit_code": 0},
        "timings": {"total_ms": 1.0},
        "trajectory": "t",
        "step": 0,
        "recorded_at": 1.0,
    }
    stats = {"acknowledged": 1, "recorded": 1, "lost": 0, "pending": 0}
    fake.on("POST", "/v1/sandboxes", httpx.Response(201, json=info()))
    fake.on(
        "GET", "/v1/sandboxes/sb1/trajectory", httpx.Response(200, json={"entries": [entry], "stats": stats})
    )
    t = client.create("python", backend="container").trajectory()
    assert "backend" not in body(fake.calls("POST", "/v1/sandboxes")[0])  # the default: older servers read it
    assert t.get("stats") is t.stats and t.get("nope") is None
    assert isinstance(t, Trajectory) and isinstance(t.entries[0], Entry)
    assert t.entries[0].seq == t["entries"][0]["seq"] == 1 and t.stats.recorded == t["stats"]["recorded"] == 1
    assert "seq" in t.entries[0] and "nope" not in t.entries[0]
    with pytest.raises(KeyError):
        t["nope"]
    with pytest.raises(errors.InvalidRequest, match="unknown sandbox option"):
        client.create("python", colour="red")  # type: ignore[call-arg]
