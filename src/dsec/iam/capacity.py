"""Elastic capacity's shared state (dsec.apiserver.capacity), kept in the control plane's
database so that every apiserver sees the same bursts and idle drains, and exactly one of them
acts on them. A part of `IAM` (store.py), which holds the database; what it uses of the rest of
IAM is declared at the top.

* `bursts`: an announced burst as the wire shows it (`body`, a `Burst`) and what its acting
  apiserver needs to resume it (`progress`: grow rounds done, a node-provider request in flight;
  once cancelled, the edges still to be sent their pools' new boost). What a project announced in
  total (pending bursts, the pool stock of finished ones) counts against its `max_sandboxes`,
  `max_cpu` and `max_memory_mb` and its ancestors'; the cluster-wide bound on pending bursts has
  a per-project share.
* `burst_prewarms`: the pool sandboxes each burst asked of each edge (and until when the edge
  is held for it), so the next prewarm of a pool sets its boost to every burst's share.
* `capacity_edges`: the edges the capacity loop drained because they idled (`idle`), is giving
  back to the node provider (`releasing`) or gave back (`released`). An admin's drains are
  `edge_drains` (admission.py).
* `capacity_leader`: which apiserver acts (one row): an owner id of dsec.iam.db, alive while
  its process lives (PostgreSQL: a session advisory lock and a lease; SQLite: an flock). When
  it dies the next apiserver to ask takes over, and every write the acting apiserver makes is
  fenced by that row: one that lost the lead changes nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsec.errors import NotFound, QuotaExceeded
from dsec.iam.db import Database, Row
from dsec.iam.schema import _ANCESTORS_SQL, _DESCENDANTS_SQL
from dsec.models.capacity import Burst

ACTIVE = ("scheduled", "provisioning")
EDGE_STATES = ("idle", "releasing", "released")
_ACTIVE_SQL = "state IN ('scheduled', 'provisioning')"
_LEADS_SQL = "SELECT 1 FROM capacity_leader WHERE name = 'capacity' AND owner = ?"


class BurstCancelled(Exception):
    """A burst was cancelled (DELETE /v1/capacity/{id}): what its task did is not written."""


@dataclass(frozen=True)
class EdgeMark:
    """An edge the capacity loop drained (`idle`), is releasing or released; `since`: epoch s."""

    state: str
    since: float
    owner: str | None


class CapacityStore:
    """Bursts, their prewarms, idle drains and who acts on them (see the module)."""

    # What this part uses of the rest of IAM.
    _lock: threading.Lock
    _db: Database
    _owner_id: str | None

    if TYPE_CHECKING:

        def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

        @contextmanager
        def _write(self) -> Iterator[Database]: ...

        def _owner(self) -> str: ...

        def _owner_alive(self, owner: str) -> bool: ...

    # ------------------------------------------------------------------ who acts

    def capacity_lead(self) -> bool:
        """Whether this process acts on bursts and idle edges: it does while its owner holds the
        row; it takes the row when nobody holds it or its holder is dead."""
        me = self._owner()
        rows = self._read("SELECT owner FROM capacity_leader WHERE name = 'capacity'")
        holder = rows[0][0] if rows else None
        if holder == me:
            return True
        if holder is not None and self._owner_alive(holder):
            return False
        with self._write() as db:
            row = db.execute("SELECT owner FROM capacity_leader WHERE name = 'capacity'").fetchone()
            now = row[0] if row is not None else None
            if now != holder:  # another apiserver took it first
                return bool(now == me)
            db.execute(
                "INSERT INTO capacity_leader (name, owner, since) VALUES ('capacity', ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, since = excluded.since",
                (me, time.time()),
            )
            if holder is not None:
                self._db.forget_owner(holder)  # (dead: what is left of it, as release_orphaned does)
        return True

    def capacity_leader(self) -> str | None:
        rows = self._read("SELECT owner FROM capacity_leader WHERE name = 'capacity'")
        return rows[0][0] if rows else None

    def _leads(self, db: Database) -> bool:
        return db.execute(_LEADS_SQL, (self._owner_id,)).fetchone() is not None

    # ------------------------------------------------------------------ bursts

    def add_burst(
        self,
        burst: Burst,
        *,
        max_active: int | None,
        keep: int,
        max_project: int | None = None,
        pooled_since: float = 0.0,
    ) -> None:
        """Record an announced burst, or refuse it (429 quota_exceeded) when `max_active` are
        pending in the whole cluster, `max_project` in its project (None: no bound: an admin's),
        or when the sandboxes its project's subtree has announced would pass a `max_sandboxes`
        (their CPUs and memory: `max_cpu`, `max_memory_mb`) of the project or an ancestor:
        pending bursts count their `count`, finished ones the pool sandboxes they had
        pre-warmed since `pooled_since` (stock that is still warm).
        Forget the project's oldest finished bursts beyond `keep`."""
        with self._write() as db:
            if max_active is not None:
                (active,) = db.execute(f"SELECT COUNT(*) FROM bursts WHERE {_ACTIVE_SQL}").fetchone()
                if active >= max_active:
                    raise QuotaExceeded(
                        f"{active} bursts are already pending in this cluster; retry when one is done",
                        reason="too_many_bursts",
                        max=max_active,
                    )
            if max_project is not None:
                # The share is a tenant's: its top-level project's whole tree (a tenant granted a
                # parent with children must not hold a share in each child).
                rows = db.execute(_ANCESTORS_SQL, (burst.project,)).fetchall()
                top = rows[-1]["name"] if rows else burst.project
                tree = [r[0] for r in db.execute(_DESCENDANTS_SQL.format(marks="?"), (top,))] or [top]
                marks = ",".join("?" * len(tree))
                (mine,) = db.execute(
                    f"SELECT COUNT(*) FROM bursts WHERE {_ACTIVE_SQL} AND project IN ({marks})", tree
                ).fetchone()
                if mine >= max_project:
                    where = "" if top == burst.project else f" (with the other projects under {top!r})"
                    raise QuotaExceeded(
                        f"project {burst.project!r} has {mine} bursts pending{where}, its share of this "
                        "cluster's bound: retry when one is done, or cancel one "
                        "(DELETE /v1/capacity/{id})",
                        reason="too_many_project_bursts",
                        max=max_project,
                        project=top,
                    )
            _check_announced(db, burst, pooled_since)
            db.execute(
                "INSERT INTO bursts (id, project, state, announced_at, body, progress)"
                " VALUES (?, ?, ?, ?, ?, '{}')",
                (burst.id, burst.project, burst.state, burst.announced_at, burst.model_dump_json()),
            )
            cutoff = db.execute(
                f"SELECT announced_at FROM bursts WHERE NOT {_ACTIVE_SQL} AND project = ?"
                " ORDER BY announced_at DESC LIMIT 1 OFFSET ?",
                (burst.project, keep),
            ).fetchone()
            if cutoff is not None:
                db.execute(
                    f"DELETE FROM bursts WHERE NOT {_ACTIVE_SQL} AND project = ? AND announced_at <= ?",
                    (burst.project, cutoff[0]),
                )

    def cancel_burst(self, burst_id: str, projects: set[str] | None, by: str) -> tuple[Burst, list[str]]:
        """Cancel a burst of `projects` (None: any; another project's is not_found): it is
        `cancelled`, no longer counts against its project, and the pool sandboxes it asked of
        edges are to be given back: those edges are returned (none if it was cancelled before)
        and kept in its progress until the acting apiserver has sent them their pools' new boost
        (`unreleased_bursts`). Its task on the acting apiserver ends at its next write."""
        with self._write() as db:
            sql = "SELECT project, body, progress FROM bursts WHERE id = ?"
            row = db.execute(sql, (burst_id,)).fetchone()
            if row is None or (projects is not None and row[0] not in projects):
                raise NotFound(f"no burst {burst_id!r} (GET /v1/capacity lists yours)", burst=burst_id)
            burst = Burst.model_validate_json(row[1])
            if burst.state == "cancelled":
                return burst, []
            edges = [r[0] for r in db.execute("SELECT edge FROM burst_prewarms WHERE burst = ?", (burst_id,))]
            progress = json.loads(row[2])
            if edges:
                progress["release"] = sorted(set(progress.get("release", ())) | set(edges))
            burst.state = "cancelled"
            burst.actions.append(f"cancelled by {by}" + (f": releasing {', '.join(edges)}" if edges else ""))
            db.execute(
                "UPDATE bursts SET state = ?, body = ?, progress = ? WHERE id = ?",
                (burst.state, burst.model_dump_json(), json.dumps(progress), burst_id),
            )
            db.execute("DELETE FROM burst_prewarms WHERE burst = ?", (burst_id,))
        return burst, edges

    def unreleased_bursts(self) -> list[tuple[Burst, list[str]]]:
        """Cancelled bursts whose edges have not all been sent their pools' new boost yet."""
        sql = "SELECT body, progress FROM bursts WHERE state = 'cancelled' AND progress LIKE ?"
        rows = self._read(sql, ('%"release"%',))
        out = [(Burst.model_validate_json(r[0]), json.loads(r[1]).get("release") or []) for r in rows]
        return [(b, edges) for b, edges in out if edges]

    def released(self, burst_id: str, edges: Sequence[str]) -> bool:
        """`edges` of a cancelled burst were sent their pools' new boost (fenced: False if this
        process no longer acts, nothing written)."""
        with self._write() as db:
            if not self._leads(db):
                return False
            row = db.execute("SELECT progress FROM bursts WHERE id = ?", (burst_id,)).fetchone()
            if row is None:
                return True
            progress = json.loads(row[0])
            left = sorted(set(progress.pop("release", ())) - set(edges))
            if left:
                progress["release"] = left
            db.execute("UPDATE bursts SET progress = ? WHERE id = ?", (json.dumps(progress), burst_id))
        return True

    def list_bursts(self, projects: set[str] | None) -> list[Burst]:
        """The bursts of `projects` (None: all), oldest first (at most `keep` finished ones a
        project are stored: see add_burst)."""
        rows = self._read("SELECT project, body FROM bursts ORDER BY announced_at, id")
        return [Burst.model_validate_json(r[1]) for r in rows if projects is None or r[0] in projects]

    def active_bursts(self) -> list[tuple[Burst, dict[str, Any]]]:
        """Pending bursts with their progress, for the acting apiserver."""
        rows = self._read(f"SELECT body, progress FROM bursts WHERE {_ACTIVE_SQL} ORDER BY announced_at, id")
        return [(Burst.model_validate_json(r[0]), json.loads(r[1])) for r in rows]

    def save_burst(self, burst: Burst, progress: dict[str, Any], shape: str) -> bool:
        """Write what was done for `burst` and its prewarms (`burst.prewarmed`, of pool `shape`;
        `progress["hold"]`: until when its edges are kept), if this process still acts (False:
        it lost the lead, nothing was written) and the burst was not cancelled (BurstCancelled)."""
        hold = float(progress.get("hold", 0.0))
        now = time.time()
        with self._write() as db:
            if not self._leads(db):
                return False
            row = db.execute("SELECT state FROM bursts WHERE id = ?", (burst.id,)).fetchone()
            if row is None or row[0] == "cancelled":
                raise BurstCancelled(burst.id)
            db.execute(
                "UPDATE bursts SET state = ?, body = ?, progress = ? WHERE id = ?",
                (burst.state, burst.model_dump_json(), json.dumps(progress), burst.id),
            )
            had = {
                r[0]: (r[1], r[2])
                for r in db.execute(
                    "SELECT edge, count, hold_until FROM burst_prewarms WHERE burst = ?", (burst.id,)
                )
            }
            for edge in set(had) - set(burst.prewarmed):
                db.execute("DELETE FROM burst_prewarms WHERE burst = ? AND edge = ?", (burst.id, edge))
            changed = [(e, n) for e, n in burst.prewarmed.items() if had.get(e) != (n, hold)]
            if changed:  # (a save per step of a burst: only what changed, not every edge again)
                db.executemany(
                    "INSERT INTO burst_prewarms (burst, edge, shape, count, at, hold_until)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (burst, edge) DO UPDATE SET"
                    " count = excluded.count, hold_until = excluded.hold_until",
                    [(burst.id, e, shape, n, now, hold) for e, n in changed],
                )
        return True

    def prewarm_held(self, edge: str, since: float, shape: str | None = None) -> int:
        """Pool sandboxes every burst asked of `edge` since `since` (of one pool shape, or all)."""
        sql = "SELECT COALESCE(SUM(count), 0) FROM burst_prewarms WHERE edge = ? AND at > ?"
        params: tuple[Any, ...] = (edge, since)
        if shape is not None:
            sql, params = sql + " AND shape = ?", (*params, shape)
        return int(self._read(sql, params)[0][0])

    def held_edges(self, now: float) -> dict[str, float]:
        """Edges a burst still needs, with until when."""
        rows = self._read(
            "SELECT edge, MAX(hold_until) FROM burst_prewarms WHERE hold_until > ? GROUP BY edge", (now,)
        )
        return {r[0]: float(r[1]) for r in rows}

    def forget_prewarms(self, before: float) -> None:
        """Prewarms whose pool boost and hold both ended before `before`."""
        with self._write() as db:
            db.execute("DELETE FROM burst_prewarms WHERE at < ? AND hold_until < ?", (before, before))

    # ------------------------------------------------------------------ idle drains and releases

    def capacity_marks(self) -> dict[str, EdgeMark]:
        rows = self._read("SELECT edge, state, since, owner FROM capacity_edges")
        return {r[0]: EdgeMark(r[1], float(r[2]), r[3]) for r in rows}

    def mark_edge(self, edge: str, state: str | None, *, expect: str | None) -> bool:
        """Move `edge` from `expect` to `state` (None: no mark), if it is at `expect` and this
        process acts; whether it did. Two apiservers never both make one transition."""
        assert state is None or state in EDGE_STATES
        with self._write() as db:
            if not self._leads(db):
                return False
            row = db.execute("SELECT state FROM capacity_edges WHERE edge = ?", (edge,)).fetchone()
            if (row[0] if row is not None else None) != expect:
                return False
            if state is None:
                db.execute("DELETE FROM capacity_edges WHERE edge = ?", (edge,))
            else:
                db.execute(
                    "INSERT INTO capacity_edges (edge, state, since, owner) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (edge) DO UPDATE SET state = excluded.state, since = excluded.since,"
                    " owner = excluded.owner",
                    (edge, state, time.time(), self._owner_id),
                )
        return True

    def unmark_edge(self, edge: str) -> None:
        """An admin's undrain: the edge is neither idle-drained nor remembered as released (a
        release under way finishes)."""
        with self._write() as db:
            db.execute("DELETE FROM capacity_edges WHERE edge = ? AND state != 'releasing'", (edge,))

    def forget_released(self, before: float) -> None:
        with self._write() as db:
            db.execute("DELETE FROM capacity_edges WHERE state = 'released' AND since < ?", (before,))


def _one(shape: dict[str, Any]) -> float:
    return 1.0


def _cpus(shape: dict[str, Any]) -> float:
    return float(shape["cpu"])


def _memory(shape: dict[str, Any]) -> float:
    return float(shape["memory_mb"])


# The quota a burst counts against: (project field, unit, what a sandbox of the burst takes).
_DIMENSIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("max_sandboxes", "sandboxes", _one),
    ("max_cpu", "CPUs", _cpus),
    ("max_memory_mb", "MiB of memory", _memory),
)


