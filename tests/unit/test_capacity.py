"""Elastic capacity in the apiserver (dsec.apiserver.capacity), with fake edges and a fake node
provider: the POST /v1/capacity body's validation and who may announce for which project, the
proportional pre-warm, growth through the provider when the edges are short, drain / undrain
and the idle release. (On real edges and a real provider: tests/e2e/test_capacity.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI

from dsec.apiserver.app import create_api_app
from dsec.apiserver.capacity import Capacity, split
from dsec.apiserver.tenancy import ApiServerSettings
from dsec.cluster.provider import NodeInfo, NodeProvider
from dsec.iam import IAM
from dsec.models import EdgeStatus, PoolInfo, PoolSpec, Quota, SandboxSpec


class FakeEdge:
    """An edge's status and its prewarm calls; `can_be_lost` false: it is never given up."""

    url = None
    can_be_lost = False

    def __init__(
        self,
        name: str,
        slots: int,
        used: int = 0,
        *,
        images: tuple[str, ...] = ("python",),
        registry: bool = False,
    ) -> None:
        self.name = name
        self.slots = slots
        self.used = used
        self.holds, self.registry = list(images), registry
        self.prewarms: list[tuple[PoolSpec, int]] = []
        self.projects: list[str | None] = []  # the project of each prewarm

    async def status(self) -> EdgeStatus:
        return EdgeStatus(
            name=self.name,
            healthy=True,
            backends=["container"],
            capacity={"sandboxes": self.slots, "cpu": 1000, "memory_mb": 10**7},
            used={"sandboxes": self.used, "pooled": 0, "cpu": self.used, "memory_mb": self.used * 1024},
            sandboxes=self.used,
            by_image={},
            by_project={},
            layers=[],
            images=self.holds,
            registry=self.registry,
        )

    async def prewarm(self, spec: PoolSpec, count: int, project: str | None = None) -> PoolInfo:
        self.prewarms.append((spec, count))
        self.projects.append(project)
        return PoolInfo(spec=spec, ready=0, target=count, claims=0, misses=0)

    async def images(self) -> list[dict[str, Any]]:
        return [{"name": "python", "layers": []}]

    async def snapshots(self, _project: object) -> list[dict[str, Any]]:
        return []

    async def aclose(self) -> None:
        pass


class FakeProvider(NodeProvider):
    """Adds FakeEdges to the directory as a new edge registering would."""

    kind = "fake"

    def __init__(self, slots: int = 10) -> None:
        self.slots = slots
        self.capacity: Capacity | None = None
        self.nodes: dict[str, FakeEdge] = {}
        self.removed: list[str] = []
        self.asked: list[int] = []

    async def add(self, n: int) -> list[str]:
        assert self.capacity is not None
        self.asked.append(n)
        names = []
        for _ in range(n):
            edge = FakeEdge(f"new{len(self.nodes)}", self.slots)
            self.nodes[edge.name] = edge
            view = self.capacity.directory.add(edge)  # type: ignore[arg-type]
            view.status = await edge.status()
            names.append(edge.name)
        return names

    async def remove(self, edge: str) -> None:
        self.removed.append(edge)
        self.nodes.pop(edge, None)

    async def list(self) -> list[NodeInfo]:
        return [NodeInfo(n, "ready") for n in self.nodes]


