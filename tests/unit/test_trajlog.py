"""The trajectory log: gap-free numbering, durability, backpressure, step lookup, stats, exports, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.trajlog import Entry, StepTag, TrajectoryLog, action_hash

pytestmark = pytest.mark.asyncio


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "traj.db"


@pytest.fixture
async def log(db: Path) -> AsyncIterator[TrajectoryLog]:
    t = TrajectoryLog(db, batch_size=16, flush_interval_s=0.01, reserve_block=8)
    await t.start()
    try:
        yield t
    finally:
        await t.close()


def obs(i: int) -> dict[str, Any]:
    return {"exit_code": 0, "stdout": f"out {i}\n"}


async def test_seqs_gap_free_per_sandbox_and_independent(log: TrajectoryLog) -> None:
    a = [await log.record("a", "exec", {"cmd": f"echo {i}"}, obs(i), {"run": 0.1}) for i in range(50)]
    b = [await log.record("b", "file", {"path": f"/f{i}"}, None, {}) for i in range(7)]
    assert a == list(range(1, 51))
    assert b == list(range(1, 8))
    await log.flush()
    entries = log.read("a")
    assert [e.seq for e in entries] == a
    assert entries[3].action == {"cmd": "echo 3"} and entries[3].observation == obs(3)
    assert entries[3].timings == {"run": 0.1} and entries[3].kind == "exec"
    assert entries[3].action_hash == action_hash({"cmd": "echo 3"})
    assert [e.seq for e in log.read("b")] == b
    assert log.read("b")[0].observation is None
    assert [e.seq for e in log.read("a", after_seq=45)] == [46, 47, 48, 49, 50]
    assert [e.seq for e in log.read("a", after_seq=10, limit=3)] == [11, 12, 13]
    assert log.read("nobody") == []


async def test_concurrent_producers_get_distinct_ordered_seqs(log: TrajectoryLog) -> None:
    async def producer(k: int) -> list[int]:
        out = []
        for i in range(40):
            out.append(await log.record("shared", "exec", {"k": k, "i": i}, None, {}))
            await asyncio.sleep(0)
        return out

    results = await asyncio.gather(*(producer(k) for k in range(10)))
    seqs = sorted(s for r in results for s in r)
    assert seqs == list(range(1, 401))
    for r in results:  # each producer sees its own seqs increase
        assert r == sorted(r)
    await log.flush()
    entries = log.read("shared")
    assert [e.seq for e in entries] == list(range(1, 401))
    # the seq a producer got is the one its action was stored under
    for e in entries:
        assert results[e.action["k"]][e.action["i"]] == e.seq


async def test_action_hash_is_canonical(log: TrajectoryLog) -> None:
    await log.record("a", "exec", {"b": 1, "a": [1, 2], "é": "ü"}, None, {})
    await log.flush()
    e = log.read("a")[0]
    assert e.action_hash == action_hash({"é": "ü", "a": [1, 2], "b": 1})
    assert e.action_hash == action_hash(json.loads(json.dumps({"a": [1, 2], "b": 1, "é": "ü"})))
    assert len(e.action_hash or "") == 64


async def test_durable_after_close_and_reopen_continues_without_gap(db: Path) -> None:
    t = TrajectoryLog(db, reserve_block=4)
    await t.start()
    for i in range(10):
        await t.record("a", "exec", {"i": i}, obs(i), {"run": 1.0})
    await t.close()  # flushes
    t2 = TrajectoryLog(db, reserve_block=4)
    await t2.start()
    try:
        assert t2.recovered == []  # a clean close gives the unused reservation back: no gap
        assert [e.seq for e in t2.read("a")] == list(range(1, 11))
        assert await t2.record("a", "exec", {"i": 10}, None, {}) == 11
        await t2.flush()
        assert [e.kind for e in t2.read("a")] == ["exec"] * 11
        assert t2.stats("a") == {"acknowledged": 11, "recorded": 11, "lost": 0, "pending": 0}
    finally:
        await t2.close()


async def test_flush_makes_entries_durable_for_other_connections(log: TrajectoryLog, db: Path) -> None:
    for i in range(5):
        await log.record("a", "exec", {"i": i}, None, {})
    await log.flush()
    other = sqlite3.connect(db)
    try:
        assert other.execute("SELECT COUNT(*) FROM entries WHERE sandbox_id = 'a'").fetchone() == (5,)
    finally:
        other.close()


async def test_entries_are_durable_within_the_flush_interval(db: Path) -> None:
    t = TrajectoryLog(db, flush_interval_s=0.02)
    await t.start()
    try:
        await t.record("a", "exec", {}, None, {})
        assert t.stats("a")["pending"] == 1
        for _ in range(200):
            if t.stats("a")["pending"] == 0:
                break
            await asyncio.sleep(0.01)
        assert t.stats("a") == {"acknowledged": 1, "recorded": 1, "lost": 0, "pending": 0}
        assert len(t.read("a")) == 1
    finally:
        await t.close()


async def test_read_is_durable_only(db: Path) -> None:
    t = TrajectoryLog(db, flush_interval_s=10)
    await t.start()
    try:
        await t.record("a", "exec", {}, None, {})
        assert t.read("a") == []  # still queued: read() shows what is durable
        await t.flush()
        assert len(t.read("a")) == 1
    finally:
        await t.close()


async def test_backpressure_delays_callers_and_drops_nothing(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = TrajectoryLog(db, batch_size=8, queue_max=4, flush_interval_s=0.001)
    assert t.max_unflushed == 8  # W = min(queue_max, batch_size) = 4: one committing + one waiting
    real_commit = t._commit
    commits: list[int] = []
    unflushed_seen: list[int] = []

    def slow_commit(rows: list[Any]) -> None:
        commits.append(len(rows))
        time.sleep(0.02)
        real_commit(rows)

    monkeypatch.setattr(t, "_commit", slow_commit)
    await t.start()
    try:
        waits: list[float] = []

        async def producer(k: int) -> list[int]:
            out = []
            for i in range(10):
                t0 = time.perf_counter()
                out.append(await t.record(f"sb{k % 2}", "exec", {"k": k, "i": i}, None, {}))
                waits.append(time.perf_counter() - t0)
                s = t.stats("sb0")["pending"] + t.stats("sb1")["pending"]
                unflushed_seen.append(s)
            return out

        t0 = time.perf_counter()
        await asyncio.gather(*(producer(k) for k in range(4)))
        elapsed = time.perf_counter() - t0
        # 40 entries, at most 4 per 20 ms commit, at most 8 unflushed when the last record returns:
        # the producers waited for at least (40 - 8) / 4 = 8 commits
        assert elapsed >= 8 * 0.02 * 0.95
        assert max(waits) >= 0.015
        assert max(commits) <= 4
        assert max(unflushed_seen) <= t.max_unflushed
        await t.flush()
        assert sum(commits) == 40
        for sb in ("sb0", "sb1"):
            assert [e.seq for e in t.read(sb)] == list(range(1, 21))
            assert t.stats(sb) == {"acknowledged": 20, "recorded": 20, "lost": 0, "pending": 0}
    finally:
        await t.close()


async def test_find_step_sees_queued_and_durable_entries(db: Path) -> None:
    t = TrajectoryLog(db, flush_interval_s=10, batch_size=1000)
    await t.start()
    try:
        seq = await t.record("a", "exec", {"cmd": "ls"}, {"stdout": "x"}, {}, step=StepTag("traj-1", 0))
        queued = t.find_step("traj-1", 0)  # not durable yet
        assert isinstance(queued, Entry)
        assert (queued.sandbox_id, queued.seq, queued.trajectory, queued.step) == ("a", seq, "traj-1", 0)
        assert queued.observation == {"stdout": "x"}
        assert t.read("a") == []
        await t.flush()
        durable = t.find_step("traj-1", 0)
        assert durable == queued
        assert t.find_step("traj-1", 1) is None
        assert t.find_step("traj-2", 0) is None
    finally:
        await t.close()
    t2 = TrajectoryLog(db)
    await t2.start()
    try:
        e = t2.find_step("traj-1", 0)
        assert e is not None and e.seq == 1
    finally:
        await t2.close()


async def test_step_tags_are_unique(log: TrajectoryLog) -> None:
    await log.record("a", "exec", {}, None, {}, step=StepTag("t", 3))
    with pytest.raises(errors.Conflict):  # still queued
        await log.record("b", "exec", {}, None, {}, step=StepTag("t", 3))
    await log.flush()
    with pytest.raises(errors.Conflict):  # durable
        await log.record("a", "exec", {}, None, {}, step=StepTag("t", 3))
    # a refused record does not use up a seq
    assert await log.record("a", "exec", {}, None, {}, step=StepTag("t", 4)) == 2
    assert await log.record("a", "exec", {}, None, {}, step=StepTag("u", 3)) == 3


async def test_caller_mutations_after_record_do_not_change_the_log(log: TrajectoryLog) -> None:
    action: dict[str, Any] = {"cmd": "a"}
    observation: dict[str, Any] = {"stdout": "1"}
    await log.record("a", "exec", action, observation, {}, step=StepTag("m", 0))
    action["cmd"] = "b"
    observation["stdout"] = "2"
    e = log.find_step("m", 0)
    assert e is not None and e.action == {"cmd": "a"} and e.observation == {"stdout": "1"}
    await log.flush()
    assert log.read("a")[0].action == {"cmd": "a"}


async def test_invalid_records_are_refused_without_using_a_seq(log: TrajectoryLog) -> None:
    with pytest.raises(errors.InvalidRequest):
        await log.record("a", "gap", {}, None, {})
    with pytest.raises(errors.InvalidRequest):
        await log.record("a", "exec", {"x": object()}, None, {})
    with pytest.raises(errors.InvalidRequest):
        await log.record("a", "exec", {}, None, {"run": float("nan")})
    with pytest.raises(errors.InvalidRequest):
        await log.record("", "exec", {}, None, {})
    assert await log.record("a", "exec", {}, None, {}) == 1


async def test_stats(db: Path) -> None:
    t = TrajectoryLog(db, flush_interval_s=10, batch_size=1000, reserve_block=4)
    await t.start()
    try:
        assert t.stats("a") == {"acknowledged": 0, "recorded": 0, "lost": 0, "pending": 0}
        for i in range(6):
            await t.record("a", "exec", {"i": i}, None, {})
        assert t.stats("a") == {"acknowledged": 6, "recorded": 0, "lost": 0, "pending": 6}
        await t.flush()
        assert t.stats("a") == {"acknowledged": 6, "recorded": 6, "lost": 0, "pending": 0}
    finally:
        await t.close()


async def test_record_after_close_is_refused(db: Path) -> None:
    t = TrajectoryLog(db)
    with pytest.raises(errors.Unavailable):
        await t.record("a", "exec", {}, None, {})
    await t.start()
    await t.close()
    with pytest.raises(errors.Unavailable):
        await t.record("a", "exec", {}, None, {})
    await t.close()  # idempotent


async def test_one_writer_process_per_file(log: TrajectoryLog, db: Path) -> None:
    with pytest.raises(errors.Conflict):
        await TrajectoryLog(db).start()


async def test_export_jsonl_and_parquet_round_trip(log: TrajectoryLog, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    for i in range(40):
        step = StepTag("tr", i) if i % 2 == 0 else None
        await log.record(
            "a", "exec", {"cmd": f"echo {i}", "env": {"A": "ü"}}, obs(i), {"run": i / 10}, step=step
        )
    await log.record("a", "file", {"path": "/x"}, None, {})
    await log.record("other", "exec", {}, None, {})
    await log.flush()
    expected = [e.model_dump() for e in log.read("a")]
    assert len(expected) == 41

    n = log.export_jsonl("a", tmp_path / "a.jsonl")
    assert n == 41
    lines = (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()
    assert [Entry.model_validate_json(line).model_dump() for line in lines] == expected

    n = log.export_parquet("a", tmp_path / "a.parquet")
    assert n == 41
    table = pq.read_table(tmp_path / "a.parquet")
    assert table.num_rows == 41
    rows = table.to_pylist()
    back = [
        Entry(
            **{
                **r,
                "action": json.loads(r["action"]),
                "observation": None if r["observation"] is None else json.loads(r["observation"]),
                "timings": json.loads(r["timings"]),
            }
        ).model_dump()
        for r in rows
    ]
    assert back == expected
    assert rows[0]["step"] == 0 and rows[1]["step"] is None and rows[40]["observation"] is None
    assert log.export_jsonl("nobody", tmp_path / "none.jsonl") == 0
    assert log.export_parquet("nobody", tmp_path / "none.parquet") == 0
    assert pq.read_table(tmp_path / "none.parquet").num_rows == 0


def _simulate_crash(db: Path, sandbox_id: str, *, durable: int, reserved_hw: int) -> None:
    """What a killed edge leaves behind: `durable` entries flushed, seqs reserved up to `reserved_hw`."""
    con = sqlite3.connect(db, isolation_level=None)
    try:
        con.execute(
            "UPDATE sandboxes SET reserved_hw = ? WHERE sandbox_id = ? AND durable_seq = ?",
            (reserved_hw, sandbox_id, durable),
        )
        assert con.total_changes == 1
    finally:
        con.close()


async def test_recovery_writes_a_gap_for_reserved_but_unflushed_seqs(db: Path) -> None:
    t = TrajectoryLog(db, reserve_block=16)
    await t.start()
    for i in range(5):
        await t.record("a", "exec", {"i": i}, None, {})
    await t.record("b", "exec", {}, None, {})
    await t.close()
    # As if seqs 6..21 had been reserved (and maybe handed out) but the process died before flushing them.
    _simulate_crash(db, "a", durable=5, reserved_hw=21)

    t2 = TrajectoryLog(db, reserve_block=16)
    await t2.start()
    try:
        assert len(t2.recovered) == 1
        gap = t2.recovered[0]
        assert (gap.sandbox_id, gap.seq, gap.kind) == ("a", 6, "gap")
        assert gap.observation is not None
        assert gap.observation["reason"] == (
            "the edge stopped before this batch was flushed; up to 16 operations may have been lost"
        )
        assert (gap.observation["first_seq"], gap.observation["last_seq"], gap.observation["count"]) == (
            6,
            21,
            16,
        )
        entries = t2.read("a")
        assert [(e.seq, e.kind) for e in entries] == [(i, "exec") for i in range(1, 6)] + [(6, "gap")]
        # a gap is returned for any after_seq it covers
        assert [e.seq for e in t2.read("a", after_seq=10)] == [6]
        assert t2.read("a", after_seq=21) == []
        assert t2.stats("a") == {"acknowledged": 21, "recorded": 5, "lost": 16, "pending": 0}
        # numbering continues after the gap
        assert await t2.record("a", "exec", {}, None, {}) == 22
        assert await t2.record("b", "exec", {}, None, {}) == 2  # b was clean: no gap
        await t2.flush()
        assert [e.seq for e in t2.read("a", after_seq=21)] == [22]
        assert t2.stats("a") == {"acknowledged": 22, "recorded": 6, "lost": 16, "pending": 0}
    finally:
        await t2.close()
    t3 = TrajectoryLog(db)
    await t3.start()
    try:
        assert t3.recovered == []  # the gap is written once
        assert t3.stats("a") == {"acknowledged": 22, "recorded": 6, "lost": 16, "pending": 0}
    finally:
        await t3.close()


async def test_a_log_abandoned_without_close_recovers_with_a_gap(db: Path) -> None:
    """Entries recorded but never flushed (the writer never ran) are covered by the gap at the next start."""
    t = TrajectoryLog(db, flush_interval_s=10, batch_size=1000, reserve_block=8)
    await t.start()
    acked = [await t.record("a", "exec", {"i": i}, None, {}) for i in range(3)]
    await t.flush()
    acked += [await t.record("a", "exec", {"i": i}, None, {}) for i in range(3, 12)]
    # abandon: stop the writer and drop the files without flushing, like a SIGKILL
    assert t._task is not None
    t._task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await t._task
    t._close_files()
    t2 = TrajectoryLog(db, reserve_block=8)
    await t2.start()
    try:
        durable = {e.seq for e in t2.read("a") if e.kind != "gap"}
        gaps = [e for e in t2.read("a") if e.kind == "gap"]
        assert durable == {1, 2, 3}
        assert len(gaps) == 1 and gaps[0].observation is not None
        first, last = gaps[0].observation["first_seq"], gaps[0].observation["last_seq"]
        assert all(s in durable or first <= s <= last for s in acked)
        # reservations: seq 1 reserved up to 1 + 8 = 9, seq 10 up to 10 + 8 = 18
        assert (first, last) == (4, 18)
        assert await t2.record("a", "exec", {}, None, {}) == 19
    finally:
        await t2.close()


async def test_reservations_are_written_once_per_block(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = TrajectoryLog(db, reserve_block=10, flush_interval_s=10, batch_size=1000)
    reservations: list[tuple[str, int]] = []
    real = t._persist_reservation

    def spy(sandbox_id: str, hw: int) -> None:
        assert threading.current_thread() is not threading.main_thread()  # never on the event loop
        reservations.append((sandbox_id, hw))
        real(sandbox_id, hw)

    monkeypatch.setattr(t, "_persist_reservation", spy)
    await t.start()
    try:
        for _ in range(25):
            await t.record("a", "exec", {}, None, {})
        assert reservations == [("a", 11), ("a", 22), ("a", 33)]
    finally:
        await t.close()


async def test_write_failures_fail_flush_then_recover(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = TrajectoryLog(db, flush_interval_s=0.001)
    real_commit = t._commit
    broken = True

    def flaky(rows: list[Any]) -> None:
        if broken:
            raise sqlite3.OperationalError("disk I/O error")
        real_commit(rows)

    monkeypatch.setattr(t, "_commit", flaky)
    await t.start()
    try:
        await t.record("a", "exec", {}, None, {})
        with pytest.raises(errors.Unavailable):
            await t.flush()
        assert t.stats("a")["pending"] == 1  # kept, retried: not dropped
        broken = False
        await t.flush()
        assert t.stats("a") == {"acknowledged": 1, "recorded": 1, "lost": 0, "pending": 0}
    finally:
        await t.close()


async def test_close_reports_entries_it_could_not_write(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = TrajectoryLog(db, flush_interval_s=10, reserve_block=4)

    def broken(rows: list[Any]) -> None:
        raise sqlite3.OperationalError("disk full")

    monkeypatch.setattr(t, "_commit", broken)
    await t.start()
    await t.record("a", "exec", {}, None, {})
    with pytest.raises(errors.InternalError):
        await t.close()
    t2 = TrajectoryLog(db)
    await t2.start()
    try:  # the unwritten entry is declared lost, not silently missing
        assert [(g.sandbox_id, g.seq) for g in t2.recovered] == [("a", 1)]
        assert t2.stats("a") == {"acknowledged": 5, "recorded": 0, "lost": 5, "pending": 0}
    finally:
        await t2.close()
