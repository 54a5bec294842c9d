"""The watcher's view of the edges, and placement over it.

The watcher polls each edge's status (health, capacity, live sandboxes per
image and project, cached layers, images, pool stock). Placement filters
(healthy, knows the image) and prefers edges holding ready pool sandboxes or
the image's layers, then picks the least loaded of k random candidates. Each
apiserver overlays its own recent placements not yet seen by the watcher, so a
burst is spread before the next poll. Nothing here is durable: after a restart
the view is rebuilt by polling (edges also re-register every few seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from dsec import errors
from dsec.edgeapi import EdgeAPI, edge_of
from dsec.models import EdgeStatus, SandboxSpec

log = logging.getLogger("dsec.apiserver.placement")


@dataclass
class EdgeView:
    api: EdgeAPI
    status: EdgeStatus | None = None
    last_ok: float = 0.0
    failures: int = 0
    recent: list[float] = field(default_factory=list)  # our placements since the last poll

    @property
    def healthy(self) -> bool:
        return self.status is not None and self.status.healthy and self.failures < 3

    def load(self, spec: SandboxSpec) -> float:
        s = self.status
        if s is None:
            return float("inf")
        extra = len(self.recent)
        by_count = (s.used.get("sandboxes", 0) + extra) / max(s.capacity.get("sandboxes", 1), 1)
        by_cpu = (s.used.get("cpu", 0) + extra * spec.cpu) / max(s.capacity.get("cpu", 1), 1e-9)
        mem_cap = max(s.capacity.get("memory_mb", 1), 1)
        by_mem = (s.used.get("memory_mb", 0) + extra * spec.memory_mb) / mem_cap
        return max(by_count, by_cpu, by_mem)


class EdgeDirectory:
    def __init__(self, *, poll_interval_s: float = 1.0, k: int = 2) -> None:
        self.views: dict[str, EdgeView] = {}
        self.poll_interval_s = poll_interval_s
        self.k = k
        self._task: asyncio.Task[None] | None = None

    def add(self, api: EdgeAPI) -> EdgeView:
        view = self.views.get(api.name)
        if view is not None and view.api.url == api.url:
            return view
        self.views[api.name] = view = EdgeView(api)
        return view

    def edge_for(self, sandbox_id: str) -> EdgeAPI:
        name = edge_of(sandbox_id)
        view = self.views.get(name)
        if view is None:
            raise errors.SandboxNotFound(
                f"sandbox {sandbox_id} belongs to edge {name!r}, which is not registered"
            )
        return view.api

    def all(self) -> Iterable[EdgeAPI]:
        return [v.api for v in self.views.values()]

    async def poll_once(self) -> None:
        async def one(view: EdgeView) -> None:
            try:
                view.status = await asyncio.wait_for(view.api.status(), 5.0)
                view.last_ok = time.monotonic()
                view.failures = 0
                view.recent.clear()
            except Exception as e:  # an unreachable edge is just unhealthy
                view.failures += 1
                log.debug("edge %s status failed: %s", view.api.name, e)

        await asyncio.gather(*(one(v) for v in list(self.views.values())))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dsec-watcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for v in self.views.values():
            await v.api.aclose()

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval_s)

    def candidates(self, spec: SandboxSpec) -> list[EdgeView]:
        """Edges to try, best first: filter, prefer warm ones, then power of k choices."""
        healthy = [v for v in self.views.values() if v.healthy]
        if not healthy:
            raise errors.Unavailable(
                "no healthy edge is registered; start `dsec edge` or wait for it to register"
            )
        able = [v for v in healthy if v.status is not None and spec.image in v.status.images]
        if not able:
            raise errors.ImageNotFound(
                f"no edge has image {spec.image!r}; build or import it first (dsec image build / import)"
            )
        tier = [v for v in able if v.status is not None and spec.backend in v.status.backends]
        if not tier:
            known = sorted({b for v in healthy if v.status for b in v.status.backends})
            raise errors.InvalidRequest(
                f"no edge with image {spec.image!r} runs backend {spec.backend!r}; "
                f"backends available: {', '.join(known) or 'none'}",
                reason="unknown_backend",
                available=known,
            )
        able = tier
        ordered: list[EdgeView] = []
        remaining = list(able)
        while remaining:
            sample = random.sample(remaining, min(self.k, len(remaining)))
            best = min(sample, key=lambda v: v.load(spec))
            ordered.append(best)
            remaining.remove(best)
        return ordered

    def note_placed(self, view: EdgeView) -> None:
        view.recent.append(time.monotonic())
