"""Memory checkpoints on a real edge: CRIU dumps a sandbox's processes, they continue
from their state in a new sandbox or in the same one, and what cannot be checkpointed
fails with a coded reason.

The CRIU it needs is installed by install.sh (ensure_criu); the `criu` fixture installs it
if missing and skips the tests when Debian's mirror cannot be reached."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from dsec import errors
from dsec.backends import criu as ckpt
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

CRIU_DATA = Path(os.environ.get("DSEC_TEST_CRIU_DATA", "/var/lib/dsec"))

# A process with state: a counter, 50 MiB of memory with a known checksum, a log it appends to.
COUNTER = r"""
import hashlib, os, sys, time
blob = bytearray(os.urandom(1 << 20)) * 50
digest = hashlib.sha256(blob).hexdigest()[:16]
n = 0
while True:
    n += 1
    with open("/tmp/count.log", "a") as f:
        f.write(f"{n} {os.getpid()} {hashlib.sha256(blob).hexdigest()[:16] if n % 20 == 0 else digest}\n")
    time.sleep(0.02)
"""


@pytest.fixture(scope="session")
def criu() -> Path:
    try:
        return ckpt.ensure_criu(CRIU_DATA)
    except errors.UnsupportedOperation as e:
        pytest.skip(f"CRIU unavailable: {e}")


# --- through the edge ---------------------------------------------------------------------


async def checkpoint_sandbox(edge, sid: str, *, leave_running: bool):
    c = await edge.checkpoint(sid, leave_running=leave_running)
    return c, edge._checkpoint_dir(c.id)


async def restore_new(edge, cid: str) -> str:
    info = await edge.restore(cid)
    assert info.spec.labels["dsec.restored-from"] == cid
    return info.id


async def restore_in_place(edge, sid: str, cid: str) -> None:
    await edge.restore(cid, sandbox_id=sid)


# --- helpers ---------------------------------------------------------------------------


async def start_counter(edge, sid: str) -> None:
    await edge.write_file(sid, "/tmp/counter.py", COUNTER.encode())
    r = await edge.exec(sid, ExecRequest(cmd="nohup python3 /tmp/counter.py > /tmp/out.log 2>&1 &"))
    assert r.exit_code == 0, r
    await wait_lines(edge, sid, 5)


def lines(edge, sid: str) -> list[tuple[int, int, str]]:
    out = []
    for ln in edge.sandboxes[sid].files.read("/tmp/count.log").decode().splitlines():
        n, pid, digest = ln.split()
        out.append((int(n), int(pid), digest))
    return out


async def wait_lines(edge, sid: str, at_least: int, timeout: float = 20.0) -> list[tuple[int, int, str]]:
    end = time.monotonic() + timeout
    while True:
        try:
            got = lines(edge, sid)
        except errors.DsecError:
            got = []
        if len(got) >= at_least or time.monotonic() > end:
            return got
        await asyncio.sleep(0.05)


def assert_continuous(log: list[tuple[int, int, str]]) -> None:
    """One process counted 1, 2, 3, ... without a restart, its memory unchanged."""
    assert [n for n, _, _ in log] == list(range(1, len(log) + 1)), log[:3]
    assert len({pid for _, pid, _ in log}) == 1
    assert len({d for _, _, d in log}) == 1


def sandbox_procs(edge, sid: str) -> list[int]:
    """Every process in the sandbox's tracking cgroup and below (host pids)."""
    out = []
    for d, _, _ in os.walk(edge.cgroups.tracking_dir(sid)):
        with open(os.path.join(d, "cgroup.procs")) as f:
            out += [int(x) for x in f.read().split()]
    return out


