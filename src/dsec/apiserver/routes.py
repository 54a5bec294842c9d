"""Per-sandbox HTTP routes, shared by the apiserver and the edge's own server.

Both mount the same router; they differ only in how a sandbox id is resolved to
an edge and a project scope (`app.state.resolve`): the apiserver authenticates
the caller with IAM and routes by the edge name in the id, the edge server
trusts the cluster token and the project scope the apiserver forwarded.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from dsec import errors
from dsec.apiserver.edges import EdgeAPI, Projects
from dsec.models import (
    ExecRequest,
    ExecResult,
    FileContent,
    FileEdit,
    FileStat,
    FileWrite,
    SandboxInfo,
    SessionCreate,
    SessionInfo,
    SessionResult,
    SessionRun,
)

MAX_ARCHIVE = 512 * 1024 * 1024


@dataclass
class Target:
    edge: EdgeAPI
    projects: Projects


Resolver = Callable[[Request, str], Awaitable[Target]]
ExecObserver = Callable[[float], None]


async def _target(request: Request, sid: str) -> Target:
    resolve: Resolver = request.app.state.resolve
    return await resolve(request, sid)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.DsecError)
    async def _dsec_error(_: Request, exc: errors.DsecError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors()[:10]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg')}")
        err = errors.InvalidRequest("invalid request: " + "; ".join(problems), fields=problems)
        return JSONResponse(err.to_wire(), status_code=err.status)


def install_body_limit(app: FastAPI, limit: int) -> None:
    @app.middleware("http")
    async def _limit(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        length = request.headers.get("content-length")
        cap = (
            MAX_ARCHIVE
            if request.url.path.endswith("/archive") or "/images/import" in request.url.path
            else limit
        )
        if length is not None and length.isdigit() and int(length) > cap:
            err = errors.PayloadTooLarge(
                f"request body of {length} bytes exceeds the {cap}-byte limit; "
                "send large files as an archive upload"
            )
            return JSONResponse(err.to_wire(), status_code=err.status)
        return await call_next(request)


def sse(events: AsyncIterator[tuple[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for kind, item in events:
                data = item.model_dump_json() if isinstance(item, ExecResult) else json.dumps(item)
                yield f"event: {kind}\ndata: {data}\n\n".encode()
        except errors.DsecError as e:
            yield f"event: error\ndata: {json.dumps(e.to_wire())}\n\n".encode()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sandbox_router(observe_exec: ExecObserver | None = None) -> APIRouter:
    r = APIRouter(prefix="/v1/sandboxes/{sid}")

    @r.get("", response_model=SandboxInfo)
    async def get_sandbox(sid: str, request: Request) -> SandboxInfo:
        t = await _target(request, sid)
        return await t.edge.get(sid, t.projects)

    _add_exec_routes(r, observe_exec)
    _add_session_routes(r)
    _add_file_routes(r)
    _add_archive_routes(r)
    return r


def _add_exec_routes(r: APIRouter, observe_exec: ExecObserver | None) -> None:
    @r.post("/exec", response_model=ExecResult)
    async def exec_(sid: str, body: ExecRequest, request: Request) -> ExecResult:
        t0 = time.perf_counter()
        t = await _target(request, sid)
        res = await t.edge.exec(sid, body, t.projects)
        if observe_exec is not None:
            observe_exec(time.perf_counter() - t0)
        return res

    @r.post("/exec/stream")
    async def exec_stream(sid: str, body: ExecRequest, request: Request) -> StreamingResponse:
        t = await _target(request, sid)
        await t.edge.get(sid, t.projects)  # fail before the stream starts
        return sse(t.edge.exec_stream(sid, body, t.projects))


def _add_session_routes(r: APIRouter) -> None:
    @r.post("/sessions", response_model=SessionInfo, status_code=201)
    async def session_create(sid: str, body: SessionCreate, request: Request) -> SessionInfo:
        t = await _target(request, sid)
        return await t.edge.session_create(sid, body, t.projects)

    @r.get("/sessions")
    async def session_list(sid: str, request: Request) -> dict[str, list[SessionInfo]]:
        t = await _target(request, sid)
        return {"sessions": await t.edge.session_list(sid, t.projects)}

    @r.post("/sessions/{ses}/run", response_model=SessionResult)
    async def session_run(sid: str, ses: str, body: SessionRun, request: Request) -> SessionResult:
        t = await _target(request, sid)
        return await t.edge.session_run(sid, ses, body, t.projects)

    @r.delete("/sessions/{ses}", status_code=204)
    async def session_close(sid: str, ses: str, request: Request) -> Response:
        t = await _target(request, sid)
        await t.edge.session_close(sid, ses, t.projects)
        return Response(status_code=204)


def _add_file_routes(r: APIRouter) -> None:
    @r.get("/files", response_model=FileContent)
    async def read_file(sid: str, path: str, request: Request) -> FileContent:
        t = await _target(request, sid)
        return await t.edge.read_file(sid, path, t.projects)

    @r.put("/files", status_code=204)
    async def write_file(sid: str, body: FileWrite, request: Request) -> Response:
        t = await _target(request, sid)
        await t.edge.write_file(sid, body, t.projects)
        return Response(status_code=204)

    @r.post("/files/edit")
    async def edit_file(sid: str, body: FileEdit, request: Request) -> dict[str, int]:
        t = await _target(request, sid)
        return {"size": await t.edge.edit_file(sid, body, t.projects)}

    @r.get("/files/stat", response_model=FileStat)
    async def stat_file(sid: str, path: str, request: Request) -> FileStat:
        t = await _target(request, sid)
        return await t.edge.stat_file(sid, path, t.projects)

    @r.get("/files/list")
    async def list_dir(sid: str, path: str, request: Request) -> dict[str, list[FileStat]]:
        t = await _target(request, sid)
        return {"entries": await t.edge.list_dir(sid, path, t.projects)}

    @r.delete("/files", status_code=204)
    async def delete_file(sid: str, path: str, request: Request, recursive: bool = False) -> Response:
        t = await _target(request, sid)
        await t.edge.delete_file(sid, path, recursive, t.projects)
        return Response(status_code=204)


def _add_archive_routes(r: APIRouter) -> None:
    @r.put("/archive", status_code=204)
    async def upload(sid: str, path: str, request: Request) -> Response:
        t = await _target(request, sid)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_ARCHIVE:
                raise errors.PayloadTooLarge(f"archive exceeds {MAX_ARCHIVE} bytes; split the upload")
        await t.edge.upload_tar(sid, path, bytes(data), t.projects)
        return Response(status_code=204)

    @r.get("/archive")
    async def download(sid: str, path: str, request: Request) -> Response:
        t = await _target(request, sid)
        data = await t.edge.download_tar(sid, path, t.projects)
        return Response(content=data, media_type="application/x-tar")
