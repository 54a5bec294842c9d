"""Elastic capacity: announced bursts, draining, idle release (issue #14 item 7).

A job announces a burst (`POST /v1/capacity`: N sandboxes of a shape, for a project, at a
time). At `when - capacity_lead_s` (at once if that has passed) dsec pre-warms pools of that
shape on the healthy edges that take placements, each given a share proportional to its free
room (sandbox slots, CPU and memory, less the pool sandboxes it holds or was promised); when
they are short, it asks the node provider for enough edges of the size it knows, waits for
them to register, and pre-warms the rest there. What was done is kept on the burst
(`GET /v1/capacity`). What a project has announced counts against its quota in total, and the
cluster's bound on pending bursts has a per-project share (dsec.iam.capacity.add_burst; admins
are bound by neither). `DELETE /v1/capacity/{id}` cancels a burst: its edges are sent their
pools' boost without its share (`cancel`, and again by the acting apiserver after any prewarm it
had in flight: `_release_cancelled`).

Draining: a draining edge takes no new placements (`EdgeView.draining`, filtered by
`EdgeDirectory.candidates`); its sandboxes keep working. An admin drains one for maintenance
(`POST /v1/edges/{name}/drain`, `undrain`). With a node provider and `idle_drain_after_s`, an
edge the provider holds with no sandbox (pool sandboxes included: stock someone asked for) for
that long is drained, newest edges first (none while a burst is being provisioned), and
released through the provider once a later status poll still finds it empty (a placement that
raced the drain makes it busy again: it is undrained instead); never below `min_edges` taking
placements. The edges a burst pre-warmed on are kept `capacity_hold_s` past its time (or past
the pre-warm, if later).

Shared by apiservers: everything above is kept in the IAM's database (dsec.iam.capacity), so
with stateless apiservers on one PostgreSQL any of them takes an announcement or a drain and
every one lists the same bursts and keeps the same drains on its views (each re-reads them every
`capacity_interval_s`). Exactly one apiserver acts (pre-warms, asks the node provider, drains
idle edges, releases them): the holder of the `capacity_leader` row, an IAM owner alive while
its process lives (PostgreSQL: a session advisory lock and a lease, as pending creates' owners);
when it dies the next apiserver's round takes the row over, and every write the actor makes is
fenced by it, so one that lost the lead changes nothing. A burst is resumable from what is
stored: its prewarms are recorded before they are sent (a successor sends them again, as a
prewarm sets a pool's target, instead of a second share), a node-provider request is recorded
before it is made (a successor waits for those edges instead of asking again), and an edge moves
idle -> releasing -> released by conditional writes (a successor finishes a release under way,
the provider's removal being a no-op the second time; an edge is released once). An idle edge is
released only after a status poll `2 x capacity_interval_s` after its drain, once every
apiserver has taken the drain up. Since each step is written before it is taken, an actor cut
off from the database (replaced once its lease ends) can finish at most the call it was in, not
start another. What this leaves: a successor of an actor that died between recording a node
request and making it waits `capacity_edge_wait_s` for edges that never come before it goes on.
The edges' own state (pools, sandboxes) is what each apiserver's watcher reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from dsec.iam.capacity import BurstCancelled
from dsec.models import Burst, CapacityRequest, PoolSpec, SandboxSpec
from dsec.models.capacity import MAX_LEAD_S
from dsec.models.pools import POOL_SHAPE

log = logging.getLogger("dsec.apiserver.capacity")

POOL_HOLD_S = 300.0  # how long an edge keeps a prewarm's boost (dsec.edge.pools.prewarm)
KEEP_BURSTS = 100  # finished bursts kept for GET, a project
RELEASED_MEMORY_S = 3600.0  # an edge released this recently is kept drained if it registers again
GROW_ROUNDS = 3  # how many times one burst asks the node provider for edges


@dataclass
class Drain:
    reason: str  # "admin" (maintenance), "idle" (to be released), "releasing", "released"
    since: float  # monotonic: when this apiserver first saw it


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


class _LostLead(Exception):
    """This apiserver no longer acts on bursts (another took over): its burst tasks end."""


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
        self.leading = False  # this apiserver acts on bursts and idle edges (see the module)
        self.drains: dict[str, Drain] = {}  # every drain, as the IAM had it at the last tick
        self.idle_since: dict[str, float] = {}  # (acting apiserver) edge -> monotonic
        self.running: dict[str, Burst] = {}  # (acting apiserver) bursts it is working on
        self._releasing: set[str] = set()
        self._managed: tuple[float, set[str]] = (0.0, set())
        self._tasks: set[asyncio.Task[None]] = set()
        self._burst_tasks: dict[str, asyncio.Task[None]] = {}
        self._send_locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}  # (users)
        self._loop: asyncio.Task[None] | None = None
        self._pruned = 0.0

    # --- drain ----------------------------------------------------------------------------

    def _view(self, name: str) -> EdgeView:
        view = self.directory.views.get(name)
        if view is None:
            raise errors.NotFound(
                f"no edge named {name!r} is registered (GET /v1/edges lists them)", edge=name
            )
        return view

    def drain(self, name: str) -> EdgeView:
        """An admin's drain (maintenance): never released by idleness."""
        view = self._view(name)
        self.iam.set_drained(name, True)  # every apiserver takes it up at its next tick
        self.drains[name] = Drain("admin", time.monotonic())
        view.draining = True
        self.publish("edge_draining", edge=name, reason="admin")
        log.warning("edge %s drains (admin): no new placements", name)
        return view

    def undrain(self, name: str) -> EdgeView:
        view = self._view(name)
        self.iam.set_drained(name, False)
        self.iam.unmark_edge(name)  # idle-drained or released: taken back too
        if self.drains.get(name, Drain("", 0)).reason != "releasing":
            self.drains.pop(name, None)
            view.draining = False
        self.publish("edge_undrained", edge=name)
        log.warning("edge %s takes placements again", name)
        return view

    def _sync_drains(self, now: float) -> None:
        """Every drain is in the IAM's database (an admin's, the idle ones, releases), so every
        apiserver keeps them; a view re-made when its edge registers again stays drained."""
        try:
            admin = self.iam.drained_edges()
            marks = self.iam.capacity_marks()
        except errors.DsecError:
            admin, marks = None, None  # (the database away: what we had, next tick again)
        if admin is not None and marks is not None:
            # an admin's drain outranks an idle one; a release under way or done outranks both
            wanted = (
                {n: m.state for n, m in marks.items() if m.state == "idle"}
                | dict.fromkeys(admin, "admin")
                | {n: m.state for n, m in marks.items() if m.state != "idle"}
            )
            before, self.drains = self.drains, {}
            for name, reason in wanted.items():
                had = before.get(name)
                self.drains[name] = had if had is not None and had.reason == reason else Drain(reason, now)
                if reason == "released" and (had is None or had.reason != "released"):
                    self._forget_view(name)  # released by the acting apiserver: gone
        for name, view in self.directory.views.items():
            view.draining = name in self.drains

    def _forget_view(self, name: str) -> None:
        view = self.directory.views.pop(name, None)
        if view is not None:
            task = asyncio.get_running_loop().create_task(view.api.aclose())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # --- bursts ---------------------------------------------------------------------------

    def announce(self, req: CapacityRequest, p: Principal) -> Burst:
        """Validate and record a burst (authorization: see the route); the acting apiserver
        takes it up (at once if that is this one)."""
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
        shape = req.model_dump(include={"project", "image", "backend", "cpu", "memory_mb", "count"})
        burst = Burst(
            id="burst-" + secrets.token_hex(6), when=when, announced_at=now, announced_by=p.name,
            state="scheduled", **shape,
        )  # fmt: skip
        start = when - s.capacity_lead_s
        if start > now:
            burst.actions.append(f"pre-warming at {datetime.fromtimestamp(start).isoformat()}")
        iam.add_burst(
            burst,
            # an admin is bound by neither the cluster's bound on pending bursts nor a project's
            # share of it: a tenant that took them all cannot lock the operator out
            max_active=None if p.admin else s.capacity_max_bursts,
            max_project=None if p.admin else s.capacity_max_bursts_per_project,
            keep=KEEP_BURSTS,
            pooled_since=now - POOL_HOLD_S,  # a finished burst's stock counts while edges keep it
        )
        if self.leading:
            self._take_up(burst, {})
        return burst

    def visible(self, scope: set[str] | None) -> list[Burst]:
        return self.iam.list_bursts(scope)

    async def cancel(self, burst_id: str, p: Principal) -> Burst:
        """Cancel a burst of one of `p`'s projects (another's: not_found). Its pool sandboxes
        are given back: each edge it pre-warmed is sent its pool's boost without it, here at
        once and again by the acting apiserver (which also ends the burst's task), so that a
        prewarm that was in flight as it was cancelled does not keep them."""
        burst, edges = self.iam.cancel_burst(burst_id, self.iam.visible_projects(p), p.name)
        if edges:
            await self._unboost(burst, edges)
        self.publish("capacity", id=burst.id, project=burst.project, state=burst.state, shortfall=0)
        return burst

    async def _unboost(self, b: Burst, edges: Iterable[str]) -> list[str]:
        """Send `edges` their `b`-shaped pool's boost as the bursts still holding it there ask
        (`b` cancelled: without its share); the edges done (a failure is retried by the acting
        apiserver; an edge gone or given up holds nothing to give back)."""
        _, pool = self._shape(b)
        done = []
        for name in edges:
            view = self.directory.views.get(name)
            if view is None or view.lost:
                done.append(name)
                continue
            try:
                await self._send_boost(name, pool, b.project)
            except errors.DsecError as e:
                log.warning("burst %s: giving back its pool sandboxes on %s failed: %s", b.id, name, e)
                continue
            done.append(name)
        return done

    async def _release_cancelled(self) -> None:
        """(The acting apiserver) end the tasks of cancelled bursts and send their edges the
        pools' boost again, after any prewarm those tasks had in flight (see `_send_boost`)."""
        for b, edges in self.iam.unreleased_bursts():
            task = self._burst_tasks.get(b.id)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            done = await self._unboost(b, edges)
            if done and not self.iam.released(b.id, done):
                raise _LostLead(b.id)

    def _take_up(self, b: Burst, progress: dict[str, Any]) -> None:
        if b.id in self._burst_tasks:
            return
        self.running[b.id] = b
        task = asyncio.create_task(self._run(b, progress), name=f"dsec-{b.id}")
        self._burst_tasks[b.id] = task

        def done(_: object) -> None:
            self._burst_tasks.pop(b.id, None)
            self.running.pop(b.id, None)

        task.add_done_callback(done)

    def _save(self, b: Burst, progress: dict[str, Any]) -> None:
        if not self.iam.save_burst(b, progress, _shape_key(self._shape(b)[1])):
            raise _LostLead(b.id)

    async def _run(self, b: Burst, progress: dict[str, Any]) -> None:
        try:
            start = b.when - self.settings.capacity_lead_s
            if start > time.time():
                await asyncio.sleep(start - time.time())
            me = self.iam.capacity_leader()
            if b.state == "provisioning" and progress.get("by") not in (None, me):
                b.actions.append("taken up by another apiserver (the one acting on it stopped)")
            b.state, progress["by"] = "provisioning", me
            self._save(b, progress)
            await self._fulfil(b, progress)
        except _LostLead:
            log.warning("burst %s: another apiserver acts on it now", b.id)
        except BurstCancelled:
            log.warning("burst %s was cancelled", b.id)
        except errors.Unavailable as e:  # (the database away: the next round resumes it)
            log.warning("burst %s paused: %s", b.id, e)
        except Exception as e:
            log.exception("burst %s failed", b.id)
            b.state, b.error = "failed", f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                self._save(b, progress)

    def _shape(self, b: Burst) -> tuple[SandboxSpec, PoolSpec]:
        spec = SandboxSpec(image=b.image, backend=b.backend, cpu=b.cpu, memory_mb=b.memory_mb)
        return spec, PoolSpec(**spec.model_dump(include=set(POOL_SHAPE)))

    def _held(self, edge: str, pool: PoolSpec | None = None) -> int:
        """Pool sandboxes promised to bursts on `edge` (of one shape, or all) and still held."""
        shape = None if pool is None else _shape_key(pool)
        return self.iam.prewarm_held(edge, time.time() - POOL_HOLD_S, shape)

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

    async def _send_boost(self, name: str, pool: PoolSpec, project: str) -> None:
        """Send edge `name` its pool's boost: every burst's share there, read and sent under one
        lock per edge and pool, so that a send which read a share since cancelled is over before
        the acting apiserver sends the boost without it."""
        key = (name, _shape_key(pool))
        lock, users = self._send_locks.get(key, (asyncio.Lock(), 0))
        self._send_locks[key] = (lock, users + 1)
        try:
            async with lock:
                view = self.directory.views.get(name)
                if view is None:
                    raise errors.NotFound(f"edge {name} is not registered here")
                await view.api.prewarm(pool, self._held(name, pool), project)
        finally:
            lock, users = self._send_locks.pop(key)
            if users > 1:
                self._send_locks[key] = (lock, users - 1)

    async def _prewarm(self, b: Burst, progress: dict[str, Any], pool: PoolSpec, name: str) -> bool:
        """Send edge `name` its pool's boost: every burst's share there (`b`'s recorded first,
        so an apiserver that takes over sends it again rather than another share)."""
        try:
            await self._send_boost(name, pool, b.project)
        except errors.DsecError as e:
            b.actions.append(f"pre-warming {b.prewarmed.pop(name)} on {name} failed: {e.message}")
            self._save(b, progress)
            return False
        return True

    async def _prewarm_round(
        self, b: Burst, progress: dict[str, Any], spec: SandboxSpec, pool: PoolSpec, remaining: int
    ) -> int:
        """Pre-warm up to `remaining` on the edges not used by `b` yet; how many were."""
        free = {v.api.name: edge_slots(v, spec, self._held(v.api.name)) for v in self._able(spec)}
        free = {k: n for k, n in free.items() if k not in b.prewarmed}
        done = 0
        for name, n in split(remaining, free).items():
            b.prewarmed[name] = n
            self._save(b, progress)
            if await self._prewarm(b, progress, pool, name):
                b.actions.append(f"pre-warmed {n} on {name}")
                done += n
        return done

    async def _fulfil(self, b: Burst, progress: dict[str, Any]) -> None:
        spec, pool = self._shape(b)
        for name in list(b.prewarmed):  # an apiserver that stopped recorded these: send them again
            await self._prewarm(b, progress, pool, name)
        grow = progress.get("grow")
        if grow:  # it had asked the node provider: wait for those edges, do not ask again
            await self._grown(b, progress, spec, set(grow["before"]), grow["want"], grow["deadline"])
        while True:
            remaining = b.count - sum(b.prewarmed.values())
            if remaining > 0:
                remaining -= await self._prewarm_round(b, progress, spec, pool, remaining)
            if remaining <= 0 or progress.get("rounds", 0) >= GROW_ROUNDS:
                break
            progress["rounds"] = progress.get("rounds", 0) + 1
            if not await self._grow(b, progress, spec, remaining):
                break
        # one hold for all its edges
        progress["hold"] = max(b.when, time.time()) + self.settings.capacity_hold_s
        b.shortfall = max(remaining, 0)
        b.state = "ready" if b.shortfall == 0 else "partial"
        if b.shortfall:
            b.actions.append(f"short by {b.shortfall}")
        self._save(b, progress)
        self.publish("capacity", id=b.id, project=b.project, state=b.state, shortfall=b.shortfall)

    async def _grow(self, b: Burst, progress: dict[str, Any], spec: SandboxSpec, remaining: int) -> bool:
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
        deadline = time.time() + self.settings.capacity_edge_wait_s
        b.actions.append(f"asking the {self.provider.kind} provider for {want} edges")
        b.edges_requested += want
        # recorded before asking: an apiserver taking over waits for them instead of asking again
        progress["grow"] = {"before": sorted(before), "want": want, "deadline": deadline}
        self._save(b, progress)
        try:
            await self.provider.add(want)
        except errors.DsecError as e:
            b.actions.append(f"the provider could not add edges: {e.message}")
            b.edges_requested -= want
            progress["grow"] = None
            self._save(b, progress)
            return False
        return await self._grown(b, progress, spec, before, want, deadline)

    async def _grown(
        self,
        b: Burst,
        progress: dict[str, Any],
        spec: SandboxSpec,
        before: set[str],
        want: int,
        deadline: float,
    ) -> bool:
        """Wait for `want` edges not in `before` to take placements (until `deadline`, epoch s);
        whether any did."""
        while True:
            new = [v.api.name for v in self._able(spec) if v.api.name not in before]
            if len(new) >= want or time.time() > deadline:
                break
            await asyncio.sleep(0.2)
        b.edges_added += [n for n in new if n not in b.edges_added]
        b.actions.append(f"{len(new)} new edges up: {', '.join(new) or 'none'}")
        progress["grow"] = None
        self._save(b, progress)
        return bool(new)

    # --- idle drain and release (the acting apiserver) -------------------------------------------

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

    async def tick(self) -> None:
        """One round, on every apiserver: keep the IAM's drains on the views. On the acting
        apiserver (taking the lead if it is free): take up pending bursts, undrain idle-drained
        edges that got busy, drain idle ones, release drained ones that stayed empty."""
        now = time.monotonic()
        self._sync_drains(now)
        try:
            leading = self.iam.capacity_lead()
        except errors.DsecError:
            leading = False  # (the database away: acting needs it)
        if not leading:
            if self.leading:
                self._step_down()
            return
        if not self.leading:
            log.warning("this apiserver now acts on announced bursts and idle edges")
        self.leading = True
        for b, progress in self.iam.active_bursts():
            self._take_up(b, progress)
        try:
            await self._release_cancelled()
        except _LostLead:
            return  # (the next round steps down)
        if time.time() - self._pruned > 60:
            self._pruned = time.time()
            self.iam.forget_prewarms(time.time() - max(POOL_HOLD_S, 60.0))
            self.iam.forget_released(time.time() - RELEASED_MEMORY_S)
        await self._idle_round(now)

    def _step_down(self) -> None:
        log.warning("another apiserver acts on bursts and idle edges now")
        self.leading = False
        for task in [*self._burst_tasks.values()]:
            task.cancel()
        self.idle_since.clear()

    async def _idle_round(self, now: float) -> None:
        after = self.settings.idle_drain_after_s
        if self.provider is None or after is None:
            return
        for name, held_by in self.drains.items():  # releases an apiserver that stopped had begun
            if held_by.reason == "releasing" and name not in self._releasing:
                self._start_release(name)
        if any(b.state == "provisioning" for b in self.running.values()):
            self.idle_since.clear()  # nothing idles while a burst is being placed
            return
        managed = await self._managed_edges()
        views = self.directory.views
        # how many more may drain: idle release never goes below min_edges taking placements
        room = -self.settings.min_edges + len([n for n in managed if n in views and n not in self.drains])
        held = self.iam.held_edges(time.time())
        settle = 2 * self.settings.capacity_interval_s  # every apiserver synced it by then
        newest_first = sorted(views.items(), key=lambda kv: kv[1].added_at, reverse=True)
        for name, view in newest_first:
            if name in self._releasing or name not in managed:
                continue
            mark = self.drains.get(name)
            if not self._idle(view, held):
                self.idle_since.pop(name, None)
                if mark is not None and mark.reason == "idle":
                    self._undrain_idle(name)  # a placement raced the drain: it is busy after all
                continue
            since = self.idle_since.setdefault(name, now)
            if mark is None and now - since >= after and room > 0:
                room -= 1
                self._drain_idle(name)
            elif (
                # a status poll after every apiserver took up the drain still finds it empty:
                # nothing can land on it now
                mark is not None
                and mark.reason == "idle"
                and view.last_ok > mark.since + settle
                and self.iam.mark_edge(name, "releasing", expect="idle")
            ):
                self.drains[name] = Drain("releasing", now)
                self._start_release(name)

    def _drain_idle(self, name: str) -> None:
        if not self.iam.mark_edge(name, "idle", expect=None):
            return
        self.drains[name] = Drain("idle", time.monotonic())
        self.directory.views[name].draining = True
        self.publish("edge_draining", edge=name, reason="idle")
        log.warning("edge %s drains (idle): no new placements", name)

    def _undrain_idle(self, name: str) -> None:
        if not self.iam.mark_edge(name, None, expect="idle"):
            return
        self.drains.pop(name, None)
        self.directory.views[name].draining = False
        self.publish("edge_undrained", edge=name)
        log.warning("edge %s takes placements again (busy after its idle drain)", name)

    def _idle(self, view: EdgeView, held: dict[str, float]) -> bool:
        s = view.status
        if s is None or not view.healthy or view.recent:
            return False
        if held.get(view.api.name, 0.0) > time.time():
            return False
        # warm pool sandboxes count: stock someone asked for (they go when their pool shrinks)
        return s.sandboxes == 0 and s.used.get("sandboxes", 0) == 0

    def _start_release(self, name: str) -> None:
        self._releasing.add(name)
        task = asyncio.create_task(self._release(name), name=f"dsec-release-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, name: str) -> None:
        assert self.provider is not None
        try:
            await self.provider.remove(name)  # (a no-op when an earlier try got there)
            released = self.iam.mark_edge(name, "released", expect="releasing")
        except Exception as e:
            log.warning("releasing edge %s failed (retried): %s", name, e)
            return
        finally:
            self._releasing.discard(name)
        self._managed = (0.0, set())
        self.idle_since.pop(name, None)
        if not released:
            return
        self.drains[name] = Drain("released", time.monotonic())
        self._forget_view(name)
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
        tasks = [*self._tasks, *self._burst_tasks.values(), *([self._loop] if self._loop else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.provider is not None:
            await self.provider.aclose()


def _shape_key(pool: PoolSpec) -> str:
    return json.dumps(list(pool.key()), default=str)