def counter_procs(edge, sid: str) -> list[int]:
    out = []
    for pid in sandbox_procs(edge, sid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"counter.py" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


# --- tests -----------------------------------------------------------------------------


async def test_checkpoint_and_restore_into_a_new_sandbox(edge, criu, tmp_path):
    spec = SandboxSpec(image="python", memory_mb=512)
    src = await edge.create(spec)
    await start_counter(edge, src.id)
    t0 = time.perf_counter()
    info, dest = await checkpoint_sandbox(edge, src.id, leave_running=True)
    dump_ms = (time.perf_counter() - t0) * 1000
    assert len(info.trees) == 1 and "counter.py" in info.trees[0].cmdline
    assert info.size_bytes > 50 << 20
    at_checkpoint = [ln for ln in (dest / "fs" / "tmp" / "count.log").read_text().splitlines() if ln]
    n0 = len(at_checkpoint)
    # the source keeps running
    await wait_lines(edge, src.id, n0 + 5)
    assert len(lines(edge, src.id)) >= n0 + 5

    t0 = time.perf_counter()
    new_id = await restore_new(edge, info.id)
    restore_ms = (time.perf_counter() - t0) * 1000
    assert edge.sandboxes[new_id].record.spec.memory_mb == spec.memory_mb
    log = await wait_lines(edge, new_id, n0 + 10)
    assert len(log) >= n0 + 10, log[-3:]
    assert_continuous(log)  # continued at n0 + 1, same pid, same 50 MiB
    assert log[0][1] == info.trees[0].root
    # it runs in the new sandbox: its cgroups, its limits, its memory charge
    procs = counter_procs(edge, new_id)
    assert len(procs) == 1
    assert (edge.cgroups.memory_bytes(new_id) or 0) > 50 << 20
    with open(f"/proc/{procs[0]}/status") as f:
        status = f.read()
    assert "Seccomp:\t2" in status and "NoNewPrivs:\t1" in status
    assert os.readlink(f"/proc/{procs[0]}/ns/user") == os.readlink(
        f"/proc/{edge.sandboxes[new_id].handle.pid}/ns/user"
    )
    # ...and an ordinary exec there sees it
    r = await edge.exec(new_id, ExecRequest(cmd="pgrep -f '^python3 /tmp/counter'"))
    assert r.stdout.split() == [str(info.trees[0].root)], r
    print(
        f"\ncheckpoint of a 50 MiB process: dump {dump_ms:.0f} ms ({info.timings_ms}), "
        f"restore into a new sandbox {restore_ms:.0f} ms (incl. create)"
    )

    # a second restore from the same checkpoint works too (a memory fork)
    other = await restore_new(edge, info.id)
    log2 = await wait_lines(edge, other, n0 + 5)
    assert_continuous(log2)
    assert [c.id for c in edge.list_checkpoints()] == [info.id]
    assert edge.list_checkpoints({"another-project"}) == []
    with pytest.raises(errors.Conflict):  # its files are stacked under the restored sandboxes
        edge.delete_checkpoint(info.id)
    await edge.stop(other)
    await edge.stop(new_id)
    edge.delete_checkpoint(info.id)
    assert not dest.exists()
    with pytest.raises(errors.CheckpointNotFound):
        await edge.restore(info.id)


async def test_checkpoint_and_restore_in_place(edge, criu, tmp_path):
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512))
    await start_counter(edge, sb.id)
    info, dest = await checkpoint_sandbox(edge, sb.id, leave_running=False)
    await asyncio.sleep(0.2)
    assert counter_procs(edge, sb.id) == []  # the processes are gone, memory freed
    n0 = len(lines(edge, sb.id))
    await asyncio.sleep(0.3)
    assert len(lines(edge, sb.id)) == n0
    t0 = time.perf_counter()
    await restore_in_place(edge, sb.id, info.id)
    restore_ms = (time.perf_counter() - t0) * 1000
    log = await wait_lines(edge, sb.id, n0 + 10)
    assert_continuous(log)
    print(f"\nin-place restore of a 50 MiB process: {restore_ms:.0f} ms; dump {info.timings_ms}")
    # the sandbox still works normally
    r = await edge.exec(sb.id, ExecRequest(cmd="echo ok"))
    assert r.stdout == "ok\n"
    # restoring again while the process runs: its pid is taken
    with pytest.raises(errors.UnsupportedOperation) as e:
        await ckpt.restore(
            edge.sandboxes[sb.id].handle, dest, criu=criu, cgroups=edge.cgroups, group_name="dsec-xtest-1"
        )
    assert e.value.details["reason"] == "pid_in_use"


