"""The trajectory log on the wire: one recorded operation."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Entry(BaseModel):
    sandbox_id: str
    seq: int
    kind: str  # "exec" | "session" | "file" | ... | "gap"
    action: dict[str, Any]
    observation: dict[str, Any] | None
    timings: dict[str, float]
    trajectory: str | None = None
    step: int | None = None
    action_hash: str | None = None
    recorded_at: float
