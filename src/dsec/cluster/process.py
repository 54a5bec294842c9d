"""Starting and stopping a server process the cluster helpers run (PostgreSQL, the registry)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

from dsec.errors import Unavailable
from dsec.privatefs import open_private


def as_user(ids: tuple[int, int] | None) -> dict[str, Any]:
    """subprocess arguments that run a child as (uid, gid) with no supplementary groups;
    None: as this process."""
    return {} if ids is None else {"user": ids[0], "group": ids[1], "extra_groups": []}


def stop_server(proc: subprocess.Popen[bytes], sig: signal.Signals, timeout: float) -> None:
    """Send `sig` (the server's own shutdown signal) and wait; past `timeout`, SIGKILL its
    process group (it was started in a session of its own) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class ServerProcess:
    """A server the cluster helpers run as a child: its process (None once stopped), how it
    shuts down cleanly, and how long it may take."""

    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM
    stop_timeout: ClassVar[float] = 10.0

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def ready(self) -> bool:
        """Whether the server answers."""
        raise NotImplementedError

    def _spawn(self, argv: list[str], log_path: Path, ids: tuple[int, int] | None) -> None:
        """Start the server (as `ids`, see as_user) in a session of its own, its output
        appended to `log_path`, files it makes private (umask 077)."""
        with os.fdopen(open_private(log_path, os.O_WRONLY | os.O_APPEND), "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                umask=0o077, **as_user(ids),
            )  # fmt: skip
        self.pid = self.proc.pid

    def _wait_ready(self, what: str, log_path: Path, timeout: float) -> None:
        """Until ready(): Unavailable with the log's tail if it exits first, and stopped (and
        Unavailable) if it is not ready within `timeout` seconds."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-800:]
                self.proc = None
                raise Unavailable(f"{what} exited at start: {tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"{what} did not answer within {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float | None = None) -> None:
        """Its clean shutdown (`stop_signal`), SIGKILL if it lingers past `timeout`."""
        if self.proc is None:
            return
        stop_server(self.proc, self.stop_signal, self.stop_timeout if timeout is None else timeout)
        self.proc = None
