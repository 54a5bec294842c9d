"""Sandboxes, execs, sessions, files, snapshots and checkpoints on the wire."""

from __future__ import annotations

import re
import time
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.models.network import NetworkPolicy

MiB = 1024 * 1024
# What a sandbox gets when neither its spec nor its image names a user or a workdir.
DEFAULT_USER = "root"
DEFAULT_WORKDIR = "/work"
ShortStr = Annotated[str, Field(max_length=256)]
LabelDict = Annotated[dict[str, str], Field(max_length=64)]
# Label keys under this prefix are the platform's (dsec.fork-of, dsec.restored-from, ...): the
# apiserver refuses them in what a user sends.
PLATFORM_LABEL_PREFIX = "dsec."
# What a keyed create made carries (a digest of principal and key): a create taken over from a
# dead apiserver looks for it. It belongs to that sandbox alone: forks and restores drop it.
IDEMPOTENCY_LABEL = "dsec.idempotency"


def inherited_labels(labels: dict[str, str], **platform: str) -> dict[str, str]:
    """A fork's or a restore's labels: its source's, less the idempotency label, plus
    `platform` (keyword names with '_' for '-', under PLATFORM_LABEL_PREFIX)."""
    out = {k: v for k, v in labels.items() if k != IDEMPOTENCY_LABEL}
    out.update({PLATFORM_LABEL_PREFIX + k.replace("_", "-"): v for k, v in platform.items()})
    return out


# The kernel takes at most ~2 MiB of argv + environment in all (and 128 KiB per string): bound
# the environment well inside that, so too much is a clear 4xx here and not a failure at exec.
MAX_ENV_VARS = 4096
MAX_ENV_BYTES = 1 * MiB
EnvDict = Annotated[dict[str, str], Field(max_length=MAX_ENV_VARS)]


def check_env(v: dict[str, str]) -> dict[str, str]:
    """Environment variables: names without '=' or NUL, values without NUL, bounded in size."""
    total = 0
    for k, val in v.items():
        if not k or "=" in k or "\0" in k or "\0" in val:
            raise ValueError(f"environment variable name {k[:100]!r} is invalid: no '=' or NUL allowed")
        total += len(k) + len(val) + 2
    if total > MAX_ENV_BYTES:
        raise ValueError(
            f"the environment holds {total} bytes, over the {MAX_ENV_BYTES}-byte limit: pass large data "
            "as a file or on stdin"
        )
    return v


_SURROGATE = re.compile("[\ud800-\udfff]")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    FAILED = "failed"


class SandboxSpec(_Model):
    """What a caller asks for. Limits are hard: cgroups and the writable layer's file system
    enforce them."""

    image: ShortStr = "python"
    cpu: float = Field(1.0, gt=0, le=64, description="CPU cores (CFS quota); also sets the CPU weight")
    memory_mb: int = Field(1024, ge=16, le=262144)
    pids: int = Field(1024, ge=8, le=65536, description="max processes and threads")
    disk_mb: int = Field(2048, ge=1, le=1048576, description="size of the writable layer")
    disk_inodes: int = Field(262144, ge=1024, le=16777216, description="files the writable layer can hold")
    storage: Literal["disk", "memory"] = Field(
        "disk",
        # Left out when it is the default, as `backend` is: older edges and records read it.
        exclude_if=lambda v: v == "disk",
        description="where the writable layer lives: disk (an ext4 of disk_mb of its own: files do not "
        "count against memory_mb) or memory (a tmpfs of disk_mb whose pages are memory_mb's: "
        "~2 ms faster to create, for short, write-light tasks)",
    )
    max_output_bytes: int = Field(
        1 * MiB, ge=0, le=64 * MiB, description="ceiling on what any call in this sandbox captures per stream"
    )
    env: Annotated[dict[str, str], Field(max_length=256)] = Field(
        default_factory=dict, description="over the image's env (ImageConfig.env); each call's goes over it"
    )
    user: ShortStr | None = Field(
        None,
        description="root, a name of the image's /etc/passwd, uid or uid:gid (names may take a "
        ":group); None: the image's USER, else root. A sandbox's info shows the one it runs as",
    )
    workdir: ShortStr | None = Field(
        None,
        description="the cwd of its execs and sessions, made at create when missing; None: the "
        "image's WORKDIR, else /work. A sandbox's info shows the one it has",
    )
    labels: LabelDict = Field(default_factory=dict)
    ttl_idle_s: float | None = Field(
        None, gt=0, description="stop (or pause) after this long without a request"
    )
    ttl_action: Literal["stop", "pause"] = Field("stop", description="what the idle TTL does")
    project: ShortStr = "default"
    backend: str = Field(
        "container",
        pattern=r"^[a-z][a-z0-9-]{0,31}$",
        # Left out of what is sent and stored when it is the default: older apiservers, edges and
        # records (which forbid unknown fields) keep reading specs of the default backend.
        exclude_if=lambda v: v == "container",
        description="the isolation tier that runs it: container, gvisor; GET /v1/backends lists them",
    )
    network: NetworkPolicy | None = Field(
        None, description="egress allowlist (domains, IPs/CIDRs, ports, protocols); None: loopback only"
    )
    protected_paths: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="paths of the image (graders, reference answers) moved out of the sandbox at "
        "create: the agent cannot read them; POST .../verify brings them back for one command",
    )

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("workdir must be an absolute path such as /work")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class ForkLayer(_Model):
    """The shared layer a fork copied the parent's writable layer into (the fork response
    only): it lives on the edge until no sandbox stacks it any more. A microVM's child has
    none: this is its own copy of the parent's disk (id: the child's), held until it stops."""

    id: str
    size_bytes: int


