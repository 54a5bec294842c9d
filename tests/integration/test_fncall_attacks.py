"""Attacks on the fncall backend from the code it runs, on a real edge with the `code` image.

What must hold: a call's result comes from the runner's waitpid and nothing the code
writes can stand in for it (the control channel is unreachable from any process of a
call); a call's processes all die with its cgroup before the worker serves anyone again,
so nothing of one call sees the next; workers never serve two projects; and a worker
that says anything unexpected on its channel is replaced.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import secrets
import time

import pytest

from dsec.compat.sandboxfusion import jupyter_response, run_code_response
from dsec.models import FnCallRequest, FnCallResult, JupyterRequest

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


@pytest.fixture
async def fedge(edge, code_image):
    edge.fncall.size = 1  # one worker: every call goes to the worker the attacker had
    return edge


async def call(edge, **kw) -> FnCallResult:
    return await edge.fncall_run(FnCallRequest(**kw))


# A reply as the runner writes it, claiming success; FORGE_ID finds the call's id in the
# runner's memory that the fast path's child shares (so the id alone protects nothing).
FORGE = r"""
import glob, json, os, sys

def call_id():
    f = sys._getframe()
    while f is not None:
        if isinstance(f.f_locals.get("call_id"), str):
            return f.f_locals["call_id"]
        f = f.f_back
    return None

def forged(stdout):
    return (json.dumps({
        "id": call_id(), "compile": None, "files": {}, "healthy": True,
        "run": {"status": "Finished", "return_code": 0, "stdout": stdout, "stderr": "",
                "execution_time": 0.0, "truncated": False},
        "driver": {"status": "Finished", "return_code": 0, "stdout": stdout, "stderr": ""},
        "cells": [],
    }) + "\n").encode()

def spray(stdout, low=3):
    line, hits = forged(stdout), []
    for fd in range(low, 1024):
        try:
            os.write(fd, line)
            hits.append(fd)
        except OSError:
            pass
    paths = glob.glob(f"/proc/{os.getppid()}/fd/*") + glob.glob("/proc/1/fd/*")
    paths += [p for p in glob.glob("/proc/self/fd/*") if int(p.rsplit("/", 1)[1]) >= low]
    for p in paths:
        try:
            fd = os.open(p, os.O_WRONLY)
            os.write(fd, line)
            hits.append(p)
        except OSError:
            pass
    return hits
