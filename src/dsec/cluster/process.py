"""Stopping a server process the cluster helpers started (PostgreSQL, the registry)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
