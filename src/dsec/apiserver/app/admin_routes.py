"""Routes of images, pools, edges, projects and principals (mostly admin-only)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from dsec import errors
from dsec.aio import wait_for
from dsec.apiserver.app.control import _visibility
from dsec.apiserver.app.state import ApiServerState, _PrincipalFn
from dsec.apiserver.edges import HttpEdge
from dsec.apiserver.placement import EdgeDirectory
from dsec.apiserver.tenancy import (
    tenant_edge,
    tenant_layer,
)
from dsec.models import (
    BackendInfo,
    PoolInfo,
    PoolSpec,
    PrewarmRequest,
    PrincipalCreate,
    ProjectCreate,
    RegisterEdge,
)

log = logging.getLogger("dsec.apiserver")


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
        statuses = [
            v.status.model_copy(update={"draining": v.draining}) for v in directory.views.values() if v.status
        ]
        if scope is None:
            return {"edges": [s.model_dump(mode="json") for s in statuses]}
        vis = await _visibility(st, scope)
        return {"edges": [tenant_edge(s, vis) for s in statuses]}

    @app.get("/v1/backends")
    async def backends(request: Request) -> dict[str, Any]:
        """Every backend (isolation tier) the healthy edges run, with what it can do, and
        those an edge was asked to run but cannot (with why). Anyone may ask."""
        tiers = cluster_backends(directory)
        if st.iam.visible_projects(principal(request)) is not None:  # a tenant: no host paths
            tiers = [
                b if b.available else b.model_copy(update={"reason": "not available here"}) for b in tiers
            ]
        return {"backends": [b.model_dump(mode="json") for b in tiers]}

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
                        ev = await wait_for(q.get(), 15.0)
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
        project = iam.create_project(body.name, body.parent, body.quota, body.allowed_backends)
        return project.model_dump(mode="json")

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


def cluster_backends(directory: EdgeDirectory) -> list[BackendInfo]:
    """The backends of the healthy edges, merged by name: available where any edge runs it."""
    merged: dict[str, BackendInfo] = {}
    for view in directory.views.values():
        if not view.healthy or view.status is None:
            continue
        for info in view.status.backend_info:
            have = merged.get(info.name)
            if have is None or (info.available and not have.available):
                merged[info.name] = info.model_copy(update={"edges": []})
            b = merged[info.name]
            if info.available:
                b.edges.append(view.status.name)
                b.accelerated = b.accelerated or info.accelerated
    return [merged[n] for n in sorted(merged)]
