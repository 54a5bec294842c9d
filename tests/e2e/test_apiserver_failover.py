"""kill -9 of one of two apiservers under exec, file and session load (issue #25, item 9), on a
`dsec cluster up` cluster (PostgreSQL, 2 apiservers, 2 edges in network namespaces).

Every client is given both apiservers and talks to the first when it is killed. Calls in flight
then may fail `unavailable`; every call started once the death is seen (the process has exited)
succeeds; nothing runs twice: each exec and each session run appends a line of its own to a
file in its sandbox, counted at the end.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsec import errors
from dsec.client import Client, Sandbox

from .conftest import cluster_up

pytestmark = [pytest.mark.root, pytest.mark.e2e]

DSEC = [sys.executable, "-m", "dsec.cli"]
WORKERS = ("exec", "session", "file", "exec session file")  # what each worker calls, in turn
AFTER = 12  # calls each worker starts after the death, at least


@dataclass
class Outcome:
    kind: str  # exec | session | file
    mark: str  # the line or file this call leaves behind
    started: float
    error: str | None = None  # its error code (or exception type), when it failed


@dataclass
class Load:
    """Workers calling exec, session runs and file writes and reads, each on its own sandbox
    through its own client (both apiservers, the first current)."""

    urls: list[str]
    token: str
    sandboxes: list[str]
    stop: threading.Event = field(default_factory=threading.Event)
    progress: threading.Condition = field(default_factory=threading.Condition)
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    died_at: float | None = None
    clients_after: list[str] = field(default_factory=list)

    def run(self, sandbox_id: str, kinds: str) -> None:
        done = self.outcomes.setdefault(sandbox_id, [])
        with Client(self.urls, self.token) as c:
            sb = c.sandbox(sandbox_id)
            with sb.session("bash") as session:
                by_kind: dict[str, Callable[[str], None]] = {
                    "exec": lambda m: self._exec(sb, m),
                    "session": lambda m: self._session_run(session.run, m),
                    "file": lambda m: self._file(sb, m),
                }
                calls = [(kind, by_kind[kind]) for kind in kinds.split()]
                n = 0
                while not self.stop.is_set():
                    kind, call = calls[n % len(calls)]
                    n += 1
                    o = Outcome(kind, uuid.uuid4().hex, time.monotonic())
                    try:
                        call(o.mark)
                    except errors.DsecError as e:
                        o.error = e.code
                    except Exception as e:  # anything else leaking out of the SDK is a bug
                        o.error = type(e).__name__
                    with self.progress:
                        done.append(o)
                        self.progress.notify_all()
            self.clients_after.append(c.url)

    @staticmethod
    def _exec(sb: Sandbox, mark: str) -> None:
        r = sb.exec(f"echo {mark} >> /work/exec.log")
        assert r.exit_code == 0, r

    @staticmethod
    def _session_run(run: Callable[..., object], mark: str) -> None:
        run(f"echo {mark} >> /work/session.log")

    @staticmethod
    def _file(sb: Sandbox, mark: str) -> None:
        sb.files.write(f"/work/files/{mark}", mark)
        assert sb.files.read(f"/work/files/{mark}") == mark

    def wait(self, enough: Callable[[list[Outcome]], bool], timeout: float = 300) -> None:
        """Until every worker's outcomes are `enough` (or it failed to start)."""
        with self.progress:
            assert self.progress.wait_for(
                lambda: (
                    len(self.outcomes) == len(self.sandboxes) and all(map(enough, self.outcomes.values()))
                ),
                timeout,
            ), {k: len(v) for k, v in self.outcomes.items()}


def _kill_and_wait(pid: int) -> None:
    """SIGKILL `pid` (not our child: the cluster's) and return once it has exited."""
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        assert select.select([fd], [], [], 30)[0], f"apiserver {pid} did not die"
    finally:
        os.close(fd)


def test_kill_9_of_an_apiserver_under_load_fails_no_later_call_and_runs_nothing_twice(
    cluster_dir: Path, python_image: str
) -> None:
    state = cluster_up(cluster_dir)
    try:
        urls = [a["url"] for a in state["apiservers"]]
        with Client(urls, state["token"]) as c:
            sandboxes = [c.create("python", memory_mb=128).id for _ in WORKERS]
            for sid in sandboxes:
                c.sandbox(sid).exec("mkdir -p /work/files && touch /work/exec.log /work/session.log")
        load = Load(urls, state["token"], sandboxes)
        workers = [threading.Thread(target=load.run, args=a) for a in zip(sandboxes, WORKERS, strict=True)]
        for w in workers:
            w.start()
        try:
            load.wait(lambda done: len(done) >= 6)
            _kill_and_wait(state["apiservers"][0]["pid"])
            load.died_at = died = time.monotonic()
            load.wait(lambda done: sum(o.started > died for o in done) >= AFTER)
        finally:
            load.stop.set()
            for w in workers:
                w.join(120)
        assert load.clients_after == [urls[1]] * len(WORKERS)  # every client moved to the live one

        everything = [o for done in load.outcomes.values() for o in done]
        after = [o for o in everything if o.started > died]
        assert [o for o in after if o.error] == [], "a call started after the death failed"
        failed = [o for o in everything if o.error]
        assert all(o.error == "unavailable" for o in failed), failed  # (calls in flight then)

        with Client(urls[1:], state["token"]) as c:
            for sid, done in load.outcomes.items():
                files = c.sandbox(sid).files
                for kind in ("exec", "session"):
                    lines = Counter(files.read(f"/work/{kind}.log").split())
                    ran = [o for o in done if o.kind == kind]
                    assert set(lines) <= {o.mark for o in ran}
                    assert set(lines.values()) <= {1}, f"a {kind} ran twice"
                    assert all(lines[o.mark] == 1 for o in ran if not o.error), f"a {kind} did not run"
                written = {f.name for f in files.list("/work/files")}
                assert {o.mark for o in done if o.kind == "file" and not o.error} <= written
            c.stop_many(sandboxes)
        print(f"{len(everything)} calls, {len(after)} after the death, failed in flight: {len(failed)}")
    finally:
        down = subprocess.run(
            [*DSEC, "cluster", "down", "--dir", str(cluster_dir), "--purge"], capture_output=True, text=True
        )
    assert down.returncode == 0, down.stderr[-2000:]
