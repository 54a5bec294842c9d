"""Warm pools and idle-TTL reaping on a real edge."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec.models import ExecRequest, PoolSpec, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def wait_for(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.05)


async def test_pool_serves_matching_creates_and_refills(edge):
    await edge.configure_pool(PoolSpec(image="python", memory_mb=256, min_size=2, max_size=4))
    pool = next(iter(edge.pools.pools.values()))
    await wait_for(lambda: len(pool.ready) == 2)
    ready = set(pool.ready)
    sb = await edge.create(SandboxSpec(image="python", memory_mb=256, env={"A": "1"}, labels={"k": "v"}))
    assert sb.id in ready and "pool" in sb.timings_ms
    r = await edge.exec(sb.id, ExecRequest(cmd="echo $A"))
    assert r.stdout == "1\n"
    assert [i.id for i in edge.list(labels={"k": "v"})] == [sb.id]
    # a different shape is not served from the pool
    other = await edge.create(SandboxSpec(image="python", memory_mb=512))
    assert other.id not in ready
    await wait_for(lambda: len(pool.ready) >= 2)  # refilled in the background
    # pooled sandboxes are invisible to users until claimed
    assert {i.id for i in edge.list()} == {sb.id, other.id}
    # an announced burst raises the target
    await edge.prewarm(PoolSpec(image="python", memory_mb=256), 4)
    await wait_for(lambda: len(pool.ready) == 4)


async def test_idle_ttl_stops_sandboxes(edge):
    keep = await edge.create(SandboxSpec(image="python"))
    short = await edge.create(SandboxSpec(image="python", ttl_idle_s=0.5))
    await edge.exec(short.id, ExecRequest(cmd="true"))
    await wait_for(lambda: short.id not in edge.sandboxes, timeout=10)
    assert keep.id in edge.sandboxes
