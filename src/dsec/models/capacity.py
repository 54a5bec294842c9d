"""Elastic capacity on the wire: a burst a job announces, and what dsec did about it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from dsec.models.sandbox import ShortStr

MAX_LEAD_S = 7 * 86400.0  # a burst is announced at most a week ahead

BurstState = Literal["scheduled", "provisioning", "ready", "partial", "failed", "cancelled"]


class CapacityRequest(BaseModel):
    """`POST /v1/capacity`: `count` sandboxes of this shape will be created in `project` at
    `when`. dsec pre-warms pools of that shape across the edges (and asks its node provider
    for more edges when they are short), so the creates are served from warm pools."""

    model_config = ConfigDict(extra="forbid")

    project: ShortStr = Field(description="the project whose job will create them")
    image: ShortStr = "python"
    backend: str = Field("container", pattern=r"^[a-z][a-z0-9-]{0,31}$")
    cpu: float = Field(1.0, gt=0, le=64, description="as the creates will ask (the pool's shape)")
    memory_mb: int = Field(1024, ge=16, le=262144)
    count: int = Field(ge=1, le=100000, description="sandboxes (the apiserver may bound it lower)")
    when: Annotated[float, Field(ge=0, le=MAX_LEAD_S)] | AwareDatetime = Field(
        0.0, description="seconds from now, or a time with its timezone (ISO 8601)"
    )


class Burst(BaseModel):
    """An announced burst and what was done for it."""

    id: str
    project: str
    image: str
    backend: str
    cpu: float
    memory_mb: int
    count: int
    when: float = Field(description="epoch seconds")
    announced_at: float
    announced_by: str
    state: BurstState
    prewarmed: dict[str, int] = Field(default_factory=dict, description="edge -> sandboxes pre-warmed")
    edges_requested: int = Field(0, description="edges asked of the node provider")
    edges_added: list[str] = Field(default_factory=list, description="new edges that came up for it")
    shortfall: int = Field(0, description="sandboxes no edge could take")
    actions: list[str] = Field(default_factory=list, description="what was done, in order")
    error: str | None = None
