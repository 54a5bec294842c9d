"""The trajectory log: every operation on a sandbox, numbered gap-free and persisted in durable batches.

Numbering
    Each sandbox has its own sequence 1, 2, 3, ... handed out by :meth:`TrajectoryLog.record`.
    Sequence numbers are *reserved* in blocks: before a sandbox's next seq passes its durable
    reservation (``reserved_hw``), ``record`` persists ``reserved_hw = seq + reserve_block`` and waits
    for that commit (fsynced, ``synchronous=FULL``) before it hands the seq out. That is the only write a
    caller waits for, once per ``reserve_block`` operations of a sandbox; it runs in a worker thread, so
    the event loop is never blocked by it. Everything else is written by one background writer task in
    batches (``synchronous=NORMAL``: no fsync per batch; WAL commits survive a crash of the process).

Crash detection
    A seq handed out always lies at or below the durable ``reserved_hw``. At :meth:`TrajectoryLog.start`,
    every sandbox whose ``reserved_hw`` is above its last durable seq gets one ``kind="gap"`` entry covering
    ``last_durable + 1 .. reserved_hw``, and numbering continues at ``reserved_hw + 1``. So every seq ever
    handed out either has a durable entry or lies inside a declared gap: loss is bounded and detectable,
    never silent. A clean :meth:`TrajectoryLog.close` flushes and then gives the unused reservations back,
    so it leaves no gap.

How much a crash can lose ("at most one batch")
    Let ``W = min(queue_max, batch_size)``. The writer takes at most ``W`` entries per commit (it takes what
    is waiting, and never more than ``batch_size``), and ``record`` waits while ``W`` entries are already
    waiting for the writer. Hence at any instant the entries acknowledged by ``record`` but not yet
    committed are at most one batch being committed (``<= W``) plus one full batch waiting (``<= W``)::

        acknowledged but not durable  <=  max_unflushed  =  2 * W        (512 with the defaults)

    A SIGKILL of the edge loses at most ``max_unflushed`` acknowledged operations, and all of them lie inside
    the gap written at the next start. (The gap itself can be wider, up to ``reserve_block`` + that: it also
    covers reserved seqs that were never handed out, which is why its text says "up to N".) With the defaults
    the waiting queue is one batch, not ``queue_max``: ``queue_max`` only matters when it is smaller than
    ``batch_size``. A power loss can additionally roll back un-fsynced batch commits since the last
    reservation or checkpoint; those seqs are still inside the fsynced reservation, so they too show up as a
    gap.

Durable acknowledgements
    ``record(..., durable=True)`` returns only once the entry is committed: a SIGKILL then loses nothing
    that was acknowledged (a crash gap still covers reserved seqs never handed out). Concurrent callers
    share commits (the writer does not linger while someone waits), and a small batch someone waits on is
    committed on the event loop itself (a WAL append without fsync, tens of microseconds) rather than in
    a worker thread. The edge records this way by default (``EdgeSettings.trajectory_durable_acks``):
    about +0.1 ms per exec on the edge (1.13-1.16x its p50 of ~0.58 ms), bursts of 64 at once within
    this host's noise (bench/bench_trajlog_acks.py).

Backpressure
    ``record`` never drops: when ``W`` entries are waiting it waits until the writer takes them.

Reads
    :meth:`TrajectoryLog.read`, :meth:`TrajectoryLog.stats` (recorded/lost) and the exports see only what is
    durable; call ``await log.flush()`` first to include everything recorded so far.
    :meth:`TrajectoryLog.find_step` also sees entries still queued, so a replay sees its own recent steps.
    Reads are synchronous SQLite queries on their own connection (WAL: they never wait for the writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.aio import wait_for
from dsec.models.trajectory import Entry
from dsec.privatefs import open_private, private_file
from dsec.trajlog.rows import (
    INSERT,
    READ_COLUMNS,
    SCHEMA,
    STEP_INDEX,
    Row,
    StepTag,
    entry_from_row,
    gap_row,
    insert_rows,
    serialized,
)

INLINE_COMMIT_MAX = 64  # a batch this small that someone waits on commits on the event loop


@dataclass(slots=True)
class _Sandbox:
    """In-memory numbering state of one sandbox (loaded on first use)."""

    next: int  # the seq record() hands out next
    hw: int  # durable reservation: seqs <= hw may be handed out without another write
    recorded: int  # durable non-gap entries
    lost: int  # seqs inside durable gap entries
    pending: int = 0  # handed out, not yet durable (waiting or being committed)
    reserving: asyncio.Future[None] | None = None


class TrajectoryLog:
    """Per-sandbox, gap-free, crash-detecting operation log (see the module docstring for the guarantees).

    ``batch_size``: most entries per commit. ``flush_interval_s``: how long the writer waits for a batch
    to fill before it commits a partial one (the durability delay under light load). ``queue_max``: cap on
    entries waiting for the writer; the effective cap is ``min(queue_max, batch_size)``.
    ``reserve_block``: seqs reserved per reservation write (also the widest a crash gap gets beyond the
    lost entries).
    """

    def __init__(
        self,
        path: Path,
        *,
        batch_size: int = 256,
        flush_interval_s: float = 0.05,
        queue_max: int = 4096,
        reserve_block: int = 256,
    ) -> None:
        if batch_size < 1 or queue_max < 1 or reserve_block < 1 or flush_interval_s < 0:
            raise errors.InvalidRequest(
                "batch_size, queue_max and reserve_block must be >= 1 and flush_interval_s >= 0"
            )
        self.path = Path(path)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.queue_max = queue_max
        self.reserve_block = reserve_block
        self._wait_max = min(queue_max, batch_size)
        #: Most acknowledged entries that are not durable at any instant (what a SIGKILL can lose).
        self.max_unflushed = 2 * self._wait_max
        #: The gap entries written by the last start() (one per sandbox that lost its tail).
        self.recovered: list[Entry] = []

        self._wdb: sqlite3.Connection | None = None  # the writer's (and reservations') connection
        self._rdb: sqlite3.Connection | None = None  # reads
        self._wlock = threading.RLock()  # one transaction at a time on _wdb (reentrant: _commit_with_retry)
        self._rlock = threading.Lock()
        self._lock_fd: int | None = None

        self._sandboxes: dict[str, _Sandbox] = {}
        self._waiting: deque[Row] = deque()
        self._committing: list[Row] = []
        # queued or committing entries with a step tag, by (scope, trajectory, step)
        self._steps: dict[tuple[str, str, int], Row] = {}
        self._enqueued = 0
        self._durable = 0
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._error: BaseException | None = None

        self._open = False
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._nonempty = asyncio.Event()  # something is waiting
        self._ready = asyncio.Event()  # commit now: a full batch waits, or flush/close asked
        self._space = asyncio.Event()  # the waiting queue has room again

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Open the database, write a gap for every sandbox whose reserved seqs are not all durable, start
        the writer."""
        if self._open or self._task is not None:
            raise errors.Conflict("the trajectory log is already started")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_private(Path(f"{self.path}.lock"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise errors.Conflict(f"the trajectory log {self.path} is open in another process") from None
        self._lock_fd = fd
        try:
            self._wdb = self._connect()
            await asyncio.to_thread(self._migrate)
            self._rdb = self._connect()
            self.recovered = [entry_from_row(r) for r in await asyncio.to_thread(self._recover)]
        except BaseException:
            self._close_files()
            raise
        self._open = True
        self._task = asyncio.create_task(self._run(), name=f"trajlog-writer:{self.path.name}")

    async def close(self) -> None:
        """Commit everything recorded so far, stop the writer, give back unused reservations."""
        if self._task is None:
            return
        self._open = False
        self._closing = True
        self._wake_writer()
        self._space.set()  # producers waiting for room see the log is closing
        task = self._task
        # wait() rather than await: a writer that died must not make close() raise its error (or look
        # like close() itself was cancelled); the files are closed either way.
        await asyncio.wait([task])
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            self._error = task.exception()
        unflushed = len(self._waiting) + len(self._committing)
        for _, fut in self._flush_waiters:
            if not fut.done():
                fut.set_exception(errors.Unavailable("the trajectory log closed before this flush completed"))
        self._flush_waiters.clear()
        try:
            if unflushed == 0:
                # Every seq handed out is durable: the rest of each reservation was never used.
                await asyncio.to_thread(self._release_reservations)
        finally:
            self._close_files()
        if unflushed:
            raise errors.InternalError(
                f"the trajectory log could not write {unflushed} entries; they will show up as a gap",
                error=repr(self._error),
            )

    async def __aenter__(self) -> TrajectoryLog:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- hot path

    async def retire(self, sandbox_id: str) -> None:
        """The sandbox is gone (call after its last operation): once its entries are durable,
        give back the rest of its reservation and drop its in-memory numbering state, so an
        edge that has run millions of sandboxes holds state only for the live ones. Its log
        stays readable; a later record() for it would reload the state from the database."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or not self._open:
            return
        if sb.pending or sb.reserving is not None:
            await self.flush()
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.pending or sb.reserving is not None:
            return  # busy again: leave it (close() gives reservations back anyway)
        await asyncio.to_thread(self._release_reservation, sandbox_id)
        if not sb.pending and sb.reserving is None:
            self._sandboxes.pop(sandbox_id, None)

    async def prepare(self, sandbox_id: str) -> None:
        """Load a sandbox's numbering state and make its first reservation now, so that its first
        :meth:`record` neither reads the database nor waits for the reservation's fsync. The edge
        calls this while the sandbox's runtime starts (it overlaps with that), and for pool sandboxes."""
        self._check_open()
        sb = self._sandboxes.get(sandbox_id) or self._load(sandbox_id)
        if sb.next > sb.hw:
            await self._reserve(sandbox_id, sb)

    async def record(
        self,
        sandbox_id: str,
        kind: str,
        action: dict[str, Any],
        observation: dict[str, Any] | bytes | bytearray | None,
        timings: dict[str, float],
        step: StepTag | None = None,
        *,
        durable: bool = False,
    ) -> int:
        """Give the operation the sandbox's next seq, queue it for the writer and return the seq.

        Waits (never drops) while a full batch is already waiting for the writer, and once per
        ``reserve_block`` operations of a sandbox for the reservation write. The dicts are serialized
        here: changing them afterwards does not change the log. ``durable``: return only once the
        entry is committed (a SIGKILL of the process can no longer lose it; concurrent callers
        share commits, and the writer does not linger for a batch to fill while one waits).
        """
        self._check_open()
        action_json, observation_json, timings_json = serialized(
            sandbox_id, kind, action, observation, timings
        )
        digest = hashlib.sha256(action_json.encode()).hexdigest()
        key = None if step is None else (step.scope, step.trajectory, step.index)

        while True:
            if len(self._waiting) >= self._wait_max:  # backpressure: a full batch already waits
                self._space.clear()
                await self._space.wait()
                self._check_open()
                continue
            sb = self._sandboxes.get(sandbox_id) or self._load(sandbox_id)
            if sb.next > sb.hw:  # past the durable reservation: reserve the next block first
                await self._reserve(sandbox_id, sb)
                self._check_open()
                continue
            break
        # From here to the append there is no await: seqs enter the queue in order, so batches commit in
        # seq order and the durable seqs of a sandbox are always a prefix.
        if key is not None:
            self._check_step_free(key)
        seq = sb.next
        sb.next = seq + 1
        sb.pending += 1
        scope, traj, index = (None, None, None) if key is None else key
        row: Row = (sandbox_id, seq, seq, kind, action_json, observation_json, timings_json, traj, index,
                    digest, time.time(), scope)  # fmt: skip
        self._waiting.append(row)
        self._enqueued += 1
        if key is not None:
            self._steps[key] = row
        n = len(self._waiting)
        if n == 1:
            self._nonempty.set()
        if n >= self._wait_max:
            self._ready.set()
        if durable:
            await self._until_durable(self._enqueued)
        return seq

    async def flush(self) -> None:
        """Wait until everything recorded before this call is durable."""
        await self._until_durable(self._enqueued)

    async def _until_durable(self, target: int) -> None:
        """Wait until the first `target` entries ever recorded are committed."""
        if self._durable >= target:
            return
        if self._task is None:
            raise errors.Unavailable("the trajectory log is not running")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((target, fut))
        self._wake_writer()
        await fut

    # ----------------------------------------------------------------- reads

    def read(self, sandbox_id: str, *, after_seq: int = 0, limit: int | None = None) -> list[Entry]:
        """Durable entries of a sandbox covering seqs > ``after_seq``, in seq order, gaps included.

        Entries still queued are not returned: ``await flush()`` first to see everything recorded.
        A gap entry that covers ``after_seq + 1`` is returned even if it starts at or before ``after_seq``.
        """
        sql = (
            f"SELECT {READ_COLUMNS} FROM entries WHERE sandbox_id = ? AND seq_end > ? AND seq >= "
            "COALESCE((SELECT MAX(seq) FROM entries WHERE sandbox_id = ? AND seq <= ?), 0) ORDER BY seq"
        )
        args: list[Any] = [sandbox_id, after_seq, sandbox_id, after_seq]
        if limit is not None:
            sql += " LIMIT ?"
            args.append(max(0, limit))
        with self._rlock:
            rows = self._reader().execute(sql, args).fetchall()
        return [entry_from_row(r) for r in rows]

    def find_step(
        self, trajectory: str, index: int, scope: str = "", sandbox_id: str | None = None
    ) -> Entry | None:
        """The entry tagged (trajectory, index) in ``scope``: still queued or durable. Only that
        scope's entries are ever returned; an entry logged before scopes existed (scope NULL)
        is returned only to its own sandbox (``sandbox_id``), whose scope it necessarily was."""
        row = self._steps.get((scope, trajectory, index))
        if row is not None:
            return entry_from_row(row)
        with self._rlock:
            found = (
                self._reader()
                .execute(
                    f"SELECT {READ_COLUMNS} FROM entries WHERE trajectory = ? AND step = ? "
                    "AND (scope = ? OR (scope IS NULL AND sandbox_id = ?)) ORDER BY scope IS NULL LIMIT 1",
                    (trajectory, index, scope, sandbox_id),
                )
                .fetchone()
            )
        return None if found is None else entry_from_row(found)

    def stats(self, sandbox_id: str) -> dict[str, int]:
        """``acknowledged``: seqs handed out (or covered by a gap); ``recorded``: durable non-gap entries;
        ``lost``: seqs inside gap entries; ``pending``: handed out, not yet durable.
        Always ``acknowledged == recorded + lost + pending``."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None:
            return {
                "acknowledged": sb.next - 1,
                "recorded": sb.recorded,
                "lost": sb.lost,
                "pending": sb.pending,
            }
        with self._rlock:
            row = (
                self._reader()
                .execute(
                    "SELECT durable_seq, recorded, lost FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
                )
                .fetchone()
            )
        durable, recorded, lost = row if row is not None else (0, 0, 0)
        return {"acknowledged": durable, "recorded": recorded, "lost": lost, "pending": 0}

    def iter_rows(self, sandbox_id: str, *, chunk: int = 4096) -> Iterator[list[Row]]:
        """Durable rows of a sandbox in seq order, ``chunk`` at a time (for exports)."""
        after = 0
        while True:
            with self._rlock:
                rows: list[Row] = (
                    self._reader()
                    .execute(
                        f"SELECT {READ_COLUMNS} FROM entries "
                        "WHERE sandbox_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                        (sandbox_id, after, chunk),
                    )
                    .fetchall()
                )
            if not rows:
                return
            yield rows
            after = rows[-1][1]

    def export_jsonl(self, sandbox_id: str, path: Path) -> int:
        """Write the durable entries of a sandbox as JSON lines; returns the number of rows."""
        from dsec.trajlog.export import export_jsonl

        return export_jsonl(self, sandbox_id, path)

    def export_parquet(self, sandbox_id: str, path: Path) -> int:
        """Write the durable entries of a sandbox as Parquet (action/observation/timings as JSON strings)."""
        from dsec.trajlog.export import export_parquet

        return export_parquet(self, sandbox_id, path)

    # ----------------------------------------------------------------- internals: loop side

    # --- shipping to the control plane (dsec.edge.shipper) ---------------------------------

    def rows_after(self, rowid: int, limit: int = 2000) -> list[tuple[int, Row]]:
        """Durable entries written after `rowid` (in write order), with their rowids."""
        with self._rlock:
            sql = f"SELECT rowid, {READ_COLUMNS} FROM entries WHERE rowid > ? ORDER BY rowid LIMIT ?"
            cur = self._reader().execute(sql, (rowid, limit))
            return [(r[0], tuple(r[1:])) for r in cur.fetchall()]  # type: ignore[misc]

    def shipped_through(self, target: str) -> int:
        with self._rlock:
            sql = "SELECT last_rowid FROM shipped WHERE target = ?"
            row = self._reader().execute(sql, (target,)).fetchone()
        return int(row[0]) if row else 0

    def mark_shipped(self, target: str, rowid: int) -> None:
        with self._rlock:
            self._reader().execute(
                "INSERT INTO shipped (target, last_rowid) VALUES (?, ?)"
                " ON CONFLICT (target) DO UPDATE SET last_rowid = excluded.last_rowid",
                (target, rowid),
            )

    def _check_open(self) -> None:
        if not self._open:
            raise errors.Unavailable("the trajectory log is not running (start() it, or it was closed)")

    def _reader(self) -> sqlite3.Connection:
        if self._rdb is None:
            raise errors.Unavailable("the trajectory log is not open")
        return self._rdb

    def _load(self, sandbox_id: str) -> _Sandbox:
        with self._rlock:
            row = (
                self._reader()
                .execute(
                    "SELECT reserved_hw, durable_seq, recorded, lost FROM sandboxes WHERE sandbox_id = ?",
                    (sandbox_id,),
                )
                .fetchone()
            )
        hw, durable, recorded, lost = row if row is not None else (0, 0, 0, 0)
        # After start() every reservation is durable or covered by a gap, so durable == hw here.
        sb = _Sandbox(next=max(hw, durable) + 1, hw=durable, recorded=recorded, lost=lost)
        self._sandboxes[sandbox_id] = sb
        return sb

    async def _reserve(self, sandbox_id: str, sb: _Sandbox) -> None:
        if sb.reserving is None:
            hw = sb.next + self.reserve_block
            sb.reserving = asyncio.ensure_future(self._do_reserve(sandbox_id, sb, hw))
        # shield: a cancelled caller must not cancel the reservation other callers wait for
        await asyncio.shield(sb.reserving)

    async def _do_reserve(self, sandbox_id: str, sb: _Sandbox, hw: int) -> None:
        try:
            await asyncio.to_thread(self._persist_reservation, sandbox_id, hw)
        except Exception as e:
            raise errors.Unavailable(f"the trajectory log could not reserve seqs: {e}") from e
        finally:
            sb.reserving = None
        sb.hw = max(sb.hw, hw)

    def _check_step_free(self, key: tuple[str, str, int]) -> None:
        other = self._steps.get(key)
        if other is None:
            with self._rlock:
                other = (
                    self._reader()
                    .execute(
                        "SELECT sandbox_id, seq FROM entries WHERE trajectory = ? AND step = ? AND scope = ?",
                        (key[1], key[2], key[0]),
                    )
                    .fetchone()
                )
        if other is not None:
            raise errors.Conflict(
                f"step {key[2]} of trajectory {key[1]!r} is already recorded "
                f"(sandbox {other[0]}, seq {other[1]})",
                trajectory=key[1],
                step=key[2],
            )

    def _wake_writer(self) -> None:
        self._nonempty.set()
        self._ready.set()

    async def _run(self) -> None:
        try:
            await self._write_loop()
        except BaseException as e:  # a bug or a cancelled loop: stop taking records, wake everyone
            self._error = e
            self._open = False
            self._space.set()
            for _, fut in self._flush_waiters:
                if not fut.done():
                    fut.set_exception(errors.Unavailable(f"the trajectory log writer stopped: {e!r}"))
            self._flush_waiters.clear()
            raise

    async def _write_loop(self) -> None:
        """The single writer: commit what waits, at most one batch at a time, in queue (= seq) order."""
        while True:
            if not self._waiting:
                if self._closing:
                    return
                self._nonempty.clear()
                self._finish_flushes()
                await self._nonempty.wait()
                continue
            if len(self._waiting) < self._wait_max and not self._closing and not self._flush_waiters:
                self._ready.clear()  # linger: let the batch fill, at most flush_interval_s
                with contextlib.suppress(TimeoutError):
                    await wait_for(self._ready.wait(), self.flush_interval_s)
            n = min(len(self._waiting), self.batch_size)
            batch = [self._waiting.popleft() for _ in range(n)]
            self._committing = batch
            self._space.set()
            if not await self._commit_with_retry(batch):
                return  # closing and the disk keeps failing: close() reports it
            self._committing = []
            self._durable += n
            self._committed(batch)
            batch.clear()  # (not kept while the writer waits: entries can be large)
            self._finish_flushes()

    def _committed(self, batch: list[Row]) -> None:
        for row in batch:
            sb = self._sandboxes[row[0]]
            sb.pending -= 1
            sb.recorded += 1
            if row[7] is not None and row[8] is not None:
                self._steps.pop((row[11] or "", row[7], row[8]), None)

    async def _commit_with_retry(self, batch: list[Row]) -> bool:
        attempt = 0
        while True:
            try:
                small = len(batch) <= INLINE_COMMIT_MAX
                if small and self._flush_waiters and self._wlock.acquire(blocking=False):
                    # someone waits on this commit and it is small (a WAL append, no fsync: tens
                    # of microseconds): done here, without the hop to a worker thread and back
                    try:
                        self._commit(batch)  # takes the lock again: it is reentrant
                    finally:
                        self._wlock.release()
                else:
                    await asyncio.to_thread(self._commit, batch)
                self._error = None
                return True
            except Exception as e:
                self._error = e
                attempt += 1
                for _, fut in self._flush_waiters:
                    if not fut.done():
                        fut.set_exception(errors.Unavailable(f"the trajectory log cannot write: {e}"))
                self._flush_waiters.clear()
                if self._closing and attempt >= 3:
                    return False
                await asyncio.sleep(min(1.0, 0.01 * 2**attempt))

    def _finish_flushes(self) -> None:
        if not self._flush_waiters:
            return
        keep = []
        for target, fut in self._flush_waiters:
            if fut.done():
                continue
            if self._durable >= target:
                fut.set_result(None)
            else:
                keep.append((target, fut))
        self._flush_waiters = keep

    # ----------------------------------------------------------------- internals: database (any thread)

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: autocommit; the writer opens its own transactions.
        private_file(self.path)  # 0600, and so its -wal and -shm files
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA busy_timeout = 10000")
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a WAL commit survives a crash of the process (kill -9); only a power loss can roll back
        # batches since the last fsync, and those lie inside an fsynced reservation (a gap at restart).
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

    def _writer(self) -> sqlite3.Connection:
        if self._wdb is None:
            raise errors.Unavailable("the trajectory log is not open")
        return self._wdb

    def _commit(self, rows: list[Row]) -> None:
        """One batch, one transaction (in a worker thread, or inline for a small one that is
        waited on)."""
        marks: dict[str, list[int]] = {}
        for r in rows:
            m = marks.get(r[0])
            if m is None:
                marks[r[0]] = [r[1], 1]
            else:
                m[0] = max(m[0], r[1])
                m[1] += 1
        db = self._writer()
        with self._wlock:
            db.execute("BEGIN IMMEDIATE")
            try:
                insert_rows(db, rows)
                db.executemany(
                    "UPDATE sandboxes SET durable_seq = MAX(durable_seq, ?), recorded = recorded + ? "
                    "WHERE sandbox_id = ?",
                    [(m[0], m[1], sid) for sid, m in marks.items()],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _migrate(self) -> None:
        """Bring a log written by an older edge to this schema: the scope column, and the step
        index per scope instead of the global one (which let one tenant's tag shadow another's)."""
        db = self._writer()
        with self._wlock:
            db.execute("BEGIN IMMEDIATE")
            try:
                cols = {r[1] for r in db.execute("PRAGMA table_info(entries)")}
                if "scope" not in cols:
                    db.execute("ALTER TABLE entries ADD COLUMN scope TEXT")
                db.execute("DROP INDEX IF EXISTS entries_step")
                db.execute(STEP_INDEX)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _persist_reservation(self, sandbox_id: str, hw: int) -> None:
        db = self._writer()
        with self._wlock:
            db.execute("PRAGMA synchronous=FULL")  # fsync: numbering must survive even a power loss
            try:
                db.execute(
                    "INSERT INTO sandboxes (sandbox_id, reserved_hw) VALUES (?, ?) ON CONFLICT (sandbox_id) "
                    "DO UPDATE SET reserved_hw = MAX(reserved_hw, excluded.reserved_hw)",
                    (sandbox_id, hw),
                )
            finally:
                db.execute("PRAGMA synchronous=NORMAL")

    def _recover(self) -> list[Row]:
        db = self._writer()
        now = time.time()
        gaps: list[Row] = []
        with self._wlock:
            db.execute("BEGIN IMMEDIATE")
            try:
                stale = db.execute(
                    "SELECT sandbox_id, durable_seq, reserved_hw FROM sandboxes "
                    "WHERE reserved_hw > durable_seq"
                ).fetchall()
                for sandbox_id, durable, hw in stale:
                    gap = gap_row(sandbox_id, durable + 1, hw, now)
                    db.execute(INSERT, gap)
                    db.execute(
                        "UPDATE sandboxes SET durable_seq = ?, lost = lost + ? WHERE sandbox_id = ?",
                        (hw, hw - durable, sandbox_id),
                    )
                    gaps.append(gap)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return gaps

    def _release_reservation(self, sandbox_id: str) -> None:
        db = self._writer()
        with self._wlock:
            db.execute(
                "UPDATE sandboxes SET reserved_hw = durable_seq "
                "WHERE sandbox_id = ? AND reserved_hw > durable_seq",
                (sandbox_id,),
            )

    def _release_reservations(self) -> None:
        db = self._writer()
        with self._wlock:
            db.execute("UPDATE sandboxes SET reserved_hw = durable_seq WHERE reserved_hw > durable_seq")

    def _close_files(self) -> None:
        for db in (self._wdb, self._rdb):
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
        self._wdb = self._rdb = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
