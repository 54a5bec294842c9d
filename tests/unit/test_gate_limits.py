"""The apiserver's gate against hostile bodies, driven at the ASGI level so that every body
chunk the application pulls is counted: chunked bodies (no content-length) are cut off at the
route's cap with 413, a caller without a valid token is refused before one byte of its body
is read (native API, SandboxFusion with its token in the path or query, SWE-ReX, edge
registration), tenants are refused admin-only calls before their body is read, and text JSON
cannot carry (lone surrogates) or an oversized environment is a 4xx, never a 500. The edge is
the recording stand-in of test_express (control-plane logic only)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fastapi import FastAPI

from dsec.apiserver.app import create_api_app
from dsec.http.routes import MAX_ARCHIVE, SMALL_BODY, check_json_text
from dsec.iam import IAM

from .test_express import RecordingEdge

LIMIT = 1 << 20  # max_body of the app under test: 1 MiB
CHUNK = 64 * 1024


class Reply:
    def __init__(self, status: int, body: bytes, headers: dict[str, str], consumed: int) -> None:
        self.status = status
        self.body = body
        self.headers = headers
        self.consumed = consumed  # body bytes the application pulled

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        body = self.json()
        return body.get("error", {}).get("code") if isinstance(body, dict) else None


async def call(
    app: FastAPI,
    method: str,
    path: str,
    *,
    chunks: Iterator[bytes] | None = None,
    headers: dict[str, str] | None = None,
    query: str = "",
    chunked: bool = True,
) -> Reply:
    """One request through the whole ASGI app; `chunks` may be endless."""
    consumed = 0
    source = chunks if chunks is not None else iter(())
    hdrs = {k.lower(): v for k, v in (headers or {}).items()}
    if chunks is not None and chunked:
        hdrs.setdefault("transfer-encoding", "chunked")

    async def receive() -> dict[str, Any]:
        nonlocal consumed
        chunk = next(source, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        consumed += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
        "root_path": "",
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers_out = {k.decode(): v.decode() for k, v in start["headers"]}
    return Reply(start["status"], body, headers_out, consumed)


def endless(prefix: bytes = b'{"cells": ["', total: int = 8 * LIMIT) -> Iterator[bytes]:
    """A JSON document that goes on well past the cap (`total` bytes: a gate that does not
    stop it reads it all, and the test says how much)."""
    return itertools.chain([prefix], itertools.repeat(b"a" * CHUNK, total // CHUNK))


MULTIPART = b'--xx\r\nContent-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\n'


class Env:
    def __init__(self, app: FastAPI, iam: IAM, admin: str, tenant: str) -> None:
        self.app = app
        self.iam = iam
        self.admin = admin
        self.tenant = tenant


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    iam = IAM(tmp_path / "iam.db")
    admin = iam.bootstrap()
    assert admin is not None
    iam.create_project("team")
    _, tenant = iam.create_principal("alice", ["team"])
    edges: list[Any] = [RecordingEdge()]
    app = create_api_app(iam=iam, cluster_token="cluster-secret", local_edges=edges, max_body=LIMIT)
    await app.state.dsec.directory.poll_once()
    yield Env(app, iam, admin, tenant)
    iam.close()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "content-type": "application/json"}


# --- authentication before any body byte ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "query", "headers"),
    [
        ("/run_jupyter", "", {}),
        ("/run_jupyter", "token=dsec_wrong", {}),
        ("/run_code", "", {"authorization": "Bearer dsec_wrong"}),
        ("/sandboxfusion/dsec_wrong/run_jupyter", "", {}),
        ("/sandboxfusion/dsec_wrong/run_code", "", {}),
        ("/v1/fncall/jupyter", "", {}),
        ("/v1/sandboxes/n0-000000000001/exec", "", {"authorization": "Bearer nope"}),
        ("/v1/sandboxes/n0-000000000001/archive", "path=/work", {"content-type": "application/x-tar"}),
        ("/v1/images/import", "name=x", {"content-type": "application/x-tar"}),
        ("/swerex/n0-000000000001/write_file", "", {"x-api-key": "dsec_wrong"}),
        ("/swerex/n0-000000000001/upload", "", {"content-type": "multipart/form-data; boundary=x"}),
        ("/v1/edges/register", "", {"authorization": "Bearer not-the-cluster-token"}),
    ],
)
async def test_no_token_no_body_read(env: Env, path: str, query: str, headers: dict[str, str]) -> None:
    r = await call(env.app, "POST", path, chunks=endless(), headers=headers, query=query)
    assert r.status == 401, r.body[:300]
    assert r.consumed == 0, f"{path}: {r.consumed} body bytes read before authentication"
    assert r.headers.get("connection") == "close"  # the rest of the body is not drained either
    if path.startswith("/swerex/"):
        assert r.json()["detail"].startswith("Invalid API Key")  # what SWE-ReX clients read
    else:
        assert r.code == "unauthenticated"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/pools/prewarm"),
        ("POST", "/v1/pools"),
        ("POST", "/v1/projects"),
        ("POST", "/v1/principals"),
        ("POST", "/v1/images/build"),  # (a recipe, or a shared image's Dockerfile build)
        ("POST", "/v1/images/build?name=x:1"),
        ("POST", "/v1/images/build?name=x:1&project=not-mine"),  # (a project not its own)
        ("POST", "/v1/images/import"),
        ("POST", "/v1/principals/admin/rotate"),
        ("POST", "/v1/principals/admin/revoke"),
    ],
)
async def test_tenants_refused_admin_calls_before_the_body(env: Env, method: str, path: str) -> None:
    path, _, query = path.partition("?")
    body = endless(b'{"spec": {"image": "')
    r = await call(env.app, method, path, chunks=body, headers=bearer(env.tenant), query=query)
    assert (r.status, r.code, r.consumed) == (403, "forbidden", 0), r.body[:300]


# --- bodies bounded while streaming ------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "query", "headers", "cap"),
    [
        ("/run_jupyter", "", {}, LIMIT),  # JSON, behind FastAPI
        ("/sandboxfusion/{tenant}/run_code", "", {}, LIMIT),  # express lane, token in the path
        ("/run_code", "token={tenant}", {}, LIMIT),
        ("/v1/sandboxes/n0-000000000001/exec", "", {}, LIMIT),  # express lane
        ("/v1/sandboxes/n0-000000000001/sessions", "", {}, min(LIMIT, SMALL_BODY)),  # small route
        ("/v1/sandboxes", "", {}, min(LIMIT, SMALL_BODY)),
        ("/v1/sandboxes/n0-000000000001/archive", "path=/work", {"content-type": "application/x-tar"}, None),
        ("/swerex/n0-000000000001/write_file", "", {"x-api-key": "{tenant}"}, LIMIT),
        (
            "/swerex/n0-000000000001/upload",
            "",
            {"x-api-key": "{tenant}", "content-type": "multipart/form-data; boundary=xx"},
            LIMIT,
        ),
    ],
)
async def test_chunked_bodies_stop_at_the_cap(
    env: Env, path: str, query: str, headers: dict[str, str], cap: int | None
) -> None:
    limit = cap if cap is not None else MAX_ARCHIVE
    hdrs = {"authorization": f"Bearer {env.tenant}", "content-type": "application/json"}
    hdrs.update({k: v.replace("{tenant}", env.tenant) for k, v in headers.items()})
    r = await call(
        env.app,
        "POST" if "archive" not in path else "PUT",
        path.replace("{tenant}", env.tenant),
        chunks=endless(
            MULTIPART if "multipart" in hdrs["content-type"] else b'{"cells": ["', limit + 8 * CHUNK
        ),
        headers=hdrs,
        query=query.replace("{tenant}", env.tenant),
    )
    assert r.status == 413, r.body[:300]
    body = r.json()
    assert body["error"]["code"] == "payload_too_large"
    assert body["error"]["details"]["limit"] == limit
    assert limit < r.consumed <= limit + 2 * CHUNK, r.consumed  # stopped at the cap, not at the end
    if path.startswith("/swerex/"):
        assert "detail" in body


@pytest.mark.asyncio
async def test_declared_length_over_the_cap_is_refused_unread(env: Env) -> None:
    r = await call(
        env.app,
        "POST",
        "/v1/sandboxes",
        chunks=endless(),
        headers={**bearer(env.tenant), "content-length": str(SMALL_BODY + 1)},
        chunked=False,
    )
    assert (r.status, r.code, r.consumed) == (413, "payload_too_large", 0)


@pytest.mark.asyncio
async def test_a_body_under_the_cap_still_works(env: Env) -> None:
    big = json.dumps({"cmd": ["echo", "x" * (LIMIT - 1000)]}).encode()
    r = await call(
        env.app,
        "POST",
        "/v1/sandboxes/n0-000000000001/exec",
        chunks=iter([big[i : i + CHUNK] for i in range(0, len(big), CHUNK)]),
        headers=bearer(env.tenant),
    )
    # the recording edge answers for any project; what matters is that the body went through
    assert r.status == 200, r.body[:300]
    assert len(r.json()["stdout"]) == LIMIT - 1000 + 5


# --- malformed text and oversized environments: 4xx, not 500 -------------------------------------


LONE = [r"\ud800", r"\udfff", r"x\ud83d", r"\ude00y", r"\ud83d\ud83d\ude00", r"\\\ud800"]


@pytest.mark.asyncio
@pytest.mark.parametrize("text", LONE)
@pytest.mark.parametrize(
    ("path", "template"),
    [
        ("/v1/sandboxes/n0-000000000001/exec", '{"cmd": ["echo", "%s"]}'),  # express lane
        ("/v1/sandboxes/n0-000000000001/exec", '{"cmd": "echo", "env": {"A": "%s"}}'),
        ("/v1/sandboxes/n0-000000000001/sessions", '{"env": {"%s": "1"}}'),  # FastAPI route
        ("/v1/sandboxes", '{"labels": {"k": "%s"}}'),
        ("/run_code", '{"code": "print(\\"%s\\")"}'),
        ("/v1/sandboxes/n0-000000000001/files", '{"path": "/work/%s", "content": "x"}'),
    ],
)
async def test_lone_surrogates_are_a_clear_400(env: Env, path: str, template: str, text: str) -> None:
    body = (template % text).encode()
    json.loads(body)  # valid JSON: the text is the problem
    method = "PUT" if path.endswith("/files") else "POST"
    r = await call(env.app, method, path, chunks=iter([body]), headers=bearer(env.admin))
    assert r.status == 400, (r.status, r.body[:300])
    assert r.code == "invalid_request"
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.asyncio
async def test_surrogate_pairs_and_escaped_backslashes_pass(env: Env) -> None:
    for text in [r"\ud83d\ude00", r"\\ud800", "\u00e9", r"\u00e9\ud83d\ude00\u0041"]:
        body = json.dumps({"cmd": ["echo", "placeholder"]}).replace("placeholder", text).encode()
        r = await call(
            env.app,
            "POST",
            "/v1/sandboxes/n0-000000000001/exec",
            chunks=iter([body]),
            headers=bearer(env.admin),
        )
        assert r.status == 200, (text, r.body[:300])
        assert r.json()["stdout"] == "echo " + json.loads(body)["cmd"][1]


def test_check_json_text_agrees_with_json_loads() -> None:
    import random

    from dsec import errors

    pieces = [
        "\\",
        "\\u",
        "ud800",
        "udc00",
        "ud83d",
        "ude00",
        "a",
        '"',
        "\\\\",
        r"\ud800",
        r"\udc00",
        r"\uDBFF",
    ]
    rng = random.Random(7)
    checked = 0
    for _ in range(20000):
        text = '"' + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) + '"'
        try:
            value = json.loads(text)
        except ValueError:
            continue
        lone = any(0xD800 <= ord(c) <= 0xDFFF for c in value)
        try:
            check_json_text(text.encode())
            refused = False
        except errors.InvalidRequest:
            refused = True
        assert refused == lone, text
        checked += 1
    assert checked > 5000


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "env_field"),
    [
        ("/v1/sandboxes/n0-000000000001/exec", {"cmd": "true"}),
        ("/v1/sandboxes/n0-000000000001/sessions", {}),
    ],
)
@pytest.mark.parametrize(
    "variables",
    [
        {f"V{i}": "" for i in range(70000)},  # more than 65,535 variables
        {"BIG": "x" * (1 << 20)},  # one variable over the size bound
        {"A=B": "1"},
        {"A\u0000": "1"},
    ],
    ids=["count", "size", "equals", "nul"],
)
async def test_environment_bounds(
    env: Env, path: str, env_field: dict[str, Any], variables: dict[str, str]
) -> None:
    body = json.dumps({**env_field, "env": variables}).encode()
    edges: list[Any] = [RecordingEdge()]
    limit_app = create_api_app(iam=env.iam, cluster_token="c", local_edges=edges, max_body=8 << 20)
    await limit_app.state.dsec.directory.poll_once()
    r = await call(limit_app, "POST", path, chunks=iter([body]), headers=bearer(env.admin))
    assert r.status == 400 and r.code == "invalid_request", (r.status, r.body[:300])
    assert "env" in r.json()["error"]["message"]
