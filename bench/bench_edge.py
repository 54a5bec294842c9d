"""Edge benchmarks, with baselines measured in the same run. Run as root:

    .venv/bin/python bench/bench_edge.py [--n 50] [--idle 200]

Prints a Markdown table for docs/benchmarks.md. Ratios matter, not absolute
times: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import pct, podman_run_true, row, timed_cmd  # type: ignore[import-not-found]

from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.models import ExecRequest, SandboxSpec, SessionCreate, SessionRun


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


async def main(n: int, idle: int) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    settings = EdgeSettings(name="bench", run_dir=run_dir, reconcile_interval_s=3600)
    edge = Edge(settings)
    await edge.start()
    rootfs = edge.layers.lowerdirs(edge.layers.get_image("python"))[-1]
    lines = ["| operation | p50 ms | p95 ms | vs floor |", "|---|---|---|---|"]
    try:
        # --- create -> ready -> stop ---
        await edge.stop((await edge.create(SandboxSpec())).id)  # warm caches
        cycle = []
        for _ in range(n):
            t = time.perf_counter()
            sb = await edge.create(SandboxSpec())
            await edge.stop(sb.id)
            cycle.append(time.perf_counter() - t)
        floor_unshare = timed_cmd(["unshare", "-fpmniu", "--mount-proc", "true"], n)
        bwrap = timed_cmd(
            [
                "bwrap",
                "--ro-bind",
                str(rootfs),
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--unshare-all",
                "--die-with-parent",
                "/bin/true",
            ],
            n,
        )
        podman = podman_run_true(rootfs, max(5, n // 5))
        base = pct(floor_unshare, 0.5)
        lines.append(row("unshare pid/mnt/net/ipc/uts + /proc, run true (floor)", floor_unshare, base))
        lines.append(row("bwrap on the python rootfs, run true", bwrap, base))
        if podman:
            lines.append(row("podman run --rm (runc) of the same rootfs", podman, base))
        lines.append(row("**dsec edge: create -> ready -> stop**", cycle, base))
        if podman:
            lines.append(f"| dsec vs podman (p50) | | | {pct(podman, 0.5) / pct(cycle, 0.5):.1f}x faster |")

        # --- exec true ---
        sb = await edge.create(SandboxSpec())
        execs = []
        for _ in range(n * 4):
            t = time.perf_counter()
            await edge.exec(sb.id, ExecRequest(cmd=["true"]))
            execs.append(time.perf_counter() - t)
        host = timed_cmd(["/bin/true"], n * 4)
        crun_exec = timed_cmd(
            ["crun", "--root", str(run_dir / "bench" / "runtime"), "exec", sb.id, "true"], n
        )
        await edge.stop(sb.id)
        base = pct(host, 0.5)
        lines.append(row("fork+exec /bin/true on the host (floor)", host, base))
        lines.append(row("crun exec true", crun_exec, base))
        lines.append(row("**dsec edge: exec true**", execs, base))

        # --- idle density: sandboxes holding a Python session ---
        before = mem_available()
        ids = []
        for _ in range(idle):
            s = await edge.create(SandboxSpec(memory_mb=256))
            ses = await edge.session_create(s.id, SessionCreate(kind="python"))
            await edge.session_run(s.id, ses.id, SessionRun(code="x = 1"))
            ids.append(s.id)
        await asyncio.sleep(1)
        per = (before - mem_available()) / idle
        lines.append("")
        lines.append(
            f"Idle sandboxes holding a Python session: {per / 2**20:.2f} MiB each "
            f"(host MemAvailable delta over {idle}); "
            f"{int(24 * 2**30 / per)} would fit in 24 GiB."
        )
        await asyncio.gather(*(edge.stop(i) for i in ids))
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--idle", type=int, default=200)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    asyncio.run(main(a.n, a.idle))
