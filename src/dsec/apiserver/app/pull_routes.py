"""Images pulled by reference (`POST /v1/images/pull`) and the projects' registry logins.

A member of a project pulls into the project's own images (`<project>/<name>`: its members
see and use them, no one else can, and no name of another project or of the shared images
can be taken); an admin may pull a shared image (no project). The login the pull presents is
the project's for that registry, looked up here and sent to the edges with the pull; it is
never returned (`GET .../registries` lists registries and user names only).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from dsec import errors
from dsec.apiserver.app.control import _visibility
from dsec.apiserver.app.state import ApiServerState, _PrincipalFn
from dsec.iam.registries import check_registry_name
from dsec.layers.pull import Reference
from dsec.models import BuildRequest, EdgeBuild, EdgePull, PullRequest, RegistryLogin

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")


def image_name(ref: Reference, name: str | None, project: str | None) -> str:
    """The name a pull stores its image under: `name`, else the reference's last path part
    and its tag (or the digest's first 12 hex digits); in a project, `<project>/<that>`."""
    if name is None:
        base = ref.repository.rsplit("/", 1)[-1]
        name = f"{base}:{ref.tag}" if ref.tag is not None else f"{base}-{(ref.digest or '')[7:19]}"
    return project_name(name, project)


def project_name(name: str, project: str | None) -> str:
    """`name` as stored: `<project>/<name>` for a project's image (a `<project>/` prefix the
    caller gave is its own), the name itself for a shared one."""
    if project is not None and name.startswith(f"{project}/"):
        name = name[len(project) + 1 :]
    if not _NAME.match(name):
        raise errors.InvalidRequest(
            f"image name {name[:140]!r} is invalid: use letters, digits and '._:+-' (up to 128), "
            "without a project prefix other than the pull's own",
            reason="bad_name",
        )
    return name if project is None else f"{project}/{name}"


def _member_check(st: ApiServerState, principal: _PrincipalFn) -> Callable[[Request, str], None]:
    """403 unless the caller may act for `project` (then 404 for no such project: a tenant
    learns nothing of projects not its own)."""

    def member(request: Request, project: str) -> None:
        p = principal(request)
        st.iam.authorize(p, project)
        st.iam.get_project(project)

    return member


def _install_pull_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    iam, directory = st.iam, st.directory
    member = _member_check(st, principal)

    @app.post("/v1/images/pull")
    async def pull(body: PullRequest, request: Request) -> dict[str, Any]:
        p = principal(request)
        if body.project is None and not p.admin:
            raise errors.InvalidRequest(
                "give the project to pull into (its members' own image); only admins pull shared images",
                reason="project_required",
            )
        if body.project is not None:
            member(request, body.project)
        ref = Reference.parse(body.reference)
        name = image_name(ref, body.name, body.project)
        login = iam.registry_login(body.project, ref.registry) if body.project is not None else None
        req = EdgePull(
            reference=str(ref), name=name, project=body.project,
            username=login[0] if login else None, password=login[1] if login else None,  # type: ignore[arg-type]
        )  # fmt: skip
        edges = directory.all()
        if not edges:
            raise errors.Unavailable("no edge is registered to pull the image", reason="no_edges")
        results = await asyncio.gather(*(e.pull_image(req) for e in edges))
        await directory.poll_once()
        return {**results[0], "edges": [e.name for e in edges]}

    @app.put("/v1/projects/{project}/registries/{registry}", status_code=204)
    async def set_login(project: str, registry: str, body: RegistryLogin, request: Request) -> Response:
        member(request, project)
        iam.set_registry_login(project, registry, body.username, body.password.get_secret_value())
        return Response(status_code=204)

    @app.get("/v1/projects/{project}/registries")
    async def logins(project: str, request: Request) -> dict[str, Any]:
        member(request, project)
        return {"registries": iam.registry_logins(project)}

    @app.delete("/v1/projects/{project}/registries/{registry}", status_code=204)
    async def delete_login(project: str, registry: str, request: Request) -> Response:
        member(request, project)
        iam.delete_registry_login(project, check_registry_name(registry))
        return Response(status_code=204)


def _install_image_routes(app: FastAPI, st: ApiServerState, principal: _PrincipalFn) -> None:
    """One image: inspected, deleted."""
    iam, directory = st.iam, st.directory
    member = _member_check(st, principal)

    @app.get("/v1/images/{name:path}")
    async def image(name: str, request: Request) -> dict[str, Any]:
        """One image as the caller may see it: its digest, layers, config, the edges holding it
        (a tenant: of another's image nothing, of its source the type, reference and digest)."""
        vis = await _visibility(st, iam.visible_projects(principal(request)))
        if not vis.image(name.partition("@")[0]):
            raise errors.ImageNotFound(f"no image {name!r} that you may see", image=name)
        found: dict[str, Any] | None = None
        holders: list[str] = []
        for e in directory.all():
            with contextlib.suppress(errors.DsecError):
                found = found or await e.image(name)
                holders.append(e.name)
        if found is None:
            raise errors.ImageNotFound(f"no edge holds image {name!r}", image=name)
        return {**found, "edges": holders}

    @app.delete("/v1/images/{name:path}", status_code=204)
    async def delete_image(name: str, request: Request) -> Response:
        """A project's image by its members, a shared one by admins; on every edge."""
        base = name.partition("@")[0]
        if "/" in base:
            member(request, base.split("/", 1)[0])
        elif not principal(request).admin:
            raise errors.Forbidden("only admins delete shared images; a project's are named <project>/<name>")
        results = await asyncio.gather(
            *(e.delete_image(name) for e in directory.all()), return_exceptions=True
        )
        await directory.poll_once()
        done = [r for r in results if not isinstance(r, BaseException)]
        if not done:
            first = next((r for r in results if isinstance(r, errors.DsecError)), None)
            raise first or errors.ImageNotFound(f"no edge holds image {name!r}", image=name)
        return Response(status_code=204)


def _install_build_routes(
    app: FastAPI, st: ApiServerState, principal: _PrincipalFn, require_admin: _PrincipalFn
) -> None:
    """`POST /v1/images/build`: a JSON {"recipe"} builds a Debian recipe on every edge (admins);
    a tar body is a Dockerfile build's context (a project's members into its images, admins a
    shared one), built on one edge, its log streamed as NDJSON events."""
    directory = st.directory
    member = _member_check(st, principal)

    @app.post("/v1/images/build", response_model=None)
    async def build(
        request: Request,
        name: str | None = None,
        project: str | None = None,
        dockerfile: str = "Dockerfile",
        target: str | None = None,
        build_arg: Annotated[list[str] | None, Query()] = None,
    ) -> dict[str, Any] | StreamingResponse:
        if request.headers.get("content-type", "").startswith("application/json"):
            require_admin(request)
            try:
                recipe = BuildRequest.model_validate_json(await request.body()).recipe
            except ValidationError as e:
                why = e.errors()[0]["msg"]
                raise errors.InvalidRequest(f'a recipe build takes {{"recipe": NAME}}: {why}') from e
            results = await asyncio.gather(*(e.build_image(recipe) for e in directory.all()))
            await directory.poll_once()
            return results[0] if results else {}
        if name is None:
            raise errors.InvalidRequest(
                "a Dockerfile build needs the image's name (?name=NAME[:TAG]) and its context as a tar body",
                reason="name_required",
            )
        if project is None:
            require_admin(request)
        else:
            member(request, project)
        args = {k: v for k, _, v in (a.partition("=") for a in build_arg or [])}
        req = EdgeBuild(
            name=project_name(name, project), project=project, dockerfile=dockerfile, target=target,
            build_args=args,
        )  # fmt: skip
        views = [v for v in directory.views.values() if v.healthy]
        if not views:
            raise errors.Unavailable("no edge is up to build the image", reason="no_edges")
        events = views[0].api.build_dockerfile(req, await request.body())
        first = await anext(events)  # (errors before the build starts are the response's own)

        async def stream() -> AsyncIterator[bytes]:
            yield first
            async for chunk in events:
                yield chunk
            await directory.poll_once()  # (placement finds the image on its edge at once)

        return StreamingResponse(stream(), media_type="application/x-ndjson")
