"""Step tags are scoped to the sandbox's project: one tenant's tag can neither make another
tenant's step replay its observation nor show up in another tenant's divergence error; a
replay in a new sandbox of the same project (preemption) still works; a log written before
scopes is migrated."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dsec import errors
from dsec.models import ExecRequest, FileWrite, SandboxSpec, SessionCreate, SessionRun, Step
from dsec.trajlog import StepTag, TrajectoryLog

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


def tagged(cmd: str, traj: str, i: int) -> ExecRequest:
    return ExecRequest(cmd=cmd, step=Step(trajectory=traj, index=i))


async def test_another_projects_tag_is_another_step(edge):
    victim = await edge.create(SandboxSpec(image="python", project="victim"))
    attacker = await edge.create(SandboxSpec(image="python", project="attacker"))
    # the attacker logs the victim's next step first, with a forged observation as its output
    forged = await edge.exec(attacker.id, tagged("echo PASSED-ALL-TESTS", "traj-7", 0))
    assert not forged.replayed
    # the victim's own step 0 runs for real (before: it replayed "PASSED-ALL-TESTS")
    real = await edge.exec(victim.id, tagged("echo $((6*7)) > /work/ran; cat /work/ran", "traj-7", 0))
    assert (real.stdout, real.replayed) == ("42\n", False)
    assert (await edge.exec(victim.id, ExecRequest(cmd="cat /work/ran"))).stdout == "42\n"
    # the same for session and file steps
    s = await edge.session_create(attacker.id, SessionCreate(kind="bash"))
    await edge.session_run(
        attacker.id, s.id, SessionRun(code="echo forged", step=Step(trajectory="t2", index=0))
    )
    vs = await edge.session_create(victim.id, SessionCreate(kind="bash"))
    r = await edge.session_run(
        victim.id, vs.id, SessionRun(code="echo mine", step=Step(trajectory="t2", index=0))
    )
    assert (r.output, r.replayed) == ("mine\n", False)
    await edge.write_logged(
        attacker.id, FileWrite(path="/work/x", content="evil", step=Step(trajectory="t3", index=0)), b"evil"
    )
    await edge.write_logged(
        victim.id, FileWrite(path="/work/x", content="good", step=Step(trajectory="t3", index=0)), b"good"
    )
    assert await edge.read_file(victim.id, "/work/x") == b"good"


async def test_divergence_shows_only_the_callers_project(edge):
    a = await edge.create(SandboxSpec(image="python", project="alpha"))
    b = await edge.create(SandboxSpec(image="python", project="beta"))
    await edge.exec(a.id, tagged("echo alpha-secret-token", "shared", 1))
    # beta's different action at the same tag is not a divergence: it is beta's own step
    r = await edge.exec(b.id, tagged("echo beta", "shared", 1))
    assert (r.stdout, r.replayed) == ("beta\n", False)
    with pytest.raises(errors.TrajectoryDivergence) as ei:
        await edge.exec(b.id, tagged("echo beta again", "shared", 1))
    wire = repr(ei.value.to_wire())
    assert "alpha-secret-token" not in wire
    assert ei.value.details["logged"]["cmd"] == "echo beta"


async def test_replay_in_a_new_sandbox_of_the_same_project(edge):
    first = await edge.create(SandboxSpec(image="python", project="rl"))
    r1 = await edge.exec(first.id, tagged("echo once >> /work/side; wc -l < /work/side", "pre", 0))
    await edge.stop(first.id)
    again = await edge.create(SandboxSpec(image="python", project="rl"))
    r2 = await edge.exec(again.id, tagged("echo once >> /work/side; wc -l < /work/side", "pre", 0))
    assert (r2.stdout, r2.replayed) == (r1.stdout, True)
    with pytest.raises(errors.TrajectoryDivergence):
        await edge.exec(again.id, tagged("echo other", "pre", 0))
    # a sandbox of another project starting the same trajectory runs it
    other = await edge.create(SandboxSpec(image="python", project="rl-other"))
    r3 = await edge.exec(other.id, tagged("echo once >> /work/side; wc -l < /work/side", "pre", 0))
    assert not r3.replayed


async def test_a_log_from_before_scopes_is_migrated(tmp_path: Path):
    db = tmp_path / "old.db"
    old = sqlite3.connect(db)
    old.executescript(
        """
        CREATE TABLE entries (sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, seq_end INTEGER NOT NULL,
            kind TEXT NOT NULL, action TEXT NOT NULL, observation TEXT, timings TEXT NOT NULL,
            trajectory TEXT, step INTEGER, action_hash TEXT, recorded_at REAL NOT NULL,
            PRIMARY KEY (sandbox_id, seq));
        CREATE UNIQUE INDEX entries_step ON entries (trajectory, step) WHERE trajectory IS NOT NULL;
        CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, reserved_hw INTEGER NOT NULL DEFAULT 0,
            durable_seq INTEGER NOT NULL DEFAULT 0, recorded INTEGER NOT NULL DEFAULT 0,
            lost INTEGER NOT NULL DEFAULT 0);
        INSERT INTO entries VALUES ('e-old', 1, 1, 'exec', '{}', '{"stdout":"old"}', '{}', 'tr', 0, 'h', 1.0);
        INSERT INTO sandboxes VALUES ('e-old', 1, 1, 1, 0);
        """
    )
    old.close()
    log = TrajectoryLog(db)
    await log.start()
    try:
        # the old row: found by its own sandbox only, whatever scope asks
        e = log.find_step("tr", 0, "p", "e-old")
        assert e is not None and e.observation == {"stdout": "old"}
        assert log.find_step("tr", 0, "p", "e-someone-else") is None
        # two scopes may now log the same tag; one scope may not log it twice
        await log.record("e-a", "exec", {"x": 1}, {}, {}, StepTag("tr", 5, "p"))
        await log.record("e-b", "exec", {"x": 2}, {}, {}, StepTag("tr", 5, "q"))
        with pytest.raises(errors.Conflict):
            await log.record("e-c", "exec", {"x": 3}, {}, {}, StepTag("tr", 5, "p"))
        await log.flush()
        found_p, found_q = log.find_step("tr", 5, "p"), log.find_step("tr", 5, "q")
        assert found_p is not None and found_p.action == {"x": 1}
        assert found_q is not None and found_q.action == {"x": 2}
    finally:
        await log.close()
    idx = sqlite3.connect(db).execute("SELECT name FROM sqlite_master WHERE type='index'").fetchall()
    assert ("entries_step",) not in idx and ("entries_step_scoped",) in idx
