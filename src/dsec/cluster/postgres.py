"""A PostgreSQL server of our own: Debian's binaries, a data directory we made, run as the
`postgres` system user (PostgreSQL refuses root), listening on one address and a socket
directory of its own. What `dsec cluster up` starts for its apiservers and what the tests
run against; a production cluster points `--database` at its own server instead."""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dsec.cluster.process import ServerProcess, as_user
from dsec.errors import InvalidRequest, Unavailable

PG_USER = "postgres"


def find_bin_dir() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name)
    )
    if not found:
        raise Unavailable("PostgreSQL is not installed: run ./install.sh (it installs Debian's postgresql)")
    return found[-1].parent


class PostgresServer(ServerProcess):
    """One server over `root` (its data in root/data, its socket in root/run, its password
    in root/password): made on first start, reused after."""

    stop_signal = signal.SIGINT  # a fast shutdown: open transactions are rolled back
    stop_timeout = 30.0

    def __init__(self, root: Path, *, host: str = "127.0.0.1", port: int = 5432) -> None:
        super().__init__()
        self.root = root
        self.host = host
        self.port = port
        self.bin = find_bin_dir()
        self.data = root / "data"
        self.run = root / "run"

    @property
    def password(self) -> str:
        return (self.root / "password").read_text().strip()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{PG_USER}:{self.password}@{self.host}:{self.port}/{database}"

    @staticmethod
    def _ids() -> tuple[int, int]:
        pw = pwd.getpwnam(PG_USER)
        return pw.pw_uid, pw.pw_gid

    def init(self) -> None:
        """initdb, once: password authentication (scram) for every connection."""
        if (self.data / "PG_VERSION").exists():
            return
        uid, gid = self._ids()
        self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
        for parent in [self.root, *self.root.parents]:
            st = parent.stat()
            if not st.st_mode & 0o001 and st.st_uid != uid and not (st.st_gid == gid and st.st_mode & 0o010):
                raise InvalidRequest(
                    f"PostgreSQL (user {PG_USER}) cannot reach {self.root}: {parent} is closed to it "
                    f"(mode {oct(st.st_mode & 0o777)}); put the cluster in a directory others may traverse"
                )
        for d in (self.data, self.run):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chown(d, uid, gid)
        secret = self.root / "password"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
        pwfile = self.run / "pwfile"
        pwfile.write_text(self.password + "\n")
        os.chown(pwfile, uid, gid)
        try:
            argv = [str(self.bin / "initdb"), "-D", str(self.data), "-U", PG_USER, "--auth=scram-sha-256",
                    f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8"]  # fmt: skip
            r = subprocess.run(
                argv, capture_output=True, text=True, check=False, umask=0o077, **as_user(self._ids())
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if r.returncode != 0:
            raise InvalidRequest(f"initdb failed: {(r.stderr or r.stdout)[-600:]}")

    def start(self, timeout: float = 60.0) -> None:
        self.init()
        argv = [
            str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.run), "-p", str(self.port),
            "-c", f"listen_addresses={self.host}", "-c", "max_connections=300", "-c", "fsync=on",
            "-c", "shared_buffers=64MB",
        ]  # fmt: skip
        self._spawn(argv, self.root / "postgres.log", self._ids())
        self._wait_ready("PostgreSQL", self.root / "postgres.log", timeout)

    def ready(self) -> bool:
        r = subprocess.run(
            [str(self.bin / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port)], check=False
        )
        return r.returncode == 0

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends (a crash: it recovers from its WAL at start)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def throwaway_server(prefix: str = "dsec-pg-") -> Iterator[PostgresServer]:
    """A PostgreSQL server of its own in a new directory under /tmp, on a free port of
    127.0.0.1 (for tests and benchmarks); stopped and removed afterwards."""
    from dsec.cluster.registry import free_port

    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(root, 0o755)  # the postgres user must reach its data directory
    server = PostgresServer(root / "pg", port=free_port())
    try:
        server.start()
        yield server
    finally:
        server.remove()
        shutil.rmtree(root, ignore_errors=True)