def _check_announced(db: Database, burst: Burst, pooled_since: float) -> None:
    """Refuse `burst` if, with what its project's subtree has announced, the sandboxes announced
    under the project or an ancestor would pass its `max_sandboxes`, or their CPUs or memory its
    `max_cpu` or `max_memory_mb` (the bursts of every project below a bound count against it, as
    sandboxes do: a project held to 4 CPUs cannot have 1,000 one-CPU sandboxes pre-warmed)."""
    rows = db.execute(_ANCESTORS_SQL, (burst.project,)).fetchall()
    bounds = [(r["name"], dim, r[field]) for r in rows for dim, (field, _, _) in enumerate(_DIMENSIONS)]
    bounds = [b for b in bounds if b[2] is not None]
    if not bounds:
        return
    announced: dict[str, list[float]] = {}  # project -> what it announced, per dimension

    def add(project: str, shape: dict[str, Any], n: int) -> None:
        total = announced.setdefault(project, [0.0] * len(_DIMENSIONS))
        for dim, (_, _, per) in enumerate(_DIMENSIONS):
            total[dim] += n * per(shape)

    for project, body in db.execute(f"SELECT project, body FROM bursts WHERE {_ACTIVE_SQL}"):
        shape = json.loads(body)
        add(project, shape, int(shape["count"]))
    pooled = db.execute(
        "SELECT b.project, b.body, SUM(p.count) FROM burst_prewarms p JOIN bursts b ON b.id = p.burst"
        f" WHERE NOT b.{_ACTIVE_SQL} AND p.at > ? GROUP BY b.id, b.project, b.body",
        (pooled_since,),
    )
    for project, body, n in pooled:
        add(project, json.loads(body), int(n))
    mine = burst.model_dump()
    for name, dim, bound in bounds:
        field, unit, per = _DIMENSIONS[dim]
        subtree = {r[0] for r in db.execute(_DESCENDANTS_SQL.format(marks="?"), (name,))}
        used = sum(total[dim] for project, total in announced.items() if project in subtree)
        if used + burst.count * per(mine) > bound + 1e-9:
            via = "" if name == burst.project else f" (through its ancestor {name!r})"
            raise QuotaExceeded(
                f"project {burst.project!r} cannot announce {burst.count} more sandboxes: with the "
                f"{used:g} {unit} already announced in bursts pending or pre-warmed under {name!r}, "
                f"they would pass its quota of {bound:g} {unit}{via}; announce fewer or smaller "
                "sandboxes, or cancel a burst (DELETE /v1/capacity/{id})",
                reason="bursts_exceed_quota",
                quota=bound,
                announced=used,
                project=name,
                limit=field,
            )
