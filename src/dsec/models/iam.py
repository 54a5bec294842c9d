"""Projects, principals and quotas on the wire."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Quota(BaseModel):
    """Limits of a project's whole subtree.

    ``None`` means unlimited at this level (an ancestor's bound still applies).
    """

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: int | None = Field(default=None, ge=0)
    max_cpu: float | None = Field(default=None, ge=0)
    max_memory_mb: int | None = Field(default=None, ge=0)
    max_snapshots: int | None = Field(default=None, ge=0)
    #: Total size of the subtree's snapshots in MiB, each snapshot rounded up to a whole MiB.
    max_snapshot_mb: int | None = Field(default=None, ge=0)


class Project(BaseModel):
    name: str
    parent: str | None
    quota: Quota
    created_at: float
    allowed_backends: list[str] | None = Field(
        default=None, description="the backends its sandboxes may use (None: any its parent allows)"
    )


class Principal(BaseModel):
    id: str
    name: str
    admin: bool
    projects: list[str]
    created_at: float


class Usage(BaseModel):
    sandboxes: int
    cpu: float
    memory_mb: int
    snapshots: int = 0
    snapshot_mb: int = 0
