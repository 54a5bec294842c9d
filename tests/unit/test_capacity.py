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
from dsec.models import Burst, EdgeStatus, PoolInfo, PoolSpec, Quota, SandboxSpec


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
            if not self.iam.active_bursts():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("bursts still pending")

    def burst(self, burst_id: str) -> Burst:
        (b,) = [b for b in self.iam.list_bursts(None) if b.id == burst_id]
        return b


async def _env(
    db: Path | str,
    edges: list[FakeEdge],
    provider: NodeProvider | None = None,
    *,
    tokens: tuple[str, str, str] | None = None,
    lead: bool = True,
    **settings: Any,
) -> Env:
    """An apiserver on the IAM database `db` (a new one, or one an earlier _env made: pass its
    `tokens`); `lead`: take the lead at once (a tick)."""
    iam = IAM(db)
    if tokens is None:
        admin = iam.bootstrap()
        assert admin is not None
        iam.create_project("team-a", quota=Quota(max_sandboxes=500))
        iam.create_project("team-b")
        _, alice = iam.create_principal("alice", ["team-a"])
        _, bob = iam.create_principal("bob", ["team-b"])
    else:
        admin, alice, bob = tokens
    s = ApiServerSettings(**{"capacity_max_count": 1000, "capacity_edge_wait_s": 2, **settings})
    app = create_api_app(
        iam=iam,
        cluster_token="c",
        local_edges=edges,  # type: ignore[arg-type]
        settings=s,
        provider=provider,
    )
    await app.state.dsec.directory.poll_once()
    if lead:
        await app.state.capacity.tick()  # (the first apiserver: it acts on bursts)
    if isinstance(provider, FakeProvider):
        provider.capacity = app.state.capacity
    return Env(app, iam, admin, alice, bob, edges)


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    e = await _env(tmp_path / "iam.db", [FakeEdge("e0", 30), FakeEdge("e1", 20, used=10)])
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
    assert env.iam.list_bursts(None) == []


async def test_tenants_announce_only_for_their_own_projects(env: Env) -> None:
    r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-b", "count": 5})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = await env.call("POST", "/v1/capacity", "not-a-token", {"project": "team-a", "count": 5})
    assert r.status_code == 401
    assert env.iam.list_bursts(None) == []

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
    b2 = env.burst(r.json()["id"])
    assert b2.prewarmed == {"e0": 8, "e1": 2}  # free now 15 and 5
    assert e0.prewarms[-1][1] == 15 + 8 and e1.prewarms[-1][1] == 5 + 2


async def test_a_burst_prewarms_edges_that_pull_the_image_from_a_registry(tmp_path: Path) -> None:
    """An edge that lacks the image but has a registry is pre-warmed (it pulls the image when
    asked, for the burst's project); one that has neither the image nor a registry is not."""
    holder = FakeEdge("e0", 10)
    puller = FakeEdge("e1", 10, images=(), registry=True)
    plain = FakeEdge("e2", 10, images=())
    env = await _env(tmp_path / "iam.db", [holder, puller, plain])
    try:
        r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 20})
        await env.settle()
        b = env.burst(r.json()["id"])
        assert b.state == "ready" and b.prewarmed == {"e0": 10, "e1": 10}, b.actions
        assert puller.projects == ["team-a"] and plain.prewarms == []
    finally:
        await env.http.aclose()


async def test_burst_without_provider_is_partial(env: Env) -> None:
    r = await env.call("POST", "/v1/capacity", env.admin, {"project": "team-b", "count": 55})
    await env.settle()
    b = env.burst(r.json()["id"])
    assert b.state == "partial" and b.shortfall == 15 and b.prewarmed == {"e0": 30, "e1": 10}
    assert any("no node provider" in a for a in b.actions)


