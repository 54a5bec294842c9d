"""Routes of sandboxes and their state: create (one and batches), exec and files through the
shared per-sandbox routes, snapshots, forks, checkpoints, stop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Query, Request, Response

from dsec import errors
from dsec.apiserver.app.charges import (
    ChargedCopy,
    copy_bound_mb,
    disk_key,
    fork_copies_mb,
    mib,
    own_disks,
)
from dsec.apiserver.app.control import _place
from dsec.apiserver.app.state import ApiServerState, _PrincipalFn, respond_then
from dsec.edgeapi import EdgeAPI, edge_of
from dsec.http.routes import (
    Express,
    model_response,
)
from dsec.iam import IAM, Principal
from dsec.models import (
    IDEMPOTENCY_LABEL,
    PLATFORM_LABEL_PREFIX,
    BatchCreate,
    BatchStop,
    Checkpoint,
    CheckpointRequest,
    ForkRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
    ShippedBatch,
    SnapshotInfo,
    SnapshotRequest,
    Trajectory,
)

log = logging.getLogger("dsec.apiserver")

IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _check_user_labels(labels: dict[str, str]) -> None:
    """Refuse label keys of the platform's (PLATFORM_LABEL_PREFIX) in what a user sends: a
    planted `dsec.idempotency` could be adopted by another's create taken over."""
    if not labels:
        return
    reserved = sorted(k for k in labels if k.startswith(PLATFORM_LABEL_PREFIX))
    if reserved:
        raise errors.InvalidRequest(
            f"label {reserved[0]!r} is reserved: keys starting with {PLATFORM_LABEL_PREFIX!r} are set by "
            "dsec; rename it",
            reason="reserved_label",
            labels=reserved,
        )


class _Keyed:
    """A create under an idempotency key: whose key, and whether its end (the answer kept for
    retries) was written with the create's rekey (one transaction)."""

    def __init__(self, principal: str, key: str) -> None:
        self.principal, self.key = principal, key
        self.ended = False


_Make = Callable[[SandboxSpec, "str | None", "_Keyed | None"], Awaitable[SandboxInfo]]


async def _create_once(
    st: ApiServerState, p: Principal, spec: SandboxSpec, key: str, make: _Make
) -> SandboxInfo:
    """A create with an idempotency key: one sandbox however often it is sent, to whichever
    apiserver (a client failing over, a retry after a lost response). The key is the
    caller's own (kept per principal, a day); what it made carries its label, so a create
    whose apiserver died mid-way is found rather than made twice.

    The claim of the key and the create's pending reservation are one IAM transaction, and
    so are the reservation's rekey and the key's end (`make` is given both): two commits a
    create rather than four."""
    iam = st.iam
    if not IDEMPOTENCY_KEY.fullmatch(key):
        raise errors.InvalidRequest(
            "Idempotency-Key must be 1-128 letters, digits, '.', '_' or '-' (a UUID, say)"
        )
    iam.check_create(p, spec.project, spec.backend)  # (before the claim: a refusal leaves nothing to undo)
    label = hashlib.sha256(f"{p.id}:{key}".encode()).hexdigest()[:32]
    pending = f"pending-{secrets.token_hex(8)}"
    deadline = time.monotonic() + 120
    while True:
        try:
            state, result = iam.begin_idempotent(
                p.id, key, reserve=(pending, spec.project, spec.cpu, spec.memory_mb)
            )
        except errors.QuotaExceeded:  # (neither the claim nor the reservation was made)
            st.metrics.failures.labels("create", "quota").inc()
            raise
        except errors.Unavailable:  # (its commit may have landed before the database went away)
            iam.abandon(pending)
            iam.end_idempotent(p.id, key, None, defer=True)
            raise
        if state == "done":
            return SandboxInfo.model_validate_json(result or "{}")
        if state != "busy":
            break
        if time.monotonic() > deadline:
            raise errors.Conflict(f"a create with Idempotency-Key {key!r} is still in progress; retry")
        await asyncio.sleep(0.1)  # the first call is still making it: its answer is ours
    keyed = _Keyed(p.id, key)
    try:
        info = None
        if state == "taken_over":  # its first apiserver died: did it make the sandbox?
            lists = await asyncio.gather(
                *(e.list({IDEMPOTENCY_LABEL: label}, None, None) for e in st.directory.all()),
                return_exceptions=True,
            )
            # (the label is the platform's: users cannot set it; forks and restores drop it)
            found = [
                i
                for lst in lists
                if isinstance(lst, list)
                for i in lst
                if i.spec.project == spec.project and i.spec.labels.get(IDEMPOTENCY_LABEL) == label
            ]
            if found:
                info = found[0]
                iam.reserve(info.id, info.spec.project, info.spec.cpu, info.spec.memory_mb)
        if info is None:
            labelled = spec.model_copy(update={"labels": {**spec.labels, IDEMPOTENCY_LABEL: label}})
            info = await make(labelled, pending if state == "new" else None, keyed)
    except BaseException:
        if not keyed.ended:
            iam.end_idempotent(p.id, key, None, defer=True)
        raise
    if not keyed.ended:
        iam.end_idempotent(p.id, key, info.model_dump_json(), defer=True)
    return info


