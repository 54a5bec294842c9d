"""The watcher's view of the edges, and placement over it.

The watcher polls each edge's status (health, capacity, live sandboxes per
image and project, cached layers, images, pool stock) and, once per poll, files
the edges per (backend, image) in tiers: those holding the image, then those with
a registry by how many of its layers they hold (an image's layers as an edge that holds
it lists them; for an image no edge holds, as the registry's manifest names them, read
before its first placement: `learn_from_registry`). Placement reads that index (a
create does not scan every edge), asks only the edges it draws whether they are
able now, and within a tier picks the least loaded of k random candidates; an
edge at `SPILL_AT` load goes last. Each apiserver overlays its own recent
placements not yet seen by the watcher, so a burst is spread before the next
poll. Nothing here is durable: after a restart the view is rebuilt by polling
(edges also re-register every few seconds).

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
from dsec.aio import wait_for
from dsec.edgeapi import EdgeAPI, edge_of
from dsec.models import EdgeStatus, SandboxSpec

log = logging.getLogger("dsec.apiserver.placement")


LOST_AFTER_S = 5.0
SPILL_AT = 0.9  # an edge this loaded (of its capacity) is tried after the rest (Candidates)


@dataclass
class EdgeView:
    api: EdgeAPI
    _status: EdgeStatus | None = None
    last_ok: float = 0.0
    failures: int = 0
    recent: list[float] = field(default_factory=list)  # our placements since the last poll
    added_at: float = field(default_factory=time.monotonic)
    lost: bool = False  # given up (see the module); until it answers again
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set while lost: in-flight calls end
    lost_after_s: float = LOST_AFTER_S
    draining: bool = False  # takes no new placements (dsec.apiserver.capacity)
    changed: Callable[[], None] = lambda: None  # its status was replaced (the directory's index)

    @property
    def status(self) -> EdgeStatus | None:
        return self._status

    @status.setter
    def status(self, status: EdgeStatus | None) -> None:
        self._status = status
        self.changed()

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
                await wait_for(view.gone.wait(), view.lost_after_s + 2)
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
    """The edges able to take a spec, best first, each drawn when it is first asked for.

    The edges come in tiers (those holding the image, then those holding more of its layers
    before those holding fewer; see `EdgeDirectory.candidates`). Within a tier each is the
    least loaded of k drawn at random from those not taken yet (power of k choices). A create
    nearly always takes the first, so it reads k edges' loads rather than ordering every edge
    up front (O(n^2) with list removals: ~35 ms a create at 1,000 edges, bench_control_plane).
    A later one is drawn with the loads as they are then (after the placements meanwhile).

    The tiers come from the directory's index, made once per poll; whether an edge is able
    now (healthy, not draining, still registered) is asked of each edge drawn, so an edge that
    went silent since the poll is never taken. An edge drawn at `spill_at` load or above moves
    to a last tier of its own: holding the layers does not pile a burst onto one edge."""

    def __init__(
        self,
        tiers: Iterable[list[EdgeView]],
        spec: SandboxSpec,
        k: int,
        able: Callable[[EdgeView], bool] = lambda _v: True,
        spill_at: float = float("inf"),
    ) -> None:
        self._tiers = [list(t) for t in tiers]  # (their own lists: drawn from in place)
        self._tiers.append([])  # the spilled: too loaded to be preferred, tried last
        self._tier = 0
        self._taken: list[EdgeView] = []
        self._members: set[int] | None = None
        self._settled = False
        self._spec = spec
        self._k = k
        self._able = able
        self._spill_at = spill_at

    @staticmethod
    def _pop(left: list[EdgeView], i: int) -> EdgeView:
        v = left[i]
        left[i] = left[-1]  # (the order of those left does not matter: they are sampled)
        left.pop()
        return v

    def _best_of_k(self, left: list[EdgeView]) -> int | None:
        """The index of the least loaded of k able edges drawn from `left` (the unable ones
        drawn meanwhile are dropped from it); None when it has no able edge."""
        while left:
            sample = random.sample(range(len(left)), min(self._k, len(left)))
            unable = sorted((i for i in sample if not self._able(left[i])), reverse=True)
            if not unable:
                return min(sample, key=lambda i: left[i].load(self._spec))
            for i in unable:  # (highest first: a swap from the end never moves a later one)
                self._pop(left, i)
        return None

    def _draw(self) -> bool:
        tiers = self._tiers
        while self._tier < len(tiers):
            left = tiers[self._tier]
            best = self._best_of_k(left)
            if best is None:
                self._tier += 1
                continue
            v = self._pop(left, best)
            if self._tier < len(tiers) - 1 and v.load(self._spec) >= self._spill_at:
                tiers[-1].append(v)
                continue
            self._taken.append(v)
            return True
        return False

    def _settle(self) -> None:
        """Drop every unable edge not drawn yet (len and `in` are then exact)."""
        if not self._settled:
            for t in self._tiers[self._tier :]:
                t[:] = [v for v in t if self._able(v)]
            self._settled = True

    def __len__(self) -> int:
        self._settle()
        return len(self._taken) + sum(len(t) for t in self._tiers[self._tier :])

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
            self._settle()
            self._members = {id(x) for t in (self._taken, *self._tiers[self._tier :]) for x in t}
        return id(v) in self._members

    def __repr__(self) -> str:
        return f"Candidates({[v.api.name for v in self]})"


@dataclass
class _Tiers:
    """One (backend, image)'s edges for `Candidates`, made from the statuses of one poll."""

    tiers: list[list[EdgeView]]
    made: int  # the directory's generation it was made at
    used_at: float  # (monotonic) keys not asked for a while are not remade at every poll


