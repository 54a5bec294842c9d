"""Warm pools on the wire: a pool's shape and its state."""

from __future__ import annotations

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
    user: str = "root"
    workdir: str = "/work"
    min_size: int = Field(0, ge=0, le=10000)
    max_size: int = Field(64, ge=0, le=10000)

    def key(self) -> tuple[object, ...]:
        return (
            self.image,
            self.cpu,
            self.memory_mb,
            self.pids,
            self.disk_mb,
            self.disk_inodes,
            self.user,
            self.workdir,
        )

    def base_spec(self) -> SandboxSpec:
        return SandboxSpec(
            image=self.image,
            cpu=self.cpu,
            memory_mb=self.memory_mb,
            pids=self.pids,
            disk_mb=self.disk_mb,
            disk_inodes=self.disk_inodes,
            user=self.user,
            workdir=self.workdir,
            project=POOL_PROJECT,
        )


class PoolInfo(BaseModel):
    spec: PoolSpec
    ready: int
    target: int
    claims: int
    misses: int
