"""Stopping a server process the cluster helpers started (PostgreSQL, the registry)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import ClassVar


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

    def stop(self, timeout: float | None = None) -> None:
        """Its clean shutdown (`stop_signal`), SIGKILL if it lingers past `timeout`."""
        if self.proc is None:
            return
        stop_server(self.proc, self.stop_signal, self.stop_timeout if timeout is None else timeout)
        self.proc = None
