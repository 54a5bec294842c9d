"""The IAM's database: SQLite in one file (one host: what `dsec up` embeds) or PostgreSQL
(stateless apiservers on several hosts), behind the few calls IAM makes.

IAM writes its SQL once, in SQLite's dialect with `?` placeholders, in the subset both
understand (`INSERT ... ON CONFLICT`, recursive CTEs, typed parameters where PostgreSQL
cannot infer one). What differs is here:

* Write transactions. SQLite's `BEGIN IMMEDIATE` takes the database's one write lock before
  anything is read; PostgreSQL's equivalent is a transaction-scoped advisory lock taken first
  thing (`pg_advisory_xact_lock`): every IAM write on every apiserver is serialised, so a
  reservation's read-check-write of its project rows can never interleave with another's and
  no quota is overshot, whichever apiserver admits.
* Pending creates' owners (a process that reserved quota for a create in flight, see
  admission.py). SQLite: an flock on a file beside the database (one host). PostgreSQL: a
  session-level advisory lock held by a connection of the owning process, and a lease row
  that connection renews every few seconds: an owner whose lock is free (its process died:
  its session ended) or whose lease ran out (its host was cut off) is gone, and its pending
  reservations and idempotent creates are taken over by whichever apiserver comes next.
* Whether another process wrote since we last looked (the auth cache's epoch check): free in
  SQLite (`PRAGMA data_version`), a read of the epoch row in PostgreSQL.
* Losing the server: a PostgreSQL connection that broke is replaced from the pool on the next
  call (psycopg_pool); the call that met the break fails with `unavailable` (503), never with
  half a transaction applied. SQLite has no server to lose.
* The schema: SQLite's `user_version`, PostgreSQL's row in `meta`; types mapped (REAL is
  double precision, INTEGER is bigint). Migrations run at start under the write lock, so
  several apiservers starting at once migrate once.
* Round trips: PostgreSQL also gets the IAM's server-side functions (`has_functions`,
  `call_int`: a create's admission and its settling, one round trip each instead of six
  and four; see admission.py). SQLite, in-process, has no round trips to save.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.errors import InvalidRequest, Unavailable
from dsec.privatefs import private_file

Row = Any  # a row of either: by position and by column name

OWNER_RE = re.compile(r"o[0-9a-f]{16}")
LEASE_S = 30.0  # a PostgreSQL owner's lease, renewed every sixth of it
_WRITE_LOCK = 0x64736563  # "dsec": the advisory lock every IAM write transaction takes first
_BEGIN_WRITE = f"BEGIN; SELECT pg_advisory_xact_lock({_WRITE_LOCK})".encode()


@dataclass(frozen=True, slots=True)
class Schema:
    """What a database holds at `version`: `statements` (CREATE ... IF NOT EXISTS), the
    `added` (table, column, declaration) columns an older database lacks, and the
    server-side `functions` (PostgreSQL only)."""

    statements: Sequence[str]
    added: Sequence[tuple[str, str, str]]
    version: int
    functions: Sequence[str] = ()


class Part:
    """A part of `IAM` (store.py) in a module of its own (its mixins): what it uses of the
    IAM that holds the database."""

    _lock: threading.Lock
    _db: Database

    if TYPE_CHECKING:

        def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

        @contextmanager
        def _write(self) -> Iterator[Database]: ...


class Database(ABC):
    """One connection's worth of the IAM's database (IAM serialises its own use of it)."""

    url: str

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; a cursor (fetchone, fetchall, rowcount, iteration), rows
        indexable by position and by column name."""

    @abstractmethod
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    #: Whether the server runs the IAM's functions (`migrate`'s `functions`): PostgreSQL's
    #: do, in one round trip, what SQLite does statement by statement in-process.
    has_functions = False

    def call_int(self, sql: bytes, params: Sequence[Any]) -> int:
        """Run one statement (`$1`-style placeholders) as a transaction of its own; the integer
        in its first column. Only where `has_functions`."""
        raise NotImplementedError

    def read_int(self, sql: str) -> int | None:
        """The integer in the first column of the first row of a constant query (no
        parameters); None when it has no row (or the value is NULL)."""
        row = self.execute(sql).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    @abstractmethod
    def begin_write(self) -> None:
        """Begin a transaction that holds the database's write lock from its first statement."""

    def commit(self) -> None:
        self.execute("COMMIT")

    def rollback(self) -> None:
        self.execute("ROLLBACK")

    @abstractmethod
    def others_wrote(self) -> bool:
        """Whether another connection may have committed since the last call."""

    @abstractmethod
    def migrate(self, schema: Schema) -> None:
        """Create what is missing of `schema`, add the columns an older database lacks,
        (re)create the server-side functions where the database has them (PostgreSQL), and
        record the schema's version; refuse a newer database."""

    # pending creates' owners

    @abstractmethod
    def new_owner(self) -> str:
        """An owner id for this process, alive until `close` (or the process's end)."""

    @abstractmethod
    def owner_alive(self, owner: str) -> bool: ...

    @abstractmethod
    def forget_owner(self, owner: str) -> None:
        """Remove what is left of a dead owner."""

    @abstractmethod
    def close(self) -> None: ...


