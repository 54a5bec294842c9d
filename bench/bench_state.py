"""State benchmarks at the edge interface: fork x8 of a sandbox with 60 MB written,
pause / resume, snapshot. Baselines from the same run: 8 fresh sandboxes without a
fork (the floor of starting 8), and `cp -a` of the same files on the host. Run as root:

    .venv/bin/python bench/bench_state.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import pct, row

from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.models import ExecRequest, SandboxSpec

FILL = (
    "mkdir -p /work/data && head -c 60000000 /dev/urandom > /work/data/blob && "
    "for i in $(seq 3000); do echo $i > /work/data/f$i; done"
)


async def main(rounds: int) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    edge = Edge(EdgeSettings(name="stb", run_dir=run_dir, reconcile_interval_s=3600, fncall_image=""))
    await edge.start()
    lines = ["| operation | p50 ms | p95 ms |", "|---|---|---|"]
    try:
        fork, fresh, copy_only, resume, pause, snap = [], [], [], [], [], []
        for _ in range(rounds):
            sb = await edge.create(SandboxSpec())
            await edge.exec(sb.id, ExecRequest(cmd=FILL, timeout=120))
            t = time.perf_counter()
            kids = await edge.fork(sb.id, 8)
            fork.append(time.perf_counter() - t)
            copy_only.append(kids[0].timings_ms["fork_copy"] / 1000)
            t = time.perf_counter()
            plain = await asyncio.gather(*(edge.create(SandboxSpec()) for _ in range(8)))
            fresh.append(time.perf_counter() - t)
            for _ in range(4):
                t = time.perf_counter()
                await edge.pause(sb.id)
                pause.append(time.perf_counter() - t)
                t = time.perf_counter()
                await edge.resume(sb.id)
                resume.append(time.perf_counter() - t)
            t = time.perf_counter()
            s = await edge.snapshot(sb.id, ["/work/data/f1"])
            snap.append(time.perf_counter() - t)
            await asyncio.gather(*(edge.stop(x.id) for x in [*kids, *plain, sb]))
            edge.delete_snapshot(s.id)
        host = Path(tempfile.mkdtemp(prefix="dsec-bench-cp-", dir="/dev/shm"))
        subprocess.run(["sh", "-c", FILL.replace("/work", str(host))], check=True)
        cp = []
        for i in range(rounds):
            t = time.perf_counter()
            subprocess.run(["cp", "-a", f"{host}/data", f"{host}/copy{i}"], check=True)
            cp.append(time.perf_counter() - t)
        shutil.rmtree(host)
        lines += [
            row("**fork x8 of a sandbox with 60 MB + 3,000 files written**", fork),
            row("  of which: frozen copy of the writable layer", copy_only),
            row("baseline: 8 fresh sandboxes, no fork (concurrent)", fresh),
            row("baseline: cp -a of the same files, tmpfs to tmpfs, host", cp),
            row("**pause** (freeze + reclaim)", pause),
            row("**resume**", resume),
            row("snapshot to the layer store (ext4), one path scrubbed", snap),
        ]
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    print("\n".join(lines))
    ratio = pct(fork, 0.5) / pct(fresh, 0.5)
    print(f"\nfork x8 p50 {pct(fork, 0.5):.0f} ms = {ratio:.2f}x of starting 8 fresh ones")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(ap.parse_args().rounds))
