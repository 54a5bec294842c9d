"""Placement by layer affinity over the watcher's index (fake edges, control-plane logic only):
edges holding an image first, then those holding more of its layers; a loaded holder spills;
an edge that went silent, drains or is released since the last poll is never drawn."""

from __future__ import annotations

import asyncio
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


async def _push_manifest(url: str, image: str, refs: list[str]) -> None:
    """An image's manifest in a real registry: a config and one blob per layer, each layer
    descriptor annotated with its ref (as `dsec image push` writes them)."""
    from dsec.layers import distribution as dist

    client = dist.RegistryClient(url)
    try:
        cfg, cfg_size = await client.push_blob_bytes(b'{"image": {}}')
        layers = []
        for ref in refs:
            digest, size = await client.push_blob_bytes(ref.encode())
            layers.append({
                "mediaType": dist.LAYER_TYPE, "digest": digest, "size": size,
                "annotations": {dist.ANN_REF: ref, dist.ANN_TREE: "sha256:" + "0" * 64},
            })  # fmt: skip
        await client.put_manifest(dist.image_tag(image), {
            "schemaVersion": 2, "mediaType": dist.MANIFEST_TYPE,
            "config": {"mediaType": dist.CONFIG_TYPE, "digest": cfg, "size": cfg_size},
            "layers": layers,
        })  # fmt: skip
    finally:
        await client.aclose()


async def test_an_image_no_edge_holds_goes_where_most_of_its_layers_are(registry_url: str) -> None:
    """An image just pushed (no edge holds it) built on layers some edges cache: placement
    reads its layers from the registry's manifest (a real registry) and tries the edges that
    hold more of them first. One read for a burst; an image the registry lacks, or a registry
    that is away or slow, costs only the preference."""
    from dsec.layers.distribution import RegistryClient

    await _push_manifest(registry_url, "swe", LAYERS)
    most, some = LayerEdge("most", capacity=1000, layers=2), LayerEdge("some", layers=1)
    d = await _directory(LayerEdge("none"), some, most)
    assert "swe" not in d.image_layers  # no edge holds it: the edges cannot tell its layers
    client = RegistryClient(registry_url, timeout=5.0)
    try:
        assert await client.layer_refs("swe") == frozenset(LAYERS)
        assert await client.layer_refs("nothing-here") is None
        before = client.counts["GET manifest"]
        d.registry_layers = client.layer_refs
        for _ in range(20):  # a burst: the first create reads, the others wait on that read
            await asyncio.gather(*(_place(State(d), SandboxSpec(image="swe")) for _ in range(5)))  # type: ignore[arg-type]
        assert client.counts["GET manifest"] == before + 1
        assert len(most.created) == 100  # the edge holding 2 of its 3 layers took them all
        for _ in range(3):
            assert _names(d) == ["most", "some", "none"]
        # an image the registry lacks: no preference, and not asked again within the minute
        await _place(State(d), SandboxSpec(image="nothing-here"))  # type: ignore[arg-type]
        await _place(State(d), SandboxSpec(image="nothing-here"))  # type: ignore[arg-type]
        assert client.counts["GET manifest"] == before + 2
    finally:
        await client.aclose()

    async def away(_image: str) -> frozenset[str] | None:
        raise errors.Unavailable("registry cannot be reached")

    async def slow(_image: str) -> frozenset[str] | None:
        await asyncio.sleep(30)
        return frozenset(LAYERS)

    for reader in (away, slow):
        d = await _directory(LayerEdge("most", layers=2), LayerEdge("none"))
        d.registry_layers = reader
        t = time.monotonic()
        info = await asyncio.wait_for(_place(State(d), SandboxSpec(image="swe")), 5)  # type: ignore[arg-type]
        assert info.edge in ("most", "none") and time.monotonic() - t < 2.5
        await d.close()  # (ends the slow read)
        assert not d._reading


async def test_the_apiservers_registry_setting_feeds_placement(tmp_path: Any, registry_url: str) -> None:
    """DSEC_APISERVER_REGISTRY (what `dsec cluster up` and the manifests set): a create through
    the API of an image only the registry has goes to the edge holding most of its layers."""
    import httpx

    from dsec.apiserver.app import create_api_app
    from dsec.apiserver.tenancy import ApiServerSettings
    from dsec.iam import IAM

    await _push_manifest(registry_url, "swe", LAYERS)
    edges = [LayerEdge("none"), LayerEdge("some", layers=1), LayerEdge("most", capacity=1000, layers=2)]
    iam = IAM(tmp_path / "iam.db")
    admin = iam.bootstrap()
    settings = ApiServerSettings(registry=registry_url)
    app = create_api_app(iam=iam, cluster_token="c", local_edges=edges, settings=settings)  # type: ignore[arg-type]
    directory = app.state.dsec.directory
    try:
        await directory.poll_once()
        headers = {"authorization": f"Bearer {admin}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for _ in range(5):
                r = await c.post("/v1/sandboxes", json={"image": "swe"}, headers=headers)
                assert r.status_code == 201, r.text
                assert r.json()["edge"] == "most"
    finally:
        await directory.registry_layers.__self__.aclose()  # (the app's lifespan would)
        iam.close()