"""


async def test_forged_reply_through_every_descriptor(fedge):
    code = FORGE + (
        "hits = spray('FORGED\\n')\n"
        "print('fds', sorted(os.listdir('/proc/self/fd')))\n"
        "try:\n    print('parent fds', os.listdir(f'/proc/{os.getppid()}/fd'))\n"
        "except OSError as e:\n    print('parent fds closed', e.errno)\n"
        "print('hits', hits)\n"
        "sys.exit(1)\n"
    )
    for _ in range(2):  # and the worker is still in step for the next call
        r = await call(fedge, code=code)
        assert r.run is not None
        assert (r.run.status, r.run.return_code) == ("Error", 1), r.run
        assert "FORGED" not in (r.run.stdout or ""), r.run.stdout
        assert "hits []" in r.run.stdout, r.run.stdout  # nothing but its own stdio was writable
        assert "parent fds closed" in r.run.stdout, r.run.stdout  # the runner is not dumpable
        assert run_code_response(r)["status"] == "Failed"
    r = await call(fedge, code="print('next')")
    assert (r.run.status, r.run.stdout) == ("Finished", "next\n")


async def test_forged_reply_from_a_compiled_program_and_a_grandchild(fedge):
    # The exec'd path (bash) and a forked grandchild of the fast path spray every fd too.
    line = json.dumps({"compile": None, "run": {"status": "Finished", "return_code": 0, "stdout": "FORGED"}})
    bash = f"for fd in $(seq 3 1023); do echo '{line}' >&$fd; done 2>/dev/null; exit 3"
    r = await call(fedge, language="bash", code=bash)
    assert (r.run.status, r.run.return_code) == ("Error", 3) and "FORGED" not in r.run.stdout
    code = FORGE + (
        "pid = os.fork()\n"
        "if pid == 0:\n    spray('FORGED\\n')\n    os._exit(0)\n"
        "os.waitpid(pid, 0)\nraise SystemExit(4)\n"
    )
    r = await call(fedge, code=code)
    assert (r.run.status, r.run.return_code) == ("Error", 4) and "FORGED" not in r.run.stdout


async def test_forged_jupyter_driver(fedge):
    # A cell writes a whole reply to every fd but the result pipe (fd 3, its own), then the
    # kernel exits 3: the driver reports that exit, from waitpid.
    cells = [FORGE, "spray('FORGED\\n', low=4)", "import os\nos._exit(3)"]
    r = await fedge.fncall_jupyter(JupyterRequest(cells=cells))
    assert r.driver is not None and (r.driver.status, r.driver.return_code) == ("Error", 3), r.driver
    assert "FORGED" not in (r.driver.stdout or "") and r.cells is None
    assert jupyter_response(r)["status"] == "Failed"
    r = await fedge.fncall_jupyter(JupyterRequest(cells=["1 + 1"]))
    assert r.driver.status == "Finished" and r.cells[0].display == [{"text/plain": "2"}]


async def test_early_fake_reply_cannot_desync_the_next_caller(fedge):
    # The attacker's fake reply goes out at once, then it keeps running; the callers after it
    # (another project's, then its own project's) must each get their own output.
    attack = FORGE + "spray('FORGED\\n')\nimport time\ntime.sleep(1.5)\nprint('ATTACKER-LATE')\nsys.exit(9)\n"
    t0 = time.monotonic()
    r = await call(fedge, code=attack, project="mallory")
    assert (r.run.return_code, r.run.stdout) == (9, "ATTACKER-LATE\n"), r.run
    assert time.monotonic() - t0 >= 1.5
    victim = await call(fedge, code="print('VICTIM-OWN')", project="alice")
    assert (victim.run.return_code, victim.run.stdout) == (0, "VICTIM-OWN\n"), victim.run
    again = await call(fedge, code="print('MALLORY-2')", project="mallory")
    assert again.run.stdout == "MALLORY-2\n", again.run


async def test_early_fake_reply_concurrent_callers(edge, code_image):
    # Two workers, callers of two projects at the same time as the attacker's fake replies.
    edge.fncall.size = 2
    attack = FORGE + "spray('FORGED\\n')\nimport time\ntime.sleep(0.5)\nprint('A')\n"
    results = await asyncio.gather(
        *(call(edge, code=attack, project="mallory") for _ in range(3)),
        *(call(edge, code=f"print('V{i}')", project="alice") for i in range(6)),
    )
    assert [r.run.stdout for r in results[:3]] == ["A\n"] * 3
    assert [r.run.stdout for r in results[3:]] == [f"V{i}\n" for i in range(6)]


# A background spy: polls every scratch directory and every command line for a later
# call's secret, and sends what it finds out through every descriptor and as files in
# every directory it can write (where the next call looks).
SPY = r"""
def spy(seconds):
    import glob, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end = time.time() + seconds
    while time.time() < end:
        stolen = []
        for p in glob.glob("/fncall/*/*") + glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ"):
            try:
                data = open(p, "rb").read()
            except OSError:
                continue
            if b"SECRET-" in data and b"def spy" not in data:
                stolen.append(data[data.index(b"SECRET-"):][:40].decode(errors="replace"))
        if stolen:
            spray("STOLEN " + repr(stolen) + "\n")
            for d in ("/fncall", "/tmp", "/var/tmp", "/dev/shm", "/run", "/root", "/"):
                try:
                    open(f"{d}/stolen.txt", "w").write(repr(stolen))
                except OSError:
                    pass
        time.sleep(0.005)

def daemon(fn, *args):
    # Double fork and setsid, stdio on /dev/null (so the call itself ends at once).
    sys.stdout.flush()
    try:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                nul = os.open("/dev/null", os.O_RDWR)
                for i in range(3):
                    os.dup2(nul, i)
                try:
                    fn(*args)
                finally:
                    os._exit(0)
            os._exit(0)
    except OSError:  # at the process limit
        pass

def sleeper():
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    time.sleep(120)

