"""Warm pools on the wire: a pool's shape and its state."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from dsec.models.sandbox import SandboxSpec

POOL_PROJECT = "_pool"  # the project ready pool sandboxes belong to until claimed


class PoolSpec(BaseModel):
    image: str = "python"
    cpu: float = 1.0
    memory_mb: int = 1024
    pids: int = 1024
    disk_mb: int = 2048
    disk_inodes: int = 262144
    storage: Literal["disk", "memory"] = Field("disk", exclude_if=lambda v: v == "disk")
    user: str | None = None  # (as in SandboxSpec: None is the image's, else root and /work)
    workdir: str | None = None
    backend: str = Field(
        "container", pattern=r"^[a-z][a-z0-9-]{0,31}$", description="the tier of its sandboxes"
    )
    min_size: int = Field(0, ge=0, le=10000)
    max_size: int = Field(64, ge=0, le=10000)

    def key(self) -> tuple[object, ...]:
        """What makes two pools the same: the sandbox they hold (not their sizes)."""
        return tuple(getattr(self, f) for f in POOL_SHAPE)

    def base_spec(self) -> SandboxSpec:
        """The spec of the sandboxes it holds, as the pool's project owns them until claimed."""
        return SandboxSpec.model_validate(
            {f: getattr(self, f) for f in POOL_SHAPE} | {"project": POOL_PROJECT}
        )


# The fields of a pool that are the fields of its sandboxes' spec: a create whose spec has the
# same values takes a sandbox from it (dsec.edge.pools.spec_key).
POOL_SHAPE = tuple(f for f in PoolSpec.model_fields if f in SandboxSpec.model_fields)


class PoolInfo(BaseModel):
    spec: PoolSpec
    ready: int
    target: int
    claims: int
    misses: int
