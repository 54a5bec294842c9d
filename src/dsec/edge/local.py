"""An edge in the apiserver's own process (`dsec up`): the edge contract over `Edge`."""

import asyncio
import builtins
import contextlib
import hashlib
import json
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dsec import errors
from dsec import models as wire
from dsec.edge import Edge
from dsec.edge.edge import encode_content
from dsec.edge.files import off_loop
from dsec.edgeapi import EdgeAPI, ExecReply, Projects, decode_write
from dsec.layers import Image
from dsec.layers.dockerbuild import Builder

log = logging.getLogger("dsec.edge")


class LocalEdge(EdgeAPI):
    """An edge in this process."""

    can_be_lost = False  # it lives and dies with the apiserver that holds it

    def __init__(self, edge: Edge, url: str | None = None) -> None:
        self.edge = edge
        self.name = edge.name
        self.url = url
        self._builder: Builder | None = None  # Dockerfile builds, made at the first

    def _check(self, sid: str, projects: Projects) -> None:
        self.edge.check_access(sid, projects)

    async def create(self, spec: wire.SandboxSpec) -> wire.SandboxInfo:
        return await self.edge.create(spec)

    async def get(self, sid: str, projects: Projects) -> wire.SandboxInfo:
        self._check(sid, projects)
        return await self.edge.sandbox_status(sid)

    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> list[wire.SandboxInfo]:
        return [i for i in self.edge.list(labels, project) if projects is None or i.spec.project in projects]

    async def stop(self, sid: str, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.stop(sid, wait=False)  # gone at once; teardown continues in the background

    async def exec_reply(self, sid: str, req: wire.ExecRequest, projects: Projects) -> ExecReply:
        self._check(sid, projects)
        return await self.edge.exec_reply(sid, req)

    async def exec_stream(self, sid: str, req: wire.ExecRequest, projects: Projects) -> AsyncIterator[bytes]:
        self._check(sid, projects)
        async with contextlib.aclosing(self.edge.exec_events(sid, req)) as events:
            async for piece in events:
                yield piece

    async def session_create(self, sid: str, req: wire.SessionCreate, projects: Projects) -> wire.SessionInfo:
        self._check(sid, projects)
        return await self.edge.session_create(sid, req)

    async def session_list(self, sid: str, projects: Projects) -> builtins.list[wire.SessionInfo]:
        self._check(sid, projects)
        return self.edge.session_list(sid)

    async def session_run(
        self, sid: str, ses: str, req: wire.SessionRun, projects: Projects
    ) -> wire.SessionResult:
        self._check(sid, projects)
        return await self.edge.session_run(sid, ses, req)

    async def session_close(self, sid: str, ses: str, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.session_close(sid, ses)

    async def read_file(self, sid: str, path: str, projects: Projects) -> wire.FileContent:
        self._check(sid, projects)
        data = await self.edge.read_file(sid, path)
        content, encoding = encode_content(data)
        return wire.FileContent(path=path, content=content, encoding=encoding, size=len(data))  # type: ignore[arg-type]

    async def write_file(self, sid: str, req: wire.FileWrite, projects: Projects) -> None:
        self._check(sid, projects)
        await self.edge.write_logged(sid, req, decode_write(req))

    async def edit_file(self, sid: str, req: wire.FileEdit, projects: Projects) -> int:
        self._check(sid, projects)
        return await self.edge.edit_logged(sid, req)

    async def stat_file(self, sid: str, path: str, projects: Projects) -> wire.FileStat:
        self._check(sid, projects)
        return await self.edge.stat_file(sid, path)

    async def list_dir(self, sid: str, path: str, projects: Projects) -> builtins.list[wire.FileStat]:
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

    async def status(self) -> wire.EdgeStatus:
        return self.edge.status().model_copy(update={"url": self.url})

    async def configure_pool(self, spec: wire.PoolSpec) -> wire.PoolInfo:
        return await self.edge.configure_pool(spec)

    async def prewarm(self, spec: wire.PoolSpec, count: int, project: str | None = None) -> wire.PoolInfo:
        return await self.edge.prewarm(spec, count, project)

    async def pools(self) -> builtins.list[wire.PoolInfo]:
        return self.edge.pools.list()

    async def pause(self, sid: str, projects: Projects) -> wire.SandboxInfo:
        self._check(sid, projects)
        return await self.edge.pause(sid)

    async def resume(self, sid: str, projects: Projects) -> wire.SandboxInfo:
        self._check(sid, projects)
        return await self.edge.resume(sid)

    async def pause_project(self, project: str) -> builtins.list[str]:
        return await self.edge.pause_project(project)

    async def snapshot(self, sid: str, req: wire.SnapshotRequest, projects: Projects) -> wire.SnapshotInfo:
        self._check(sid, projects)
        return await self.edge.snapshot(sid, req.scrub, max_bytes=req.max_bytes)

    async def fork(
        self, sid: str, req: wire.ForkRequest, projects: Projects
    ) -> builtins.list[wire.SandboxInfo]:
        self._check(sid, projects)
        return await self.edge.fork(sid, req.n, max_layer_bytes=req.max_layer_bytes)

    async def checkpoint(self, sid: str, req: wire.CheckpointRequest, projects: Projects) -> wire.Checkpoint:
        self._check(sid, projects)
        return await self.edge.checkpoint(sid, leave_running=req.leave_running, max_bytes=req.max_bytes)

    async def checkpoints(self, projects: Projects) -> builtins.list[wire.Checkpoint]:
        return self.edge.list_checkpoints(projects)

    async def restore(self, cid: str, req: wire.RestoreRequest, projects: Projects) -> wire.SandboxInfo:
        return await self.edge.restore(cid, sandbox_id=req.sandbox_id, labels=req.labels, projects=projects)

    async def delete_checkpoint(self, cid: str, projects: Projects) -> None:
        self.edge.delete_checkpoint(cid, projects)

    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]:
        return self.edge.list_snapshots(projects)

    async def protect(self, sid: str, paths: builtins.list[str], projects: Projects) -> builtins.list[str]:
        self._check(sid, projects)
        return await self.edge.protect(sid, paths)

    async def verify(self, sid: str, req: wire.ExecRequest, projects: Projects) -> wire.ExecResult:
        self._check(sid, projects)
        return await self.edge.verify(sid, req)

    async def set_network(
        self, sid: str, policy: wire.NetworkPolicy | None, projects: Projects
    ) -> dict[str, Any]:
        self._check(sid, projects)
        return await self.edge.set_network(sid, policy)

    async def network(self, sid: str, projects: Projects) -> dict[str, Any]:
        self._check(sid, projects)
        return await self.edge.network(sid)

    async def delete_snapshot(self, name: str, projects: Projects = None) -> None:
        await self.edge.delete_snapshot(name, projects)

    async def trajectory(
        self, sid: str, after_seq: int, limit: int | None, projects: Projects
    ) -> dict[str, Any]:
        self._check(sid, projects)
        return await self.edge.trajectory(sid, after_seq=after_seq, limit=limit)

    async def trajectory_export(self, sid: str, fmt: str, projects: Projects) -> bytes:
        self._check(sid, projects)
        return await self.edge.trajectory_export(sid, fmt)

    async def fncall_run(self, req: wire.FnCallRequest) -> wire.FnCallResult:
        return await self.edge.fncall_run(req)

    async def fncall_jupyter(self, req: wire.JupyterRequest) -> wire.JupyterResult:
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


    async def build_dockerfile(self, req: wire.EdgeBuild, context: bytes) -> AsyncIterator[bytes]:
        """A Dockerfile build on this edge (dsec.layers.dockerbuild), its events as NDJSON."""
        from dsec.layers.dockerbuild import BuildSpec

        if self._builder is None:
            s = self.edge.settings
            self._builder = Builder(
                self.edge.layers, s.builds_dir / s.name, ranges=self.edge.id_ranges,
                cgroups=self.edge.cgroups, policy=s.pull_policy(),
            )  # fmt: skip
        builder = self._builder
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def emit(event: dict[str, Any]) -> None:  # (from the build's thread)
            loop.call_soon_threadsafe(events.put_nowait, event)

        def line(event: dict[str, Any]) -> bytes:
            return (json.dumps(event) + "\n").encode()

        spec = BuildSpec(req.name, req.project, req.dockerfile, dict(req.build_args), req.target)
        uploads = self.edge.settings.data_dir / "build-uploads"
        uploads.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix="context-", suffix=".tar", dir=uploads) as f:
            await loop.run_in_executor(None, f.write, context)
            await loop.run_in_executor(None, f.flush)
            del context
            job: asyncio.Future[Image] = loop.run_in_executor(None, builder.build, spec, Path(f.name), emit)
            while not (job.done() and events.empty()):
                getter: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(events.get())
                either: set[asyncio.Future[Any]] = {getter, job}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield line(getter.result())
                else:
                    getter.cancel()
            try:
                image = job.result()
            except errors.DsecError as e:
                yield line({"type": "error", "error": e.to_wire()})
                return
        yield line({"type": "result", "image": {**_image_dict(image), "source": _source(image)}})

    async def image(self, name: str) -> dict[str, Any]:
        image = self.edge.layers.get_image(name)
        return {**_image_dict(image), "source": _source(image)}

    async def delete_image(self, name: str) -> None:
        """Forget image `name` and its pins (`name@digest`); running sandboxes keep their layers
        (mounted), the layers stay in the store. Snapshots go through delete_snapshot."""
        image = self.edge.layers.get_image(name)
        if image.source.get("type") == "snapshot":
            raise errors.InvalidRequest(
                f"{name} is a snapshot: delete it with DELETE /v1/snapshots/{name}", reason="is_snapshot"
            )
        self.edge.layers.delete_image(name)

    async def pull_image(self, req: wire.EdgePull) -> dict[str, Any]:
        from dsec.layers.pull import Reference, RegistryAuth, pull_image

        ref = Reference.parse(req.reference)
        auth = None
        if req.username is not None and req.password is not None:
            auth = RegistryAuth(req.username, req.password.get_secret_value())
        s = self.edge.settings
        async with self.edge.pulls:  # a pull is heavy (network, disk): a few at a time
            image = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: pull_image(
                    self.edge.layers, ref, req.name, scratch=s.data_dir / "pulls", policy=s.pull_policy(),
                    auth=auth, project=req.project, progress=lambda line: log.info("pull %s: %s", ref, line),
                ),
            )  # fmt: skip
        return {**_image_dict(image), "source": _source(image)}


_PULL_KEYS = (
    "type", "reference", "digest", "size_bytes", "project", "created_layers", "reused_layers",
)  # fmt: skip


def _source(image: Any) -> dict[str, Any]:
    """What an image's source says that anyone who may see the image may know."""
    return {k: image.source.get(k) for k in _PULL_KEYS}


def _image_dict(image: Any) -> dict[str, Any]:
    return {
        "name": image.name,
        "layers": [str(r) for r in image.layers],
        "created_at": image.created_at,
        "digest": image.digest,
        "config": image.config.model_dump(mode="json"),  # what its sandboxes get by default
    }
