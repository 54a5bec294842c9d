"""Every API operation as a function returning a :class:`Call`: the request to send and how
to turn the response into a typed result (and the checks and helpers of its arguments).
The sync and async SDKs send the same calls (`_base`)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from dsec import errors
from dsec import models as wire
from dsec.client._base import Call, Request, wire_error

M = TypeVar("M", bound=BaseModel)

BATCH_MAX = 256  # sandboxes per POST /v1/sandboxes/batch from create_many
STOP_BATCH_MAX = 1024  # ids per POST /v1/sandboxes/batch_stop
WRITE_MAX = 128 * wire.MiB  # FileWrite.content: characters on the wire (base64 for bytes)


def _none(_: httpx.Response) -> None:
    return None


def _json(response: httpx.Response) -> Any:
    return response.json()


def _model(cls: type[M]) -> Callable[[httpx.Response], M]:
    def parse(response: httpx.Response) -> M:
        return cls.model_validate(response.json())

    return parse


def _models(cls: type[M], key: str) -> Callable[[httpx.Response], list[M]]:
    def parse(response: httpx.Response) -> list[M]:
        return [cls.model_validate(item) for item in response.json()[key]]

    return parse


def _sb(sandbox_id: str, *rest: str) -> str:
    for segment in (sandbox_id, *rest):
        if segment in ("", ".", ".."):
            raise errors.InvalidRequest(f"invalid id {segment!r}")
    parts = ["/v1/sandboxes", quote(sandbox_id, safe="")]
    parts.extend(quote(p, safe="") for p in rest)
    return "/".join(parts)


def _dump(model: BaseModel) -> Any:
    body = model.model_dump(mode="json")
    if body.get("step", 0) is None:
        del body["step"]  # untagged: keep the wire as it was before step tags
    return body


def _validated(cls: type[M], **values: Any) -> M:
    """Build a request model; bad arguments raise :class:`errors.InvalidRequest` before any I/O."""
    try:
        return cls(**values)
    except ValidationError as exc:
        raise errors.InvalidRequest(f"invalid {cls.__name__}: {exc}") from exc


# --------------------------------------------------------------------------- specs


class SpecOptions(TypedDict, total=False):
    """Keyword arguments of a sandbox spec (see :class:`dsec.models.SandboxSpec`)."""

    cpu: float
    memory_mb: int
    pids: int
    disk_mb: int
    env: dict[str, str] | None
    user: str
    workdir: str
    labels: dict[str, str] | None
    ttl_idle_s: float | None
    ttl_action: str
    project: str
    backend: str
    disk_inodes: int
    storage: str
    max_output_bytes: int
    protected_paths: list[str] | None
    network: wire.NetworkPolicy | dict[str, Any] | None


def snapshot_image(snapshot: wire.SnapshotInfo | str | None) -> str | None:
    """The image name a snapshot restores from: a SnapshotInfo (what Sandbox.snapshot()
    returns) or its id."""
    if snapshot is None or isinstance(snapshot, str):
        return snapshot
    if isinstance(snapshot, wire.SnapshotInfo):
        return snapshot.id
    raise errors.InvalidRequest(
        f"snapshot= takes what Sandbox.snapshot() returned or its id, not {type(snapshot).__name__}"
    )


def build_spec(image: str, opts: SpecOptions) -> wire.SandboxSpec:
    values: dict[str, Any] = {k: v for k, v in opts.items() if v is not None}
    unknown = set(values) - set(SpecOptions.__annotations__)
    if unknown:
        raise errors.InvalidRequest(f"unknown sandbox option(s): {', '.join(sorted(unknown))}")
    return _validated(wire.SandboxSpec, image=image, **values)


def chunk_sizes(n: int, size: int = BATCH_MAX) -> list[int]:
    if n < 0:
        raise errors.InvalidRequest(f"n must be >= 0, got {n}")
    return [min(size, n - start) for start in range(0, n, size)]


# --------------------------------------------------------------------------- sandboxes


@dataclass(frozen=True, slots=True)
class BatchCreated:
    sandboxes: list[wire.SandboxInfo]
    errors: list[errors.DsecError]


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


def create(spec: wire.SandboxSpec, idempotency_key: str | None = None) -> Call[wire.SandboxInfo]:
    """With an idempotency key (the SDK makes one per call) the create is retried, to any
    apiserver, and still makes one sandbox."""
    key = idempotency_key or new_idempotency_key()
    req = Request(
        "POST", "/v1/sandboxes", json=_dump(spec), headers={"Idempotency-Key": key}, idempotent=True
    )
    return Call(req, _model(wire.SandboxInfo))


def create_batch(count: int, spec: wire.SandboxSpec) -> Call[BatchCreated]:
    def parse(response: httpx.Response) -> BatchCreated:
        body = response.json()
        infos = [wire.SandboxInfo.model_validate(s) for s in body.get("sandboxes", [])]
        errs = [wire_error(e) for e in body.get("errors") or []]
        if len(infos) < count and not errs:
            errs.append(errors.InternalError(f"the batch created {len(infos)} of {count} sandboxes"))
        return BatchCreated(infos, errs)

    return Call(Request("POST", "/v1/sandboxes/batch", json={"count": count, "spec": _dump(spec)}), parse)


def get(sandbox_id: str) -> Call[wire.SandboxInfo]:
    return Call(Request("GET", _sb(sandbox_id), idempotent=True), _model(wire.SandboxInfo))


def list_sandboxes(project: str | None, labels: dict[str, str] | None) -> Call[list[wire.SandboxInfo]]:
    params: list[tuple[str, str]] = []
    if project is not None:
        params.append(("project", project))
    params.extend(("label", f"{k}={v}") for k, v in (labels or {}).items())
    return Call(
        Request("GET", "/v1/sandboxes", params=params or None, idempotent=True),
        _models(wire.SandboxInfo, "sandboxes"),
    )


def stop(sandbox_id: str) -> Call[None]:
    return Call(Request("DELETE", _sb(sandbox_id), idempotent=True), _none)


def stop_batch(ids: list[str]) -> Call[dict[str, errors.DsecError]]:
    """Stopping is idempotent, so this POST is retried. Returns the errors by id."""

    def parse(response: httpx.Response) -> dict[str, errors.DsecError]:
        body = response.json()
        return {sid: wire_error(e) for sid, e in (body.get("errors") or {}).items()}

    return Call(Request("POST", "/v1/sandboxes/batch_stop", json={"ids": ids}, idempotent=True), parse)


def stop_batch_raise(errs: dict[str, errors.DsecError]) -> None:
    """Raise the first error of a batch stop that is not 'already gone'."""
    for err in errs.values():
        if not isinstance(err, errors.SandboxNotFound):
            raise err


# --------------------------------------------------------------------------- exec


StepArg = tuple[str, int] | None
"""A step tag (trajectory id, step index): a logged step is replayed, never run twice."""


def _step(step: StepArg) -> dict[str, Any] | None:
    if step is None:
        return None
    trajectory, index = step
    return {"trajectory": trajectory, "index": index}


class _RunOptions(TypedDict, total=False):
    timeout: float  # seconds (default 60; verify: 300)
    env: dict[str, str] | None  # added to the sandbox's environment
    cwd: str | None  # default: the sandbox's workdir
    user: str | None  # a user of the image (default: the sandbox's)
    max_output_bytes: int  # cap per stream (default 1 MiB)


class StreamOptions(_RunOptions, total=False):
    """Keyword arguments of `exec_stream()`."""

    stdin: str | None


class VerifyOptions(_RunOptions, total=False):
    """Keyword arguments of `verify()`."""

    step: StepArg  # (trajectory id, step index): logged, replayed when sent again
    task_dirs: list[str] | None  # the sandbox's directories the command sees (default /work, workdir)


class ExecOptions(StreamOptions, total=False):
    """Keyword arguments of `exec()`."""

    step: StepArg
    task_dirs: list[str] | None  # trusted only
    trusted: bool  # the image's own toolchain, a platform uid, a clean environment


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One logged operation to run again (`Sandbox.replay`): an exec or an edit, with its
    step tag when it had one."""

    seq: int
    op: str  # "exec" | "edit"
    args: dict[str, Any]


