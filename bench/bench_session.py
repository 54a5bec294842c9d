"""Session run benchmarks, with the exec of `true` in the same sandbox as the baseline.
Run as root:

    .venv/bin/python bench/bench_session.py [--n 200]

A bash session run is an exec of the platform's shell plus its start and the carried-over
state; a Python session run is one round trip to a long-lived interpreter. Prints a
Markdown table. Ratios matter, not absolute times: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import pct, row  # type: ignore[import-not-found]

from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.models import ExecRequest, SandboxSpec, SessionCreate, SessionRun


async def timed_runs(edge: Edge, sid: str, ses: str, code: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = await edge.session_run(sid, ses, SessionRun(code=code))
        out.append(time.perf_counter() - t)
        if r.exit_code != 0:
            raise SystemExit(f"session run of {code!r} failed: {r}")
    return out


async def main(n: int) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    settings = EdgeSettings(name="bench", run_dir=run_dir, reconcile_interval_s=3600)
    edge = Edge(settings)
    await edge.start()
    lines = ["| operation | p50 ms | p95 ms | vs exec true |", "|---|---|---|---|"]
    try:
        sb = await edge.create(SandboxSpec())
        bash = (await edge.session_create(sb.id, SessionCreate(kind="bash"))).id
        bash2 = (await edge.session_create(sb.id, SessionCreate(kind="bash"))).id
        py = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
        for _ in range(10):  # warm caches
            await edge.exec(sb.id, ExecRequest(cmd=["true"]))
            await edge.session_run(sb.id, bash, SessionRun(code="true"))
        execs = []
        for _ in range(n):
            t = time.perf_counter()
            await edge.exec(sb.id, ExecRequest(cmd=["true"]))
            execs.append(time.perf_counter() - t)
        bash_true = await timed_runs(edge, sb.id, bash, "true", n)
        bash_state = await timed_runs(edge, sb.id, bash2, "cd /tmp; X=1", n)
        py_pass = await timed_runs(edge, sb.id, py, "pass", n)
        base = pct(execs, 0.5)
        lines.append(row("exec true (baseline)", execs, base))
        lines.append(row("**bash session: true**", bash_true, base))
        lines.append(row("**bash session: cd /tmp; X=1**", bash_state, base))
        lines.append(row("**python session: pass**", py_pass, base))
        await edge.stop(sb.id)
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    asyncio.run(main(a.n))
