"""Per-sandbox HTTP routes, shared by the apiserver and the edge's own server.

Both mount the same router; they differ only in how a sandbox id is resolved to
an edge and a project scope (`app.state.resolve`): the apiserver authenticates
the caller with IAM and routes by the edge name in the id, the edge server
trusts the cluster token and the project scope the apiserver forwarded.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute

from dsec import errors
from dsec import models as wire
from dsec.edgeapi import EdgeAPI, Projects
from dsec.http.output import BodyResponse, reply_response

MAX_ARCHIVE = 512 * 1024 * 1024


@dataclass
class Target:
    edge: EdgeAPI
    projects: Projects


Resolver = Callable[[Request, str], Awaitable[Target]]
ExecObserver = Callable[[float, wire.ExecResult], None]


async def _target(request: Request, sid: str) -> Target:
    resolve: Resolver = request.app.state.resolve
    return await resolve(request, sid)


NATIVE_ERROR_PREFIXES = ("/v1/", "/metrics")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.DsecError)
    async def _dsec_error(_: Request, exc: errors.DsecError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if not request.url.path.startswith(NATIVE_ERROR_PREFIXES):
            # Compatibility endpoints answer bad input as the originals do (FastAPI's 422).
            return await request_validation_exception_handler(request, exc)
        problems = []
        for e in exc.errors()[:10]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg')}")
        err = errors.InvalidRequest("invalid request: " + "; ".join(problems), fields=problems)
        return JSONResponse(err.to_wire(), status_code=err.status)


Guard = Callable[[dict[str, Any]], None]
Endpoint = Callable[..., Awaitable[Response]]


def error_response(err: errors.DsecError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(err, errors.AuthError) else None
    return JSONResponse(err.to_wire(), status_code=err.status, headers=headers)


@dataclass(frozen=True)
class Lane:
    method: str
    path: re.Pattern[str]
    endpoint: Endpoint
    body: type[BaseModel] | None
    body_arg: str


class Express:
    """The hot routes of an RL step (create, exec, session runs, file writes, stop, stateless
    code runs) answered without FastAPI's routing and dependency resolution, which cost ~0.3 ms
    per call on a CPU that just woke from idle (a linear scan of ~100 routes, request and
    dependency objects).

    A lane calls the very endpoint function its FastAPI route calls, with the path parameters
    and the body model; a body that does not validate goes on to FastAPI unchanged, and what
    the endpoint raises goes to the app's exception handlers, so bad input gets exactly the
    answers it always got. Only endpoints whose parameters are the path, the JSON body and
    the request may have a lane. The OpenAPI document still lists the route."""

    def __init__(self) -> None:
        self.lanes: dict[str, list[Lane]] = {}

    def add(
        self,
        method: str,
        path: str,
        endpoint: Endpoint,
        body: type[BaseModel] | None = None,
        body_arg: str = "body",
    ) -> None:
        regex = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path) + "$")
        self.lanes.setdefault(method, []).append(Lane(method, regex, endpoint, body, body_arg))

    def derive(self, routes: Iterable[BaseRoute], *endpoints: Endpoint) -> None:
        """Give each of `endpoints` a lane taken from its FastAPI route in `routes`: the
        method, the path and the body model as the route declares them, stated nowhere else."""
        by_endpoint = {r.endpoint: r for r in routes if isinstance(r, APIRoute)}
        for endpoint in endpoints:
            route = by_endpoint.get(endpoint)
            if route is None:
                raise RuntimeError(f"{endpoint.__name__} is not the endpoint of any route given")
            dep = route.dependant
            if dep.query_params or dep.header_params or dep.cookie_params or dep.dependencies:
                raise RuntimeError(
                    f"{route.path}: a lane passes only the path, the JSON body and the request"
                )
            methods = sorted(route.methods or ())
            if len(methods) != 1 or len(dep.body_params) > 1:
                raise RuntimeError(f"{route.path}: a lane needs one method and at most one body")
            (method,) = methods
            body: type[BaseModel] | None = None
            arg = "body"
            if dep.body_params:
                field = dep.body_params[0]
                annotation = field.field_info.annotation
                if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                    raise RuntimeError(f"{route.path}: a lane's body must be a pydantic model")
                body, arg = annotation, field.name
            self.add(method, route.path_format, endpoint, body, arg)

    def match(self, scope: dict[str, Any]) -> tuple[Lane, dict[str, str]] | None:
        for lane in self.lanes.get(scope["method"], ()):
            m = lane.path.match(scope["path"])
            if m is not None:
                return lane, m.groupdict()
        return None


class Gate:
    """Checks that run before any body is read: the declared size, then an optional guard
    (authentication) that raises a DsecError; then the body is read under its route's cap
    (`caps`), whatever the framing (chunked bodies have no content-length): a JSON body (or
    one without a content type, which FastAPI parses as JSON) is read whole, checked for text
    JSON cannot carry (lone UTF-16 surrogates) and replayed; any other body streams through a
    counter that answers 413 the moment it passes the cap. Then the express lanes, if any.
    Plain ASGI on purpose: Starlette's BaseHTTPMiddleware costs an extra task and stream per
    request (~0.3 ms each)."""

    def __init__(
        self,
        app: Any,
        *,
        limit: int,
        guard: Guard | None = None,
        express: Express | None = None,
        caps: Callable[[str, str, int], int] | None = None,
    ):
        self.app = app
        self.limit = limit
        self.guard = guard
        self.express = express
        self.caps = caps or body_cap

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_body = _has_body(scope)
        try:
            cap = self._check(scope)
        except errors.DsecError as err:
            await reject(err, scope, send, close=has_body)
            return
        hit = self.express.match(scope) if self.express is not None else None
        body: bytes | None = None
        if has_body and _json_content(scope, untyped=True):
            body = await self._read(scope, receive, send, cap)
            if body is None:
                return
            # A lane's parser (pydantic's) refuses lone surrogates itself: the scan is left
            # for when it fails and FastAPI's (json.loads, which accepts them) takes over.
            if hit is None or hit[0].body is None or not _json_content(scope):
                try:
                    check_json_text(body)
                except errors.DsecError as err:
                    await reject(err, scope, send)
                    return
            receive = _replay(body, receive)
        if hit is not None:
            await self._express(hit[0], hit[1], body, scope, receive, send)
        elif has_body and body is None:
            await _Limited(self.app, cap)(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _read(self, scope: dict[str, Any], receive: Any, send: Any, cap: int) -> bytes | None:
        """The whole body, or None once answered (over `cap`) or when the client went away."""
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > cap:
                await reject(_too_large(cap), scope, send, close=more)
                return None
        return bytes(body)

    async def _express(
        self,
        lane: Lane,
        kwargs: dict[str, Any],
        body: bytes | None,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
    ) -> None:
        if lane.body is not None:
            if body is None or not _json_content(scope):
                await self.app(scope, receive, send)
                return
            try:
                kwargs[lane.body_arg] = lane.body.model_validate_json(body)
            except ValidationError:
                try:
                    check_json_text(body)
                except errors.DsecError as err:
                    await reject(err, scope, send)
                    return
                await self.app(scope, receive, send)  # FastAPI's own errors (the body is replayed)
                return
        request = Request(scope, receive)
        try:
            response = await lane.endpoint(request=request, **kwargs)
        except Exception as exc:  # answered by the app's handler for it, as FastAPI would
            handler = _exception_handler(scope, exc)
            if handler is None:
                raise
            answer = handler(request, exc)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)

    def _check(self, scope: dict[str, Any]) -> int:
        """The body cap of this request; raises when the declared length exceeds it or the
        guard refuses the caller."""
        cap = self.caps(scope["method"], scope["path"], self.limit)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > cap:
                raise errors.PayloadTooLarge(
                    f"request body of {int(value)} bytes exceeds the {cap}-byte limit of this route; "
                    "send large files as an archive upload",
                    limit=cap,
                )
        if self.guard is not None:
            self.guard(scope)
        return cap


class _Limited:
    """Runs the app with a receive channel that counts body bytes: past `cap` the caller gets
    413 (if nothing was answered yet), the app sees a disconnect and whatever it answers
    after that is dropped."""

    def __init__(self, app: Any, cap: int) -> None:
        self.app = app
        self.cap = cap
        self.seen = 0
        self.tripped = False
        self.started = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def limited_receive() -> dict[str, Any]:
            if self.tripped:
                return {"type": "http.disconnect"}
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                self.seen += len(message.get("body", b""))
                if self.seen > self.cap:
                    self.tripped = True
                    if not self.started:
                        self.started = True
                        await reject(_too_large(self.cap), scope, send, close=message.get("more_body", False))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if self.tripped:
                return
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not self.tripped:
                raise  # the app's own failure; a cut-off body is answered already


# Routes whose bodies may be large (file contents, stdin, code, archives); every other route
# takes a small JSON document (a spec, a policy, a list of ids).
SMALL_BODY = 4 * 1024 * 1024
_LARGE_BODY = re.compile(
    r"^(?:/v1/sandboxes/[^/]+/(?:exec|exec/stream|verify|files|files/edit|sessions/[^/]+/run)"
    r"|/v1/fncall/(?:run|jupyter)|/run_code|/run_jupyter|/sandboxfusion/[^/]+/run_(?:code|jupyter)"
    r"|/swerex/.*)$"
)


_UPLOADS = frozenset({"/v1/images/import", "/v1/images/build", "/v1/images/dockerbuild"})  # archives


def body_cap(method: str, path: str, limit: int) -> int:
    """The most bytes a request body to `path` may carry."""
    if path.endswith("/archive") or path in _UPLOADS:
        return max(MAX_ARCHIVE, limit)
    if _LARGE_BODY.match(path):
        return limit
    return min(limit, SMALL_BODY)


def _too_large(cap: int) -> errors.PayloadTooLarge:
    return errors.PayloadTooLarge(
        f"request body exceeds the {cap}-byte limit of this route; send less, or large files as an "
        "archive upload",
        limit=cap,
    )


async def reject(err: errors.DsecError, scope: dict[str, Any], send: Any, *, close: bool = False) -> None:
    """Answer `err` without reading the body. `close`: the client may still be sending one,
    so the connection ends after the answer instead of reading (and discarding) the rest."""
    response = error_response(err)
    if scope["path"].startswith("/swerex/"):  # SWE-ReX clients read FastAPI's {"detail": ...}
        detail = f"Invalid API Key: {err.message}" if type(err) is errors.AuthError else err.message
        response = JSONResponse({"detail": detail, **err.to_wire()}, status_code=err.status)
    if close:
        response.headers["connection"] = "close"

    async def no_body() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)


# A surrogate pair, or one surrogate alone (a literal prefix, so the scan runs at C speed).
_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}"
)


def _escaped(body: bytes, at: int) -> bool:
    """Whether the backslash at `at` is itself escaped (an odd run of backslashes before it)."""
    n = 0
    while at - n - 1 >= 0 and body[at - n - 1] == 0x5C:
        n += 1
    return n % 2 == 1


def check_json_text(body: bytes) -> None:
    """Refuse JSON text that names a lone UTF-16 surrogate (``"\\ud800"``): no valid string
    holds one, and it would fail later, when the text is encoded for the sandbox."""
    if b"\\u" not in body:
        return
    for m in _SURROGATE.finditer(body):
        pair = m.end() - m.start() == 12
        if _escaped(body, m.start()) != pair:
            continue  # a real pair, or text that merely looks like an escape
        # a real escape of a lone surrogate, or the low half of a "pair" whose high half is text
        break
    else:
        return
    raise errors.InvalidRequest(
        "the JSON body contains a lone UTF-16 surrogate escape (such as \\ud800): strings must be "
        "valid Unicode; send binary data base64-encoded"
    )


def _exception_handler(scope: dict[str, Any], exc: Exception) -> Callable[..., Any] | None:
    """The handler Starlette's ExceptionMiddleware would pick for `exc` (status, then class)."""
    handlers: dict[Any, Callable[..., Any]] = scope["app"].exception_handlers
    if isinstance(exc, StarletteHTTPException) and exc.status_code in handlers:
        return handlers[exc.status_code]
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


