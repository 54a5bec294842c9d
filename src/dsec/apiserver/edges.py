"""How an apiserver talks to edges: one interface, an in-process and an HTTP twin.

`LocalEdge` calls an :class:`~dsec.edge.Edge` in the same process (what `dsec up`
runs: no second network hop). `HttpEdge` calls a remote `dsec edge` over its
HTTP API with the cluster token. Both scope every per-sandbox call to the
caller's visible projects (`projects`, None = all), so the apiserver needs no
per-sandbox state: the edge knows each sandbox's project.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import hashlib
import json
import tempfile
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from dsec import errors
from dsec.edge import Edge
from dsec.edge.edge import encode_content
from dsec.edge.files import off_loop
from dsec.edge.pools import PoolInfo, PoolSpec
from dsec.fncall.models import FnCallRequest, FnCallResult, JupyterRequest, JupyterResult
from dsec.models import (
    Checkpoint,
    CheckpointRequest,
    EdgeStatus,
    ExecRequest,
    ExecResult,
    FileContent,
    FileEdit,
    FileStat,
    FileWrite,
    NetworkPolicy,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
    SessionCreate,
    SessionInfo,
    SessionResult,
    SessionRun,
    SnapshotInfo,
    SnapshotRequest,
)

Projects = set[str] | None


def edge_of(sandbox_id: str) -> str:
    """The owning edge's name, encoded in the id (`<edge>-<random>`)."""
    name, sep, rest = sandbox_id.partition("-")
    if not sep or not name or not rest:
        raise errors.SandboxNotFound(f"{sandbox_id!r} is not a sandbox id (expected <edge>-<random>)")
    return name


