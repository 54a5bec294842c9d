"""Output floods and the edge's memory (issue #25 item 6): a streamed exec whose reader stops
leaves its command blocked on a full pipe instead of queueing its output; a project holds at
most `project_streams` streams open; concurrent floods past the output budget wait their turn
(the oldest goes on) instead of being held at once; and what comes back is the exact text."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import tracemalloc
from pathlib import Path

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

MiB = 1 << 20


@pytest.fixture
async def tight_edge(python_image: str, edge_dirs: dict[str, Path]):
    """An edge with a small output budget (8 MiB, 4 MiB per project) and 2 streams per project."""
    from dsec.config import EdgeSettings
    from dsec.edge import Edge

    e = Edge(
        EdgeSettings(
            name="t" + secrets.token_hex(4),
            reconcile_interval_s=3600,
            fncall_image="",
            output_budget_mb=8,
            project_output_budget_mb=4,
            project_streams=2,
            **edge_dirs,
        )
    )
    await e.start()
    try:
        yield e
    finally:
        await e.close()


def _procs(edge, sid: str, name: bytes) -> list[int]:
    """Host pids of the sandbox's processes whose command line starts with `name`."""
    out = []
    for d, _, _ in os.walk(edge.cgroups.tracking_dir(sid)):
        with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
            for pid in f.read().split():
                with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as c:
                    if c.read().startswith(name):
                        out.append(int(pid))
    return out


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip()
    except OSError:
        return "gone"


async def _until(cond, what: str, timeout: float = 60.0):
    """Wait for `cond()` to give something true (a guard, not a speed assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        got = cond()
        if got:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_stream_nobody_reads_blocks_its_command(edge):
    """The reader takes one event and stops: the command fills its pipe and blocks writing;
    it neither finishes nor has its output queued in the edge. Before, the edge read all 32
    MiB into an unbounded queue at once and the command was done."""
    sb = await edge.create(SandboxSpec(image="python", max_output_bytes=64 * MiB))
    size = 32 * MiB
    events = edge.exec_stream(
        sb.id, ExecRequest(cmd=f"head -c {size} /dev/zero", max_output_bytes=64 * MiB, timeout=300)
    )
    kind, first = await anext(events)
    assert kind == "stdout"

    def settled() -> str | None:
        heads = _procs(edge, sb.id, b"head")
        if not heads:
            return "exited"
        state = _wchan(heads[0])  # (anon_pipe_write on newer kernels)
        return "blocked" if state.endswith("pipe_write") else None

    assert await _until(settled, "head to exit or block writing") == "blocked"
    got = len(first)
    async for kind, item in events:  # the reader comes back: everything arrives, in order
        if kind == "result":
            assert item.exit_code == 0 and not item.truncated
            assert len(item.stdout) == size
        else:
            got += len(item)
    assert got == size


async def test_a_project_holds_at_most_its_streams(tight_edge):
    """Two streams open (project_streams=2): a third of the same project is 429 quota_exceeded,
    reason open_streams; another project's is not; a stream closed by its reader frees its
    place. Before, every stream was admitted."""
    edge = tight_edge
    a = await edge.create(SandboxSpec(image="python", project="pa"))
    b = await edge.create(SandboxSpec(image="python", project="pb"))
    slow = ExecRequest(cmd="echo go; exec sleep 300", timeout=300)
    opened = [edge.exec_stream(a.id, slow) for _ in range(2)]
    for s in opened:
        assert await anext(s) == ("stdout", b"go\n")
    third = edge.exec_stream(a.id, slow)
    with pytest.raises(errors.QuotaExceeded) as ei:
        await anext(third)
    assert ei.value.code == "quota_exceeded" and ei.value.status == 429
    assert ei.value.details == {"reason": "open_streams", "limit": 2}
    other = [item async for item in edge.exec_stream(b.id, ExecRequest(cmd="echo hi"))]
    assert other[-1][0] == "result" and other[-1][1].stdout == "hi\n"  # another project's room
    await opened[0].aclose()  # closed by its reader: its place is free again
    again = [item async for item in edge.exec_stream(a.id, ExecRequest(cmd="echo again"))]
    assert again[-1][1].stdout == "again\n"
    await opened[1].aclose()


async def test_floods_past_the_budget_wait_their_turn(tight_edge):
    """Four concurrent 8 MiB floods of one project against a 4 MiB project budget (8 MiB for the
    edge): the memory the edge's Python allocates at once stays within its budget plus the
    oldest call's output and JSON (and the test's own decoding of one answer), not four calls'
    worth of decoded copies (about 280 MiB before); each gets its whole, exact output."""
    edge = tight_edge
    size = 8 * MiB
    boxes = [await edge.create(SandboxSpec(image="python", max_output_bytes=size)) for _ in range(4)]
    # bytes that are not UTF-8, a control character and a quote in each line
    cmd = f"yes \"$(printf 'x\\377\\001\\042')\" | head -c {size}"
    line = b'x\xff\x01"\n'
    want = hashlib.sha256((line * (size // len(line) + 1))[:size].decode(errors="replace").encode()).digest()

    async def flood(sid: str) -> bytes:
        result = await edge.exec(sid, ExecRequest(cmd=cmd, max_output_bytes=size, timeout=300))
        assert result.exit_code == 0 and not result.truncated
        return hashlib.sha256(result.stdout.encode()).digest()

    tracemalloc.start()
    try:
        digests = await asyncio.gather(*(flood(sb.id) for sb in boxes))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digests == [want] * 4
    oldest = size + 6 * size  # its output and its JSON (at most 6 bytes per byte)
    decoding = 6 * size + 2 * size  # the test's: one answer's JSON joined, its text (UCS-2)
    assert peak < 8 * MiB + oldest + decoding + 8 * MiB, peak / MiB
    budget = edge.execs.budget
    assert budget.peak <= budget.total + oldest and budget.held == 0
