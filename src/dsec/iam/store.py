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

import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsec.errors import AuthError, Conflict, Forbidden, InvalidRequest, NotFound
from dsec.iam.admission import PG_FUNCTIONS, Admission
from dsec.iam.capacity import CapacityStore
from dsec.iam.db import LEASE_S, Database, Row, Schema, open_database
from dsec.iam.registries import RegistryLogins
from dsec.iam.schema import (
    _ADDED_COLUMNS,
    _ANCESTORS_SQL,
    _DESCENDANTS_SQL,
    _DIMENSIONS,
    _PRINCIPAL_RE,
    _REVOKED,
    _SCHEMA,
    _SCHEMA_VERSION,
    ADMIN_NAME,
    DEFAULT_PROJECT,
    _check_fits,
    _check_project_name,
    _effective_backends,
    _hash_token,
    _new_token,
    _project_from_row,
    _quota_of,
    _tighten,
)
from dsec.iam.trajectories import ShippedTrajectories
from dsec.models.iam import Principal, Project, Quota, Usage

__all__ = ["IAM", "Principal", "Project", "Quota", "Usage"]


class IAM(Admission, ShippedTrajectories, CapacityStore, RegistryLogins):
    """Projects, principals, tokens and quota admission stored in one SQLite database."""

    def __init__(
        self,
        db: Path | str,
        *,
        auth_cache_ttl_s: float = 5.0,
        busy_timeout_s: float = 30.0,
        owner_lease_s: float = LEASE_S,
    ) -> None:
        """`db`: a SQLite file, or a PostgreSQL URL (postgresql://...) shared by apiservers;
        `owner_lease_s`: how long after a PostgreSQL apiserver is last heard of its pending
        creates' reservations count as orphaned."""
        self._lock = threading.Lock()
        self._auth_ttl = auth_cache_ttl_s
        # token hash -> (principal, expiry on the monotonic clock)
        self._auth_cache: dict[str, tuple[Principal, float]] = {}
        self._auth_epoch = -1
        self._owner_id: str | None = None  # set on this process's first pending reservation
        self._abandoned: set[str] = set()  # pending reservations of creates that ended (Admission.abandon)
        self._unended: dict[tuple[str, str], str | None] = {}  # idempotency keys to end (end_idempotent)
        self._making: set[tuple[str, str]] = set()  # idempotency keys this process is making
        self._db = open_database(db, busy_timeout_s=busy_timeout_s, lease_s=owner_lease_s)
        self.url = self._db.url
        self._closed = False
        try:
            self._db.migrate(Schema(_SCHEMA, _ADDED_COLUMNS, _SCHEMA_VERSION, PG_FUNCTIONS))
        except BaseException:
            self._db.close()
            raise

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _tx(self) -> Iterator[Database]:
        """One write transaction; the caller must hold ``self._lock``."""
        if self._closed:
            raise RuntimeError("IAM is closed")
        self._db.begin_write()
        try:
            yield self._db
        except BaseException:
            self._db.rollback()
            raise
        self._db.commit()

    @contextmanager
    def _write(self) -> Iterator[Database]:
        with self._lock, self._tx() as db:
            yield db

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            if self._closed:
                raise RuntimeError("IAM is closed")
            rows: list[Row] = self._db.execute(sql, params).fetchall()
            return rows

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._auth_cache.clear()
            self._db.close()

    def __enter__(self) -> IAM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ bootstrap

    def bootstrap(self) -> str | None:
        """Ensure project ``default`` and principal ``admin`` exist; return the admin token if new."""
        with self._write() as db:
            db.execute(
                "INSERT INTO projects (name, parent, created_at) VALUES (?, NULL, ?) ON CONFLICT DO NOTHING",
                (DEFAULT_PROJECT, time.time()),
            )
            if db.execute("SELECT 1 FROM principals WHERE name = ?", (ADMIN_NAME,)).fetchone():
                return None
            _, token = self._insert_principal(db, ADMIN_NAME, [DEFAULT_PROJECT], admin=True)
            return token

    # ------------------------------------------------------------------ projects

    def _project_row(self, db: Database, name: str) -> Row:
        return _one(
            db.execute("SELECT * FROM projects WHERE name = ?", (name,)),
            f"project {name!r} does not exist: check the name (`dsec project list`) or create it first",
            project=name,
        )

    def _effective(self, db: Database, name: str) -> Quota:
        """Effective bounds of ``name``: its own quota tightened by every ancestor's."""
        rows = db.execute(_ANCESTORS_SQL, (name,)).fetchall()
        if not rows:
            self._project_row(db, name)  # raises NotFound
        bound = Quota()
        for row in reversed(rows):  # root first
            bound = _tighten(bound, _quota_of(row))
        return bound

    def create_project(
        self,
        name: str,
        parent: str | None = None,
        quota: Quota | None = None,
        allowed_backends: list[str] | None = None,
    ) -> Project:
        _check_project_name(name)
        quota = quota or Quota()
        allowed = None if allowed_backends is None else sorted(set(allowed_backends))
        with self._write() as db:
            if db.execute("SELECT 1 FROM projects WHERE name = ?", (name,)).fetchone():
                raise Conflict(f"project {name!r} already exists: pick another name", project=name)
            if parent is not None:
                self._project_row(db, parent)
                _check_fits(name, quota, parent, self._effective(db, parent))
                inherited = _effective_backends(db.execute(_ANCESTORS_SQL, (parent,)).fetchall())
                if allowed is not None and inherited is not None and not set(allowed) <= set(inherited):
                    raise InvalidRequest(
                        f"project {name!r} may only narrow the backends its parent {parent!r} allows "
                        f"({', '.join(inherited)}); {', '.join(sorted(set(allowed) - set(inherited)))} "
                        "is not among them",
                        project=name,
                        allowed=inherited,
                    )
            now = time.time()
            fields = [field for field, _ in _DIMENSIONS]
            db.execute(
                f"INSERT INTO projects (name, parent, {', '.join(fields)}, allowed_backends, created_at)"
                f" VALUES (?, ?, {', '.join('?' * len(fields))}, ?, ?)",
                (name, parent, *(getattr(quota, f) for f in fields), _json_or_null(allowed), now),
            )
        return Project(name=name, parent=parent, quota=quota, created_at=now, allowed_backends=allowed)

    def allowed_backends(self, name: str) -> list[str] | None:
        """The backends sandboxes of ``name`` may use (every ancestor's list narrows it), or
        None when no project on its path limits them."""
        with self._lock:
            rows = self._db.execute(_ANCESTORS_SQL, (name,)).fetchall()
            if not rows:
                self._project_row(self._db, name)  # raises NotFound
        return _effective_backends(rows)

    def check_backend(self, project: str, backend: str) -> None:
        """Refuse a sandbox of ``project`` on a backend its tier policy does not allow."""
        _check_backend(project, backend, self.allowed_backends(project))

    def check_create(self, p: Principal, project: str, backend: str) -> None:
        """`authorize` then `check_backend` for a create, over one read of the project's
        ancestors (each read them apart)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("IAM is closed")
            rows = self._db.execute(_ANCESTORS_SQL, (project,)).fetchall()
            if not p.admin:
                _authorize(p, project, rows)
            if not rows:
                self._project_row(self._db, project)  # raises NotFound
        _check_backend(project, backend, _effective_backends(rows))

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
            children: dict[str, list[Row]] = {}
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
        self, db: Database, name: str, projects: list[str], *, admin: bool
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

    def _principal(self, db: Database, row: Row) -> Principal:
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

    def _principal_row(self, db: Database, principal_id: str) -> Row:
        return _one(
            db.execute("SELECT * FROM principals WHERE id = ?", (principal_id,)),
            f"principal {principal_id!r} does not exist: check the id (`dsec principal list`)",
            principal=principal_id,
        )

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

    def _bump_epoch(self, db: Database) -> None:
        """Tell every process sharing the database to drop its cached authentications (this
        one drops its own entries for the principal itself; its other entries stay unless
        another process had bumped the epoch unseen)."""
        row = db.execute("SELECT value FROM meta WHERE key = 'auth_epoch'").fetchone()
        before = row[0] if row is not None else 0
        db.execute(
            "INSERT INTO meta (key, value) VALUES ('auth_epoch', 1)"
            " ON CONFLICT(key) DO UPDATE SET value = meta.value + 1"
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
        lock. In SQLite the common case costs one pragma and no read (see db.py)."""
        if not self._db.others_wrote():
            return
        epoch = self._db.read_int("SELECT value FROM meta WHERE key = 'auth_epoch'") or 0
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
        rows: list[Row] = []
        if p.projects:
            with self._lock:
                if self._closed:
                    raise RuntimeError("IAM is closed")
                rows = self._db.execute(_ANCESTORS_SQL, (project,)).fetchall()
        _authorize(p, project, rows)