async def test_burst_grows_the_cluster_through_the_provider(tmp_path: Path) -> None:
    provider = FakeProvider(slots=10)
    env = await _env(tmp_path / "iam.db", [FakeEdge("e0", 10, used=4)], provider)
    try:
        r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 31})
        await env.settle()
        b = env.burst(r.json()["id"])
        # 6 fit on e0; 25 more need ceil(25 / 10) = 3 edges of e0's size
        assert provider.asked == [3]
        assert b.state == "ready", b.actions
        assert b.prewarmed.pop("e0") == 6 and sorted(b.prewarmed.values()) == [8, 8, 9]
        assert b.edges_requested == 3 and sorted(b.edges_added) == ["new0", "new1", "new2"]

        # max_edges bounds the growth
        env.capacity.settings.max_edges = 4
        r = await env.call("POST", "/v1/capacity", env.alice, {"project": "team-a", "count": 10})
        await env.settle()
        b = env.burst(r.json()["id"])  # the 5 slots the new edges have left, no more
        assert b.state == "partial" and b.shortfall == 5 and provider.asked == [3]
        assert any("max_edges" in a for a in b.actions)
    finally:
        await env.http.aclose()
        await env.capacity.close()
        env.iam.close()


async def test_burst_in_the_future_waits_for_its_lead_time(env: Env) -> None:
    env.capacity.settings.capacity_lead_s = 0
    r = await env.call("POST", "/v1/capacity", env.admin, {"project": "team-a", "count": 4, "when": 0.3})
    await asyncio.sleep(0.1)
    b = env.burst(r.json()["id"])
    assert b.state == "scheduled" and b.prewarmed == {}
    await asyncio.sleep(0.4)
    await env.settle()
    b = env.burst(r.json()["id"])
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
    assert env.burst(r.json()["id"]).prewarmed == {"e1": 4}
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
    env = await _env(tmp_path / "iam.db", [busy, idle1, idle2], provider, idle_drain_after_s=0.2, min_edges=1,
                     capacity_interval_s=0.01)  # fmt: skip
    cap, directory = env.capacity, env.capacity.directory
    try:
        await cap.tick()
        assert not any(v.draining for v in directory.views.values())
        await asyncio.sleep(0.25)
        await cap.tick()
        assert {n for n, v in directory.views.items() if v.draining} == {"idle1", "idle2"}
        assert [v.api.name for v in directory.candidates(SandboxSpec())] == ["busy"]

        # idle2 gets a sandbox that raced the drain: it is busy, so it takes placements again
        await asyncio.sleep(0.03)  # (every apiserver has taken up the drain: 2 capacity rounds)
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
        await asyncio.sleep(0.03)
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


# --- shared by apiservers (the IAM's database: SQLite and a real PostgreSQL) -------------------


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    if request.param == "sqlite":
        return tmp_path / "iam.db"
    return str(request.getfixturevalue("pg_url"))


async def _close(*envs: Env) -> None:
    for e in envs:
        await e.http.aclose()
        await e.capacity.close()
        e.iam.close()


def _tokens(env: Env) -> tuple[str, str, str]:
    return env.admin, env.alice, env.bob


