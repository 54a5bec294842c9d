"""Durable trajectory acknowledgements against queued ones, in one edge, interleaved. As root:

    .venv/bin/python bench/bench_trajlog_acks.py [--rounds 6] [--n 60] [--concurrent 64]

An exec is answered once its trajectory entry is committed (`trajectory_durable_acks`, the
default: a kill -9 of the edge loses nothing acknowledged) or once it is queued (the old way:
a kill -9 loses at most a batch or two, declared as a gap). Measures, on one sandbox of the
`python` image, sequential `/bin/true` execs (p50/p95) and bursts of `--concurrent` at once
(execs/s), the two modes alternating round by round in the same process. Prints Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import pct  # type: ignore[import-not-found]

from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.models import ExecRequest, SandboxSpec


async def main(rounds: int, n: int, concurrent: int) -> None:
    name = "ba" + secrets.token_hex(3)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-acks-") as tmp:
        settings = EdgeSettings(
            name=name, reconcile_interval_s=3600, fncall_image="", data_dir=Path(tmp) / "data",
            layers_dir=Path("/var/lib/dsec/layers"), run_dir=Path(f"/run/dsec-bench-{name}"),
            criu_dir=Path("/var/lib/dsec/criu"), backends=["container"],
        )  # fmt: skip
        edge = Edge(settings)
        await edge.start()
        try:
            sb = await edge.create(SandboxSpec(image="python", memory_mb=128))
            req = ExecRequest(cmd=["/bin/true"])
            seq: dict[bool, list[float]] = {True: [], False: []}
            burst: dict[bool, list[float]] = {True: [], False: []}
            for r in range(rounds):
                for durable in (False, True) if r % 2 == 0 else (True, False):
                    edge.settings.trajectory_durable_acks = durable
                    for _ in range(n):
                        t = time.perf_counter()
                        await edge.exec(sb.id, req)
                        seq[durable].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    await asyncio.gather(*(edge.exec(sb.id, req) for _ in range(concurrent)))
                    burst[durable].append(concurrent / (time.perf_counter() - t))
            await edge.stop(sb.id)
        finally:
            await edge.close()
            shutil.rmtree(settings.run_dir, ignore_errors=True)  # (its tmpfs is gone with the edge)
    print(f"| acknowledged | exec p50 ms | exec p95 ms | {concurrent} at once, execs/s (median) |")
    print("|---|---|---|---|")
    for durable in (False, True):
        label = "once committed (default)" if durable else "once queued"
        xs = seq[durable]
        rate = statistics.median(burst[durable])
        print(f"| {label} | {pct(xs, 0.5):.3f} | {pct(xs, 0.95):.3f} | {rate:.0f} |")
    ratio = pct(seq[True], 0.5) / pct(seq[False], 0.5)
    rates = statistics.median(burst[True]) / statistics.median(burst[False])
    print(f"\ncommitted/queued: sequential p50 {ratio:.2f}x, burst rate {rates:.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--concurrent", type=int, default=64)
    a = ap.parse_args()
    asyncio.run(main(a.rounds, a.n, a.concurrent))