def replay_plan(
    trajectory: wire.Trajectory | Mapping[str, Any],
) -> tuple[list[ReplayStep], list[tuple[int, str]]]:
    """What of a logged trajectory (another sandbox's, its edge lost, say) can run again in
    order to rebuild its files and processes' effects: execs and edits, with their step
    tags (so a rollout that goes on with the same tags finds them done). What cannot, and
    why: writes (the log keeps a digest, not the content), session runs, gaps."""
    entries = trajectory["entries"]
    steps: list[ReplayStep] = []
    skipped: list[tuple[int, str]] = []
    for e in entries:
        seq, kind, action = e["seq"], e["kind"], e["action"]
        tag = (e["trajectory"], e["step"]) if e["trajectory"] is not None and e["step"] is not None else None
        op = action.get("op")
        if kind == "gap":
            skipped.append((seq, "lost before it was logged durably"))
        elif op == "exec":
            args = {k: action[k] for k in ("stdin", "env", "cwd", "user") if action.get(k) is not None}
            steps.append(ReplayStep(seq, "exec", {"cmd": action["cmd"], "step": tag, **args}))
        elif op == "edit":
            args = {"path": action["path"], "old": action["old"], "new": action["new"], "step": tag}
            steps.append(ReplayStep(seq, "edit", args))
        else:
            reason = (
                "the log keeps its digest, not its content"
                if op == "write"
                else f"{op or kind} is not replayed"
            )
            skipped.append((seq, reason))
    return steps, skipped


