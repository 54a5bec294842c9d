"""Edge restarts: kill -9 the edge while sandboxes run; a new edge adopts them; nothing leaks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.isolation.idranges import RANGE, IdRanges, range_of
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from dsec.config import EdgeSettings
    from dsec.edge import Edge
    from dsec.models import ExecRequest, SandboxSpec

    async def main():
        edge = Edge(EdgeSettings.model_validate_json(sys.argv[1]))
        await edge.start()
        ids = []
        for i in range(3):
            sb = await edge.create(SandboxSpec(image="python"))
            await edge.exec(sb.id, ExecRequest(cmd=f"echo {i} > /work/mark; sleep 1000 &"))
            ids.append(sb.id)
        # one sandbox dies while the edge is down: it must be reaped, not adopted
        print(json.dumps(ids), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def dsec_mounts(prefix: str) -> list[str]:
    return [line for line in Path("/proc/mounts").read_text().splitlines() if f"dsec-{prefix}" in line]


def dsec_cgroups(prefix: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob("*/dsec/*") if p.name.startswith(prefix)]


async def test_kill_edge_then_adopt(edge_dirs, python_image):
    settings = EdgeSettings(name="dur", reconcile_interval_s=3600, fncall_image="", **edge_dirs)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, settings.model_dump_json()], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        ids = json.loads(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    # sandbox mounts live only in the sandboxes' own mount namespaces; the host holds just
    # the edge's run tmpfs, which outlives the edge process with the sandboxes in it
    assert not dsec_mounts("dur-")
    run_mounts = [
        m.split()[:3] for m in Path("/proc/mounts").read_text().splitlines() if str(settings.run_dir) in m
    ]
    assert run_mounts == [["dsec-run-dur", str(settings.edge_run_dir), "tmpfs"]]

    # Each keeps its own id range while no edge runs (their inits hold it in the registry).
    inits = {sid: int((settings.edge_run_dir / "sandboxes" / sid / "pid").read_text()) for sid in ids}
    bases = {sid: range_of(pid) for sid, pid in inits.items()}
    assert len(set(bases.values())) == 3
    other = IdRanges(settings.id_registry, settings.uid_offset + RANGE)  # another edge of the host
    grabbed = [other.claim() for _ in range(8)]
    assert not {r.base for r in grabbed} & set(bases.values())
    for r in grabbed:
        r.release()

    # While no edge runs, one sandbox dies (its init is killed from the host).
    victim = ids[2]
    pid = inits[victim]
    os.kill(pid, signal.SIGKILL)

    edge = Edge(settings)
    await edge.start()
    try:
        assert sorted(edge.sandboxes) == sorted(ids[:2])
        for sid in ids[:2]:  # adopted with their ranges, claimed again by this edge
            c = edge.sandboxes[sid].handle
            assert c.id_base == bases[sid] and c.id_range is not None
        for i, sid in enumerate(ids[:2]):
            r = await edge.exec(sid, ExecRequest(cmd="cat /work/mark; pgrep -c sleep"))
            assert r.stdout == f"{i}\n1\n"
        # the dead one was reaped completely
        assert not dsec_mounts(victim)
        assert not any(p.name == victim for p in dsec_cgroups("dur-"))
        sb = await edge.create(SandboxSpec(image="python"))
        assert (await edge.exec(sb.id, ExecRequest(cmd="echo new"))).stdout == "new\n"
        assert edge.sandboxes[sb.id].handle.id_base not in {bases[i] for i in ids[:2]}
    finally:
        await edge.close()
    assert not dsec_mounts("dur-")
    assert not dsec_cgroups("dur-")
    assert not [m for m in Path("/proc/mounts").read_text().splitlines() if str(settings.run_dir) in m]
    sandboxes = settings.edge_run_dir / "sandboxes"
    assert not sandboxes.exists() or not list(sandboxes.iterdir())


async def test_reconciler_removes_orphans(edge):
    """Resources no record claims (a crash between steps) are removed by the reconciler."""
    sb = await edge.create(SandboxSpec(image="python"))
    # Forget the sandbox without stopping it, as if the record were lost.
    s = edge.sandboxes.pop(sb.id)
    edge._detach(s)
    edge.store.delete(sb.id)
    pid = s.handle.pid
    assert Path(f"/proc/{pid}").exists()
    assert any(p.name == sb.id for p in dsec_cgroups(edge.name))
    removed = await edge.reconcile()
    assert removed["sandboxes"] >= 1
    for _ in range(100):  # the killed init is reaped by its parent
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the orphan sandbox's init survived the reconciler")
    assert not any(p.name == sb.id for p in dsec_cgroups(edge.name))
    assert not (edge.backend.sandboxes_dir / sb.id).exists()


async def test_replay_survives_an_edge_restart(edge_dirs, python_image):
    from dsec.models import Step

    settings = EdgeSettings(
        name="rpl" + os.urandom(2).hex(), reconcile_interval_s=3600, fncall_image="", **edge_dirs
    )
    req = ExecRequest(cmd="echo run >> /work/log; wc -l < /work/log", step=Step(trajectory="t", index=0))
    first = Edge(settings)
    await first.start()
    sb = await first.create(SandboxSpec(image="python"))
    r1 = await first.exec(sb.id, req)
    await first.close(stop_sandboxes=False)  # the edge goes away, the sandbox stays

    second = Edge(settings)
    await second.start()
    try:
        r2 = await second.exec(sb.id, req)
        assert (r2.stdout, r2.replayed, r2.seq) == (r1.stdout, True, r1.seq)
        assert (await second.exec(sb.id, ExecRequest(cmd="wc -l < /work/log"))).stdout == "1\n"
        entries = (await second.trajectory(sb.id))["entries"]
        assert [e["seq"] for e in entries] == [1, 2]  # numbering continues across the restart
    finally:
        await second.close()


async def test_one_edge_per_name_and_its_lock_file_goes_with_it(edge: Edge, edge_dirs) -> None:
    from dsec import errors

    lock = Path("/run/dsec-edges") / f"{edge.name}.lock"
    assert lock.exists()
    twin = Edge(EdgeSettings(name=edge.name, reconcile_interval_s=3600, fncall_image="", **edge_dirs))
    with pytest.raises(errors.Conflict):
        twin._lock_name()
    await edge.close()
    assert not lock.exists()  # no file per edge name ever run on the host
    twin._lock_name()  # the name is free again
    assert lock.exists()
    os.close(twin._lock_fd)
    lock.unlink()
