"""Placement over the edges and the loops that keep quota reservations and fork layers
true."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from dsec import errors
from dsec.apiserver.app.charges import disk_key
from dsec.apiserver.app.state import ApiServerState
from dsec.apiserver.placement import EdgeView
from dsec.apiserver.tenancy import (
    Visibility,
)
from dsec.edgeapi import EdgeAPI, edge_of
from dsec.iam import IAM
from dsec.models import (
    EdgeStatus,
    SandboxInfo,
    SandboxSpec,
)

log = logging.getLogger("dsec.apiserver")


async def _visibility(st: ApiServerState, scope: set[str] | None) -> Visibility:
    """What `scope` may see of the edges' images and layers (admins, scope None: everything)."""
    if scope is None:
        return Visibility(None, [], [])
    images: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    for e in st.directory.all():
        with contextlib.suppress(errors.DsecError):
            images += await e.images()
            snapshots += await e.snapshots(None)
    return Visibility(scope, images, snapshots)


async def _candidates(st: ApiServerState, spec: SandboxSpec) -> Sequence[EdgeView]:
    await st.directory.learn_from_registry(spec.image)  # (at once when edges told its layers)
    try:
        return st.directory.candidates(spec)
    except errors.ImageNotFound:
        # An image made a moment ago (a snapshot, an import) may not be in the watcher's
        # view yet: look again once before saying it does not exist.
        await st.directory.poll_once()
        return st.directory.candidates(spec)


async def _place(st: ApiServerState, spec: SandboxSpec) -> SandboxInfo:
    last: errors.DsecError | None = None
    holders = await _candidates(st, spec)
    for view in holders:
        st.directory.note_placed(view)
        try:
            return await view.api.create(spec)
        except (errors.CapacityExhausted, errors.Unavailable) as e:
            last = e  # the edge has the final say: try the next candidate
    # Every edge holding the image is full: another one with a registry, least loaded first,
    # pulls it at create (a snapshot made on one edge restores on any). An edge without a
    # registry gets no image from here: images travel only through the registry.
    others = sorted(
        (
            v
            for v in st.directory.views.values()
            if v.healthy
            and not v.draining
            and v not in holders
            and v.status is not None
            and v.status.registry
            and spec.backend in v.status.backends
        ),
        key=lambda v: v.load(spec),
    )
    for view in others:
        try:
            st.directory.note_placed(view)
            return await view.api.create(spec)
        except (errors.CapacityExhausted, errors.Unavailable) as e:
            last = e
    raise errors.CapacityExhausted(f"every edge that has image {spec.image!r} is full; retry later") from last


def _refresh_gauges(st: ApiServerState) -> None:
    m = st.metrics
    m.live.clear()
    healthy = 0
    for v in st.directory.views.values():
        s: EdgeStatus | None = v.status
        if s is None:
            continue
        healthy += int(v.healthy)
        m.pool_ready.labels(s.name).set(s.used.get("pooled", 0))
        for image, n in s.by_image.items():
            m.live.labels(s.name, image, "*").set(n)
        for project, n in s.by_project.items():
            m.live.labels(s.name, "*", project).set(n)
    m.edges.set(healthy)


def watch_node_loss(st: ApiServerState) -> None:
    """What the watcher does when an edge goes silent and when it answers again (see
    dsec.apiserver.placement): its sandboxes are given up in the IAM (quota released, ids
    remembered as lost), and stopped on it when it is back, so none is counted twice or
    left running unaccounted."""
    directory, iam = st.directory, st.iam

    async def lost(edge: EdgeAPI) -> None:
        given_up = iam.mark_edge_lost(edge.name)
        for sid, project in given_up:
            st.events.publish("lost", id=sid, edge=edge.name, project=project)
        log.warning("edge %s lost: %d sandboxes given up, their quota released", edge.name, len(given_up))

    async def back(edge: EdgeAPI) -> None:
        doomed = iam.lost_on(edge.name)
        if not doomed:
            return
        live = {i.id for i in await edge.list({}, None, None)}
        for sid in sorted(doomed & live):
            with contextlib.suppress(errors.SandboxNotFound):
                await edge.stop(sid, None)
        log.warning(
            "edge %s is back: stopped %d sandboxes given up while it was lost", edge.name, len(doomed & live)
        )

    directory.on_lost = lost
    directory.on_back = back
    directory.lost_project = iam.lost_project


