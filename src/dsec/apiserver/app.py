"""The apiserver: the only ingress. Auth, quota admission, placement, forwarding.

Per request: authenticate the bearer token (IAM) -> for a create, reserve quota
atomically under a provisional key, place on an edge (retrying the next
candidate when an edge says it is full), then re-key the reservation to the
sandbox id -> for any other call, route by the edge name inside the sandbox id
and scope it to the caller's projects. No per-sandbox state lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.background import BackgroundTask

from dsec import __version__, errors
from dsec.apiserver.edges import HttpEdge
from dsec.apiserver.placement import EdgeDirectory, EdgeView
from dsec.apiserver.tenancy import (
    ApiServerSettings,
    TenantMetrics,
    Visibility,
    make_guard,
    metrics_scope,
    tenant_edge,
    tenant_layer,
)
from dsec.compat.sandboxfusion import sandboxfusion_router
from dsec.compat.swerex import swerex_router
from dsec.edgeapi import EdgeAPI, edge_of
from dsec.fncall.tenancy import caller_project
from dsec.http.routes import (
    Express,
    Gate,
    Target,
    install_error_handlers,
    model_response,
    sandbox_router,
)
from dsec.iam import IAM, Principal
from dsec.models import (
    BatchCreate,
    BatchStop,
    BuildRequest,
    Checkpoint,
    CheckpointRequest,
    EdgeStatus,
    ExecResult,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    JupyterRequest,
    JupyterResult,
    PoolInfo,
    PoolSpec,
    PrewarmRequest,
    PrincipalCreate,
    ProjectCreate,
    RegisterEdge,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    SnapshotRequest,
)

_PrincipalFn = Callable[[Request], Principal]
log = logging.getLogger("dsec.apiserver")

LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.015, 0.03, 0.06, 0.125, 0.25, 0.5, 1, 2, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.create_phase = Histogram(
            "dsec_create_phase_seconds",
            "Sandbox creation latency by phase",
            ["phase"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.exec_latency = Histogram(
            "dsec_exec_seconds", "Exec round trip inside the apiserver", registry=r, buckets=LATENCY_BUCKETS
        )
        self.failures = Counter(
            "dsec_failures_total", "Failed operations by reason", ["op", "reason"], registry=r
        )
        self.misbehaviour = Counter(
            "dsec_misbehaviour",
            "Limit hits seen in exec results: oom_kills, pids_limit_hits, disk_full, timeouts, "
            "output_truncated (an environment limit, not the task, may explain a reward)",
            ["kind"],
            registry=r,
        )
        self.live = Gauge("dsec_live_sandboxes", "Live sandboxes", ["edge", "image", "project"], registry=r)
        self.pool_ready = Gauge("dsec_pool_ready", "Ready sandboxes in warm pools", ["edge"], registry=r)
        self.edges = Gauge("dsec_edges_healthy", "Healthy edges", registry=r)

    def observe_exec(self, seconds: float, res: ExecResult) -> None:
        self.exec_latency.observe(seconds)
        for kind, n in res.misbehaviour.items():
            self.misbehaviour.labels(kind).inc(n)
        if res.timed_out:
            self.misbehaviour.labels("timeouts").inc()
        if res.truncated:
            self.misbehaviour.labels("output_truncated").inc()


class EventBus:
    """Lifecycle events for SSE subscribers; slow subscribers lose old events, never block creates.
    Each subscriber sees only events of its projects (None: all); an event without a project
    reaches admins only."""

    def __init__(self) -> None:
        self.subscribers: dict[asyncio.Queue[dict[str, Any]], set[str] | None] = {}

    def publish(self, kind: str, **data: Any) -> None:
        event = {"type": kind, "time": time.time(), **data}
        project = data.get("project")
        for q, scope in list(self.subscribers.items()):
            if scope is not None and project not in scope:
                continue
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(event)


@dataclass
class ApiServerState:
    iam: IAM
    directory: EdgeDirectory
    cluster_token: str
    metrics: Metrics
    events: EventBus


def create_api_app(
    *,
    iam: IAM,
    cluster_token: str,
    local_edges: list[EdgeAPI] | None = None,
    remote_edges: dict[str, str] | None = None,
    max_body: int = 160 * 1024 * 1024,
    poll_interval_s: float = 1.0,
    extra_lifespan: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    compat_auth: bool = True,
    settings: ApiServerSettings | None = None,
) -> FastAPI:
    settings = settings or ApiServerSettings()
    directory = EdgeDirectory(poll_interval_s=poll_interval_s)
    for e in local_edges or []:
        directory.add(e)
    for name, url in (remote_edges or {}).items():
        directory.add(HttpEdge(name, url, cluster_token))
    st = ApiServerState(iam, directory, cluster_token, Metrics(), EventBus())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if extra_lifespan is not None:
            await extra_lifespan()
        await directory.poll_once()
        directory.start()
        reconcile = asyncio.create_task(
            _reconcile_quota(st, settings.reconcile_interval_s, settings.reservation_grace_s)
        )
        try:
            yield
        finally:
            reconcile.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reconcile
            if on_shutdown is not None:
                await on_shutdown()
            await directory.close()

    app = FastAPI(
        title="dsec",
        version=__version__,
        lifespan=lifespan,
        description="Elastic sandboxes for agentic RL. See docs/API.md.",
    )
    app.state.dsec = st
    install_error_handlers(app)
    express = Express()
    guard = make_guard(iam, cluster_token, compat_auth=compat_auth, metrics_token=settings.metrics_secret())
    app.add_middleware(Gate, limit=max_body, guard=guard, express=express)

    def principal(request: Request) -> Principal:
        cached = getattr(request.state, "principal", None)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        p = iam.authenticate(token)
        request.state.principal = p
        return p

    def require_admin(request: Request) -> Principal:
        p = principal(request)
        if not p.admin:
            raise errors.Forbidden("this call needs an admin token")
        return p

    async def resolve(request: Request, sid: str) -> Target:
        p = principal(request)
        return Target(directory.edge_for(sid), iam.visible_projects(p))

    app.state.resolve = resolve
    _install_snapshot_route(app, st, principal)  # before the shared router: snapshot/checkpoint quotas

    app.include_router(sandbox_router(st.metrics.observe_exec, express))
    app.include_router(swerex_router())
    _install_fncall_routes(app, st, principal, compat_auth, express)

    _install_public_routes(app, st)
    _install_sandbox_routes(app, st, principal, express)
    _install_sandbox_stop_routes(app, st, principal, express)
    _install_state_routes(app, st, principal)
    _install_checkpoint_routes(app, st, principal)
    _install_image_pool_routes(app, st, principal, require_admin)
    _install_pool_routes(app, st, principal, require_admin)
    _install_edge_routes(app, st, principal)
    _install_iam_routes(app, st, principal, require_admin)

    @app.exception_handler(errors.AuthError)
    async def _auth_error(_: Request, exc: errors.AuthError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.status, headers={"WWW-Authenticate": "Bearer"})

    return app


def _install_fncall_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, compat_auth: bool, express: Express
) -> None:
    """Stateless code runs: the native API and the SandboxFusion-compatible endpoints."""

    async def on_some_edge(image: str, call: Callable[[EdgeAPI], Awaitable[Any]]) -> Any:
        last: errors.DsecError | None = None
        for view in await _candidates(st, SandboxSpec(image=image)):
            try:
                return await call(view.api)
            except (errors.CapacityExhausted, errors.Unavailable) as e:
                last = e
        raise errors.Unavailable(f"no edge could run the call on image {image!r}; retry later") from last

    async def run(req: FnCallRequest) -> FnCallResult:
        result: FnCallResult = await on_some_edge(req.image, lambda e: e.fncall_run(req))
        return result

    async def jupyter(req: JupyterRequest) -> JupyterResult:
        result: JupyterResult = await on_some_edge(req.image, lambda e: e.fncall_jupyter(req))
        return result

    # Workers are per project: the project is always the caller's (never a client's word).
    @app.post("/v1/fncall/run", response_model=FnCallResult)
    async def fncall_run(body: FnCallRequest, request: Request) -> Response:
        project = caller_project(st.iam, principal(request), body.project)
        return model_response(await run(body.model_copy(update={"project": project})))

    express.add("POST", "/v1/fncall/run", fncall_run, FnCallRequest)

    @app.post("/v1/fncall/jupyter", response_model=JupyterResult)
    async def fncall_jupyter(body: JupyterRequest, request: Request) -> Response:
        project = caller_project(st.iam, principal(request), body.project)
        return model_response(await jupyter(body.model_copy(update={"project": project})))

    def authenticate(token: str | None) -> str:
        return caller_project(st.iam, st.iam.authenticate(token), None)

    app.include_router(sandboxfusion_router(run, jupyter, authenticate if compat_auth else None, express))


def _install_public_routes(app: FastAPI, st: ApiServerState) -> None:
    """Health and version: no token needed, nothing about any tenant. Metrics: an admin token
    or the metrics token sees every series; a tenant's token sees none per project and none
    naming another project's snapshot."""
    directory = st.directory

    # --- public, unauthenticated ---------------------------------------------------

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        healthy = sum(1 for v in directory.views.values() if v.healthy)
        return {"status": "ok" if healthy else "degraded", "edges": healthy}

    @app.get("/v1/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        view = metrics_scope(request.scope)  # set by the gate, which authenticated the caller
        _refresh_gauges(st)
        registry: Any = st.metrics.registry
        if view != "all":
            p = request.state.principal
            registry = TenantMetrics(registry, await _visibility(st, st.iam.visible_projects(p)))
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")


def respond_then(response: Response, after: list[Callable[[], None]]) -> Response:
    """Run `after` once the response is written: on this event loop, before it reads the next
    request (the steps are synchronous; nothing yields in between), so a caller that got the
    response and sends its next call still finds them done. Used for a stop's accounting: an
    IAM write costs ~0.25 ms on a CPU just out of idle, and a stop is usually followed by a
    pause, not by another call. (A create that reaches another apiserver within that window
    can find the quota still held: the conservative side.)"""

    async def run() -> None:
        for step in after:
            try:
                step()
            except Exception:
                log.exception("accounting after a response failed")

    response.background = BackgroundTask(run)
    return response


def _install_sandbox_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, express: Express
) -> None:
    """Create and list sandboxes."""
    iam, directory = st.iam, st.directory

    # --- sandboxes -------------------------------------------------------------------

    async def create_one(p: Principal, spec: SandboxSpec, t_auth: float) -> SandboxInfo:
        iam.authorize(p, spec.project)
        key = f"pending-{secrets.token_hex(8)}"
        try:
            iam.reserve(key, spec.project, spec.cpu, spec.memory_mb, pending=True)
        except errors.QuotaExceeded:
            st.metrics.failures.labels("create", "quota").inc()
            raise
        t_place = time.perf_counter()
        try:
            info = await _place(st, spec)
        except BaseException as e:
            iam.release(key)
            reason = e.code if isinstance(e, errors.DsecError) else "internal"
            st.metrics.failures.labels("create", reason).inc()
            raise
        iam.rekey(key, info.id)
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
        return model_response(await create_one(p, spec, time.perf_counter() - t0), 201)

    express.add("POST", "/v1/sandboxes", create, SandboxSpec, "spec")

    @app.post("/v1/sandboxes/batch")
    async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        p = principal(request)
        iam.authorize(p, body.spec.project)
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
        edge = directory.edge_for(sid)
        scope = iam.visible_projects(p)
        source = await edge.get(sid, scope)
        keys = [f"pending-{secrets.token_hex(8)}" for _ in range(body.n)]
        # The fork layer counts like a snapshot: a slot and the parent's writable layer as it
        # is now, refused here before anything is copied; its real size once copied (below).
        layer_key = f"pending-{secrets.token_hex(8)}"
        iam.reserve_snapshot(layer_key, source.spec.project, _mib(source.telemetry.get("disk_used_bytes", 0)))
        reserved: list[str] = []
        try:
            for key in keys:
                iam.reserve(key, source.spec.project, source.spec.cpu, source.spec.memory_mb, pending=True)
                reserved.append(key)
            infos = await edge.fork(sid, body.n, scope)
        except BaseException:
            iam.release_snapshot(layer_key)
            for key in reserved:
                iam.release(key)
            raise
        for key, info in zip(keys, infos, strict=True):
            iam.rekey(key, info.id)
        await _charge_fork_layer(iam, edge, scope, layer_key, infos)
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


