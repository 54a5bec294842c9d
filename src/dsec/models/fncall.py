"""Wire models of the fncall backend (shared by the edge, the apiserver and the SDK)."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from dsec.models.requests import BackendName
from dsec.models.sandbox import MiB


def _file_names(v: list[str]) -> list[str]:
    for name in v:
        if not name or "\0" in name or len(name) > 4096:
            raise ValueError(f"file name {name[:80]!r} must be a non-empty path without NUL bytes")
    return v


def _base64_files(v: dict[str, str | None]) -> dict[str, str | None]:
    _file_names(list(v))
    for name, data in v.items():
        if data is None:
            continue
        try:
            base64.b64decode(data.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error) as e:
            raise ValueError(f"files[{name!r}] must be base64 (encode the file's bytes first): {e}") from None
    return v


PROJECT_DOC = (
    "the project whose workers run the call (workers are never shared across projects); the "
    "apiserver sets it from the caller's token: one of its projects, the first when not given"
)

WORKER_BACKEND = "container"  # fncall workers are container sandboxes (the pool uses per-call host cgroups)
BACKEND_DOC = (
    "the isolation tier of the call: fncall workers are container sandboxes, so only 'container' "
    "(the project's allowed_backends must include it); for gvisor or microvm create a sandbox with "
    "that backend and exec in it"
)


def _backend_field() -> Any:
    # Left out of what is sent when it is the default: older edges keep reading the requests.
    return Field(WORKER_BACKEND, exclude_if=lambda v: v == WORKER_BACKEND, description=BACKEND_DOC)


class Stage(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    truncated: bool = False


class FnCallRequest(BaseModel):
    language: str = "python"
    code: str = Field(max_length=16 * MiB)
    stdin: str | None = Field(None, max_length=16 * MiB)
    files: dict[str, str | None] = Field(default_factory=dict, description="relative path -> base64")
    fetch_files: list[str] = Field(default_factory=list)
    compile_timeout: float = Field(10.0, gt=0, le=600)

    _files_are_base64 = field_validator("files")(_base64_files)
    _fetch_names = field_validator("fetch_files")(_file_names)
    run_timeout: float = Field(10.0, gt=0, le=600)
    memory_limit_mb: int = Field(-1, ge=-1, le=65536)
    max_output: int = Field(1 * MiB, ge=0, le=64 * MiB)
    image: str = "code"
    backend: BackendName = _backend_field()
    project: str | None = Field(None, max_length=256, description=PROJECT_DOC)


class FnCallResult(BaseModel):
    compile: Stage | None = None
    run: Stage | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    worker: str


class JupyterRequest(BaseModel):
    cells: list[str] = Field(max_length=1000)
    cell_timeout: float = Field(0.0, ge=0, le=600)
    total_timeout: float = Field(45.0, gt=0, le=3600)
    memory_limit_mb: int = Field(-1, ge=-1, le=65536)
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    image: str = "code"
    backend: BackendName = _backend_field()
    project: str | None = Field(None, max_length=256, description=PROJECT_DOC)

    _files_are_base64 = field_validator("files")(_base64_files)
    _fetch_names = field_validator("fetch_files")(_file_names)


class Cell(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class JupyterResult(BaseModel):
    driver: Stage | None
    cells: list[Cell] | None
    files: dict[str, str | None] = Field(default_factory=dict)
    worker: str
