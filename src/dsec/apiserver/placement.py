"""The watcher's view of the edges, and placement over it.

The watcher polls each edge's status (health, capacity, live sandboxes per
image and project, cached layers, images, pool stock). Placement filters
(healthy, knows the image) and prefers edges holding ready pool sandboxes or
the image's layers, then picks the least loaded of k random candidates. Each
apiserver overlays its own recent placements not yet seen by the watcher, so a
burst is spread before the next poll. Nothing here is durable: after a restart
the view is rebuilt by polling (edges also re-register every few seconds).

Node loss: an edge that has not answered a status poll for `lost_after_s` (5 s; a poll
waits at most a third of that) is unhealthy (no placements) and lost: `on_lost` gives up its
sandboxes (their quota is released, they answer sandbox_lost), every call in flight to it
ends with sandbox_lost at once instead of waiting for a host that may never answer, and
new calls are refused the same way. When it answers again, `on_back` reconciles it (what
was given up is stopped there) and it takes placements again. An edge in this process
(`can_be_lost` false) is never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

from dsec import errors
from dsec.edgeapi import EdgeAPI, edge_of
from dsec.models import EdgeStatus, SandboxSpec

log = logging.getLogger("dsec.apiserver.placement")


LOST_AFTER_S = 5.0


@dataclass
class EdgeView:
    api: EdgeAPI
    status: EdgeStatus | None = None
    last_ok: float = 0.0
    failures: int = 0
    recent: list[float] = field(default_factory=list)  # our placements since the last poll
    added_at: float = field(default_factory=time.monotonic)
    lost: bool = False  # given up (see the module); until it answers again
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set while lost: in-flight calls end
    lost_after_s: float = LOST_AFTER_S
    draining: bool = False  # takes no new placements (dsec.apiserver.capacity)

    @property
    def healthy(self) -> bool:
        if self.status is None or not self.status.healthy or self.failures >= 3 or self.lost:
            return False
        return not self.can_be_lost or time.monotonic() - self.last_ok < self.lost_after_s

    @property
    def can_be_lost(self) -> bool:
        return bool(getattr(self.api, "can_be_lost", True))

    def silent_for(self) -> float:
        """Seconds since it last answered (or since it was added, if it never did)."""
        return time.monotonic() - max(self.last_ok, self.added_at)

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


class GuardedEdge:
    """An edge's API whose calls end with sandbox_lost as soon as the watcher gives the edge
    up (a call to a host that was cut off would otherwise wait for its timeouts), and whose
    "no such sandbox" for a sandbox given up earlier is sandbox_lost too.

    sandbox_lost names a sandbox, so it is said only to a caller who may see it (`scope`: the
    caller's projects, None for an admin): to anyone else a sandbox given up is not found, with
    the edge's own words, so lost ids are no oracle of another tenant's sandboxes."""

    def __init__(
        self, view: EdgeView, lost_project: Callable[[str], str | None], scope: set[str] | None
    ) -> None:
        self._view = view
        self._lost_project = lost_project
        self._scope = scope
        self.name = view.api.name

    def _lost(self, sid: object = None) -> errors.DsecError:
        if isinstance(sid, str):
            project = self._lost_project(sid)
            if project is None or (self._scope is not None and project not in self._scope):
                return errors.SandboxNotFound(f"sandbox {sid} does not exist or is not in your projects")
        what = f"sandbox {sid}" if isinstance(sid, str) else "the call"
        return errors.SandboxLost(
            f"edge {self.name} stopped answering and was given up: {what} is lost (its quota "
            "is released); create a new sandbox",
            edge=self.name,
        )

    async def _call(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        view = self._view
        if view.lost:
            raise self._lost(args[0] if args else None)
        call = asyncio.ensure_future(fn(*args, **kw))
        gone = asyncio.ensure_future(view.gone.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            call.cancel()
            raise
        finally:
            gone.cancel()
        if not call.done():
            call.cancel()
            raise self._lost(args[0] if args else None)
        try:
            return call.result()
        except errors.SandboxNotFound:
            if args and isinstance(args[0], str) and self._lost_project(args[0]) is not None:
                raise self._lost(args[0]) from None
            raise
        except errors.Unavailable:
            # It cannot be reached (a dead process refuses at once): the watcher's verdict
            # comes within lost_after_s; until then this is no answer yet.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(view.gone.wait(), view.lost_after_s + 2)
            if view.lost:
                raise self._lost(args[0] if args else None) from None
            raise

    async def _stream(
        self, fn: Callable[..., AsyncIterator[Any]], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> AsyncIterator[Any]:
        it = fn(*args, **kw).__aiter__()
        while True:
            try:
                item = await self._call(it.__anext__, (), {})
            except StopAsyncIteration:
                return
            yield item

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._view.api, name)
        if inspect.iscoroutinefunction(attr):

            async def call(*args: Any, **kw: Any) -> Any:
                return await self._call(attr, args, kw)

            return call
        if inspect.isasyncgenfunction(attr) or name in ("exec_stream", "download_tar"):

            def stream(*args: Any, **kw: Any) -> AsyncIterator[Any]:
                return self._stream(attr, args, kw)

            return stream
        return attr


class Candidates(Sequence[EdgeView]):
    """The edges able to take a spec, best first, each drawn when it is first asked for: the
    least loaded of k drawn at random from those not taken yet (power of k choices). A create
    nearly always takes the first, so it reads k edges' loads rather than ordering every edge
    up front (O(n^2) with list removals: ~35 ms a create at 1,000 edges, bench_control_plane).
    A later one is drawn with the loads as they are then (after the placements meanwhile)."""

    def __init__(self, able: list[EdgeView], spec: SandboxSpec, k: int) -> None:
        self._left = able  # (its own list: drawn from in place)
        self._taken: list[EdgeView] = []
        self._members: set[int] | None = None
        self._spec = spec
        self._k = k

    def _draw(self) -> bool:
        left = self._left
        if not left:
            return False
        sample = random.sample(range(len(left)), min(self._k, len(left)))
        best = min(sample, key=lambda i: left[i].load(self._spec))
        self._taken.append(left[best])
        left[best] = left[-1]  # (the order of those left does not matter: they are sampled)
        left.pop()
        return True

    def __len__(self) -> int:
        return len(self._taken) + len(self._left)

    def __iter__(self) -> Iterator[EdgeView]:
        i = 0
        while i < len(self._taken) or self._draw():
            yield self._taken[i]
            i += 1

    @overload
    def __getitem__(self, i: int) -> EdgeView: ...
    @overload
    def __getitem__(self, i: slice) -> list[EdgeView]: ...
    def __getitem__(self, i: int | slice) -> EdgeView | list[EdgeView]:
        if isinstance(i, slice):
            return list(self)[i]
        j = i + len(self) if i < 0 else i
        while len(self._taken) <= j and self._draw():
            pass
        if not 0 <= j < len(self._taken):
            raise IndexError(i)
        return self._taken[j]

    def __contains__(self, v: object) -> bool:
        if self._members is None:
            self._members = {id(x) for x in (*self._taken, *self._left)}
        return id(v) in self._members

    def __repr__(self) -> str:
        return f"Candidates({[v.api.name for v in self]})"


LostHook = Callable[[EdgeAPI], Awaitable[None]]


class EdgeDirectory:
    def __init__(
        self, *, poll_interval_s: float = 1.0, k: int = 2, lost_after_s: float = LOST_AFTER_S
    ) -> None:
        self.views: dict[str, EdgeView] = {}
        self.poll_interval_s = poll_interval_s
        self.lost_after_s = lost_after_s
        self.k = k
        self._task: asyncio.Task[None] | None = None
        self._lag: asyncio.Task[None] | None = None
        self.stalled_until = 0.0  # no edge is given up before this (see _watch_lag)
        self.on_lost: LostHook | None = None  # an edge was given up (see the module)
        self.on_back: LostHook | None = None  # a given-up edge answers again
        # the project of a sandbox given up earlier (None: it was not)
        self.lost_project: Callable[[str], str | None] = lambda _sid: None

    def add(self, api: EdgeAPI) -> EdgeView:
        view = self.views.get(api.name)
        if view is not None and view.api.url == api.url:
            return view
        self.views[api.name] = view = EdgeView(api, lost_after_s=self.lost_after_s)
        return view

    def _api(self, view: EdgeView, scope: set[str] | None = None) -> EdgeAPI:
        if not view.can_be_lost:
            return view.api
        return cast(EdgeAPI, GuardedEdge(view, self.lost_project, scope))

    def edge_for(self, sandbox_id: str, scope: set[str] | None) -> EdgeAPI:
        """The edge that holds `sandbox_id`, for a caller who sees `scope` (its projects; None:
        an admin): sandbox_lost is said only about sandboxes in it (see GuardedEdge)."""
        name = edge_of(sandbox_id)
        view = self.views.get(name)
        if view is None:
            project = self.lost_project(sandbox_id)
            if project is not None and (scope is None or project in scope):
                raise errors.SandboxLost(
                    f"sandbox {sandbox_id} was lost with its edge {name!r}; create a new sandbox", edge=name
                )
            raise errors.SandboxNotFound(
                f"sandbox {sandbox_id} belongs to edge {name!r}, which is not registered"
            )
        return self._api(view, scope)

    def all(self) -> Iterable[EdgeAPI]:
        """The edges to ask (fan-out calls): not those given up."""
        return [self._api(v) for v in self.views.values() if not v.lost]

    async def poll_once(self) -> None:
        timeout = max(0.5, min(5.0, self.lost_after_s / 3))

        async def one(view: EdgeView) -> None:
            try:
                view.status = await asyncio.wait_for(view.api.status(), timeout)
                view.last_ok = time.monotonic()
                view.failures = 0
                view.recent.clear()
            except Exception as e:  # an unreachable edge is just unhealthy
                view.failures += 1
                log.debug("edge %s status failed: %s", view.api.name, e)
            await self._judge(view)

        await asyncio.gather(*(one(v) for v in list(self.views.values())))

    async def _judge(self, view: EdgeView) -> None:
        """Give a silent edge up, or take a given-up one back (see the module)."""
        if not view.can_be_lost:
            return
        answered = view.failures == 0 and view.last_ok > 0
        if time.monotonic() < self.stalled_until:
            return  # this process could not listen (see _watch_lag): silence proves nothing
        if not view.lost and not answered and view.silent_for() >= self.lost_after_s:
            log.warning("edge %s has not answered for %.1f s: given up", view.api.name, view.silent_for())
            if self.on_lost is not None:  # its sandboxes are recorded lost before any call hears so
                try:
                    await self.on_lost(view.api)
                except Exception:
                    log.exception("giving up edge %s failed; retried at the next poll", view.api.name)
                    return
            view.lost = True
            view.gone.set()
        elif view.lost and answered:
            if self.on_back is not None:
                try:
                    await self.on_back(view.api)
                except Exception:
                    log.exception("taking edge %s back failed; retried at the next poll", view.api.name)
                    return
            view.lost = False
            view.gone = asyncio.Event()
            log.warning("edge %s answers again: taking placements", view.api.name)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dsec-watcher")
        self._lag = asyncio.create_task(self._watch_lag(), name="dsec-watcher-lag")

    async def _watch_lag(self, tick: float = 0.1) -> None:
        """An edge is judged by the answers this process heard. When this process's own event
        loop stalls (a blocked call, CPU starvation, the IAM's database away), answers wait
        unread and polls time out here, not there: no edge is given up until a full
        `lost_after_s` has passed with the loop running freely again."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - t > tick + 0.5:
                self.stalled_until = now + self.lost_after_s
                for v in self.views.values():  # what they answered before the stall counts from now
                    v.last_ok = max(v.last_ok, now - self.lost_after_s / 2) if v.last_ok else v.last_ok
                    v.failures = 0

    async def close(self) -> None:
        for task in (self._task, self._lag):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for v in self.views.values():
            await v.api.aclose()

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval_s)

    def candidates(self, spec: SandboxSpec) -> Candidates:
        """Edges to try, best first: filter, prefer warm ones, then power of k choices."""
        runs = [
            v
            for v in self.views.values()
            if v.healthy and not v.draining and v.status is not None and spec.backend in v.status.backends
        ]
        tier = [v for v in runs if spec.image in v.status.images]  # type: ignore[union-attr]
        if not tier:  # no edge holds it: those with a registry pull it at create (EdgeStatus.registry)
            tier = [v for v in runs if v.status.registry]  # type: ignore[union-attr]
        if not tier:
            self._refuse(spec)
        return Candidates(tier, spec, self.k)

    def _refuse(self, spec: SandboxSpec) -> None:
        """Why no edge can take `spec` (candidates found none): the first filter that failed."""
        healthy = [v for v in self.views.values() if v.healthy and not v.draining]
        if not healthy:
            raise errors.Unavailable(
                "no healthy edge is registered; start `dsec edge` or wait for it to register"
            )
        able = [v for v in healthy if v.status is not None and spec.image in v.status.images]
        if not able:  # edges with a registry pull what they lack at create (EdgeStatus.registry)
            able = [v for v in healthy if v.status is not None and v.status.registry]
        if not able:
            raise errors.ImageNotFound(
                f"no edge has image {spec.image!r}; build or import it first (dsec image build / import)"
            )
        known = sorted({b for v in healthy if v.status for b in v.status.backends})
        raise errors.InvalidRequest(
            f"no edge with image {spec.image!r} runs backend {spec.backend!r}; "
            f"backends available: {', '.join(known) or 'none'}",
            reason="unknown_backend",
            available=known,
        )

    def note_placed(self, view: EdgeView) -> None:
        view.recent.append(time.monotonic())