class EdgeAPI(ABC):
    name: str
    url: str | None = None

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> SandboxInfo: ...
    @abstractmethod
    async def get(self, sid: str, projects: Projects) -> SandboxInfo: ...
    @abstractmethod
    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> list[SandboxInfo]: ...
    @abstractmethod
    async def stop(self, sid: str, projects: Projects) -> None: ...
    @abstractmethod
    async def exec(self, sid: str, req: ExecRequest, projects: Projects) -> ExecResult: ...
    @abstractmethod
    def exec_stream(
        self, sid: str, req: ExecRequest, projects: Projects
    ) -> AsyncIterator[tuple[str, Any]]: ...
    @abstractmethod
    async def session_create(self, sid: str, req: SessionCreate, projects: Projects) -> SessionInfo: ...
    @abstractmethod
    async def session_list(self, sid: str, projects: Projects) -> builtins.list[SessionInfo]: ...
    @abstractmethod
    async def session_run(self, sid: str, ses: str, req: SessionRun, projects: Projects) -> SessionResult: ...
    @abstractmethod
    async def session_close(self, sid: str, ses: str, projects: Projects) -> None: ...
    @abstractmethod
    async def read_file(self, sid: str, path: str, projects: Projects) -> FileContent: ...
    @abstractmethod
    async def write_file(self, sid: str, req: FileWrite, projects: Projects) -> None: ...
    @abstractmethod
    async def edit_file(self, sid: str, req: FileEdit, projects: Projects) -> int: ...
    @abstractmethod
    async def stat_file(self, sid: str, path: str, projects: Projects) -> FileStat: ...
    @abstractmethod
    async def list_dir(self, sid: str, path: str, projects: Projects) -> builtins.list[FileStat]: ...
    @abstractmethod
    async def delete_file(self, sid: str, path: str, recursive: bool, projects: Projects) -> None: ...
    @abstractmethod
    async def upload_tar(self, sid: str, path: str, data: bytes, projects: Projects) -> None: ...
    @abstractmethod
    def download_tar(self, sid: str, path: str, projects: Projects) -> AsyncIterator[bytes]: ...
    # download_tar: the tar's bytes in chunks; the first chunk comes once the archive was built
    # (or refused), so a caller that takes it first can still answer an error.
    @abstractmethod
    async def status(self) -> EdgeStatus: ...
    @abstractmethod
    async def configure_pool(self, spec: PoolSpec) -> PoolInfo: ...
    @abstractmethod
    async def prewarm(self, spec: PoolSpec, count: int) -> PoolInfo: ...
    @abstractmethod
    async def pools(self) -> builtins.list[PoolInfo]: ...
    @abstractmethod
    async def pause(self, sid: str, projects: Projects) -> SandboxInfo: ...
    @abstractmethod
    async def resume(self, sid: str, projects: Projects) -> SandboxInfo: ...
    @abstractmethod
    async def pause_project(self, project: str) -> builtins.list[str]: ...
    @abstractmethod
    async def snapshot(self, sid: str, req: SnapshotRequest, projects: Projects) -> SnapshotInfo: ...
    @abstractmethod
    async def fork(self, sid: str, n: int, projects: Projects) -> builtins.list[SandboxInfo]: ...
    @abstractmethod
    async def checkpoint(self, sid: str, req: CheckpointRequest, projects: Projects) -> Checkpoint: ...
    @abstractmethod
    async def checkpoints(self, projects: Projects) -> builtins.list[Checkpoint]: ...
    @abstractmethod
    async def restore(self, cid: str, req: RestoreRequest, projects: Projects) -> SandboxInfo: ...
    @abstractmethod
    async def delete_checkpoint(self, cid: str, projects: Projects) -> None: ...
    @abstractmethod
    async def protect(
        self, sid: str, paths: builtins.list[str], projects: Projects
    ) -> builtins.list[str]: ...
    @abstractmethod
    async def verify(self, sid: str, req: ExecRequest, projects: Projects) -> ExecResult: ...
    @abstractmethod
    async def set_network(
        self, sid: str, policy: NetworkPolicy | None, projects: Projects
    ) -> dict[str, Any]: ...
    @abstractmethod
    async def network(self, sid: str, projects: Projects) -> dict[str, Any]: ...
    @abstractmethod
    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]: ...
    @abstractmethod
    async def image_manifest(self, name: str) -> dict[str, Any]: ...
    @abstractmethod
    async def missing_layers(self, manifest: dict[str, Any]) -> builtins.list[str]: ...
    @abstractmethod
    async def fetch_layer(self, ref: str, dest: Path) -> None: ...
    @abstractmethod
    async def push_layer(self, ref: str, digest: str, archive: Path) -> None: ...
    @abstractmethod
    async def put_image(self, manifest: dict[str, Any]) -> None: ...
    @abstractmethod
    async def delete_snapshot(self, name: str, projects: Projects = None) -> None: ...
    @abstractmethod
    async def trajectory(
        self, sid: str, after_seq: int, limit: int | None, projects: Projects
    ) -> dict[str, Any]: ...
    @abstractmethod
    async def trajectory_export(self, sid: str, fmt: str, projects: Projects) -> bytes: ...
    @abstractmethod
    async def fncall_run(self, req: FnCallRequest) -> FnCallResult: ...
    @abstractmethod
    async def fncall_jupyter(self, req: JupyterRequest) -> JupyterResult: ...

    @abstractmethod
    async def images(self) -> builtins.list[dict[str, Any]]: ...
    @abstractmethod
    async def layers(self) -> builtins.list[dict[str, Any]]: ...
    @abstractmethod
    async def build_image(self, recipe: str) -> dict[str, Any]: ...
    @abstractmethod
    async def import_image(self, name: str, data: bytes) -> dict[str, Any]: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass


def decode_write(req: FileWrite) -> bytes:
    if req.encoding == "base64":
        try:
            return base64.b64decode(req.content, validate=True)
        except ValueError as e:
            raise errors.InvalidRequest("content is not valid base64; send encoding='utf-8' for text") from e
    return req.content.encode()


