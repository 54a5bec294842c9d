"""Snapshots, forks, pause and resume through the SDK against a real `dsec up`."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest

from dsec import errors
from dsec.client import AsyncClient, Client
from dsec.models import SandboxState

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def test_snapshot_restore_fork_pause(service):
    with Client() as c:
        sb = c.create("python")
        sb.exec("mkdir -p /work/env /work/ref && echo ready > /work/env/flag && echo answer > /work/ref/gold")
        snap = sb.snapshot(scrub=["/work/ref"])
        assert snap.scrubbed == ["/work/ref"]
        restored = c.create(snapshot=snap.id)
        assert restored.exec("cat /work/env/flag; ls /work/ref 2>&1 || true").stdout.startswith("ready\n")
        assert "No such file" in restored.exec("ls /work/ref").stderr
        assert snap.id in {s["name"] for s in c.snapshots()}
        # what snapshot() returned restores as well as its id
        again = c.create(snapshot=snap)
        assert again.exec("cat /work/env/flag").stdout == "ready\n"
        again.stop()
        with pytest.raises(errors.InvalidRequest, match="snapshot= takes"):
            c.create(snapshot=3.5)  # type: ignore[arg-type]

        kids = sb.fork(3)
        assert len(kids) == 3
        kids[0].exec("echo changed > /work/env/flag")
        assert kids[1].exec("cat /work/env/flag").stdout == "ready\n"
        assert sb.exec("cat /work/env/flag").stdout == "ready\n"

        info = sb.pause()
        assert info.state is SandboxState.PAUSED
        assert sb.refresh().state is SandboxState.PAUSED
        assert sb.exec("echo awake").stdout == "awake\n"  # resumes transparently
        assert sb.refresh().state is SandboxState.RUNNING

        for x in (*kids, restored, sb):
            x.stop()
        c.delete_snapshot(snap.id)
        with pytest.raises(errors.ImageNotFound):
            c.delete_snapshot(snap.id)


def test_pause_project_and_fork_quota(service):
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as http:
        assert (
            http.post("/v1/projects", json={"name": "pre", "quota": {"max_sandboxes": 3}}).status_code == 200
        )
        tok = http.post("/v1/principals", json={"name": "pre-user", "projects": ["pre"]}).json()["token"]

    async def go():
        async with AsyncClient(service.url, tok) as ac:
            a = await ac.create("python", project="pre")
            b = await ac.create("python", project="pre")
            paused = await ac.pause_project("pre")
            assert sorted(paused) == sorted([a.id, b.id])
            assert (await a.refresh()).state is SandboxState.PAUSED
            with pytest.raises(errors.QuotaExceeded):
                await a.fork(2)  # 2 live + 2 > 3
            (kid,) = await a.fork(1)
            assert (await kid.exec("echo hi")).stdout == "hi\n"
            with pytest.raises(errors.Forbidden):
                await ac.pause_project("default")
            await asyncio.gather(a.stop(), b.stop(), kid.stop())

    asyncio.run(go())


def test_checkpoint_and_restore_through_the_sdk(service):
    from dsec.backends.criu import ensure_criu

    try:
        ensure_criu(Path("/var/lib/dsec"))  # what install.sh does
    except errors.UnsupportedOperation as e:
        pytest.skip(f"CRIU unavailable: {e}")
    counter = "i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.05; done"
    with Client() as c:
        sb = c.create("python", memory_mb=256)
        # an attached exec cannot be checkpointed: the error says what to do instead
        sb.exec(f"nohup sh -c '{counter}' > /dev/null 2>&1 &")
        time.sleep(0.3)
        ck = sb.checkpoint()
        assert ck.sandbox == sb.id and len(ck.trees) == 1 and "sh -c" in ck.trees[0].cmdline
        assert [x.id for x in c.checkpoints()] == [ck.id]
        at = int(sb.files.read("/tmp/n"))
        restored = c.restore(ck.id, labels={"k": "v"})
        assert restored.info.spec.labels["k"] == "v"
        time.sleep(0.3)
        n = int(restored.files.read("/tmp/n"))
        assert n > at  # counting on in the new sandbox, from where it was (the file came along)
        assert restored.exec("pgrep -f 'while true'").exit_code == 0
        # into a running sandbox: its processes are replaced by the checkpoint's
        other = c.create("python", memory_mb=256)
        again = c.restore(ck.id, sandbox_id=other.id)
        assert again.id == other.id
        time.sleep(0.2)
        assert other.exec("pgrep -f 'while true'").exit_code == 0
        with pytest.raises(errors.Conflict):
            c.delete_checkpoint(ck.id)  # files stacked under the restored sandbox
        with pytest.raises(errors.CheckpointNotFound):
            c.restore("nope-ckpt-000000000000")
        for x in (sb, restored, other):
            x.stop()
        c.delete_checkpoint(ck.id)
        assert c.checkpoints() == []


def test_snapshots_count_against_quota(service):
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as http:
        quota = {"max_snapshots": 2, "max_snapshot_mb": 3}
        assert http.post("/v1/projects", json={"name": "snapq", "quota": quota}).status_code == 200
        tok = http.post("/v1/principals", json={"name": "snapq-user", "projects": ["snapq"]}).json()["token"]
    with Client(service.url, tok) as c:
        sb = c.create("python", project="snapq")
        sb.exec("mkdir -p /work && head -c 5000000 /dev/urandom > /work/big")
        with pytest.raises(errors.QuotaExceeded) as exc:
            sb.snapshot()  # ~5 MiB > 3 MiB
        assert "max_snapshot_mb" in exc.value.message
        assert c.snapshots() == []  # refused snapshots are not kept
        sb.exec("rm /work/big")
        first = sb.snapshot()
        second = sb.snapshot()
        with pytest.raises(errors.QuotaExceeded) as exc:
            sb.snapshot()  # a third: over max_snapshots
        assert "max_snapshots" in exc.value.message
        assert sorted(s["name"] for s in c.snapshots()) == sorted([first.id, second.id])
        c.delete_snapshot(first.id)  # gives the slot back
        third = sb.snapshot()
        for s in (second, third):
            c.delete_snapshot(s.id)
        with Client(service.url, service.token) as admin:
            other = admin.create("python")
            mine = sb.snapshot()
            with pytest.raises(errors.ImageNotFound):  # a snapshot restores only in its project
                admin.create(snapshot=mine.id)
            other.stop()
            c.delete_snapshot(mine.id)
        sb.stop()


def test_protect_and_verify_through_the_sdk(service):
    with Client() as c:
        sb = c.create("python")
        sb.files.write("/grader/test.sh", "echo graded $(cat /work/out)")
        assert sb.protect(["/grader"]) == ["/grader"]
        sb.exec("echo 7 > /work/out")
        assert sb.exec("cat /grader/test.sh").exit_code != 0
        r = sb.verify("sh /grader/test.sh")
        assert r.stdout == "graded 7\n" and r.seq is not None
        with pytest.raises(errors.InvalidRequest):
            sb.protect(["relative/path"])
        # a grader the platform cannot run (its vault copy lost on the node) is an error the
        # SDK raises, never an ExecResult with an exit code a trainer would score
        shutil.rmtree(next(service.data_dir.glob(f"**/vault/{sb.id}")) / "t0")
        with pytest.raises(errors.GraderUnavailable):
            sb.verify("sh /grader/test.sh")
        sb.stop()


def test_network_policy_through_the_sdk(service):
    with Client() as c:
        sb = c.create("python", network={"allow": []})  # attached, nothing allowed
        r = sb.exec("python3 -c \"import socket; socket.create_connection(('192.0.2.1', 80), timeout=1)\"")
        assert r.exit_code != 0  # denied at once (rejected), no route out
        assert r.misbehaviour.get("denied_connections", 0) >= 1  # in the result and the trajectory
        net = sb.set_network({"allow": [{"to": "192.0.2.0/24", "ports": [80, "8000-8100"]}]})
        assert net["policy"]["allow"][0]["to"] == "192.0.2.0/24"
        assert net["counters"]["denied_packets"] >= 1
        assert sb.refresh().telemetry["denied_connections"] >= 1  # on the sandbox's status too
        with pytest.raises(errors.InvalidRequest):
            sb.set_network({"allow": [{"to": "not a host!"}]})
        assert sb.set_network(None)["policy"] is None
        assert sb.network()["policy"] is None
        sb.stop()


def test_misbehaviour_reaches_metrics(service):
    with Client() as c:
        sb = c.create("python", memory_mb=64)
        assert sb.exec("sleep 5", timeout=0.2).timed_out
        r = sb.exec("python3 -c 'b = bytearray(200 << 20)'")
        assert r.misbehaviour.get("oom_kills", 0) >= 1
        t = sb.refresh().telemetry
        assert t["timeouts"] == 1 and t["oom_kills"] >= 1
        sb.stop()
    text = httpx.get(service.url + "/metrics", headers={"Authorization": f"Bearer {service.token}"}).text
    assert 'dsec_misbehaviour_total{kind="timeouts"}' in text
    assert 'dsec_misbehaviour_total{kind="oom_kills"}' in text