LostHook = Callable[[EdgeAPI], Awaitable[None]]


class EdgeDirectory:
    def __init__(
        self,
        *,
        poll_interval_s: float = 1.0,
        k: int = 2,
        lost_after_s: float = LOST_AFTER_S,
        spill_at: float = SPILL_AT,
    ) -> None:
        self.views: dict[str, EdgeView] = {}
        self.poll_interval_s = poll_interval_s
        self.lost_after_s = lost_after_s
        self.k = k
        self.spill_at = spill_at
        # The placement index: (backend, image) -> tiers, remade once per poll (not per create)
        self._index: dict[tuple[str, str], _Tiers] = {}
        self._generation = 0  # bumped when a status or the set of edges changes outside a poll
        # What the edges told of each image's layers (name -> (refs, when learned)): edges
        # that hold more of them are preferred when none holds the image (see candidates)
        self.image_layers: dict[str, tuple[frozenset[str], float]] = {}
        self._layer_sets: dict[int, tuple[EdgeStatus, frozenset[str], frozenset[str]]] = {}
        # An image's layers as the registry's manifest names them (None: it lacks the image),
        # for images no edge holds (see learn_from_registry); None: no registry is known
        self.registry_layers: Callable[[str], Awaitable[frozenset[str] | None]] | None = None
        self._from_registry: dict[str, tuple[frozenset[str], float]] = {}  # (like image_layers)
        self._reading: dict[str, asyncio.Future[None]] = {}
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
        self.views[api.name] = view = EdgeView(api, lost_after_s=self.lost_after_s, changed=self._changed)
        self._changed()
        return view

    def _changed(self) -> None:
        self._generation += 1

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
                view._status = await wait_for(view.api.status(), timeout)  # (indexed below)
                view.last_ok = time.monotonic()
                view.failures = 0
                view.recent.clear()
            except Exception as e:  # an unreachable edge is just unhealthy
                view.failures += 1
                log.debug("edge %s status failed: %s", view.api.name, e)
            await self._judge(view)

        await asyncio.gather(*(one(v) for v in list(self.views.values())))
        await self._learn_image_layers()
        self._reindex()

    async def _judge(self, view: EdgeView) -> None:
        """Give a silent edge up, or take a given-up one back (see the module)."""
        if not view.can_be_lost:
            return
        answered = view.failures == 0 and view.last_ok > 0
        if time.monotonic() < self.stalled_until:
            return  # this process could not listen (see _watch_lag): silence proves nothing
        if not view.lost and not answered and view.silent_for() >= self.lost_after_s:
            log.warning("edge %s has not answered for %.1f s: given up", view.api.name, view.silent_for())
            # its sandboxes are recorded lost before any call hears so
            if not await _hook(self.on_lost, view, "giving up edge %s failed; retried at the next poll"):
                return
            view.lost = True
            view.gone.set()
        elif view.lost and answered:
            if not await _hook(self.on_back, view, "taking edge %s back failed; retried at the next poll"):
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
                self._changed()  # (healthy again: back in the index)

    async def close(self) -> None:
        for task in (self._task, self._lag, *self._reading.values()):
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
        """Edges to try, best first: those that hold the image, then (edges with a registry,
        which pull what they lack at create) those that hold more of its layers before those
        that hold fewer; within a tier, power of k choices. Read from the index made at the
        last poll: a create does not scan every edge."""
        key = (spec.backend, spec.image)
        entry = self._index.get(key)
        if entry is None or entry.made != self._generation:
            entry = self._index[key] = self._tiers(*key)
        entry.used_at = time.monotonic()
        c = Candidates(entry.tiers, spec, self.k, self._able, self.spill_at)
        if not c._draw():  # (the first is nearly always the pick: drawn now)
            self._refuse(spec)
        return c

    def _able(self, v: EdgeView) -> bool:
        """Whether an indexed edge takes a placement now (its health expires between polls)."""
        return v.healthy and not v.draining and self.views.get(v.api.name) is v

    def _sets(self, s: EdgeStatus) -> tuple[frozenset[str], frozenset[str]]:
        """A status's images and layers as sets, made once per status."""
        got = self._layer_sets.get(id(s))
        if got is None or got[0] is not s:
            got = self._layer_sets[id(s)] = (s, frozenset(s.images), frozenset(s.layers))
        return got[1], got[2]

    def _tiers(self, backend: str, image: str) -> _Tiers:
        """The index entry of (backend, image): edges able at the last poll, in tiers (see
        candidates). Edges that have not answered are left out; draining ones are kept (a
        drain is lifted between polls) and skipped when drawn."""
        layers = self.image_layers.get(image, (frozenset(), 0.0))[0]
        if not layers:
            layers = self._from_registry.get(image, (frozenset(), 0.0))[0]
        holders: list[EdgeView] = []
        by_share: dict[int, list[EdgeView]] = {}
        for v in self.views.values():
            s = v.status
            if s is None or not v.healthy or backend not in s.backends:
                continue
            images, held = self._sets(s)
            if image in images:
                holders.append(v)
            elif s.registry:  # (it pulls what it lacks at create)
                by_share.setdefault(len(layers & held) if layers else 0, []).append(v)
        tiers = [holders] + [by_share[n] for n in sorted(by_share, reverse=True)]
        return _Tiers([t for t in tiers if t], self._generation, time.monotonic())

    def _reindex(self, keep_s: float = 60.0) -> None:
        """Remake the index from this poll's statuses: the keys asked for lately now, the
        rest when next asked."""
        self._generation += 1
        now = time.monotonic()
        live = {id(v.status) for v in self.views.values() if v.status is not None}
        self._layer_sets = {k: x for k, x in self._layer_sets.items() if k in live}
        for key, entry in list(self._index.items()):
            if now - entry.used_at > keep_s:
                del self._index[key]
            else:
                fresh = self._tiers(*key)
                fresh.used_at = entry.used_at
                self._index[key] = fresh

    async def _learn_image_layers(self, ttl_s: float = 60.0) -> None:
        """Learn the layers of images the edges hold (and relearn them after `ttl_s`: a name
        may be rebuilt), asking one edge that holds each: once per image, not per poll, all at
        once and briefly (the poll's verdicts wait for it)."""
        now = time.monotonic()
        ask: dict[int, tuple[EdgeView, list[str]]] = {}
        for v in self.views.values():
            s = v.status
            if s is None or v.lost or v.failures:
                continue
            for name in s.images:
                known = self.image_layers.get(name)
                if known is None or now - known[1] > ttl_s:
                    self.image_layers[name] = (known[0] if known else frozenset(), now)  # (asked now)
                    ask.setdefault(id(v), (v, []))[1].append(name)

        async def one(v: EdgeView, names: list[str]) -> None:
            try:
                images = await wait_for(v.api.images(), min(1.0, self.lost_after_s / 3))
            except Exception as e:  # (not known: no layer preference for it until next time)
                log.debug("edge %s images failed: %s", v.api.name, e)
                return
            for i in images:
                if i.get("name") in names:
                    self.image_layers[str(i["name"])] = (frozenset(str(r) for r in i.get("layers", ())), now)

        await asyncio.gather(*(one(v, names) for v, names in ask.values()))

    async def learn_from_registry(self, image: str, *, ttl_s: float = 60.0, wait_s: float = 1.0) -> None:
        """Before placing `image`: when no edge has told its layers (none holds it) and the
        registry's manifest was not read in the last `ttl_s`, read it, so that edges holding
        more of its layers come first (an image built on a base they hold). Concurrent creates
        share one read and wait at most `wait_s` for it; a registry that fails, is slow or
        lacks the image leaves no preference (the edge's pull says what is wrong)."""
        if self.registry_layers is None or self.image_layers.get(image, ((), 0.0))[0]:
            return
        known = self._from_registry.get(image)
        if known is not None and time.monotonic() - known[1] < ttl_s:
            return
        reading = self._reading.get(image)
        if reading is None:
            reading = self._reading[image] = asyncio.ensure_future(self._read_layers(image))
            reading.add_done_callback(lambda _: self._reading.pop(image, None))
        await asyncio.wait({reading}, timeout=wait_s)  # (not cancelled: a later create has it)

    async def _read_layers(self, image: str, keep: int = 4096) -> None:
        assert self.registry_layers is not None
        try:
            layers = await self.registry_layers(image) or frozenset()
        except Exception as e:
            log.debug("the registry's layers of image %r could not be read: %s", image, e)
            layers = frozenset()
        if len(self._from_registry) >= keep:  # (names come from callers: bounded)
            self._from_registry.clear()
        self._from_registry[image] = (layers, time.monotonic())
        if layers:
            self._changed()  # (the index is remade with them)

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


async def _hook(fn: LostHook | None, view: EdgeView, failed: str) -> bool:
    """Run an edge-lost/back hook; False (logged) if it failed: the next poll tries again."""
    if fn is not None:
        try:
            await fn(view.api)
        except Exception:
            log.exception(failed, view.api.name)
            return False
    return True
