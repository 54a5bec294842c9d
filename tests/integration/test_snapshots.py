"""Snapshots and forks on a real edge."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from pathlib import Path

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
        await edge.delete_snapshot(snap.id)  # in use
    await edge.stop(new.id)
    await edge.delete_snapshot(snap.id)
    assert snap.id not in [s["name"] for s in edge.list_snapshots()]


async def test_fork_children_are_independent(edge):
    # (made by a keyed create: its label is the parent's alone, not its children's)
    labels = {"team": "a", "dsec.idempotency": "0" * 32}
    sb = await edge.create(SandboxSpec(image="python", labels=labels))
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
    assert kids[0].spec.labels == {"team": "a", "dsec.fork-of": sb.id}
    # the shared layer goes away with the last child
    shared = edge.sandboxes[kids[0].id].record.extra_lower
    for k in kids:
        await edge.stop(k.id)
    assert shared is not None and not os.path.exists(shared)
    copy_ms = kids[0].timings_ms["fork_copy"]
    print(f"fork x8 of 60 MB + 3,000 files: {took * 1000:.0f} ms (copy {copy_ms:.0f} ms)")


async def test_fork_of_fork_stacks_layers_keeps_deletions_and_opaque_dirs(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(
        edge,
        sb.id,
        "mkdir -p /work && echo a > /work/a && rm /etc/issue && "
        "rm -rf /usr/share/doc && mkdir /usr/share/doc && echo mine > /usr/share/doc/only",
    )
    (kid,) = await edge.fork(sb.id, 1)
    await sh(edge, sb.id, "echo after > /work/parent-after")
    await sh(edge, kid.id, "rm /work/a && echo b > /work/b")
    grand = await edge.fork(kid.id, 2)
    chain = edge.sandboxes[grand[0].id].record.extra_lower.split(":")
    assert len(chain) == 2 and chain[1] == edge.sandboxes[kid.id].record.extra_lower
    for g in grand:
        out = await sh(
            edge,
            g.id,
            "ls /work; test -e /etc/issue && echo issue; ls /usr/share/doc; "
            "test -e /work/parent-after && echo leak; true",
        )
        assert out == "b\nonly\n"
    # the parent's layer stays while a descendant stacks it, and goes with the last one
    await edge.stop(kid.id)
    assert all(os.path.exists(p) for p in chain)
    for g in grand:
        await edge.stop(g.id)
    assert not any(os.path.exists(p) for p in chain)


async def test_long_fork_chains_are_flattened(edge, monkeypatch):
    import dsec.edge.state as edge_mod  # where fork() reads it

    monkeypatch.setattr(edge_mod, "MAX_FORK_CHAIN", 1)
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(edge, sb.id, "mkdir -p /work/d && echo 1 > /work/d/one && echo x > /work/x && rm /etc/issue")
    (kid,) = await edge.fork(sb.id, 1)
    await sh(edge, kid.id, "rm -r /work/d && mkdir /work/d && echo 2 > /work/d/two && rm /work/x")
    (grand,) = await edge.fork(kid.id, 1)
    rec = edge.sandboxes[grand.id].record
    assert rec.extra_lower is not None and ":" not in rec.extra_lower  # one merged layer
    out = await sh(edge, grand.id, "ls /work /work/d; test -e /etc/issue && echo issue; true")
    assert out == "/work:\nd\n\n/work/d:\ntwo\n"


async def test_fork_copy_never_follows_links_out_of_the_sandbox(edge):
    secret_dir = Path(f"/run/dsec-test-secret-{secrets.token_hex(3)}")
    secret_dir.mkdir()
    try:
        (secret_dir / "key").write_text("HOSTSECRET")
        sb = await edge.create(SandboxSpec(image="python"))
        await sh(
            edge, sb.id, f"mkdir -p /work && ln -s {secret_dir} /work/d && ln -s {secret_dir}/key /work/k"
        )
        (kid,) = await edge.fork(sb.id, 1)
        tree = Path(edge.sandboxes[kid.id].record.extra_lower)
        assert (tree / "work/d").is_symlink() and (tree / "work/k").is_symlink()
        assert not any(
            b"HOSTSECRET" in p.read_bytes() for p in tree.rglob("*") if p.is_file() and not p.is_symlink()
        )
        # inside, the links resolve in the sandbox's own root, where that path does not exist
        r = await edge.exec(kid.id, ExecRequest(cmd="cat /work/k"))
        assert r.exit_code != 0 and "HOSTSECRET" not in r.stdout
    finally:
        shutil.rmtree(secret_dir)
