"""SandboxInfo.usage: a sandbox's memory and CPU use, read from its cgroup by the edge."""

from __future__ import annotations

import pytest

from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

# ~96 MiB touched and a fixed amount of work; it prints the CPU time it took itself (a
# busy host stretches the wall time, not this)
WORKLOAD = "python3 -c 'import time; d = b\"x\" * (96 << 20); sum(range(10**7)); print(time.process_time())'"


async def test_usage_reports_memory_peak_and_cpu_time(edge):
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512))
    try:
        before = edge.get(sb.id).usage
        assert before["memory_bytes"] > 0 and before["cpu_usec"] >= 0
        r = await edge.exec(sb.id, ExecRequest(cmd=WORKLOAD, timeout=60))
        assert r.exit_code == 0, r.stderr
        took_usec = float(r.stdout) * 1e6
        after = edge.get(sb.id).usage
        assert after["memory_peak_bytes"] >= 96 << 20  # the bytes object, freed by now
        assert after["memory_peak_bytes"] <= 512 << 20  # the sandbox's limit
        assert after["memory_bytes"] < after["memory_peak_bytes"]
        assert after["cpu_usec"] - before["cpu_usec"] >= took_usec > 0  # the cgroup counts it all
        # a fresh read on each GET: another run raises the CPU time again
        r = await edge.exec(sb.id, ExecRequest(cmd=WORKLOAD, timeout=60))
        assert edge.get(sb.id).usage["cpu_usec"] - after["cpu_usec"] >= float(r.stdout) * 1e6
    finally:
        await edge.stop(sb.id)
