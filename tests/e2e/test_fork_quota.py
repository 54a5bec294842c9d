"""Fork layers count against their project's snapshot quota (issue #11), on a real `dsec up`:
a fork takes a snapshot slot and the parent's writable-layer size before anything is copied,
is refused with quota_exceeded when over, and gives both back once its layer is gone (its
last child stopped; the apiserver learns it from the edges' status)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import Service, dsec_up

pytestmark = [pytest.mark.root, pytest.mark.e2e]

QUOTA = {"max_snapshots": 1, "max_snapshot_mb": 30, "max_sandboxes": 10}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, python_image: str) -> Iterator[Service]:
    extra = {"DSEC_APISERVER_RECONCILE_INTERVAL_S": "0.05", "DSEC_APISERVER_RESERVATION_GRACE_S": "0.5"}
    with dsec_up(tmp_path_factory.mktemp("dsec-fork-quota"), extra) as s:
        yield s


@pytest.fixture
def tenant(svc: Service) -> Iterator[tuple[httpx.Client, str]]:
    project = "forkq-" + secrets.token_hex(3)
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}, timeout=120) as a:
        assert a.post("/v1/projects", json={"name": project, "quota": QUOTA}).status_code == 200
        r = a.post("/v1/principals", json={"name": f"{project}-user", "projects": [project]})
        token = r.json()["token"]
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
        yield c, project


def _create(c: httpx.Client, project: str) -> str:
    r = c.post("/v1/sandboxes", json={"image": "python", "memory_mb": 256, "project": project})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _exec(c: httpx.Client, sid: str, cmd: str) -> None:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text


def _fork(c: httpx.Client, sid: str, n: int = 1) -> httpx.Response:
    return c.post(f"/v1/sandboxes/{sid}/fork", json={"n": n})


def _refused(r: httpx.Response, limit: str) -> None:
    assert r.status_code == 429, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == "quota_exceeded" and limit in err["message"], err


def _fork_layers(svc: Service) -> list[str]:
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}) as a:
        return [x for e in a.get("/v1/edges").json()["edges"] for x in e["fork_layers"]]


def _eventually(fn: Any, timeout: float = 15.0) -> httpx.Response:
    end = time.monotonic() + timeout
    while True:
        r: httpx.Response = fn()
        if r.status_code < 300 or time.monotonic() > end:
            return r
        time.sleep(0.1)


def test_a_fork_layer_holds_a_snapshot_slot_until_its_children_stop(
    svc: Service, tenant: tuple[httpx.Client, str]
) -> None:
    c, project = tenant
    sid = _create(c, project)
    _exec(c, sid, "mkdir -p /work && echo hi > /work/f")
    snap = c.post(f"/v1/sandboxes/{sid}/snapshot", json={})
    assert snap.status_code == 201, snap.text
    _refused(_fork(c, sid), "max_snapshots")  # the snapshot holds the only slot
    assert not [x for x in _fork_layers(svc) if x.startswith(f"{sid}-")]  # refused before the copy
    assert c.delete(f"/v1/snapshots/{snap.json()['id']}").status_code == 204

    r = _fork(c, sid, 2)
    assert r.status_code == 201, r.text
    kids = [k["id"] for k in r.json()["sandboxes"]]
    end = time.monotonic() + 10  # the admin sees the layer (the watcher's next status poll)...
    while not [x for x in _fork_layers(svc) if x.startswith(f"{sid}-")]:
        assert time.monotonic() < end, "no edge reports the fork layer"
        time.sleep(0.1)
    assert all(e["fork_layers"] == [] for e in c.get("/v1/edges").json()["edges"])  # ...no tenant
    _refused(c.post(f"/v1/sandboxes/{sid}/snapshot", json={}), "max_snapshots")  # the layer holds it
    _refused(_fork(c, sid), "max_snapshots")
    _refused(_fork(c, kids[0]), "max_snapshots")  # a fork of a fork is a layer of its own

    c.delete(f"/v1/sandboxes/{kids[0]}")
    time.sleep(2)  # many reconciler rounds past the grace: one child still stacks the layer
    _refused(_fork(c, sid), "max_snapshots")
    c.delete(f"/v1/sandboxes/{kids[1]}")
    r = _eventually(lambda: _fork(c, sid))  # the layer is gone: its slot comes back
    assert r.status_code == 201, r.text
    for k in r.json()["sandboxes"]:
        c.delete(f"/v1/sandboxes/{k['id']}")
    c.delete(f"/v1/sandboxes/{sid}")


def test_a_fork_bigger_than_the_snapshot_budget_is_refused_before_the_copy(
    svc: Service, tenant: tuple[httpx.Client, str]
) -> None:
    c, project = tenant
    sid = _create(c, project)
    _exec(c, sid, "mkdir -p /work && head -c 41943040 /dev/urandom > /work/big")  # 40 MiB > 30
    _refused(_fork(c, sid, 3), "max_snapshot_mb")
    assert not [x for x in _fork_layers(svc) if x.startswith(f"{sid}-")]
    assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == 1  # no child kept either

    _exec(c, sid, "head -c 20971520 /work/big > /work/small && rm /work/big")  # 20 MiB fits
    r = _fork(c, sid)
    assert r.status_code == 201, r.text
    (kid,) = (k["id"] for k in r.json()["sandboxes"])
    assert r.json()["sandboxes"][0]["fork_layer"]["size_bytes"] >= 20 << 20
    # the layer's 20 MiB are held: a snapshot of another 20 MiB does not fit beside it
    other = _create(c, project)
    _exec(c, other, "mkdir -p /work && head -c 20971520 /dev/urandom > /work/x")
    _refused(c.post(f"/v1/sandboxes/{other}/snapshot", json={}), "max_snapshot")
    c.delete(f"/v1/sandboxes/{kid}")
    snap = _eventually(lambda: c.post(f"/v1/sandboxes/{other}/snapshot", json={}))
    assert snap.status_code == 201, snap.text  # only once the fork layer is gone
    assert c.delete(f"/v1/snapshots/{snap.json()['id']}").status_code == 204
    for s in (sid, other):
        c.delete(f"/v1/sandboxes/{s}")
