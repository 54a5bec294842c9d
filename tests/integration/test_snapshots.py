"""Snapshots and forks on a real edge."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def sh(edge, sid, cmd):
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=60))
    assert r.exit_code == 0, r.stderr
    return r.stdout


async def test_snapshot_restores_and_never_contains_scrubbed_paths(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(
        edge,
        sb.id,
        "mkdir -p /work/env /work/answers && echo built > /work/env/state && "
        "echo 42 > /work/answers/secret && echo hidden > /etc/motd && rm /etc/issue && "
        "pip --version > /work/env/pip",
    )
    snap = await edge.snapshot(sb.id, ["/work/answers", "/etc/motd"])
    assert snap.scrubbed == ["/work/answers", "/etc/motd"]
    # the layer itself holds no scrubbed data
    tree = edge.layers.layer_path(snap.layer)
    assert not (tree / "work/answers/secret").exists()
    assert b"42" not in b"".join(
        p.read_bytes() for p in tree.rglob("*") if p.is_file() and not p.is_symlink()
    )
    # the source keeps running and keeps its files
    assert await sh(edge, sb.id, "cat /work/answers/secret") == "42\n"
    new = await edge.create(SandboxSpec(image=snap.id))
    assert await sh(edge, new.id, "cat /work/env/state") == "built\n"
    r = await edge.exec(new.id, ExecRequest(cmd="ls /work/answers /etc/motd /etc/issue"))
    assert r.exit_code != 0 and "No such file" in r.stderr  # scrubbed, and a deletion carried over
    assert snap.id in [s["name"] for s in edge.list_snapshots()]
    with pytest.raises(errors.Conflict):
        edge.delete_snapshot(snap.id)  # in use
    await edge.stop(new.id)
    edge.delete_snapshot(snap.id)
    assert snap.id not in [s["name"] for s in edge.list_snapshots()]


async def test_fork_children_are_independent(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(
        edge,
        sb.id,
        "mkdir -p /work/data && head -c 60000000 /dev/urandom > /work/data/blob && "
        "for i in $(seq 3000); do echo $i > /work/data/f$i; done",
    )
    t0 = time.perf_counter()
    kids = await edge.fork(sb.id, 8)
    took = time.perf_counter() - t0
    assert len(kids) == 8 and len({k.id for k in kids}) == 8
    # every child sees the parent's files as of the fork
    sums = await asyncio.gather(
        *(sh(edge, k.id, "md5sum < /work/data/blob; cat /work/data/f3000") for k in kids)
    )
    parent = await sh(edge, sb.id, "md5sum < /work/data/blob; cat /work/data/f3000")
    assert set(sums) == {parent}
    # changes after the fork stay where they are made
    await sh(edge, kids[0].id, "echo sibling > /work/data/f1; rm /work/data/f2")
    await sh(edge, sb.id, "echo parent > /work/data/f3")
    assert await sh(edge, kids[1].id, "cat /work/data/f1 /work/data/f2 /work/data/f3") == "1\n2\n3\n"
    assert await sh(edge, sb.id, "cat /work/data/f1 /work/data/f2") == "1\n2\n"
    assert kids[0].spec.labels["dsec.fork-of"] == sb.id
    # the shared layer goes away with the last child
    shared = edge.sandboxes[kids[0].id].record.extra_lower
    for k in kids:
        await edge.stop(k.id)
    assert shared is not None and not os.path.exists(shared)
    copy_ms = kids[0].timings_ms["fork_copy"]
    print(f"fork x8 of 60 MB + 3,000 files: {took * 1000:.0f} ms (copy {copy_ms:.0f} ms)")
