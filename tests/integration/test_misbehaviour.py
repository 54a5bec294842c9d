"""Limits a sandbox runs into, and how they are reported (issue #6): disk quota (bytes and
inodes) gives ENOSPC inside and never fills the node; OOM kills, pids-limit hits, timeouts,
truncated output and a full disk are counted per call (in the result and the trajectory), on
the sandbox (GET) and in metrics; a sandbox that dies is `failed` with a reason and a
distinct error code."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest

from dsec import errors
from dsec.backends.base import Capability
from dsec.models import ExecRequest, SandboxSpec, SandboxState
from tests.conftest import require

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def test_disk_quota_bytes_and_inodes_give_enospc_inside(edge, backend):
    free_before = shutil.disk_usage("/").free
    sb = await edge.create(SandboxSpec(image="python", backend=backend, disk_mb=8, disk_inodes=2048))
    if backend == "microvm":  # its first sandbox of this shape saved a template VM: not the sandbox's
        free_before = shutil.disk_usage("/").free
    r = await edge.exec(sb.id, ExecRequest(cmd="head -c 200000000 /dev/zero > /work/big; echo rc=$?"))
    assert "rc=1" in r.stdout and "No space left on device" in r.stderr
    assert r.exit_code == 0 and r.misbehaviour == {"disk_full": 1}  # the shell went on: still counted
    await edge.exec(sb.id, ExecRequest(cmd="rm /work/big"))
    r = await edge.exec(sb.id, ExecRequest(cmd="head -c 200000000 /dev/zero > /work/big2"))
    assert r.exit_code != 0 and r.misbehaviour.get("disk_full") == 1
    # 400 MB asked for, 8 MB allowed: the node's disk did not take them (what else writes to
    # it meanwhile, other tests on a loaded host, stays well under the margin)
    assert free_before - shutil.disk_usage("/").free < 150_000_000
    await edge.exec(sb.id, ExecRequest(cmd="rm -f /work/big /work/big2"))
    r = await edge.exec(
        sb.id,
        ExecRequest(cmd="mkdir -p /work/many && cd /work/many && for i in $(seq 4000); do : > f$i; done"),
    )
    assert r.exit_code != 0 and "No space left on device" in r.stderr
    assert r.misbehaviour.get("disk_full") == 1  # out of inodes this time
    t = edge.get(sb.id).telemetry
    assert t["disk_full"] >= 1 and 1500 < t["disk_used_inodes"] <= 2048


async def test_oom_pids_timeouts_and_truncation_are_counted(edge, backend):
    require(edge, backend, Capability.TELEMETRY)
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=64, pids=32))
    r = await edge.exec(sb.id, ExecRequest(cmd="python3 -c 'b = bytearray(200 << 20); print(len(b))'"))
    assert r.exit_code == 137 and r.misbehaviour.get("oom_kills", 0) >= 1
    r = await edge.exec(
        sb.id, ExecRequest(cmd="for i in $(seq 100); do sleep 0.3 & done 2>/dev/null; wait", timeout=10)
    )
    assert r.misbehaviour.get("pids_limit_hits", 0) >= 1, r
    await asyncio.sleep(0.5)  # the sleeps that did start hold the pids until they end
    r = await edge.exec(sb.id, ExecRequest(cmd="sleep 5", timeout=0.2))
    assert r.timed_out
    r = await edge.exec(sb.id, ExecRequest(cmd="yes | head -c 1000000", max_output_bytes=1000))
    assert r.truncated and len(r.stdout) <= 1000
    t = edge.get(sb.id).telemetry
    assert t["oom_kills"] >= 1 and t["pids_limit_hits"] >= 1
    assert t["timeouts"] == 1 and t["output_truncated"] == 1
    # the trajectory keeps what the call saw
    entries = (await edge.trajectory(sb.id))["entries"]
    assert any((e.get("observation") or {}).get("misbehaviour", {}).get("oom_kills") for e in entries)


CATCH_EAGAIN = """
import os, sys, time
kids, refused = [], 0
for _ in range(64):
    try:
        pid = os.fork()
    except BlockingIOError:
        refused += 1
        continue
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
print(refused)
"""


async def test_refused_forks_are_counted_when_the_program_carries_on_and_exits_0(edge, backend):
    require(edge, backend, Capability.TELEMETRY)
    sb = await edge.create(SandboxSpec(image="python", backend=backend, pids=16))
    r = await edge.exec(sb.id, ExecRequest(cmd=["python3", "-c", CATCH_EAGAIN], timeout=30))
    assert r.exit_code == 0 and int(r.stdout) > 0, r
    assert r.misbehaviour.get("pids_limit_hits", 0) >= 1, r
    assert edge.get(sb.id).telemetry["pids_limit_hits"] >= 1
    r = await edge.exec(sb.id, ExecRequest(cmd="true"))  # a later, well-behaved call: nothing
    assert r.misbehaviour.get("pids_limit_hits", 0) == 0, r
    await edge.stop(sb.id)


async def test_a_sandbox_that_dies_is_failed_with_a_reason(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    os.kill(edge.sandboxes[sb.id].handle.pid, signal.SIGKILL)  # its runtime dies under it
    for _ in range(200):
        if sb.id not in edge.sandboxes:
            break
        await asyncio.sleep(0.01)
    info = edge.get(sb.id)
    assert info.state is SandboxState.FAILED and "SIGKILL" in (info.reason or "")
    with pytest.raises(errors.SandboxFailed) as e:
        await edge.exec(sb.id, ExecRequest(cmd="true"))
    assert e.value.status == 410 and e.value.code == "sandbox_failed"
    assert "environment failure" in e.value.message
    await edge.stop(sb.id)  # acknowledging it forgets it
    with pytest.raises(errors.SandboxNotFound):
        edge.get(sb.id)
    # and nothing of it stays on the host (on gvisor its sentry and gofer outlived the keeper)
    for _ in range(500):
        if not any(d.exists() for d in edge.cgroups.sandbox_dirs(sb.id)):
            break
        await asyncio.sleep(0.01)
    assert not [d for d in edge.cgroups.sandbox_dirs(sb.id) if d.exists()]


async def test_protected_paths_are_out_of_reach_until_verification(edge, backend):
    require(edge, backend, Capability.TRUSTED_EXEC)
    # A grader written into the image-like filesystem, then protected at create time.
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    await edge.exec(
        sb.id,
        ExecRequest(cmd="mkdir -p /grader && echo 'ANSWER=42' > /grader/key && echo s > /work/solution"),
    )
    assert await edge.protect(sb.id, ["/grader"]) == ["/grader"]
    # the agent, root inside, with every trick: nothing there to read
    r = await edge.exec(
        sb.id,
        ExecRequest(cmd="cat /grader/key; ls -a /grader; grep -r ANSWER= / --include=key 2>/dev/null; true"),
    )
    assert "ANSWER" not in r.stdout and "No such file" in r.stderr
    with pytest.raises(errors.FileNotFound):
        await edge.read_file(sb.id, "/grader/key")
    # a lurking agent process that waits for the grader to appear
    await edge.exec(
        sb.id,
        ExecRequest(
            cmd="nohup sh -c 'while :; do cat /grader/key >> /tmp/stolen 2>/dev/null; sleep 0.005; done' "
            ">/dev/null 2>&1 &"
        ),
    )
    # the grader sees the task directory (/work) as the agent left it
    r = await edge.verify(sb.id, ExecRequest(cmd="cat /grader/key; cat /work/solution"))
    assert r.stdout == "ANSWER=42\ns\n"
    # the lurker was gone before the grader came back, and the grader is gone again
    r = await edge.exec(
        sb.id, ExecRequest(cmd="cat /tmp/stolen 2>/dev/null; test -e /grader/key && echo still")
    )
    assert "ANSWER" not in r.stdout and "still" not in r.stdout
    # verification can run again (graders stay in the vault until the sandbox stops)
    assert (await edge.verify(sb.id, ExecRequest(cmd="cat /grader/key"))).stdout == "ANSWER=42\n"
    vault = edge._vault(sb.id)
    assert vault.exists()
    await edge.stop(sb.id)
    assert not vault.exists()


async def test_protected_paths_at_create(edge, backend):
    require(edge, backend, Capability.TRUSTED_EXEC)
    with pytest.raises(errors.FileNotFound):
        await edge.create(SandboxSpec(image="python", backend=backend, protected_paths=["/no/such/grader"]))
    sb = await edge.create(SandboxSpec(image="python", backend=backend, protected_paths=["/etc/os-release"]))
    r = await edge.exec(sb.id, ExecRequest(cmd="cat /etc/os-release"))
    assert r.exit_code != 0
    r = await edge.verify(sb.id, ExecRequest(cmd="grep -c Debian /etc/os-release"))
    assert r.stdout.strip() != "0"
    await edge.stop(sb.id)


async def test_output_floods_are_capped_everywhere(edge, backend):
    from dsec.models import SessionCreate, SessionKind, SessionRun

    cap = 4096
    sb = await edge.create(SandboxSpec(image="python", backend=backend, max_output_bytes=cap))
    r = await edge.exec(sb.id, ExecRequest(cmd="yes", timeout=1))  # asks for the default 1 MiB
    assert r.truncated and len(r.stdout) <= cap and len(r.stderr) <= cap
    for kind, code in (
        (SessionKind.BASH, "yes | head -c 50000000"),
        (SessionKind.PYTHON, "for i in range(200000): print('y' * 100)"),
        (SessionKind.PYTHON, "import sys; sys.stderr.write('e' * 50_000_000); 'x' * 50_000_000"),
    ):
        if Capability.SESSIONS not in edge.backends[backend].capabilities:
            break
        s = await edge.session_create(sb.id, SessionCreate(kind=kind))
        res = await edge.session_run(sb.id, s.id, SessionRun(code=code, timeout=60))
        assert res.truncated, (kind, code)
        assert len(res.output) <= cap and len(res.stderr) <= cap
        ok = await edge.session_run(
            sb.id, s.id, SessionRun(code="print(1)" if kind == "python" else "echo 1")
        )
        assert ok.output == "1\n"  # the session survived the flood
    entries = (await edge.trajectory(sb.id))["entries"]
    for e in entries:  # nothing bigger than the cap was logged either
        obs = e.get("observation") or {}
        assert all(len(obs.get(k) or "") <= cap for k in ("stdout", "stderr", "output"))


async def test_bash_session_output_just_past_the_cap(edge, backend):
    require(edge, backend, Capability.SESSIONS)
    from dsec.models import SessionCreate, SessionKind, SessionRun

    cap = 1000
    sb = await edge.create(SandboxSpec(image="python", backend=backend, max_output_bytes=cap))
    s = await edge.session_create(sb.id, SessionCreate(kind=SessionKind.BASH))
    for extra in (0, 1, 10, 30, 60, 100, 5000):  # the end marker lands in the buffer, across, in the tail
        res = await edge.session_run(
            sb.id, s.id, SessionRun(code=f"yes a | tr -d '\\n' | head -c {cap + extra}; false", timeout=10)
        )
        assert not res.timed_out and res.exit_code == 1, (extra, res)
        assert res.output == "a" * min(cap, cap + extra) and res.truncated == (extra > 0), extra


async def test_denied_syscalls_are_counted_per_call_and_sandbox(edge, backend):
    require(edge, backend, Capability.TELEMETRY)
    a = await edge.create(SandboxSpec(image="python", backend=backend))
    b = await edge.create(SandboxSpec(image="python", backend=backend))
    # Tools that exit right after their refused call: attributed by the sandbox's audit session.
    r = await edge.exec(a.id, ExecRequest(cmd="unshare -U true; mount -t tmpfs x /mnt; true"))
    assert r.exit_code == 0 and r.misbehaviour.get("denied_syscalls", 0) >= 2, r
    # A process that keeps running after its refused calls (an agent's interpreter, say).
    probe = (
        "import ctypes, time\nlibc = ctypes.CDLL(None)\n"
        "libc.unshare(0x10000000); libc.mount(b'x', b'/mnt', b'tmpfs', 0, None); time.sleep(0.2)\n"
    )
    r = await edge.exec(a.id, ExecRequest(cmd=["python3", "-c", probe]))
    assert r.exit_code == 0 and r.misbehaviour.get("denied_syscalls", 0) >= 2, r
    r = await edge.exec(a.id, ExecRequest(cmd="true"))
    assert "denied_syscalls" not in r.misbehaviour
    assert edge.get(a.id).telemetry["denied_syscalls"] >= 4
    assert edge.get(b.id).telemetry["denied_syscalls"] == 0  # attributed to the right sandbox