class Env:
    def __init__(self, app: FastAPI, iam: IAM, admin: str, alice: str, bob: str, edges: list[FakeEdge]):
        self.app, self.iam, self.admin, self.alice, self.bob, self.edges = app, iam, admin, alice, bob, edges
        self.capacity: Capacity = app.state.capacity
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsec")

    async def call(self, method: str, path: str, token: str, body: Any = None) -> httpx.Response:
        return await self.http.request(method, path, json=body, headers={"authorization": f"Bearer {token}"})

    async def settle(self) -> None:
        for _ in range(200):
            if not any(b.state in ("scheduled", "provisioning") for b in self.capacity.bursts.values()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("bursts still pending")


async def _env(
    tmp: Path, edges: list[FakeEdge], provider: NodeProvider | None = None, **settings: Any
) -> Env:
    iam = IAM(tmp / "iam.db")
    admin = iam.bootstrap()
    assert admin is not None
    iam.create_project("team-a", quota=Quota(max_sandboxes=500))
    iam.create_project("team-b")
    _, alice = iam.create_principal("alice", ["team-a"])
    _, bob = iam.create_principal("bob", ["team-b"])
    s = ApiServerSettings(capacity_max_count=1000, capacity_edge_wait_s=2, **settings)
    app = create_api_app(
        iam=iam,
        cluster_token="c",
        local_edges=edges,  # type: ignore[arg-type]
        settings=s,
        provider=provider,
    )
    await app.state.dsec.directory.poll_once()
    if isinstance(provider, FakeProvider):
        provider.capacity = app.state.capacity
    return Env(app, iam, admin, alice, bob, edges)


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    e = await _env(tmp_path, [FakeEdge("e0", 30), FakeEdge("e1", 20, used=10)])
    yield e
    await e.http.aclose()
    await e.capacity.close()
    e.iam.close()


def test_split_is_proportional_bounded_and_exact() -> None:
    assert split(20, {"a": 30, "b": 10}) == {"a": 15, "b": 5}
    assert split(10, {"a": 3, "b": 3, "c": 3, "d": 100}) == {"c": 1, "d": 9}  # largest remainders
    for count in range(0, 60):
        out = split(count, {"a": 7, "b": 0, "c": 13, "d": 21})
        assert sum(out.values()) == min(count, 41)
        assert all(out[k] <= {"a": 7, "c": 13, "d": 21}[k] for k in out) and "b" not in out
    assert split(5, {"a": 2, "b": 1}) == {"a": 2, "b": 1}  # all the room, short by 2
    assert split(3, {}) == {}


# --- validation and authorization ----------------------------------------------------------------

PAST, FAR = "2001-01-01T00:00:00Z", "2999-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("body", "code", "status", "reason"),
    [
        ({"project": "team-a", "count": 0}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 100001}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 1001}, "invalid_request", 400, "count_too_large"),
        ({"project": "team-a", "count": 501}, "invalid_request", 400, "count_exceeds_quota"),
        ({"count": 5}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 5, "bogus": 1}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 5, "when": -1}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 5, "when": 8 * 86400}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 5, "when": "2030-01-01T00:00:00"}, "invalid_request", 400, None),
        (
            {"project": "team-a", "count": 5, "when": "2001-01-01T00:00:00Z"},
            "invalid_request",
            400,
            "when_in_past",
        ),
        (
            {"project": "team-a", "count": 5, "when": "2999-01-01T00:00:00Z"},
            "invalid_request",
            400,
            "when_too_far",
        ),
        ({"project": "team-a", "count": 5, "cpu": 0}, "invalid_request", 400, None),
        ({"project": "team-a", "count": 5, "backend": "Bad Backend"}, "invalid_request", 400, None),
        ({"project": "nope", "count": 5}, "not_found", 404, None),
    ],
)
async def test_announce_refuses_bad_input_with_stable_codes(
    env: Env, body: dict[str, Any], code: str, status: int, reason: str | None
) -> None:
    r = await env.call("POST", "/v1/capacity", env.admin, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    if reason is not None:
        assert err["details"]["reason"] == reason
    assert env.capacity.bursts == {}


async def test_tenants_announce_only_for_their_own_projects(env: Env) -> None:
    r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-b", "count": 5})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = await env.call("POST", "/v1/capacity", "not-a-token", {"project": "team-a", "count": 5})
    assert r.status_code == 401
    assert env.capacity.bursts == {}

    r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 5})
    assert r.status_code == 200, r.text
    mine = r.json()
    assert mine["project"] == "team-a" and mine["announced_by"] == "alice"
    r = await env.call("POST", "/v1/capacity", env.admin, {"project": "team-b", "count": 3})
    assert r.status_code == 200, r.text
    await env.settle()

    seen = {
        who: [b["project"] for b in (await env.call("GET", "/v1/capacity", tok)).json()["bursts"]]
        for who, tok in (("alice", env.alice), ("bob", env.bob), ("admin", env.admin))
    }
    assert seen == {"alice": ["team-a"], "bob": ["team-b"], "admin": ["team-a", "team-b"]}

    # drains are for admins
    for path in ("/v1/edges/e0/drain", "/v1/edges/e0/undrain"):
        r = await env.call("POST", path, env.alice)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = await env.call("POST", "/v1/edges/nosuch/drain", env.admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# --- what a burst does ------------------------------------------------------------------------------


async def test_burst_prewarms_in_proportion_to_free_room(env: Env) -> None:
    e0, e1 = env.edges  # free: 30 and 10
    r = await env.call(
        "POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 20, "memory_mb": 256, "cpu": 0.5}
    )
    assert r.status_code == 200 and r.json()["state"] in ("scheduled", "provisioning", "ready")
    await env.settle()
    (burst,) = (await env.call("GET", "/v1/capacity", env.alice)).json()["bursts"]
    assert burst["state"] == "ready" and burst["shortfall"] == 0
    assert burst["prewarmed"] == {"e0": 15, "e1": 5}
    assert [n for _, n in e0.prewarms] == [15] and [n for _, n in e1.prewarms] == [5]
    spec, _ = e0.prewarms[0]
    # the pool's shape is the creates' (a create with these values takes a pooled sandbox)
    assert spec.key() == PoolSpec(image="python", cpu=0.5, memory_mb=256).key()
    assert (
        spec.key()
        == PoolSpec(
            **SandboxSpec(cpu=0.5, memory_mb=256).model_dump(include=set(PoolSpec.model_fields))
        ).key()
    )

    # a second burst of the same shape: the edges' promised pool sandboxes take room, and a
    # prewarm sets the pool's boost to the sum of both bursts
    r = await env.call(
        "POST", "/v1/capacity", env.admin, {"project": "team-a", "count": 10, "memory_mb": 256, "cpu": 0.5}
    )
    await env.settle()
    b2 = env.capacity.bursts[r.json()["id"]]
    assert b2.prewarmed == {"e0": 8, "e1": 2}  # free now 15 and 5
    assert e0.prewarms[-1][1] == 15 + 8 and e1.prewarms[-1][1] == 5 + 2


async def test_a_burst_prewarms_edges_that_pull_the_image_from_a_registry(tmp_path: Path) -> None:
    """An edge that lacks the image but has a registry is pre-warmed (it pulls the image when
    asked, for the burst's project); one that has neither the image nor a registry is not."""
    holder = FakeEdge("e0", 10)
    puller = FakeEdge("e1", 10, images=(), registry=True)
    plain = FakeEdge("e2", 10, images=())
    env = await _env(tmp_path, [holder, puller, plain])
    try:
        r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 20})
        await env.settle()
        b = env.capacity.bursts[r.json()["id"]]
        assert b.state == "ready" and b.prewarmed == {"e0": 10, "e1": 10}, b.actions
        assert puller.projects == ["team-a"] and plain.prewarms == []
    finally:
        await env.http.aclose()


