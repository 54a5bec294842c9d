"""Each operation is declared once, or checked against its other statements here (issue #12):

- every express lane is derived from a FastAPI route (method, path, body model, endpoint);
- every request the SDK builds (dsec.client._calls) and every request the apiserver's edge
  client sends (HttpEdge) hits a route the server declares, with that method;
- LocalEdge and HttpEdge implement every operation of EdgeAPI, with its parameters;
- the sync and async SDKs offer the same calls with the same parameters and defaults.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

import dsec.client._async as sdk_async
import dsec.client._calls as sdk_calls
import dsec.client._sync as sdk_sync
from dsec.apiserver.app import create_api_app
from dsec.apiserver.edges import HttpEdge
from dsec.config import EdgeSettings
from dsec.edge.local import LocalEdge
from dsec.edge.server import create_edge_app
from dsec.edgeapi import EdgeAPI
from dsec.http.routes import Express, Gate
from dsec.iam import IAM

METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}


@pytest.fixture(scope="module")
def api_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    iam = IAM(tmp_path_factory.mktemp("iam") / "iam.db")
    return create_api_app(iam=iam, cluster_token="c", local_edges=[])


@pytest.fixture(scope="module")
def edge_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    d = tmp_path_factory.mktemp("edge")
    settings = EdgeSettings(name="decl", data_dir=d / "data", run_dir=d / "run", fncall_image="")
    return create_edge_app(settings, token="t", public_url="http://127.0.0.1:1", apiservers=[])


def _express(app: FastAPI) -> Express:
    for m in app.user_middleware:
        if m.cls is Gate and m.kwargs.get("express") is not None:
            return m.kwargs["express"]  # type: ignore[no-any-return]
    raise AssertionError("the app has no express lanes")


def _routes(app: FastAPI) -> list[Any]:
    """Every API route as served: an APIRoute, or each route of an included router (FastAPI
    >= 0.165 keeps those in an `_IncludedRouter`; each candidate carries the effective path,
    methods, endpoint and dependant)."""
    out: list[Any] = []
    for r in app.routes:
        if isinstance(r, APIRoute):
            out.append(r)
        elif hasattr(r, "effective_candidates"):
            out.extend(c for c in r.effective_candidates() if c.methods)
    return out


@pytest.mark.parametrize("which", ["api_app", "edge_app"])
def test_every_lane_is_its_route(which: str, request: pytest.FixtureRequest) -> None:
    app = request.getfixturevalue(which)
    lanes = [lane for group in _express(app).lanes.values() for lane in group]
    assert len(lanes) >= 5  # create, stop, exec, session run, file write (+ fncall, SandboxFusion)
    for lane in lanes:
        matches = [r for r in _routes(app) if r.endpoint is lane.endpoint]
        assert len(matches) == 1, f"lane {lane.method} {lane.path.pattern} has no route of its own"
        route = matches[0]
        assert route.methods == {lane.method}
        template = re.sub(r"\{\w+\}", "x1", route.path_format)
        assert lane.path.match(template) and route.path_regex.match(template)
        body = route.dependant.body_params
        assert (body[0].field_info.annotation if body else None) is lane.body
        assert (body[0].name if body else "body") == lane.body_arg


def _requests_in(module_file: str) -> list[tuple[str, str, int]]:
    """(method, path with every variable part as `x1`, line) of every call in the file shaped
    like `f("METHOD", path, ...)`: the SDK's Request(...), HttpEdge's self._call(...)."""
    tree = ast.parse(Path(module_file).read_text())
    namespace = vars(sdk_calls)
    out = []

    def path_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "x1" for v in node.values)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in namespace:
            args = [a.value if isinstance(a, ast.Constant) else "x1" for a in node.args]
            return str(namespace[node.func.id](*args))
        return None

    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and len(node.args) >= 2):
            continue
        method = node.args[0]
        if not (isinstance(method, ast.Constant) and method.value in METHODS):
            continue
        path = path_of(node.args[1])
        assert path is not None, f"{module_file}:{node.lineno}: a request path this test cannot read"
        out.append((method.value, path.split("?")[0], node.lineno))
    return out


def _served(app: FastAPI, method: str, path: str) -> bool:
    return any(method in r.methods and r.path_regex.match(path) for r in _routes(app))


def test_every_sdk_request_hits_a_declared_route(api_app: FastAPI) -> None:
    requests = _requests_in(sdk_calls.__file__)
    assert len(requests) >= 40
    missing = [f"{m} {p} (line {n})" for m, p, n in requests if not _served(api_app, m, p)]
    assert not missing, f"the SDK sends requests no route of the apiserver declares: {missing}"


def test_every_edge_client_request_hits_a_declared_edge_route(edge_app: FastAPI) -> None:
    import dsec.apiserver.edges as edges

    requests = _requests_in(edges.__file__)
    assert len(requests) >= 25
    missing = [f"{m} {p} (line {n})" for m, p, n in requests if not _served(edge_app, m, p)]
    assert not missing, f"HttpEdge sends requests the edge server does not declare: {missing}"


def _params(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_both_edge_implementations_take_every_operation_as_declared() -> None:
    ops = sorted(EdgeAPI.__abstractmethods__)
    assert len(ops) >= 40
    for impl in (LocalEdge, HttpEdge):
        assert not impl.__abstractmethods__, impl
        for op in ops:
            declared, actual = getattr(EdgeAPI, op), getattr(impl, op)
            assert [p[0] for p in _params(actual)] == [p[0] for p in _params(declared)], (
                f"{impl.__name__}.{op}"
            )
            assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(declared) or (
                inspect.isasyncgenfunction(actual)
            ), f"{impl.__name__}.{op}"


PAIRS = [
    (sdk_sync.Client, sdk_async.AsyncClient),
    (sdk_sync.Sandbox, sdk_async.AsyncSandbox),
    (sdk_sync.Session, sdk_async.AsyncSession),
    (sdk_sync.Files, sdk_async.AsyncFiles),
]
RENAMED = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}


@pytest.mark.parametrize(("sync", "async_"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_sync_and_async_sdk_offer_the_same_calls(sync: type, async_: type) -> None:
    def public(cls: type) -> dict[str, object]:
        return {
            n: f
            for n, f in vars(cls).items()
            if callable(f) and (not n.startswith("_") or n in RENAMED or n in RENAMED.values())
        }

    s, a = public(sync), public(async_)

    def counterpart(name: str) -> str:
        return name if name in a else RENAMED.get(name, name)

    assert {counterpart(n) for n in s} == set(a)
    for name, fn in s.items():
        other = a[counterpart(name)]
        assert _params(fn) == _params(other), f"{sync.__name__}.{name} and {async_.__name__}.{name} differ"