class SandboxInfo(_Model):
    id: str
    state: SandboxState
    spec: SandboxSpec
    edge: str
    created_at: float
    last_active: float
    reason: str | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict)
    telemetry: dict[str, int] = Field(
        default_factory=dict,
        description="misbehaviour counters (GET only): oom_kills, pids_limit_hits, timeouts, "
        "output_truncated, disk_full, disk_used_bytes, disk_used_inodes, denied_connections",
    )
    usage: dict[str, int] = Field(
        default_factory=dict,
        description="resource use now, read from the sandbox's cgroup (GET only): memory_bytes, "
        "memory_peak_bytes (the most since it started), cpu_usec (CPU time); what the host does "
        "not count is left out",
    )
    fork_layer: ForkLayer | None = Field(None, description="the layer a fork made (fork response only)")
    image_digest: str | None = Field(
        None,
        exclude_if=lambda v: v is None,  # (older readers forbid new fields)
        description="the digest of the image it started from (`spec.image` may name other content "
        "later; `image@digest` names this content for as long as the edge keeps it)",
    )


class Step(_Model):
    """A client's tag for one step of a trajectory: (trajectory id, step index).

    A tagged step already in the log is not run again: its recorded result comes back
    (`replayed=True`); a different action at the same tag is a `trajectory_divergence`."""

    trajectory: str = Field(min_length=1, max_length=256)
    index: int = Field(ge=0, le=2**63 - 1)