def exec_request(
    cmd: str | list[str], opts: Mapping[str, Any], allowed: type, *, timeout: float = 60
) -> wire.ExecRequest:
    """The request of an exec, a stream or a verify from its keyword arguments (`allowed`:
    the TypedDict naming those the call takes)."""
    unknown = set(opts) - allowed.__required_keys__ - allowed.__optional_keys__  # type: ignore[attr-defined]
    if unknown:
        raise errors.InvalidRequest(
            f"unknown option(s): {', '.join(sorted(unknown))}; this call takes "
            + ", ".join(sorted(allowed.__optional_keys__))  # type: ignore[attr-defined]
        )
    values = {k: v for k, v in opts.items() if v is not None}
    values.setdefault("timeout", timeout)
    values["step"] = _step(values.get("step"))
    return _validated(wire.ExecRequest, cmd=cmd, **values)


def exec_(sandbox_id: str, req: wire.ExecRequest) -> Call[wire.ExecResult]:
    return Call(
        # A tagged step is deduplicated by the edge's trajectory log: safe to retry.
        Request(
            "POST",
            _sb(sandbox_id, "exec"),
            json=_dump(req),
            op_timeout=req.timeout,
            idempotent=req.step is not None,
        ),
        _model(wire.ExecResult),
    )


def exec_stream(sandbox_id: str, req: wire.ExecRequest) -> Request:
    return Request(
        "POST",
        _sb(sandbox_id, "exec", "stream"),
        json=_dump(req),
        headers={"Accept": "text/event-stream"},
        op_timeout=req.timeout,
    )


# --------------------------------------------------------------------------- sessions


def session_create(
    sandbox_id: str, kind: str, env: dict[str, str] | None, cwd: str | None
) -> Call[wire.SessionInfo]:
    body = _validated(wire.SessionCreate, kind=kind, env=env or {}, cwd=cwd)
    return Call(Request("POST", _sb(sandbox_id, "sessions"), json=_dump(body)), _model(wire.SessionInfo))


def session_list(sandbox_id: str) -> Call[list[wire.SessionInfo]]:
    return Call(
        Request("GET", _sb(sandbox_id, "sessions"), idempotent=True), _models(wire.SessionInfo, "sessions")
    )


