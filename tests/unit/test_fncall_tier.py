"""The tier policy of stateless calls in the apiserver's control plane (the edge is the
recording stand-in of test_express): a project whose allowed_backends exclude container is
refused before any edge sees the call; the names of workers that belong to no project (an
admin without projects, the anonymous SandboxFusion caller) have no policy and still run.
tests/e2e/test_fncall_tenancy.py runs the same through a real service."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from dsec import errors
from dsec.apiserver.app import create_api_app
from dsec.fncall.tenancy import ANONYMOUS, check_tier
from dsec.fncall.tier import container_only
from dsec.iam import IAM

from .test_express import RecordingEdge


def test_only_projects_have_a_policy(tmp_path: Path) -> None:
    iam = IAM(tmp_path / "iam.db")
    try:
        iam.create_project("vm-only", allowed_backends=["microvm"])
        with pytest.raises(errors.Forbidden) as e:
            check_tier(iam, "vm-only", "container")
        assert e.value.details["reason"] == "backend_not_allowed"
        check_tier(iam, "vm-only", "microvm")
        check_tier(iam, ANONYMOUS, "container")  # neither is a project: nothing to look up
        check_tier(iam, "principal:p-123", "container")
        with pytest.raises(errors.NotFound):
            check_tier(iam, "no-such-project", "container")  # a name that could be a project is one
    finally:
        iam.close()
    container_only("container")
    with pytest.raises(errors.UnsupportedOperation, match="container workers only"):
        container_only("gvisor")


@pytest.mark.asyncio
@pytest.mark.parametrize("compat_auth", [True, False])
async def test_calls_without_a_project_run_and_a_limited_project_is_refused(
    tmp_path: Path, compat_auth: bool
) -> None:
    iam = IAM(tmp_path / "iam.db")
    iam.bootstrap()
    iam.create_project("vm-only", allowed_backends=["microvm"])
    _, vm_token = iam.create_principal("vm-user", ["vm-only"])
    lone, loner = iam.create_principal("loner", [], admin=True)  # an admin of no project
    edge = RecordingEdge()
    app = create_api_app(
        iam=iam,
        cluster_token="c",
        local_edges=[edge],  # type: ignore[list-item]
        compat_auth=compat_auth,
    )
    await app.state.dsec.directory.poll_once()
    code = {"code": "print(1)"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/fncall/run", json=code, headers={"authorization": f"Bearer {loner}"})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/fncall/run", json=code, headers={"authorization": f"Bearer {vm_token}"})
            assert r.status_code == 403 and r.json()["error"]["details"]["reason"] == "backend_not_allowed"
            if compat_auth:
                r = await c.post(f"/run_code?token={vm_token}", json=code)
                assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
                r = await c.post(f"/run_code?token={loner}", json=code)
            else:
                r = await c.post("/run_code", json=code)  # anonymous
            assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    finally:
        iam.close()
    projects = [call[1]["project"] for call in edge.calls]
    loner_key = f"principal:{lone.id}"
    assert projects == [loner_key, loner_key if compat_auth else ANONYMOUS], projects
