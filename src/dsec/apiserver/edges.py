"""An edge on another host, over its HTTP API (`dsec edge`), with the cluster token."""

import builtins
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx

from dsec import errors
from dsec import models as wire
from dsec.client._wire import AsyncWire, usable
from dsec.edgeapi import EdgeAPI, ExecReply, Projects
from dsec.http.output import META_HEADER, meta_from_header


def _query(params: dict[str, Any] | None) -> list[tuple[str, str]] | None:
    """Query parameters as httpx reads a dict: a list is the key repeated."""
    if not params:
        return None
    out: list[tuple[str, str]] = []
    for k, v in params.items():
        for item in v if isinstance(v, list) else [v]:
            out.append((k, str(item).lower() if isinstance(item, bool) else str(item)))
    return out


# Answers to execs capped at this much output per stream (the default cap) are read whole
# (at most ~12 MiB of JSON: 6 bytes per byte of output); larger caps stream through.
WHOLE_OUTPUT = 1024 * 1024


class _EdgeReply(ExecReply):
    """An edge's answer to an exec, passed on as it arrives."""

    def __init__(self, r: httpx.Response, *, streamed: bool = False) -> None:
        meta = r.headers.get(META_HEADER)
        if meta is not None:
            self.meta = meta_from_header(meta)
        elif not streamed:  # (an edge of an older version: its small answer read for its fields)
            whole = wire.ExecResult.model_validate_json(r.content)
            self.meta = whole.model_copy(update={"stdout": "", "stderr": ""})
        else:  # (nothing for the metrics, then)
            self.meta = wire.ExecResult(stdout="", stderr="", exit_code=0, duration=0.0)
        length = r.headers.get("content-length")
        self.length = int(length) if length is not None and length.isdigit() else None
        self._r, self._streamed = r, streamed

    async def body(self) -> AsyncIterator[bytes]:
        if not self._streamed:
            yield self._r.content
            return
        async for chunk in self._r.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        await self._r.aclose()


