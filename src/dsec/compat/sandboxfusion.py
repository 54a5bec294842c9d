"""SandboxFusion-compatible endpoints: `/run_code`, `/run_jupyter`, `/v1/ping`.

Served on the fncall backend. The status semantics follow SandboxFusion:
`Success` when every stage finished with exit code 0, `Failed` when the code did
not (a compile error, a non-zero exit, a time limit), and `SandboxError` only when
the platform failed, never for the user's code. Clients that know only an
endpoint URL authenticate with the token in the path
(`/sandboxfusion/<token>/run_code`, for the `sandbox-fusion` client whose
endpoint is a base URL) or in the query (`/run_code?token=...`, for verl's full
`run_code` URL); an `Authorization: Bearer` header works too. `compat_auth=False`
turns authentication off for a trusted network.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec import errors
from dsec.fncall import languages
from dsec.fncall.tenancy import ANONYMOUS
from dsec.http.routes import Express
from dsec.models import FnCallRequest, FnCallResult, JupyterRequest, JupyterResult, Stage

log = logging.getLogger("dsec.compat.sandboxfusion")

# Accepted like SandboxFusion (an unknown name is FastAPI's 422); the ones the image does not
# run are refused with a 400 that names the reason (dsec.fncall.languages).
LANGUAGES = (*languages.LANGUAGES, *languages.UNAVAILABLE)
Language = Literal[LANGUAGES]  # type: ignore[valid-type]


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str
    language: Language = "python"
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class RunJupyterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = 0
    total_timeout: float = 45
    memory_limit_MB: int = -1
    kernel: Literal["python3"] = "python3"
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


def _stage(s: Stage | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return s.model_dump(include={"status", "execution_time", "return_code", "stdout", "stderr"})


def _files(files: dict[str, str | None]) -> dict[str, str]:
    # SandboxFusion clients type this as {str: str}: leave out what was not found.
    return {k: v for k, v in files.items() if v is not None}


def run_code_response(res: FnCallResult) -> dict[str, Any]:
    stages = [s for s in (res.compile, res.run) if s is not None]
    ok = res.run is not None and all(s.status == "Finished" and s.return_code == 0 for s in stages)
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "compile_result": _stage(res.compile),
        "run_result": _stage(res.run),
        "executor_pod_name": res.worker or None,
        "files": _files(res.files),
    }


def jupyter_response(res: JupyterResult) -> dict[str, Any]:
    cells = [c.model_dump() for c in res.cells or []]
    ok = res.driver is not None and res.driver.status == "Finished" and not any(c["error"] for c in cells)
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "driver": _stage(res.driver),
        "cells": cells,
        "executor_pod_name": res.worker or None,
        "files": _files(res.files),
    }


def sandbox_error(message: str) -> dict[str, Any]:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}  # fmt: skip


RunFn = Callable[[FnCallRequest], Awaitable[FnCallResult]]
JupyterFn = Callable[[JupyterRequest], Awaitable[JupyterResult]]
AuthFn = Callable[[str | None], str]  # token -> the caller's project (its workers serve the call)


@contextlib.contextmanager
def _as_request_error() -> Iterator[None]:
    """A value the original accepts in its schema but ours bounds (a negative timeout, a
    non-base64 file) is bad input: FastAPI's 422, as for any other malformed field."""
    try:
        yield
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


class _Compat:
    def __init__(self, run: RunFn, jupyter: JupyterFn, authenticate: AuthFn | None) -> None:
        self.run = run
        self.jupyter = jupyter
        self.authenticate = authenticate

    def check(self, request: Request, token: str | None) -> str:
        """Authenticate; the project whose fncall workers run the call."""
        if self.authenticate is None:
            return ANONYMOUS
        if token is None:
            token = request.query_params.get("token")
        if token is None:
            auth = request.headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        return self.authenticate(token)

    async def run_code(self, body: RunCodeRequest, request: Request, token: str | None) -> JSONResponse:
        project = self.check(request, token)
        with _as_request_error():
            req = FnCallRequest(
                language=body.language, code=body.code, stdin=body.stdin, files=body.files,
                fetch_files=body.fetch_files, compile_timeout=body.compile_timeout,
                run_timeout=body.run_timeout, memory_limit_mb=body.memory_limit_MB, project=project,
            )  # fmt: skip
        try:
            return JSONResponse(run_code_response(await self.run(req)))
        except (errors.InvalidRequest, errors.Forbidden) as e:
            # An unsupported language, or a project whose tier policy excludes the fncall
            # workers' backend: the request is wrong, not the platform.
            return JSONResponse(e.to_wire(), status_code=e.status)
        except errors.DsecError as e:
            log.warning("run_code failed on the platform side: %s", e)
            return JSONResponse(sandbox_error(e.message))

    async def run_jupyter(self, body: RunJupyterRequest, request: Request, token: str | None) -> JSONResponse:
        project = self.check(request, token)
        with _as_request_error():
            req = JupyterRequest(
                cells=body.cells, cell_timeout=body.cell_timeout, total_timeout=body.total_timeout,
                memory_limit_mb=body.memory_limit_MB, files=body.files, fetch_files=body.fetch_files,
                project=project,
            )  # fmt: skip
        try:
            return JSONResponse(jupyter_response(await self.jupyter(req)))
        except errors.Forbidden as e:  # the project's tier policy excludes the workers' backend
            return JSONResponse(e.to_wire(), status_code=e.status)
        except errors.DsecError as e:
            return JSONResponse({**sandbox_error(e.message), "driver": None, "cells": []})


def sandboxfusion_router(
    run: RunFn, jupyter: JupyterFn, authenticate: AuthFn | None, express: Express | None = None
) -> APIRouter:
    c = _Compat(run, jupyter, authenticate)
    r = APIRouter(tags=["SandboxFusion compatibility"])

    @r.post("/run_code")
    async def run_code(body: RunCodeRequest, request: Request) -> JSONResponse:
        return await c.run_code(body, request, None)

    @r.post("/sandboxfusion/{token}/run_code")
    async def run_code_t(token: str, body: RunCodeRequest, request: Request) -> JSONResponse:
        return await c.run_code(body, request, token)

    if express is not None:
        express.derive(r.routes, run_code, run_code_t)

    # The rest are served at both paths by one endpoint (the token, if any, is the path's).
    async def run_jupyter(body: RunJupyterRequest, request: Request) -> JSONResponse:
        return await c.run_jupyter(body, request, request.path_params.get("token"))

    async def ping() -> str:
        return "pong"

    for prefix in ("", "/sandboxfusion/{token}"):
        r.add_api_route(prefix + "/run_jupyter", run_jupyter, methods=["POST"])
        r.add_api_route(prefix + "/v1/ping", ping, methods=["GET"])
    return r


COMPAT_PATHS = ("/run_code", "/run_jupyter", "/sandboxfusion/")
