"""Placement with edges that pull from a registry (EdgeStatus.registry): fake edges only."""

from __future__ import annotations

import pytest

from dsec import errors
from dsec.apiserver.app import _place
from dsec.models import EdgeStatus, SandboxSpec

from .test_placement import FakeEdge, State, _directory


class RegistryEdge(FakeEdge):
    """An edge with `images`, pulling what it lacks when `registry`."""

    def __init__(self, name: str, capacity: int, used: int = 0, *, images: list[str], registry: bool) -> None:
        super().__init__(name, capacity, used)
        self.images, self.registry = images, registry

    async def status(self) -> EdgeStatus:
        s = await super().status()
        return s.model_copy(update={"images": self.images, "registry": self.registry})


async def test_no_holder_falls_back_to_edges_with_a_registry() -> None:
    plain = RegistryEdge("plain", 100, images=["python"], registry=False)
    puller = RegistryEdge("puller", 100, images=["python"], registry=True)
    d = await _directory(plain, puller)
    info = await _place(State(d), SandboxSpec(image="snap-x"))  # type: ignore[arg-type]
    assert info.edge == "puller"
    d2 = await _directory(RegistryEdge("plain", 100, images=[], registry=False))
    with pytest.raises(errors.ImageNotFound):
        await _place(State(d2), SandboxSpec(image="snap-x"))  # type: ignore[arg-type]


async def test_a_full_holder_sends_the_create_to_a_puller_never_to_an_edge_without_a_registry() -> None:
    holder = RegistryEdge("holder", 1, used=1, images=["snap-x"], registry=True)
    puller = RegistryEdge("puller", 100, images=[], registry=True)
    plain = RegistryEdge("plain", 100, used=90, images=[], registry=False)
    d = await _directory(holder, puller, plain)
    info = await _place(State(d), SandboxSpec(image="snap-x"))  # type: ignore[arg-type]
    assert info.edge == "puller"
    # the puller fills up: the plain edge has room but no way to get the image (no relay)
    puller.used = puller.capacity
    d = await _directory(holder, puller, plain)
    with pytest.raises(errors.CapacityExhausted, match="every edge that has image 'snap-x' is full"):
        await _place(State(d), SandboxSpec(image="snap-x"))  # type: ignore[arg-type]
    assert plain.used == 90  # never asked
