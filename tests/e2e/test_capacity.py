"""Elastic capacity on a real `dsec cluster up` cluster (issue #14 item 7): one apiserver whose
node provider is the local cluster, two edges of 4 sandboxes each. A tenant's burst of 10 is
pre-warmed on both edges and, as they are short by 2, on a third edge the provider starts for
real (a namespace and a process); that edge becomes healthy and takes placements; a drained
edge takes none while its sandboxes keep answering (`dsec edge drain`); an edge that stays
idle is released: its process and namespace are gone. Everything is removed at the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from dsec import errors
from dsec.client import Client
from dsec.cluster import local

from .conftest import cluster_up

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

DSEC = [sys.executable, "-m", "dsec.cli"]
SHAPE = {"memory_mb": 64, "cpu": 0.5}


def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _cli(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DSEC, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        return b"dsec" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _acting(urls: list[str], admin: str) -> str:
    """The apiserver that acts on bursts (the first to start its capacity loop)."""
    for _ in range(100):
        for u in urls:
            r = httpx.get(u + "/v1/capacity", headers={"authorization": f"Bearer {admin}"})
            if r.status_code == 200 and r.json()["acting"]:
                return u
        time.sleep(0.1)
    raise AssertionError("no apiserver acts on bursts")


def test_bursts_grow_drain_and_release_edges_of_a_local_cluster() -> None:
    base = Path(tempfile.mkdtemp(prefix="dsec-capacity-", dir="/tmp"))
    os.chmod(base, 0o755)  # (PostgreSQL, as its own user, must reach the cluster dir)
    d = base / "cluster"
    env = {
        **os.environ,
        "DSEC_EDGE_FNCALL_IMAGE": "",
        "DSEC_EDGE_MAX_SANDBOXES": "4",
        "DSEC_APISERVER_MIN_EDGES": "2",
        "DSEC_APISERVER_CAPACITY_LEAD_S": "0",
    }
    up = _cli(["cluster", "up", "--apiservers", "2", "--edges", "2", "--dir", str(d), "--elastic",
               "--idle-drain-after", "3", "--json"], env, timeout=300)  # fmt: skip
    assert up.returncode == 0, up.stderr[-3000:]
    state = local.ClusterState.load(d)
    pids = [m.pid for m in [*state.apiservers, *state.edges]]
    netns: list[str] = [e.netns for e in state.edges]
    admin = state.token
    try:
        e0, e1 = (e.name for e in state.edges)
        # two apiservers on one PostgreSQL: one acts on bursts, the other takes announcements
        acting = _acting([a.url for a in state.apiservers], admin)
        (url,) = [a.url for a in state.apiservers if a.url != acting]
        (acting_pid,) = [a.pid for a in state.apiservers if a.url == acting]
        with Client(url, admin) as root:
            for name in ("rl", "other"):
                httpx.post(
                    url + "/v1/projects", json={"name": name}, headers={"authorization": f"Bearer {admin}"}
                ).raise_for_status()
            tokens = {}
            for who, project in (("trainer", "rl"), ("stranger", "other")):
                r = httpx.post(
                    url + "/v1/principals",
                    json={"name": who, "projects": [project]},
                    headers={"authorization": f"Bearer {admin}"},
                )
                r.raise_for_status()
                tokens[who] = r.json()["token"]
            tenant = tokens["trainer"]

            with Client(url, tenant) as c, Client(acting, tenant) as on_acting:
                # a tenant announces only for its own projects
                with pytest.raises(errors.Forbidden):
                    c.announce_capacity("default", 4)
                burst = c.announce_capacity("rl", 10, **SHAPE)  # type: ignore[arg-type]
                assert burst.project == "rl" and burst.count == 10
                # taken by one apiserver, acted on by the other: both list it; no other tenant does
                assert [b.id for b in on_acting.capacity()] == [burst.id]
                for u in (url, acting):
                    with Client(u, tokens["stranger"]) as stranger:
                        assert stranger.capacity() == []

                # the acting apiserver pre-warms both edges (4 each) and, short by 2, asks the
                # provider for an edge; once that edge is started it is SIGKILLed: the other
                # apiserver takes the burst up, waits for that edge (asking for none) and
                # pre-warms the last 2 there
                def edge_started() -> bool:
                    return len([e for e in local.ClusterState.load(d).edges if e.pid]) == 3

                _wait(edge_started, 120, "the provider started an edge")
                os.kill(acting_pid, signal.SIGKILL)
                (b,) = c.capacity()
                assert b.state == "provisioning" and b.edges_requested == 1, b.actions

                def done() -> bool:
                    (b,) = c.capacity()
                    return b.state not in ("scheduled", "provisioning")

                _wait(done, 120, "the burst provisioned")
                (b,) = c.capacity()
                assert b.state == "ready", b.actions
                assert any("taken up by another apiserver" in a for a in b.actions), b.actions
                assert len(b.edges_added) == 1, b.actions
                e2 = b.edges_added[0]
                assert b.prewarmed == {e0: 4, e1: 4, e2: 2}, b.actions
                assert b.edges_requested == 1
                assert len(local.ClusterState.load(d).edges) == 3  # no edge asked for twice

            # the new edge is real: in cluster.json, its own process in its own namespace
            added = next(e for e in local.ClusterState.load(d).edges if e.name == e2)
            pids.append(added.pid)
            netns.append(added.netns)
            assert _alive(added.pid)
            assert os.readlink(f"/proc/{added.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            assert httpx.get(url + "/v1/health").json()["edges"] == 3

            def pooled() -> dict[str, int]:
                return {p["edge"]: p["ready"] for p in root_pools()}

            def root_pools() -> list[dict[str, object]]:
                r = httpx.get(url + "/v1/pools", headers={"authorization": f"Bearer {admin}"})
                return [p for p in r.json()["pools"] if p["spec"]["memory_mb"] == 64]

            _wait(lambda: pooled() == {e0: 4, e1: 4, e2: 2}, 120, f"pools filled: {pooled()}")

            with Client(url, tenant) as c:
                # creates of that shape: served from the pools, on all three edges
                sbs = [c.create("python", project="rl", **SHAPE) for _ in range(10)]  # type: ignore[arg-type]
                on = Counter(s.id.rsplit("-", 1)[0] for s in sbs)
                assert set(on) == {e0, e1, e2} and max(on.values()) <= 4, on  # (12 slots for 10)
                for s in sbs:
                    assert s.exec("hostname").stdout.strip() == s.id

                # drain e0 with the CLI: no new placements there, its sandboxes keep answering
                cli_env = {**os.environ, "DSEC_URL": url, "DSEC_TOKEN": admin}
                drain = subprocess.run(
                    [*DSEC, "edge", "drain", e0], env=cli_env, capture_output=True, text=True
                )
                assert drain.returncode == 0, drain.stderr
                edges = {e.name: e.draining for e in root.edges()}
                assert edges == {e0: True, e1: False, e2: False}
                status = subprocess.run(
                    [*DSEC, "status", "--json"], env=cli_env, capture_output=True, text=True, check=True
                )
                assert {e["name"]: e["draining"] for e in json.loads(status.stdout)["edges"]} == edges
                by_edge = {n: [s for s in sbs if s.id.startswith(n + "-")] for n in (e0, e1, e2)}
                keep = by_edge[e0][0]
                for s in by_edge[e0][1:] + by_edge[e1] + by_edge[e2]:
                    s.stop()  # room everywhere, e0 included
                fresh = [c.create("python", project="rl", **SHAPE) for _ in range(4)]  # type: ignore[arg-type]
                assert not any(s.id.startswith(e0 + "-") for s in fresh), [s.id for s in fresh]
                assert keep.exec("echo still").stdout == "still\n"
                undrain = subprocess.run(
                    [*DSEC, "edge", "undrain", e0], env=cli_env, capture_output=True, text=True
                )
                assert undrain.returncode == 0, undrain.stderr
                assert {e.name: e.draining for e in root.edges()}[e0] is False
                for s in [*fresh, keep]:
                    s.stop()

            # idle release: an edge added by hand (`dsec cluster add-edge`, no pools) holds no
            # sandbox; it drains and is released through the provider within seconds. The
            # burst's edges keep their pool stock (someone asked for it): they stay, and
            # min_edges would keep two anyway
            add = _cli(["cluster", "add-edge", "--dir", str(d), "--json"], env, timeout=180)
            assert add.returncode == 0, add.stderr[-2000:]
            (spare,) = json.loads(add.stdout)["edges"]
            pids.append(spare["pid"])
            netns.append(spare["netns"])
            assert spare["name"] in {e.name for e in root.edges()}
            t = time.monotonic()
            _wait(lambda: spare["name"] not in {e.name for e in root.edges()}, 60, "the idle edge released")
            assert time.monotonic() - t < 30
            _wait(lambda: not _alive(spare["pid"]), 30, "the released edge's process ended")
            assert spare["name"] not in {e.name for e in local.ClusterState.load(d).edges}
            assert (
                spare["netns"] not in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
            )
            assert not (d / "edges" / spare["name"]).exists()
            # released once, by one apiserver (both logs: the survivor's and the killed one's)
            logs = "".join(p.read_text(errors="replace") for p in (d / "logs").glob("api*.log"))
            assert logs.count(f"edge {spare['name']} released through") == 1
            assert logs.count(f"edge {spare['name']} drains (idle)") == 1
            assert {e.name: e.draining for e in root.edges()} == {e0: False, e1: False, e2: False}
            assert httpx.get(url + "/v1/health").json()["edges"] == 3
    finally:
        down = _cli(["cluster", "down", "--dir", str(d), "--purge"], dict(os.environ), timeout=300)
        assert down.returncode == 0, down.stderr[-2000:]
    for pid in pids:
        assert not _alive(pid), pid
    left = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in netns)
    assert state.bridge not in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert not Path(state.run_dir).exists()
    assert not d.exists()
    base.rmdir()


def _reason(e: pytest.ExceptionInfo[errors.QuotaExceeded]) -> str:
    return str(e.value.details.get("reason"))


def test_bursts_count_in_total_have_shares_and_are_cancelled(
    python_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #25 item 7 on a `dsec cluster up` (2 apiservers on PostgreSQL, 2 edges): five bursts
    of two for a two-sandbox project: the first is pre-warmed and the other four refused, its warm
    pool counting; one tenant's bursts take only its share (2) of the cluster's bound (3), the
    next tenant gets the last one and an admin still announces; another tenant's DELETE is 404;
    the owner's DELETE (on the other apiserver) gives the pool sandboxes back and frees the
    quota."""
    for k, v in {
        "CAPACITY_MAX_BURSTS": "3",
        "CAPACITY_MAX_BURSTS_PER_PROJECT": "2",
        "CAPACITY_LEAD_S": "0",
    }.items():
        monkeypatch.setenv(f"DSEC_APISERVER_{k}", v)
    base = Path(tempfile.mkdtemp(prefix="dsec-bursts-", dir="/tmp"))
    os.chmod(base, 0o755)  # (PostgreSQL, as its own user, must reach the cluster dir)
    d = base / "cluster"
    try:
        state = cluster_up(d)
        one, two = (a["url"] for a in state["apiservers"])
        admin = state["token"]
        auth = {"authorization": f"Bearer {admin}"}
        tokens = {}
        for who, project, quota in (
            ("trainer", "rl", 2),
            ("stranger", "other", None),
            ("newcomer", "third", None),
        ):
            r = httpx.post(
                one + "/v1/projects", json={"name": project, "quota": {"max_sandboxes": quota}}, headers=auth
            )
            assert r.status_code == 200, r.text
            r = httpx.post(one + "/v1/principals", json={"name": who, "projects": [project]}, headers=auth)
            assert r.status_code == 200, r.text
            tokens[who] = r.json()["token"]

        def pooled() -> int:
            r = httpx.get(one + "/v1/pools", headers=auth)
            return sum(p["ready"] for p in r.json()["pools"] if p["spec"]["memory_mb"] == 64)

        later = {"when": 3600.0}
        with (
            Client(one, tokens["trainer"]) as trainer,
            Client(two, tokens["trainer"]) as trainer2,
            Client(two, tokens["stranger"]) as stranger,
            Client(one, tokens["newcomer"]) as newcomer,
            Client(two, admin) as root,
        ):
            burst = trainer.announce_capacity("rl", 2, **SHAPE)  # type: ignore[arg-type]
            _wait(lambda: trainer2.capacity()[0].state == "ready", 120, "the burst pre-warmed")
            _wait(lambda: pooled() == 2, 120, f"its pools filled: {pooled()}")
            for c in (trainer, trainer2, trainer, trainer2):  # 2 + 2 > 2, its warm pool counting
                with pytest.raises(errors.QuotaExceeded) as e:
                    c.announce_capacity("rl", 2, **SHAPE)  # type: ignore[arg-type]
                assert _reason(e) == "bursts_exceed_quota", e.value
            assert [b.id for b in trainer2.capacity()] == [burst.id]

            # shares: 2 of the cluster's 3 pending bursts for one project, the 3rd to another
            for _ in range(2):
                stranger.announce_capacity("other", 1, **later)  # type: ignore[arg-type]
            with pytest.raises(errors.QuotaExceeded) as e:
                stranger.announce_capacity("other", 1, **later)  # type: ignore[arg-type]
            assert _reason(e) == "too_many_project_bursts", e.value
            newcomer.announce_capacity("third", 1, **later)  # type: ignore[arg-type]
            with pytest.raises(errors.QuotaExceeded) as e:
                newcomer.announce_capacity("third", 1, **later)  # type: ignore[arg-type]
            assert _reason(e) == "too_many_bursts", e.value
            assert root.announce_capacity("third", 1, **later).state == "scheduled"  # type: ignore[arg-type]

            # another tenant neither sees nor cancels the trainer's burst
            assert all(b.project == "other" for b in stranger.capacity())
            with pytest.raises(errors.NotFound):
                stranger.cancel_capacity(burst.id)
            assert pooled() == 2 and trainer.capacity()[0].state == "ready"

            cancelled = trainer2.cancel_capacity(burst.id)
            assert cancelled.state == "cancelled" and trainer.capacity()[0].state == "cancelled"
            _wait(lambda: pooled() == 0, 60, f"the pool sandboxes given back: {pooled()}")
            for b in root.capacity():  # the admin cancels any
                if b.state == "scheduled":
                    assert root.cancel_capacity(b.id).state == "cancelled"
            # nothing pending, nothing pooled: the quota and the cluster's bound are free again
            assert trainer.announce_capacity("rl", 2, **SHAPE, **later).state == "scheduled"  # type: ignore[arg-type]
    finally:
        if (d / "cluster.json").exists():
            down = _cli(["cluster", "down", "--dir", str(d), "--purge"], dict(os.environ), timeout=300)
            assert down.returncode == 0, down.stderr[-2000:]
        shutil.rmtree(base, ignore_errors=True)
