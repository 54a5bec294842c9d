"""The edge contract: what the apiserver asks of an edge, whatever runs it.

`dsec.edge.local.LocalEdge` calls an edge in the same process (what `dsec up` runs: no
second network hop); `dsec.apiserver.edges.HttpEdge` calls a remote `dsec edge` over its
HTTP API with the cluster token. Both scope every per-sandbox call to the caller's visible
projects (`projects`, None = all), so the apiserver needs no per-sandbox state: the edge
knows each sandbox's project. This module imports only the wire models.
"""

import base64
import builtins
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from dsec import errors
from dsec import models as wire

Projects = set[str] | None


def edge_of(sandbox_id: str) -> str:
    """The owning edge's name, encoded in the id (`<edge>-<random>`)."""
    name, sep, rest = sandbox_id.partition("-")
    if not sep or not name or not rest:
        raise errors.SandboxNotFound(f"{sandbox_id!r} is not a sandbox id (expected <edge>-<random>)")
    return name


class ExecReply(ABC):
    """An exec's ExecResult as the JSON body that carries it, in pieces. The output stays
    bytes in the service and becomes JSON text only piece by piece as it is written
    (`dsec.http.output`), so an answer costs its size once, never a decoded copy; what it holds
    is released by `aclose` (after the body was sent, or instead)."""

    meta: wire.ExecResult  # every field but the output (stdout and stderr empty)
    length: int | None = None  # bytes of the body, when known before it is sent

    @abstractmethod
    def body(self) -> AsyncIterator[bytes]: ...
    @abstractmethod
    async def aclose(self) -> None: ...

    async def result(self) -> wire.ExecResult:
        """The whole answer, decoded (in-process callers; the SDK reads the same JSON)."""
        try:
            return wire.ExecResult.model_validate_json(b"".join([piece async for piece in self.body()]))
        finally:
            await self.aclose()


