"""Trajectory logs shipped by edges (dsec.edge.shipper), kept in the control plane's database
so that a sandbox's log outlives its edge. A part of `IAM` (store.py), which holds the
database; what it uses of the rest of IAM is declared at the top."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from dsec.iam.db import Part, Row

COLUMNS = (
    "sandbox_id, seq, seq_end, kind, action, observation, timings, trajectory, step, action_hash, "
    "recorded_at, scope"
)


# The newest counts win; how far shipping got only grows (a batch sent again changes nothing).
_UPSERT_SHIPPED = """
INSERT INTO trajectory_shipped
    (sandbox_id, edge, scope, shipped_seq, acknowledged, recorded, lost, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (sandbox_id) DO UPDATE SET
    shipped_seq = CASE WHEN excluded.shipped_seq > trajectory_shipped.shipped_seq
                       THEN excluded.shipped_seq ELSE trajectory_shipped.shipped_seq END,
    acknowledged = CASE WHEN excluded.acknowledged > trajectory_shipped.acknowledged
                        THEN excluded.acknowledged ELSE trajectory_shipped.acknowledged END,
    recorded = excluded.recorded, lost = excluded.lost, updated_at = excluded.updated_at,
    scope = COALESCE(trajectory_shipped.scope, excluded.scope)
"""


def _entry(r: Row) -> dict[str, Any]:
    return {
        "sandbox_id": r[0],
        "seq": r[1],
        "kind": r[3],
        "action": json.loads(r[4]),
        "observation": None if r[5] is None else json.loads(r[5]),
        "timings": json.loads(r[6]),
        "trajectory": r[7],
        "step": r[8],
        "action_hash": r[9],
        "recorded_at": r[10],
    }


class ShippedTrajectories(Part):
    def store_trajectories(
        self, edge: str, rows: Sequence[Sequence[Any]], stats: dict[str, dict[str, int]]
    ) -> int:
        """Store a batch an edge shipped (idempotent: rows already there are kept); how many
        were new. Each sandbox's counts are the edge's as of the batch."""
        new = 0
        now = time.time()
        with self._write() as db:
            top: dict[str, tuple[int, str | None]] = {}
            for r in rows:
                cur = db.execute(
                    f"INSERT INTO trajectory_entries ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
                    " ON CONFLICT DO NOTHING",
                    tuple(r),
                )
                new += int(cur.rowcount or 0)
                sid, seq_end, scope = str(r[0]), int(r[2]), r[11]
                if seq_end > top.get(sid, (0, None))[0]:
                    top[sid] = (seq_end, scope)
            for sid, (seq_end, scope) in top.items():
                st = stats.get(sid, {})
                counts = (
                    int(st.get("acknowledged", seq_end)),
                    int(st.get("recorded", 0)),
                    int(st.get("lost", 0)),
                )
                db.execute(_UPSERT_SHIPPED, (sid, edge, scope, seq_end, *counts, now))
        return new

    def shipped_trajectory(
        self, sandbox_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """What was shipped of a sandbox's log (entries in seq order) and how far it goes;
        None when nothing was."""
        head = self._read(
            "SELECT edge, scope, shipped_seq, acknowledged, recorded, lost, updated_at"
            " FROM trajectory_shipped WHERE sandbox_id = ?",
            (sandbox_id,),
        )
        if not head:
            return None
        h = head[0]
        sql = f"SELECT {COLUMNS} FROM trajectory_entries WHERE sandbox_id = ? AND seq > ? ORDER BY seq"
        params: list[Any] = [sandbox_id, after_seq]
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        entries = [_entry(r) for r in self._read(sql, params)]
        info = {
            "edge": h["edge"], "scope": h["scope"], "shipped_seq": h["shipped_seq"],
            "acknowledged": h["acknowledged"], "recorded": h["recorded"], "lost": h["lost"],
            "shipped_at": h["updated_at"],
        }  # fmt: skip
        return entries, info

    def forget_trajectories(self, older_than_s: float) -> None:
        """Drop shipped logs not updated for `older_than_s` (sandboxes long gone)."""
        cutoff = time.time() - older_than_s
        with self._write() as db:
            old = [r[0] for r in db.execute(
                "SELECT sandbox_id FROM trajectory_shipped WHERE updated_at < ?", (cutoff,)
            ).fetchall()]  # fmt: skip
            for sid in old:
                db.execute("DELETE FROM trajectory_entries WHERE sandbox_id = ?", (sid,))
                db.execute("DELETE FROM trajectory_shipped WHERE sandbox_id = ?", (sid,))
