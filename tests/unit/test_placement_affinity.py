"""Placement by layer affinity over the watcher's index (fake edges, control-plane logic only):
edges holding an image first, then those holding more of its layers; a loaded holder spills;
an edge that went silent, drains or is released since the last poll is never drawn."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from dsec import errors
from dsec.apiserver.app import _place
from dsec.apiserver.placement import EdgeDirectory
from dsec.models import EdgeStatus, SandboxSpec

from .test_placement import FakeEdge, State, _directory

LAYERS = ["base@1", "py@1", "swe@1"]  # the image "swe", bottom first


class LayerEdge(FakeEdge):
    """An edge with images, cached layers and a registry (it pulls what it lacks)."""

    def __init__(
        self, name: str, capacity: int = 100, used: int = 0, *, images: tuple[str, ...] = (), layers: int = 0
    ) -> None:
        super().__init__(name, capacity, used)
        self.held = list(images)
        self.layers = LAYERS[:layers] if "swe" not in images else list(LAYERS)
        self.asked_images = 0

    async def status(self) -> EdgeStatus:
        s = await super().status()
        return s.model_copy(update={"images": self.held, "layers": self.layers, "registry": True})

    async def images(self) -> list[dict[str, Any]]:  # what an edge answers on GET /v1/images
        self.asked_images += 1
        return [{"name": i, "layers": LAYERS if i == "swe" else ["base@1"]} for i in self.held]


def _names(d: EdgeDirectory, image: str = "swe") -> list[str]:
    return [v.api.name for v in d.candidates(SandboxSpec(image=image))]


async def test_holders_first_then_more_layers_before_fewer() -> None:
    holder = LayerEdge("holder", images=("swe",))
    most, some, none = LayerEdge("most", layers=2), LayerEdge("some", layers=1), LayerEdge("none")
    d = await _directory(none, some, most, holder)
    assert d.image_layers["swe"][0] == frozenset(LAYERS)  # learned from the edge that holds it
    for _ in range(5):
        assert _names(d) == ["holder", "most", "some", "none"]
    await d.poll_once()
    assert holder.asked_images == 1  # once per image (then after its ttl), not per poll


async def test_a_loaded_holder_spills_to_the_edges_with_most_layers() -> None:
    holder = LayerEdge("holder", capacity=10, used=9, images=("swe",))  # 90%: spill_at
    d = await _directory(holder, LayerEdge("most", layers=2), LayerEdge("none"))
    assert _names(d) == ["most", "none", "holder"]  # tried last: it may still have room
    holder.used = 10
    d = await _directory(holder, LayerEdge("most", used=100, layers=2), LayerEdge("none"))
    info = await _place(State(d), SandboxSpec(image="swe"))  # type: ignore[arg-type]
    assert info.edge == "none"  # the full ones refuse; the last able edge pulls the image


async def test_the_overlay_of_recent_placements_spills_a_burst_off_the_holder() -> None:
    holder = LayerEdge("holder", capacity=20, images=("swe",))
    most = [LayerEdge(f"most{i}", capacity=1000, layers=2) for i in range(4)]
    d = await _directory(holder, *most)
    for _ in range(60):  # no poll meanwhile: only this apiserver's overlay knows the holder filled
        await _place(State(d), SandboxSpec(image="swe"))  # type: ignore[arg-type]
    assert len(holder.created) == 18  # up to spill_at (90%), then the next tier
    spread = Counter({e.name: len(e.created) for e in most})
    assert sum(spread.values()) == 42 and min(spread.values()) >= 6  # power of two within the tier


async def test_equal_edges_share_a_burst() -> None:
    edges = [LayerEdge(f"e{i}", images=("swe",)) for i in range(4)]
    d = await _directory(*edges)
    for _ in range(40):
        await _place(State(d), SandboxSpec(image="swe"))  # type: ignore[arg-type]
    assert max(len(e.created) for e in edges) - min(len(e.created) for e in edges) <= 3


async def test_health_drains_and_releases_between_polls_are_honoured() -> None:
    a, b, c = LayerEdge("a", images=("swe",)), LayerEdge("b", images=("swe",)), LayerEdge("c", layers=1)
    d = await _directory(a, b, c)
    d.views["a"].last_ok = time.monotonic() - d.lost_after_s - 1  # silent since: unhealthy now
    d.views["b"].draining = True
    assert _names(d) == ["c"]
    d.views["b"].draining = False  # a drain lifted between polls: at once
    assert _names(d) == ["b", "c"]
    del d.views["b"]  # released (dsec.apiserver.capacity)
    assert _names(d) == ["c"]
    d.views["c"].draining = True
    with pytest.raises(errors.Unavailable):
        d.candidates(SandboxSpec(image="swe"))


async def test_the_index_is_made_once_per_poll_not_per_create(monkeypatch: pytest.MonkeyPatch) -> None:
    d = await _directory(*(LayerEdge(f"e{i}", images=("swe",)) for i in range(10)))
    made = 0
    tiers = d._tiers

    def counted(backend: str, image: str) -> Any:
        nonlocal made
        made += 1
        return tiers(backend, image)

    monkeypatch.setattr(d, "_tiers", counted)
    for _ in range(50):
        _names(d)
    assert made == 1
    await d.poll_once()  # remade at the poll (a key asked for lately), then read by creates
    for _ in range(50):
        _names(d)
    assert made == 2
    d.views["e0"].status = None  # a status replaced outside a poll (a registration): remade
    assert "e0" not in _names(d) and made == 3
