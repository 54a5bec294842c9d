"""How the trajectory log stores an entry: the SQLite schema, one row per entry (or per gap),
the canonical JSON of actions, and the step tags entries are found by (the log itself, its
numbering and its writer, are dsec.trajlog.log)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from dsec import errors
from dsec.models.trajectory import Entry

GAP = "gap"

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    sandbox_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    seq_end INTEGER NOT NULL,       -- = seq, except for a gap: the last seq it covers
    kind TEXT NOT NULL,
    action TEXT NOT NULL,           -- canonical JSON
    observation TEXT,               -- canonical JSON or NULL
    timings TEXT NOT NULL,          -- canonical JSON
    trajectory TEXT,
    step INTEGER,
    action_hash TEXT,
    recorded_at REAL NOT NULL,
    scope TEXT,                     -- whose step tag: the sandbox's project (NULL: logged before scopes)
    PRIMARY KEY (sandbox_id, seq)
);
CREATE TABLE IF NOT EXISTS shipped (
    target TEXT PRIMARY KEY,                 -- where entries are shipped to (the control plane)
    last_rowid INTEGER NOT NULL              -- every durable entry up to this rowid is there
);
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    reserved_hw INTEGER NOT NULL DEFAULT 0,  -- seqs up to here may have been handed out
    durable_seq INTEGER NOT NULL DEFAULT 0,  -- every seq up to here has an entry or lies in a gap
    recorded INTEGER NOT NULL DEFAULT 0,     -- durable non-gap entries
    lost INTEGER NOT NULL DEFAULT 0          -- seqs inside gap entries
);
"""

COLUMNS = (
    "sandbox_id, seq, seq_end, kind, action, observation, timings, trajectory, step, action_hash, "
    "recorded_at, scope"
)
INSERT = f"INSERT INTO entries ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"

# One entry as stored: the columns above, in order. Built once in record(), immutable afterwards.
Row = tuple[str, int, int, str, str, str | None, str, str | None, int | None, str | None, float, str | None]

# Step tags are unique per scope (a project): two tenants may use the same trajectory ids
# without ever seeing each other's steps. Logs written before scopes had a global unique
# index on (trajectory, step); _migrate replaces it.
STEP_INDEX = (
    "CREATE UNIQUE INDEX IF NOT EXISTS entries_step_scoped ON entries (trajectory, step, scope) "
    "WHERE trajectory IS NOT NULL"
)


@dataclass(frozen=True)
class StepTag:
    """Where an operation sits in an agent trajectory: unique per (scope, trajectory, index).

    ``scope`` is whose trajectory it is (the edge uses the sandbox's project): a step is
    found, replayed and refused only within its scope."""

    trajectory: str
    index: int
    scope: str = ""


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, UTF-8, no NaN: equal values give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def action_hash(action: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of an action."""
    return hashlib.sha256(canonical_json(action).encode()).hexdigest()


def entry_from_row(row: tuple[Any, ...]) -> Entry:
    return Entry(
        sandbox_id=row[0],
        seq=row[1],
        kind=row[3],
        action=json.loads(row[4]),
        observation=None if row[5] is None else json.loads(row[5]),
        timings=json.loads(row[6]),
        trajectory=row[7],
        step=row[8],
        action_hash=row[9],
        recorded_at=row[10],
    )


def gap_row(sandbox_id: str, first: int, last: int, now: float) -> Row:
    n = last - first + 1
    action = {"first_seq": first, "last_seq": last}
    observation = {
        "reason": f"the edge stopped before this batch was flushed; up to {n} operations may have been lost",
        "first_seq": first,
        "last_seq": last,
        "count": n,
    }
    a = canonical_json(action)
    return (sandbox_id, first, last, GAP, a, canonical_json(observation), "{}", None, None,
            hashlib.sha256(a.encode()).hexdigest(), now, None)  # fmt: skip


def serialized(
    sandbox_id: str,
    kind: str,
    action: dict[str, Any],
    observation: dict[str, Any] | None,
    timings: dict[str, float],
) -> tuple[str, str | None, str]:
    """A record's checked arguments as the JSON the log stores (action, observation, timings)."""
    if not isinstance(sandbox_id, str) or not sandbox_id:
        raise errors.InvalidRequest("sandbox_id must be a non-empty string")
    if not isinstance(kind, str) or not kind or kind == GAP:
        raise errors.InvalidRequest(f"kind must be a non-empty string other than {GAP!r}")
    try:
        action_json = canonical_json(action)
        observation_json = None if observation is None else canonical_json(observation)
        timings_json = canonical_json(timings)
    except (TypeError, ValueError) as e:
        raise errors.InvalidRequest(f"action, observation and timings must be JSON objects: {e}") from e
    if not (isinstance(action, dict) and isinstance(timings, dict)) or not (
        observation is None or isinstance(observation, dict)
    ):
        raise errors.InvalidRequest("action, observation and timings must be JSON objects")
    for v in timings.values():
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise errors.InvalidRequest(f"timings must map names to finite numbers, got {v!r}")
    return action_json, observation_json, timings_json