async def test_listening_server_survives_restore(edge, criu, tmp_path):
    spec = SandboxSpec(image="python", memory_mb=256)
    src = await edge.create(spec)
    await edge.write_file(
        src.id,
        "/tmp/srv.py",
        b"import http.server, socketserver\n"
        b"hits = 0\n"
        b"class H(http.server.BaseHTTPRequestHandler):\n"
        b"    def do_GET(self):\n"
        b"        global hits\n"
        b"        hits += 1\n"
        b"        body = str(hits).encode()\n"
        b"        self.send_response(200); self.send_header('Content-Length', str(len(body)))\n"
        b"        self.end_headers(); self.wfile.write(body)\n"
        b"    def log_message(self, *a): pass\n"
        b"http.server.HTTPServer(('127.0.0.1', 8080), H).serve_forever()\n",
    )
    await edge.exec(src.id, ExecRequest(cmd="nohup python3 /tmp/srv.py >/dev/null 2>&1 &"))
    get = (
        "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8080').read().decode())\""
    )
    for _ in range(100):
        r = await edge.exec(src.id, ExecRequest(cmd=get))
        if r.exit_code == 0:
            break
        await asyncio.sleep(0.05)
    assert r.stdout.strip() == "1", r
    info, _ = await checkpoint_sandbox(edge, src.id, leave_running=False)
    new_id = await restore_new(edge, info.id)
    r = await edge.exec(new_id, ExecRequest(cmd=get))
    assert r.stdout.strip() == "2", r  # the server's state came along
    await edge.stop(new_id)


async def test_what_cannot_be_checkpointed_fails_clearly(edge, criu, tmp_path):
    sb = await edge.create(SandboxSpec(image="python"))
    # nothing running: nothing to checkpoint
    with pytest.raises(errors.UnsupportedOperation) as e:
        await checkpoint_sandbox(edge, sb.id, leave_running=True)
    assert e.value.details["reason"] == "no_processes"
    assert edge.list_checkpoints() == []  # nothing left behind
    # a running exec is attached to the edge by its pipes
    task = asyncio.create_task(edge.exec(sb.id, ExecRequest(cmd="sleep 30", timeout=60)))
    for _ in range(100):
        if sandbox_procs(edge, sb.id)[1:]:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    with pytest.raises(errors.UnsupportedOperation) as e:
        await checkpoint_sandbox(edge, sb.id, leave_running=True)
    assert e.value.details["reason"] == "attached_process"
    assert "sleep 30" in e.value.message and "nohup" in e.value.message
    assert edge.list_checkpoints() == []
    task.cancel()
    with pytest.raises(BaseException):  # noqa: B017 - the exec was cancelled mid-run
        await task
    await ckpt.kill_user_processes(edge.cgroups, sb.id)
    # an established TCP connection (between two processes of the sandbox)
    await edge.write_file(
        sb.id,
        "/tmp/tcp.py",
        b"import socket, time\n"
        b"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        b"s.bind(('127.0.0.1', 9000)); s.listen()\n"
        b"c = socket.create_connection(('127.0.0.1', 9000)); a, _ = s.accept()\n"
        b"open('/tmp/tcp.ready', 'w').close()\n"
        b"time.sleep(600)\n",
    )
    await edge.exec(sb.id, ExecRequest(cmd="nohup python3 /tmp/tcp.py >/tmp/tcp.log 2>&1 &"))
    for _ in range(200):
        r = await edge.exec(sb.id, ExecRequest(cmd="test -e /tmp/tcp.ready"))
        if r.exit_code == 0:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(errors.UnsupportedOperation) as e:
        await checkpoint_sandbox(edge, sb.id, leave_running=True)
    assert e.value.details["reason"] == "tcp_connection", e.value.message
    # a failed checkpoint leaves the processes running
    r = await edge.exec(sb.id, ExecRequest(cmd="pgrep -f tcp.py"))
    assert r.exit_code == 0
    with open(f"/proc/{counter_or(edge, sb.id, b'tcp.py')}/status") as f:
        assert "State:\tS" in f.read()


def counter_or(edge, sid: str, needle: bytes) -> int:
    for pid in sandbox_procs(edge, sid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    return pid
        except OSError:
            pass
    raise AssertionError(f"no process matching {needle!r}")


async def test_no_criu_is_a_clear_error(tmp_path):
    with pytest.raises(errors.UnsupportedOperation) as e:
        ckpt.find_criu(tmp_path)
    assert e.value.details["reason"] == "criu_unavailable"
    assert "pause()" in e.value.message