async def test_apiservers_share_bursts_and_one_acts_on_them(db: Path | str) -> None:
    edges = [FakeEdge("e0", 30), FakeEdge("e1", 20, used=10)]
    a = await _env(db, edges)
    b = await _env(db, edges, tokens=_tokens(a))
    try:
        await b.capacity.tick()
        assert a.capacity.leading and not b.capacity.leading

        # announced on B (which does not act): A shows it, then takes it up at its next round
        r = await b.call(
            "POST", "/v1/capacity", b.alice, {"project": "team-a", "count": 20, "memory_mb": 256}
        )
        assert r.status_code == 200, r.text
        (seen,) = (await a.call("GET", "/v1/capacity", a.alice)).json()["bursts"]
        assert seen["id"] == r.json()["id"] and seen["state"] == "scheduled"
        await a.capacity.tick()
        await a.settle()
        got = {
            n: (await e.call("GET", "/v1/capacity", e.alice)).json()["bursts"]
            for n, e in (("a", a), ("b", b))
        }
        assert got["a"] == got["b"] and got["a"][0]["state"] == "ready"
        assert got["a"][0]["prewarmed"] == {"e0": 15, "e1": 5}
        assert [n for _, n in edges[0].prewarms] == [15] and [n for _, n in edges[1].prewarms] == [5]

        # another tenant sees none of it, on either apiserver; an admin sees it on both
        for e in (a, b):
            assert (await e.call("GET", "/v1/capacity", e.bob)).json()["bursts"] == []
            answer = (await e.call("GET", "/v1/capacity", e.admin)).json()
            assert len(answer["bursts"]) == 1 and answer["acting"] is (e is a)

        # the bound on pending bursts holds across apiservers
        a.capacity.settings.capacity_max_bursts = b.capacity.settings.capacity_max_bursts = 1
        body = {"project": "team-a", "count": 1, "when": 3600}
        assert (await a.call("POST", "/v1/capacity", a.alice, body)).status_code == 200
        r = await b.call("POST", "/v1/capacity", b.alice, body)
        assert r.status_code == 429 and r.json()["error"]["details"]["reason"] == "too_many_bursts", r.text
    finally:
        await _close(a, b)


class StuckProvider(FakeProvider):
    """A fake node provider whose edges never come: the acting apiserver waits on it."""

    async def add(self, n: int) -> list[str]:
        self.asked.append(n)
        await asyncio.Event().wait()
        return []


async def test_another_apiserver_finishes_a_burst_whose_apiserver_stopped(db: Path | str) -> None:
    edges = [FakeEdge("e0", 6)]
    stuck, spare = StuckProvider(slots=10), FakeProvider(slots=10)
    a = await _env(db, edges, stuck, capacity_edge_wait_s=30)
    b = await _env(db, edges, spare, tokens=_tokens(a), capacity_edge_wait_s=30)
    try:
        r = await a.call("POST", "/v1/capacity", a.alice, {"project": "team-a", "count": 10})
        burst_id = r.json()["id"]
        for _ in range(100):  # A pre-warmed 6 on e0 and asked its provider for an edge
            if stuck.asked:
                break
            await asyncio.sleep(0.01)
        assert stuck.asked == [1] and a.burst(burst_id).prewarmed == {"e0": 6}
        assert a.burst(burst_id).state == "provisioning"

        await a.capacity.close()  # A stops (its process's owner dies with its IAM)
        a.iam.close()
        await b.capacity.tick()
        assert b.capacity.leading
        await asyncio.sleep(0.1)
        assert spare.asked == [], "B asked for edges again"
        assert b.burst(burst_id).state == "provisioning"

        # the edge A asked for registers: B pre-warms the rest there and finishes
        late = FakeEdge("late", 10)
        b.capacity.directory.add(late)  # type: ignore[arg-type]
        await b.capacity.directory.poll_once()
        await b.settle()
        done = b.burst(burst_id)
        assert done.state == "ready", done.actions
        assert done.prewarmed == {"e0": 6, "late": 4} and done.edges_added == ["late"]
        assert done.edges_requested == 1 and spare.asked == []
        assert any("taken up by another apiserver" in x for x in done.actions)
        # e0 got its prewarm again (a target: the same 6), never another share
        assert [n for _, n in edges[0].prewarms] == [6, 6] and [n for _, n in late.prewarms] == [4]
    finally:
        await b.http.aclose()
        await b.capacity.close()
        b.iam.close()
        await a.http.aclose()


