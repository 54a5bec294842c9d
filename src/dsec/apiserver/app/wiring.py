"""The apiserver's app: create_api_app wires the Gate, the routes and the background loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest

from dsec import __version__, errors
from dsec.apiserver.app.admin_routes import (
    _install_edge_routes,
    _install_iam_routes,
    _install_image_pool_routes,
    _install_pool_routes,
)
from dsec.apiserver.app.capacity_routes import _install_capacity_routes
from dsec.apiserver.app.control import (
    _candidates,
    _reconcile_quota,
    _refresh_gauges,
    _visibility,
    watch_node_loss,
)
from dsec.apiserver.app.pull_routes import _install_build_routes, _install_image_routes, _install_pull_routes
from dsec.apiserver.app.sandbox_routes import (
    _install_checkpoint_routes,
    _install_sandbox_routes,
    _install_sandbox_stop_routes,
    _install_snapshot_route,
    _install_state_routes,
    _install_trajectory_routes,
)
from dsec.apiserver.app.state import ApiServerState, EventBus, Metrics, _PrincipalFn
from dsec.apiserver.capacity import Capacity
from dsec.apiserver.edges import HttpEdge
from dsec.apiserver.placement import EdgeDirectory
from dsec.apiserver.tenancy import (
    ApiServerSettings,
    TenantMetrics,
    make_guard,
    metrics_scope,
)
from dsec.cluster.provider import NodeProvider
from dsec.compat.sandboxfusion import sandboxfusion_router
from dsec.compat.swerex import swerex_router
from dsec.edgeapi import EdgeAPI
from dsec.fncall import languages
from dsec.fncall.tenancy import caller_project, check_tier
from dsec.fncall.tier import container_only
from dsec.http.routes import (
    Express,
    Gate,
    Target,
    install_error_handlers,
    model_response,
    sandbox_router,
)
from dsec.iam import IAM, Principal
from dsec.layers.distribution import RegistryClient
from dsec.models import (
    FnCallRequest,
    FnCallResult,
    JupyterRequest,
    JupyterResult,
    SandboxSpec,
)

log = logging.getLogger("dsec.apiserver")


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
    provider: NodeProvider | None = None,
) -> FastAPI:
    settings = settings or ApiServerSettings()
    directory = EdgeDirectory(poll_interval_s=poll_interval_s, lost_after_s=settings.edge_lost_after_s)
    for e in local_edges or []:
        directory.add(e)
    for name, url in (remote_edges or {}).items():
        directory.add(HttpEdge(name, url, cluster_token))
    registry = None
    if settings.registry:  # (layers of images no edge holds: see EdgeDirectory.learn_from_registry)
        registry = RegistryClient(settings.registry, timeout=5.0)
        directory.registry_layers = registry.layer_refs
    st = ApiServerState(iam, directory, cluster_token, Metrics(), EventBus())
    watch_node_loss(st)
    capacity = Capacity(directory, iam, settings, provider, st.events.publish)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if extra_lifespan is not None:
            await extra_lifespan()
        await directory.poll_once()
        directory.start()
        capacity.start()
        reconcile = asyncio.create_task(
            _reconcile_quota(
                st,
                settings.reconcile_interval_s,
                settings.reservation_grace_s,
                settings.lost_memory_s,
                orphan_after_s=settings.orphan_after_s,
            )
        )
        try:
            yield
        finally:
            reconcile.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reconcile
            await capacity.close()
            if on_shutdown is not None:
                await on_shutdown()
            await directory.close()
            if registry is not None:
                await registry.aclose()

    app = FastAPI(
        title="dsec",
        version=__version__,
        lifespan=lifespan,
        description="Elastic sandboxes for agentic RL. See docs/API.md.",
    )
    app.state.dsec = st
    app.state.capacity = capacity
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
        scope = iam.visible_projects(principal(request))
        return Target(directory.edge_for(sid, scope), scope)

    app.state.resolve = resolve
    _install_snapshot_route(app, st, principal)  # before the shared router: snapshot/checkpoint quotas
    _install_trajectory_routes(app, st, principal)  # ...and a lost edge's shipped trajectory logs

    app.include_router(sandbox_router(st.metrics.observe_exec, express))
    app.include_router(swerex_router())
    _install_fncall_routes(app, st, principal, compat_auth, express)

    _install_public_routes(app, st)
    _install_sandbox_routes(app, st, principal, express)
    _install_sandbox_stop_routes(app, st, principal, express)
    _install_state_routes(app, st, principal)
    _install_checkpoint_routes(app, st, principal)
    _install_image_pool_routes(app, st, principal, require_admin)
    _install_pull_routes(app, st, principal)
    _install_image_routes(app, st, principal)
    _install_build_routes(app, st, principal, require_admin)
    _install_pool_routes(app, st, principal, require_admin)
    _install_edge_routes(app, st, principal)
    _install_iam_routes(app, st, principal, require_admin)
    _install_capacity_routes(app, st, capacity, principal, require_admin)

    @app.exception_handler(errors.AuthError)
    async def _auth_error(_: Request, exc: errors.AuthError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.status, headers={"WWW-Authenticate": "Bearer"})

    return app


def _install_fncall_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, compat_auth: bool, express: Express
) -> None:
    """Stateless code runs: the native API and the SandboxFusion-compatible endpoints."""

    async def on_some_edge(
        req: FnCallRequest | JupyterRequest, call: Callable[[EdgeAPI], Awaitable[Any]]
    ) -> Any:
        # Every entry (native, SandboxFusion) comes here with the caller's project set.
        if req.project is None:
            raise errors.InternalError("a stateless call lost its caller's project")
        check_tier(st.iam, req.project, req.backend)  # the project's tier policy (admins too)
        # An unknown backend gets a create's answer; a known one other than the workers' is refused.
        views = await _candidates(st, SandboxSpec(image=req.image, backend=req.backend))
        container_only(req.backend)
        last: errors.DsecError | None = None
        for view in views:
            try:
                return await call(view.api)
            except (errors.CapacityExhausted, errors.Unavailable) as e:
                last = e
        raise errors.Unavailable(f"no edge could run the call on image {req.image!r}; retry later") from last

    async def run(req: FnCallRequest) -> FnCallResult:
        result: FnCallResult = await on_some_edge(req, lambda e: e.fncall_run(req))
        return result

    async def jupyter(req: JupyterRequest) -> JupyterResult:
        result: JupyterResult = await on_some_edge(req, lambda e: e.fncall_jupyter(req))
        return result

    # Workers are per project: the project is always the caller's (never a client's word).
    @app.post("/v1/fncall/run", response_model=FnCallResult)
    async def fncall_run(body: FnCallRequest, request: Request) -> Response:
        project = caller_project(st.iam, principal(request), body.project)
        return model_response(await run(body.model_copy(update={"project": project})))

    express.derive(app.routes, fncall_run)

    @app.get("/v1/fncall/languages")
    async def fncall_languages() -> dict[str, Any]:
        """The languages of the `code` image, and SandboxFusion's others with why they are not."""
        return languages.listing()

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