def _reserve_pending(st: ApiServerState, spec: SandboxSpec) -> str:
    """Reserve a create's quota under a pending key of this process; the key."""
    key = f"pending-{secrets.token_hex(8)}"
    try:
        st.iam.reserve(key, spec.project, spec.cpu, spec.memory_mb, pending=True)
    except errors.QuotaExceeded:
        st.metrics.failures.labels("create", "quota").inc()
        raise
    except errors.Unavailable:
        st.iam.abandon(key)  # (its commit may have landed before the database went away)
        raise
    return key


def _release_or_abandon(iam: IAM, key: str) -> None:
    """Give a failed create's pending reservation back, or (the database is away) leave it to
    the reconciler (`IAM.abandon`)."""
    try:
        iam.release(key)
    except errors.DsecError:
        iam.abandon(key)


async def _account_create(
    st: ApiServerState, key: str, info: SandboxInfo, keyed: _Keyed | None = None
) -> None:
    """Move a create's pending reservation to the sandbox it made (and end its idempotency
    key with its answer, same transaction). When that cannot be done (the IAM's database is
    away) the sandbox goes again, so nothing runs unaccounted, and its reservation is
    released once the database is back."""
    ends = None if keyed is None else (keyed.principal, keyed.key, info.model_dump_json())
    try:
        st.iam.rekey(key, info.id, ends=ends)
    except BaseException:
        st.iam.abandon(key)
        with contextlib.suppress(Exception):
            await st.directory.edge_for(info.id, None).stop(info.id, None)
        raise
    if keyed is not None:
        keyed.ended = True