async def test_burst_without_provider_is_partial(env: Env) -> None:
    r = await env.call("POST", "/v1/capacity", env.admin, {"project": "team-b", "count": 55})
    await env.settle()
    b = env.capacity.bursts[r.json()["id"]]
    assert b.state == "partial" and b.shortfall == 15 and b.prewarmed == {"e0": 30, "e1": 10}
    assert any("no node provider" in a for a in b.actions)


async def test_burst_grows_the_cluster_through_the_provider(tmp_path: Path) -> None:
    provider = FakeProvider(slots=10)
    env = await _env(tmp_path, [FakeEdge("e0", 10, used=4)], provider)
    try:
        r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 31})
        await env.settle()
        b = env.capacity.bursts[r.json()["id"]]
        # 6 fit on e0; 25 more need ceil(25 / 10) = 3 edges of e0's size
        assert provider.asked == [3]
        assert b.state == "ready", b.actions
        assert b.prewarmed.pop("e0") == 6 and sorted(b.prewarmed.values()) == [8, 8, 9]
        assert b.edges_requested == 3 and sorted(b.edges_added) == ["new0", "new1", "new2"]

        # max_edges bounds the growth
        env.capacity.settings.max_edges = 4
        r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 10})
        await env.settle()
        b = env.capacity.bursts[r.json()["id"]]  # the 5 slots the new edges have left, no more
        assert b.state == "partial" and b.shortfall == 5 and provider.asked == [3]
        assert any("max_edges" in a for a in b.actions)
    finally:
        await env.http.aclose()
        await env.capacity.close()
        env.iam.close()