def _json_content(scope: dict[str, Any], untyped: bool = False) -> bool:
    """Whether the body is JSON by its media type; `untyped`: what a body without one is
    (FastAPI parses it as JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return untyped


def _has_body(scope: dict[str, Any]) -> bool:
    """Whether the request says a body follows (HTTP/1.1: a length or chunked framing)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False


def _replay(body: bytes, receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A receive channel that yields `body` once, then the real channel (disconnects)."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # type: ignore[no-any-return]

    return again


def bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text[:7].lower() == "bearer " else None
    return None


def sse(events: AsyncIterator[bytes], first: bytes = b"") -> BodyResponse:
    """Server-sent events already encoded (`first`: what was taken to see the stream admitted);
    a failure on the way is the last event, `error`."""

    async def body() -> AsyncIterator[bytes]:
        yield first
        try:
            async for piece in events:
                yield piece
        except errors.DsecError as e:
            yield f"event: error\ndata: {json.dumps(e.to_wire())}\n\n".encode()

    async def done() -> None:
        close = getattr(events, "aclose", None)  # (an async generator's, at once: not when collected)
        if close is not None:
            await close()

    return BodyResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, done=done, idle=True
    )


def model_response(model: BaseModel, status_code: int = 200) -> Response:
    """Serialize once: a returned Response skips FastAPI's re-validation of response_model
    (the models are already validated; that pass cost ~0.3 ms per call)."""
    return Response(model.model_dump_json().encode(), status_code=status_code, media_type="application/json")