def open_database(target: str | Path, *, busy_timeout_s: float = 30.0, lease_s: float = LEASE_S) -> Database:
    """A database by URL (postgresql://...) or SQLite file path. `lease_s`: how long a
    PostgreSQL owner outlives its last renewal (see the module)."""
    text = str(target)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(text, lease_s=lease_s)
    return SqliteDatabase(Path(text), busy_timeout_s=busy_timeout_s)


def _newer(version: int, mine: int, url: str) -> InvalidRequest:
    return InvalidRequest(
        f"IAM database {url} has schema version {version}, newer than this dsec understands "
        f"({mine}): upgrade dsec"
    )


# --- SQLite -------------------------------------------------------------------------------


class SqliteDatabase(Database):
    """One SQLite file: WAL (several processes of one host may open it), busy timeout."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = path
        self.url = str(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        private_file(path)  # 0600, and so its -wal and -shm files
        self._busy_s = busy_timeout_s
        self.db = sqlite3.connect(
            str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self.db.row_factory = sqlite3.Row
        self._data_version = -1
        self._owners_dir = path.with_name(path.name + ".owners")
        self._owner_fds: dict[str, int] = {}
        try:
            self._pragmas()
        except BaseException:
            self.db.close()
            raise

    def _pragmas(self) -> None:
        db = self.db
        db.execute(f"PRAGMA busy_timeout = {int(self._busy_s * 1000)}")
        deadline = time.monotonic() + self._busy_s
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

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self.db.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.db.executemany(sql, rows)

    def begin_write(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def others_wrote(self) -> bool:
        (version,) = self.db.execute("PRAGMA data_version").fetchone()
        if version == self._data_version:
            return False
        self._data_version = version
        return True

    def migrate(self, schema: Schema) -> None:
        db = self.db
        self.begin_write()
        try:
            (have,) = db.execute("PRAGMA user_version").fetchone()
            if have > schema.version:
                raise _newer(have, schema.version, self.url)
            for stmt in schema.statements:
                db.execute(stmt)
            for table, column, decl in schema.added:
                columns = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in columns:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            db.execute(f"PRAGMA user_version = {schema.version}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def new_owner(self) -> str:
        """An flock held on <db>.owners/<id> for as long as this process lives."""
        self._owners_dir.mkdir(mode=0o700, exist_ok=True)
        oid = "o" + secrets.token_hex(8)
        fd = os.open(self._owners_dir / oid, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._owner_fds[oid] = fd
        return oid

    def owner_alive(self, owner: str) -> bool:
        if owner in self._owner_fds:
            return True
        if not OWNER_RE.fullmatch(owner):
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

    def forget_owner(self, owner: str) -> None:
        if OWNER_RE.fullmatch(owner):
            with contextlib.suppress(OSError):
                os.unlink(self._owners_dir / owner)

    def close(self) -> None:
        self.db.close()
        for oid, fd in self._owner_fds.items():
            with contextlib.suppress(OSError):
                os.unlink(self._owners_dir / oid)  # while still holding the lock
            os.close(fd)
        self._owner_fds.clear()


# --- PostgreSQL ----------------------------------------------------------------------------


def _pg_sql(sql: str) -> str:
    """SQLite's `?` placeholders as psycopg's `%s` (a literal % doubled first)."""
    return sql.replace("%", "%%").replace("?", "%s")


def _pg_ddl(stmt: str) -> str:
    stmt = stmt.replace(" WITHOUT ROWID", "")
    stmt = re.sub(r"\bREAL\b", "DOUBLE PRECISION", stmt)
    return re.sub(r"\bINTEGER\b", "BIGINT", stmt)


class _Row(tuple[Any, ...]):
    """A row by position and by column name (what sqlite3.Row offers)."""

    _names: dict[str, int]

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            return tuple.__getitem__(self, self._names[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._names)


_NAMES: dict[tuple[bytes | None, ...], dict[str, int]] = {}  # a result's column names -> positions


def _row_factory(cursor: Any) -> Any:
    # Read off the raw result: `cursor.description` makes a Column (with its type looked up)
    # per column per statement, rows or none: a sixth of a create's CPU on PostgreSQL
    # (bench_control_plane, the apiserver process profiled).
    res = cursor.pgresult
    if res is None or not res.nfields:
        return None
    key = tuple(res.fname(i) for i in range(res.nfields))
    names = _NAMES.get(key)
    if names is None:
        if len(_NAMES) > 1024:  # (the IAM's queries have a few dozen shapes)
            _NAMES.clear()
        names = _NAMES[key] = {(n or b"").decode(): i for i, n in enumerate(key)}

    def make(values: Sequence[Any]) -> _Row:
        row = _Row(values)
        row._names = names
        return row

    return make


class PostgresDatabase(Database):
    """PostgreSQL through a small psycopg pool: one connection in use at a time (IAM
    serialises its calls), another ready when a connection breaks."""

    def __init__(self, url: str, *, lease_s: float = LEASE_S) -> None:
        self.lease_s = lease_s
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as e:  # pragma: no cover - a dependency of dsec
            raise InvalidRequest(f"PostgreSQL needs psycopg and psycopg-pool: {e}") from e
        self.url = url
        self._psycopg = psycopg
        self._simple_ok = frozenset((psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK))
        self._conn_ok = psycopg.pq.ConnStatus.OK
        self.pool = ConnectionPool(
            url,
            min_size=1,
            max_size=2,
            kwargs={"autocommit": True, "row_factory": _row_factory, "connect_timeout": 3},
            check=ConnectionPool.check_connection,
            open=False,
            name="dsec-iam",
        )
        try:
            self.pool.open(wait=True, timeout=30)
        except Exception as e:
            self.pool.close()
            raise Unavailable(f"cannot reach the IAM database at {_redact(url)}: {e}") from e
        self._conn: Any = None
        self._owners: set[str] = set()
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock_conn: Any = None
        self._holder_lock = threading.Lock()

    # one connection for a transaction, fresh from the pool otherwise

    def _connection(self) -> Any:
        if self._conn is None:
            try:
                # (short: IAM calls run on the apiserver's event loop; a server that is away
                # must cost a quick 503, not a stalled apiserver)
                self._conn = self.pool.getconn(timeout=2)
            except Exception as e:
                raise Unavailable(f"the IAM database is unreachable ({e}); retry") from e
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                self.pool.putconn(conn)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        try:
            cur = self._connection().execute(_pg_sql(sql), tuple(params))
        except self._psycopg.OperationalError as e:
            self._drop()  # (the pool checks it before lending it again)
            raise Unavailable(f"lost the IAM database's connection ({e}); retry") from e
        return cur

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        try:
            with self._connection().cursor() as cur:
                cur.executemany(_pg_sql(sql), [tuple(r) for r in rows])
        except self._psycopg.OperationalError as e:
            self._drop()
            raise Unavailable(f"lost the IAM database's connection ({e}); retry") from e

    def _simple(self, sql: bytes, params: Sequence[Any] | None = None) -> Any:
        """A statement straight through libpq (PQexec; PQexecParams with `params`, sent as
        text): none of psycopg's per-statement Python (cursor, query conversion,
        prepared-statement books, its wait loop), which is most of a statement's client CPU
        (12.6 -> 3.6 us). It blocks, as the psycopg calls here do (IAM's calls are
        synchronous)."""
        conn = self._connection()
        pgconn = conn.pgconn
        try:
            if params is None:
                res = pgconn.exec_(sql)
            else:
                res = pgconn.exec_params(sql, [_text_param(v) for v in params])
        except self._psycopg.OperationalError as e:  # (its connection closed)
            self._drop()
            raise Unavailable(f"lost the IAM database's connection ({e}); retry") from e
        if res.status in self._simple_ok:
            return res
        if pgconn.status != self._conn_ok:
            self._drop()  # (the pool checks it before lending it again)
            why = bytes(pgconn.error_message).decode(errors="replace").strip()
            raise Unavailable(f"lost the IAM database's connection ({why}); retry")
        error = self._psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
        if isinstance(error, self._psycopg.OperationalError):
            self._drop()
            raise Unavailable(f"lost the IAM database's connection ({error}); retry") from error
        raise error

    def read_int(self, sql: str) -> int | None:
        # (sent as written: no placeholders; PQexec's rows come as text, int() reads them)
        res = self._simple(sql.encode())
        value = res.get_value(0, 0) if res.ntuples and res.nfields else None
        return None if value is None else int(value)

    has_functions = True

    def call_int(self, sql: bytes, params: Sequence[Any]) -> int:
        res = self._simple(sql, params)
        return int(res.get_value(0, 0))

    def begin_write(self) -> None:
        # One round trip: a simple query may hold two statements (the lock is a constant).
        self._simple(_BEGIN_WRITE)

    def commit(self) -> None:
        self._simple(b"COMMIT")

    def rollback(self) -> None:
        with contextlib.suppress(Unavailable):  # (a broken connection rolled it back itself)
            self._simple(b"ROLLBACK")

    def others_wrote(self) -> bool:
        return True  # (one read of the epoch row: see the module)

    def migrate(self, schema: Schema) -> None:
        self.begin_write()
        try:
            self.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL)")
            row = self.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            have = row[0] if row is not None else 0
            if have > schema.version:
                raise _newer(have, schema.version, _redact(self.url))
            for stmt in schema.statements:
                self.execute(_pg_ddl(stmt))
            for table, column, decl in schema.added:
                self.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {_pg_ddl(decl)}")
            self.execute(
                "CREATE TABLE IF NOT EXISTS owners"
                " (id TEXT PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL)"
            )
            self.execute(
                "ALTER TABLE owners ADD COLUMN IF NOT EXISTS renewed_at DOUBLE PRECISION NOT NULL DEFAULT 0"
            )
            for stmt in schema.functions:  # (CREATE OR REPLACE: this version's body, every start)
                self._simple(stmt.replace("@WRITE_LOCK@", str(_WRITE_LOCK)).encode())
            self.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (schema.version,),
            )
        except BaseException:
            self.rollback()
            raise
        self.commit()

    # pending creates' owners: leases, and a session lock (see the module)

    def _lease(self, conn: Any, owner: str) -> None:
        """Renew `owner`'s lease, through the connection that holds its lock (taken first)."""
        now = "EXTRACT(EPOCH FROM clock_timestamp())"
        conn.execute(
            f"INSERT INTO owners (id, expires_at, renewed_at) VALUES (%s, {now} + %s, {now})"
            " ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at,"
            " renewed_at = excluded.renewed_at",
            (owner, self.lease_s),
        )

    def _holder(self) -> Any:
        """The connection that holds this process's owner locks and renews its leases: when
        the process dies its session ends, the locks go with it, and its owners are dead at
        once (the lease covers a host cut off, whose session may linger)."""
        if self._lock_conn is None or self._lock_conn.closed:
            self._lock_conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=3)
            for oid in self._owners:
                self._lock_conn.execute("SELECT pg_advisory_lock(%s, %s)", _owner_key(oid))
        return self._lock_conn

    def new_owner(self) -> str:
        oid = "o" + secrets.token_hex(8)
        with self._holder_lock:
            try:
                conn = self._holder()
                conn.execute("SELECT pg_advisory_lock(%s, %s)", _owner_key(oid))
                self._lease(conn, oid)
            except self._psycopg.OperationalError as e:
                self._lock_conn = None
                raise Unavailable(f"the IAM database is unreachable ({e}); retry") from e
            self._owners.add(oid)
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew, name="dsec-iam-lease", daemon=True)
            self._renewer.start()
        return oid

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 6):
            with self._holder_lock:
                try:
                    conn = self._holder()
                    for oid in list(self._owners):
                        self._lease(conn, oid)
                except Exception:  # (the server is away: reconnect and re-lock next time)
                    with contextlib.suppress(Exception):
                        if self._lock_conn is not None:
                            self._lock_conn.close()
                    self._lock_conn = None

    def owner_alive(self, owner: str) -> bool:
        if owner in self._owners:
            return True
        row = self.execute(
            "SELECT expires_at > EXTRACT(EPOCH FROM clock_timestamp()),"
            " renewed_at > EXTRACT(EPOCH FROM pg_postmaster_start_time()) FROM owners WHERE id = ?",
            (owner,),
        ).fetchone()
        if row is None or not row[0] or not OWNER_RE.fullmatch(owner):
            return False
        if not row[1]:
            # The server restarted since the owner last renewed: its lock went with its old
            # session and it may not have taken it again yet. Only its lease tells.
            return True
        # Its lease runs and it locked since the server started: does it still hold the lock?
        # (free: its session ended, it is gone; give the lock back)
        (free,) = self.execute("SELECT pg_try_advisory_lock(?, ?)", _owner_key(owner)).fetchone()
        if free:
            self.execute("SELECT pg_advisory_unlock(?, ?)", _owner_key(owner))
        return not free

    def forget_owner(self, owner: str) -> None:
        self.execute("DELETE FROM owners WHERE id = ?", (owner,))

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        with contextlib.suppress(Exception):
            for oid in self._owners:
                self.execute("DELETE FROM owners WHERE id = ?", (oid,))
        with contextlib.suppress(Exception):
            if self._lock_conn is not None:
                self._lock_conn.close()
        self._drop()
        self.pool.close()


def _text_param(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format (None: NULL)."""
    if value is None:
        return None
    if isinstance(value, float):
        return repr(value).encode()  # (round-trips exactly)
    return str(value).encode()


def _owner_key(owner: str) -> tuple[int, int]:
    """The advisory lock (a pair of int4) of a PostgreSQL owner."""
    v = int(owner[1:9], 16)
    return 0x6F776E, v - (1 << 32) if v >= 1 << 31 else v


def _redact(url: str) -> str:
    """A database URL without its password, for messages."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)