def _install_sandbox_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, express: Express
) -> None:
    """Create and list sandboxes."""
    iam, directory = st.iam, st.directory

    # --- sandboxes -------------------------------------------------------------------

    async def create_one(
        p: Principal,
        spec: SandboxSpec,
        t_auth: float,
        reserved: str | None = None,
        keyed: _Keyed | None = None,
    ) -> SandboxInfo:
        """`reserved`: the pending reservation already made (with an idempotency key's claim,
        after the same checks); `keyed`: that key, ended with the reservation's rekey."""
        if reserved is None:
            iam.check_create(p, spec.project, spec.backend)  # the tier policy applies to admins too
        key = reserved or _reserve_pending(st, spec)
        t_place = time.perf_counter()
        try:
            info = await _place(st, spec)
        except BaseException as e:
            _release_or_abandon(iam, key)
            reason = e.code if isinstance(e, errors.DsecError) else "internal"
            st.metrics.failures.labels("create", reason).inc()
            raise
        await _account_create(st, key, info, keyed)
        m = st.metrics.create_phase
        m.labels("auth").observe(t_auth)
        m.labels("placement").observe(time.perf_counter() - t_place - info.timings_ms.get("total", 0) / 1000)
        for phase in ("layer_preparation", "runtime_start", "ready", "pool"):
            if phase in info.timings_ms:
                m.labels(phase).observe(info.timings_ms[phase] / 1000)
        st.events.publish("created", id=info.id, edge=info.edge, image=spec.image, project=spec.project)
        return info

    @app.post("/v1/sandboxes", response_model=SandboxInfo, status_code=201)
    async def create(spec: SandboxSpec, request: Request) -> Response:
        t0 = time.perf_counter()
        p = principal(request)
        t_auth = time.perf_counter() - t0
        _check_user_labels(spec.labels)
        key = request.headers.get("idempotency-key")  # (then: one sandbox however often sent)
        made = _create_once(st, p, spec, key, lambda s, r, k: create_one(p, s, t_auth, r, k)) if key else None
        return model_response(await (made or create_one(p, spec, t_auth)), 201)

    express.derive(app.routes, create)

    @app.post("/v1/sandboxes/batch")
    async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        p = principal(request)
        iam.authorize(p, body.spec.project)
        _check_user_labels(body.spec.labels)
        t_auth = time.perf_counter() - t0
        results = await asyncio.gather(
            *(create_one(p, body.spec, t_auth) for _ in range(body.count)), return_exceptions=True
        )
        ok = [r for r in results if isinstance(r, SandboxInfo)]
        errs = [r for r in results if not isinstance(r, SandboxInfo)]
        for e in errs:
            if not isinstance(e, errors.DsecError):
                raise e
        return {
            "sandboxes": [i.model_dump(mode="json") for i in ok],
            "errors": [e.to_wire()["error"] for e in errs if isinstance(e, errors.DsecError)],
        }

    @app.get("/v1/sandboxes")
    async def list_(
        request: Request, project: str | None = None, label: list[str] = Query(default=[])
    ) -> dict[str, Any]:
        p = principal(request)
        if project is not None:
            iam.authorize(p, project)
        labels = {}
        for x in label:
            k, sep, v = x.partition("=")
            if not sep:
                raise errors.InvalidRequest(f"label filter {x!r} must look like key=value")
            labels[k] = v
        scope = iam.visible_projects(p)
        lists = await asyncio.gather(
            *(e.list(labels, project, scope) for e in directory.all()), return_exceptions=True
        )
        out = [i.model_dump(mode="json") for lst in lists if isinstance(lst, list) for i in lst]
        return {"sandboxes": out}


