"""How the trajectory log stores an entry: the SQLite schema, one row per entry (or per gap),
the canonical JSON of actions, and the step tags entries are found by (the log itself, its
numbering and its writer, are dsec.trajlog.log)."""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
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
CREATE TABLE IF NOT EXISTS bodies (
    entry INTEGER PRIMARY KEY,               -- an entries rowid whose observation is large
    body BLOB NOT NULL                       -- that observation (UTF-8 JSON); its own is NULL
);
"""

COLUMNS = (
    "sandbox_id, seq, seq_end, kind, action, observation, timings, trajectory, step, action_hash, "
    "recorded_at, scope"
)
# An observation may come as UTF-8 bytes (an exec's, made from its output without a decoded
# copy: dsec.edge.outputs): CAST stores them as the same TEXT a str would be. Bound whole,
# SQLite holds two copies of a value while it inserts it; one over LARGE bytes goes to `bodies`
# instead (its entry's own observation NULL), made as a zeroblob and written piece by piece
# (blob I/O). A zeroblob costs nothing only as the last column of its row, hence the table of
# its own. Reads take it from there (READ_COLUMNS).
INSERT = f"INSERT INTO entries ({COLUMNS}) VALUES (?,?,?,?,?,CAST(? AS TEXT),?,?,?,?,?,?)"
READ_COLUMNS = COLUMNS.replace(
    "observation",
    "CAST(COALESCE((SELECT body FROM bodies WHERE entry = entries.rowid), observation) AS TEXT)",
)
LARGE = 1024 * 1024

# One entry as stored: the columns above, in order. Built once in record(), immutable afterwards.
Observation = str | bytes | bytearray
Row = tuple[
    str, int, int, str, str, Observation | None, str, str | None, int | None, str | None, float, str | None
]

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
    observation: dict[str, Any] | bytes | bytearray | None,
    timings: dict[str, float],
) -> tuple[str, Observation | None, str]:
    """A record's checked arguments as the JSON the log stores (action, observation, timings).
    An observation given as bytes is its canonical JSON already, taken as it is."""
    if not isinstance(sandbox_id, str) or not sandbox_id:
        raise errors.InvalidRequest("sandbox_id must be a non-empty string")
    if not isinstance(kind, str) or not kind or kind == GAP:
        raise errors.InvalidRequest(f"kind must be a non-empty string other than {GAP!r}")
    try:
        action_json = canonical_json(action)
        observation_json = observation if not isinstance(observation, dict) else canonical_json(observation)
        timings_json = canonical_json(timings)
    except (TypeError, ValueError) as e:
        raise errors.InvalidRequest(f"action, observation and timings must be JSON objects: {e}") from e
    if not (isinstance(action, dict) and isinstance(timings, dict)) or not (
        observation is None or isinstance(observation, dict | bytes | bytearray)
    ):
        raise errors.InvalidRequest("action, observation and timings must be JSON objects")
    for v in timings.values():
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise errors.InvalidRequest(f"timings must map names to finite numbers, got {v!r}")
    return action_json, observation_json, timings_json


def insert_rows(db: sqlite3.Connection, rows: list[Row]) -> None:
    """Insert `rows` in order; an observation over LARGE bytes goes to `bodies`, written piece
    by piece, never bound whole."""
    start = 0
    for i, row in enumerate(rows):
        obs = row[5]
        if isinstance(obs, bytes | bytearray) and len(obs) > LARGE:
            db.executemany(INSERT, rows[start:i])
            entry = db.execute(INSERT, (*row[:5], None, *row[6:])).lastrowid
            db.execute("INSERT INTO bodies (entry, body) VALUES (?, zeroblob(?))", (entry, len(obs)))
            with db.blobopen("bodies", "body", entry or 0) as blob:
                view = memoryview(obs)
                for at in range(0, len(view), LARGE):
                    blob.write(view[at : at + LARGE])
            start = i + 1
    db.executemany(INSERT, rows[start:])
