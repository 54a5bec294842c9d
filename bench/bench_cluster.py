"""A cluster on this machine against one node, in the same run (issue #14). As root:

    .venv/bin/python bench/bench_cluster.py [--n 100] [--burst 1000] [--apiservers 2] [--edges 3]

Starts `dsec cluster up` (PostgreSQL, apiservers, edges each in a network namespace) and a
single-node `dsec up`, and measures on each: create -> exec -> stop p50/p95 (one client,
sequential), and on the cluster a burst of `--burst` concurrent creates spread over the
apiservers (the SDK given every URL), reporting the rate and how the sandboxes spread over
the edges. Prints Markdown for docs/benchmarks.md: read the ratios (shared, noisy machines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import pct, row, running_service  # type: ignore[import-not-found]

from dsec.client import AsyncClient, Client


def cycle(url: str | list[str], token: str, n: int) -> list[float]:
    out = []
    with Client(url, token) as c:
        c.create("python", memory_mb=64).stop()  # warm
        for _ in range(n):
            t = time.perf_counter()
            sb = c.create("python", memory_mb=64)
            sb.exec(["/bin/true"])
            sb.stop()
            out.append(time.perf_counter() - t)
    return out


async def burst(urls: list[str], token: str, n: int, concurrency: int = 64) -> tuple[float, list[str], int]:
    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(urls, token, timeout=300) as c:

        async def one() -> str | None:
            async with sem:
                try:
                    return (await c.create("python", memory_mb=32)).id
                except Exception:
                    return None

        t = time.perf_counter()
        ids = await asyncio.gather(*(one() for _ in range(n)))
        took = time.perf_counter() - t
        made = [i for i in ids if i]
        for start in range(0, len(made), 512):
            await c.stop_many(made[start : start + 512])
    return took, made, n - len(made)


def main(n: int, burst_n: int, apiservers: int, edges: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="dsec-bench-cluster-", dir="/tmp"))
    os.chmod(root, 0o755)
    d = root / "cluster"
    env = {**os.environ, "DSEC_EDGE_FNCALL_IMAGE": "", "DSEC_EDGE_MAX_SANDBOXES": str(max(400, burst_n))}
    up = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "cluster", "up", "--apiservers", str(apiservers),
         "--edges", str(edges), "--dir", str(d), "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    state = json.loads(up.stdout)
    urls = [a["url"] for a in state["apiservers"]]
    try:
        with running_service("benchone") as (one_url, one_token):
            single = cycle(one_url, one_token, n)
        clustered = cycle(urls, state["token"], n)
        took, made, failed = asyncio.run(burst(urls, state["token"], burst_n))
    finally:
        subprocess.run(
            [sys.executable, "-m", "dsec.cli", "cluster", "down", "--dir", str(d), "--purge"], check=False
        )
        shutil.rmtree(root, ignore_errors=True)
    spread = Counter(i.split("-")[0] for i in made)
    print("| operation | p50 ms | p95 ms | vs one node |")
    print("|---|---|---|---|")
    print(row("one node (`dsec up`): create -> exec -> stop", single, pct(single, 0.5)))
    print(
        row(
            f"cluster ({apiservers} apiservers, {edges} edges): create -> exec -> stop",
            clustered,
            pct(single, 0.5),
        )
    )
    print()
    print(
        f"- burst of {burst_n} concurrent creates over {apiservers} apiservers: {len(made)} made, "
        f"{failed} failed, "
        f"{took:.1f} s ({len(made) / took:.0f} creates/s); per edge: {dict(sorted(spread.items()))}"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--apiservers", type=int, default=2)
    ap.add_argument("--edges", type=int, default=3)
    a = ap.parse_args()
    main(a.n, a.burst, a.apiservers, a.edges)