def sandbox_router(observe_exec: ExecObserver | None = None, express: Express | None = None) -> APIRouter:
    """The per-sandbox routes; the hot ones also get an express lane when `express` is given."""
    r = APIRouter(prefix="/v1/sandboxes/{sid}")
    lanes = express if express is not None else Express()  # a throwaway: no lanes

    @r.get("", response_model=wire.SandboxInfo)
    async def get_sandbox(sid: str, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.get(sid, t.projects))

    @r.post("/pause", response_model=wire.SandboxInfo)
    async def pause(sid: str, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.pause(sid, t.projects))

    @r.post("/resume", response_model=wire.SandboxInfo)
    async def resume(sid: str, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.resume(sid, t.projects))

    @r.post("/snapshot", response_model=wire.SnapshotInfo, status_code=201)
    async def snapshot(sid: str, body: wire.SnapshotRequest, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.snapshot(sid, body, t.projects), 201)

    @r.put("/network")
    async def set_network(sid: str, body: wire.NetworkPolicy, request: Request) -> dict[str, Any]:
        t = await _target(request, sid)
        return await t.edge.set_network(sid, body, t.projects)

    @r.delete("/network")
    async def delete_network(sid: str, request: Request) -> dict[str, Any]:
        t = await _target(request, sid)
        return await t.edge.set_network(sid, None, t.projects)

    @r.get("/network")
    async def get_network(sid: str, request: Request) -> dict[str, Any]:
        t = await _target(request, sid)
        return await t.edge.network(sid, t.projects)

    @r.post("/protect")
    async def protect(sid: str, body: wire.ProtectRequest, request: Request) -> dict[str, Any]:
        t = await _target(request, sid)
        return {"protected": await t.edge.protect(sid, body.paths, t.projects)}

    @r.post("/verify", response_model=wire.ExecResult)
    async def verify(sid: str, body: wire.ExecRequest, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.verify(sid, body, t.projects))

    @r.post("/checkpoint", response_model=wire.Checkpoint, status_code=201)
    async def checkpoint(sid: str, request: Request, body: wire.CheckpointRequest | None = None) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.checkpoint(sid, body or wire.CheckpointRequest(), t.projects), 201)

    @r.get("/trajectory", response_model=wire.Trajectory)
    async def trajectory(
        sid: str,
        request: Request,
        after_seq: int = Query(0, ge=0, le=2**63 - 1),
        limit: int | None = Query(None, ge=1, le=1_000_000),
    ) -> dict[str, Any]:
        t = await _target(request, sid)
        return await t.edge.trajectory(sid, after_seq, limit, t.projects)

    @r.get("/trajectory/export")
    async def trajectory_export(sid: str, request: Request, format: str = "jsonl") -> Response:
        t = await _target(request, sid)
        data = await t.edge.trajectory_export(sid, format, t.projects)
        media = "application/x-ndjson" if format == "jsonl" else "application/vnd.apache.parquet"
        return Response(content=data, media_type=media)

    _add_exec_routes(r, observe_exec, lanes)
    _add_session_routes(r, lanes)
    _add_file_routes(r, lanes)
    _add_archive_routes(r)
    return r