async def test_one_apiserver_drains_and_releases_an_idle_edge_once(db: Path | str) -> None:
    provider = FakeProvider()
    busy, idle1, idle2 = FakeEdge("busy", 10, used=2), FakeEdge("idle1", 10), FakeEdge("idle2", 10)
    provider.nodes = {e.name: e for e in (busy, idle1, idle2)}
    opts: dict[str, Any] = {"idle_drain_after_s": 0.1, "min_edges": 1, "capacity_interval_s": 0.01}
    a = await _env(db, [busy, idle1, idle2], provider, **opts)
    b = await _env(db, [busy, idle1, idle2], provider, tokens=_tokens(a), **opts)
    events: list[tuple[str, str]] = []
    b.capacity.publish = lambda kind, **data: events.append((kind, data.get("edge", "")))
    try:
        for _ in range(60):
            for e in (a, b):
                await e.capacity.directory.poll_once()
                await e.capacity.tick()
            await asyncio.sleep(0.02)
            if "idle2" in provider.removed:
                break
        # both idle edges (newest first, down to min_edges=1) released once, by A alone
        assert sorted(provider.removed) == ["idle1", "idle2"], provider.removed
        assert not b.capacity.leading and events == []
        for e in (a, b):  # gone from both apiservers' views
            assert set(e.capacity.directory.views) == {"busy"}
            assert {n: m.reason for n, m in e.capacity.drains.items()} == {
                "idle1": "released",
                "idle2": "released",
            }

        # a release A began and did not finish: B takes over and finishes it, once
        extra = FakeEdge("extra", 10)
        provider.nodes["extra"] = extra
        for e in (a, b):
            e.capacity.directory.add(extra)  # type: ignore[arg-type]
            await e.capacity.directory.poll_once()
        busy.used = 2
        assert a.iam.mark_edge("extra", "idle", expect=None)
        assert not b.iam.mark_edge("extra", "releasing", expect="idle")  # (B does not act)
        assert a.iam.mark_edge("extra", "releasing", expect="idle")
        await a.capacity.close()
        a.iam.close()
        await b.capacity.tick()
        await asyncio.sleep(0.05)
        assert b.capacity.leading and provider.removed.count("extra") == 1
        assert events == [("edge_released", "extra")]
        assert b.iam.capacity_marks()["extra"].state == "released"
        # an admin's undrain takes a released edge back (it registered again)
        b.capacity.directory.add(extra)  # type: ignore[arg-type]
        await b.capacity.tick()
        assert b.capacity.directory.views["extra"].draining
        r = await b.call("POST", "/v1/edges/extra/undrain", b.admin)
        assert r.json() == {"edge": "extra", "draining": False}
        assert "extra" not in b.iam.capacity_marks()
    finally:
        await b.http.aclose()
        await b.capacity.close()
        b.iam.close()
        await a.http.aclose()


def test_writes_of_an_apiserver_that_lost_the_lead_change_nothing(db: Path | str) -> None:
    with IAM(db) as a, IAM(db) as b:
        a.bootstrap()
        assert a.capacity_lead() and not b.capacity_lead()
        burst = Burst(
            id="burst-1", project="default", image="python", backend="container", cpu=1, memory_mb=64,
            count=3, when=0, announced_at=1, announced_by="admin", state="scheduled",
        )  # fmt: skip
        a.add_burst(burst, max_active=10, keep=10)
        burst.state, burst.prewarmed = "provisioning", {"e0": 3}
        assert not b.save_burst(burst, {}, "s")
        assert not b.mark_edge("e0", "idle", expect=None)
        assert a.save_burst(burst, {"hold": 2e9}, "s")
        assert (
            a.prewarm_held("e0", 0) == 3 == a.prewarm_held("e0", 0, "s") and a.prewarm_held("e0", 0, "t") == 0
        )
        assert b.held_edges(1.0) == {"e0": 2e9}
        # B is judged to have the lead (as when A's owner died): A's writes are refused
        b_owner = b._owner()
        with b._write() as db_:
            db_.execute("UPDATE capacity_leader SET owner = ?", (b_owner,))
        assert b.capacity_lead() and not a.capacity_lead()
        burst.state = "ready"
        assert not a.save_burst(burst, {}, "s")
        assert b.list_bursts(None)[0].state == "provisioning"
        assert b.mark_edge("e0", "idle", expect=None) and not b.mark_edge("e0", "idle", expect=None)
        assert not a.mark_edge("e0", "releasing", expect="idle")
        # finished bursts beyond `keep` are forgotten, oldest first
        assert b.save_burst(burst, {}, "s")
        for i in range(3):
            nxt = burst.model_copy(update={"id": f"burst-n{i}", "announced_at": 10 + i, "state": "ready"})
            b.add_burst(nxt, max_active=10, keep=2)
        assert [x.id for x in b.list_bursts(None)] == ["burst-n1", "burst-n2"]
        assert b.list_bursts({"other"}) == []


