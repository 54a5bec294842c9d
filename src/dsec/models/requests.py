"""Request bodies of the apiserver's and the edge's routes that are no resource of their own."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from dsec.models.iam import Quota
from dsec.models.pools import PoolSpec
from dsec.models.sandbox import SandboxSpec


class BatchCreate(BaseModel):
    count: int = Field(ge=1, le=1024)
    spec: SandboxSpec


class BatchStop(BaseModel):
    ids: list[str] = Field(max_length=4096)


class RegisterEdge(BaseModel):
    name: str
    url: str


class PrewarmRequest(BaseModel):
    spec: SandboxSpec
    count: int = Field(ge=0, le=10000)


class BuildRequest(BaseModel):
    recipe: str


BackendName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")]


class ProjectCreate(BaseModel):
    name: str
    parent: str | None = None
    quota: Quota = Field(default_factory=Quota)
    allowed_backends: list[BackendName] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description='the backends its sandboxes may use (a minimum tier: e.g. ["gvisor"]); a child '
        "project may only narrow its parent's; None: whatever the parent allows",
    )


class PrincipalCreate(BaseModel):
    name: str
    projects: list[str] = Field(default_factory=list)
    admin: bool = False


class PoolPrewarm(BaseModel):
    """apiserver -> edge: keep `count` sandboxes of a pool's shape ready."""

    spec: PoolSpec
    count: int = Field(ge=0, le=10000)
    project: str | None = Field(
        None, description="the project the burst is for: a snapshot image must be its (None: an admin's)"
    )