def _install_state_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """Fork (quota-checked like creates), pausing a project, snapshots."""
    iam, directory = st.iam, st.directory

    @app.post("/v1/sandboxes/{sid}/fork", status_code=201)
    async def fork(sid: str, body: ForkRequest, request: Request) -> dict[str, Any]:
        p = principal(request)
        scope = iam.visible_projects(p)
        edge = directory.edge_for(sid, scope)
        source = await edge.get(sid, scope)
        spec = source.spec
        iam.check_backend(spec.project, spec.backend)  # the policy may have narrowed since
        keys = [f"pending-{secrets.token_hex(8)}" for _ in range(body.n)]
        reserved: list[str] = []
        try:
            for key in keys:
                iam.reserve(key, spec.project, spec.cpu, spec.memory_mb, pending=True)
                reserved.append(key)
            # The fork layer (a microVM: each child's copy of the disk) counts like a snapshot,
            # and as memory (it lives on the edge's run tmpfs): what it should take, or what
            # the quotas have left, is its cap (charges.py).
            want, copies = fork_copies_mb(source, body.n)
            layer = ChargedCopy(
                iam, spec.project, want, in_ram=True, asked=body.max_layer_bytes, copies=copies
            )
            infos = await layer.run(
                lambda cap: edge.fork(sid, body.model_copy(update={"max_layer_bytes": cap}), scope)
            )
        except BaseException:
            for key in reserved:
                _release_or_abandon(iam, key)
            raise
        for key, info in zip(keys, infos, strict=True):
            await _account_create(st, key, info)
        await _charge_fork_layer(iam, edge, scope, layer, infos)
        for info in infos:
            st.events.publish(
                "created",
                id=info.id,
                edge=info.edge,
                image=info.spec.image,
                project=info.spec.project,
                fork_of=sid,
            )
        return {"sandboxes": [i.model_dump(mode="json") for i in infos]}

    @app.post("/v1/projects/{project}/pause")
    async def pause_project(project: str, request: Request) -> dict[str, Any]:
        """Pause every sandbox of a project on every edge (a preempted job): one call."""
        iam.authorize(principal(request), project)
        results = await asyncio.gather(*(e.pause_project(project) for e in directory.all()))
        paused = [sid for r in results for sid in r]
        st.events.publish("project_paused", project=project, count=len(paused))
        return {"paused": paused}

    @app.get("/v1/snapshots")
    async def snapshots(request: Request) -> dict[str, Any]:
        scope = iam.visible_projects(principal(request))
        out = []
        for e in directory.all():
            with contextlib.suppress(errors.DsecError):
                out += [{**x, "edge": e.name} for x in await e.snapshots(scope)]
        return {"snapshots": out}

    @app.delete("/v1/snapshots/{name}", status_code=204)
    async def delete_snapshot(name: str, request: Request) -> Response:
        scope = iam.visible_projects(principal(request))
        deleted = False
        for e in directory.all():  # every copy (pulled ones included)
            with contextlib.suppress(errors.ImageNotFound):
                await e.delete_snapshot(name, scope)
                deleted = True
        if deleted:
            iam.release_snapshot(name)
        if not deleted:
            raise errors.ImageNotFound(f"there is no snapshot {name!r}")
        return Response(status_code=204)


async def _charge_fork_layer(
    iam: IAM, edge: EdgeAPI, scope: set[str] | None, pending: ChargedCopy, infos: list[SandboxInfo]
) -> None:
    """Move a fork's pending reservation to its layer (``fork:<layer id>``, released by the
    reconciler once no edge reports the layer) at the size the edge copied, or to each child's
    copy of a microVM's disk (``disk:<child id>``, released when the child is stopped); if
    that is over the quota, the children are stopped (which frees the layer) and the fork is
    refused."""
    layer = infos[0].fork_layer if infos else None
    if layer is None:  # an edge that reports no copy: nothing to vouch for it
        pending.release()
        return

    async def undo() -> None:
        await asyncio.gather(*(edge.stop(i.id, scope) for i in infos), return_exceptions=True)
        for i in infos:
            iam.release(i.id)

    if not own_disks(infos[0].spec):
        await pending.settle(f"fork:{layer.id}", layer.size_bytes, undo)
        return
    sizes = {disk_key(i.id): mib(i.fork_layer.size_bytes if i.fork_layer else 0) for i in infos}
    await pending.settle_each(sizes, undo)


