"""Request bodies of the apiserver's and the edge's routes that are no resource of their own."""

from __future__ import annotations

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


class ProjectCreate(BaseModel):
    name: str
    parent: str | None = None
    quota: Quota = Field(default_factory=Quota)


class PrincipalCreate(BaseModel):
    name: str
    projects: list[str] = Field(default_factory=list)
    admin: bool = False


class PoolPrewarm(BaseModel):
    """apiserver -> edge: keep `count` sandboxes of a pool's shape ready."""

    spec: PoolSpec
    count: int = Field(ge=0, le=10000)