class LocalEdge(EdgeAPI):
    """An edge in this process."""

    def __init__(self, edge: Edge, url: str | None = None) -> None:
        self.edge = edge
        self.name = edge.name
        self.url = url

    def _check(self, sid: str, projects: Projects) -> None:
        self.edge.check_access(sid, projects)

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        return await self.edge.create(spec)

    async def get(self, sid: str, projects: Projects) -> SandboxInfo:
        self._check(sid, projects)
        return await self.edge.sandbox_status(sid)

    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> list[SandboxInfo]:
        return [i for i in self.edge.list(labels, project) if projects is None or i.spec.project in projects]

    async def stop(self, sid: str, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.stop(sid, wait=False)  # gone at once; teardown continues in the background

    async def exec(self, sid: str, req: ExecRequest, projects: Projects) -> ExecResult:
        self._check(sid, projects)
        return await self.edge.exec(sid, req)

    async def exec_stream(
        self, sid: str, req: ExecRequest, projects: Projects
    ) -> AsyncIterator[tuple[str, Any]]:
        self._check(sid, projects)
        async for kind, item in self.edge.exec_stream(sid, req):
            yield kind, (item.decode(errors="replace") if isinstance(item, bytes) else item)

    async def session_create(self, sid: str, req: SessionCreate, projects: Projects) -> SessionInfo:
        self._check(sid, projects)
        return await self.edge.session_create(sid, req)

    async def session_list(self, sid: str, projects: Projects) -> builtins.list[SessionInfo]:
        self._check(sid, projects)
        return self.edge.session_list(sid)

    async def session_run(self, sid: str, ses: str, req: SessionRun, projects: Projects) -> SessionResult:
        self._check(sid, projects)
        return await self.edge.session_run(sid, ses, req)

    async def session_close(self, sid: str, ses: str, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.session_close(sid, ses)

    async def read_file(self, sid: str, path: str, projects: Projects) -> FileContent:
        self._check(sid, projects)
        data = await self.edge.read_file(sid, path)
        content, encoding = encode_content(data)
        return FileContent(path=path, content=content, encoding=encoding, size=len(data))  # type: ignore[arg-type]

    async def write_file(self, sid: str, req: FileWrite, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.write_logged(sid, req, decode_write(req))

    async def edit_file(self, sid: str, req: FileEdit, projects: Projects) -> int:
        self._check(sid, projects)
        return await self.edge.edit_logged(sid, req)

    async def stat_file(self, sid: str, path: str, projects: Projects) -> FileStat:
        self._check(sid, projects)
        return self.edge.stat_file(sid, path)

    async def list_dir(self, sid: str, path: str, projects: Projects) -> builtins.list[FileStat]:
        self._check(sid, projects)
        return await self.edge.list_dir(sid, path)

    async def delete_file(self, sid: str, path: str, recursive: bool, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.delete_file(sid, path, recursive)
        await self.edge.log_event(sid, "file", {"op": "delete", "path": path, "recursive": recursive}, {})

    async def upload_tar(self, sid: str, path: str, data: bytes, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.upload_tar(sid, path, data)
        digest = hashlib.sha256(data).hexdigest()
        await self.edge.log_event(
            sid, "file", {"op": "upload", "path": path, "sha256": digest, "size": len(data)}, {}
        )

    async def download_tar(self, sid: str, path: str, projects: Projects) -> AsyncIterator[bytes]:
        self._check(sid, projects)
        spool = await self.edge.archive(sid, path)
        try:
            while chunk := await off_loop(lambda: spool.read(1 << 20)):
                yield chunk
        finally:
            spool.close()

    async def status(self) -> EdgeStatus:
        return self.edge.status().model_copy(update={"url": self.url})

    async def configure_pool(self, spec: PoolSpec) -> PoolInfo:
        return self.edge.configure_pool(spec)

    async def prewarm(self, spec: PoolSpec, count: int) -> PoolInfo:
        return self.edge.prewarm(spec, count)

    async def pools(self) -> builtins.list[PoolInfo]:
        return self.edge.pools.list()

    async def pause(self, sid: str, projects: Projects) -> SandboxInfo:
        self._check(sid, projects)
        return await self.edge.pause(sid)

    async def resume(self, sid: str, projects: Projects) -> SandboxInfo:
        self._check(sid, projects)
        return await self.edge.resume(sid)

    async def pause_project(self, project: str) -> builtins.list[str]:
        return await self.edge.pause_project(project)

    async def snapshot(self, sid: str, req: SnapshotRequest, projects: Projects) -> SnapshotInfo:
        self._check(sid, projects)
        return await self.edge.snapshot(sid, req.scrub)

    async def fork(self, sid: str, n: int, projects: Projects) -> builtins.list[SandboxInfo]:
        self._check(sid, projects)
        return await self.edge.fork(sid, n)

    async def checkpoint(self, sid: str, req: CheckpointRequest, projects: Projects) -> Checkpoint:
        self._check(sid, projects)
        return await self.edge.checkpoint(sid, leave_running=req.leave_running)

    async def checkpoints(self, projects: Projects) -> builtins.list[Checkpoint]:
        return self.edge.list_checkpoints(projects)

    async def restore(self, cid: str, req: RestoreRequest, projects: Projects) -> SandboxInfo:
        return await self.edge.restore(cid, sandbox_id=req.sandbox_id, labels=req.labels, projects=projects)

    async def delete_checkpoint(self, cid: str, projects: Projects) -> None:
        self.edge.delete_checkpoint(cid, projects)

    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]:
        return self.edge.list_snapshots(projects)

    async def protect(self, sid: str, paths: builtins.list[str], projects: Projects) -> builtins.list[str]:
        self._check(sid, projects)
        return await self.edge.protect(sid, paths)

    async def verify(self, sid: str, req: ExecRequest, projects: Projects) -> ExecResult:
        self._check(sid, projects)
        return await self.edge.verify(sid, req)

    async def set_network(self, sid: str, policy: NetworkPolicy | None, projects: Projects) -> dict[str, Any]:
        self._check(sid, projects)
        return await self.edge.set_network(sid, policy)

    async def network(self, sid: str, projects: Projects) -> dict[str, Any]:
        self._check(sid, projects)
        return await self.edge.network(sid)

    async def delete_snapshot(self, name: str, projects: Projects = None) -> None:
        self.edge.delete_snapshot(name, projects)

    async def image_manifest(self, name: str) -> dict[str, Any]:
        return self.edge.image_manifest(name)

    async def missing_layers(self, manifest: dict[str, Any]) -> builtins.list[str]:
        return self.edge.missing_layers(manifest)

    async def fetch_layer(self, ref: str, dest: Path) -> None:
        await self.edge.export_layer(ref, dest)

    async def push_layer(self, ref: str, digest: str, archive: Path) -> None:
        await self.edge.import_layer(ref, digest, archive)

    async def put_image(self, manifest: dict[str, Any]) -> None:
        self.edge.put_image(manifest)

    async def trajectory(
        self, sid: str, after_seq: int, limit: int | None, projects: Projects
    ) -> dict[str, Any]:
        self._check(sid, projects)
        return await self.edge.trajectory(sid, after_seq=after_seq, limit=limit)

    async def trajectory_export(self, sid: str, fmt: str, projects: Projects) -> bytes:
        self._check(sid, projects)
        return await self.edge.trajectory_export(sid, fmt)

    async def fncall_run(self, req: FnCallRequest) -> FnCallResult:
        return await self.edge.fncall_run(req)

    async def fncall_jupyter(self, req: JupyterRequest) -> JupyterResult:
        return await self.edge.fncall_jupyter(req)

    async def images(self) -> builtins.list[dict[str, Any]]:
        return [_image_dict(i) for i in self.edge.layers.list_images()]

    async def layers(self) -> builtins.list[dict[str, Any]]:
        return [layer.model_dump(mode="json") for layer in self.edge.layers.list_layers()]

    async def build_image(self, recipe: str) -> dict[str, Any]:
        from dsec.layers import build_recipe_image, load_recipe

        load_recipe(recipe)  # unknown recipe -> ImageNotFound before any work
        image = await asyncio.get_running_loop().run_in_executor(
            None, build_recipe_image, self.edge.layers, recipe
        )
        return _image_dict(image)

    async def import_image(self, name: str, data: bytes) -> dict[str, Any]:
        from dsec.layers import import_oci_archive

        def run() -> Any:
            with tempfile.NamedTemporaryFile(prefix="dsec-import-", suffix=".tar") as f:
                f.write(data)
                f.flush()
                return import_oci_archive(self.edge.layers, name, Path(f.name))

        return _image_dict(await asyncio.get_running_loop().run_in_executor(None, run))


class HttpEdge(EdgeAPI):
    """A remote edge behind `dsec edge`, reached with the cluster token."""

    def __init__(self, name: str, url: str, token: str, *, timeout: float = 600.0) -> None:
        self.name = name
        self.url = url.rstrip("/")
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self.http = httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout, limits=limits
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    @staticmethod
    def _hdr(projects: Projects) -> dict[str, str]:
        return {"X-Dsec-Projects": "*" if projects is None else json.dumps(sorted(projects))}

    async def _call(
        self,
        method: str,
        path: str,
        projects: Projects = None,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        try:
            r = await self.http.request(
                method, path, headers=self._hdr(projects), json=json_body, params=params, content=content
            )
        except httpx.TransportError as e:
            raise errors.Unavailable(f"edge {self.name} at {self.url} is unreachable: {e}") from e
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            raise errors.error_from_wire(r.status_code, body)
        return r

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        r = await self._call("POST", "/v1/sandboxes", json_body=spec.model_dump(mode="json"))
        return SandboxInfo.model_validate_json(r.content)

    async def get(self, sid: str, projects: Projects) -> SandboxInfo:
        return SandboxInfo.model_validate_json(
            (await self._call("GET", f"/v1/sandboxes/{sid}", projects)).content
        )

    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> list[SandboxInfo]:
        params: dict[str, Any] = {"label": [f"{k}={v}" for k, v in labels.items()]}
        if project is not None:
            params["project"] = project
        r = await self._call("GET", "/v1/sandboxes", projects, params=params)
        return [SandboxInfo.model_validate(x) for x in r.json()["sandboxes"]]

    async def stop(self, sid: str, projects: Projects) -> None:
        await self._call("DELETE", f"/v1/sandboxes/{sid}", projects)

    async def exec(self, sid: str, req: ExecRequest, projects: Projects) -> ExecResult:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/exec", projects, json_body=req.model_dump(mode="json")
        )
        return ExecResult.model_validate_json(r.content)

    async def exec_stream(
        self, sid: str, req: ExecRequest, projects: Projects
    ) -> AsyncIterator[tuple[str, Any]]:
        async with self.http.stream(
            "POST",
            f"/v1/sandboxes/{sid}/exec/stream",
            headers=self._hdr(projects),
            json=req.model_dump(mode="json"),
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                raise errors.error_from_wire(r.status_code, r.json())
            event = "message"
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:].strip())
                    if event == "result":
                        yield "result", ExecResult.model_validate(data)
                    elif event == "error":
                        raise errors.error_from_wire(500, data)
                    else:
                        yield event, data

    async def session_create(self, sid: str, req: SessionCreate, projects: Projects) -> SessionInfo:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/sessions", projects, json_body=req.model_dump(mode="json")
        )
        return SessionInfo.model_validate_json(r.content)

    async def session_list(self, sid: str, projects: Projects) -> builtins.list[SessionInfo]:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/sessions", projects)
        return [SessionInfo.model_validate(x) for x in r.json()["sessions"]]

    async def session_run(self, sid: str, ses: str, req: SessionRun, projects: Projects) -> SessionResult:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/sessions/{ses}/run", projects, json_body=req.model_dump(mode="json")
        )
        return SessionResult.model_validate_json(r.content)

    async def session_close(self, sid: str, ses: str, projects: Projects) -> None:
        await self._call("DELETE", f"/v1/sandboxes/{sid}/sessions/{ses}", projects)

    async def read_file(self, sid: str, path: str, projects: Projects) -> FileContent:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/files", projects, params={"path": path})
        return FileContent.model_validate_json(r.content)

    async def write_file(self, sid: str, req: FileWrite, projects: Projects) -> None:
        await self._call("PUT", f"/v1/sandboxes/{sid}/files", projects, json_body=req.model_dump(mode="json"))

    async def edit_file(self, sid: str, req: FileEdit, projects: Projects) -> int:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/files/edit", projects, json_body=req.model_dump(mode="json")
        )
        return int(r.json()["size"])

    async def stat_file(self, sid: str, path: str, projects: Projects) -> FileStat:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/files/stat", projects, params={"path": path})
        return FileStat.model_validate_json(r.content)

    async def list_dir(self, sid: str, path: str, projects: Projects) -> builtins.list[FileStat]:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/files/list", projects, params={"path": path})
        return [FileStat.model_validate(x) for x in r.json()["entries"]]

    async def delete_file(self, sid: str, path: str, recursive: bool, projects: Projects) -> None:
        params = {"path": path, "recursive": str(recursive).lower()}
        await self._call("DELETE", f"/v1/sandboxes/{sid}/files", projects, params=params)

    async def upload_tar(self, sid: str, path: str, data: bytes, projects: Projects) -> None:
        await self._call("PUT", f"/v1/sandboxes/{sid}/archive", projects, params={"path": path}, content=data)

    async def download_tar(self, sid: str, path: str, projects: Projects) -> AsyncIterator[bytes]:
        async with self.http.stream(
            "GET", f"/v1/sandboxes/{sid}/archive", headers=self._hdr(projects), params={"path": path}
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                try:
                    body: Any = r.json()
                except ValueError:
                    body = r.text
                raise errors.error_from_wire(r.status_code, body)
            async for chunk in r.aiter_bytes(1 << 20):
                yield chunk

    async def status(self) -> EdgeStatus:
        r = await self._call("GET", "/v1/edge/status")
        return EdgeStatus.model_validate_json(r.content).model_copy(update={"url": self.url})

    async def configure_pool(self, spec: PoolSpec) -> PoolInfo:
        r = await self._call("POST", "/v1/pools", json_body=spec.model_dump(mode="json"))
        return PoolInfo.model_validate_json(r.content)

    async def prewarm(self, spec: PoolSpec, count: int) -> PoolInfo:
        r = await self._call(
            "POST", "/v1/pools/prewarm", json_body={"spec": spec.model_dump(mode="json"), "count": count}
        )
        return PoolInfo.model_validate_json(r.content)

    async def pools(self) -> builtins.list[PoolInfo]:
        return [PoolInfo.model_validate(x) for x in (await self._call("GET", "/v1/pools")).json()["pools"]]

    async def pause(self, sid: str, projects: Projects) -> SandboxInfo:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/pause", projects)
        return SandboxInfo.model_validate_json(r.content)

    async def resume(self, sid: str, projects: Projects) -> SandboxInfo:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/resume", projects)
        return SandboxInfo.model_validate_json(r.content)

    async def pause_project(self, project: str) -> builtins.list[str]:
        return list((await self._call("POST", f"/v1/projects/{project}/pause")).json()["paused"])

    async def snapshot(self, sid: str, req: SnapshotRequest, projects: Projects) -> SnapshotInfo:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/snapshot", projects, json_body=req.model_dump())
        return SnapshotInfo.model_validate_json(r.content)

    async def fork(self, sid: str, n: int, projects: Projects) -> builtins.list[SandboxInfo]:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/fork", projects, json_body={"n": n})
        return [SandboxInfo.model_validate(x) for x in r.json()["sandboxes"]]

    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/snapshots", projects)).json()["snapshots"])

    async def protect(self, sid: str, paths: builtins.list[str], projects: Projects) -> builtins.list[str]:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/protect", projects, json_body={"paths": paths})
        return list(r.json()["protected"])

    async def verify(self, sid: str, req: ExecRequest, projects: Projects) -> ExecResult:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/verify", projects, json_body=req.model_dump(mode="json")
        )
        return ExecResult.model_validate_json(r.content)

    async def set_network(self, sid: str, policy: NetworkPolicy | None, projects: Projects) -> dict[str, Any]:
        if policy is None:
            r = await self._call("DELETE", f"/v1/sandboxes/{sid}/network", projects)
        else:
            body = policy.model_dump(mode="json")
            r = await self._call("PUT", f"/v1/sandboxes/{sid}/network", projects, json_body=body)
        return dict(r.json())

    async def network(self, sid: str, projects: Projects) -> dict[str, Any]:
        return dict((await self._call("GET", f"/v1/sandboxes/{sid}/network", projects)).json())

    async def image_manifest(self, name: str) -> dict[str, Any]:
        return dict((await self._call("GET", f"/v1/images/{name}/manifest")).json())

    async def missing_layers(self, manifest: dict[str, Any]) -> builtins.list[str]:
        r = await self._call("POST", "/v1/images/missing-layers", json_body=manifest)
        return list(r.json()["missing"])

    async def fetch_layer(self, ref: str, dest: Path) -> None:
        try:
            async with self.http.stream("GET", f"/v1/layers/{ref}/archive", headers=self._hdr(None)) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise errors.error_from_wire(r.status_code, r.json())
                with open(dest, "wb") as f:
                    async for chunk in r.aiter_bytes(1 << 20):
                        f.write(chunk)
        except httpx.TransportError as e:
            raise errors.Unavailable(f"edge {self.name} at {self.url} is unreachable: {e}") from e

    async def push_layer(self, ref: str, digest: str, archive: Path) -> None:
        async def body() -> AsyncIterator[bytes]:
            with open(archive, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk

        try:
            r = await self.http.put(
                f"/v1/layers/{ref}/archive",
                params={"digest": digest},
                content=body(),
                headers=self._hdr(None),
                timeout=600,
            )
        except httpx.TransportError as e:
            raise errors.Unavailable(f"edge {self.name} at {self.url} is unreachable: {e}") from e
        if r.status_code >= 400:
            raise errors.error_from_wire(r.status_code, r.json())

    async def put_image(self, manifest: dict[str, Any]) -> None:
        await self._call("POST", "/v1/images/manifest", json_body=manifest)

    async def checkpoint(self, sid: str, req: CheckpointRequest, projects: Projects) -> Checkpoint:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/checkpoint", projects, json_body=req.model_dump())
        return Checkpoint.model_validate_json(r.content)

    async def checkpoints(self, projects: Projects) -> builtins.list[Checkpoint]:
        r = await self._call("GET", "/v1/checkpoints", projects)
        return [Checkpoint.model_validate(x) for x in r.json()["checkpoints"]]

    async def restore(self, cid: str, req: RestoreRequest, projects: Projects) -> SandboxInfo:
        r = await self._call(
            "POST", f"/v1/checkpoints/{cid}/restore", projects, json_body=req.model_dump(mode="json")
        )
        return SandboxInfo.model_validate_json(r.content)

    async def delete_checkpoint(self, cid: str, projects: Projects) -> None:
        await self._call("DELETE", f"/v1/checkpoints/{cid}", projects)

    async def delete_snapshot(self, name: str, projects: Projects = None) -> None:
        await self._call("DELETE", f"/v1/snapshots/{name}", projects)

    async def trajectory(
        self, sid: str, after_seq: int, limit: int | None, projects: Projects
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"after_seq": after_seq}
        if limit is not None:
            params["limit"] = limit
        return dict(
            (await self._call("GET", f"/v1/sandboxes/{sid}/trajectory", projects, params=params)).json()
        )

    async def trajectory_export(self, sid: str, fmt: str, projects: Projects) -> bytes:
        r = await self._call(
            "GET", f"/v1/sandboxes/{sid}/trajectory/export", projects, params={"format": fmt}
        )
        return r.content

    async def fncall_run(self, req: FnCallRequest) -> FnCallResult:
        r = await self._call("POST", "/v1/fncall/run", json_body=req.model_dump(mode="json"))
        return FnCallResult.model_validate_json(r.content)

    async def fncall_jupyter(self, req: JupyterRequest) -> JupyterResult:
        r = await self._call("POST", "/v1/fncall/jupyter", json_body=req.model_dump(mode="json"))
        return JupyterResult.model_validate_json(r.content)

    async def images(self) -> builtins.list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/images")).json()["images"])

    async def layers(self) -> builtins.list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/layers")).json()["layers"])

    async def build_image(self, recipe: str) -> dict[str, Any]:
        return dict((await self._call("POST", "/v1/images/build", json_body={"recipe": recipe})).json())

    async def import_image(self, name: str, data: bytes) -> dict[str, Any]:
        return dict(
            (await self._call("POST", "/v1/images/import", params={"name": name}, content=data)).json()
        )


def _image_dict(image: Any) -> dict[str, Any]:
    return {"name": image.name, "layers": [str(r) for r in image.layers], "created_at": image.created_at}
