"""What the agent's freeze costs a trusted exec, and what the freezer group costs an exec (v1
hosts: every exec's process joins the user's freezer group too). Each pair alternates in one
run, on one sandbox whose agent keeps `--agents` processes alive. Run as root:

    .venv/bin/python bench/bench_trusted.py [--n 40] [--agents 10]

Prints a Markdown table; ratios matter, not absolute times (shared, noisy machines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from unittest import mock

from _common import in_process_edge, pct, row  # type: ignore[import-not-found]

from dsec.edge.trusted import AgentFreeze
from dsec.isolation.cgroups import CgroupHost, ExecGroup
from dsec.models import ExecRequest, SandboxSpec


@contextlib.asynccontextmanager
async def no_freeze(self: AgentFreeze, sandbox_id: str, timeout: float = 0) -> AsyncIterator[None]:
    yield


def own_group_only(real: Callable[..., ExecGroup]) -> Callable[..., ExecGroup]:
    """open_exec_group as before the freezer group: the exec's own cgroup only."""

    def open_exec_group(self: CgroupHost, sandbox_id: str, name: str) -> ExecGroup:
        group = real(self, sandbox_id, name)
        for fd in group.join_fds:
            os.close(fd)
        group.join_fds = []
        return group

    return open_exec_group


async def timed(
    edge: Any, sid: str, req: ExecRequest, patch: contextlib.AbstractContextManager[Any]
) -> float:
    with patch:
        t = time.perf_counter()
        r = await edge.exec(sid, req)
        took = time.perf_counter() - t
    assert r.exit_code == 0, r
    return took


async def measure(edge: Any, n: int, agents: int) -> list[str]:
    sb = await edge.create(SandboxSpec(image="python"))
    await edge.exec(sb.id, ExecRequest(cmd=f"for i in $(seq {agents}); do setsid sleep 3600 & done"))
    trusted, plain = ExecRequest(cmd=["true"], trusted=True), ExecRequest(cmd=["true"])
    unfrozen = mock.patch.object(AgentFreeze, "hold", no_freeze)
    unjoined = mock.patch.object(CgroupHost, "open_exec_group", own_group_only(CgroupHost.open_exec_group))
    same = contextlib.nullcontext()
    for req in (trusted, plain):  # warm up: the helper's build, caches
        await edge.exec(sb.id, req)
    runs: dict[str, list[float]] = {k: [] for k in ("t0", "t1", "e0", "e1", "hold")}
    for _ in range(n):
        runs["t0"].append(await timed(edge, sb.id, trusted, unfrozen))
        runs["t1"].append(await timed(edge, sb.id, trusted, same))
        for _ in range(4):
            runs["e0"].append(await timed(edge, sb.id, plain, unjoined))
            runs["e1"].append(await timed(edge, sb.id, plain, same))
            t = time.perf_counter()
            async with AgentFreeze(edge.cgroups).hold(sb.id):
                pass
            runs["hold"].append(time.perf_counter() - t)
    await edge.stop(sb.id)
    t0, e0 = pct(runs["t0"], 0.5), pct(runs["e0"], 0.5)
    v = edge.cgroups.version
    return [
        "| operation | p50 ms | p95 ms | vs first row |",
        "|---|---|---|---|",
        row("trusted exec true, the agent not frozen", runs["t0"], t0),
        row(f"**trusted exec true, {agents} agent processes frozen and thawed**", runs["t1"], t0),
        row(f"the freeze and thaw alone ({agents} agent processes)", runs["hold"], t0),
        row("exec true, its own cgroup only", runs["e0"], e0),
        row(f"**exec true, and the user's freezer group (cgroup v{v})**", runs["e1"], e0),
    ]


async def main(n: int, agents: int) -> None:
    async with in_process_edge("benchtrusted") as edge:
        print("\n".join(await measure(edge, n, agents)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--agents", type=int, default=10)
    asyncio.run(main(**vars(ap.parse_args())))
