"""fncall workers per project through HTTP on a real `dsec up` with one fncall worker: the
apiserver passes the caller's project down (native API and SandboxFusion endpoints), so a
worker that ran one tenant's code never runs another's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from .conftest import Service, dsec_up

pytestmark = [pytest.mark.root, pytest.mark.e2e]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, python_image: str, code_image: str) -> Iterator[Service]:
    """`dsec up` with one fncall worker per image."""
    extra = {"DSEC_EDGE_FNCALL_WORKERS": "1"}
    with dsec_up(tmp_path_factory.mktemp("dsec-fncall-tenancy"), extra) as s:
        yield s


def tenant(svc: Service, project: str) -> str:
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}, timeout=30) as c:
        assert c.post("/v1/projects", json={"name": project}).status_code == 200
        r = c.post("/v1/principals", json={"name": f"{project}-user", "projects": [project]})
        assert r.status_code == 200, r.text
        return str(r.json()["token"])


def run_code(svc: Service, token: str, code: str) -> dict[str, object]:
    body = {"code": code, "language": "python"}
    r = httpx.post(f"{svc.url}/run_code?token={token}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def test_workers_follow_the_callers_project(svc: Service) -> None:
    alice, bob = tenant(svc, "fn-alice"), tenant(svc, "fn-bob")
    a1 = run_code(svc, alice, "print('a')")
    a2 = run_code(svc, alice, "print('a')")
    assert a1["status"] == a2["status"] == "Success"
    assert a1["executor_pod_name"] == a2["executor_pod_name"]  # her worker stays hers
    b = run_code(svc, bob, "print('b')")
    assert b["status"] == "Success" and b["executor_pod_name"] != a1["executor_pod_name"]
    # The native API: bob asking for alice's project is refused; his own works.
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {bob}"}, timeout=120) as c:
        r = c.post("/v1/fncall/run", json={"code": "print(1)", "project": "fn-alice"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        r = c.post("/v1/fncall/run", json={"code": "print(2)"})
        assert r.status_code == 200 and r.json()["worker"] == b["executor_pod_name"], r.text
        r = c.post("/v1/fncall/jupyter", json={"cells": ["6 * 7"]})
        assert r.status_code == 200 and r.json()["worker"] == b["executor_pod_name"], r.text
    a3 = run_code(svc, alice, "print('a')")
    assert a3["executor_pod_name"] not in (a1["executor_pod_name"], b["executor_pod_name"])
