"""What a verify costs on each tier, in one run: the container backend (dsec-trusted beside
the agent: the baseline) against gVisor and the microVM, where the grader runs in a fresh
sandbox of the same backend with the task's files copied in (dsec.edge.gradersandbox). One
graded sandbox per backend (a protected grader, a /work of `--files` small files); the
backends take turns, so the host's load falls on all of them alike. Run as root:

    .venv/bin/python bench/bench_verify_tiers.py [--n 10] [--files 200] [--backends ...]

Prints a Markdown table; ratios matter, not absolute times (shared, noisy machines).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from _common import in_process_edge, pct, row  # type: ignore[import-not-found]

from dsec.models import ExecRequest, SandboxSpec

GRADER = b"import os, sys\nn = len(os.listdir('/work/src'))\nprint(n)\nsys.exit(0 if n else 1)\n"


async def graded(edge: Any, backend: str, files: int) -> str:
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=256))
    await edge.write_file(sb.id, "/grader/check.py", GRADER)
    assert await edge.protect(sb.id, ["/grader"]) == ["/grader"]
    make = f"mkdir -p /work/src && cd /work/src && for i in $(seq {files}); do echo 'x = $i' > m$i.py; done"
    r = await edge.exec(sb.id, ExecRequest(cmd=make, timeout=300))
    assert r.exit_code == 0, r
    return sb.id


async def main(n: int, files: int, backends: list[str]) -> None:
    async with in_process_edge("benchverify") as edge:
        sids = {b: await graded(edge, b, files) for b in backends}
        verify = ExecRequest(cmd="python3 /grader/check.py", timeout=300)
        trusted = ExecRequest(cmd=["true"], trusted=True, timeout=300)
        for sid in sids.values():  # warm up: helpers built, templates made, caches
            assert (await edge.verify(sid, verify)).exit_code == 0
            await edge.exec(sid, trusted)
        runs: dict[str, list[float]] = {f"{k} {b}": [] for b in backends for k in ("verify", "trusted")}
        for _ in range(n):
            for b, sid in sids.items():
                t = time.perf_counter()
                r = await edge.verify(sid, verify)
                runs[f"verify {b}"].append(time.perf_counter() - t)
                assert (r.exit_code, r.stdout) == (0, f"{files}\n"), r
                t = time.perf_counter()
                await edge.exec(sid, trusted)
                runs[f"trusted {b}"].append(time.perf_counter() - t)
        for sid in sids.values():
            await edge.stop(sid)
    base = backends[0]
    print(f"{n} rounds, /work of {files} files, one graded sandbox per backend")
    print("| operation | p50 ms | p95 ms | vs the first backend |")
    print("|---|---|---|---|")
    for kind in ("verify", "trusted"):
        b0 = pct(runs[f"{kind} {base}"], 0.5)
        label = "verify (python3 grader)" if kind == "verify" else "trusted exec true"
        for b in backends:
            print(row(f"{label}, {b}", runs[f"{kind} {b}"], b0))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--backends", nargs="+", default=["container", "gvisor", "microvm"])
    asyncio.run(main(**vars(ap.parse_args())))