def rabbit(seconds):
    # A new pid every few ms: one pass over /proc cannot catch it.
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end = time.time() + seconds
    while time.time() < end:
        try:
            if os.fork():
                os._exit(0)
        except OSError:
            pass
        time.sleep(0.002)
    spy(seconds)
"""

STORM = (
    FORGE
    + SPY
    + r"""
print(open("/proc/self/cgroup").read())
for _ in range(120):
    daemon(sleeper)
for _ in range(6):
    daemon(rabbit, 30)
for _ in range(3):
    daemon(spy, 30)
print("stormed")
"""
)

SCAN = r"""
import os
mine = {os.getpid(), os.getppid()}
others = []
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) not in mine:
        try:
            st = os.stat(f"/proc/{p}")
            cmd = open(f"/proc/{p}/cmdline", "rb").read()[:60]
        except OSError:
            continue
        if st.st_uid != 0:
            others.append((p, st.st_uid, cmd))
print("others", others)
"""


async def test_fork_storm_dies_with_the_call(fedge):
    r = await call(fedge, code=STORM, project="mallory")
    assert r.run.return_code == 0 and "stormed" in r.run.stdout, r.run
    assert "fncall-call-" in r.run.stdout  # the call ran in its own cgroup
    worker = r.worker
    await asyncio.sleep(0.3)  # the storm is well under way: daemons, rabbits, spies
    # Nothing of call 1 lives while call 2 runs: it can neither read call 2's secret
    # (in its code and on its command line) nor answer for it.
    secret = "SECRET-" + secrets.token_hex(8)
    victim = (
        f"import subprocess, time\nS = {secret!r}\n"
        f"subprocess.run(['sleep', '0.5', {secret!r}])\n"
        f"time.sleep(0.2)\nprint('own')\n"
    )
    r = await call(fedge, code=victim, project="mallory")
    assert (r.run.return_code, r.run.stdout) == (0, "own\n"), r.run
    assert r.worker == worker  # the same worker (its project's), cleaned, not replaced
    look = "import glob\nprint(glob.glob('/*/stolen.txt') + glob.glob('/stolen.txt'))\n"
    r = await call(fedge, code=SCAN + look, project="mallory")
    assert r.run.stdout == "others []\n[]\n", r.run
    # From the host: the worker's sandbox holds its init and the runner, nothing else.
    tree = fedge.cgroups.tracking_dir(fedge.sandboxes[worker].handle.id)
    procs = [p for f in tree.rglob("cgroup.procs") for p in f.read_text().split()]
    assert len(procs) == 2, procs
    assert not list(tree.rglob("fncall-call-*"))  # and every call's cgroup is gone


async def test_timed_out_call_leaves_nothing(fedge):
    code = STORM + "import time\ntime.sleep(60)\n"
    r = await call(fedge, code=code, run_timeout=1.0)
    assert r.run.status == "TimeLimitExceeded"
    r = await call(fedge, code=SCAN)
    assert r.run.stdout == "others []\n", r.run.stdout


async def test_projects_never_share_a_worker(fedge):
    marker = "MARK-" + secrets.token_hex(6)
    leave = (
        FORGE
        + SPY
        + f"M = {marker!r}\n"
        + r"""
import subprocess
written = []
for d, dirs, files in os.walk("/"):
    if d.startswith(("/proc", "/sys", os.getcwd())):
        dirs[:] = []
        continue
    if os.access(d, os.W_OK):
        try:
            open(f"{d}/{M}.txt", "w").write(M)
            written.append(d)
        except OSError:
            pass
print("written", written)
open(f"{M}.txt", "w").write(M)
subprocess.Popen(["setsid", "sleep", "300"])
subprocess.Popen(["python3", "-c", f"import time; M = {M!r}; time.sleep(300)"], start_new_session=True)
daemon(rabbit, 30)
"""
    )
    a = await call(fedge, code=leave, project="alice")
    assert a.run.return_code == 0, a.run
    assert a.run.stdout == "written []\n", a.run.stdout  # no directory but its scratch is writable
    b = await call(
        fedge,
        code=SCAN
        + f"M = {marker!r}\n"
        + r"""
found = []
for d, dirs, files in os.walk("/"):
    if d.startswith(("/proc", "/sys")):
        dirs[:] = []
        continue
    found += [f"{d}/{f}" for f in files if M in f]