class ExecRequest(_Model):
    cmd: str | list[str] = Field(description="a shell string (run by /bin/sh -c) or an argv list")
    stdin: str | None = Field(None, max_length=64 * MiB)
    env: EnvDict = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout: float = Field(60.0, gt=0, le=86400)
    max_output_bytes: int = Field(1 * MiB, ge=0, le=64 * MiB, description="cap per stream")
    step: Step | None = None
    trusted: bool = Field(
        False,
        description="run with the image's own toolchain: its read-only layers for every system "
        "path, the sandbox's files only in `task_dirs`, as a platform uid the sandbox cannot "
        "reach, with a clean environment (verify always runs so)",
    )
    task_dirs: list[ShortStr] | None = Field(
        None,
        max_length=16,
        description="trusted only: the directories taken live from the sandbox (default: /work "
        "and the sandbox's workdir)",
    )

    _env = field_validator("env")(check_env)

    @field_validator("cmd")
    @classmethod
    def _non_empty(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and (not v or not all(isinstance(a, str) for a in v)):
            raise ValueError("cmd as a list must be a non-empty argv of strings")
        if isinstance(v, str) and not v.strip():
            raise ValueError("cmd must not be empty")
        return v


class ExecResult(_Model):
    stdout: str
    stderr: str
    exit_code: int
    duration: float
    truncated: bool = False
    timed_out: bool = False
    misbehaviour: dict[str, int] = Field(
        default_factory=dict,
        description="limit hits during this call (oom_kills, pids_limit_hits, disk_full): an "
        "environment limit, not the task, may explain the result",
    )
    seq: int | None = Field(None, description="this operation's number in the sandbox's trajectory log")
    replayed: bool = False


class SessionKind(StrEnum):
    BASH = "bash"
    PYTHON = "python"


class SessionCreate(_Model):
    kind: SessionKind = SessionKind.BASH
    env: EnvDict = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None

    _env = field_validator("env")(check_env)


class SessionInfo(_Model):
    id: str
    kind: SessionKind
    created_at: float = Field(default_factory=time.time)


class SessionRun(_Model):
    code: str = Field(max_length=16 * MiB, description="a bash command line or Python source")
    timeout: float = Field(60.0, gt=0, le=86400)
    max_output_bytes: int = Field(1 * MiB, ge=0, le=64 * MiB)
    step: Step | None = None


class SessionResult(_Model):
    output: str = Field(description="stdout (bash: stdout and stderr merged, in order)")
    stderr: str = ""
    exit_code: int
    error: str | None = Field(None, description="Python: the traceback of an uncaught exception")
    duration: float
    truncated: bool = False
    timed_out: bool = False
    seq: int | None = None
    replayed: bool = False


class FileWrite(_Model):
    path: str
    content: str = Field(max_length=128 * MiB)
    encoding: Literal["utf-8", "base64"] = "utf-8"
    mode: int = Field(0o644, ge=0, le=0o7777)
    step: Step | None = None


class FileContent(_Model):
    path: str
    content: str
    encoding: Literal["utf-8", "base64"]
    size: int


class FileEdit(_Model):
    path: str
    old: str = Field(min_length=1)
    new: str
    step: Step | None = None


class FileStat(_Model):
    """A file's metadata. Its `path` and `name` are text: a byte of a name that is not UTF-8
    (a sandbox may name its files anything) is shown as U+FFFD, as in exec output."""

    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    uid: int
    gid: int

    @field_validator("path", "name")
    @classmethod
    def _text(cls, v: str) -> str:
        # os.fsdecode's surrogate escapes cannot be encoded as JSON: the answer was a 500
        return v if v.isascii() else _SURROGATE.sub("\ufffd", v)


class BackendInfo(_Model):
    """One isolation tier (`SandboxSpec.backend`): what it can do and how it runs here."""

    name: str
    available: bool = True
    capabilities: list[str] = Field(default_factory=list, description="operations it supports")
    accelerated: bool = Field(
        default=True, description="False: it runs, but emulated (a microVM without KVM: TCG)"
    )
    reason: str | None = Field(default=None, description="why it is not available")
    detail: dict[str, str | list[str]] = Field(
        default_factory=dict, description="how it runs (gvisor: the platform in use and those that work)"
    )
    edges: list[str] = Field(default_factory=list, description="edges that run it (cluster view)")


class EdgeStatus(_Model):
    name: str
    url: str | None = None
    healthy: bool
    backends: list[str]
    backend_info: list[BackendInfo] = Field(default_factory=list)
    capacity: dict[str, float]
    used: dict[str, float]
    sandboxes: int
    by_image: dict[str, int]
    by_project: dict[str, int]
    layers: list[str]
    images: list[str]
    fork_layers: list[str] = Field(
        default_factory=list, description="ids of the fork layers alive (stacked by some sandbox)"
    )
    registry: bool = Field(
        default=False, description="pulls an image it lacks from an OCI registry at its first create"
    )
    draining: bool = Field(
        False, description="takes no new placements (set by the apiserver: drain, idle release)"
    )


class SnapshotInfo(_Model):
    id: str = Field(description="an image name: create sandboxes from it to restore")
    sandbox: str
    layer: str
    size_bytes: int
    files: int
    scrubbed: list[str]
    created_at: float


_MAX_BYTES = (
    "refuse (quota_exceeded) a copy bigger than this many bytes before it is made; the apiserver "
    "lowers it to what the project's snapshot quota has left"
)


class SnapshotRequest(_Model):
    scrub: list[str] = Field(default_factory=list, max_length=1024, description="absolute paths to leave out")
    max_bytes: int | None = Field(None, ge=0, description=_MAX_BYTES)


class ProtectRequest(_Model):
    paths: list[str] = Field(min_length=1, max_length=64, description="absolute paths to move into the vault")


class CheckpointRequest(_Model):
    leave_running: bool = Field(
        True, description="keep the processes running after the dump (else kill them)"
    )
    max_bytes: int | None = Field(None, ge=0, description=_MAX_BYTES)


class CheckpointTree(_Model):
    root: int = Field(description="pid of the tree's root inside the sandbox")
    pids: list[int]
    cmdline: str


class Checkpoint(_Model):
    id: str = Field(description="restore it with POST /v1/checkpoints/{id}/restore")
    sandbox: str
    project: str
    image: str
    cpu: float = Field(description="the sandbox's shape; a restore into a new sandbox gets the same")
    memory_mb: int
    backend: str = Field(
        default="container",
        exclude_if=lambda v: v == "container",  # (as in SandboxSpec: older readers forbid new fields)
        description="the backend it was taken on (and restores on)",
    )
    trees: list[CheckpointTree]
    size_bytes: int = Field(description="process images (the files copied with them come on top)")
    leave_running: bool
    created_at: float
    timings_ms: dict[str, float] = Field(default_factory=dict)


class RestoreRequest(_Model):
    sandbox_id: str | None = Field(
        None,
        description="restore into this running sandbox (its processes are replaced); "
        "by default a new sandbox with the checkpoint's files and spec is created",
    )
    labels: dict[str, str] = Field(default_factory=dict, description="labels of the new sandbox")


class ForkRequest(_Model):
    n: int = Field(1, ge=1, le=256)
    max_layer_bytes: int | None = Field(
        None, ge=0, description=_MAX_BYTES.replace("snapshot quota", "snapshot and memory quotas")
    )
