"""Identity and access: projects, principals, API tokens and quota admission, in one SQLite file.

Design notes
------------
* One connection per :class:`IAM` (``check_same_thread=False``) guarded by a :class:`threading.Lock`;
  several processes may open the same file (WAL mode, ``busy_timeout``).
* Tokens are ``"dsec_" + secrets.token_urlsafe(32)``; only their SHA-256 (hex) is stored.
  :meth:`IAM.authenticate` keeps ``hash -> principal`` in memory for ``auth_cache_ttl_s``.
  :meth:`IAM.rotate_token`, :meth:`IAM.revoke_token` and :meth:`IAM.delete_principal` bump an
  *auth epoch* (table ``meta``) in the same transaction; every authentication first asks SQLite
  whether any other connection wrote the file since it last looked (``PRAGMA data_version``,
  no I/O) and, if so, re-reads the epoch: a changed epoch empties the cache, so a revoked or
  rotated token stops working at once in every process that shares the database. A revoked
  principal keeps its grants but has no token (its hash is replaced by a value no token hashes
  to) until an admin rotates it a new one.
* A create's reservation is *pending* (``owner`` = the creating process) until the create ends:
  re-keyed to the sandbox id on success, released on failure. The reconciler never releases a
  pending reservation of a live process, however long the create takes; a process holds an
  exclusive ``flock`` on ``<db>.owners/<owner>`` while it lives, so another process (or its
  successor after a crash) sees the lock gone and releases what it left pending
  (:meth:`IAM.release_orphaned`). SQLite in WAL mode is one host only, and so are these locks.
* Projects form a tree (a project's parent never changes and projects are never deleted, so
  ``(name, parent)`` is immutable once written). Each project row carries the *recursive* usage
  of its subtree (``used_*`` columns), kept in step with the ``reservations`` table inside the same
  transaction, so admission reads and writes only the O(depth) ancestor rows.
* CPU is accounted in integer millicores so that repeated reserve/release never drifts.
* Admission (:meth:`IAM.reserve`) is one ``BEGIN IMMEDIATE`` transaction: the write lock is taken
  before usage is read, so concurrent admissions (threads or processes) serialise and a quota
  can never be overshot.
* Snapshot storage is admitted the same way (:meth:`IAM.reserve_snapshot`) but kept in its own
  ``snapshot_reservations`` table and ``used_snapshot*`` columns, so sandbox and snapshot keys
  never meet: :meth:`IAM.release` only gives back sandboxes, :meth:`IAM.release_snapshot` only
  snapshots. Sizes are whole MiB, rounded up per snapshot.
* Schema changes are additive: opening an older database adds the missing columns (with their
  defaults) inside the same ``BEGIN IMMEDIATE`` transaction that creates the tables, then bumps
  ``user_version``; a database newer than this code is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsec.errors import AuthError, Conflict, Forbidden, InvalidRequest, NotFound, QuotaExceeded
from dsec.models.iam import Principal, Project, Quota, Usage
from dsec.privatefs import private_file

__all__ = ["IAM", "Principal", "Project", "Quota", "Usage"]

DEFAULT_PROJECT = "default"
ADMIN_NAME = "admin"
TOKEN_PREFIX = "dsec_"

_PROJECT_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_PRINCIPAL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_MILLI = 1000
# 2: snapshot quotas (max_snapshot*, used_snapshot*, snapshot_reservations)
# 3: reservations.owner (pending creates), meta (auth epoch)
_SCHEMA_VERSION = 3
_OWNER_RE = re.compile(r"o[0-9a-f]{16}")
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
        used_snapshot_mb INTEGER NOT NULL DEFAULT 0
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
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS snapshot_reservations_project ON snapshot_reservations(project)",
    "CREATE INDEX IF NOT EXISTS snapshot_reservations_created ON snapshot_reservations(created_at)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID",
)

# Columns added after schema version 1, by table: a database from an older dsec gains them on open
# (``CREATE TABLE IF NOT EXISTS`` leaves an existing table as it was).
_ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("projects", "max_snapshots", "INTEGER"),
    ("projects", "max_snapshot_mb", "INTEGER"),
    ("projects", "used_snapshots", "INTEGER NOT NULL DEFAULT 0"),
    ("projects", "used_snapshot_mb", "INTEGER NOT NULL DEFAULT 0"),
    ("reservations", "owner", "TEXT"),
)

# The project and its ancestors, nearest first, with their quotas and recursive usage.
_ANCESTORS_SQL = """
WITH RECURSIVE anc(name, depth) AS (
    SELECT ?, 0
    UNION ALL
    SELECT p.parent, anc.depth + 1 FROM projects p JOIN anc ON p.name = anc.name
    WHERE p.parent IS NOT NULL
)
SELECT p.name, p.max_sandboxes, p.max_cpu, p.max_memory_mb,
       p.used_sandboxes, p.used_cpu_m, p.used_memory_mb,
       p.max_snapshots, p.max_snapshot_mb, p.used_snapshots, p.used_snapshot_mb
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


