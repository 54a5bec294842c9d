"""The IAM database: its schema and queries, names and the small conversions every part of
IAM shares."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from dsec.errors import InvalidRequest
from dsec.models.iam import Project, Quota, Usage

DEFAULT_PROJECT = "default"
ADMIN_NAME = "admin"
TOKEN_PREFIX = "dsec_"

_PROJECT_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_PRINCIPAL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_MILLI = 1000
# 2: snapshot quotas (max_snapshot*, used_snapshot*, snapshot_reservations)
# 3: reservations.owner (pending creates), meta (auth epoch)
# 4: projects.allowed_backends (a JSON list; NULL: whatever the parent allows)
# 5: lost_sandboxes (sandboxes of an edge that stopped answering, given up)
# 6: idempotency (creates by idempotency key)
# 7: trajectory_entries, trajectory_shipped (trajectory logs shipped by edges)
# 8: edge_drains (an admin's drains, seen by every apiserver)
# 9: bursts, burst_prewarms, capacity_edges, capacity_leader (elastic capacity shared by
#    apiservers: dsec.iam.capacity)
# 10: PostgreSQL's functions dsec_begin_create, dsec_settle_create (dsec.iam.admission: a
#     create's admission and settling in one round trip each); nothing new in SQLite
# 11: snapshot_reservations.owner (copies in flight: reserved before they are made, owned by
#     a live process) and .in_ram (fork layers: host memory, counted in max_memory_mb too)
_SCHEMA_VERSION = 12
_REVOKED = "revoked:"  # prefix of a revoked principal's token_hash: no SHA-256 hex matches it

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS projects (
        name TEXT PRIMARY KEY,
        parent TEXT REFERENCES projects(name),
        max_sandboxes INTEGER,
        max_cpu REAL,
        max_memory_mb INTEGER,
        created_at REAL NOT NULL,
        used_sandboxes INTEGER NOT NULL DEFAULT 0,
        used_cpu_m INTEGER NOT NULL DEFAULT 0,
        used_memory_mb INTEGER NOT NULL DEFAULT 0,
        max_snapshots INTEGER,
        max_snapshot_mb INTEGER,
        used_snapshots INTEGER NOT NULL DEFAULT 0,
        used_snapshot_mb INTEGER NOT NULL DEFAULT 0,
        allowed_backends TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS projects_parent ON projects(parent)",
    """CREATE TABLE IF NOT EXISTS principals (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        admin INTEGER NOT NULL,
        token_hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS grants (
        principal_id TEXT NOT NULL REFERENCES principals(id) ON DELETE CASCADE,
        project TEXT NOT NULL REFERENCES projects(name),
        PRIMARY KEY (principal_id, project)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS reservations (
        key TEXT PRIMARY KEY,
        project TEXT NOT NULL REFERENCES projects(name),
        cpu_m INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        created_at REAL NOT NULL,
        owner TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS reservations_project ON reservations(project)",
    "CREATE INDEX IF NOT EXISTS reservations_created ON reservations(created_at)",
    """CREATE TABLE IF NOT EXISTS snapshot_reservations (
        key TEXT PRIMARY KEY,
        project TEXT NOT NULL REFERENCES projects(name),
        size_mb INTEGER NOT NULL,
        created_at REAL NOT NULL,
        owner TEXT,
        in_ram INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS snapshot_reservations_project ON snapshot_reservations(project)",
    "CREATE INDEX IF NOT EXISTS snapshot_reservations_created ON snapshot_reservations(created_at)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID",
    """CREATE TABLE IF NOT EXISTS lost_sandboxes (
        id TEXT PRIMARY KEY,
        edge TEXT NOT NULL,
        project TEXT NOT NULL,
        lost_at REAL NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS lost_sandboxes_edge ON lost_sandboxes(edge)",
    """CREATE TABLE IF NOT EXISTS idempotency (
        principal TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL,
        owner TEXT,
        result TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (principal, key)
    )""",
    """CREATE TABLE IF NOT EXISTS trajectory_entries (
        sandbox_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        seq_end INTEGER NOT NULL,
        kind TEXT NOT NULL,
        action TEXT NOT NULL,
        observation TEXT,
        timings TEXT NOT NULL,
        trajectory TEXT,
        step INTEGER,
        action_hash TEXT,
        recorded_at REAL NOT NULL,
        scope TEXT,
        PRIMARY KEY (sandbox_id, seq)
    )""",
    "CREATE TABLE IF NOT EXISTS edge_drains (edge TEXT PRIMARY KEY, drained_at REAL NOT NULL)",
    """CREATE TABLE IF NOT EXISTS trajectory_shipped (
        sandbox_id TEXT PRIMARY KEY,
        edge TEXT NOT NULL,
        scope TEXT,
        shipped_seq INTEGER NOT NULL,
        acknowledged INTEGER NOT NULL,
        recorded INTEGER NOT NULL,
        lost INTEGER NOT NULL,
        updated_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS bursts (
        id TEXT PRIMARY KEY,
        project TEXT NOT NULL,
        state TEXT NOT NULL,
        announced_at REAL NOT NULL,
        body TEXT NOT NULL,
        progress TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS bursts_state ON bursts(state)",
    "CREATE INDEX IF NOT EXISTS bursts_announced ON bursts(announced_at)",
    """CREATE TABLE IF NOT EXISTS burst_prewarms (
        burst TEXT NOT NULL,
        edge TEXT NOT NULL,
        shape TEXT NOT NULL,
        count INTEGER NOT NULL,
        at REAL NOT NULL,
        hold_until REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (burst, edge)
    )""",
    "CREATE INDEX IF NOT EXISTS burst_prewarms_edge ON burst_prewarms(edge)",
    """CREATE TABLE IF NOT EXISTS capacity_edges (
        edge TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        since REAL NOT NULL,
        owner TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS capacity_leader (
        name TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        since REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS registry_logins (
        project TEXT NOT NULL,
        registry TEXT NOT NULL,
        username TEXT NOT NULL,
        secret TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (project, registry)
    )""",
)

# Columns added after schema version 1, by table: a database from an older dsec gains them on open
# (``CREATE TABLE IF NOT EXISTS`` leaves an existing table as it was).
_ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("projects", "max_snapshots", "INTEGER"),
    ("projects", "max_snapshot_mb", "INTEGER"),
    ("projects", "used_snapshots", "INTEGER NOT NULL DEFAULT 0"),
    ("projects", "used_snapshot_mb", "INTEGER NOT NULL DEFAULT 0"),
    ("reservations", "owner", "TEXT"),
    ("projects", "allowed_backends", "TEXT"),
    ("snapshot_reservations", "owner", "TEXT"),
    ("snapshot_reservations", "in_ram", "INTEGER NOT NULL DEFAULT 0"),
)

# The project and its ancestors, nearest first, with their quotas and recursive usage.
_ANCESTORS_SQL = """
WITH RECURSIVE anc(name, depth) AS (
    SELECT CAST(? AS TEXT), 0
    UNION ALL
    SELECT p.parent, anc.depth + 1 FROM projects p JOIN anc ON p.name = anc.name
    WHERE p.parent IS NOT NULL
)
SELECT p.name, p.max_sandboxes, p.max_cpu, p.max_memory_mb,
       p.used_sandboxes, p.used_cpu_m, p.used_memory_mb,
       p.max_snapshots, p.max_snapshot_mb, p.used_snapshots, p.used_snapshot_mb, p.allowed_backends
FROM anc JOIN projects p ON p.name = anc.name ORDER BY anc.depth
"""

_DESCENDANTS_SQL = """
WITH RECURSIVE sub(name) AS (
    SELECT name FROM projects WHERE name IN ({marks})
    UNION
    SELECT p.name FROM projects p JOIN sub ON p.parent = sub.name
)
SELECT name FROM sub
"""


_DIMENSIONS: tuple[tuple[str, str], ...] = (
    ("max_sandboxes", "sandboxes"),
    ("max_cpu", "CPUs"),
    ("max_memory_mb", "MiB of memory"),
    ("max_snapshots", "snapshots"),
    ("max_snapshot_mb", "MiB of snapshots"),
)


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def _milli(cpu: float) -> int:
    return round(cpu * _MILLI)


def _fmt(value: float) -> str:
    return f"{value:g}"


def _quota_of(row: Any) -> Quota:
    return Quota(**{field: row[field] for field, _ in _DIMENSIONS})


def _usage_of(row: Any) -> Usage:
    """The recursive usage kept on a project row."""
    return Usage(
        sandboxes=row["used_sandboxes"],
        cpu=row["used_cpu_m"] / _MILLI,
        memory_mb=row["used_memory_mb"],
        snapshots=row["used_snapshots"],
        snapshot_mb=row["used_snapshot_mb"],
    )


def _project_from_row(row: Any) -> Project:
    return Project(
        name=row["name"],
        parent=row["parent"],
        quota=_quota_of(row),
        created_at=row["created_at"],
        allowed_backends=_backends_of(row),
    )


def _backends_of(row: Any) -> list[str] | None:
    raw = row["allowed_backends"]
    return None if raw is None else list(json.loads(raw))


def _effective_backends(rows: Sequence[Any]) -> list[str] | None:
    """What a project's ancestors (and itself) allow together: None when none limits them."""
    allowed: set[str] | None = None
    for row in rows:
        own = _backends_of(row)
        if own is not None:
            allowed = set(own) if allowed is None else allowed & set(own)
    return None if allowed is None else sorted(allowed)


def _check_project_name(name: str) -> None:
    if not isinstance(name, str) or not _PROJECT_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid project name {name!r}: use 1-63 lowercase letters, digits or '-', "
            "starting with a letter or digit",
            project=name,
        )


def _check_fits(child: str, quota: Quota, parent: str, bound: Quota) -> None:
    """``quota`` (explicit values of ``child``) must not exceed ``bound`` (effective bounds of ``parent``)."""
    for field, unit in _DIMENSIONS:
        mine, limit = getattr(quota, field), getattr(bound, field)
        if mine is not None and limit is not None and mine > limit:
            raise InvalidRequest(
                f"quota {field}={_fmt(mine)} of project {child!r} exceeds the {_fmt(limit)} {unit} "
                f"allowed by its parent {parent!r}: lower it to at most {_fmt(limit)} or leave it unset "
                "to inherit the parent's bound",
                project=child,
                parent=parent,
                dimension=field,
                requested=mine,
                limit=limit,
            )


def _tighten(bound: Quota, quota: Quota) -> Quota:
    """Effective bounds of a child with explicit ``quota`` under a parent with effective ``bound``."""
    values: dict[str, Any] = {}
    for field, _ in _DIMENSIONS:
        mine, limit = getattr(quota, field), getattr(bound, field)
        values[field] = limit if mine is None else (mine if limit is None else min(mine, limit))
    return Quota(**values)