def session_run(
    sandbox_id: str, session_id: str, code: str, timeout: float, max_output_bytes: int, step: StepArg = None
) -> Call[wire.SessionResult]:
    body = _validated(
        wire.SessionRun, code=code, timeout=timeout, max_output_bytes=max_output_bytes, step=_step(step)
    )
    # A tagged step is deduplicated by the edge's trajectory log: safe to retry.
    return Call(
        Request(
            "POST",
            _sb(sandbox_id, "sessions", session_id, "run"),
            json=_dump(body),
            op_timeout=timeout,
            idempotent=step is not None,
        ),
        _model(wire.SessionResult),
    )


def session_close(sandbox_id: str, session_id: str) -> Call[None]:
    return Call(Request("DELETE", _sb(sandbox_id, "sessions", session_id), idempotent=True), _none)


# --------------------------------------------------------------------------- files


def file_read(sandbox_id: str, path: str) -> Call[wire.FileContent]:
    return Call(
        Request("GET", _sb(sandbox_id, "files"), params=[("path", path)], idempotent=True),
        _model(wire.FileContent),
    )


def content_text(fc: wire.FileContent) -> str:
    if fc.encoding != "utf-8":
        raise errors.InvalidRequest(f"{fc.path} is not utf-8 text ({fc.size} bytes); use files.read_bytes()")
    return fc.content


def content_bytes(fc: wire.FileContent) -> bytes:
    return base64.b64decode(fc.content) if fc.encoding == "base64" else fc.content.encode("utf-8")


