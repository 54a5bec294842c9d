"""Registry pull benchmark: the first create of an image on an edge that lacks its layers
(manifest + blobs pulled from a real OCI registry on 127.0.0.1, sha256 checked while
streaming, unpacked, tree digest checked, committed) against a create on an edge that has
them, and a pool of 4 pre-warmed (until all 4 are ready) on each. The image is `python`
(one layer, ~690 MB of files). Between rounds the pulling edge evicts what it pulled, so
every round pulls again. Run as root:

    .venv/bin/python bench/bench_registry.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import pct, row

from dsec.cluster.registry import RegistryServer, free_port
from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.layers import LayerStore
from dsec.layers import distribution as dist
from dsec.models import PoolSpec, SandboxSpec

LAYERS = Path(os.environ.get("DSEC_TEST_LAYERS", "/var/lib/dsec/layers"))


def provisioned(store_root: Path, image: str) -> LayerStore:
    """A store holding `image` as a hard-link copy of the host's (a provisioned node)."""
    host = LayerStore(LAYERS)
    store = LayerStore(store_root)
    img = host.get_image(image)
    for ref in img.layers:
        d = store.layer_path(ref).parent
        d.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(host.layer_path(ref).parent), str(d)], check=True)
    store.put_image(img)
    return store


async def prewarmed(e: Edge, image: str, n: int) -> float:
    """Seconds from a prewarm of `n` to `n` ready; the pool is then dropped and stopped."""
    t = time.perf_counter()
    await e.prewarm(PoolSpec(image=image, memory_mb=256), n)
    while sum(p.ready for p in e.pools.list()) < n:
        await asyncio.sleep(0.005)
    took = time.perf_counter() - t
    await asyncio.gather(*(e.stop(sid) for sid in e.pools.drop(image)))
    return took


async def main(rounds: int, image: str) -> None:
    base = Path(tempfile.mkdtemp(prefix="dsec-bench-registry-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    server = RegistryServer(base / "registry", port=free_port())
    server.start()
    edges: list[Edge] = []
    try:
        src = provisioned(base / "source", image)
        url = f"{server.url}/bench"
        client = dist.RegistryClient(url)
        t = time.perf_counter()
        await dist.push_image(src, client, image)
        push = time.perf_counter() - t
        await client.aclose()
        size = sum(src.get_layer(r).size_bytes for r in src.get_image(image).layers)

        def edge(name: str, layers: Path) -> Edge:
            run = Path(tempfile.mkdtemp(prefix=f"dsec-bench-{name}-", dir="/run"))
            s = EdgeSettings(name=name, run_dir=run, layers_dir=layers, data_dir=base / f"data-{name}",
                             registry=url, reconcile_interval_s=3600, fncall_image="")  # fmt: skip
            e = Edge(s)
            edges.append(e)
            return e

        lacks = edge("rgl", base / "lacks")
        provisioned(base / "has", image)
        has = edge("rgh", base / "has")
        await lacks.start()
        await has.start()
        pulled, local, again = [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            a = await lacks.create(SandboxSpec(image=image))
            pulled.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = await lacks.create(SandboxSpec(image=image))
            again.append(time.perf_counter() - t)
            t = time.perf_counter()
            c = await has.create(SandboxSpec(image=image))
            local.append(time.perf_counter() - t)
            for e, sid in ((lacks, a.id), (lacks, b.id), (has, c.id)):
                await e.stop(sid)
            evicted = lacks.cache.evict(1)  # nothing in use: the next round pulls again
            assert evicted and not lacks.layers.has_image(image), evicted
        warm_pulled, warm_local = [], []
        for _ in range(rounds):
            for e, out in ((lacks, warm_pulled), (has, warm_local)):
                out.append(await prewarmed(e, image, 4))
            assert lacks.cache.evict(1) and not lacks.layers.has_image(image)
        base_ms = pct(local, 0.5)
        print(f"image {image}: {len(src.get_image(image).layers)} layer(s), {size / 1e6:.0f} MB of files; "
              f"push (archive + upload, once): {push:.1f} s; {rounds} rounds\n")  # fmt: skip
        print("| create | p50 ms | p95 ms | vs has layers |\n|---|---|---|---|")
        print(row("first create, edge lacks the layers (registry pull)", pulled, base_ms))
        print(row("second create on that edge (layers now cached)", again, base_ms))
        print(row("create on an edge that has the layers", local, base_ms))
        warm_ms = pct(warm_local, 0.5)
        print("\n| pre-warm a pool of 4, until ready | p50 ms | p95 ms | vs has layers |\n|---|---|---|---|")
        print(row("edge lacks the layers (registry pull first)", warm_pulled, warm_ms))
        print(row("edge has the layers", warm_local, warm_ms))
    finally:
        for e in edges:
            await e.close()
            shutil.rmtree(e.settings.run_dir, ignore_errors=True)
        server.remove()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--image", default="python")
    args = p.parse_args()
    asyncio.run(main(args.rounds, args.image))
