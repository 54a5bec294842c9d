"""An external tool of the layer store (skopeo, buildah) run under a deadline, its output
read line by line as it comes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolRun:
    """How the tool ended: its exit code, the last lines of its output (stdout and stderr
    together), and whether the deadline killed it (its whole process group)."""

    returncode: int
    tail: list[str]
    timed_out: bool
    stopped: bool = False  # by `check` (see run_tool)


def run_tool(
    argv: list[str], *, env: dict[str, str], timeout: float, on_line: Callable[[str], None] | None = None,
    keep: int = 200, check: Callable[[], bool] | None = None,
) -> ToolRun:  # fmt: skip
    """Run `argv` in a session of its own; each output line to `on_line` (its first 2,000
    characters); SIGKILL to its process group at `timeout` seconds, or as soon as `check`
    (asked every second) answers False."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True, text=True, errors="replace",
    )  # fmt: skip
    killed, stopped, done = threading.Event(), threading.Event(), threading.Event()

    def kill() -> None:  # the tool and anything it started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def watch() -> None:  # `check` at once, then every second until the deadline
        end = time.monotonic() + timeout
        while True:
            if time.monotonic() >= end:
                killed.set()
            elif check is not None and not check():
                stopped.set()
            elif done.wait(min(1.0, max(end - time.monotonic(), 0.0))):
                return
            else:
                continue
            kill()
            return

    watchdog = threading.Thread(target=watch, name="tool-watch", daemon=True)
    watchdog.start()
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            out.append(line)  # whole: a registry's manifest can be one long line
            del out[:-keep]
            if on_line is not None:
                on_line(line[:2000])
        proc.wait()
    finally:
        done.set()
        if proc.poll() is None:
            kill()
            proc.wait()
        watchdog.join()
        if proc.stdout is not None:
            proc.stdout.close()
    return ToolRun(proc.returncode, out, killed.is_set(), stopped.is_set())
