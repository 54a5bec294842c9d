"""Warm pools: ready sandboxes per image and resource shape, sized by recent demand.

RL steps ask for sandboxes in periodic bursts. Each pool tracks the largest
number of claims seen in any recent window (`window_s`) and keeps that many
ready (times `headroom`), bounded by [min_size, max_size]. A create whose
shape matches a pool is served by re-labelling a ready sandbox (sub-ms) and
the pool refills in the background. `prewarm(count)` raises the target at
once for an announced burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from dsec.aio import wait_for
from dsec.models import PoolInfo, PoolSpec, SandboxSpec
from dsec.models.pools import POOL_SHAPE

log = logging.getLogger("dsec.edge.pools")


def spec_key(spec: SandboxSpec) -> tuple[object, ...]:
    """The key of the pool whose sandboxes `spec` can take (PoolSpec.key of the same shape)."""
    return tuple(getattr(spec, f) for f in POOL_SHAPE)


@dataclass
class Pool:
    spec: PoolSpec
    ready: deque[str] = field(default_factory=deque)
    filling: int = 0
    claims: int = 0
    misses: int = 0
    boost: int = 0
    boost_until: float = 0.0
    last_take: float = 0.0
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (window start, claims in window)

    def record_demand(self, now: float, window_s: float) -> None:
        if not self.recent or now - self.recent[-1][0] >= window_s:
            self.recent.append((now, 0))
        start, n = self.recent[-1]
        self.recent[-1] = (start, n + 1)
        while self.recent and now - self.recent[0][0] > window_s * 10:
            self.recent.popleft()

    def target(self, now: float, headroom: float) -> int:
        peak = max((n for _, n in self.recent), default=0)
        t = max(self.spec.min_size, int(peak * headroom + 0.999))
        if now < self.boost_until:
            t = max(t, self.boost)
        return min(t, self.spec.max_size)


class WarmPools:
    def __init__(
        self,
        create: Callable[[SandboxSpec], Awaitable[str]],
        destroy: Callable[[str], Coroutine[Any, Any, None]],
        *,
        window_s: float = 30.0,
        headroom: float = 1.25,
        parallel: int = 2,
        quiet_s: float = 0.25,
    ) -> None:
        self.quiet_s = quiet_s
        self._create = create
        self._destroy = destroy
        self.window_s = window_s
        self.headroom = headroom
        self.pools: dict[tuple[object, ...], Pool] = {}
        self._sem = asyncio.Semaphore(parallel)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._refill_loop(), name="dsec-pools")

    async def close(self) -> list[str]:
        """Stop refilling (a create in flight is cancelled and cleans up after itself); the
        ready sandboxes, for the caller to stop."""
        self._closed = True  # the loop ends even where a cancellation got lost (see _refill_loop)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        ids = [sid for p in self.pools.values() for sid in p.ready]
        for p in self.pools.values():
            p.ready.clear()
        return ids

    def configure(self, spec: PoolSpec) -> PoolInfo:
        pool = self.pools.get(spec.key())
        if pool is None:
            pool = self.pools[spec.key()] = Pool(spec)
        else:
            pool.spec = spec
        self._wake.set()
        return self.info(pool)

    def prewarm(self, spec: PoolSpec, count: int, hold_s: float = 300.0) -> PoolInfo:
        pool = self.pools.get(spec.key()) or self.pools.setdefault(spec.key(), Pool(spec))
        pool.spec.max_size = max(pool.spec.max_size, count)
        pool.boost = count
        pool.boost_until = time.monotonic() + hold_s
        self._wake.set()
        return self.info(pool)

    def drop(self, image: str) -> list[str]:
        """Forget the pools of `image` (deleted): their ready sandboxes, for the caller to stop
        (one still being made is stopped when it is ready)."""
        ids: list[str] = []
        for key, pool in list(self.pools.items()):
            if pool.spec.image == image:
                del self.pools[key]
                ids += pool.ready
                pool.ready.clear()
        return ids

    def info(self, pool: Pool) -> PoolInfo:
        return PoolInfo(
            spec=pool.spec,
            ready=len(pool.ready),
            target=pool.target(time.monotonic(), self.headroom),
            claims=pool.claims,
            misses=pool.misses,
        )

    def list(self) -> list[PoolInfo]:
        return [self.info(p) for p in self.pools.values()]

    def take(self, spec: SandboxSpec) -> str | None:
        """A ready sandbox id for this shape, or None (a miss is recorded as demand)."""
        pool = self.pools.get(spec_key(spec))
        if pool is None:
            return None
        pool.last_take = time.monotonic()
        pool.record_demand(pool.last_take, self.window_s)
        self._wake.set()
        if pool.ready:
            pool.claims += 1
            return pool.ready.popleft()
        pool.misses += 1
        return None

    def forget(self, sandbox_id: str) -> None:
        for p in self.pools.values():
            with contextlib.suppress(ValueError):
                p.ready.remove(sandbox_id)

    def ready_count(self) -> int:
        return sum(len(p.ready) for p in self.pools.values())

    async def _refill_loop(self) -> None:
        pause = 1.0
        while True:
            # (dsec.aio's: asyncio's wait_for on Python 3.11 swallows a cancellation that comes
            # as the wait ends, a claim waking the loop just before the edge closes, and close()
            # waited for a loop that went on refilling)
            with contextlib.suppress(TimeoutError):
                await wait_for(self._wake.wait(), pause)
            if self._closed:
                return
            self._wake.clear()
            now = time.monotonic()
            pause = 1.0
            jobs = []
            for pool in self.pools.values():
                target = pool.target(now, self.headroom)
                # Refilling costs a runtime start (CPU) right when the caller starts
                # using what it claimed: wait for a quiet moment unless stock runs low.
                quiet_at = pool.last_take + self.quiet_s
                if now < quiet_at and len(pool.ready) >= max(1, target // 4):
                    pause = min(pause, quiet_at - now)
                    continue
                want = target - len(pool.ready) - pool.filling
                for _ in range(max(0, want)):
                    pool.filling += 1
                    jobs.append(asyncio.create_task(self._fill_one(pool)))
                # Shrink slowly: one surplus sandbox per tick.
                if len(pool.ready) > pool.target(now, self.headroom) and not pool.filling:
                    sid = pool.ready.pop()
                    jobs.append(asyncio.create_task(self._destroy(sid)))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)

    async def _fill_one(self, pool: Pool) -> None:
        try:
            async with self._sem:
                sid = await self._create(pool.spec.base_spec())
            if self.pools.get(pool.spec.key()) is not pool:  # dropped meanwhile
                await self._destroy(sid)
                return
            pool.ready.append(sid)
        except Exception as e:  # keep the pool alive; the next tick retries
            log.warning("pool refill for %s failed: %s", pool.spec.image, e)
            await asyncio.sleep(1.0)
        finally:
            pool.filling -= 1