def _mib(n_bytes: int) -> int:
    return -(-n_bytes // (1 << 20))


async def _charge_fork_layer(
    iam: IAM, edge: EdgeAPI, scope: set[str] | None, pending: str, infos: list[SandboxInfo]
) -> None:
    """Move a fork's pending snapshot reservation to its layer (``fork:<layer id>``, released
    by the reconciler once no edge reports the layer) at the size the edge copied; if that
    is over the quota (the parent wrote more after it was measured), the children are stopped
    (which frees the layer) and the fork is refused."""
    layer = infos[0].fork_layer if infos else None
    if layer is None:  # an edge from before fork layers were reported: nothing to vouch for it
        iam.release_snapshot(pending)
        return
    key = f"fork:{layer.id}"
    iam.rekey_snapshot(pending, key)
    try:
        iam.resize_snapshot(key, _mib(layer.size_bytes))
    except errors.DsecError:
        await asyncio.gather(*(edge.stop(i.id, scope) for i in infos), return_exceptions=True)
        for i in infos:
            iam.release(i.id)
        iam.release_snapshot(key)
        raise


def _install_snapshot_route(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """Snapshots count against their project's quota (max_snapshots, max_snapshot_mb): a slot
    is reserved before the copy, the size once it is known; over the limit, the snapshot is
    deleted again and the caller gets quota_exceeded."""
    iam, directory = st.iam, st.directory

    @app.post("/v1/sandboxes/{sid}/snapshot", response_model=SnapshotInfo, status_code=201)
    async def snapshot(sid: str, body: SnapshotRequest, request: Request) -> Response:
        p = principal(request)
        scope = iam.visible_projects(p)
        edge = directory.edge_for(sid)
        project = (await edge.get(sid, scope)).spec.project
        pending = f"pending-{secrets.token_hex(8)}"
        iam.reserve_snapshot(pending, project, 0)  # the count, before paying for the copy
        try:
            info = await edge.snapshot(sid, body, scope)
        finally:
            iam.release_snapshot(pending)
        try:
            iam.reserve_snapshot(info.id, project, -(-info.size_bytes // (1 << 20)))
        except errors.DsecError:
            with contextlib.suppress(errors.DsecError):
                await edge.delete_snapshot(info.id, scope)
            raise
        return model_response(info, 201)

    @app.post("/v1/sandboxes/{sid}/checkpoint", response_model=Checkpoint, status_code=201)
    async def checkpoint(sid: str, request: Request, body: CheckpointRequest | None = None) -> Response:
        """A memory checkpoint (its images and its copy of the files) counts like a snapshot:
        a slot (and at least 1 MiB) before the dump, its size once known."""
        scope = iam.visible_projects(principal(request))
        edge = directory.edge_for(sid)
        project = (await edge.get(sid, scope)).spec.project
        pending = f"pending-{secrets.token_hex(8)}"
        iam.reserve_snapshot(pending, project, 1)  # refused here, before anything is written
        try:
            info = await edge.checkpoint(sid, body or CheckpointRequest(), scope)
        finally:
            iam.release_snapshot(pending)
        try:
            iam.reserve_snapshot(info.id, project, max(1, -(-info.size_bytes // (1 << 20))))
        except errors.DsecError:
            with contextlib.suppress(errors.DsecError):
                await edge.delete_checkpoint(info.id, scope)
            raise
        return model_response(info, 201)


def _install_checkpoint_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """Memory checkpoints: list, restore (into a new sandbox: admitted like a create), delete.
    Taking one is a per-sandbox route (routes.py); checkpoint ids name their edge like sandbox ids."""
    iam, directory = st.iam, st.directory

    def edge_for(cid: str) -> EdgeAPI:
        try:
            return directory.edge_for(cid)
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
        scope = iam.visible_projects(p)
        edge = edge_for(cid)
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
        key = f"pending-{secrets.token_hex(8)}"
        iam.reserve(key, ck.project, ck.cpu, ck.memory_mb, pending=True)
        try:
            info = await edge.restore(cid, body, scope)
        except BaseException:
            iam.release(key)
            raise
        iam.rekey(key, info.id)
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
        await edge_for(cid).delete_checkpoint(cid, scope)
        iam.release_snapshot(cid)  # its share of the project's snapshot quota
        return Response(status_code=204)


def _install_sandbox_stop_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, express: Express
) -> None:
    """Stop one or many sandboxes."""
    iam, directory = st.iam, st.directory

    async def stop_one(p: Principal, sid: str, after: list[Callable[[], None]] | None = None) -> None:
        edge = directory.edge_for(sid)
        await edge.stop(sid, iam.visible_projects(p))

        def account() -> None:
            project = iam.release(sid)
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

    express.add("DELETE", "/v1/sandboxes/{sid}", stop)

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


def _install_image_pool_routes(
    app: FastAPI,
    st: ApiServerState,
    principal: _PrincipalFn,
    require_admin: _PrincipalFn,
) -> None:
    """Images, layers and warm pools across every edge."""
    iam, directory = st.iam, st.directory

    # --- images, pools, edges ------------------------------------------------------------

    @app.get("/v1/images")
    async def images(request: Request) -> dict[str, Any]:
        """Shared images for everyone; a snapshot only for its own project (and admins)."""
        vis = await _visibility(st, iam.visible_projects(principal(request)))
        seen: dict[str, dict[str, Any]] = {}
        for e in directory.all():
            with contextlib.suppress(errors.DsecError):
                for img in await e.images():
                    if vis.image(img["name"]):
                        seen.setdefault(img["name"], {**img, "edges": []})["edges"].append(e.name)
        return {"images": list(seen.values())}

    @app.get("/v1/layers")
    async def layers(request: Request) -> dict[str, Any]:
        """Admins: every layer. Tenants: the layers of the images they see, without other
        sandboxes' ids, scrubbed paths or import paths."""
        vis = await _visibility(st, iam.visible_projects(principal(request)))
        seen: dict[str, dict[str, Any]] = {}
        for e in directory.all():
            with contextlib.suppress(errors.DsecError):
                for layer in await e.layers():
                    ref = f"{layer['name']}@{layer['version']}"
                    if vis.scope is None:
                        seen.setdefault(ref, layer)
                    elif vis.layer(ref):
                        seen.setdefault(ref, tenant_layer(layer))
        return {"layers": list(seen.values())}

    @app.post("/v1/images/build")
    async def build(body: BuildRequest, request: Request) -> dict[str, Any]:
        require_admin(request)
        results = await asyncio.gather(*(e.build_image(body.recipe) for e in directory.all()))
        await directory.poll_once()
        return results[0] if results else {}

    @app.post("/v1/images/import")
    async def import_(name: str, request: Request) -> dict[str, Any]:
        require_admin(request)
        data = await request.body()
        results = await asyncio.gather(*(e.import_image(name, data) for e in directory.all()))
        await directory.poll_once()
        return results[0] if results else {}


def _install_pool_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, require_admin: _PrincipalFn
) -> None:
    """Warm pools across every edge: configured and prewarmed by admins only."""
    iam, directory = st.iam, st.directory

    @app.get("/v1/pools")
    async def pools(request: Request) -> dict[str, Any]:
        """Warm pools of the images the caller sees."""
        vis = await _visibility(st, iam.visible_projects(principal(request)))
        out = []
        for e in directory.all():
            with contextlib.suppress(errors.DsecError):
                out += [
                    {"edge": e.name, **i.model_dump(mode="json")}
                    for i in await e.pools()
                    if vis.image(i.spec.image)
                ]
        return {"pools": out}

    @app.post("/v1/pools")
    async def configure_pool(spec: PoolSpec, request: Request) -> dict[str, Any]:
        require_admin(request)
        infos = await asyncio.gather(*(e.configure_pool(spec) for e in directory.all()))
        return {"pools": [i.model_dump(mode="json") for i in infos]}

    @app.post("/v1/pools/prewarm")
    async def prewarm(body: PrewarmRequest, request: Request) -> dict[str, Any]:
        """Admins only: pooled sandboxes belong to no project, so they count against no quota
        (a tenant's create that takes one from a pool is admitted like any other)."""
        require_admin(request)
        spec = PoolSpec(**body.spec.model_dump(include=set(PoolSpec.model_fields) - {"min_size", "max_size"}))
        edges = [v.api for v in directory.candidates(body.spec)]
        share, extra = divmod(body.count, max(len(edges), 1))
        infos: list[PoolInfo] = await asyncio.gather(
            *(e.prewarm(spec, share + (1 if i < extra else 0)) for i, e in enumerate(edges))
        )
        return {"pools": [i.model_dump(mode="json") for i in infos], "count": body.count}


def _install_edge_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """Edge listing and registration, and the event stream."""
    directory, cluster_token = st.directory, st.cluster_token

    @app.get("/v1/edges")
    async def edges(request: Request) -> dict[str, Any]:
        """Admins: every edge's status. Tenants: without other projects, their snapshots and
        sandbox ids, or the edges' internal addresses."""
        scope = st.iam.visible_projects(principal(request))
        statuses = [v.status for v in directory.views.values() if v.status]
        if scope is None:
            return {"edges": [s.model_dump(mode="json") for s in statuses]}
        vis = await _visibility(st, scope)
        return {"edges": [tenant_edge(s, vis) for s in statuses]}

    @app.post("/v1/edges/register")
    async def register(body: RegisterEdge, request: Request) -> dict[str, str]:
        # the gate checked the cluster token before the body was read
        view = directory.add(HttpEdge(body.name, body.url, cluster_token))
        if view.status is None:
            with contextlib.suppress(Exception):
                view.status = await view.api.status()
        return {"status": "registered"}

    @app.get("/v1/events")
    async def events(request: Request) -> StreamingResponse:
        """Lifecycle events of the caller's projects (admins: all)."""
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)
        st.events.subscribers[q] = st.iam.visible_projects(principal(request))

        async def body() -> AsyncIterator[bytes]:
            try:
                yield b": connected\n\n"
                while True:
                    try:
                        ev = await asyncio.wait_for(q.get(), 15.0)
                        yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode()
                    except TimeoutError:
                        yield b": keep-alive\n\n"
            finally:
                st.events.subscribers.pop(q, None)

        return StreamingResponse(body(), media_type="text/event-stream")


def _install_iam_routes(
    app: FastAPI,
    st: ApiServerState,
    principal: _PrincipalFn,
    require_admin: _PrincipalFn,
) -> None:
    """Projects and principals."""
    iam = st.iam

    # --- IAM -----------------------------------------------------------------------------

    @app.post("/v1/projects")
    async def create_project(body: ProjectCreate, request: Request) -> dict[str, Any]:
        require_admin(request)
        return iam.create_project(body.name, body.parent, body.quota).model_dump(mode="json")

    @app.get("/v1/projects")
    async def list_projects(request: Request) -> dict[str, Any]:
        p = principal(request)
        scope = iam.visible_projects(p)
        return {
            "projects": [
                x.model_dump(mode="json") for x in iam.list_projects() if scope is None or x.name in scope
            ]
        }

    @app.post("/v1/principals")
    async def create_principal(body: PrincipalCreate, request: Request) -> dict[str, Any]:
        require_admin(request)
        p, token = iam.create_principal(body.name, body.projects, admin=body.admin)
        return {"principal": p.model_dump(mode="json"), "token": token}

    # --- tokens: an admin revokes or rotates anyone's; a principal its own -----------------

    @app.get("/v1/principals")
    async def list_principals(request: Request) -> dict[str, Any]:
        require_admin(request)
        return {"principals": [x.model_dump(mode="json") for x in iam.list_principals()]}

    @app.get("/v1/principals/me")
    async def whoami(request: Request) -> dict[str, Any]:
        return {"principal": principal(request).model_dump(mode="json")}

    @app.post("/v1/principals/{who}/rotate")
    async def rotate_principal(who: str, request: Request) -> dict[str, Any]:
        """A new token for `who` (a name or id), returned once; the old one stops working at once."""
        require_admin(request)
        target = iam.find_principal(who)
        token = iam.rotate_token(target.id)
        return {"principal": target.model_dump(mode="json"), "token": token}

    @app.post("/v1/principals/{who}/revoke")
    async def revoke_principal(who: str, request: Request) -> dict[str, Any]:
        """`who`'s token stops working at once; it gets no new one (rotate issues one)."""
        me = require_admin(request)
        target = iam.find_principal(who)
        if target.id == me.id:
            raise errors.InvalidRequest(
                "an admin cannot revoke its own token here (nobody could issue a new one): "
                "rotate it with POST /v1/token/rotate, or revoke it with another admin's token"
            )
        iam.revoke_token(target.id)
        return {"principal": target.model_dump(mode="json"), "revoked": True}

    @app.post("/v1/token/rotate")
    async def rotate_own(request: Request) -> dict[str, Any]:
        """Replace the caller's own token: the new one is returned once, the one that made this
        call stops working at once."""
        me = principal(request)
        return {"principal": me.model_dump(mode="json"), "token": iam.rotate_token(me.id)}

    @app.post("/v1/token/revoke")
    async def revoke_own(request: Request) -> dict[str, Any]:
        """Revoke the caller's own token (a leaked one): an admin can issue a new one."""
        me = principal(request)
        iam.revoke_token(me.id)
        return {"principal": me.model_dump(mode="json"), "revoked": True}


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


async def _candidates(st: ApiServerState, spec: SandboxSpec) -> list[EdgeView]:
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
    # Every edge holding the image is full: move it to one that is not (a snapshot made on
    # one edge restores on any), least loaded first.
    others = sorted(
        (v for v in st.directory.views.values() if v.healthy and v not in holders and v.status is not None),
        key=lambda v: v.load(spec),
    )
    for view in others:
        try:
            await _transfer_image(holders[0].api, view.api, spec.image)
            st.directory.note_placed(view)
            return await view.api.create(spec)
        except (errors.CapacityExhausted, errors.Unavailable) as e:
            last = e
    raise errors.CapacityExhausted(f"every edge that has image {spec.image!r} is full; retry later") from last


async def _transfer_image(source: EdgeAPI, target: EdgeAPI, name: str) -> None:
    """Copy an image's missing layers (relayed through this process) and its manifest."""
    manifest = await source.image_manifest(name)
    with tempfile.TemporaryDirectory(prefix="dsec-transfer-") as tmp:
        for ref in await target.missing_layers(manifest):
            archive = Path(tmp) / "layer.tar"
            await source.fetch_layer(ref, archive)
            await target.push_layer(ref, manifest["digests"][ref], archive)
            archive.unlink()
    await target.put_image(manifest)


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


async def _reconcile_quota(st: ApiServerState, interval_s: float, grace_s: float) -> None:
    """Release reservations of sandboxes no edge reports any more (TTL reaping, crashes) and
    those of creates whose apiserver died mid-way. A create in flight keeps its reservation
    however long it takes: only its own success (re-keyed to the sandbox) or failure
    (released) ends it."""
    while True:
        try:
            st.iam.release_orphaned()
        except Exception:
            log.exception("releasing the reservations of dead apiservers failed; retrying")
        await asyncio.sleep(interval_s)
        live: set[str] = set()
        complete = True
        for e in st.directory.all():
            try:
                live |= {i.id for i in await e.list({}, None, None)}
            except Exception:
                complete = False
        if complete:
            st.iam.reconcile(live, older_than_s=grace_s)
        await _reconcile_fork_layers(st, grace_s)


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
