"""Exec output made into JSON piece by piece (dsec.http.output) is exactly the text the whole
would make, whatever the bytes and wherever the pieces split them; an exec's observation is
the canonical JSON the trajectory log would make of it; the output budget's rules (room,
waiting, the oldest call always going on) as dsec.edge.outputs states them."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from dsec.edge.outputs import OutputBudget, observe
from dsec.http.output import PIECE, StreamText, json_string, result_json
from dsec.models import ExecResult
from dsec.trajlog import canonical_json

pytestmark = pytest.mark.asyncio


def _text_json(data: bytes) -> bytes:
    return json.dumps(data.decode(errors="replace"), ensure_ascii=False).encode()


def _nasty(seed: int) -> bytes:
    """Random bytes, with the sequences UTF-8 decoders disagree on, put where pieces split."""
    rng = random.Random(seed)
    parts = [
        b'"\\\n\r\t\x00\x1f\x7f',
        "\u2028é€😀".encode(),
        b"\xed\xa0\x80",  # an encoded surrogate
        b"\xc0\x80\xf4\x90\x80\x80",  # overlong, past U+10FFFF
        b"\xe2\x82",  # cut short
        b"\x80\xbf",  # lone continuation bytes
    ]
    out = bytearray()
    while len(out) < 2 * PIECE + 64:
        out += rng.choice(parts) if rng.random() < 0.3 else rng.randbytes(rng.randint(1, 50))
    at = PIECE - 2  # a four-byte character across the first piece's end
    out[at : at + 4] = "😀".encode()
    return bytes(out) + b"\xf0\x9f\x98"  # and one cut short at the very end


async def _joined(data: bytes) -> bytes:
    return b"".join([p async for p in json_string(data)])


@pytest.mark.parametrize("seed", range(4))
async def test_pieces_make_exactly_the_whole_text(seed: int) -> None:
    data = _nasty(seed)
    assert await _joined(data) == _text_json(data)
    assert await _joined(data[:1000]) == _text_json(data[:1000])  # one piece
    assert await _joined(b"") == b'""'


async def test_stream_events_carry_the_whole_text_however_reads_split_it() -> None:
    data = _nasty(7)
    rng = random.Random(7)
    text = StreamText()
    events, at = [], 0
    while at < len(data):
        n = rng.randint(1, 70000)
        events.append(text.event("stdout", data[at : at + n]))
        at += n
    events.append(text.flush())
    got = ""
    for block in b"".join(events).split(b"\n\n")[:-1]:
        kind, payload = block.split(b"\n")
        assert kind == b"event: stdout" and payload.startswith(b"data: ")
        got += json.loads(payload[6:])
    assert got == data.decode(errors="replace")


async def test_an_answer_is_the_result_json_would_make() -> None:
    out, err = _nasty(1), b"err \xff"
    meta = ExecResult(stdout="", stderr="", exit_code=3, duration=0.5, misbehaviour={"oom_kills": 1}, seq=9)
    body = b"".join([p async for p in result_json(meta, out, err)])
    want = meta.model_copy(
        update={"stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}
    )
    assert ExecResult.model_validate_json(body) == want


@pytest.mark.parametrize("out", [_nasty(2), _nasty(3)[:5000], b""], ids=["pieces", "whole", "empty"])
async def test_an_observation_is_the_canonical_json_the_log_would_make(out: bytes) -> None:
    err = b"\x00oops\n"
    meta = ExecResult(
        stdout="", stderr="", exit_code=1, duration=0.25, truncated=True, misbehaviour={"disk_full": 1}
    )
    budget = OutputBudget(64 << 20, 64 << 20)
    hold = budget.hold("p")
    hold.take(len(out) + len(err))  # as its pipes were read
    obs = await observe(meta, out, err, hold)
    result = meta.model_copy(
        update={"stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}
    )
    assert bytes(obs.doc) == canonical_json(result.model_dump()).encode()
    assert hold.held == len(obs.doc)  # the output's bytes given back, its JSON held
    reply = obs.reply(hold, seq=4)
    assert reply.length == len(b"".join([p async for p in reply.body()]))
    assert await reply.result() == result.model_copy(update={"seq": 4})
    assert budget.held == 0  # the answer taken: everything given back


async def test_the_budget_makes_later_calls_wait_and_the_oldest_go_on() -> None:
    budget = OutputBudget(total=100, per_project=60)
    first, second, third = budget.hold("a"), budget.hold("a"), budget.hold("b")
    first.take(80)  # the oldest may take past both budgets
    assert first.room() > 10**9
    assert second.room() == 0  # its project is past 60
    assert third.room() == 20  # the edge has 20 left, project b all of its 60
    third.take(20)
    assert third.room() == 0
    woken = asyncio.get_running_loop().create_future()
    second.when_room(lambda: woken.done() or woken.set_result(True))
    waiting = asyncio.ensure_future(second.reserve(30))
    await asyncio.sleep(0)  # (a turn of the loop: it waits)
    assert not waiting.done()
    first.close()  # gives back 80: second is now the oldest
    assert woken.done()
    await waiting
    assert second.held == 30 and budget.held == 50 and budget.held_by("a") == 30
    assert third.room() == 50  # b's oldest: what the edge has left, past b's own 60 if need be
    second.close()
    third.close()
    assert budget.held == 0 and budget.peak == 100


async def test_large_observations_read_back_as_they_were_recorded(tmp_path) -> None:
    """An observation given as bytes (large: written piece by piece into a table of its own)
    reads back, ships and exports as the same JSON as one given as a dict."""
    from dsec.trajlog import TrajectoryLog

    big = {"stdout": "\ufffd" * (1 << 20) + "é\n", "exit_code": 0}
    small = {"stdout": "hi\n", "exit_code": 1}
    async with TrajectoryLog(tmp_path / "t.db") as log:
        await log.record("s1", "exec", {"n": 1}, bytearray(canonical_json(big).encode()), {}, durable=True)
        await log.record("s1", "exec", {"n": 2}, canonical_json(small).encode(), {}, durable=True)
        await log.record("s1", "exec", {"n": 3}, big, {}, durable=True)
        await log.record("s1", "event", {"n": 4}, None, {}, durable=True)
        assert [e.observation for e in log.read("s1")] == [big, small, big, None]
        shipped = [row[5] for _, row in log.rows_after(0)]
        assert shipped == [canonical_json(big), canonical_json(small), canonical_json(big), None]
        log.export_jsonl("s1", tmp_path / "t.jsonl")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(x)["observation"] for x in lines] == [big, small, big, None]
