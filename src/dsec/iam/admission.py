"""Quota admission: reservations of sandboxes and snapshot storage against a project's whole
subtree, atomic in one transaction, and their reconciliation with what edges report.

A part of `IAM` (store.py): what it uses of the rest of IAM is declared at the top of
`Admission`."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dsec.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded, Unavailable
from dsec.iam.db import Database, Row
from dsec.iam.schema import _ANCESTORS_SQL, _MILLI, _fmt, _milli, _usage_of
from dsec.models.iam import Usage


class Admission:
    """reserve, release, rekey, usage, reconcile; the same for snapshot storage (see the module)."""

    # What this part uses of the rest of IAM.
    _owner_id: str | None
    _abandoned: set[str]
    _unended: dict[tuple[str, str], str | None]
    _making: set[tuple[str, str]]
    _lock: threading.Lock
    _db: Database
    _closed: bool

    if TYPE_CHECKING:

        def _project_row(self, db: Database, name: str) -> Row: ...

        def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

        @contextmanager
        def _write(self) -> Iterator[Database]: ...

    # ------------------------------------------------------------------ admission

    def reserve(self, key: str, project: str, cpu: float, memory_mb: int, *, pending: bool = False) -> None:
        """Atomically admit one sandbox ``key`` into ``project``, or raise :class:`QuotaExceeded`.

        Idempotent: reserving an existing key for the same project is a no-op. ``pending``: the
        key is provisional (a create in flight in this process): :meth:`reconcile` leaves it
        alone while this process lives; :meth:`rekey` or :meth:`release` ends it.
        """
        _check_reservation(key, cpu, memory_mb)
        owner = self._owner() if pending else None
        if self._fast_begin(None, None, owner, (key, project, cpu, memory_mb)):
            return
        with self._write() as db:
            self._reserve(db, key, project, _milli(cpu), memory_mb, owner)

    def _fast_begin(
        self, principal: str | None, key: str | None, owner: str | None, reserve: Pending
    ) -> bool:
        """The common case of `begin_idempotent` (a new key, or none) and `reserve` (a new
        reservation key, within quota) as one server-side function call (`dsec_begin_create`,
        PostgreSQL): one round trip instead of six. False: nothing was written and the
        statement-by-statement path decides (and words any refusal)."""
        if not self._db.has_functions:
            return False
        rkey, project, cpu, memory_mb = reserve
        with self._lock:
            if self._closed:
                raise RuntimeError("IAM is closed")
            return not self._db.call_int(
                _BEGIN_CREATE, (principal, key, owner, time.time(), rkey, project, _milli(cpu), memory_mb)
            )

    def _reserve(
        self, db: Database, key: str, project: str, cpu_m: int, memory_mb: int, owner: str | None
    ) -> None:
        chain = db.execute(_ANCESTORS_SQL, (project,)).fetchall()
        if not chain:
            self._project_row(db, project)  # raises NotFound
        # The row first (a key already held is then read, not admitted again); a refusal
        # below rolls it back with the transaction. One statement fewer than looking first.
        cur = db.execute(
            "INSERT INTO reservations (key, project, cpu_m, memory_mb, created_at, owner)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (key, project, cpu_m, memory_mb, time.time(), owner),
        )
        if not cur.rowcount:
            (held,) = db.execute("SELECT project FROM reservations WHERE key = ?", (key,)).fetchone()
            if held == project:
                return
            raise Conflict(
                f"reservation {key!r} is already held in project {held!r}, not {project!r}: "
                "release it first or use a new key",
                key=key,
                project=held,
            )
        for row in chain:
            _admit(row, project, cpu_m, memory_mb)
        _add_usage(db, chain, used_sandboxes=1, used_cpu_m=cpu_m, used_memory_mb=memory_mb)

    def _release(self, db: Database, key: str) -> str | None:
        row = _take(db, "reservations", key)
        if row is None:
            return None
        chain = db.execute(_ANCESTORS_SQL, (row["project"],)).fetchall()
        _add_usage(db, chain, used_sandboxes=-1, used_cpu_m=-row["cpu_m"], used_memory_mb=-row["memory_mb"])
        return str(row["project"])

    def release(self, key: str) -> str | None:
        """Give back the reservation ``key``; return its project (None: there was none)."""
        with self._write() as db:
            return self._release(db, key)

    def rekey(self, old_key: str, new_key: str, *, ends: Ends | None = None) -> None:
        """Move a reservation from a provisional key to the sandbox's real id (idempotent).
        `ends`: (principal, idempotency key, result): end that key's create with `result`
        in the same transaction (as `end_idempotent`; one commit for both)."""
        if not new_key:
            raise InvalidRequest("new reservation key must be a non-empty string (the sandbox id)")
        if self._db.has_functions and old_key != new_key:
            # One round trip (`dsec_settle_create`) when the reservation moves as asked.
            principal, ikey, result = ends if ends is not None else (None, None, None)
            with self._lock:
                if self._closed:
                    raise RuntimeError("IAM is closed")
                settled = not self._db.call_int(
                    _SETTLE_CREATE, (old_key, new_key, time.time(), principal, ikey, result)
                )
            if settled:
                if ends is not None:
                    self._making.discard(ends[:2])
                return
        with self._write() as db:
            if old_key != new_key:
                self._rekey(db, old_key, new_key)
            if ends is not None:
                _end_idempotent(db, *ends)
        if ends is not None:
            self._making.discard(ends[:2])

    @staticmethod
    def _rekey(db: Database, old_key: str, new_key: str) -> None:
        # No longer pending: from now on the edges' listings vouch for it, and the grace
        # period of reconcile() starts again (the edge may not list it for a moment yet).
        # (Only when the new key is free; the cases below are read only when it did nothing.)
        moved = db.execute(
            "UPDATE reservations SET key = ?, owner = NULL, created_at = ? WHERE key = ?"
            " AND NOT EXISTS (SELECT 1 FROM reservations WHERE key = ?)",
            (new_key, time.time(), old_key, new_key),
        ).rowcount
        if moved:
            return
        rows = db.execute("SELECT key FROM reservations WHERE key IN (?, ?)", (old_key, new_key)).fetchall()
        found = {r[0] for r in rows}
        if old_key not in found:
            if new_key in found:
                return  # already moved
            raise NotFound(
                f"no reservation under key {old_key!r}: reserve quota before renaming it", key=old_key
            )
        raise Conflict(
            f"reservation key {new_key!r} is already taken: release it or pick another key",
            key=new_key,
        )

    def usage(self, project: str, *, recursive: bool = True) -> Usage:
        """What ``project`` holds; with ``recursive`` (the default) including every descendant."""
        with self._lock:
            row = self._project_row(self._db, project)
            if recursive:
                return _usage_of(row)
            n, cpu_m, mem = self._db.execute(
                "SELECT COUNT(*), CAST(COALESCE(SUM(cpu_m), 0) AS BIGINT),"
                " CAST(COALESCE(SUM(memory_mb), 0) AS BIGINT)"
                " FROM reservations WHERE project = ?",
                (project,),
            ).fetchone()
            snaps, snap_mb, ram_mb = self._db.execute(
                "SELECT COUNT(*), CAST(COALESCE(SUM(size_mb), 0) AS BIGINT),"
                " CAST(COALESCE(SUM(size_mb * in_ram), 0) AS BIGINT) FROM snapshot_reservations"
                " WHERE project = ?",
                (project,),
            ).fetchone()
            return Usage(
                sandboxes=n, cpu=cpu_m / _MILLI, memory_mb=mem + ram_mb, snapshots=snaps, snapshot_mb=snap_mb
            )

    def usages(self) -> dict[str, Usage]:
        """Recursive usage of every project (as :meth:`usage` reports it), read in one query."""
        return {r["name"]: _usage_of(r) for r in self._read("SELECT * FROM projects ORDER BY name")}

    def reservations(self) -> dict[str, str]:
        return {r[0]: r[1] for r in self._read("SELECT key, project FROM reservations")}

    def reconcile(
        self, live_keys: set[str], older_than_s: float = 30.0, *, as_of: float | None = None
    ) -> list[str]:
        """Release reservations not in ``live_keys`` older than ``older_than_s``; return their keys.

        ``as_of``: when ``live_keys`` was taken (default: now). Only a reservation made (or
        re-keyed) ``older_than_s`` before that can be missing from it for a reason: one made
        while the edges were being asked may just not be in their answers yet.

        Pending reservations (creates in flight) are not the edges' to vouch for: they stay
        while their process lives, whatever their age, and go when it is gone."""
        cutoff = (time.time() if as_of is None else as_of) - older_than_s
        released = self.release_orphaned()
        with self._write() as db:
            rows = db.execute(
                "SELECT key FROM reservations WHERE created_at < ? AND owner IS NULL", (cutoff,)
            ).fetchall()
            for (key,) in rows:
                if key not in live_keys and self._release(db, key):
                    released.append(key)
        return sorted(released)

    def unaccounted(self, sandbox_ids: set[str]) -> set[str]:
        """Those of `sandbox_ids` that no reservation accounts for (none keyed by the id)."""
        if not sandbox_ids:
            return set()
        rows = self._read("SELECT key FROM reservations WHERE owner IS NULL")
        return sandbox_ids - {r[0] for r in rows}

    # ------------------------------------------------------------------ idempotency keys

    def begin_idempotent(
        self, principal: str, key: str, *, reserve: Pending | None = None
    ) -> tuple[str, str | None]:
        """Claim `key` of `principal` for a create: ("new", None) when this call makes it,
        ("done", result) when an earlier call made it, ("busy", None) while another call makes
        it (in this process, or another live apiserver process), ("taken_over", None) when
        the one that began it died or ended without ending the key (what it made, if
        anything, carries the key's label: look for it first).

        `reserve`: (reservation key, project, cpu, memory_mb): when the state is "new", also
        reserve that create's quota, pending (as `reserve(..., pending=True)`), in the same
        transaction: one commit for both, and when the quota refuses (QuotaExceeded) the key
        is not claimed either."""
        state, result = self._begin_idempotent(principal, key, reserve)
        if state in ("new", "taken_over"):
            self._making.add((principal, key))  # (until its end: see below)
            # This call ends the key now: an end deferred by an earlier call (the database was
            # away) must not end it under this one (nor clear it from _making)
            self._unended.pop((principal, key), None)
        return state, result

    def _begin_idempotent(self, principal: str, key: str, reserve: Pending | None) -> tuple[str, str | None]:
        owner = self._owner()
        if reserve is not None:
            _check_reservation(reserve[0], reserve[2], reserve[3])
            if self._fast_begin(principal, key, owner, reserve):
                return "new", None
        with self._write() as db:
            claimed = db.execute(  # (a key seen before is read only when this finds it)
                "INSERT INTO idempotency (principal, key, state, owner, created_at)"
                " VALUES (?, ?, 'pending', ?, ?) ON CONFLICT DO NOTHING",
                (principal, key, owner, time.time()),
            ).rowcount
            if claimed:
                if reserve is not None:
                    rkey, project, cpu, memory_mb = reserve
                    self._reserve(db, rkey, project, _milli(cpu), memory_mb, owner)
                return "new", None
            row = db.execute(
                "SELECT state, owner, result FROM idempotency WHERE principal = ? AND key = ?",
                (principal, key),
            ).fetchone()
            if row["state"] == "done":
                return "done", row["result"]
            if row["owner"] == owner:
                # This process's own: still being made here (a retry that came back to the
                # same apiserver: wait for it), or its create ended without ending the key.
                if (principal, key) in self._making:
                    return "busy", None
            elif self._db.owner_alive(row["owner"] or ""):
                return "busy", None
            db.execute(
                "UPDATE idempotency SET owner = ? WHERE principal = ? AND key = ?", (owner, principal, key)
            )
            return "taken_over", None

    def end_idempotent(self, principal: str, key: str, result: str | None, *, defer: bool = False) -> None:
        """The create of `key` made `result` (its answer, kept for retries), or failed (None:
        the key is free again). `defer`: if the database is away, do it once it is back
        (`release_orphaned`), so a retry never waits on a key nobody is making any more."""
        try:
            self._end_idempotent(principal, key, result)
        except Unavailable:
            if not defer:
                raise
            self._unended[(principal, key)] = result

    def _end_idempotent(self, principal: str, key: str, result: str | None) -> None:
        with self._write() as db:
            _end_idempotent(db, principal, key, result)
        self._making.discard((principal, key))

    def forget_idempotency(self, older_than_s: float) -> None:
        with self._write() as db:
            cutoff = time.time() - older_than_s
            db.execute("DELETE FROM idempotency WHERE state = 'done' AND created_at < ?", (cutoff,))

    # ------------------------------------------------------------------ drained edges

    def set_drained(self, edge: str, drained: bool) -> None:
        """An admin's drain of `edge` (or its end), for every apiserver to see."""
        with self._write() as db:
            if drained:
                db.execute(
                    "INSERT INTO edge_drains (edge, drained_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                    (edge, time.time()),
                )
            else:
                db.execute("DELETE FROM edge_drains WHERE edge = ?", (edge,))

    def drained_edges(self) -> set[str]:
        return {r[0] for r in self._read("SELECT edge FROM edge_drains")}

    # ------------------------------------------------------------------ lost edges

    def mark_edge_lost(self, edge: str) -> list[tuple[str, str]]:
        """Give up the sandboxes of `edge` (it stopped answering): release their reservations
        and remember them as lost, in one transaction (idempotent: every apiserver that sees
        the edge go does this). Their (sandbox, project) pairs, newly given up."""
        prefix = f"{edge}-"
        lost: list[tuple[str, str]] = []
        with self._write() as db:
            rows = db.execute("SELECT key, project FROM reservations WHERE owner IS NULL").fetchall()
            now = time.time()
            for key, project in ((r[0], r[1]) for r in rows):
                if not key.startswith(prefix):
                    continue
                self._release(db, key)
                db.execute(
                    "INSERT INTO lost_sandboxes (id, edge, project, lost_at) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT DO NOTHING",
                    (key, edge, project, now),
                )
                lost.append((key, project))
        return lost

    def lost_project(self, sandbox_id: str) -> str | None:
        """The project of a sandbox given up (None: it was not)."""
        rows = self._read("SELECT project FROM lost_sandboxes WHERE id = ?", (sandbox_id,))
        return str(rows[0][0]) if rows else None

    def lost_on(self, edge: str) -> set[str]:
        """The sandboxes of `edge` given up (to stop there when it answers again)."""
        return {r[0] for r in self._read("SELECT id FROM lost_sandboxes WHERE edge = ?", (edge,))}

    def forget_lost(self, older_than_s: float) -> int:
        """Forget sandboxes given up more than `older_than_s` ago (they answer not found from
        then on); how many."""
        with self._write() as db:
            cur = db.execute("DELETE FROM lost_sandboxes WHERE lost_at < ?", (time.time() - older_than_s,))
            return int(cur.rowcount or 0)

    # ------------------------------------------------------------------ pending creates' owners

    def _owner(self) -> str:
        """This instance's owner id, alive for as long as it lives (made on first use)."""
        with self._lock:
            if self._owner_id is None:
                self._owner_id = self._db.new_owner()
            return self._owner_id

    def _owner_alive(self, owner: str) -> bool:
        if owner == self._owner_id:
            return True
        with self._lock:
            return self._db.owner_alive(owner)

    def abandon(self, key: str) -> None:
        """A pending reservation of this process whose create (or copy) ended without its rekey
        or release (the database was away then): `release_orphaned` releases it later."""
        self._abandoned.add(key)

    def release_orphaned(self) -> list[str]:
        """Release the pending reservations of processes that are gone (a crash mid-create),
        and this process's own abandoned ones; return their keys. Those of creates still in
        flight stay, however old."""
        for (principal, key), result in list(self._unended.items()):
            self._end_idempotent(principal, key, result)
            del self._unended[(principal, key)]
        released: list[str] = []
        if self._abandoned:
            with self._write() as db:
                for key in sorted(self._abandoned):  # (a create's, or a copy's: see reserve_snapshot_up_to)
                    if self._release(db, key) or self._release_snapshot(db, key):
                        released.append(key)
            self._abandoned.clear()
        owners = {
            r[0]
            for table in ("reservations", "snapshot_reservations")
            for r in self._read(f"SELECT DISTINCT owner FROM {table} WHERE owner IS NOT NULL")
        }
        dead = sorted(o for o in owners if not self._owner_alive(o))
        if not dead:
            return released
        with self._write() as db:
            for owner in dead:
                for (key,) in db.execute("SELECT key FROM reservations WHERE owner = ?", (owner,)).fetchall():
                    if self._release(db, key):
                        released.append(key)
                # a copy in flight (snapshot, fork layer, checkpoint) of a dead process
                rows = db.execute("SELECT key FROM snapshot_reservations WHERE owner = ?", (owner,))
                for (key,) in rows.fetchall():
                    if self._release_snapshot(db, key):
                        released.append(key)
        with self._lock:
            for owner in dead:
                self._db.forget_owner(owner)
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
            _add_usage(db, chain, used_snapshots=1, used_snapshot_mb=mb)

    def reserve_snapshot_up_to(self, key: str, project: str, want_mb: int, *, in_ram: bool = False) -> int:
        """Reserve a copy about to be made (a snapshot, a fork layer, a checkpoint) before it is
        made: one snapshot slot and as many MiB as ``project`` and every ancestor have left, at
        most ``want_mb`` (the copy's upper bound). The MiB reserved are the cap the copy may not
        pass; returns them. Pending: owned by this process, released by :meth:`release_orphaned`
        if it dies first; :meth:`rekey_snapshot` settles it (then :meth:`resize_snapshot` to the
        real size), :meth:`release_snapshot` gives it back. ``in_ram``: the copy lives in the
        host's memory (a fork layer on the edge's run tmpfs), so it counts against
        ``max_memory_mb`` too, for as long as it is held.

        QuotaExceeded when no slot is left, or not even 1 MiB (of a ``want_mb`` of at least 1)."""
        if not key:
            raise InvalidRequest("snapshot reservation key must be a non-empty string")
        mb = _snapshot_mb(key, want_mb)
        owner = self._owner()
        with self._write() as db:
            chain = db.execute(_ANCESTORS_SQL, (project,)).fetchall()
            if not chain:
                self._project_row(db, project)  # raises NotFound
            grant = min([mb, *(_snapshot_room(r, in_ram) for r in chain)])
            cur = db.execute(  # (the row first: a refusal below rolls it back with the transaction)
                "INSERT INTO snapshot_reservations (key, project, size_mb, created_at, owner, in_ram)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (key, project, grant, time.time(), owner, int(in_ram)),
            )
            if not cur.rowcount:
                raise Conflict(f"snapshot reservation {key!r} is already held: use a new key", key=key)
            for row in chain:  # refuses here when there is no slot, or no MiB at all
                _admit_snapshot(row, project, 1, max(grant, min(mb, 1)), in_ram=in_ram)
            _add_usage(db, chain, used_snapshots=1, used_snapshot_mb=grant, **_ram(in_ram, grant))
        return grant

    def resize_snapshot(self, key: str, size_mb: int) -> None:
        """Change the size held by snapshot reservation ``key``; growth is admitted like a new reservation.

        Shrinking always succeeds. On :class:`QuotaExceeded` the reservation keeps its old size.
        """
        mb = _snapshot_mb(key, size_mb)
        with self._write() as db:
            row = db.execute(
                "SELECT project, size_mb, in_ram FROM snapshot_reservations WHERE key = ?", (key,)
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
                    _admit_snapshot(r, row["project"], 0, delta, in_ram=bool(row["in_ram"]))
            db.execute("UPDATE snapshot_reservations SET size_mb = ? WHERE key = ?", (mb, key))
            _add_usage(db, chain, used_snapshot_mb=delta, **_ram(row["in_ram"], delta))

    def _release_snapshot(self, db: Database, key: str) -> bool:
        row = _take(db, "snapshot_reservations", key)
        if row is None:
            return False
        chain = db.execute(_ANCESTORS_SQL, (row["project"],)).fetchall()
        size = row["size_mb"]
        _add_usage(db, chain, used_snapshots=-1, used_snapshot_mb=-size, **_ram(row["in_ram"], -size))
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
        re-admitted, no longer pending); its age for :meth:`reconcile_snapshots` starts again."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE snapshot_reservations SET key = ?, created_at = ?, owner = NULL WHERE key = ?",
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


# --- the same on the server, one round trip (PostgreSQL; see `Database.has_functions`) ---------
#
# Each does only the common case, exactly as the Python above would, and otherwise returns 1
# having written nothing, for the Python to do (and to word its refusal or conflict). Each runs
# as a statement of its own, so a transaction of its own, and takes the write lock that every
# IAM write transaction takes first. (In a VOLATILE function each query takes a fresh snapshot:
# what the lock's previous holder committed is seen.) Every apiserver's migration replaces them
# with its own: a change to what they take or do is a new schema version (schema.py), so that
# apiservers of two versions never share a database.

_BEGIN_CREATE = b"SELECT dsec_begin_create($1, $2, $3, $4, $5, $6, $7, $8)"
_SETTLE_CREATE = b"SELECT dsec_settle_create($1, $2, $3, $4, $5, $6)"

PG_FUNCTIONS = (
    # begin_idempotent(principal, key, reserve=...) on a new key (principal NULL: reserve alone)
    # with the reservation admitted by every project of the chain; 1 for anything else.
    f"""CREATE OR REPLACE FUNCTION dsec_begin_create(
        p_principal TEXT, p_key TEXT, p_owner TEXT, p_now DOUBLE PRECISION,
        p_rkey TEXT, p_project TEXT, p_cpu_m BIGINT, p_memory_mb BIGINT) RETURNS INTEGER
    LANGUAGE plpgsql VOLATILE AS $fn$
    DECLARE
        r RECORD;
        chain TEXT[] := ARRAY[]::TEXT[];
        cpu_limit DOUBLE PRECISION;
    BEGIN
        PERFORM pg_advisory_xact_lock(@WRITE_LOCK@);
        IF p_principal IS NOT NULL
           AND EXISTS (SELECT 1 FROM idempotency WHERE principal = p_principal AND key = p_key) THEN
            RETURN 1;
        END IF;
        IF EXISTS (SELECT 1 FROM reservations WHERE key = p_rkey) THEN
            RETURN 1;
        END IF;
        FOR r IN {_ANCESTORS_SQL.replace("CAST(? AS TEXT)", "p_project").strip()} LOOP
            -- _admit: integer units, millicores for CPU; a limit whose millicores are a
            -- rounding tie is left to Python's round()
            cpu_limit := r.max_cpu * {_MILLI};
            IF (r.max_sandboxes IS NOT NULL AND r.used_sandboxes + 1 > r.max_sandboxes)
               OR (r.max_memory_mb IS NOT NULL AND r.used_memory_mb + p_memory_mb > r.max_memory_mb)
               OR (cpu_limit IS NOT NULL AND (abs(cpu_limit - floor(cpu_limit) - 0.5) < 1e-6
                                              OR r.used_cpu_m + p_cpu_m > round(cpu_limit))) THEN
                RETURN 1;
            END IF;
            chain := chain || r.name;
        END LOOP;
        IF cardinality(chain) = 0 THEN
            RETURN 1;
        END IF;
        IF p_principal IS NOT NULL THEN
            INSERT INTO idempotency (principal, key, state, owner, created_at)
            VALUES (p_principal, p_key, 'pending', p_owner, p_now);
        END IF;
        INSERT INTO reservations (key, project, cpu_m, memory_mb, created_at, owner)
        VALUES (p_rkey, p_project, p_cpu_m, p_memory_mb, p_now, p_owner);
        UPDATE projects SET used_sandboxes = used_sandboxes + 1, used_cpu_m = used_cpu_m + p_cpu_m,
            used_memory_mb = used_memory_mb + p_memory_mb WHERE name = ANY(chain);
        RETURN 0;
    END $fn$""",
    # rekey(old, new, ends=...) when `old` moves to a free `new`; 1 for anything else.
    """CREATE OR REPLACE FUNCTION dsec_settle_create(
        p_old TEXT, p_new TEXT, p_now DOUBLE PRECISION,
        p_principal TEXT, p_key TEXT, p_result TEXT) RETURNS INTEGER
    LANGUAGE plpgsql VOLATILE AS $fn$
    BEGIN
        PERFORM pg_advisory_xact_lock(@WRITE_LOCK@);
        UPDATE reservations SET key = p_new, owner = NULL, created_at = p_now
        WHERE key = p_old AND NOT EXISTS (SELECT 1 FROM reservations WHERE key = p_new);
        IF NOT FOUND THEN
            RETURN 1;
        END IF;
        IF p_principal IS NULL THEN
            RETURN 0;
        ELSIF p_result IS NULL THEN
            DELETE FROM idempotency WHERE principal = p_principal AND key = p_key;
        ELSE
            UPDATE idempotency SET state = 'done', result = p_result, owner = NULL
            WHERE principal = p_principal AND key = p_key;
        END IF;
        RETURN 0;
    END $fn$""",
)

Pending = tuple[str, str, float, int]  # a pending reservation: key, project, cpu, memory_mb
Ends = tuple[str, str, str | None]  # an idempotency key's end: principal, key, result


def _check_reservation(key: str, cpu: float, memory_mb: int) -> None:
    if not key:
        raise InvalidRequest("reservation key must be a non-empty string (the sandbox id)")
    if cpu < 0 or memory_mb < 0:
        raise InvalidRequest(f"cpu ({_fmt(cpu)}) and memory_mb ({memory_mb}) must not be negative", key=key)


def _end_idempotent(db: Database, principal: str, key: str, result: str | None) -> None:
    if result is None:
        db.execute("DELETE FROM idempotency WHERE principal = ? AND key = ?", (principal, key))
    else:
        db.execute(
            "UPDATE idempotency SET state = 'done', result = ?, owner = NULL WHERE principal = ? AND key = ?",
            (result, principal, key),
        )


def _take(db: Database, table: str, key: str) -> Row | None:
    """Delete reservation ``key`` from ``table`` (reservations, snapshot_reservations); its row
    as it was (None: there was none)."""
    row: Row | None = db.execute(f"SELECT * FROM {table} WHERE key = ?", (key,)).fetchone()
    if row is not None:
        db.execute(f"DELETE FROM {table} WHERE key = ?", (key,))
    return row


def _add_usage(db: Database, chain: Sequence[Row], **delta: int) -> None:
    """Add ``delta`` (a ``used_*`` column of projects: an amount) to every project of ``chain``
    (the rows of a project and its ancestors)."""
    columns = ", ".join(f"{column} = {column} + ?" for column in delta)
    names = [r["name"] for r in chain]
    db.execute(
        f"UPDATE projects SET {columns} WHERE name IN ({','.join('?' * len(names))})",
        (*delta.values(), *names),
    )


def _snapshot_mb(key: str, size_mb: float) -> int:
    """``size_mb`` as whole MiB (rounded up), or InvalidRequest if negative or not a finite number."""
    if isinstance(size_mb, bool) or not isinstance(size_mb, int | float) or not math.isfinite(size_mb):
        raise InvalidRequest(f"snapshot size_mb ({size_mb!r}) must be a number of MiB", key=key)
    if size_mb < 0:
        raise InvalidRequest(f"snapshot size_mb ({_fmt(size_mb)}) must not be negative", key=key)
    return math.ceil(size_mb)


_Check = tuple[str, str, float | None, float, float, float]  # field, unit, limit, used, wanted, scale


def _admit(row: Row, project: str, cpu_m: int, memory_mb: int) -> None:
    """Raise QuotaExceeded if adding one sandbox of (cpu_m, memory_mb) would overflow ``row``'s quota."""
    checks: tuple[_Check, ...] = (
        ("max_sandboxes", "sandboxes", row["max_sandboxes"], row["used_sandboxes"], 1, 1),
        ("max_cpu", "CPUs", row["max_cpu"], row["used_cpu_m"] / _MILLI, cpu_m / _MILLI, _MILLI),
        ("max_memory_mb", "MiB of memory", row["max_memory_mb"], row["used_memory_mb"], memory_mb, 1),
    )
    _check_limits(row["name"], project, checks, "sandbox", "delete sandboxes, ask for fewer resources")


def _admit_snapshot(row: Row, project: str, n: int, size_mb: int, *, in_ram: bool = False) -> None:
    """Raise QuotaExceeded if ``n`` more snapshots of ``size_mb`` MiB in all overflow ``row``'s
    quota (``in_ram``: its memory too, as a fork layer holds host memory)."""
    checks: list[_Check] = []
    if n:
        checks.append(("max_snapshots", "snapshots", row["max_snapshots"], row["used_snapshots"], n, 1))
    checks.append(
        ("max_snapshot_mb", "MiB of snapshots", row["max_snapshot_mb"], row["used_snapshot_mb"], size_mb, 1)
    )
    what, remedy = "snapshot", "delete snapshots you no longer need"
    if in_ram:
        memory = row["max_memory_mb"], row["used_memory_mb"]
        checks.append(("max_memory_mb", "MiB of memory", *memory, size_mb, 1))
        what, remedy = "fork layer", remedy + ", stop sandboxes or the children of earlier forks"
    _check_limits(row["name"], project, checks, what, remedy)


def _snapshot_room(row: Row, in_ram: bool) -> int:
    """The MiB of snapshots ``row``'s quota has left (and of memory, ``in_ram``); a large number
    when it has no limit."""
    room = [row["max_snapshot_mb"] - row["used_snapshot_mb"]] if row["max_snapshot_mb"] is not None else []
    if in_ram and row["max_memory_mb"] is not None:
        room.append(row["max_memory_mb"] - row["used_memory_mb"])
    return max(0, min(room, default=1 << 62))


def _ram(in_ram: object, mb: int) -> dict[str, int]:
    """The memory part of a snapshot reservation's usage change (a fork layer's, in_ram)."""
    return {"used_memory_mb": mb} if in_ram else {}


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
