"""The edge's durable record of its own sandboxes (SQLite, WAL).

Small on purpose: enough to re-adopt running sandboxes after an edge restart
(the shim's pid and start time) and to reap the ones that died meanwhile.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.models import SandboxInfo, SandboxSpec, SandboxState
from dsec.privatefs import private_file

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    pid INTEGER,
    start_time INTEGER,
    created_at REAL NOT NULL,
    last_active REAL NOT NULL,
    reason TEXT,
    extra_lower TEXT,
    image_digest TEXT
);
"""


@dataclass
class Record:
    id: str
    spec: SandboxSpec
    state: SandboxState
    pid: int | None
    start_time: int | None
    created_at: float
    last_active: float
    reason: str | None = None
    extra_lower: str | None = None  # a fork's shared layer (a directory), stacked under the toolkit
    image_digest: str | None = None  # what its image was when it started (Image.digest)

    def info(self, edge: str, timings_ms: dict[str, float] | None = None) -> SandboxInfo:
        """The sandbox as the API shows it (`timings_ms`: its start's, while it runs)."""
        return SandboxInfo(
            id=self.id,
            state=self.state,
            spec=self.spec,
            edge=edge,
            created_at=self.created_at,
            last_active=self.last_active,
            reason=self.reason,
            timings_ms=timings_ms or {},
            image_digest=self.image_digest,
        )


class EdgeStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        private_file(path)  # 0600, and so its -wal and -shm files
        # isolation_level=None: autocommit; each statement is its own transaction.
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL survives a crash of the edge (kill -9); only power loss could lose
        # the last commits, and sandboxes do not survive that either.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(sandboxes)")}
        if "extra_lower" not in columns:  # a database from before forks
            self.db.execute("ALTER TABLE sandboxes ADD COLUMN extra_lower TEXT")
        if "image_digest" not in columns:  # ... and before image digests
            self.db.execute("ALTER TABLE sandboxes ADD COLUMN image_digest TEXT")

    def close(self) -> None:
        self.db.close()

    def put(self, r: Record) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO sandboxes"
            " (id, spec, state, pid, start_time, created_at, last_active, reason, extra_lower, image_digest)"
            " VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                r.id,
                r.spec.model_dump_json(),
                r.state.value,
                r.pid,
                r.start_time,
                r.created_at,
                r.last_active,
                r.reason,
                r.extra_lower,
                r.image_digest,
            ),
        )

    def delete(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def touch_many(self, stamps: dict[str, float]) -> None:
        if stamps:
            self.db.executemany(
                "UPDATE sandboxes SET last_active = ? WHERE id = ?", [(t, i) for i, t in stamps.items()]
            )

    def all(self) -> list[Record]:
        rows = self.db.execute(
            "SELECT id, spec, state, pid, start_time, created_at, last_active, reason, extra_lower,"
            " image_digest FROM sandboxes"
        ).fetchall()
        return [
            Record(
                id=row[0],
                spec=SandboxSpec.model_validate_json(row[1]),
                state=SandboxState(row[2]),
                pid=row[3],
                start_time=row[4],
                created_at=row[5],
                last_active=row[6],
                reason=row[7],
                extra_lower=row[8],
                image_digest=row[9],
            )
            for row in rows
        ]


def now() -> float:
    return time.time()