# --- aggregate quotas, per-project shares, cancel (issue #25 item 7) -----------------------------


def _refused(r: httpx.Response, reason: str) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "quota_exceeded" and err["details"]["reason"] == reason, err


async def test_bursts_count_against_the_project_quota_in_total(db: Path | str) -> None:
    """Five bursts of two for a two-sandbox project: the first is pre-warmed, the other four are
    refused, on either apiserver, also once the first is ready (its warm pool counts) and when an
    admin announces them; a subproject's bursts count against its parent's quota; a cancelled
    burst and a finished one whose stock the edges no longer keep count no more."""
    edges = [FakeEdge("e0", 30), FakeEdge("e1", 20, used=10)]
    a = await _env(db, edges)
    b = await _env(db, edges, tokens=_tokens(a))
    a.iam.create_project("small", quota=Quota(max_sandboxes=2))
    a.iam.create_project("small-child", parent="small")
    _, carol = a.iam.create_principal("carol", ["small"])
    try:
        body = {"project": "small", "count": 2, "memory_mb": 256}
        r = await a.call("POST", "/v1/capacity", carol, body)
        assert r.status_code == 200, r.text
        first = r.json()["id"]
        await a.settle()
        assert a.burst(first).state == "ready" and sum(a.burst(first).prewarmed.values()) == 2
        for e, token in ((a, carol), (b, carol), (a, a.admin), (b, carol)):
            _refused(await e.call("POST", "/v1/capacity", token, body), "bursts_exceed_quota")
        r = await b.call("POST", "/v1/capacity", carol, {**body, "project": "small-child", "count": 1})
        _refused(r, "bursts_exceed_quota")
        assert r.json()["error"]["details"]["project"] == "small"
        assert [x.id for x in a.iam.list_bursts({"small", "small-child"})] == [first]

        # pending bursts count their whole count, from the announcement on
        r = await a.call("DELETE", f"/v1/capacity/{first}", carol)
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        later = {**body, "count": 1, "when": 3600}
        assert (await b.call("POST", "/v1/capacity", carol, later)).status_code == 200
        assert (
            await a.call("POST", "/v1/capacity", carol, {**later, "project": "small-child"})
        ).status_code == 200
        _refused(await b.call("POST", "/v1/capacity", carol, later), "bursts_exceed_quota")

        # a finished burst's stock counts while the edges keep its boost (POOL_HOLD_S), no longer
        for x in a.iam.list_bursts({"small", "small-child"}):
            if x.state == "scheduled":
                assert (await a.call("DELETE", f"/v1/capacity/{x.id}", carol)).status_code == 200
        r = await a.call("POST", "/v1/capacity", carol, body)
        assert r.status_code == 200, r.text
        await a.settle()
        _refused(await a.call("POST", "/v1/capacity", carol, {**body, "count": 1}), "bursts_exceed_quota")
        with a.iam._write() as db_:
            db_.execute("UPDATE burst_prewarms SET at = at - 301 WHERE burst = ?", (r.json()["id"],))
        assert (await a.call("POST", "/v1/capacity", carol, body)).status_code == 200
    finally:
        await _close(a, b)


