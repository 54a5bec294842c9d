"""State benchmarks at the edge interface: fork x8 of a sandbox with 60 MB written,
pause / resume, snapshot, memory checkpoint / restore of a process holding 50 MiB, and
the trajectory log (throughput, overhead on exec). Baselines from the same run: 8 fresh
sandboxes without a fork (the floor of starting 8), `cp -a` of the same files on the
host, a fresh sandbox starting the same process from scratch (what a restore replaces),
exec without the log. Run as root:

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
            await edge.delete_snapshot(s.id)
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
        lines += await checkpoints(edge, rounds)
        lines += await trajectory(edge, run_dir, rounds)
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    print("\n".join(lines))
    ratio = pct(fork, 0.5) / pct(fresh, 0.5)
    print(f"\nfork x8 p50 {pct(fork, 0.5):.0f} ms = {ratio:.2f}x of starting 8 fresh ones")


HOLD = (
    "import os, time\nblob = bytearray(os.urandom(1 << 20)) * 50\nopen('/tmp/ready', 'w').close()\n"
    "while True:\n    time.sleep(0.05)\n"
)


async def start_holder(edge: Edge, sid: str) -> None:
    await edge.write_file(sid, "/tmp/hold.py", HOLD.encode())
    await edge.exec(sid, ExecRequest(cmd="nohup python3 /tmp/hold.py > /dev/null 2>&1 &"))
    while (await edge.exec(sid, ExecRequest(cmd="test -e /tmp/ready"))).exit_code != 0:
        await asyncio.sleep(0.005)


async def checkpoints(edge: Edge, rounds: int) -> list[str]:
    """Checkpoint / restore of a process holding 50 MiB, against starting it afresh."""
    from dsec.errors import UnsupportedOperation

    spec = SandboxSpec(memory_mb=512)
    dump, restore_new, in_place, fresh = [], [], [], []
    try:
        for _ in range(rounds):
            sb = await edge.create(spec)
            await start_holder(edge, sb.id)
            t = time.perf_counter()
            ck = await edge.checkpoint(sb.id, leave_running=True)
            dump.append(time.perf_counter() - t)
            t = time.perf_counter()
            new = await edge.restore(ck.id)
            restore_new.append(time.perf_counter() - t)
            t = time.perf_counter()
            await edge.restore(ck.id, sandbox_id=sb.id)
            in_place.append(time.perf_counter() - t)
            t = time.perf_counter()
            other = await edge.create(spec)
            await start_holder(edge, other.id)
            fresh.append(time.perf_counter() - t)
            await asyncio.gather(*(edge.stop(x) for x in (sb.id, new.id, other.id)))
            edge.delete_checkpoint(ck.id)
    except UnsupportedOperation as e:
        return ["", f"Memory checkpoints not measured: {e.message}"]
    return [
        row("**checkpoint of a process holding 50 MiB** (CRIU dump + files, it runs on)", dump),
        row("**restore into a new sandbox** (create included)", restore_new),
        row("restore in place (its processes replaced)", in_place),
        row("baseline: new sandbox + start the same process afresh", fresh),
    ]


async def trajectory(edge: Edge, run_dir: Path, rounds: int) -> list[str]:
    """Exec latency with and without the log; records persisted per second."""
    from dsec.trajlog import TrajectoryLog

    sb = await edge.create(SandboxSpec())
    box = edge.sandboxes[sb.id]
    req = ExecRequest(cmd=["true"])
    logged, bare = [], []
    for _ in range(rounds * 100):  # interleaved, so drift hits both alike
        t = time.perf_counter()
        await edge.exec(sb.id, req)
        logged.append(time.perf_counter() - t)
        t = time.perf_counter()
        await edge._run(box, req)  # the same path minus the log
        bare.append(time.perf_counter() - t)
    await edge.stop(sb.id)
    log = TrajectoryLog(run_dir / "bench-trajlog.db")
    await log.start()
    n = 50_000
    t = time.perf_counter()
    for i in range(n):
        await log.record(f"s{i % 64}", "exec", {"cmd": "true"}, {"exit_code": 0, "stdout": ""}, {"ms": 1.0})
    await log.flush()
    took = time.perf_counter() - t
    await log.close()
    over = pct(logged, 0.5) / pct(bare, 0.5) - 1
    return [
        row("exec `true` at the edge, logged", logged),
        row("baseline: the same exec without the log", bare),
        "",
        f"Trajectory log: {n / took:,.0f} operations/s persisted (one producer, 64 sandboxes, "
        f"flushed); overhead on exec p50 {over * 100:+.1f}%.",
    ]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(ap.parse_args().rounds))