def _install_snapshot_route(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """Snapshots and checkpoints count against their project's quota (max_snapshots,
    max_snapshot_mb): a slot and what is left, up to the copy's bound, before the copy (its
    cap on the edge), the real size once it is known (charges.py)."""
    iam, directory = st.iam, st.directory

    @app.post("/v1/sandboxes/{sid}/snapshot", response_model=SnapshotInfo, status_code=201)
    async def snapshot(sid: str, body: SnapshotRequest, request: Request) -> Response:
        p = principal(request)
        scope = iam.visible_projects(p)
        edge = directory.edge_for(sid, scope)
        spec = (await edge.get(sid, scope)).spec
        copy = ChargedCopy(iam, spec.project, copy_bound_mb(spec), asked=body.max_bytes)
        info = await copy.run(
            lambda cap: edge.snapshot(sid, body.model_copy(update={"max_bytes": cap}), scope)
        )
        await copy.settle(info.id, info.size_bytes, lambda: edge.delete_snapshot(info.id, scope))
        return model_response(info, 201)

    @app.post("/v1/sandboxes/{sid}/checkpoint", response_model=Checkpoint, status_code=201)
    async def checkpoint(sid: str, request: Request, body: CheckpointRequest | None = None) -> Response:
        """A memory checkpoint (its images and its copy of the files) counts like a snapshot
        (at least 1 MiB): its bound is its memory and its files."""
        scope = iam.visible_projects(principal(request))
        edge = directory.edge_for(sid, scope)
        spec = (await edge.get(sid, scope)).spec
        req = body or CheckpointRequest()
        copy = ChargedCopy(iam, spec.project, copy_bound_mb(spec, memory=True), asked=req.max_bytes)
        info = await copy.run(
            lambda cap: edge.checkpoint(sid, req.model_copy(update={"max_bytes": cap}), scope)
        )
        await copy.settle(info.id, info.size_bytes, lambda: edge.delete_checkpoint(info.id, scope), min_mb=1)
        return model_response(info, 201)


def _install_checkpoint_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """Memory checkpoints: list, restore (into a new sandbox: admitted like a create), delete.
    Taking one is a per-sandbox route (routes.py); checkpoint ids name their edge like sandbox ids."""
    iam, directory = st.iam, st.directory

    def edge_for(cid: str, scope: set[str] | None) -> EdgeAPI:
        try:
            return directory.edge_for(cid, scope)
        except errors.SandboxNotFound:
            raise errors.CheckpointNotFound(
                f"there is no checkpoint {cid} (ids look like <edge>-ckpt-<12 hex digits>; "
                "GET /v1/checkpoints lists yours)"
            ) from None

    @app.get("/v1/checkpoints")
    async def checkpoints(request: Request) -> dict[str, Any]:
        scope = iam.visible_projects(principal(request))
        lists = await asyncio.gather(*(e.checkpoints(scope) for e in directory.all()), return_exceptions=True)
        return {
            "checkpoints": [c.model_dump(mode="json") for lst in lists if isinstance(lst, list) for c in lst]
        }

    @app.post("/v1/checkpoints/{cid}/restore", response_model=SandboxInfo, status_code=201)
    async def restore(cid: str, body: RestoreRequest, request: Request) -> Response:
        """Restore into a new sandbox (admitted like a create) or into a running one."""
        p = principal(request)
        _check_user_labels(body.labels)
        scope = iam.visible_projects(p)
        edge = edge_for(cid, scope)
        if body.sandbox_id is not None:
            if edge_of(body.sandbox_id) != edge.name:
                raise errors.InvalidRequest(
                    f"checkpoint {cid} lives on edge {edge.name}; restore it into a sandbox of that edge "
                    "or into a new sandbox"
                )
            return model_response(await edge.restore(cid, body, scope), 201)
        ck = next((c for c in await edge.checkpoints(scope) if c.id == cid), None)
        if ck is None:
            raise errors.CheckpointNotFound(f"there is no checkpoint {cid} in your projects")
        iam.check_backend(ck.project, ck.backend)
        key = f"pending-{secrets.token_hex(8)}"
        iam.reserve(key, ck.project, ck.cpu, ck.memory_mb, pending=True)
        try:
            info = await edge.restore(cid, body, scope)
        except BaseException:
            _release_or_abandon(iam, key)
            raise
        await _account_create(st, key, info)
        st.events.publish(
            "created",
            id=info.id,
            edge=info.edge,
            image=info.spec.image,
            project=ck.project,
            restored_from=cid,
        )
        return model_response(info, 201)

    @app.delete("/v1/checkpoints/{cid}", status_code=204)
    async def delete_checkpoint(cid: str, request: Request) -> Response:
        scope = iam.visible_projects(principal(request))
        await edge_for(cid, scope).delete_checkpoint(cid, scope)
        iam.release_snapshot(cid)  # its share of the project's snapshot quota
        return Response(status_code=204)


def _install_sandbox_stop_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, express: Express
) -> None:
    """Stop one or many sandboxes."""
    iam, directory = st.iam, st.directory

    async def stop_one(p: Principal, sid: str, after: list[Callable[[], None]] | None = None) -> None:
        scope = iam.visible_projects(p)
        edge = directory.edge_for(sid, scope)
        await edge.stop(sid, scope)

        def account() -> None:
            try:
                project = iam.release(sid)
            except errors.DsecError:  # the database is away: released once it is back
                iam.abandon(sid)
                project = None
            with contextlib.suppress(errors.DsecError):  # (else by the reconciler)
                iam.release_snapshot(disk_key(sid))  # its copy of a microVM parent's disk, if any
            st.events.publish("stopped", id=sid, edge=edge.name, project=project)

        if after is None:
            account()
        else:
            after.append(account)

    @app.delete("/v1/sandboxes/{sid}", status_code=204)
    async def stop(sid: str, request: Request) -> Response:
        after: list[Callable[[], None]] = []
        await stop_one(principal(request), sid, after)
        return respond_then(Response(status_code=204), after)

    express.derive(app.routes, stop)

    @app.post("/v1/sandboxes/batch_stop")
    async def batch_stop(body: BatchStop, request: Request) -> dict[str, Any]:
        p = principal(request)
        results = await asyncio.gather(*(stop_one(p, sid) for sid in body.ids), return_exceptions=True)
        stopped = [sid for sid, r in zip(body.ids, results, strict=True) if r is None]
        failed = {
            sid: (
                r.to_wire()["error"]
                if isinstance(r, errors.DsecError)
                else {"code": "internal", "message": str(r)}
            )
            for sid, r in zip(body.ids, results, strict=True)
            if r is not None
        }
        return {"stopped": stopped, "errors": failed}