def _authorize(p: Principal, project: str, ancestors: Sequence[Row]) -> None:
    """Refuse `p` (not an admin) unless it is granted `project` or one of its `ancestors`."""
    granted = set(p.projects)
    if not any(r["name"] in granted for r in ancestors):
        raise Forbidden(
            f"principal {p.name!r} has no access to project {project!r}: use one of your projects "
            f"({', '.join(sorted(granted)) or 'none'}) or ask an admin to grant {project!r}",
            project=project,
            principal=p.name,
        )


def _check_backend(project: str, backend: str, allowed: list[str] | None) -> None:
    """Refuse a sandbox of `project` on a backend its tier policy (`allowed`) does not allow."""
    if allowed is not None and backend not in allowed:
        raise Forbidden(
            f"project {project!r} may run sandboxes only on the backends {', '.join(allowed)}; "
            f"{backend!r} is not one of them: create with backend={allowed[0]!r}",
            reason="backend_not_allowed",
            project=project,
            backend=backend,
            allowed=allowed,
        )


def _one(cursor: Any, missing: str, **details: str) -> Row:
    """The row a lookup found, or NotFound with `missing` as its message."""
    row = cursor.fetchone()
    if row is None:
        raise NotFound(missing, **details)
    return row  # type: ignore[no-any-return]


def _json_or_null(value: list[str] | None) -> str | None:
    return None if value is None else json.dumps(value)