class EdgeAPI(ABC):
    name: str
    url: str | None = None
    # whether it can stop answering while this process runs (an edge on another host, or in
    # another process): the apiserver then gives up its sandboxes (sandbox_lost)
    can_be_lost: bool = True

    @abstractmethod
    async def create(self, spec: wire.SandboxSpec) -> wire.SandboxInfo: ...
    @abstractmethod
    async def get(self, sid: str, projects: Projects) -> wire.SandboxInfo: ...
    @abstractmethod
    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> list[wire.SandboxInfo]: ...
    @abstractmethod
    async def stop(self, sid: str, projects: Projects) -> None: ...
    @abstractmethod
    async def exec_reply(self, sid: str, req: wire.ExecRequest, projects: Projects) -> ExecReply:
        """An exec's answer as the JSON an HTTP answer carries (see `ExecReply`)."""

    async def exec(self, sid: str, req: wire.ExecRequest, projects: Projects) -> wire.ExecResult:
        return await (await self.exec_reply(sid, req, projects)).result()

    @abstractmethod
    def exec_stream(self, sid: str, req: wire.ExecRequest, projects: Projects) -> AsyncIterator[bytes]:
        """The exec's server-sent events, encoded (docs/API.md). The first piece (often empty)
        comes once the stream is admitted: a refusal is raised before it."""

    @abstractmethod
    async def session_create(
        self, sid: str, req: wire.SessionCreate, projects: Projects
    ) -> wire.SessionInfo: ...
    @abstractmethod
    async def session_list(self, sid: str, projects: Projects) -> builtins.list[wire.SessionInfo]: ...
    @abstractmethod
    async def session_run(
        self, sid: str, ses: str, req: wire.SessionRun, projects: Projects
    ) -> wire.SessionResult: ...
    @abstractmethod
    async def session_close(self, sid: str, ses: str, projects: Projects) -> None: ...
    @abstractmethod
    async def read_file(self, sid: str, path: str, projects: Projects) -> wire.FileContent: ...
    @abstractmethod
    async def write_file(self, sid: str, req: wire.FileWrite, projects: Projects) -> None: ...
    @abstractmethod
    async def edit_file(self, sid: str, req: wire.FileEdit, projects: Projects) -> int: ...
    @abstractmethod
    async def stat_file(self, sid: str, path: str, projects: Projects) -> wire.FileStat: ...
    @abstractmethod
    async def list_dir(self, sid: str, path: str, projects: Projects) -> builtins.list[wire.FileStat]: ...
    @abstractmethod
    async def delete_file(self, sid: str, path: str, recursive: bool, projects: Projects) -> None: ...
    @abstractmethod
    async def upload_tar(self, sid: str, path: str, data: bytes, projects: Projects) -> None: ...
    @abstractmethod
    def download_tar(self, sid: str, path: str, projects: Projects) -> AsyncIterator[bytes]: ...
    # download_tar: the tar's bytes in chunks; the first chunk comes once the archive was built
    # (or refused), so a caller that takes it first can still answer an error.
    @abstractmethod
    async def status(self) -> wire.EdgeStatus: ...
    @abstractmethod
    async def configure_pool(self, spec: wire.PoolSpec) -> wire.PoolInfo: ...
    @abstractmethod
    async def prewarm(self, spec: wire.PoolSpec, count: int, project: str | None = None) -> wire.PoolInfo: ...
    @abstractmethod
    async def pools(self) -> builtins.list[wire.PoolInfo]: ...
    @abstractmethod
    async def pause(self, sid: str, projects: Projects) -> wire.SandboxInfo: ...
    @abstractmethod
    async def resume(self, sid: str, projects: Projects) -> wire.SandboxInfo: ...
    @abstractmethod
    async def pause_project(self, project: str) -> builtins.list[str]: ...
    @abstractmethod
    async def snapshot(
        self, sid: str, req: wire.SnapshotRequest, projects: Projects
    ) -> wire.SnapshotInfo: ...
    @abstractmethod
    async def fork(
        self, sid: str, req: wire.ForkRequest, projects: Projects
    ) -> builtins.list[wire.SandboxInfo]: ...
    @abstractmethod
    async def checkpoint(
        self, sid: str, req: wire.CheckpointRequest, projects: Projects
    ) -> wire.Checkpoint: ...
    @abstractmethod
    async def checkpoints(self, projects: Projects) -> builtins.list[wire.Checkpoint]: ...
    @abstractmethod
    async def restore(self, cid: str, req: wire.RestoreRequest, projects: Projects) -> wire.SandboxInfo: ...
    @abstractmethod
    async def delete_checkpoint(self, cid: str, projects: Projects) -> None: ...
    @abstractmethod
    async def protect(
        self, sid: str, paths: builtins.list[str], projects: Projects
    ) -> builtins.list[str]: ...
    @abstractmethod
    async def verify(self, sid: str, req: wire.ExecRequest, projects: Projects) -> wire.ExecResult: ...
    @abstractmethod
    async def set_network(
        self, sid: str, policy: wire.NetworkPolicy | None, projects: Projects
    ) -> dict[str, Any]: ...
    @abstractmethod
    async def network(self, sid: str, projects: Projects) -> dict[str, Any]: ...
    @abstractmethod
    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]: ...
    @abstractmethod
    async def delete_snapshot(self, name: str, projects: Projects = None) -> None: ...
    @abstractmethod
    async def trajectory(
        self, sid: str, after_seq: int, limit: int | None, projects: Projects
    ) -> dict[str, Any]: ...
    @abstractmethod
    async def trajectory_export(self, sid: str, fmt: str, projects: Projects) -> bytes: ...
    @abstractmethod
    async def fncall_run(self, req: wire.FnCallRequest) -> wire.FnCallResult: ...
    @abstractmethod
    async def fncall_jupyter(self, req: wire.JupyterRequest) -> wire.JupyterResult: ...

    @abstractmethod
    async def images(self) -> builtins.list[dict[str, Any]]: ...
    @abstractmethod
    async def layers(self) -> builtins.list[dict[str, Any]]: ...
    @abstractmethod
    async def build_image(self, recipe: str) -> dict[str, Any]: ...
    @abstractmethod
    async def import_image(self, name: str, data: bytes) -> dict[str, Any]: ...
    @abstractmethod
    async def pull_image(self, req: wire.EdgePull) -> dict[str, Any]: ...
    @abstractmethod
    async def delete_image(self, name: str) -> None: ...
    @abstractmethod
    async def image(self, name: str) -> dict[str, Any]: ...
    @abstractmethod
    def build_dockerfile(self, req: wire.EdgeBuild, context: bytes) -> AsyncIterator[bytes]:
        """A Dockerfile build's events as NDJSON lines: {"type": "log", "line"} as it runs,
        then {"type": "result", "image"} or {"type": "error", "error": <the wire error>}."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass


def decode_write(req: wire.FileWrite) -> bytes:
    if req.encoding == "base64":
        try:
            return base64.b64decode(req.content, validate=True)
        except ValueError as e:
            raise errors.InvalidRequest("content is not valid base64; send encoding='utf-8' for text") from e
    return req.content.encode()
