"""`dsec edge`: the node agent's HTTP API, spoken only to apiservers (cluster token).

It registers itself with every apiserver it is given and keeps re-registering
(a heartbeat), so a restarted apiserver learns its edges again within seconds. An http://
name that resolves to several addresses (a Kubernetes headless Service) is resolved at each
heartbeat and every address gets the registration, so apiservers added behind the name
learn the edge too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse

from dsec import __version__, errors
from dsec.config import EdgeSettings
from dsec.edge.edge import Edge
from dsec.edge.local import LocalEdge
from dsec.edge.shipper import TrajectoryShipper
from dsec.http.routes import (
    Express,
    Gate,
    Target,
    bearer,
    install_error_handlers,
    model_response,
    sandbox_router,
)
from dsec.models import (
    BuildRequest,
    EdgeBuild,
    EdgePull,
    EdgeStatus,
    FnCallRequest,
    ForkRequest,
    JupyterRequest,
    PoolInfo,
    PoolPrewarm,
    PoolSpec,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
)

log = logging.getLogger("dsec.edge.server")


def _projects(request: Request) -> set[str] | None:
    raw = request.headers.get("x-dsec-projects", "*")
    if raw == "*":
        return None
    try:
        return set(json.loads(raw))
    except ValueError as e:
        raise errors.InvalidRequest("X-Dsec-Projects must be '*' or a JSON list of project names") from e


def create_edge_app(
    settings: EdgeSettings,
    *,
    token: str,
    public_url: str,
    apiservers: list[str],
    heartbeat_s: float = 2.0,
    keep_sandboxes: bool = False,
) -> FastAPI:
    # No sandbox's network policy may reach this edge's API or its apiservers.
    platform = [*settings.platform_addresses, public_url, *apiservers]
    edge = Edge(settings.model_copy(update={"platform_addresses": platform}))
    local = LocalEdge(edge, public_url)

    async def register_loop() -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                targets = [t for url in apiservers for t in await registration_urls(url)]
                for url in targets:
                    try:
                        await http.post(
                            url.rstrip("/") + "/v1/edges/register",
                            json={"name": edge.name, "url": public_url},
                            headers={"Authorization": f"Bearer {token}"},
                        )
                    except httpx.HTTPError as e:
                        log.debug("registering with %s failed: %s", url, e)
                await asyncio.sleep(heartbeat_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await edge.start()
        tasks = [asyncio.create_task(register_loop())]
        if apiservers:  # the trajectory log survives this edge (dsec.edge.shipper)
            shipper = TrajectoryShipper(edge.trajlog, edge.name, apiservers, token)
            tasks.append(asyncio.create_task(shipper.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await edge.close(stop_sandboxes=not keep_sandboxes)

    app = FastAPI(title="dsec edge", version=__version__, lifespan=lifespan)
    app.state.edge = edge
    install_error_handlers(app)

    express = Express()
    _install_gate(app, token, express)

    async def resolve(request: Request, sid: str) -> Target:
        return Target(local, _projects(request))

    app.state.resolve = resolve
    app.include_router(sandbox_router(express=express))
    _install_sandbox_routes(app, edge, local, express)
    _install_pool_state_routes(app, local)
    _install_image_routes(app, local)
    _install_checkpoint_routes(app, local)
    return app


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def registration_urls(url: str, resolve: Resolver = _resolve) -> list[str]:
    """Where the registrations for one `--apiserver` URL go. An http:// host name with several
    addresses (a Kubernetes headless Service: one per apiserver pod) is every one of them, so
    each apiserver behind the name learns this edge; anything else (one address, an IP, https,
    a name that does not resolve now) is the URL itself."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme != "http" or not host:
        return [url]
    try:
        ipaddress.ip_address(host)
        return [url]
    except ValueError:
        pass
    port = parts.port or 80
    try:
        addresses = list(dict.fromkeys(await resolve(host, port)))
    except OSError:
        return [url]
    if len(addresses) < 2:
        return [url]
    out = []
    for a in addresses:
        netloc = f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
        out.append(urlunsplit((parts.scheme, netloc, parts.path, "", "")))
    return out


def _install_gate(app: FastAPI, token: str, express: Express) -> None:
    """Body limit, and every call but the health check must carry the cluster token."""

    def guard(scope: dict[str, Any]) -> None:
        if scope["path"] != "/v1/health":
            got = bearer(scope) or ""
            if not secrets.compare_digest(got.encode(), token.encode()):
                raise errors.AuthError(
                    "this edge accepts only the cluster token; talk to an apiserver instead"
                )

    app.add_middleware(Gate, limit=160 * 1024 * 1024, guard=guard, express=express)


