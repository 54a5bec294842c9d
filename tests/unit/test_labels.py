"""Label keys under `dsec.` are the platform's: the apiserver refuses them from users (a planted
`dsec.idempotency` could be adopted by another principal's create taken over from a dead
apiserver), and forks and restores do not inherit the idempotency label."""

from __future__ import annotations

from pathlib import Path

import httpx

from dsec.apiserver.app import create_api_app
from dsec.iam import IAM
from dsec.models import inherited_labels

from .test_placement import FakeEdge


async def test_users_cannot_set_platform_labels(tmp_path: Path) -> None:
    iam = IAM(tmp_path / "iam.db")
    admin = iam.bootstrap()
    edge = FakeEdge("e0", 100)
    app = create_api_app(iam=iam, cluster_token="c", local_edges=[edge])  # type: ignore[list-item]
    await app.state.dsec.directory.poll_once()
    headers = {"authorization": f"Bearer {admin}"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for key in ("dsec.idempotency", "dsec.fork-of", "dsec.anything"):
                for path, body, extra in (
                    ("/v1/sandboxes", {"labels": {key: "x", "team": "a"}}, {}),
                    ("/v1/sandboxes", {"labels": {key: "x"}}, {"idempotency-key": "k1"}),
                    ("/v1/sandboxes/batch", {"count": 2, "spec": {"labels": {key: "x"}}}, {}),
                    ("/v1/checkpoints/e0-ck/restore", {"labels": {key: "x"}}, {}),
                ):
                    r = await c.post(path, json=body, headers={**headers, **extra})
                    assert r.status_code == 400, (path, r.text)
                    err = r.json()["error"]
                    assert err["code"] == "invalid_request" and err["details"]["reason"] == "reserved_label"
                    assert key in err["message"] and "rename it" in err["message"]
            assert edge.created == []  # nothing was made
            r = await c.post("/v1/sandboxes", json={"labels": {"team": "a", "dsecx": "ok"}}, headers=headers)
            assert r.status_code == 201, r.text
    finally:
        iam.close()


def test_forks_and_restores_inherit_labels_but_not_the_idempotency_label() -> None:
    parent = {"team": "a", "dsec.idempotency": "0" * 32, "dsec.fork-of": "e0-older"}
    assert inherited_labels(parent, fork_of="e0-1") == {"team": "a", "dsec.fork-of": "e0-1"}
    assert inherited_labels(parent, restored_from="e0-ck") == {
        "team": "a",
        "dsec.fork-of": "e0-older",
        "dsec.restored-from": "e0-ck",
    }
