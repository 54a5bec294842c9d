"""Express lanes (routes.Express) against FastAPI's own routing: the same requests through an
apiserver with its lanes and one without must give the same statuses, bodies and edge calls,
for good input and bad. The edge is a recording stand-in (control-plane logic only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import errors
from dsec.apiserver.app import create_api_app
from dsec.http.output import HeldReply
from dsec.http.routes import Express, Gate
from dsec.iam import IAM
from dsec.models import (
    EdgeStatus,
    ExecResult,
    FileWrite,
    FnCallRequest,
    FnCallResult,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SessionResult,
    Stage,
)


class RecordingEdge:
    """Answers the hot calls and records them; sandbox n0-gone does not exist."""

    url = None
    name = "n0"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def _check(self, sid: str) -> None:
        if sid == "n0-gone":
            raise errors.SandboxNotFound(f"there is no sandbox {sid}")

    async def status(self) -> EdgeStatus:
        return EdgeStatus(
            name="n0",
            healthy=True,
            backends=["container"],
            capacity={"sandboxes": 100, "cpu": 100, "memory_mb": 10**6},
            used={"sandboxes": 0, "cpu": 0, "memory_mb": 0},
            sandboxes=0,
            by_image={},
            by_project={},
            layers=[],
            images=["python", "code"],
        )

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        self.calls.append(("create", spec.model_dump()))
        n = sum(1 for c in self.calls if c[0] == "create")
        return SandboxInfo(
            id=f"n0-{n:012d}", state=SandboxState.RUNNING, spec=spec, edge="n0", created_at=0, last_active=0
        )

    async def exec_reply(self, sid: str, req: Any, projects: Any) -> HeldReply:
        self._check(sid)
        self.calls.append(("exec", sid, req.model_dump(), sorted(projects or [])))
        out = " ".join(req.cmd) if isinstance(req.cmd, list) else req.cmd
        res = ExecResult(stdout=out, stderr="", exit_code=0, duration=0.0)
        return HeldReply(res, [res.model_dump_json().encode()], lambda: None)

    async def session_run(self, sid: str, ses: str, req: Any, projects: Any) -> SessionResult:
        self._check(sid)
        self.calls.append(("session_run", sid, ses, req.model_dump()))
        return SessionResult(output="ok", exit_code=0, duration=0.0)

    async def write_file(self, sid: str, req: FileWrite, projects: Any) -> None:
        self._check(sid)
        self.calls.append(("write_file", sid, req.model_dump()))

    async def stop(self, sid: str, projects: Any) -> None:
        self._check(sid)
        self.calls.append(("stop", sid))

    async def fncall_run(self, req: FnCallRequest) -> FnCallResult:
        if req.language not in ("python", "bash"):
            raise errors.InvalidRequest(f"language {req.language!r} is not supported")
        self.calls.append(("fncall_run", req.model_dump()))
        return FnCallResult(run=Stage(status="Finished", return_code=0, stdout=req.code), worker="w1")

    async def list(self, labels: Any, project: Any, projects: Any) -> list[SandboxInfo]:
        return []

    async def aclose(self) -> None:
        pass


REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    # good input
    ("POST", "/v1/sandboxes", {"json": {"image": "python", "memory_mb": 256}}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": {"cmd": ["echo", "hi"], "timeout": 5}}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": {"cmd": "echo $X", "env": {"X": "1"}}}),
    ("POST", "/v1/sandboxes/n0-000000000001/sessions/s1/run", {"json": {"code": "ls"}}),
    ("PUT", "/v1/sandboxes/n0-000000000001/files", {"json": {"path": "/work/a", "content": "hi"}}),
    ("DELETE", "/v1/sandboxes/n0-000000000001", {}),
    ("POST", "/v1/fncall/run", {"json": {"code": "print(1)"}}),
    ("POST", "/run_code", {"json": {"code": "print(2)", "language": "python", "extra": 1}}),
    ("POST", "/sandboxfusion/{admin}/run_code", {"json": {"code": "print(3)"}, "token": None}),
    # bad input: each must get FastAPI's (or the endpoint's) own answer
    ("POST", "/v1/sandboxes", {"json": {"image": "python", "memory_mb": -1}}),
    ("POST", "/v1/sandboxes", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("POST", "/v1/sandboxes", {"content": b"", "headers": {"content-type": "application/json"}}),
    ("POST", "/v1/sandboxes", {"content": b'{"image": "python"}', "headers": {"content-type": "text/plain"}}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": {"cmd": [], "timeout": -3}}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": {"timeout": 5}}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": ["not", "an", "object"]}),
    ("POST", "/v1/sandboxes/n0-gone/exec", {"json": {"cmd": ["true"]}}),
    ("POST", "/v1/sandboxes/zz-unknown-edge/exec", {"json": {"cmd": ["true"]}}),
    ("PUT", "/v1/sandboxes/n0-000000000001/files", {"json": {"path": "/work/a"}}),
    ("DELETE", "/v1/sandboxes/n0-gone", {}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": {"cmd": ["x" * 5000]}, "token": "wrong"}),
    ("POST", "/v1/sandboxes/n0-000000000001/exec", {"json": {"cmd": ["x" * 5000]}, "token": None}),
    ("POST", "/v1/fncall/run", {"json": {"code": "x", "run_timeout": -1}}),
    ("POST", "/v1/fncall/run", {"json": {"code": "x", "language": "cobol"}}),
    ("POST", "/run_code", {"json": {"code": "x", "run_timeout": -1}}),  # 422 raised inside
    ("POST", "/run_code", {"json": {"code": "x", "language": "brainfuck"}}),
    ("POST", "/run_code", {"json": {"language": "python"}}),
    ("POST", "/sandboxfusion/wrong/run_code", {"json": {"code": "print(4)"}, "token": None}),
]


async def _run(tmp: Path, *, lanes: bool) -> tuple[list[tuple[int, Any]], list[tuple[Any, ...]]]:
    iam = IAM(tmp / "iam.db")
    admin = iam.bootstrap()
    edge = RecordingEdge()
    app = create_api_app(iam=iam, cluster_token="c", local_edges=[edge], max_body=4096)  # type: ignore[list-item]
    express: Express = next(m.kwargs["express"] for m in app.user_middleware)
    assert {(m, lane.path.pattern) for m, ls in express.lanes.items() for lane in ls}, "no lanes installed"
    if not lanes:
        express.lanes.clear()
    await app.state.dsec.directory.poll_once()
    out: list[tuple[int, Any]] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for method, path, kw in REQUESTS:
            kw = dict(kw)
            token = kw.pop("token", admin)
            headers = dict(kw.pop("headers", {}))
            if token is not None:
                headers["authorization"] = f"Bearer {token}"
            r = await c.request(method, path.replace("{admin}", admin), headers=headers, **kw)
            body = r.json() if r.content else None
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                body["error"].pop("request_id", None)
            out.append((r.status_code, body))
    iam.close()
    return out, edge.calls


@pytest.mark.asyncio
async def test_lanes_answer_exactly_as_fastapi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    taken: list[str] = []
    original = Gate._express

    async def counting(
        self: Gate, lane: Any, kwargs: Any, body: Any, scope: Any, receive: Any, send: Any
    ) -> None:
        taken.append(scope["path"])
        await original(self, lane, kwargs, body, scope, receive, send)

    monkeypatch.setattr(Gate, "_express", counting)
    fast, fast_calls = await _run(tmp_path / "a", lanes=True)
    # every authenticated request on a lane path took the lane (good input and bad); the three
    # with a bad or no token (two bearer, one SandboxFusion path token) were refused before it
    assert len(taken) == len(REQUESTS) - 3, taken
    taken.clear()
    slow, slow_calls = await _run(tmp_path / "b", lanes=False)
    assert not taken
    for (method, path, _), f, s in zip(REQUESTS, fast, slow, strict=True):
        assert f == s, f"{method} {path}: express {json.dumps(f)[:300]} != fastapi {json.dumps(s)[:300]}"
    assert fast_calls == slow_calls
    # the good calls reached the edge, the bad ones did not
    good = ["create", "exec", "exec", "session_run", "write_file", "stop", "fncall_run", "fncall_run"]
    assert [c[0] for c in fast_calls] == [*good, "fncall_run"]
    statuses = [f[0] for f in fast]
    assert statuses[:9] == [201, 200, 200, 200, 204, 204, 200, 200, 200]
    assert all(400 <= st < 500 for st in statuses[9:]), statuses


def test_lane_matching_is_exact() -> None:
    async def endpoint(**_: Any) -> Any:
        raise AssertionError

    ex = Express()
    ex.add("POST", "/v1/sandboxes/{sid}/exec", endpoint)
    ex.add("DELETE", "/v1/sandboxes/{sid}", endpoint)

    def hit(method: str, path: str) -> dict[str, str] | None:
        m = ex.match({"method": method, "path": path})
        return m[1] if m else None

    assert hit("POST", "/v1/sandboxes/n0-abc/exec") == {"sid": "n0-abc"}
    assert hit("POST", "/v1/sandboxes/n0-abc/exec/stream") is None
    assert hit("GET", "/v1/sandboxes/n0-abc/exec") is None
    assert hit("DELETE", "/v1/sandboxes/n0-abc") == {"sid": "n0-abc"}
    assert hit("DELETE", "/v1/sandboxes/n0-abc/files") is None
    assert hit("DELETE", "/v1/sandboxes/") is None