def _quota_of(row: sqlite3.Row) -> Quota:
    return Quota(**{field: row[field] for field, _ in _DIMENSIONS})


def _usage_of(row: sqlite3.Row) -> Usage:
    """The recursive usage kept on a project row."""
    return Usage(
        sandboxes=row["used_sandboxes"],
        cpu=row["used_cpu_m"] / _MILLI,
        memory_mb=row["used_memory_mb"],
        snapshots=row["used_snapshots"],
        snapshot_mb=row["used_snapshot_mb"],
    )


def _project_from_row(row: sqlite3.Row) -> Project:
    return Project(
        name=row["name"],
        parent=row["parent"],
        quota=_quota_of(row),
        created_at=row["created_at"],
    )


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


class IAM:
    """Projects, principals, tokens and quota admission stored in one SQLite database."""

    def __init__(self, db_path: Path, *, auth_cache_ttl_s: float = 5.0, busy_timeout_s: float = 30.0) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._auth_ttl = auth_cache_ttl_s
        # token hash -> (principal, expiry on the monotonic clock)
        self._auth_cache: dict[str, tuple[Principal, float]] = {}
        self._data_version = -1  # PRAGMA data_version when the auth epoch was last read
        self._auth_epoch = -1
        self._owners_dir = self.db_path.with_name(self.db_path.name + ".owners")
        self._owner_id: str | None = None  # set on this process's first pending reservation
        self._owner_fd = -1
        private_file(self.db_path)  # 0600, and so its -wal and -shm files
        self._db = sqlite3.connect(
            str(self.db_path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        self._closed = False
        try:
            self._init_db(busy_timeout_s)
        except BaseException:
            self._db.close()
            raise

    # ------------------------------------------------------------------ plumbing

    def _init_db(self, busy_timeout_s: float) -> None:
        db = self._db
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        deadline = time.monotonic() + busy_timeout_s
        while True:  # switching to WAL needs a moment of exclusive access; another opener may hold it
            try:
                db.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
        with self._tx():
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version > _SCHEMA_VERSION:
                raise InvalidRequest(
                    f"IAM database {self.db_path} has schema version {version}, newer than this dsec "
                    f"understands ({_SCHEMA_VERSION}): upgrade dsec"
                )
            for stmt in _SCHEMA:
                db.execute(stmt)
            for table, column, decl in _ADDED_COLUMNS:
                have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; the caller must hold ``self._lock``."""
        if self._closed:
            raise RuntimeError("IAM is closed")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._tx() as db:
            yield db

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            if self._closed:
                raise RuntimeError("IAM is closed")
            return self._db.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._auth_cache.clear()
            self._db.close()
            if self._owner_id is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._owners_dir / self._owner_id)  # while still holding the lock
                os.close(self._owner_fd)

    def __enter__(self) -> IAM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ bootstrap

    def bootstrap(self) -> str | None:
        """Ensure project ``default`` and principal ``admin`` exist; return the admin token if new."""
        with self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO projects (name, parent, created_at) VALUES (?, NULL, ?)",
                (DEFAULT_PROJECT, time.time()),
            )
            if db.execute("SELECT 1 FROM principals WHERE name = ?", (ADMIN_NAME,)).fetchone():
                return None
            _, token = self._insert_principal(db, ADMIN_NAME, [DEFAULT_PROJECT], admin=True)
            return token

    # ------------------------------------------------------------------ projects

    def _project_row(self, db: sqlite3.Connection, name: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM projects WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFound(
                f"project {name!r} does not exist: check the name (`dsec project list`) or create it first",
                project=name,
            )
        return row  # type: ignore[no-any-return]

    def _effective(self, db: sqlite3.Connection, name: str) -> Quota:
        """Effective bounds of ``name``: its own quota tightened by every ancestor's."""
        rows = db.execute(_ANCESTORS_SQL, (name,)).fetchall()
        if not rows:
            self._project_row(db, name)  # raises NotFound
        bound = Quota()
        for row in reversed(rows):  # root first
            bound = _tighten(bound, _quota_of(row))
        return bound

    def create_project(self, name: str, parent: str | None = None, quota: Quota | None = None) -> Project:
        _check_project_name(name)
        quota = quota or Quota()
        with self._write() as db:
            if db.execute("SELECT 1 FROM projects WHERE name = ?", (name,)).fetchone():
                raise Conflict(f"project {name!r} already exists: pick another name", project=name)
            if parent is not None:
                self._project_row(db, parent)
                _check_fits(name, quota, parent, self._effective(db, parent))
            now = time.time()
            fields = [field for field, _ in _DIMENSIONS]
            db.execute(
                f"INSERT INTO projects (name, parent, {', '.join(fields)}, created_at)"
                f" VALUES (?, ?, {', '.join('?' * len(fields))}, ?)",
                (name, parent, *(getattr(quota, f) for f in fields), now),
            )
        return Project(name=name, parent=parent, quota=quota, created_at=now)

    def get_project(self, name: str) -> Project:
        with self._lock:
            return _project_from_row(self._project_row(self._db, name))

    def list_projects(self) -> list[Project]:
        return [_project_from_row(r) for r in self._read("SELECT * FROM projects ORDER BY name")]

    def effective_quota(self, name: str) -> Quota:
        """The bounds that really apply to ``name`` (its own quota tightened by every ancestor's)."""
        with self._lock:
            return self._effective(self._db, name)

    def set_quota(self, name: str, quota: Quota) -> Project:
        with self._write() as db:
            row = self._project_row(db, name)
            parent = row["parent"]
            bound = Quota() if parent is None else self._effective(db, parent)
            if parent is not None:
                _check_fits(name, quota, parent, bound)
            # Every descendant with an explicit value must still fit under its (new) effective parent bound.
            children: dict[str, list[sqlite3.Row]] = {}
            for r in db.execute("SELECT * FROM projects WHERE parent IS NOT NULL"):
                children.setdefault(r["parent"], []).append(r)
            stack = [(name, _tighten(bound, quota))]
            while stack:
                pname, pbound = stack.pop()
                for child in children.get(pname, ()):
                    cq = _project_from_row(child).quota
                    _check_fits(child["name"], cq, pname, pbound)
                    stack.append((child["name"], _tighten(pbound, cq)))
            fields = [field for field, _ in _DIMENSIONS]
            db.execute(
                f"UPDATE projects SET {', '.join(f'{f} = ?' for f in fields)} WHERE name = ?",
                (*(getattr(quota, f) for f in fields), name),
            )
        return Project(name=name, parent=parent, quota=quota, created_at=row["created_at"])

    # ------------------------------------------------------------------ principals and tokens

    def _insert_principal(
        self, db: sqlite3.Connection, name: str, projects: list[str], *, admin: bool
    ) -> tuple[Principal, str]:
        token = _new_token()
        now = time.time()
        pid = "pr_" + secrets.token_hex(8)
        db.execute(
            "INSERT INTO principals (id, name, admin, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
            (pid, name, int(admin), _hash_token(token), now),
        )
        db.executemany(
            "INSERT INTO grants (principal_id, project) VALUES (?, ?)", [(pid, p) for p in projects]
        )
        return Principal(id=pid, name=name, admin=admin, projects=projects, created_at=now), token

    def create_principal(
        self, name: str, projects: list[str], *, admin: bool = False
    ) -> tuple[Principal, str]:
        """Create a principal granted ``projects`` (and descendants); its token is returned only here."""
        if not isinstance(name, str) or not _PRINCIPAL_RE.fullmatch(name):
            raise InvalidRequest(
                f"invalid principal name {name!r}: use 1-128 letters, digits, '.', '_', '@' or '-', "
                "starting with a letter or digit",
                principal=name,
            )
        if re.fullmatch(r"pr_[0-9a-f]{16}", name):
            # principals are found by name or id: a name shaped like an id could stand for another
            raise InvalidRequest(
                f"invalid principal name {name!r}: names of the form pr_<16 hex digits> are principal ids",
                principal=name,
            )
        wanted = sorted(set(projects))
        if not wanted and not admin:
            raise InvalidRequest(
                f"principal {name!r} would see nothing: grant it at least one project", principal=name
            )
        with self._write() as db:
            for p in wanted:
                self._project_row(db, p)
            if db.execute("SELECT 1 FROM principals WHERE name = ?", (name,)).fetchone():
                raise Conflict(
                    f"principal {name!r} already exists: pick another name or rotate its token",
                    principal=name,
                )
            return self._insert_principal(db, name, wanted, admin=admin)

    def _principal(self, db: sqlite3.Connection, row: sqlite3.Row) -> Principal:
        grants = db.execute(
            "SELECT project FROM grants WHERE principal_id = ? ORDER BY project", (row["id"],)
        ).fetchall()
        return Principal(
            id=row["id"],
            name=row["name"],
            admin=bool(row["admin"]),
            projects=[g[0] for g in grants],
            created_at=row["created_at"],
        )

    def _principal_row(self, db: sqlite3.Connection, principal_id: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM principals WHERE id = ?", (principal_id,)).fetchone()
        if row is None:
            raise NotFound(
                f"principal {principal_id!r} does not exist: check the id (`dsec principal list`)",
                principal=principal_id,
            )
        return row  # type: ignore[no-any-return]

    def get_principal(self, principal_id: str) -> Principal:
        with self._lock:
            return self._principal(self._db, self._principal_row(self._db, principal_id))

    def list_principals(self) -> list[Principal]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM principals ORDER BY name").fetchall()
            return [self._principal(self._db, r) for r in rows]

    def _forget(self, principal_id: str) -> None:
        """Drop cached authentications of ``principal_id``; caller holds the lock."""
        for h in [h for h, (p, _) in self._auth_cache.items() if p.id == principal_id]:
            del self._auth_cache[h]

    def find_principal(self, name_or_id: str) -> Principal:
        """A principal by id (``pr_...``) or by name."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM principals WHERE id = ? OR name = ? ORDER BY id = ? DESC LIMIT 1",
                (name_or_id, name_or_id, name_or_id),
            ).fetchone()
            if row is None:
                raise NotFound(
                    f"there is no principal {name_or_id!r}: give a principal's name or id "
                    "(GET /v1/principals lists them)",
                    principal=name_or_id,
                )
            return self._principal(self._db, row)

    def _bump_epoch(self, db: sqlite3.Connection) -> None:
        """Tell every process sharing the database to drop its cached authentications (this
        one drops its own entries for the principal itself; its other entries stay unless
        another process had bumped the epoch unseen)."""
        row = db.execute("SELECT value FROM meta WHERE key = 'auth_epoch'").fetchone()
        before = row[0] if row is not None else 0
        db.execute(
            "INSERT INTO meta (key, value) VALUES ('auth_epoch', 1)"
            " ON CONFLICT(key) DO UPDATE SET value = value + 1"
        )
        if before != self._auth_epoch:
            self._auth_cache.clear()
        self._auth_epoch = before + 1

    def rotate_token(self, principal_id: str) -> str:
        """Replace a principal's token (a revoked one gets a token again); the old one stops
        working at once, in every process sharing the database."""
        token = _new_token()
        with self._write() as db:
            self._principal_row(db, principal_id)
            db.execute(
                "UPDATE principals SET token_hash = ? WHERE id = ?", (_hash_token(token), principal_id)
            )
            self._bump_epoch(db)
            self._forget(principal_id)
        return token

    def revoke_token(self, principal_id: str) -> None:
        """Invalidate a principal's token without issuing another (the principal and its grants
        stay; :meth:`rotate_token` gives it a new token). Effective at once, everywhere."""
        with self._write() as db:
            self._principal_row(db, principal_id)
            db.execute(
                "UPDATE principals SET token_hash = ? WHERE id = ?",
                (_REVOKED + secrets.token_hex(16), principal_id),
            )
            self._bump_epoch(db)
            self._forget(principal_id)

    def delete_principal(self, principal_id: str) -> None:
        with self._write() as db:
            self._principal_row(db, principal_id)
            db.execute("DELETE FROM grants WHERE principal_id = ?", (principal_id,))
            db.execute("DELETE FROM principals WHERE id = ?", (principal_id,))
            self._bump_epoch(db)
            self._forget(principal_id)

    def _check_epoch(self) -> None:
        """Empty the auth cache if another connection changed the auth epoch; caller holds the
        lock. ``PRAGMA data_version`` changes only when another connection committed, so the
        common case costs one pragma and no read."""
        (version,) = self._db.execute("PRAGMA data_version").fetchone()
        if version == self._data_version:
            return
        self._data_version = version
        row = self._db.execute("SELECT value FROM meta WHERE key = 'auth_epoch'").fetchone()
        epoch = row[0] if row is not None else 0
        if epoch != self._auth_epoch:
            self._auth_epoch = epoch
            self._auth_cache.clear()

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise AuthError("missing API token: send 'Authorization: Bearer <token>'")
        digest = _hash_token(token)
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("IAM is closed")
            self._check_epoch()
            hit = self._auth_cache.get(digest)
            if hit is not None and hit[1] > now:
                return hit[0]
            row = self._db.execute("SELECT * FROM principals WHERE token_hash = ?", (digest,)).fetchone()
            if row is None or not hmac.compare_digest(row["token_hash"], digest):
                self._auth_cache.pop(digest, None)
                raise AuthError(
                    "invalid API token: it is unknown, revoked or was rotated; send a current token "
                    "(an admin can issue one: `dsec token rotate <principal>`)"
                )
            principal = self._principal(self._db, row)
            if self._auth_ttl > 0:
                self._auth_cache[digest] = (principal, now + self._auth_ttl)
            return principal

    # ------------------------------------------------------------------ authorization

    def visible_projects(self, p: Principal) -> set[str] | None:
        """Projects ``p`` may use: ``None`` (everything) for admins, else its grants and their descendants."""
        if p.admin:
            return None
        if not p.projects:
            return set()
        sql = _DESCENDANTS_SQL.format(marks=",".join("?" * len(p.projects)))
        return {r[0] for r in self._read(sql, p.projects)}

    def authorize(self, p: Principal, project: str) -> None:
        if p.admin:
            return
        granted = set(p.projects)
        if granted:
            with self._lock:
                if self._closed:
                    raise RuntimeError("IAM is closed")
                rows = self._db.execute(_ANCESTORS_SQL, (project,)).fetchall()
            if any(r["name"] in granted for r in rows):
                return
        raise Forbidden(
            f"principal {p.name!r} has no access to project {project!r}: use one of your projects "
            f"({', '.join(sorted(granted)) or 'none'}) or ask an admin to grant {project!r}",
            project=project,
            principal=p.name,
        )

    # ------------------------------------------------------------------ admission

    def reserve(self, key: str, project: str, cpu: float, memory_mb: int, *, pending: bool = False) -> None:
        """Atomically admit one sandbox ``key`` into ``project``, or raise :class:`QuotaExceeded`.

        Idempotent: reserving an existing key for the same project is a no-op. ``pending``: the
        key is provisional (a create in flight in this process): :meth:`reconcile` leaves it
        alone while this process lives; :meth:`rekey` or :meth:`release` ends it.
        """
        if not key:
            raise InvalidRequest("reservation key must be a non-empty string (the sandbox id)")
        if cpu < 0 or memory_mb < 0:
            raise InvalidRequest(
                f"cpu ({_fmt(cpu)}) and memory_mb ({memory_mb}) must not be negative", key=key
            )
        cpu_m = _milli(cpu)
        owner = self._owner() if pending else None
        with self._write() as db:
            existing = db.execute("SELECT project FROM reservations WHERE key = ?", (key,)).fetchone()
            if existing is not None:
                if existing[0] == project:
                    return
                raise Conflict(
                    f"reservation {key!r} is already held in project {existing[0]!r}, not {project!r}: "
                    "release it first or use a new key",
                    key=key,
                    project=existing[0],
                )
            chain = db.execute(_ANCESTORS_SQL, (project,)).fetchall()
            if not chain:
                self._project_row(db, project)  # raises NotFound
            for row in chain:
                _admit(row, project, cpu_m, memory_mb)
            db.execute(
                "INSERT INTO reservations (key, project, cpu_m, memory_mb, created_at, owner)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (key, project, cpu_m, memory_mb, time.time(), owner),
            )
            self._add_usage(db, [r["name"] for r in chain], 1, cpu_m, memory_mb)

    @staticmethod
    def _add_usage(db: sqlite3.Connection, names: list[str], n: int, cpu_m: int, memory_mb: int) -> None:
        db.execute(
            "UPDATE projects SET used_sandboxes = used_sandboxes + ?, used_cpu_m = used_cpu_m + ?,"
            f" used_memory_mb = used_memory_mb + ? WHERE name IN ({','.join('?' * len(names))})",
            (n, cpu_m, memory_mb, *names),
        )

    def _release(self, db: sqlite3.Connection, key: str) -> str | None:
        row = db.execute(
            "SELECT project, cpu_m, memory_mb FROM reservations WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            return None
        names = [r["name"] for r in db.execute(_ANCESTORS_SQL, (row["project"],))]
        db.execute("DELETE FROM reservations WHERE key = ?", (key,))
        self._add_usage(db, names, -1, -row["cpu_m"], -row["memory_mb"])
        return str(row["project"])

    def release(self, key: str) -> str | None:
        """Give back the reservation ``key``; return its project (None: there was none)."""
        with self._write() as db:
            return self._release(db, key)

    def rekey(self, old_key: str, new_key: str) -> None:
        """Move a reservation from a provisional key to the sandbox's real id (idempotent)."""
        if not new_key:
            raise InvalidRequest("new reservation key must be a non-empty string (the sandbox id)")
        if old_key == new_key:
            return
        with self._write() as db:
            old = db.execute("SELECT project FROM reservations WHERE key = ?", (old_key,)).fetchone()
            new = db.execute("SELECT project FROM reservations WHERE key = ?", (new_key,)).fetchone()
            if old is None:
                if new is not None:
                    return  # already moved
                raise NotFound(
                    f"no reservation under key {old_key!r}: reserve quota before renaming it", key=old_key
                )
            if new is not None:
                raise Conflict(
                    f"reservation key {new_key!r} is already taken: release it or pick another key",
                    key=new_key,
                )
            # No longer pending: from now on the edges' listings vouch for it, and the grace
            # period of reconcile() starts again (the edge may not list it for a moment yet).
            db.execute(
                "UPDATE reservations SET key = ?, owner = NULL, created_at = ? WHERE key = ?",
                (new_key, time.time(), old_key),
            )

    def usage(self, project: str, *, recursive: bool = True) -> Usage:
        """What ``project`` holds; with ``recursive`` (the default) including every descendant."""
        with self._lock:
            row = self._project_row(self._db, project)
            if recursive:
                return _usage_of(row)
            n, cpu_m, mem = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(cpu_m), 0), COALESCE(SUM(memory_mb), 0)"
                " FROM reservations WHERE project = ?",
                (project,),
            ).fetchone()
            snaps, snap_mb = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size_mb), 0) FROM snapshot_reservations WHERE project = ?",
                (project,),
            ).fetchone()
            return Usage(sandboxes=n, cpu=cpu_m / _MILLI, memory_mb=mem, snapshots=snaps, snapshot_mb=snap_mb)

    def usages(self) -> dict[str, Usage]:
        """Recursive usage of every project (as :meth:`usage` reports it), read in one query."""
        return {r["name"]: _usage_of(r) for r in self._read("SELECT * FROM projects ORDER BY name")}

    def reservations(self) -> dict[str, str]:
        return {r[0]: r[1] for r in self._read("SELECT key, project FROM reservations")}

    def reconcile(self, live_keys: set[str], older_than_s: float = 30.0) -> list[str]:
        """Release reservations not in ``live_keys`` older than ``older_than_s``; return their keys.

        Pending reservations (creates in flight) are not the edges' to vouch for: they stay
        while their process lives, whatever their age, and go when it is gone."""
        cutoff = time.time() - older_than_s
        released = self.release_orphaned()
        with self._write() as db:
            rows = db.execute(
                "SELECT key FROM reservations WHERE created_at < ? AND owner IS NULL", (cutoff,)
            ).fetchall()
            for (key,) in rows:
                if key not in live_keys and self._release(db, key):
                    released.append(key)
        return sorted(released)

    # ------------------------------------------------------------------ pending creates' owners

    def _owner(self) -> str:
        """This instance's owner id, locked for as long as it lives (created on first use)."""
        with self._lock:
            if self._owner_id is None:
                self._owners_dir.mkdir(mode=0o700, exist_ok=True)
                oid = "o" + secrets.token_hex(8)
                fd = os.open(self._owners_dir / oid, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._owner_id, self._owner_fd = oid, fd
            return self._owner_id

    def _owner_alive(self, owner: str) -> bool:
        if owner == self._owner_id:
            return True
        if not _OWNER_RE.fullmatch(owner):
            return False
        try:
            fd = os.open(self._owners_dir / owner, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # drops the lock we may have taken
        return False

    def release_orphaned(self) -> list[str]:
        """Release the pending reservations of processes that are gone (a crash mid-create);
        return their keys. Those of live processes stay, however old."""
        owners = [r[0] for r in self._read("SELECT DISTINCT owner FROM reservations WHERE owner IS NOT NULL")]
        dead = [o for o in owners if not self._owner_alive(o)]
        released: list[str] = []
        if not dead:
            return released
        with self._write() as db:
            for owner in dead:
                for (key,) in db.execute("SELECT key FROM reservations WHERE owner = ?", (owner,)).fetchall():
                    if self._release(db, key):
                        released.append(key)
        for owner in dead:
            with contextlib.suppress(OSError):
                os.unlink(self._owners_dir / owner)
        return released

    # ------------------------------------------------------------------ snapshot storage

    def reserve_snapshot(self, key: str, project: str, size_mb: int) -> None:
        """Atomically admit snapshot ``key`` of ``size_mb`` MiB into ``project``, or raise QuotaExceeded.

        Checks ``max_snapshots`` and ``max_snapshot_mb`` of the project and every ancestor. A
        fractional size is rounded up to a whole MiB. Idempotent: reserving an existing key again
        for the same project and size is a no-op; another project or size is a :class:`Conflict`
        (use :meth:`resize_snapshot` to change a size).
        """
        if not key:
            raise InvalidRequest("snapshot reservation key must be a non-empty string (the snapshot name)")
        mb = _snapshot_mb(key, size_mb)
        with self._write() as db:
            existing = db.execute(
                "SELECT project, size_mb FROM snapshot_reservations WHERE key = ?", (key,)
            ).fetchone()
            if existing is not None:
                if existing["project"] == project and existing["size_mb"] == mb:
                    return
                raise Conflict(
                    f"snapshot reservation {key!r} is already held in project {existing['project']!r} "
                    f"with {existing['size_mb']} MiB, not {project!r} with {mb} MiB: release it first, "
                    "resize it, or use a new key",
                    key=key,
                    project=existing["project"],
                    size_mb=existing["size_mb"],
                )
            chain = db.execute(_ANCESTORS_SQL, (project,)).fetchall()
            if not chain:
                self._project_row(db, project)  # raises NotFound
            for row in chain:
                _admit_snapshot(row, project, 1, mb)
            db.execute(
                "INSERT INTO snapshot_reservations (key, project, size_mb, created_at) VALUES (?, ?, ?, ?)",
                (key, project, mb, time.time()),
            )
            self._add_snapshot_usage(db, [r["name"] for r in chain], 1, mb)

    def resize_snapshot(self, key: str, size_mb: int) -> None:
        """Change the size held by snapshot reservation ``key``; growth is admitted like a new reservation.

        Shrinking always succeeds. On :class:`QuotaExceeded` the reservation keeps its old size.
        """
        mb = _snapshot_mb(key, size_mb)
        with self._write() as db:
            row = db.execute(
                "SELECT project, size_mb FROM snapshot_reservations WHERE key = ?", (key,)
            ).fetchone()
            if row is None:
                raise NotFound(
                    f"no snapshot reservation under key {key!r}: reserve it with reserve_snapshot first",
                    key=key,
                )
            delta = mb - row["size_mb"]
            if delta == 0:
                return
            chain = db.execute(_ANCESTORS_SQL, (row["project"],)).fetchall()
            if delta > 0:
                for r in chain:
                    _admit_snapshot(r, row["project"], 0, delta)
            db.execute("UPDATE snapshot_reservations SET size_mb = ? WHERE key = ?", (mb, key))
            self._add_snapshot_usage(db, [r["name"] for r in chain], 0, delta)

    @staticmethod
    def _add_snapshot_usage(db: sqlite3.Connection, names: list[str], n: int, size_mb: int) -> None:
        db.execute(
            "UPDATE projects SET used_snapshots = used_snapshots + ?, used_snapshot_mb = used_snapshot_mb + ?"
            f" WHERE name IN ({','.join('?' * len(names))})",
            (n, size_mb, *names),
        )

    def _release_snapshot(self, db: sqlite3.Connection, key: str) -> bool:
        row = db.execute(
            "SELECT project, size_mb FROM snapshot_reservations WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            return False
        names = [r["name"] for r in db.execute(_ANCESTORS_SQL, (row["project"],))]
        db.execute("DELETE FROM snapshot_reservations WHERE key = ?", (key,))
        self._add_snapshot_usage(db, names, -1, -row["size_mb"])
        return True

    def release_snapshot(self, key: str) -> None:
        """Give back the snapshot reservation ``key``; unknown keys are ignored."""
        with self._write() as db:
            self._release_snapshot(db, key)

    def snapshot_reservations(self) -> dict[str, tuple[str, int]]:
        """``key -> (project, size_mb)`` of every snapshot reservation."""
        rows = self._read("SELECT key, project, size_mb FROM snapshot_reservations")
        return {r[0]: (r[1], r[2]) for r in rows}

    def rekey_snapshot(self, old_key: str, new_key: str) -> None:
        """Move snapshot reservation ``old_key`` to ``new_key`` (same project and size, nothing
        re-admitted); its age for :meth:`reconcile_snapshots` starts again."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE snapshot_reservations SET key = ?, created_at = ? WHERE key = ?",
                (new_key, time.time(), old_key),
            )
            if cur.rowcount == 0:
                raise NotFound(f"no snapshot reservation under key {old_key!r} to rename", key=old_key)

    def reconcile_snapshots(
        self, live_keys: set[str], older_than_s: float = 30.0, *, prefix: str = ""
    ) -> list[str]:
        """Release snapshot reservations whose key starts with ``prefix``, not in ``live_keys``
        and older than ``older_than_s``; return the keys."""
        cutoff = time.time() - older_than_s
        released: list[str] = []
        with self._write() as db:
            rows = db.execute(
                "SELECT key FROM snapshot_reservations WHERE created_at < ?", (cutoff,)
            ).fetchall()
            for (key,) in rows:
                if key.startswith(prefix) and key not in live_keys and self._release_snapshot(db, key):
                    released.append(key)
        return sorted(released)


def _snapshot_mb(key: str, size_mb: float) -> int:
    """``size_mb`` as whole MiB (rounded up), or InvalidRequest if negative or not a finite number."""
    if isinstance(size_mb, bool) or not isinstance(size_mb, int | float) or not math.isfinite(size_mb):
        raise InvalidRequest(f"snapshot size_mb ({size_mb!r}) must be a number of MiB", key=key)
    if size_mb < 0:
        raise InvalidRequest(f"snapshot size_mb ({_fmt(size_mb)}) must not be negative", key=key)
    return math.ceil(size_mb)


_Check = tuple[str, str, float | None, float, float, float]  # field, unit, limit, used, wanted, scale


def _admit(row: sqlite3.Row, project: str, cpu_m: int, memory_mb: int) -> None:
    """Raise QuotaExceeded if adding one sandbox of (cpu_m, memory_mb) would overflow ``row``'s quota."""
    checks: tuple[_Check, ...] = (
        ("max_sandboxes", "sandboxes", row["max_sandboxes"], row["used_sandboxes"], 1, 1),
        ("max_cpu", "CPUs", row["max_cpu"], row["used_cpu_m"] / _MILLI, cpu_m / _MILLI, _MILLI),
        ("max_memory_mb", "MiB of memory", row["max_memory_mb"], row["used_memory_mb"], memory_mb, 1),
    )
    _check_limits(row["name"], project, checks, "sandbox", "delete sandboxes, ask for fewer resources")


def _admit_snapshot(row: sqlite3.Row, project: str, n: int, size_mb: int) -> None:
    """Raise QuotaExceeded if ``n`` more snapshots of ``size_mb`` MiB in all overflow ``row``'s quota."""
    checks: list[_Check] = []
    if n:
        checks.append(("max_snapshots", "snapshots", row["max_snapshots"], row["used_snapshots"], n, 1))
    checks.append(
        ("max_snapshot_mb", "MiB of snapshots", row["max_snapshot_mb"], row["used_snapshot_mb"], size_mb, 1)
    )
    _check_limits(row["name"], project, checks, "snapshot", "delete snapshots you no longer need")


def _check_limits(name: str, project: str, checks: Sequence[_Check], what: str, remedy: str) -> None:
    for field, unit, limit, used, want, scale in checks:
        if limit is None:
            continue
        # Compare in integer units (millicores for CPU) so float error cannot admit or refuse wrongly.
        if round((used + want) * scale) <= round(limit * scale):
            continue
        where = f"project {name!r}" if name == project else f"project {name!r} (an ancestor of {project!r})"
        raise QuotaExceeded(
            f"{where} is out of {unit}: {_fmt(used)} of {_fmt(limit)} in use and this {what} needs "
            f"{_fmt(want)} more; {remedy}, or ask an admin to raise {field} of project {name!r}",
            project=name,
            dimension=field,
            usage=used,
            limit=limit,
            requested=want,
        )