async def test_burst_in_the_future_waits_for_its_lead_time(env: Env) -> None:
    env.capacity.settings.capacity_lead_s = 0
    r = await env.call("POST", "/v1/capacity", env.admin, {"project": "team-a", "count": 4, "when": 0.3})
    b = env.capacity.bursts[r.json()["id"]]
    await asyncio.sleep(0.1)
    assert b.state == "scheduled" and b.prewarmed == {}
    await asyncio.sleep(0.4)
    await env.settle()
    assert b.state == "ready" and sum(b.prewarmed.values()) == 4


# --- drain ----------------------------------------------------------------------------------------------


async def test_drain_excludes_an_edge_from_placement_and_shows_in_edges(env: Env) -> None:
    directory = env.capacity.directory
    r = await env.call("POST", "/v1/edges/e0/drain", env.admin)
    assert r.status_code == 200 and r.json() == {"edge": "e0", "draining": True}
    assert [v.api.name for v in directory.candidates(SandboxSpec())] == ["e1"]
    edges = {
        e["name"]: e["draining"] for e in (await env.call("GET", "/v1/edges", env.admin)).json()["edges"]
    }
    assert edges == {"e0": True, "e1": False}
    tenant_view = (await env.call("GET", "/v1/edges", env.alice)).json()["edges"]
    assert {e["name"]: e["draining"] for e in tenant_view} == edges
    # a burst leaves it out too
    r = await env.call("POST", "/v1/capacity", env.admin, {"project": "team-a", "count": 4})
    await env.settle()
    assert env.capacity.bursts[r.json()["id"]].prewarmed == {"e1": 4}
    # the watcher's views are re-made when an edge registers again: the drain holds
    directory.views["e0"].draining = False
    await env.capacity.tick()
    assert directory.views["e0"].draining

    r = await env.call("POST", "/v1/edges/e0/undrain", env.admin)
    assert r.json() == {"edge": "e0", "draining": False}
    assert {v.api.name for v in directory.candidates(SandboxSpec())} == {"e0", "e1"}


async def test_idle_edges_drain_then_release_down_to_min_edges(tmp_path: Path) -> None:
    provider = FakeProvider()
    busy, idle1, idle2 = FakeEdge("busy", 10, used=2), FakeEdge("idle1", 10), FakeEdge("idle2", 10)
    provider.nodes = {e.name: e for e in (busy, idle1, idle2)}
    env = await _env(tmp_path, [busy, idle1, idle2], provider, idle_drain_after_s=0.2, min_edges=1)
    cap, directory = env.capacity, env.capacity.directory
    try:
        await cap.tick()
        assert not any(v.draining for v in directory.views.values())
        await asyncio.sleep(0.25)
        await cap.tick()
        assert {n for n, v in directory.views.items() if v.draining} == {"idle1", "idle2"}
        assert [v.api.name for v in directory.candidates(SandboxSpec())] == ["busy"]

        # idle2 gets a sandbox that raced the drain: it is busy, so it takes placements again
        idle2.used = 1
        await directory.poll_once()
        await cap.tick()
        await asyncio.sleep(0.05)
        assert not directory.views["idle2"].draining
        assert provider.removed == ["idle1"] and "idle1" not in directory.views

        # both empty now: one is drained and released; min_edges=1 keeps the other, undrained
        idle2.used = busy.used = 0
        await directory.poll_once()
        await cap.tick()
        await asyncio.sleep(0.25)
        await cap.tick()  # drained now
        assert len([v for v in directory.views.values() if v.draining]) == 1
        await asyncio.sleep(0.01)
        await directory.poll_once()  # a poll after the drain still finds it empty
        await cap.tick()
        await asyncio.sleep(0.05)
        assert len(provider.removed) == 2 and len(directory.views) == 1
        (left,) = directory.views
        for _ in range(3):
            await directory.poll_once()
            await cap.tick()
            await asyncio.sleep(0.05)
        assert len(provider.removed) == 2 and not directory.views[left].draining
        # a released edge that registers again (its node not gone yet) stays drained
        gone = provider.removed[-1]
        directory.add(FakeEdge(gone, 10))  # type: ignore[arg-type]
        await cap.tick()
        assert directory.views[gone].draining
    finally:
        await env.http.aclose()
        await cap.close()
        env.iam.close()