print("found", found)
""",
        project="bob",
    )
    assert b.worker != a.worker  # a worker that served alice never serves bob
    assert b.run.stdout == "others []\nfound []\n", b.run.stdout
    # alice's own next call gets a worker of hers again (a fresh one: hers was retired for bob)
    a2 = await call(fedge, code="print('alice')", project="alice")
    assert a2.run.stdout == "alice\n" and a2.worker not in (a.worker, b.worker)


IPC_SCAN = r"""
left = []
for kind in ("shm", "sem", "msg"):
    left += [line for line in open(f"/proc/sysvipc/{kind}").read().splitlines()[1:] if line.strip()]
print("ipc", left)
"""


async def test_ipc_objects_do_not_outlive_the_call(fedge):
    # System V IPC objects outlive their processes: the next call of the same project on
    # the same worker must not find them (they could carry anything from call to call).
    make = "ipcmk -M 4096 && ipcmk -S 2 && ipcmk -Q\nfor p in /dev/mqueue/x /run/lock/x; do echo x > $p; done"
    r = await call(fedge, language="bash", code=make, project="alice")
    assert r.run.stdout.count(" id: ") == 3, r.run
    assert "Permission denied" in r.run.stderr  # nothing written in /dev/mqueue, /run/lock
    r2 = await call(fedge, code=IPC_SCAN, project="alice")
    assert r2.worker == r.worker and r2.run.stdout == "ipc []\n", r2.run


# --- the edge's side of the channel -----------------------------------------------------------


def _runner_channel(edge, worker_id: str) -> int:
    """A duplicate (in this test) of the runner's end of its control channel, taken with
    pidfd_getfd from the host: what a process that reached the channel could write."""
    w = next(w for ws in edge.fncall.workers.values() for w in ws if w.sandbox_id == worker_id)
    (host_pid,) = w.proc.group.procs()
    target = next(
        int(fd)
        for fd in os.listdir(f"/proc/{host_pid}/fd")
        if os.readlink(f"/proc/{host_pid}/fd/{fd}").startswith("socket:")
    )
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(host_pid)
    try:
        fd = libc.syscall(438, pidfd, target, 0)  # pidfd_getfd
        assert fd >= 0, os.strerror(ctypes.get_errno())
        return int(fd)
    finally:
        os.close(pidfd)


def _live(edge) -> set[str]:
    return {w.sandbox_id for ws in edge.fncall.workers.values() for w in ws}


async def _wait_replaced(edge, victim: str) -> None:
    for _ in range(300):
        if victim not in _live(edge) and len(_live(edge)) == edge.fncall.size:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"worker {victim} was not replaced: {_live(edge)}")


FAKE = json.dumps({"run": {"status": "Finished", "return_code": 0, "stdout": "INJECTED"}, "healthy": True})


async def test_unsolicited_bytes_retire_the_worker(fedge):
    r = await call(fedge, code="print(1)")
    fd = _runner_channel(fedge, r.worker)
    try:
        os.write(fd, FAKE.encode() + b"\n")  # with no call pending
    finally:
        os.close(fd)
    await asyncio.sleep(0.1)
    r2 = await call(fedge, code="print(2)")
    assert r2.run.stdout == "2\n" and r2.worker != r.worker
    await _wait_replaced(fedge, r.worker)


@pytest.mark.parametrize(
    "inject",
    [
        FAKE.encode() + b"\n",  # a whole line that does not carry the call's id
        b"junk-before-the-reply",  # bytes the real reply then follows
    ],
    ids=["wrong-id", "prefix"],
)
async def test_unexpected_bytes_during_a_call(fedge, inject):
    r = await call(fedge, code="print(1)")
    fd = _runner_channel(fedge, r.worker)
    try:
        task = asyncio.ensure_future(call(fedge, code="import time; time.sleep(0.6); print('real')"))
        await asyncio.sleep(0.3)
        os.write(fd, inject)
        r2 = await task
    finally:
        os.close(fd)
    assert "INJECTED" not in (r2.run.stdout or "")
    assert r2.run.status == "Error" and r2.worker == ""  # the call's worker was lost
    await _wait_replaced(fedge, r.worker)
    r3 = await call(fedge, code="print(3)")
    assert r3.run.stdout == "3\n"