async def _reconcile_quota(
    st: ApiServerState,
    interval_s: float,
    grace_s: float,
    lost_memory_s: float = 86400.0,
    *,
    orphan_after_s: float = 30.0,
) -> None:
    """Release reservations of sandboxes no edge reports any more (TTL reaping, crashes) and
    those of creates whose apiserver died mid-way. A create in flight keeps its reservation
    however long it takes: only its own success (re-keyed to the sandbox) or failure
    (released) ends it. The other way round, stop what edges report that no reservation
    accounts for (`_stop_orphans`)."""
    suspects: dict[str, float] = {}
    while True:
        try:
            st.iam.release_orphaned()
            st.iam.forget_lost(lost_memory_s)
            st.iam.forget_idempotency(lost_memory_s)
            st.iam.forget_trajectories(lost_memory_s)
        except Exception:
            log.exception("releasing the reservations of dead apiservers failed; retrying")
        await asyncio.sleep(interval_s)
        live: dict[str, str] = {}  # sandbox -> its project
        complete = True
        asked_at = time.time()  # a create that completes while the edges answer is not in `live`
        for e in st.directory.all():
            try:
                live.update((i.id, i.spec.project) for i in await e.list({}, None, None))
            except Exception:
                complete = False
        try:
            if complete:
                st.iam.reconcile(set(live), older_than_s=grace_s, as_of=asked_at)
                _reconcile_disks(st.iam, set(live), asked_at, grace_s)
            await _reconcile_fork_layers(st, grace_s)
            await _stop_orphans(st, live, suspects, orphan_after_s)
        except errors.DsecError as e:  # (the IAM's database is away: next round)
            log.warning("reconciling quota failed, retrying in %.0f s: %s", interval_s, e)


def _reconcile_disks(iam: IAM, live: set[str], asked_at: float, grace_s: float) -> list[str]:
    """Release the charge of a microVM fork child's copy of its parent's disk (disk:<id>) once
    the child is gone without a stop through here (the edge's TTL, a crash): `live`, the
    sandboxes the edges listed at `asked_at`; a copy charged later is not a candidate."""
    held = {disk_key(sid) for sid in live}
    older = grace_s + time.time() - asked_at
    return iam.reconcile_snapshots(held, older_than_s=older, prefix=disk_key(""))


async def _stop_orphans(
    st: ApiServerState, live: dict[str, str], suspects: dict[str, float], after_s: float
) -> None:
    """Stop sandboxes the edges report that no reservation has accounted for over `after_s`
    (`suspects`: since when each was first seen so, kept across rounds). They are what a
    create left when its apiserver died after the edge made the sandbox, or when the edge's
    answer never reached it: nobody was told of them and their quota is not counted, so they
    would run unaccounted for ever. An edge lists a sandbox only once its create is done and
    the apiserver accounts for it (re-keys its reservation) right then; a fresh read of the
    IAM just before the stop rules out one accounted for meanwhile."""
    now = time.monotonic()
    unaccounted = st.iam.unaccounted(set(live))
    for sid in list(suspects):
        if sid not in unaccounted:
            del suspects[sid]
    doomed = [sid for sid in unaccounted if now - suspects.setdefault(sid, now) >= after_s]
    if not doomed:
        return
    for sid in sorted(st.iam.unaccounted(set(doomed))):
        suspects.pop(sid, None)
        try:
            await st.directory.edge_for(sid, None).stop(sid, None)
        except errors.DsecError as e:
            log.warning("stopping orphan sandbox %s failed (retried next round): %s", sid, e)
            continue
        log.warning("stopped sandbox %s: no reservation accounted for it for %.0f s (orphan)", sid, after_s)
        st.events.publish("stopped", id=sid, edge=edge_of(sid), project=live[sid], reason="orphan")


async def _reconcile_fork_layers(st: ApiServerState, grace_s: float) -> None:
    """Release the snapshot reservations of fork layers no edge reports any more (their last
    sandbox stopped). Only reservations older than the grace before the edges were asked are
    candidates, so a fork finishing while they are asked is never taken for a leftover."""
    asked = time.time()
    live: set[str] = set()
    for e in st.directory.all():
        try:
            live |= {f"fork:{x}" for x in (await e.status()).fork_layers}
        except Exception:
            return  # an edge that cannot answer may still hold its layers
    try:
        st.iam.reconcile_snapshots(live, older_than_s=grace_s + time.time() - asked, prefix="fork:")
    except Exception:
        log.exception("releasing the reservations of freed fork layers failed; retrying")