async def test_a_projects_share_of_pending_bursts_leaves_room_for_others_and_admins(db: Path | str) -> None:
    """The cluster-wide bound on pending bursts (3 here) has a per-project share (2): one tenant's
    bursts cannot take it all from another, and an admin is bound by neither."""
    opts: dict[str, Any] = {"capacity_max_bursts": 3, "capacity_max_bursts_per_project": 2}
    a = await _env(db, [FakeEdge("e0", 30)], **opts)
    b = await _env(db, [FakeEdge("e0", 30)], tokens=_tokens(a), **opts)
    later = {"count": 1, "when": 3600}
    try:
        mine = []
        for e in (a, b):
            r = await e.call("POST", "/v1/capacity", e.alice, {"project": "team-a", **later})
            assert r.status_code == 200, r.text
            mine.append(r.json()["id"])
        _refused(
            await a.call("POST", "/v1/capacity", a.alice, {"project": "team-a", **later}),
            "too_many_project_bursts",
        )
        assert (
            await b.call("POST", "/v1/capacity", b.bob, {"project": "team-b", **later})
        ).status_code == 200
        _refused(
            await a.call("POST", "/v1/capacity", a.bob, {"project": "team-b", **later}), "too_many_bursts"
        )
        ops = []
        for project in ("team-a", "team-b"):  # the operator is never locked out
            r = await b.call("POST", "/v1/capacity", b.admin, {"project": project, **later})
            assert r.status_code == 200, r.text
            ops.append(r.json()["id"])
        # cancelled bursts are not pending: room again
        for burst_id, token in [*((i, b.alice) for i in mine), *((i, b.admin) for i in ops)]:
            assert (await b.call("DELETE", f"/v1/capacity/{burst_id}", token)).status_code == 200
        assert (
            await a.call("POST", "/v1/capacity", a.bob, {"project": "team-b", **later})
        ).status_code == 200
    finally:
        await _close(a, b)


async def test_a_cancelled_burst_gives_its_pool_sandboxes_back(db: Path | str) -> None:
    """A tenant lists its bursts and cancels one (on an apiserver that does not act): each edge is
    sent its pool's boost without that burst's share at once; another tenant's DELETE is 404 and
    changes nothing; the acting apiserver sends the boosts again; a second DELETE is a no-op."""
    edges = [FakeEdge("e0", 30), FakeEdge("e1", 20, used=10)]
    e0, e1 = edges
    a = await _env(db, edges)
    b = await _env(db, edges, tokens=_tokens(a))
    shape = {"project": "team-a", "memory_mb": 256, "cpu": 0.5}
    try:
        x = (await a.call("POST", "/v1/capacity", a.alice, {**shape, "count": 20})).json()["id"]
        await a.settle()
        y = (await a.call("POST", "/v1/capacity", a.alice, {**shape, "count": 10})).json()["id"]
        await a.settle()
        assert (e0.prewarms[-1][1], e1.prewarms[-1][1]) == (15 + 8, 5 + 2)
        listed = (await b.call("GET", "/v1/capacity", b.alice)).json()["bursts"]
        assert [(t["id"], t["state"]) for t in listed] == [(x, "ready"), (y, "ready")]

        sent = (len(e0.prewarms), len(e1.prewarms))
        for e in (a, b):
            for path in (f"/v1/capacity/{x}", "/v1/capacity/burst-nosuch"):
                r = await e.call("DELETE", path, e.bob)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert (len(e0.prewarms), len(e1.prewarms)) == sent and a.burst(x).state == "ready"

        r = await b.call("DELETE", f"/v1/capacity/{x}", b.alice)
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        assert any("cancelled by alice" in act for act in r.json()["actions"])
        assert (e0.prewarms[-1][1], e1.prewarms[-1][1]) == (8, 2)  # Y's share alone
        assert [(t.id, names) for t, names in a.iam.unreleased_bursts()] == [(x, ["e0", "e1"])]
        await a.capacity.tick()  # the acting apiserver sends them again, and is done with it
        assert (e0.prewarms[-1][1], e1.prewarms[-1][1]) == (8, 2) and len(e0.prewarms) == sent[0] + 2
        assert a.iam.unreleased_bursts() == []
        again = await a.call("DELETE", f"/v1/capacity/{x}", a.alice)
        assert again.status_code == 200 and again.json()["state"] == "cancelled"
        assert len(e0.prewarms) == sent[0] + 2

        r = await a.call("DELETE", f"/v1/capacity/{y}", a.admin)
        assert r.status_code == 200 and (e0.prewarms[-1][1], e1.prewarms[-1][1]) == (0, 0)
        seen = {t["id"]: t["state"] for t in (await b.call("GET", "/v1/capacity", b.alice)).json()["bursts"]}
        assert seen == {x: "cancelled", y: "cancelled"}
        assert a.iam.prewarm_held("e0", 0) == 0 and a.iam.held_edges(0) == {}
    finally:
        await _close(a, b)


