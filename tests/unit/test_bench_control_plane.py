"""The control-plane simulation (bench/bench_control_plane.py) in its quick mode, in-process: the
real apiserver over 100 fake edges (simulation) takes 5,000 creates through the SDK. Checks that
the output adds up (every create placed once, on a registered edge, counted by the quota, none
over an edge's capacity), not how fast it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.bench_control_plane import FakeEdge, run, run_http

from dsec import errors
from dsec.models import SandboxSpec

pytestmark = pytest.mark.timeout(120)


async def test_quick_simulation_adds_up() -> None:
    runs, text = await run(edges=100, n=5000, concurrency=64, watch_s=0.5)
    (r,) = runs
    assert r.ok == r.n == 5000, text
    assert not r.errors, text
    assert r.placed_ids == r.ok and r.wrong_edge == 0, text
    assert sum(r.per_edge.values()) == r.ok, text
    assert len(r.per_edge) == 100
    assert r.quota_sandboxes == r.ok, text
    assert not r.over_capacity, text
    assert len(r.placements) >= r.ok  # one timed decision per placed create (more if retried)
    assert r.poll_cpu and r.wall_s > 0 and r.cpu_s > 0 and r.rss_end > 0
    assert "fake edges (simulation)" in text and "| placement decision" in text
    assert "5000 of 5000 placed" in text and "0 edges over capacity" in text


async def test_the_apiserver_in_a_process_of_its_own_adds_up(tmp_path: Path) -> None:
    """The burst over real HTTP against an apiserver child: its CPU alone is counted."""
    r = await run_http(str(tmp_path / "iam.db"), "SQLite", edges=50, n=1000, concurrency=32)
    assert r.ok == r.n == 1000 and not r.errors
    assert r.placed_ids == r.ok and r.wrong_edge == 0 and r.quota_sandboxes == r.ok
    assert sum(r.per_edge.values()) == r.ok and len(r.per_edge) == 50 and not r.over_capacity
    assert len(r.placements) >= r.ok and r.cpu_s > 0 and "apiserver process alone" in r.iam


async def test_fake_edge_keeps_consistent_books() -> None:
    e = FakeEdge("fake0", cpu=1.0, memory_mb=4096)
    a = await e.create(SandboxSpec(cpu=0.5, memory_mb=256, project="p", labels={"k": "v"}))
    b = await e.create(SandboxSpec(cpu=0.5, memory_mb=256, project="q"))
    assert a.id.startswith("fake0-") and a.edge == "fake0"
    with pytest.raises(errors.CapacityExhausted):  # its CPU is taken
        await e.create(SandboxSpec(cpu=0.5, memory_mb=256))
    st = await e.status()
    assert st.used["sandboxes"] == 2 and st.used["cpu"] == 1.0 and st.by_project == {"p": 1, "q": 1}
    assert [i.id for i in await e.list({"k": "v"}, None, None)] == [a.id]
    assert [i.id for i in await e.list({}, None, {"q"})] == [b.id]
    assert (await e.get(a.id, {"p"})).spec.labels == {"k": "v"}
    with pytest.raises(errors.SandboxNotFound):  # another project's
        await e.get(a.id, {"q"})
    await e.stop(a.id, None)
    assert (await e.status()).used["sandboxes"] == 1
    with pytest.raises(errors.UnsupportedOperation):
        await e.exec(b.id, None, None)  # type: ignore[arg-type]
