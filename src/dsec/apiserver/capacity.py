"""Elastic capacity: announced bursts, draining, idle release (issue #14 item 7).

A job announces a burst (`POST /v1/capacity`: N sandboxes of a shape, for a project, at a
time). At `when - capacity_lead_s` (at once if that has passed) dsec pre-warms pools of that
shape on the healthy edges that take placements, each given a share proportional to its free
room (sandbox slots, CPU and memory, less the pool sandboxes it holds or was promised); when
they are short, it asks the node provider for enough edges of the size it knows, waits for
them to register, and pre-warms the rest there. What was done is kept on the burst
(`GET /v1/capacity`).

Draining: a draining edge takes no new placements (`EdgeView.draining`, filtered by
`EdgeDirectory.candidates`); its sandboxes keep working. An admin drains one for maintenance
(`POST /v1/edges/{name}/drain`, `undrain`). With a node provider and `idle_drain_after_s`, an
edge the provider holds with no sandbox (pool sandboxes included: stock someone asked for) for
that long is drained, newest edges first (none while a burst is being provisioned), and
released through the provider once a later status poll still finds it empty (a placement that
raced the drain makes it busy again: it is undrained instead); never below `min_edges` taking
placements. The edges a burst pre-warmed on are kept `capacity_hold_s` past its time (or past
the pre-warm, if later).

What this process knows is its own: bursts and drains live in this apiserver's memory (with
several apiservers, announce and drain through the same one). The edges' own state (pools,
sandboxes) is what the watcher reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dsec import errors
from dsec.apiserver.placement import EdgeDirectory, EdgeView
from dsec.apiserver.tenancy import ApiServerSettings
from dsec.cluster.provider import NodeProvider
from dsec.iam import IAM, Principal
from dsec.models import Burst, CapacityRequest, PoolSpec, SandboxSpec
from dsec.models.capacity import MAX_LEAD_S
from dsec.models.pools import POOL_SHAPE

log = logging.getLogger("dsec.apiserver.capacity")

POOL_HOLD_S = 300.0  # how long an edge keeps a prewarm's boost (dsec.edge.pools.prewarm)
KEEP_BURSTS = 1000  # finished bursts kept for GET
RELEASED_MEMORY_S = 3600.0  # an edge released this recently is kept drained if it registers again


@dataclass
class Drain:
    reason: str  # "admin" (maintenance), "idle" (to be released), "released"
    since: float  # monotonic


def split(count: int, free: dict[str, int]) -> dict[str, int]:
    """`count` over edges in proportion to their free room (largest remainders), none above its
    room; all the room when it is not enough."""
    total = sum(max(v, 0) for v in free.values())
    if total <= count:
        return {k: v for k, v in free.items() if v > 0}
    exact = {k: count * max(v, 0) / total for k, v in free.items()}
    out = {k: math.floor(x) for k, x in exact.items()}
    rest = count - sum(out.values())
    for k in sorted(free, key=lambda k: (exact[k] - out[k], free[k], k), reverse=True)[:rest]:
        out[k] += 1
    return {k: v for k, v in out.items() if v > 0}


def edge_slots(view: EdgeView, spec: SandboxSpec, held: int = 0) -> int:
    """How many more sandboxes of `spec` the edge has room for, given `held` pool sandboxes
    (ready or promised) that take room once claimed."""
    s = view.status
    if s is None:
        return 0
    cap, used = s.capacity, s.used
    pooled = int(used.get("pooled", 0))
    held = max(held, pooled)
    by_count = cap.get("sandboxes", 0) - (used.get("sandboxes", 0) - pooled) - held
    by_cpu = (cap.get("cpu", 0) - used.get("cpu", 0)) / spec.cpu - held
    by_mem = (cap.get("memory_mb", 0) - used.get("memory_mb", 0)) / spec.memory_mb - held
    return max(0, math.floor(min(by_count, by_cpu, by_mem)))


def empty_edge_slots(views: Iterable[EdgeView], spec: SandboxSpec) -> int:
    """How many sandboxes of `spec` an empty edge of the largest known size holds (0: none known)."""
    best = 0
    for v in views:
        if v.status is None:
            continue
        cap = v.status.capacity
        n = min(
            cap.get("sandboxes", 0), cap.get("cpu", 0) / spec.cpu, cap.get("memory_mb", 0) / spec.memory_mb
        )
        best = max(best, math.floor(n))
    return best


class Capacity:
    def __init__(
        self,
        directory: EdgeDirectory,
        iam: IAM,
        settings: ApiServerSettings,
        provider: NodeProvider | None,
        publish: Callable[..., Any] = lambda kind, **data: None,
    ) -> None:
        self.directory = directory
        self.iam = iam
        self.publish = publish
        self.settings = settings
        self.provider = provider
        self.bursts: dict[str, Burst] = {}
        self.drains: dict[str, Drain] = {}
        self.idle_since: dict[str, float] = {}
        self.protected: dict[str, float] = {}  # edge -> wall time until which a burst needs it
        self.promised: dict[tuple[str, tuple[object, ...]], list[tuple[float, int]]] = {}
        self.released: dict[str, float] = {}  # edge -> monotonic time it was released
        self._releasing: set[str] = set()
        self._managed: tuple[float, set[str]] = (0.0, set())
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None

    # --- drain ----------------------------------------------------------------------------

    def _view(self, name: str) -> EdgeView:
        view = self.directory.views.get(name)
        if view is None:
            raise errors.NotFound(
                f"no edge named {name!r} is registered (GET /v1/edges lists them)", edge=name
            )
        return view

    def drain(self, name: str, reason: str = "admin") -> EdgeView:
        view = self._view(name)
        mark = self.drains.get(name)
        if mark is None or reason == "admin":  # an admin's drain is never released by idleness
            self.drains[name] = Drain(reason, time.monotonic())
        if reason == "admin":
            self.iam.set_drained(name, True)  # every apiserver takes it up at its next tick
        view.draining = True
        self.publish("edge_draining", edge=name, reason=reason)
        log.warning("edge %s drains (%s): no new placements", name, reason)
        return view

    def undrain(self, name: str) -> EdgeView:
        view = self._view(name)
        self.iam.set_drained(name, False)
        self.drains.pop(name, None)
        self.released.pop(name, None)
        view.draining = False
        self.publish("edge_undrained", edge=name)
        log.warning("edge %s takes placements again", name)
        return view

    # --- bursts ---------------------------------------------------------------------------

    def announce(self, req: CapacityRequest, p: Principal) -> Burst:
        """Validate and schedule a burst (authorization: see the route)."""
        iam, s = self.iam, self.settings
        iam.get_project(req.project)  # not_found for an unknown project
        if req.count > s.capacity_max_count:
            raise errors.InvalidRequest(
                f"count {req.count} is above this cluster's bound of {s.capacity_max_count} a burst",
                reason="count_too_large",
                max=s.capacity_max_count,
            )
        quota = iam.effective_quota(req.project).max_sandboxes
        if quota is not None and req.count > quota:
            raise errors.InvalidRequest(
                f"count {req.count} is above project {req.project!r}'s quota of {quota} sandboxes: "
                "the burst could never be used",
                reason="count_exceeds_quota",
                quota=quota,
            )
        iam.check_backend(req.project, req.backend)
        now = time.time()
        when = req.when.timestamp() if isinstance(req.when, datetime) else now + req.when
        if when < now - 60:
            raise errors.InvalidRequest(
                f"when ({datetime.fromtimestamp(when).isoformat()}) has passed", reason="when_in_past"
            )
        if when > now + MAX_LEAD_S:
            raise errors.InvalidRequest("when is more than 7 days ahead", reason="when_too_far")
        active = [b for b in self.bursts.values() if b.state in ("scheduled", "provisioning")]
        if len(active) >= s.capacity_max_bursts:
            raise errors.QuotaExceeded(
                f"{len(active)} bursts are already pending here; retry when one is done",
                reason="too_many_bursts",
            )
        burst = Burst(
            id="burst-" + secrets.token_hex(6),
            project=req.project,
            image=req.image,
            backend=req.backend,
            cpu=req.cpu,
            memory_mb=req.memory_mb,
            count=req.count,
            when=when,
            announced_at=now,
            announced_by=p.name,
            state="scheduled",
        )
        self.bursts[burst.id] = burst
        while len(self.bursts) > KEEP_BURSTS:
            oldest = next(b for b in self.bursts.values() if b.state not in ("scheduled", "provisioning"))
            del self.bursts[oldest.id]
        task = asyncio.create_task(self._run(burst), name=f"dsec-{burst.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return burst

    def visible(self, scope: set[str] | None) -> list[Burst]:
        return [b for b in self.bursts.values() if scope is None or b.project in scope]

    async def _run(self, b: Burst) -> None:
        start = b.when - self.settings.capacity_lead_s
        if start > time.time():
            b.actions.append(f"pre-warming at {datetime.fromtimestamp(start).isoformat()}")
            await asyncio.sleep(start - time.time())
        b.state = "provisioning"
        try:
            await self._fulfil(b)
        except Exception as e:
            log.exception("burst %s failed", b.id)
            b.state, b.error = "failed", f"{type(e).__name__}: {e}"

    def _shape(self, b: Burst) -> tuple[SandboxSpec, PoolSpec]:
        spec = SandboxSpec(image=b.image, backend=b.backend, cpu=b.cpu, memory_mb=b.memory_mb)
        return spec, PoolSpec(**spec.model_dump(include=set(POOL_SHAPE)))

    def _held(self, edge: str, key: tuple[object, ...] | None = None) -> int:
        """Pool sandboxes promised to bursts on `edge` (of one shape, or all) and still held."""
        now = time.monotonic()
        total = 0
        for (e, k), entries in list(self.promised.items()):
            entries[:] = [(until, n) for until, n in entries if until > now]
            if e == edge and (key is None or k == key):
                total += sum(n for _, n in entries)
        return total

    def _able(self, spec: SandboxSpec) -> list[EdgeView]:
        """Edges that can pool `spec`: those holding its image, and those with a registry
        (they pull it when asked to pre-warm, as at a create)."""
        return [
            v
            for v in self.directory.views.values()
            if v.healthy
            and not v.draining
            and v.status is not None
            and (spec.image in v.status.images or v.status.registry)
            and spec.backend in v.status.backends
        ]

    async def _prewarm_round(self, b: Burst, spec: SandboxSpec, pool: PoolSpec, remaining: int) -> int:
        """Pre-warm up to `remaining` on the edges not used by `b` yet; how many were."""
        free = {v.api.name: edge_slots(v, spec, self._held(v.api.name)) for v in self._able(spec)}
        free = {k: n for k, n in free.items() if k not in b.prewarmed}
        done = 0
        for name, n in split(remaining, free).items():
            view = self.directory.views.get(name)
            if view is None:
                continue
            key = (name, pool.key())
            total = self._held(name, pool.key()) + n  # a prewarm sets the pool's boost: all bursts'
            try:
                await view.api.prewarm(pool, total, b.project)
            except errors.DsecError as e:
                b.actions.append(f"pre-warming {n} on {name} failed: {e.message}")
                continue
            self.promised.setdefault(key, []).append((time.monotonic() + POOL_HOLD_S, n))
            b.prewarmed[name] = n
            b.actions.append(f"pre-warmed {n} on {name}")
            done += n
        return done

    async def _fulfil(self, b: Burst) -> None:
        spec, pool = self._shape(b)
        remaining = b.count
        for _ in range(3):
            remaining -= await self._prewarm_round(b, spec, pool, remaining)
            if remaining <= 0 or not await self._grow(b, spec, remaining):
                break
        hold = max(b.when, time.time()) + self.settings.capacity_hold_s  # one hold for all its edges
        for name in b.prewarmed:
            self.protected[name] = max(self.protected.get(name, 0.0), hold)
        b.shortfall = max(remaining, 0)
        b.state = "ready" if b.shortfall == 0 else "partial"
        if b.shortfall:
            b.actions.append(f"short by {b.shortfall}")
        self.publish("capacity", id=b.id, project=b.project, state=b.state, shortfall=b.shortfall)

    async def _grow(self, b: Burst, spec: SandboxSpec, remaining: int) -> bool:
        """Ask the provider for edges to hold `remaining` more; whether any came up."""
        if self.provider is None:
            b.actions.append(f"no node provider: {remaining} more do not fit")
            return False
        per_edge = empty_edge_slots(self.directory.views.values(), spec)
        want = math.ceil(remaining / per_edge) if per_edge else 1
        live = [v for v in self.directory.views.values() if not v.lost]
        want = min(want, self.settings.max_edges - len(live))
        if want <= 0:
            b.actions.append(f"at max_edges ({self.settings.max_edges}): {remaining} more do not fit")
            return False
        before = set(self.directory.views)
        b.actions.append(f"asking the {self.provider.kind} provider for {want} edges")
        try:
            await self.provider.add(want)
        except errors.DsecError as e:
            b.actions.append(f"the provider could not add edges: {e.message}")
            return False
        b.edges_requested += want
        new = await self._wait_new(before, want, spec)
        b.edges_added += new
        b.actions.append(f"{len(new)} new edges up: {', '.join(new) or 'none'}")
        return bool(new)

    async def _wait_new(self, before: set[str], want: int, spec: SandboxSpec) -> list[str]:
        deadline = time.monotonic() + self.settings.capacity_edge_wait_s
        while True:
            new = [v.api.name for v in self._able(spec) if v.api.name not in before]
            if len(new) >= want or time.monotonic() > deadline:
                return new
            await asyncio.sleep(0.2)

    # --- idle drain and release -------------------------------------------------------------

    async def _managed_edges(self) -> set[str]:
        """Edges the provider holds (cached a few seconds: it may be a remote API)."""
        at, names = self._managed
        if self.provider is None:
            return set()
        if time.monotonic() - at > 5.0:
            try:
                names = {n.name for n in await self.provider.list() if n.state == "ready"}
            except Exception as e:
                log.warning("the node provider cannot list its nodes: %s", e)
                return set()
            self._managed = (time.monotonic(), names)
        return names

    def _sync_admin_drains(self, now: float) -> None:
        """An admin's drains are in the IAM's database, so every apiserver keeps them."""
        with contextlib.suppress(errors.DsecError):  # (the database away: next tick)
            shared = self.iam.drained_edges()
            for name in shared - set(self.drains):
                self.drains[name] = Drain("admin", now)
            for name, held in list(self.drains.items()):
                if held.reason == "admin" and name not in shared:
                    del self.drains[name]

    async def tick(self) -> None:
        """One round: keep drains on (re-registered views), undrain idle-drained edges that got
        busy, drain idle ones, release drained ones that stayed empty."""
        now = time.monotonic()
        for name, at in list(self.released.items()):
            if now - at > RELEASED_MEMORY_S:
                del self.released[name]
        self._sync_admin_drains(now)
        for name, view in list(self.directory.views.items()):
            if name in self.released and name not in self.drains:
                self.drains[name] = Drain("released", now)
            view.draining = name in self.drains
        after = self.settings.idle_drain_after_s
        if self.provider is None or after is None:
            return
        if any(b.state == "provisioning" for b in self.bursts.values()):
            self.idle_since.clear()  # nothing idles while a burst is being placed
            return
        managed = await self._managed_edges()
        # how many more may drain: idle release never goes below min_edges taking placements
        room = -self.settings.min_edges + len(
            [
                n
                for n in managed
                if n in self.directory.views and n not in self._releasing and n not in self.drains
            ]
        )
        newest_first = sorted(self.directory.views.items(), key=lambda kv: kv[1].added_at, reverse=True)
        for name, view in newest_first:
            if name in self._releasing or name not in managed:
                continue
            mark = self.drains.get(name)
            if not self._idle(view):
                self.idle_since.pop(name, None)
                if mark is not None and mark.reason == "idle":
                    self.undrain(name)  # a placement raced the drain: it is busy after all
                continue
            since = self.idle_since.setdefault(name, now)
            if mark is None and now - since >= after and room > 0:
                room -= 1
                self.drain(name, "idle")
            elif mark is not None and mark.reason == "idle" and view.last_ok > mark.since:
                # a status poll after the drain still finds it empty: nothing can land on it now
                self._releasing.add(name)
                task = asyncio.create_task(self._release(name), name=f"dsec-release-{name}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _idle(self, view: EdgeView) -> bool:
        s = view.status
        if s is None or not view.healthy or view.recent:
            return False
        if self.protected.get(view.api.name, 0.0) > time.time():
            return False
        # warm pool sandboxes count: stock someone asked for (they go when their pool shrinks)
        return s.sandboxes == 0 and s.used.get("sandboxes", 0) == 0

    async def _release(self, name: str) -> None:
        assert self.provider is not None
        try:
            await self.provider.remove(name)
        except Exception as e:
            log.warning("releasing edge %s failed (retried): %s", name, e)
            return
        finally:
            self._releasing.discard(name)
        self._managed = (0.0, set())
        self.released[name] = time.monotonic()
        self.drains[name] = Drain("released", time.monotonic())
        self.idle_since.pop(name, None)
        view = self.directory.views.pop(name, None)
        if view is not None:
            with contextlib.suppress(Exception):
                await view.api.aclose()
        self.publish("edge_released", edge=name)
        log.warning("edge %s released through the %s provider", name, self.provider.kind)

    # --- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run_loop(), name="dsec-capacity")

    async def _run_loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("the capacity round failed; next round")
            await asyncio.sleep(self.settings.capacity_interval_s)

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._loop] if self._loop else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.provider is not None:
            await self.provider.aclose()