class GatedEdge(FakeEdge):
    """An edge the first prewarm reaches only once `gate` is set (a request slow on the
    network): it applies what was read before it was sent."""

    def __init__(self, name: str, slots: int) -> None:
        super().__init__(name, slots)
        self.gate = asyncio.Event()
        self.sending = asyncio.Event()

    async def prewarm(self, spec: PoolSpec, count: int, project: str | None = None) -> PoolInfo:
        if not self.sending.is_set():
            self.sending.set()
            await self.gate.wait()
        return await super().prewarm(spec, count, project)


async def _until(cond: Any, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_cancelling_a_burst_in_flight_ends_it_and_no_stale_prewarm_stays(db: Path | str) -> None:
    """A burst whose prewarm is still on its way to the edge (read with the burst's share) is
    cancelled on the other apiserver, which sends 0 first; the stale 6 lands after it. The burst's
    task ends at its next write, and the acting apiserver sends the edge its boost again (0) after
    that prewarm. A burst waiting on its node provider is ended by the acting apiserver's round.
    Both stay cancelled."""
    edge, stuck = GatedEdge("e0", 6), StuckProvider(slots=10)
    a = await _env(db, [edge], stuck)
    b = await _env(db, [edge], tokens=_tokens(a))
    try:
        r = await a.call("POST", "/v1/capacity", a.alice, {"project": "team-a", "count": 10})
        first = r.json()["id"]
        await asyncio.wait_for(edge.sending.wait(), 5)
        r = await b.call("DELETE", f"/v1/capacity/{first}", b.alice)
        assert r.status_code == 200, r.text
        assert [n for _, n in edge.prewarms] == [0]
        edge.gate.set()
        await _until(lambda: a.capacity.running == {}, "the cancelled burst's task ended")
        assert [n for _, n in edge.prewarms] == [0, 6] and stuck.asked == []  # 6: stale
        await a.capacity.tick()
        assert [n for _, n in edge.prewarms] == [0, 6, 0]
        assert a.iam.unreleased_bursts() == [] and a.iam.prewarm_held("e0", 0) == 0

        r = await a.call("POST", "/v1/capacity", a.alice, {"project": "team-a", "count": 10})
        second = r.json()["id"]
        await _until(lambda: stuck.asked == [1], "the burst asked its provider for an edge")
        assert [n for _, n in edge.prewarms][-1] == 6 and second in a.capacity.running
        assert (await b.call("DELETE", f"/v1/capacity/{second}", b.admin)).status_code == 200
        await a.capacity.tick()
        assert a.capacity.running == {} and [n for _, n in edge.prewarms][-2:] == [0, 0]
        assert {x.id: x.state for x in a.iam.list_bursts(None)} == {first: "cancelled", second: "cancelled"}
    finally:
        await _close(a, b)