def _install_sandbox_routes(app: FastAPI, edge: Edge, local: LocalEdge, express: Express) -> None:
    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "edge": edge.name}

    @app.get("/v1/edge/status", response_model=EdgeStatus)
    async def status() -> EdgeStatus:
        return await local.status()

    @app.post("/v1/sandboxes", response_model=SandboxInfo, status_code=201)
    async def create(spec: SandboxSpec, request: Request) -> Response:
        return model_response(await edge.create(spec), 201)

    @app.get("/v1/sandboxes")
    async def list_(
        request: Request, project: str | None = None, label: list[str] = Query(default=[])
    ) -> dict[str, list[SandboxInfo]]:
        labels = dict(x.split("=", 1) for x in label if "=" in x)
        return {"sandboxes": await local.list(labels, project, _projects(request))}

    @app.delete("/v1/sandboxes/{sid}", status_code=204)
    async def stop(sid: str, request: Request) -> Response:
        await local.stop(sid, _projects(request))
        return Response(status_code=204)

    express.derive(app.routes, create, stop)


def _install_checkpoint_routes(app: FastAPI, local: LocalEdge) -> None:
    @app.get("/v1/checkpoints")
    async def checkpoints(request: Request) -> dict[str, Any]:
        cps = await local.checkpoints(_projects(request))
        return {"checkpoints": [c.model_dump(mode="json") for c in cps]}

    @app.post("/v1/checkpoints/{cid}/restore", response_model=SandboxInfo, status_code=201)
    async def restore(cid: str, body: RestoreRequest, request: Request) -> Response:
        return model_response(await local.restore(cid, body, _projects(request)), 201)

    @app.delete("/v1/checkpoints/{cid}", status_code=204)
    async def delete_checkpoint(cid: str, request: Request) -> Response:
        await local.delete_checkpoint(cid, _projects(request))
        return Response(status_code=204)


def _install_pool_state_routes(app: FastAPI, local: LocalEdge) -> None:
    @app.get("/v1/pools")
    async def pools() -> dict[str, list[PoolInfo]]:
        return {"pools": await local.pools()}

    @app.post("/v1/pools", response_model=PoolInfo)
    async def configure_pool(spec: PoolSpec) -> PoolInfo:
        return await local.configure_pool(spec)

    @app.post("/v1/pools/prewarm", response_model=PoolInfo)
    async def prewarm(body: PoolPrewarm) -> PoolInfo:
        return await local.prewarm(body.spec, body.count, body.project)

    @app.post("/v1/sandboxes/{sid}/fork", status_code=201)
    async def fork(sid: str, body: ForkRequest, request: Request) -> dict[str, Any]:
        infos = await local.fork(sid, body, _projects(request))
        return {"sandboxes": [i.model_dump(mode="json") for i in infos]}

    @app.post("/v1/projects/{project}/pause")
    async def pause_project(project: str) -> dict[str, Any]:
        return {"paused": await local.pause_project(project)}

    @app.get("/v1/snapshots")
    async def snapshots(request: Request) -> dict[str, Any]:
        return {"snapshots": await local.snapshots(_projects(request))}

    @app.delete("/v1/snapshots/{name}", status_code=204)
    async def delete_snapshot(name: str, request: Request) -> Response:
        await local.delete_snapshot(name, _projects(request))
        return Response(status_code=204)

    @app.post("/v1/fncall/run")
    async def fncall_run(body: FnCallRequest) -> Response:
        return model_response(await local.fncall_run(body))

    @app.post("/v1/fncall/jupyter")
    async def fncall_jupyter(body: JupyterRequest) -> Response:
        return model_response(await local.fncall_jupyter(body))



def _install_image_routes(app: FastAPI, local: LocalEdge) -> None:
    @app.get("/v1/images")
    async def images() -> dict[str, Any]:
        return {"images": await local.images()}

    @app.get("/v1/layers")
    async def layers() -> dict[str, Any]:
        return {"layers": await local.layers()}

    @app.post("/v1/images/build")
    async def build(body: BuildRequest) -> dict[str, Any]:
        return await local.build_image(body.recipe)

    @app.post("/v1/images/dockerbuild")
    async def dockerbuild(spec: str, request: Request) -> StreamingResponse:
        req = EdgeBuild.model_validate_json(spec)
        return StreamingResponse(
            local.build_dockerfile(req, await request.body()), media_type="application/x-ndjson"
        )

    @app.get("/v1/images/{name:path}")
    async def image(name: str) -> dict[str, Any]:
        return await local.image(name)

    @app.delete("/v1/images/{name:path}", status_code=204)
    async def delete_image(name: str) -> Response:
        await local.delete_image(name)
        return Response(status_code=204)

    @app.post("/v1/images/pull")
    async def pull(body: EdgePull) -> dict[str, Any]:
        return await local.pull_image(body)

    @app.post("/v1/images/import")
    async def import_(name: str, request: Request) -> dict[str, Any]:
        return await local.import_image(name, await request.body())
