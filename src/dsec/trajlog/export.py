"""Exports of a sandbox's durable trajectory: JSON lines and Parquet.

Both see only durable entries (``await log.flush()`` first to include everything recorded), in seq order,
gap entries included. Each file is written next to its destination and renamed into place, so a reader
never sees half an export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol


class TrajectoryLog(Protocol):
    """What an export reads from the log (dsec.trajlog.log.TrajectoryLog)."""

    def iter_rows(self, sandbox_id: str) -> Iterator[list[tuple[Any, ...]]]: ...


FIELDS = (
    "sandbox_id", "seq", "kind", "action", "observation", "timings",
    "trajectory", "step", "action_hash", "recorded_at",
)  # fmt: skip


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def export_jsonl(log: TrajectoryLog, sandbox_id: str, path: Path) -> int:
    """One JSON object per entry (action/observation/timings as JSON objects); returns the rows written."""
    path = Path(path)
    tmp = _tmp(path)
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for rows in log.iter_rows(sandbox_id):
                for r in rows:
                    # The stored JSON is canonical already: splice it in instead of parsing it.
                    f.write(
                        f'{{"sandbox_id":{json.dumps(r[0])},"seq":{r[1]},"kind":{json.dumps(r[3])},'
                        f'"action":{r[4]},"observation":{"null" if r[5] is None else r[5]},"timings":{r[6]},'
                        f'"trajectory":{json.dumps(r[7])},"step":{json.dumps(r[8])},'
                        f'"action_hash":{json.dumps(r[9])},"recorded_at":{json.dumps(r[10])}}}\n'
                    )
                    n += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def export_parquet(log: TrajectoryLog, sandbox_id: str, path: Path) -> int:
    """One row per entry; action, observation (nullable) and timings as JSON strings. Returns the rows."""
    import pyarrow as pa  # type: ignore[import-untyped]  # slow to import: only when exporting
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    schema = pa.schema(
        [
            ("sandbox_id", pa.string()),
            ("seq", pa.int64()),
            ("kind", pa.string()),
            ("action", pa.string()),
            ("observation", pa.string()),
            ("timings", pa.string()),
            ("trajectory", pa.string()),
            ("step", pa.int64()),
            ("action_hash", pa.string()),
            ("recorded_at", pa.float64()),
        ]
    )
    path = Path(path)
    tmp = _tmp(path)
    n = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for rows in log.iter_rows(sandbox_id):
                cols: dict[str, list[Any]] = {
                    "sandbox_id": [r[0] for r in rows],
                    "seq": [r[1] for r in rows],
                    "kind": [r[3] for r in rows],
                    "action": [r[4] for r in rows],
                    "observation": [r[5] for r in rows],
                    "timings": [r[6] for r in rows],
                    "trajectory": [r[7] for r in rows],
                    "step": [r[8] for r in rows],
                    "action_hash": [r[9] for r in rows],
                    "recorded_at": [r[10] for r in rows],
                }
                writer.write_batch(pa.RecordBatch.from_pydict(cols, schema=schema))
                n += len(rows)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n