def _add_exec_routes(r: APIRouter, observe_exec: ExecObserver | None, lanes: Express) -> None:
    @r.post("/exec", response_model=wire.ExecResult)
    async def exec_(sid: str, body: wire.ExecRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        t = await _target(request, sid)
        reply = await t.edge.exec_reply(sid, body, t.projects)
        if observe_exec is not None:
            observe_exec(time.perf_counter() - t0, reply.meta)
        return reply_response(reply)

    @r.post("/exec/stream")
    async def exec_stream(sid: str, body: wire.ExecRequest, request: Request) -> Response:
        t = await _target(request, sid)
        events = t.edge.exec_stream(sid, body, t.projects)
        first = await anext(events)  # admitted (or refused: a 4xx) before the stream is answered
        return sse(events, first)

    lanes.derive(r.routes, exec_)


def _add_session_routes(r: APIRouter, lanes: Express) -> None:
    @r.post("/sessions", response_model=wire.SessionInfo, status_code=201)
    async def session_create(sid: str, body: wire.SessionCreate, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.session_create(sid, body, t.projects), 201)

    @r.get("/sessions")
    async def session_list(sid: str, request: Request) -> dict[str, list[wire.SessionInfo]]:
        t = await _target(request, sid)
        return {"sessions": await t.edge.session_list(sid, t.projects)}

    @r.post("/sessions/{ses}/run", response_model=wire.SessionResult)
    async def session_run(sid: str, ses: str, body: wire.SessionRun, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.session_run(sid, ses, body, t.projects))

    @r.delete("/sessions/{ses}", status_code=204)
    async def session_close(sid: str, ses: str, request: Request) -> Response:
        t = await _target(request, sid)
        await t.edge.session_close(sid, ses, t.projects)
        return Response(status_code=204)

    lanes.derive(r.routes, session_run)


def _add_file_routes(r: APIRouter, lanes: Express) -> None:
    @r.get("/files", response_model=wire.FileContent)
    async def read_file(sid: str, path: str, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.read_file(sid, path, t.projects))

    @r.put("/files", status_code=204)
    async def write_file(sid: str, body: wire.FileWrite, request: Request) -> Response:
        t = await _target(request, sid)
        await t.edge.write_file(sid, body, t.projects)
        return Response(status_code=204)

    @r.post("/files/edit")
    async def edit_file(sid: str, body: wire.FileEdit, request: Request) -> dict[str, int]:
        t = await _target(request, sid)
        return {"size": await t.edge.edit_file(sid, body, t.projects)}

    @r.get("/files/stat", response_model=wire.FileStat)
    async def stat_file(sid: str, path: str, request: Request) -> Response:
        t = await _target(request, sid)
        return model_response(await t.edge.stat_file(sid, path, t.projects))

    @r.get("/files/list")
    async def list_dir(sid: str, path: str, request: Request) -> dict[str, list[wire.FileStat]]:
        t = await _target(request, sid)
        return {"entries": await t.edge.list_dir(sid, path, t.projects)}

    @r.delete("/files", status_code=204)
    async def delete_file(sid: str, path: str, request: Request, recursive: bool = False) -> Response:
        t = await _target(request, sid)
        await t.edge.delete_file(sid, path, recursive, t.projects)
        return Response(status_code=204)

    lanes.derive(r.routes, write_file)


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
        chunks = t.edge.download_tar(sid, path, t.projects)
        first = await anext(chunks, b"")  # the archive is built (or refused: a 4xx) before we answer

        async def body() -> AsyncIterator[bytes]:
            yield first
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(body(), media_type="application/x-tar")
