"""Layers through a real OCI registry (Debian's docker-registry, the `registry_server`
fixture): push, pull by digest on a fresh edge, corruption refused, concurrent creates
sharing one download, LRU eviction under a budget, snapshots restored on another edge and
deleted from the registry with their owner checked there, warm pools pulling what they lack,
and an edge without a registry refusing an image it lacks."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec import errors
from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.layers import LayerStore, import_dir_layer
from dsec.layers import distribution as dist
from dsec.layers.store import Image
from dsec.models import ExecRequest, PoolSpec, SandboxSpec

from ..conftest import LAYERS

pytestmark = [pytest.mark.root]


def _copy_layer(src: LayerStore, dst: LayerStore, ref: object) -> None:
    """A hard-link copy of one layer (a node provisioned with it), its own directories."""
    s = src.layer_path(str(ref)).parent
    d = dst.layer_path(str(ref)).parent
    d.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(s), str(d)], check=True)


def _small_layer(store: LayerStore, name: str, size: int) -> object:
    with store.staging() as tmp:
        src = Path(tmp) / "src"
        (src / "opt" / name).mkdir(parents=True)
        (src / "opt" / name / "data").write_bytes(os.urandom(size))
        (src / "opt" / name / "hello").write_text(f"{name}\n")
        return import_dir_layer(store, name, "1", src).ref


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, registry_server: object, python_image: str
) -> Iterator[dict]:
    """A source store (python hard-linked, small layers of its own) whose images are pushed
    to a fresh repository: `python`, and small images stacked on python."""
    base = tmp_path_factory.mktemp("dsec-registry")
    src = LayerStore(base / "source")
    python = LayerStore(LAYERS).get_image(python_image)
    for ref in python.layers:
        _copy_layer(LayerStore(LAYERS), src, ref)
    src.put_image(python)
    small = {n: _small_layer(src, n, 1200 * 1024) for n in ("rega", "regb", "regc", "regd", "rege")}
    for n, ref in small.items():
        src.put_image(Image(name=n, layers=[*python.layers, ref]))
    src.put_image(Image(name="regpair", layers=[*python.layers, small["regd"], small["rege"]]))
    url = f"{registry_server.url}/t{secrets.token_hex(4)}"  # type: ignore[attr-defined]

    async def push() -> dict[str, str]:
        client = dist.RegistryClient(url)
        try:
            return {n: await dist.push_image(src, client, n) for n in ["python", *small, "regpair"]}
        finally:
            await client.aclose()

    manifests = asyncio.run(push())
    yield {"url": url, "src": src, "python": python, "small": small, "manifests": manifests, "base": base}
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def make_edge(edge_dirs: dict[str, Path], tmp_path: Path, world: dict) -> AsyncIterator[object]:
    """Edges with a registry, each over a layer store of its own (empty, or with python
    hard-linked: a node provisioned with the base image); closed afterwards."""
    made: list[Edge] = []

    async def make(
        *, with_python: bool = False, budget_mb: int = 0, registry: str | None = None, plain: bool = False
    ) -> Edge:
        layers = tmp_path / f"layers-{len(made)}"
        store = LayerStore(layers)
        if with_python:
            for ref in world["python"].layers:
                _copy_layer(world["src"], store, ref)
            store.put_image(world["python"])
        dirs = {**edge_dirs, "layers_dir": layers, "run_dir": Path(f"{edge_dirs['run_dir']}-{len(made)}")}
        e = Edge(
            EdgeSettings(
                name="t" + secrets.token_hex(4),
                reconcile_interval_s=3600,
                fncall_image="",
                registry=None if plain else registry or world["url"],
                registry_cache_mb=budget_mb,
                **dirs,
            )
        )
        await e.start()
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            await e.close()
            shutil.rmtree(e.settings.run_dir, ignore_errors=True)
            shutil.rmtree(e.settings.layer_root, ignore_errors=True)


async def sh(edge: Edge, sid: str, cmd: str) -> str:
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=60))
    assert r.exit_code == 0, r.stderr
    return r.stdout


def _staging_empty(store: LayerStore) -> bool:
    return not any((store.root / "staging").iterdir())


async def test_fresh_edge_pulls_an_image_by_digest_and_runs_it(make_edge, world):
    e = await make_edge()
    assert not e.layers.has_image("python")
    sb = await e.create(SandboxSpec(image="python"))
    assert await sh(e, sb.id, "python3 -c 'print(6*7)'") == "42\n"
    for ref in world["python"].layers:
        pulled, original = e.layers.get_layer(ref), world["src"].get_layer(ref)
        assert pulled.digest == original.digest  # the same tree, checked before the commit
        assert pulled.source["type"] == "registry"
        assert e.layers.blob_of(ref) == world["src"].blob_of(ref)
    assert e.layers.get_image("python").source["pulled_from"] == world["url"]
    assert e.cache.client.counts["GET blob"] == len(world["python"].layers) + 1  # + the config
    assert e.status().registry
    # a second create uses what is there: no request at all
    before = sum(e.cache.client.counts.values())
    sb2 = await e.create(SandboxSpec(image="python"))
    assert sum(e.cache.client.counts.values()) == before
    await e.stop(sb.id)
    await e.stop(sb2.id)
    assert _staging_empty(e.layers)


async def test_an_image_the_registry_lacks_is_image_not_found(make_edge):
    e = await make_edge()
    with pytest.raises(errors.ImageNotFound, match="nor in registry"):
        await e.create(SandboxSpec(image="nosuchimage"))


async def test_a_corrupted_blob_is_refused_and_nothing_is_committed(make_edge, world, registry_server):
    ref = world["small"]["regb"]
    blob, size = world["src"].blob_of(ref)
    path = registry_server.blob_path(blob)
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF  # one flipped byte, the same size
    path.write_bytes(bytes(bad))
    try:
        e = await make_edge(with_python=True)
        with pytest.raises(
            errors.LayerCorrupted, match=f"blob {blob} .* is corrupted: its {size} bytes hash to"
        ):
            await e.create(SandboxSpec(image="regb"))
        assert not e.layers.has_layer(ref)
        assert not e.layers.has_image("regb")
        assert _staging_empty(e.layers)
        assert not e.sandboxes
    finally:
        path.write_bytes(good)
    # restored in the registry: the next create pulls it
    sb = await e.create(SandboxSpec(image="regb"))
    assert await sh(e, sb.id, "cat /opt/regb/hello") == "regb\n"
    await e.stop(sb.id)


async def test_a_tree_that_does_not_match_its_digest_is_refused(make_edge, world, registry_server):
    """The blob is intact but the manifest names another tree digest (a layer swapped for
    another one of the same name): refused after unpacking, before the commit."""
    url = f"{registry_server.url}/t{secrets.token_hex(4)}"
    client = dist.RegistryClient(url)
    try:
        await dist.push_image(world["src"], client, "regc")
        m, _ = await client.get_manifest("regc")
        m["layers"][-1]["annotations"][dist.ANN_TREE] = "sha256:" + "0" * 64
        await client.put_manifest("regc", m)
    finally:
        await client.aclose()
    e = await make_edge(with_python=True, registry=url)
    with pytest.raises(errors.LayerCorrupted, match=r"its tree hashes to .* nothing was committed"):
        await e.create(SandboxSpec(image="regc"))
    assert not e.layers.has_layer(world["small"]["regc"])
    assert _staging_empty(e.layers)


async def test_fifty_concurrent_creates_cause_one_download_per_layer(make_edge, world, registry_server):
    e = await make_edge(with_python=True)
    spec = SandboxSpec(image="regpair", memory_mb=64)
    made = await asyncio.gather(*(e.create(spec) for _ in range(50)))
    assert len({i.id for i in made}) == 50
    assert await sh(e, made[-1].id, "cat /opt/regd/hello /opt/rege/hello") == "regd\nrege\n"
    # counted in the client and at the registry (its access log)
    assert e.cache.client.counts["GET manifest"] == 1
    assert e.cache.client.counts["GET blob"] == 3  # two layers and the config
    for name in ("regd", "rege"):
        blob, _ = world["src"].blob_of(world["small"][name])
        assert registry_server.requests("GET", f"/blobs/{blob}") == 1
    await asyncio.gather(*(e.stop(i.id) for i in made))


async def test_lru_eviction_under_a_budget_spares_what_is_in_use(make_edge, world):
    small = world["small"]
    e = await make_edge(with_python=True, budget_mb=2)  # each small layer is 1.2 MiB
    a = await e.create(SandboxSpec(image="rega"))  # stays alive
    b = await e.create(SandboxSpec(image="regb"))
    await e.stop(b.id)  # waits for the teardown
    assert e.layers.has_layer(small["rega"]) and e.layers.has_layer(small["regb"])  # nothing evictable
    c = await e.create(SandboxSpec(image="regc"))  # 3.6 MiB pulled: b's layer goes (unused, oldest)
    assert not e.layers.has_layer(small["regb"]) and not e.layers.has_image("regb")
    assert e.layers.has_layer(small["rega"])  # a live sandbox uses it
    assert e.layers.has_layer(small["regc"])  # just pulled for a create
    for ref in world["python"].layers:
        assert e.layers.has_layer(ref)  # a local image's layer, never evicted
    assert await sh(e, a.id, "cat /opt/rega/hello") == "rega\n"
    # an explicit pass with no budget left evicts nothing in use either
    assert e.cache.evict(1) == []
    await e.stop(c.id, wait=False)
    assert e.cache.evict(1) == []  # still being torn down: its layers may be mounted
    await asyncio.gather(*list(e.life._terminating.values()))
    assert e.cache.evict(1) == [str(small["regc"])]
    # an evicted image is pulled again when wanted
    b2 = await e.create(SandboxSpec(image="regb"))
    assert await sh(e, b2.id, "cat /opt/regb/hello") == "regb\n"
    await e.stop(a.id)
    await e.stop(b2.id)


async def test_a_snapshot_made_on_one_edge_restores_on_another(make_edge, world, registry_server):
    url = f"{registry_server.url}/t{secrets.token_hex(4)}"
    one = await make_edge(with_python=True, registry=url)
    two = await make_edge(registry=url)  # an empty store: everything comes from the registry
    sb = await one.create(SandboxSpec(image="python", project="p1"))
    await sh(one, sb.id, "mkdir -p /work && echo from-one > /work/state")
    snap = await one.snapshot(sb.id)
    restored = await two.create(SandboxSpec(image=snap.id, project="p1"))
    assert await sh(two, restored.id, "cat /work/state") == "from-one\n"
    image = two.layers.get_image(snap.id)
    assert image.source["project"] == "p1" and image.source["type"] == "snapshot"
    assert two.layers.get_layer(snap.layer).digest == one.layers.get_layer(snap.layer).digest
    with pytest.raises(errors.ImageNotFound):  # still another project's snapshot
        await two.create(SandboxSpec(image=snap.id, project="p2"))
    assert registry_server.requests("PUT", f"/manifests/{snap.id}") == 1  # pushed when made
    await one.stop(sb.id)
    await two.stop(restored.id)


async def test_a_snapshot_of_another_project_is_not_pulled(make_edge, registry_server):
    """A create naming another project's snapshot is image_not_found before any of its
    layers is fetched: a tenant cannot make an edge download what it may not use."""
    url = f"{registry_server.url}/t{secrets.token_hex(4)}"
    one = await make_edge(with_python=True, registry=url)
    other = await make_edge(with_python=True, registry=url)
    sb = await one.create(SandboxSpec(image="python", project="p1"))
    await sh(one, sb.id, "mkdir -p /work && echo mine > /work/state")
    snap = await one.snapshot(sb.id)
    with pytest.raises(errors.ImageNotFound, match=f"no snapshot '{snap.id}' in project 'p2'"):
        await other.create(SandboxSpec(image=snap.id, project="p2"))
    assert other.cache.client.counts["GET blob"] == 1  # the config only, not the layer
    assert not other.layers.has_layer(snap.layer) and not other.layers.has_image(snap.id)
    for e in (other, one):  # nor can that project's burst pre-warm it, pulled or held
        with pytest.raises(errors.ImageNotFound, match="in project 'p2'"):
            await e.prewarm(PoolSpec(image=snap.id, memory_mb=64), 1, "p2")
    assert not other.layers.has_layer(snap.layer) and not e.pools.pools
    await one.stop(sb.id)


async def test_deleting_a_snapshot_deletes_its_manifest_in_the_registry(make_edge, registry_server):
    """Pushed when made, pulled by another edge; another project can delete it neither from
    an edge holding it nor through the registry; its owner deletes it from an edge that
    never held it (the registry's copy alone: its edge may be gone), then the copies. After
    that the manifest is 404 at the registry and a create from it is image_not_found. The
    blobs stay for the registry's garbage collection."""
    url = f"{registry_server.url}/t{secrets.token_hex(4)}"
    one = await make_edge(with_python=True, registry=url)
    two = await make_edge(with_python=True, registry=url)
    three = await make_edge(with_python=True, registry=url)
    sb = await one.create(SandboxSpec(image="python", project="p1"))
    await sh(one, sb.id, "mkdir -p /work && echo kept > /work/state")
    snap = await one.snapshot(sb.id)
    await one.stop(sb.id)
    restored = await two.create(SandboxSpec(image=snap.id, project="p1"))
    assert await sh(two, restored.id, "cat /work/state") == "kept\n"
    await two.stop(restored.id)
    reg = dist.RegistryClient(url)
    try:
        pulled = await reg.pull_manifest(snap.id)
        assert pulled is not None
        layer_blob = pulled.layers[-1].blob
        # another project: refused on an edge holding a copy, and on one reading the registry
        for e in (two, three):
            with pytest.raises(errors.ImageNotFound, match="no snapshot"):
                await e.delete_snapshot(snap.id, {"p2"})
        assert await reg.get_manifest(dist.image_tag(snap.id)) is not None
        assert two.layers.has_image(snap.id)
        # the owner, through an edge that never held it: the registry's copy goes
        await three.delete_snapshot(snap.id, {"p1"})
        assert await reg.get_manifest(dist.image_tag(snap.id)) is None
        r = await reg.http.get(
            f"/v2/{reg.repo}/manifests/{pulled.digest}", headers={"Accept": dist.MANIFEST_TYPE}
        )
        assert r.status_code == 404
        assert registry_server.requests("DELETE", f"/manifests/{pulled.digest}") == 1
        assert await reg.has_blob(layer_blob)  # left for `docker-registry garbage-collect`
        with pytest.raises(errors.ImageNotFound):  # nothing of it left for three to delete
            await three.delete_snapshot(snap.id, {"p1"})
        # the copies: the registry has none any more, each edge still deletes its own
        await one.delete_snapshot(snap.id, {"p1"})
        await two.delete_snapshot(snap.id)
        assert not one.layers.has_image(snap.id) and not two.layers.has_image(snap.id)
        for e in (one, two, three):
            with pytest.raises(errors.ImageNotFound, match="nor in registry"):
                await e.create(SandboxSpec(image=snap.id, project="p1"))
    finally:
        await reg.aclose()


async def test_a_pool_for_an_image_the_edge_lacks_pulls_it_first(make_edge, world):
    """Pre-warming a pool of an image the edge lacks pulls it (one manifest read and one
    download per layer, however many ask at once), then fills the pool; creates of that
    shape are served from it."""
    e = await make_edge(with_python=True)
    spec = PoolSpec(image="regd", memory_mb=64)
    infos = await asyncio.gather(
        e.prewarm(spec, 2), e.configure_pool(spec), e.create(SandboxSpec(image="regd", memory_mb=32))
    )
    assert e.layers.has_image("regd") and e.layers.get_image("regd").source["pulled_from"] == world["url"]
    assert e.cache.client.counts["GET manifest"] == 1
    assert e.cache.client.counts["GET blob"] == 2  # the one missing layer and the config
    for _ in range(600):
        if e.pools.list()[0].ready >= 2:
            break
        await asyncio.sleep(0.1)
    assert e.pools.list()[0].ready >= 2, e.pools.list()
    got = await e.create(SandboxSpec(image="regd", memory_mb=64))
    assert got.timings_ms.get("pool") is not None  # served from the pool
    assert await sh(e, got.id, "cat /opt/regd/hello") == "regd\n"
    await e.stop(got.id)
    await e.stop(infos[2].id)
    with pytest.raises(errors.ImageNotFound, match="nor in registry"):
        await e.prewarm(PoolSpec(image="nosuchpool"), 2)


async def test_an_edge_without_a_registry_refuses_an_image_it_lacks(make_edge):
    e = await make_edge(plain=True)
    for ask in (
        lambda: e.create(SandboxSpec(image="regd")),
        lambda: e.prewarm(PoolSpec(image="regd"), 1),
    ):
        with pytest.raises(errors.ImageNotFound, match="DSEC_EDGE_REGISTRY") as exc:
            await asyncio.wait_for(ask(), 30)
        assert exc.value.status == 404 and exc.value.details["reason"] == "no_registry"
    assert not e.sandboxes


async def test_no_sandbox_policy_may_reach_the_registry(make_edge):
    """It holds every project's snapshots and takes pushes without credentials: an edge
    counts its registry's host among the platform's addresses."""
    e = await make_edge(with_python=True, registry="http://10.213.7.9:5000/dsec")  # (never reached)
    with pytest.raises(errors.InvalidRequest, match=r"10\.213\.7\.9") as exc:
        await e.create(
            SandboxSpec(image="python", network={"allow": [{"to": "10.213.7.9", "ports": [5000]}]})
        )
    assert exc.value.status == 400 and not e.sandboxes


def test_cli_image_push_uploads_each_layer_once(tmp_path, registry_server):
    from typer.testing import CliRunner

    from dsec.cli.main import app

    data = tmp_path / "data"
    store = LayerStore(data / "layers")
    ref = _small_layer(store, "clilayer", 4096)
    store.put_image(Image(name="cli:v1", layers=[ref]))
    url = f"{registry_server.url}/t{secrets.token_hex(4)}"
    runner = CliRunner()
    args = ["image", "push", "cli:v1", "--registry", url, "--data-dir", str(data), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    out = json.loads(first.output)
    assert out["layers"] == [str(ref)] and out["uploaded"] == 2  # the layer and the config
    assert out["tag"] != "cli:v1" and out["manifest"].startswith("sha256:")
    again = json.loads(runner.invoke(app, args).output)
    assert again["uploaded"] == 0 and again["manifest"] == out["manifest"]
    missing = runner.invoke(app, ["image", "push", "nope", "--registry", url, "--data-dir", str(data)])
    assert missing.exit_code != 0 and "image_not_found" in missing.output

    async def pulled() -> dist.Pulled | None:
        client = dist.RegistryClient(url)
        try:
            return await client.pull_manifest("cli:v1")
        finally:
            await client.aclose()

    got = asyncio.run(pulled())
    assert got is not None and got.layers[0].tree_digest == store.get_layer(ref).digest