class HttpEdge(EdgeAPI):
    """A remote edge behind `dsec edge`, reached with the cluster token."""

    def __init__(self, name: str, url: str, token: str, *, timeout: float = 600.0) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.timeout = timeout
        auth = {"Authorization": f"Bearer {token}"}
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self.http = httpx.AsyncClient(base_url=self.url, headers=auth, timeout=timeout, limits=limits)
        # Plain calls (all but streams) take the SDK's fast path: keep-alive sockets, one write
        # per request, responses parsed by httptools (dsec.client._wire); httpx otherwise.
        self.wire = (
            AsyncWire(self.url, auth, max_keepalive=128, max_connections=512) if usable(self.url) else None
        )

    async def aclose(self) -> None:
        if self.wire is not None:
            await self.wire.aclose()
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
            if self.wire is not None:
                payload = self.wire.payload(
                    method, path, params=_query(params), json_body=json_body,
                    content=content, headers=self._hdr(projects),
                )  # fmt: skip
                r = await self.wire.request(payload, 10.0, self.timeout)
            else:
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

    async def create(self, spec: wire.SandboxSpec) -> wire.SandboxInfo:
        r = await self._call("POST", "/v1/sandboxes", json_body=spec.model_dump(mode="json"))
        return wire.SandboxInfo.model_validate_json(r.content)

    async def get(self, sid: str, projects: Projects) -> wire.SandboxInfo:
        return wire.SandboxInfo.model_validate_json(
            (await self._call("GET", f"/v1/sandboxes/{sid}", projects)).content
        )

    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> list[wire.SandboxInfo]:
        params: dict[str, Any] = {"label": [f"{k}={v}" for k, v in labels.items()]}
        if project is not None:
            params["project"] = project
        r = await self._call("GET", "/v1/sandboxes", projects, params=params)
        return [wire.SandboxInfo.model_validate(x) for x in r.json()["sandboxes"]]

    async def stop(self, sid: str, projects: Projects) -> None:
        await self._call("DELETE", f"/v1/sandboxes/{sid}", projects)

    async def exec_reply(self, sid: str, req: wire.ExecRequest, projects: Projects) -> ExecReply:
        """The edge's answer passed through as it arrives, never parsed here (its fields but
        the output come in a header). A small cap's answer is read whole on the fast path."""
        body = req.model_dump(mode="json")
        if req.max_output_bytes <= WHOLE_OUTPUT:
            return _EdgeReply(await self._call("POST", f"/v1/sandboxes/{sid}/exec", projects, json_body=body))
        request = self.http.build_request(
            "POST", f"/v1/sandboxes/{sid}/exec", headers=self._hdr(projects), json=body
        )
        try:
            r = await self.http.send(request, stream=True)
        except httpx.TransportError as e:
            raise errors.Unavailable(f"edge {self.name} at {self.url} is unreachable: {e}") from e
        if r.status_code >= 400:
            try:
                await r.aread()
            finally:
                await r.aclose()
            raise errors.error_from_wire(r.status_code, r.json())
        return _EdgeReply(r, streamed=True)

    async def exec_stream(self, sid: str, req: wire.ExecRequest, projects: Projects) -> AsyncIterator[bytes]:
        async with self.http.stream(
            "POST",
            f"/v1/sandboxes/{sid}/exec/stream",
            headers=self._hdr(projects),
            json=req.model_dump(mode="json"),
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                raise errors.error_from_wire(r.status_code, r.json())
            yield b""  # admitted by the edge
            async for chunk in r.aiter_raw():  # the edge's events as they are, never parsed here
                yield chunk

    async def session_create(self, sid: str, req: wire.SessionCreate, projects: Projects) -> wire.SessionInfo:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/sessions", projects, json_body=req.model_dump(mode="json")
        )
        return wire.SessionInfo.model_validate_json(r.content)

    async def session_list(self, sid: str, projects: Projects) -> builtins.list[wire.SessionInfo]:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/sessions", projects)
        return [wire.SessionInfo.model_validate(x) for x in r.json()["sessions"]]

    async def session_run(
        self, sid: str, ses: str, req: wire.SessionRun, projects: Projects
    ) -> wire.SessionResult:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/sessions/{ses}/run", projects, json_body=req.model_dump(mode="json")
        )
        return wire.SessionResult.model_validate_json(r.content)

    async def session_close(self, sid: str, ses: str, projects: Projects) -> None:
        await self._call("DELETE", f"/v1/sandboxes/{sid}/sessions/{ses}", projects)

    async def read_file(self, sid: str, path: str, projects: Projects) -> wire.FileContent:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/files", projects, params={"path": path})
        return wire.FileContent.model_validate_json(r.content)

    async def write_file(self, sid: str, req: wire.FileWrite, projects: Projects) -> None:
        await self._call("PUT", f"/v1/sandboxes/{sid}/files", projects, json_body=req.model_dump(mode="json"))

    async def edit_file(self, sid: str, req: wire.FileEdit, projects: Projects) -> int:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/files/edit", projects, json_body=req.model_dump(mode="json")
        )
        return int(r.json()["size"])

    async def stat_file(self, sid: str, path: str, projects: Projects) -> wire.FileStat:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/files/stat", projects, params={"path": path})
        return wire.FileStat.model_validate_json(r.content)

    async def list_dir(self, sid: str, path: str, projects: Projects) -> builtins.list[wire.FileStat]:
        r = await self._call("GET", f"/v1/sandboxes/{sid}/files/list", projects, params={"path": path})
        return [wire.FileStat.model_validate(x) for x in r.json()["entries"]]

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

    async def status(self) -> wire.EdgeStatus:
        r = await self._call("GET", "/v1/edge/status")
        return wire.EdgeStatus.model_validate_json(r.content).model_copy(update={"url": self.url})

    async def configure_pool(self, spec: wire.PoolSpec) -> wire.PoolInfo:
        r = await self._call("POST", "/v1/pools", json_body=spec.model_dump(mode="json"))
        return wire.PoolInfo.model_validate_json(r.content)

    async def prewarm(self, spec: wire.PoolSpec, count: int, project: str | None = None) -> wire.PoolInfo:
        body = {"spec": spec.model_dump(mode="json"), "count": count, "project": project}
        r = await self._call("POST", "/v1/pools/prewarm", json_body=body)
        return wire.PoolInfo.model_validate_json(r.content)

    async def pools(self) -> builtins.list[wire.PoolInfo]:
        return [
            wire.PoolInfo.model_validate(x) for x in (await self._call("GET", "/v1/pools")).json()["pools"]
        ]

    async def pause(self, sid: str, projects: Projects) -> wire.SandboxInfo:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/pause", projects)
        return wire.SandboxInfo.model_validate_json(r.content)

    async def resume(self, sid: str, projects: Projects) -> wire.SandboxInfo:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/resume", projects)
        return wire.SandboxInfo.model_validate_json(r.content)

    async def pause_project(self, project: str) -> builtins.list[str]:
        return list((await self._call("POST", f"/v1/projects/{project}/pause")).json()["paused"])

    async def snapshot(self, sid: str, req: wire.SnapshotRequest, projects: Projects) -> wire.SnapshotInfo:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/snapshot", projects, json_body=req.model_dump())
        return wire.SnapshotInfo.model_validate_json(r.content)

    async def fork(
        self, sid: str, req: wire.ForkRequest, projects: Projects
    ) -> builtins.list[wire.SandboxInfo]:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/fork", projects, json_body=req.model_dump())
        return [wire.SandboxInfo.model_validate(x) for x in r.json()["sandboxes"]]

    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/snapshots", projects)).json()["snapshots"])

    async def protect(self, sid: str, paths: builtins.list[str], projects: Projects) -> builtins.list[str]:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/protect", projects, json_body={"paths": paths})
        return list(r.json()["protected"])

    async def verify(self, sid: str, req: wire.ExecRequest, projects: Projects) -> wire.ExecResult:
        r = await self._call(
            "POST", f"/v1/sandboxes/{sid}/verify", projects, json_body=req.model_dump(mode="json")
        )
        return wire.ExecResult.model_validate_json(r.content)

    async def set_network(
        self, sid: str, policy: wire.NetworkPolicy | None, projects: Projects
    ) -> dict[str, Any]:
        if policy is None:
            r = await self._call("DELETE", f"/v1/sandboxes/{sid}/network", projects)
        else:
            body = policy.model_dump(mode="json")
            r = await self._call("PUT", f"/v1/sandboxes/{sid}/network", projects, json_body=body)
        return dict(r.json())

    async def network(self, sid: str, projects: Projects) -> dict[str, Any]:
        return dict((await self._call("GET", f"/v1/sandboxes/{sid}/network", projects)).json())

    async def checkpoint(self, sid: str, req: wire.CheckpointRequest, projects: Projects) -> wire.Checkpoint:
        r = await self._call("POST", f"/v1/sandboxes/{sid}/checkpoint", projects, json_body=req.model_dump())
        return wire.Checkpoint.model_validate_json(r.content)

    async def checkpoints(self, projects: Projects) -> builtins.list[wire.Checkpoint]:
        r = await self._call("GET", "/v1/checkpoints", projects)
        return [wire.Checkpoint.model_validate(x) for x in r.json()["checkpoints"]]

    async def restore(self, cid: str, req: wire.RestoreRequest, projects: Projects) -> wire.SandboxInfo:
        r = await self._call(
            "POST", f"/v1/checkpoints/{cid}/restore", projects, json_body=req.model_dump(mode="json")
        )
        return wire.SandboxInfo.model_validate_json(r.content)

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

    async def fncall_run(self, req: wire.FnCallRequest) -> wire.FnCallResult:
        r = await self._call("POST", "/v1/fncall/run", json_body=req.model_dump(mode="json"))
        return wire.FnCallResult.model_validate_json(r.content)

    async def fncall_jupyter(self, req: wire.JupyterRequest) -> wire.JupyterResult:
        r = await self._call("POST", "/v1/fncall/jupyter", json_body=req.model_dump(mode="json"))
        return wire.JupyterResult.model_validate_json(r.content)

    async def images(self) -> builtins.list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/images")).json()["images"])

    async def layers(self) -> builtins.list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/layers")).json()["layers"])

    async def build_image(self, recipe: str) -> dict[str, Any]:
        return dict((await self._call("POST", "/v1/images/build", json_body={"recipe": recipe})).json())

    async def build_dockerfile(self, req: wire.EdgeBuild, context: bytes) -> AsyncIterator[bytes]:
        params = {"spec": json.dumps(req.model_dump(mode="json"))}
        async with self.http.stream(
            "POST", "/v1/images/dockerbuild", params=params, content=context, timeout=None
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                raise errors.error_from_wire(r.status_code, r.json())
            async for chunk in r.aiter_raw():  # the edge's NDJSON events as they are
                yield chunk

    async def image(self, name: str) -> dict[str, Any]:
        return dict((await self._call("GET", f"/v1/images/{quote(name, safe='/:@')}")).json())

    async def delete_image(self, name: str) -> None:
        await self._call("DELETE", f"/v1/images/{quote(name, safe='/:@')}")

    async def pull_image(self, req: wire.EdgePull) -> dict[str, Any]:
        return dict((await self._call("POST", "/v1/images/pull", json_body=req.wire())).json())

    async def import_image(self, name: str, data: bytes) -> dict[str, Any]:
        return dict(
            (await self._call("POST", "/v1/images/import", params={"name": name}, content=data)).json()
        )
