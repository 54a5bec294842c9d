"""Service benchmarks through the SDK and HTTP against a real `dsec up`, with baselines
measured in the same run. Run as root:

    .venv/bin/python bench/bench_service.py [--n 50]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx
from _common import pct, podman_run_true, row, running_service  # type: ignore[import-not-found]

from dsec.client import AsyncClient, Client


def main(n: int) -> None:
    with running_service("svb") as (url, token):
        out = ["| operation (SDK + HTTP) | p50 ms | p95 ms |", "|---|---|---|"]
        with Client(url, token) as c:
            c.create().stop()
            cold = []
            for _ in range(n):
                t = time.perf_counter()
                sb = c.create()
                sb.exec(["true"])
                sb.stop()
                cold.append(time.perf_counter() - t)
            out.append(row("create -> exec true -> stop, cold", cold))
            sb = c.create()
            rtt = []
            for _ in range(n * 4):
                t = time.perf_counter()
                sb.exec(["true"])
                rtt.append(time.perf_counter() - t)
            sb.stop()
            out.append(row("exec true round trip", rtt))

        async def burst(total: int, chunk: int) -> tuple[float, list[str]]:
            async with AsyncClient(url, token) as ac:
                t = time.perf_counter()
                ids: list[str] = []
                for _ in range(total // chunk):
                    ids += [
                        s.id for s in await ac.create_many(chunk, "python", memory_mb=128, concurrency=16)
                    ]
                return time.perf_counter() - t, ids

        took, ids = asyncio.run(burst(1000, 200))
        out.append("")
        out.append(
            f"Sustained creation: 1,000 sandboxes (bursts of 200, all kept live) in {took:.2f} s "
            f"= {1000 / took:.0f} sandboxes/s through the batch API."
        )
        with Client(url, token) as c:
            c.stop_many(ids)
            time.sleep(2)  # background teardown
            # Announce the burst (as a trainer would before an RL step), then let the pool fill.
            c.prewarm(n, "python")
            deadline = time.monotonic() + 60
            while (
                sum(
                    p.get("ready", 0)
                    for p in httpx.get(
                        url + "/v1/pools", headers={"Authorization": f"Bearer {token}"}
                    ).json()["pools"]
                )
                < n
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            warm = []
            for _ in range(n):
                t = time.perf_counter()
                sb = c.create()
                sb.exec(["true"])
                sb.stop()
                warm.append(time.perf_counter() - t)
                time.sleep(0.05)  # requests arrive spaced, as tool calls of many rollouts do
            out.append(row("create -> exec true -> stop, warm pool", warm))
        rootfs = next(Path("/var/lib/dsec/layers/layers/python").iterdir()) / "tree"
        podman = podman_run_true(Path(rootfs), max(5, n // 5))
        out.append(row("baseline: podman run --rm (runc) true, same rootfs", podman))
        out.append(
            f"\ndsec cold create+exec+stop is {pct(podman, 0.5) / pct(cold, 0.5):.1f}x faster than podman "
            f"(p50); warm pool {pct(podman, 0.5) / pct(warm, 0.5):.1f}x."
        )
        print("\n".join(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    main(ap.parse_args().n)
