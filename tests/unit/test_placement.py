"""Placement over the watcher's view, with fake edges (control-plane logic only)."""

from __future__ import annotations

from typing import Any

import pytest

from dsec import errors
from dsec.apiserver.app import _place
from dsec.apiserver.placement import EdgeDirectory
from dsec.models import EdgeStatus, SandboxInfo, SandboxSpec, SandboxState


class FakeEdge:
    """A stand-in for an EdgeAPI: capacity bookkeeping only, no sandboxes."""

    url = None

    def __init__(self, name: str, capacity: int, used: int = 0, *, lies: bool = False) -> None:
        self.name = name
        self.capacity = capacity
        self.used = used
        self.lies = lies  # reports room it does not have (a stale view)
        self.created: list[str] = []

    async def status(self) -> EdgeStatus:
        used = 0 if self.lies else self.used
        return EdgeStatus(
            name=self.name,
            healthy=True,
            backends=["container"],
            capacity={"sandboxes": self.capacity, "cpu": 1000, "memory_mb": 10**6},
            used={"sandboxes": used, "cpu": used, "memory_mb": used * 100},
            sandboxes=used,
            by_image={},
            by_project={},
            layers=[],
            images=["python"],
        )

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        if self.used >= self.capacity:
            raise errors.CapacityExhausted(f"{self.name} is full")
        self.used += 1
        sid = f"{self.name}-{self.used:012d}"
        self.created.append(sid)
        return SandboxInfo(
            id=sid, state=SandboxState.RUNNING, spec=spec, edge=self.name, created_at=0, last_active=0
        )

    async def aclose(self) -> None:
        pass


class State:
    def __init__(self, directory: EdgeDirectory) -> None:
        self.directory = directory


async def _directory(*edges: Any) -> EdgeDirectory:
    d = EdgeDirectory()
    for e in edges:
        d.add(e)
    await d.poll_once()
    return d


async def test_full_edge_rejection_is_retried_elsewhere() -> None:
    full = FakeEdge("full", capacity=1, used=1, lies=True)
    roomy = FakeEdge("roomy", capacity=100, used=50)
    d = await _directory(full, roomy)
    for _ in range(10):
        info = await _place(State(d), SandboxSpec())  # type: ignore[arg-type]
        assert info.edge == "roomy"
    assert full.created == []


async def test_power_of_k_spreads_a_burst_before_the_next_poll() -> None:
    a, b = FakeEdge("a", 100), FakeEdge("b", 100)
    d = await _directory(a, b)
    for _ in range(20):
        await _place(State(d), SandboxSpec())  # type: ignore[arg-type]
    # the local overlay of recent placements balances without a new poll
    assert abs(len(a.created) - len(b.created)) <= 2


async def test_no_edge_with_the_image() -> None:
    d = await _directory(FakeEdge("a", 10))
    with pytest.raises(errors.ImageNotFound):
        d.candidates(SandboxSpec(image="rust"))


async def test_everything_full() -> None:
    d = await _directory(FakeEdge("a", 1, 1, lies=True), FakeEdge("b", 1, 1, lies=True))
    with pytest.raises(errors.CapacityExhausted):
        await _place(State(d), SandboxSpec())  # type: ignore[arg-type]


async def test_candidates_drawn_lazily_still_cover_every_able_edge_once() -> None:
    edges = [FakeEdge(f"e{i}", 100, used=i) for i in range(20)]
    d = await _directory(*edges, FakeEdge("other", 100))
    other = d.views["other"]
    other.status = other.status.model_copy(update={"images": ["rust"]})  # type: ignore[union-attr]
    c = d.candidates(SandboxSpec())
    first = c[0]
    assert first.api.name != "e19"  # the least loaded of two is never the most loaded of all
    order = list(c)
    assert order[0] is first and c[-1] is order[-1] and len(order) == len(c) == 20
    assert sorted(v.api.name for v in order) == sorted(e.name for e in edges)
    assert d.views["e3"] in c and d.views["other"] not in c
    assert c[1:3] == order[1:3]
    with pytest.raises(IndexError):
        c[20]
