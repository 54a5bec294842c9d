"""fncall workers per project through HTTP on a real `dsec up` with one fncall worker: the
apiserver passes the caller's project down (native API and SandboxFusion endpoints), so a
worker that ran one tenant's code never runs another's; and the project's tier policy
(allowed_backends) binds these calls as it binds creates: workers are container sandboxes."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

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


def tenant(svc: Service, project: str, **fields: Any) -> str:
    """A project (with `fields`: allowed_backends, parent) and a principal of it; its token."""
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}, timeout=30) as c:
        r = c.post("/v1/projects", json={"name": project, **fields})
        assert r.status_code == 200, r.text
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


# --- the tier policy ------------------------------------------------------------------------------

NATIVE = (("/v1/fncall/run", {"code": "print(1)"}), ("/v1/fncall/jupyter", {"cells": ["1"]}))


def assert_tier_refused(r: httpx.Response, project: str, allowed: str) -> None:
    """The answer a create gets from a project whose policy excludes container sandboxes."""
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "forbidden", err
    assert err["details"]["reason"] == "backend_not_allowed", err
    assert err["details"]["allowed"] == [allowed] and err["details"]["backend"] == "container", err
    assert f"project {project!r} may run sandboxes only on the backends {allowed}" in err["message"]


def test_a_project_tier_policy_binds_fncall_and_sandboxfusion(svc: Service) -> None:
    """A project limited to microVMs, and the child of a gVisor-only project (policies are
    inherited), cannot run code on the container workers through any stateless endpoint: the
    native run and jupyter, SandboxFusion's run_code and run_jupyter (token in the query or
    the path); an admin naming the project is refused too, as its creates are."""
    suffix = secrets.token_hex(3)
    vm_project, gv_project = f"fn-vm-{suffix}", f"fn-gv-{suffix}"
    vm = tenant(svc, vm_project, allowed_backends=["microvm"])
    tenant(svc, gv_project, allowed_backends=["gvisor"])
    kid_project = f"{gv_project}-kid"
    kid = tenant(svc, kid_project, parent=gv_project)  # no policy of its own: its parent's
    for token, project, allowed in ((vm, vm_project, "microvm"), (kid, kid_project, "gvisor")):
        with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
            for body in ({"code": "print(1)"}, {"code": "print(1)", "backend": "container"}):
                assert_tier_refused(c.post("/v1/fncall/run", json=body), project, allowed)
            assert_tier_refused(c.post("/v1/fncall/jupyter", json={"cells": ["1"]}), project, allowed)
            # the create gives the same answer
            r = c.post("/v1/sandboxes", json={"image": "code", "project": project})
            assert_tier_refused(r, project, allowed)
        code = {"code": "print(1)", "language": "python"}
        for url in (f"{svc.url}/run_code?token={token}", f"{svc.url}/sandboxfusion/{token}/run_code"):
            assert_tier_refused(httpx.post(url, json=code, timeout=120), project, allowed)
        cells = {"cells": ["1"]}
        for url in (f"{svc.url}/run_jupyter?token={token}", f"{svc.url}/sandboxfusion/{token}/run_jupyter"):
            assert_tier_refused(httpx.post(url, json=cells, timeout=120), project, allowed)
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}, timeout=120) as c:
        r = c.post("/v1/fncall/run", json={"code": "print(1)", "project": vm_project})
        assert_tier_refused(r, vm_project, "microvm")
        # its own project (default) has no policy: the admin's calls run
        r = c.post("/v1/fncall/run", json={"code": "print(6 * 7)"})
        assert r.status_code == 200 and r.json()["run"]["stdout"] == "42\n", r.text
        # an admin with no project gets workers of its own (principal:<id>), which no policy limits
        r = c.post("/v1/principals", json={"name": f"loner-{suffix}", "projects": [], "admin": True})
        assert r.status_code == 200, r.text
        loner = r.json()["token"]
    r = httpx.post(f"{svc.url}/run_code?token={loner}", json={"code": "print(7)"}, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {loner}"}, timeout=120) as c:
        r = c.post("/v1/fncall/jupyter", json={"cells": ["6 * 7"]})
        assert r.status_code == 200 and r.json()["cells"][0]["display"] == [{"text/plain": "42"}], r.text


def test_fncall_runs_on_container_workers_only(svc: Service) -> None:
    """An unrestricted project runs code (backend container, the default, or named); a known
    backend other than container is unsupported_operation saying what to do instead (also
    for a project whose policy allows only that backend); an unknown one gets the create's
    own answer."""
    suffix = secrets.token_hex(3)
    project = f"fn-open-{suffix}"
    token = tenant(svc, project)
    vm = tenant(svc, f"fn-vm2-{suffix}", allowed_backends=["microvm"])
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
        for extra in ({}, {"backend": "container"}):
            r = c.post("/v1/fncall/run", json={"code": "print(6 * 7)", **extra})
            assert r.status_code == 200 and r.json()["run"]["stdout"] == "42\n", r.text
            r = c.post("/v1/fncall/jupyter", json={"cells": ["6 * 7"], **extra})
            assert r.status_code == 200 and r.json()["cells"][0]["display"] == [{"text/plain": "42"}], r.text
        r = httpx.post(f"{svc.url}/run_code?token={token}", json={"code": "print(6 * 7)"}, timeout=120)
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
        known = {b["name"] for b in c.get("/v1/backends").json()["backends"]}
        assert "gvisor" in known, known
        for backend in sorted(known - {"container"}):
            for path, body in NATIVE:
                r = c.post(path, json={**body, "backend": backend})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "unsupported_operation", err
                assert err["details"] == {"reason": "backend", "backend": backend, "operation": "fncall"}, err
                assert "container workers only" in err["message"], err
                assert f"create a sandbox with backend={backend!r}" in err["message"], err
        # the create's answer to a backend no edge runs, and to a malformed name
        for backend in ("nosuch", "No Such"):
            create = c.post("/v1/sandboxes", json={"image": "code", "project": project, "backend": backend})
            want = create.json()["error"]
            assert create.status_code == 400 and want["code"] == "invalid_request", create.text
            for path, body in NATIVE:
                r = c.post(path, json={**body, "backend": backend})
                assert r.status_code == 400, r.text
                got = r.json()["error"]
                assert (got["code"], got["message"], got["details"]) == (
                    want["code"], want["message"], want["details"]
                ), (got, want)  # fmt: skip
        r = c.post("/v1/fncall/run", json={"code": "print(1)", "backend": "nosuch"})
        assert r.json()["error"]["details"]["reason"] == "unknown_backend", r.text
    if "microvm" in known:
        # allowed by its policy, but fncall has no microVM workers: make a microVM sandbox instead
        with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {vm}"}, timeout=120) as c:
            r = c.post("/v1/fncall/run", json={"code": "print(1)", "backend": "microvm"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_operation", r.text
            assert "backend='microvm'" in r.json()["error"]["message"]
