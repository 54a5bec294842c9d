"""The price of disk (issue #26 item 6): create -> first exec of a sandbox whose writable layer
is an ext4 of its own on a loop device (storage="disk", the default) against a tmpfs upper
(storage="memory"), alternating in the same run, per backend; stop with its teardown (which
runs in the background, after the stop's answer); a write of 256 MiB and a sync. Run as root:

    .venv/bin/python bench/bench_disk_upper.py [--n 40] [--backends container,gvisor]

Prints Markdown for docs/benchmarks.md: read the ratios (a shared, noisy 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from _common import pct, row  # type: ignore[import-not-found]

from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.models import ExecRequest, SandboxSpec

WRITE = "head -c 268435456 /dev/zero > /work/w && sync"


async def measure(edge: Edge, backend: str, n: int) -> list[str]:
    specs = {
        s: SandboxSpec(backend=backend, storage=s, memory_mb=512, disk_mb=2048) for s in ("memory", "disk")
    }
    for spec in specs.values():  # warm caches (and the disk's blank template, made once per shape)
        await edge.stop((await edge.create(spec)).id)
    first: dict[str, list[float]] = {s: [] for s in specs}
    stop: dict[str, list[float]] = {s: [] for s in specs}
    write: dict[str, list[float]] = {s: [] for s in specs}
    for i in range(n):
        for s, spec in specs.items():  # alternating: the host's noise falls on both alike
            t = time.perf_counter()
            sb = await edge.create(spec)
            await edge.exec(sb.id, ExecRequest(cmd=["/bin/true"]))
            first[s].append(time.perf_counter() - t)
            if i < max(3, n // 8):
                t = time.perf_counter()
                await edge.exec(sb.id, ExecRequest(cmd=WRITE, timeout=120))
                write[s].append(time.perf_counter() - t)
            t = time.perf_counter()
            await edge.stop(sb.id)  # returns at once: the teardown runs in the background,
            await asyncio.gather(*edge.life._terminating.values())  # waited for here
            stop[s].append(time.perf_counter() - t)
    base = pct(first["memory"], 0.5)
    out = [f"| {backend}: operation | p50 ms | p95 ms | vs memory |", "|---|---|---|---|"]
    out.append(row("create -> first exec, storage=memory (tmpfs)", first["memory"], base))
    out.append(row("create -> first exec, storage=disk (ext4 on loop)", first["disk"], base))
    sbase = pct(stop["memory"], 0.5)
    out.append(row("stop + teardown, memory", stop["memory"], sbase))
    out.append(row("stop + teardown, disk", stop["disk"], sbase))
    out.append(row("write 256 MiB + sync, memory", write["memory"], pct(write["memory"], 0.5)))
    out.append(row("write 256 MiB + sync, disk", write["disk"], pct(write["memory"], 0.5)))
    return out


async def main(n: int, backends: list[str]) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    edge = Edge(EdgeSettings(name="bdisk", run_dir=run_dir, reconcile_interval_s=3600, fncall_image="",
                             backends=backends))  # fmt: skip
    await edge.start()
    try:
        for backend in backends:
            print("\n".join(await measure(edge, backend, n)))
            print()
    finally:
        await edge.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--backends", default="container,gvisor")
    a = p.parse_args()
    asyncio.run(main(a.n, a.backends.split(",")))