def file_write(
    sandbox_id: str, path: str, content: str | bytes, mode: int, step: StepArg = None
) -> Call[None]:
    wire_len = 4 * -(-len(content) // 3) if isinstance(content, bytes) else len(content)
    if wire_len > WRITE_MAX:
        unit = "bytes" if isinstance(content, bytes) else "characters"
        raise errors.PayloadTooLarge(
            f"writing {len(content)} {unit} to {path} exceeds "
            f"the {WRITE_MAX // wire.MiB} MiB limit of files.write ({wire_len} on the wire); "
            "use files.upload or files.upload_tar for large files"
        )
    if isinstance(content, bytes):
        body = _validated(
            wire.FileWrite,
            path=path,
            content=base64.b64encode(content).decode("ascii"),
            encoding="base64",
            mode=mode,
            step=_step(step),
        )
    else:
        body = _validated(
            wire.FileWrite, path=path, content=content, encoding="utf-8", mode=mode, step=_step(step)
        )
    return Call(Request("PUT", _sb(sandbox_id, "files"), json=_dump(body), idempotent=True), _none)


def file_edit(sandbox_id: str, path: str, old: str, new: str, step: StepArg = None) -> Call[int]:
    body = _validated(wire.FileEdit, path=path, old=old, new=new, step=_step(step))

    def parse(response: httpx.Response) -> int:
        return int(response.json()["size"])

    return Call(
        Request("POST", _sb(sandbox_id, "files", "edit"), json=_dump(body), idempotent=step is not None),
        parse,
    )


def trajectory(sandbox_id: str, after_seq: int, limit: int | None) -> Call[wire.Trajectory]:
    params = [("after_seq", str(after_seq))] + ([("limit", str(limit))] if limit is not None else [])
    return Call(
        Request("GET", _sb(sandbox_id, "trajectory"), params=params, idempotent=True), _model(wire.Trajectory)
    )


def trajectory_export(sandbox_id: str, fmt: str) -> Call[bytes]:
    def parse(response: httpx.Response) -> bytes:
        return response.content

    req = Request("GET", _sb(sandbox_id, "trajectory", "export"), params=[("format", fmt)], idempotent=True)
    return Call(req, parse)


def file_stat(sandbox_id: str, path: str) -> Call[wire.FileStat]:
    return Call(
        Request("GET", _sb(sandbox_id, "files", "stat"), params=[("path", path)], idempotent=True),
        _model(wire.FileStat),
    )


def file_list(sandbox_id: str, path: str) -> Call[list[wire.FileStat]]:
    return Call(
        Request("GET", _sb(sandbox_id, "files", "list"), params=[("path", path)], idempotent=True),
        _models(wire.FileStat, "entries"),
    )


def file_delete(sandbox_id: str, path: str, recursive: bool) -> Call[None]:
    params = [("path", path), ("recursive", "true" if recursive else "false")]
    return Call(Request("DELETE", _sb(sandbox_id, "files"), params=params, idempotent=True), _none)


def archive_put(sandbox_id: str, remote_dir: str, data: bytes) -> Call[None]:
    return Call(
        Request(
            "PUT",
            _sb(sandbox_id, "archive"),
            params=[("path", remote_dir)],
            content=data,
            headers={"Content-Type": "application/x-tar"},
            idempotent=True,
        ),
        _none,
    )


def archive_get(sandbox_id: str, remote_path: str) -> Call[bytes]:
    def parse(response: httpx.Response) -> bytes:
        return response.content

    return Call(
        Request("GET", _sb(sandbox_id, "archive"), params=[("path", remote_path)], idempotent=True), parse
    )


# --------------------------------------------------------------------------- cluster


def images() -> Call[list[dict[str, Any]]]:
    def parse(response: httpx.Response) -> list[dict[str, Any]]:
        return list(response.json()["images"])

    return Call(Request("GET", "/v1/images", idempotent=True), parse)


def backends() -> Call[list[wire.BackendInfo]]:
    return Call(Request("GET", "/v1/backends", idempotent=True), _models(wire.BackendInfo, "backends"))


def edges() -> Call[list[wire.EdgeStatus]]:
    return Call(Request("GET", "/v1/edges", idempotent=True), _models(wire.EdgeStatus, "edges"))


def health() -> Call[dict[str, Any]]:
    return Call(Request("GET", "/v1/health", idempotent=True), _json)


def version() -> Call[str]:
    def parse(response: httpx.Response) -> str:
        return str(response.json()["version"])

    return Call(Request("GET", "/v1/version", idempotent=True), parse)


def pause(sandbox_id: str) -> Call[wire.SandboxInfo]:
    return Call(Request("POST", _sb(sandbox_id, "pause"), idempotent=True), _model(wire.SandboxInfo))


def resume(sandbox_id: str) -> Call[wire.SandboxInfo]:
    return Call(Request("POST", _sb(sandbox_id, "resume"), idempotent=True), _model(wire.SandboxInfo))


def pause_project(project: str) -> Call[list[str]]:
    def parse(response: httpx.Response) -> list[str]:
        return list(response.json()["paused"])

    return Call(Request("POST", f"/v1/projects/{project}/pause", idempotent=True), parse)


def snapshot(sandbox_id: str, scrub: list[str]) -> Call[wire.SnapshotInfo]:
    body = _dump(_validated(wire.SnapshotRequest, scrub=scrub))
    return Call(Request("POST", _sb(sandbox_id, "snapshot"), json=body), _model(wire.SnapshotInfo))


def fork(sandbox_id: str, n: int) -> Call[list[wire.SandboxInfo]]:
    body = _dump(_validated(wire.ForkRequest, n=n))
    return Call(Request("POST", _sb(sandbox_id, "fork"), json=body), _models(wire.SandboxInfo, "sandboxes"))


def validated_policy(policy: dict[str, Any]) -> wire.NetworkPolicy:
    return _validated(wire.NetworkPolicy, **policy)


def set_network(sandbox_id: str, policy: wire.NetworkPolicy | None) -> Call[dict[str, Any]]:
    if policy is None:
        return Call(Request("DELETE", _sb(sandbox_id, "network"), idempotent=True), _json)
    return Call(Request("PUT", _sb(sandbox_id, "network"), json=_dump(policy), idempotent=True), _json)


def network(sandbox_id: str) -> Call[dict[str, Any]]:
    return Call(Request("GET", _sb(sandbox_id, "network"), idempotent=True), _json)


def protect(sandbox_id: str, paths: list[str]) -> Call[list[str]]:
    body = _dump(_validated(wire.ProtectRequest, paths=paths))

    def parse(response: httpx.Response) -> list[str]:
        return list(response.json()["protected"])

    return Call(Request("POST", _sb(sandbox_id, "protect"), json=body), parse)


def verify(sandbox_id: str, req: wire.ExecRequest) -> Call[wire.ExecResult]:
    return Call(Request("POST", _sb(sandbox_id, "verify"), json=_dump(req)), _model(wire.ExecResult))


def checkpoint(sandbox_id: str, leave_running: bool) -> Call[wire.Checkpoint]:
    body = _dump(_validated(wire.CheckpointRequest, leave_running=leave_running))
    return Call(Request("POST", _sb(sandbox_id, "checkpoint"), json=body), _model(wire.Checkpoint))


def checkpoints() -> Call[list[wire.Checkpoint]]:
    return Call(Request("GET", "/v1/checkpoints", idempotent=True), _models(wire.Checkpoint, "checkpoints"))


def restore(
    checkpoint_id: str, sandbox_id: str | None, labels: dict[str, str] | None
) -> Call[wire.SandboxInfo]:
    body = _dump(_validated(wire.RestoreRequest, sandbox_id=sandbox_id, labels=labels or {}))
    return Call(
        Request("POST", f"/v1/checkpoints/{checkpoint_id}/restore", json=body), _model(wire.SandboxInfo)
    )


def delete_checkpoint(checkpoint_id: str) -> Call[None]:
    return Call(Request("DELETE", f"/v1/checkpoints/{checkpoint_id}", idempotent=True), _none)


def snapshots() -> Call[list[dict[str, Any]]]:
    def parse(response: httpx.Response) -> list[dict[str, Any]]:
        return list(response.json()["snapshots"])

    return Call(Request("GET", "/v1/snapshots", idempotent=True), parse)


def delete_snapshot(name: str) -> Call[None]:
    return Call(Request("DELETE", f"/v1/snapshots/{name}", idempotent=True), _none)


def prewarm(count: int, spec: wire.SandboxSpec) -> Call[dict[str, Any]]:
    if count < 0:
        raise errors.InvalidRequest(f"count must be >= 0, got {count}")
    return Call(Request("POST", "/v1/pools/prewarm", json={"spec": _dump(spec), "count": count}), _json)


def _edge(name: str) -> str:
    if not name or "/" in name or "\0" in name:
        raise errors.InvalidRequest(f"edge {name!r} must be an edge's name")
    return quote(name, safe="")


def _image_path(name: str) -> str:
    if not name or "\0" in name or len(name) > 300:
        raise errors.InvalidRequest(f"image {name[:80]!r} must be an image's name (images() lists them)")
    return quote(name, safe="/:@")


def image(name: str) -> Call[dict[str, Any]]:
    return Call(Request("GET", f"/v1/images/{_image_path(name)}", idempotent=True), _json)


def delete_image(name: str) -> Call[None]:
    return Call(Request("DELETE", f"/v1/images/{_image_path(name)}", idempotent=True), _none)


def build_image(
    context: bytes,
    name: str,
    project: str | None,
    dockerfile: str,
    target: str | None,
    build_args: dict[str, str] | None,
) -> Request:
    params = [("name", name), ("dockerfile", dockerfile)]
    params += [("project", project)] if project is not None else []
    params += [("target", target)] if target is not None else []
    params += [("build_arg", f"{k}={v}") for k, v in (build_args or {}).items()]
    return Request(
        "POST", "/v1/images/build", params=params, content=context,
        headers={"Content-Type": "application/x-tar", "Accept": "application/x-ndjson"}, op_timeout=1800.0,
    )  # fmt: skip


def pull_image(reference: str, name: str | None, project: str | None) -> Call[dict[str, Any]]:
    body = {"reference": reference, "name": name, "project": project}
    # (a second pull of the same reference makes the same image: safe to send again)
    return Call(Request("POST", "/v1/images/pull", json=body, idempotent=True, op_timeout=1800.0), _json)


def _segment(kind: str, value: str) -> str:
    if not value or "/" in value or "\0" in value:
        raise errors.InvalidRequest(f"{kind} {value!r} must be one path segment (no '/')")
    return quote(value, safe="")


def set_registry_login(project: str, registry: str, username: str, password: str) -> Call[None]:
    p, r, body = (
        _segment("project", project),
        _segment("registry", registry),
        {"username": username, "password": password},
    )
    return Call(Request("PUT", f"/v1/projects/{p}/registries/{r}", json=body, idempotent=True), _none)


def registry_logins(project: str) -> Call[list[dict[str, Any]]]:
    p = _segment("project", project)
    return Call(
        Request("GET", f"/v1/projects/{p}/registries", idempotent=True),
        lambda r: list(r.json()["registries"]),
    )


def delete_registry_login(project: str, registry: str) -> Call[None]:
    p, r = _segment("project", project), _segment("registry", registry)
    return Call(Request("DELETE", f"/v1/projects/{p}/registries/{r}", idempotent=True), _none)


def drain_edge(name: str) -> Call[dict[str, Any]]:
    return Call(Request("POST", f"/v1/edges/{_edge(name)}/drain", idempotent=True), _json)


def undrain_edge(name: str) -> Call[dict[str, Any]]:
    return Call(Request("POST", f"/v1/edges/{_edge(name)}/undrain", idempotent=True), _json)


class BurstOptions(TypedDict, total=False):
    """Keyword arguments of a burst (see :class:`dsec.models.CapacityRequest`): when (seconds
    from now, or a time with its timezone), backend, cpu, memory_mb."""

    when: float | datetime
    backend: str
    cpu: float
    memory_mb: int


def announce_capacity(project: str, count: int, image: str, opts: BurstOptions) -> Call[wire.Burst]:
    unknown = set(opts) - set(BurstOptions.__annotations__)
    if unknown:
        raise errors.InvalidRequest(f"unknown burst option(s): {', '.join(sorted(unknown))}")
    request = _validated(wire.CapacityRequest, project=project, count=count, image=image, **opts)
    return Call(Request("POST", "/v1/capacity", json=request.model_dump(mode="json")), _model(wire.Burst))


def capacity() -> Call[list[wire.Burst]]:
    return Call(Request("GET", "/v1/capacity", idempotent=True), _models(wire.Burst, "bursts"))


def cancel_capacity(burst_id: str) -> Call[wire.Burst]:
    if not burst_id or "/" in burst_id or "\0" in burst_id:
        raise errors.InvalidRequest(f"burst {burst_id!r} must be a burst's id (capacity() lists them)")
    return Call(
        Request("DELETE", f"/v1/capacity/{quote(burst_id, safe='')}", idempotent=True), _model(wire.Burst)
    )


def _principal_path(principal: str | None, action: str) -> str:
    if principal is None:
        return f"/v1/token/{action}"  # the caller's own token
    if not principal or "/" in principal or "\0" in principal:
        raise errors.InvalidRequest(f"principal {principal!r} must be a principal's name or id")
    return f"/v1/principals/{principal}/{action}"


def rotate_token(principal: str | None) -> Call[str]:
    def parse(response: httpx.Response) -> str:
        return str(response.json()["token"])

    return Call(Request("POST", _principal_path(principal, "rotate")), parse)


def revoke_token(principal: str | None) -> Call[None]:
    return Call(Request("POST", _principal_path(principal, "revoke")), _none)


def whoami() -> Call[dict[str, Any]]:
    def parse(response: httpx.Response) -> dict[str, Any]:
        return dict(response.json()["principal"])

    return Call(Request("GET", "/v1/principals/me", idempotent=True), parse)
