"""The trajectory log on the wire: recorded operations, and a sandbox's log with its counts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class _ItemAccess:
    """`t["entries"]`, `e["seq"]`: the attributes read as keys too (the log was a plain dict
    before it was typed; code that indexes it keeps working)."""

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:  # type: ignore[attr-defined]
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in type(self).model_fields else default  # type: ignore[attr-defined]

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields  # type: ignore[attr-defined]


class Entry(_ItemAccess, BaseModel):
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


class TrajectoryStats(_ItemAccess, BaseModel):
    """Always ``acknowledged == recorded + lost + pending``."""

    acknowledged: int  # seqs handed out (or covered by a gap)
    recorded: int  # durable entries that are not gaps
    lost: int  # seqs inside gap entries (a crash between reservation and write)
    pending: int  # handed out, not yet durable


class Shipped(_ItemAccess, BaseModel):
    """A log read from the control plane (its edge was lost): how far it goes."""

    edge: str
    shipped_seq: int  # every entry up to here is in `entries` (or in a gap entry)
    last_known_seq: int  # the edge had handed out up to here when it last shipped
    shipped_at: float
    note: str


class Trajectory(_ItemAccess, BaseModel):
    """A sandbox's logged operations in seq order, gaps included, and its counts."""

    entries: list[Entry]
    stats: TrajectoryStats
    # "edge": its edge answered; "control-plane": the edge was lost and this is what it
    # shipped before (`shipped` says how far that goes and what may be missing)
    source: str = "edge"
    shipped: Shipped | None = None


class ShippedBatch(BaseModel):
    """Entries an edge ships to the control plane (dsec.edge.shipper): rows as its log
    stores them, and each sandbox's counts as of the batch."""

    edge: str = Field(pattern=r"^[a-z0-9]{1,12}$")
    rows: list[list[Any]] = Field(max_length=5000)
    stats: dict[str, dict[str, int]] = Field(default_factory=dict, max_length=5000)
