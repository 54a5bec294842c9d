"""Routes of elastic capacity (dsec.apiserver.capacity): announced bursts, edge drains."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from dsec.apiserver.app.state import ApiServerState, _PrincipalFn
from dsec.apiserver.capacity import Capacity
from dsec.models import CapacityRequest


def _install_capacity_routes(
    app: FastAPI, st: ApiServerState, capacity: Capacity, principal: _PrincipalFn, require_admin: _PrincipalFn
) -> None:
    iam = st.iam

    @app.post("/v1/capacity")
    async def announce(body: CapacityRequest, request: Request) -> dict[str, Any]:
        """Announce a burst: admins for any project, a principal for its own projects."""
        p = principal(request)
        iam.authorize(p, body.project)
        return capacity.announce(body, p).model_dump(mode="json")

    @app.get("/v1/capacity")
    async def bursts(request: Request) -> dict[str, Any]:
        """Announced bursts and what was done (tenants: their projects' only), whichever
        apiserver took them; `acting`: whether this apiserver is the one that acts on them."""
        scope = iam.visible_projects(principal(request))
        return {
            "bursts": [b.model_dump(mode="json") for b in capacity.visible(scope)],
            "provider": capacity.provider.kind if capacity.provider is not None else None,
            "acting": capacity.leading,
        }

    @app.delete("/v1/capacity/{burst_id}")
    async def cancel(burst_id: str, request: Request) -> dict[str, Any]:
        """Cancel a burst (admins: any; a principal: its projects' only, another's is 404): it
        stops counting against its project and its pre-warmed pool sandboxes are given back."""
        return (await capacity.cancel(burst_id, principal(request))).model_dump(mode="json")

    @app.post("/v1/edges/{name}/drain")
    async def drain(name: str, request: Request) -> dict[str, Any]:
        """No new placements on edge `name`; its sandboxes keep working (maintenance)."""
        require_admin(request)
        view = capacity.drain(name)
        return {"edge": name, "draining": view.draining}

    @app.post("/v1/edges/{name}/undrain")
    async def undrain(name: str, request: Request) -> dict[str, Any]:
        require_admin(request)
        view = capacity.undrain(name)
        return {"edge": name, "draining": view.draining}