def _install_trajectory_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """A sandbox's trajectory log outlives its edge: edges ship it here (dsec.edge.shipper),
    and once the edge is lost the log is answered from what was shipped. Installed before
    the shared sandbox router, whose trajectory route it stands in for."""
    iam, directory = st.iam, st.directory

    @app.post("/v1/edges/trajectories")
    async def ship(body: ShippedBatch) -> dict[str, Any]:
        # the gate checked the cluster token; an edge ships its own sandboxes' logs only
        for row in body.rows:
            if len(row) != 12 or not isinstance(row[0], str) or edge_of(row[0]) != body.edge:
                raise errors.InvalidRequest(
                    f"edge {body.edge} shipped a row that is not one of its sandboxes' log entries"
                )
        new = iam.store_trajectories(body.edge, body.rows, body.stats)
        return {"stored": new}

    @app.get("/v1/sandboxes/{sid}/trajectory", response_model=Trajectory)
    async def trajectory(
        sid: str,
        request: Request,
        after_seq: int = Query(0, ge=0, le=2**63 - 1),
        limit: int | None = Query(None, ge=1, le=1_000_000),
    ) -> Any:
        scope = iam.visible_projects(principal(request))
        try:
            return await directory.edge_for(sid, scope).trajectory(sid, after_seq, limit, scope)
        except (errors.SandboxLost, errors.SandboxNotFound):
            project = iam.lost_project(sid)
            got = None if project is None else iam.shipped_trajectory(sid, after_seq=after_seq, limit=limit)
            if got is None or (scope is not None and project not in scope):
                raise
        entries, info = got
        last = max(int(info["acknowledged"]), int(info["shipped_seq"]))
        missing = last - int(info["shipped_seq"])
        return {
            "entries": entries,
            "stats": {
                "acknowledged": last,
                "recorded": info["recorded"],
                "lost": int(info["lost"]) + missing,
                "pending": 0,
            },
            "source": "control-plane",
            "shipped": {
                "edge": info["edge"],
                "shipped_seq": info["shipped_seq"],
                "last_known_seq": last,
                "shipped_at": info["shipped_at"],
                "note": (
                    f"edge {info['edge']} was lost: this is its log as shipped up to seq "
                    f"{info['shipped_seq']}; "
                    f"{missing} later operation(s) it had acknowledged are missing, and any after its "
                    "last shipment (about a second of work) may be"
                ),
            },
        }
