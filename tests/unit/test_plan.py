"""`dsec plan`: the sizing arithmetic (dsec.plan), the measurement over a fake SDK client,
the cgroup usage reads on fake trees, and the CLI through typer's CliRunner."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from dsec.cli.main import app
from dsec.cli.plan_cmd import MeasureError, measure
from dsec.isolation.cgroups import CgroupHost
from dsec.plan import PlanError, PlanInput, plan

# The worked example, by hand: 512 rollouts x 20 env steps x 2 s = 20480 sandbox-seconds per
# step; in a 600 s budget that is 20480 / 600 = 34.13 sandboxes busy at once; x 1.5 headroom
# = 51.2 -> 52 sandboxes. A node of 16 cores and 64 GiB holds 16 / 1 = 16 by CPU and
# 65536 / 2048 = 32 by memory: CPU binds at 16 a node, so ceil(52 / 16) = 4 edges;
# 52 cores and 52 x 2 GiB = 104 GiB in all.
EXAMPLE = PlanInput(
    batch=512,
    env_steps=20,
    step_seconds=2,
    budget_seconds=600,
    sandbox_cpu=1,
    sandbox_memory_mb=2048,
    node_cores=16,
    node_memory_gib=64,
    max_sandboxes_per_node=4000,
)


def test_worked_example() -> None:
    p = plan(EXAMPLE)
    assert p.busy_sandbox_seconds == 20480
    assert p.min_concurrent == pytest.approx(34.1333, abs=1e-4)
    assert p.sandboxes == 52
    assert (p.per_node_by_cpu, p.per_node_by_memory, p.per_node_by_max) == (16, 32, 4000)
    assert (p.per_node, p.binding, p.edges) == (16, "cpu", 4)
    assert (p.total_cores, p.total_memory_gib) == (52, 104)
    assert (p.node_cores_used, p.node_memory_gib_used) == (16, 32)
    assert p.warnings == []


def test_memory_binds() -> None:
    # a quarter core and 4 GiB each: 64 by CPU, 16 by memory -> memory binds, 52 / 16 -> 4 edges
    p = plan(replace(EXAMPLE, sandbox_cpu=0.25, sandbox_memory_mb=4096))
    assert (p.per_node_by_cpu, p.per_node_by_memory, p.per_node, p.binding, p.edges) == (
        64,
        16,
        16,
        "memory",
        4,
    )
    assert p.total_cores == 13 and p.total_memory_gib == 208


def test_max_sandboxes_binds() -> None:
    # 10000 x 10 x 1 s / 100 s = 1000 at once (headroom 1); 100 a node at most -> 10 edges
    p = plan(
        replace(
            EXAMPLE,
            batch=10000,
            env_steps=10,
            step_seconds=1,
            budget_seconds=100,
            headroom=1.0,
            sandbox_cpu=0.01,
            sandbox_memory_mb=16,
            max_sandboxes_per_node=100,
        )
    )
    assert p.sandboxes == 1000
    assert (p.per_node, p.binding, p.edges) == (100, "max_sandboxes", 10)


def test_exact_products_are_not_rounded_up() -> None:
    # 100 x 3 x 1 / 100 = 3.0 exactly: 3 sandboxes, not 4; 2 x 1.5 = 3.0 too
    assert (
        plan(
            replace(EXAMPLE, batch=100, env_steps=3, step_seconds=1, budget_seconds=100, headroom=1)
        ).sandboxes
        == 3
    )
    assert plan(replace(EXAMPLE, batch=100, env_steps=2, step_seconds=1, budget_seconds=100)).sandboxes == 3
    # 0.3 cores hold three 0.1-core sandboxes despite 0.3 / 0.1 == 2.9999999999999996
    assert plan(replace(EXAMPLE, node_cores=0.3, sandbox_cpu=0.1)).per_node_by_cpu == 3


def test_tie_names_cpu_first_and_tiny_work_needs_one() -> None:
    p = plan(replace(EXAMPLE, sandbox_cpu=1, sandbox_memory_mb=4096))  # 16 and 16
    assert (p.per_node_by_cpu, p.per_node_by_memory, p.binding) == (16, 16, "cpu")
    p = plan(replace(EXAMPLE, batch=1, env_steps=1, step_seconds=0.01, budget_seconds=600))
    assert (p.sandboxes, p.edges) == (1, 1)
    assert (p.node_cores_used, p.node_memory_gib_used) == (1, 2)  # the one node holds one


def test_warnings() -> None:
    # one rollout's 20 steps x 40 s = 800 s > 600 s: infeasible whatever the cluster
    p = plan(replace(EXAMPLE, step_seconds=40))
    assert any("E*T = 800 s" in w for w in p.warnings)
    # 10 rollouts x 20 x 2 / 50 = 8 -> 12 with headroom: more sandboxes than rollouts
    p = plan(replace(EXAMPLE, batch=10, budget_seconds=50))
    assert p.sandboxes == 12 and any("more than the 10 rollouts" in w for w in p.warnings)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"batch": 0}, "batch"),
        ({"batch": -3}, "batch"),
        ({"budget_seconds": 0}, "budget_seconds"),
        ({"budget_seconds": -1.0}, "budget_seconds"),
        ({"env_steps": 0}, "env_steps"),
        ({"step_seconds": math.nan}, "step_seconds"),
        ({"headroom": 0.99}, "headroom"),
        ({"headroom": 4.01}, "headroom"),
        ({"sandbox_cpu": 0}, "sandbox_cpu"),
        ({"sandbox_memory_mb": -1}, "sandbox_memory_mb"),
        ({"node_cores": math.inf}, "node_cores"),
        ({"max_sandboxes_per_node": 0}, "max_sandboxes_per_node"),
    ],
)
def test_bad_input(change: dict[str, Any], field: str) -> None:
    with pytest.raises(PlanError) as e:
        plan(replace(EXAMPLE, **change))
    assert e.value.field == field


def test_headroom_bounds_are_allowed() -> None:
    assert plan(replace(EXAMPLE, headroom=1.0)).sandboxes == 35
    assert plan(replace(EXAMPLE, headroom=4.0)).sandboxes == 137  # 34.13 x 4 = 136.5


def test_sandbox_larger_than_a_node() -> None:
    with pytest.raises(PlanError, match="more memory than a node has") as e:
        plan(replace(EXAMPLE, sandbox_memory_mb=65 * 1024))
    assert e.value.field == "node_memory_gib"
    with pytest.raises(PlanError, match="more cores"):
        plan(replace(EXAMPLE, sandbox_cpu=17))


# --- the CLI -------------------------------------------------------------------------------

runner = CliRunner()
EXAMPLE_ARGS = ["plan", "-B", "512", "-E", "20", "-T", "2", "-S", "600", "--cpu", "1", "--memory-mb", "2048"]
NODE = ["--node-cores", "16", "--node-memory-gib", "64"]


def _flat(output: str) -> str:
    """The text of rich's error panel, its borders and line wraps taken out."""
    return " ".join(output.replace("│", " ").split())


def test_cli_table() -> None:
    r = runner.invoke(app, [*EXAMPLE_ARGS, *NODE])
    assert r.exit_code == 0, r.output
    for text in ("34.1", "52", "cpu 16 <", "memory 32", "binding constraint", "104.0"):
        assert text in r.output, (text, r.output)
    assert "edges" in r.output and "│ 4 " in r.output


def test_cli_json_has_every_input_and_output() -> None:
    r = runner.invoke(app, [*EXAMPLE_ARGS, *NODE, "--max-sandboxes", "1000", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["inputs"] == {
        "batch": 512,
        "env_steps": 20,
        "step_seconds": 2,
        "budget_seconds": 600,
        "sandbox_cpu": 1,
        "sandbox_memory_mb": 2048,
        "node_cores": 16,
        "node_memory_gib": 64,
        "max_sandboxes_per_node": 1000,
        "headroom": 1.5,
    }
    assert out["sandboxes"] == 52 and out["edges"] == 4 and out["binding"] == "cpu"
    assert out["min_concurrent"] == pytest.approx(20480 / 600)
    assert out["per_node_by_max"] == 1000 and out["total_memory_gib"] == 104
    assert out["sources"] == {"cpu": "given", "memory_mb": "given"} and out["measurement"] is None


def test_cli_node_defaults_to_this_machine() -> None:
    r = runner.invoke(app, [*EXAMPLE_ARGS, "--json"], env={"DSEC_EDGE_MAX_SANDBOXES": "77"})
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["inputs"]
    assert out["node_cores"] == os.cpu_count()
    assert out["node_memory_gib"] > 0 and out["max_sandboxes_per_node"] == 77
    r = runner.invoke(app, [*EXAMPLE_ARGS, "--json"], env={"DSEC_EDGE_MAX_SANDBOXES": None})
    assert json.loads(r.stdout)["inputs"]["max_sandboxes_per_node"] == 4000  # EdgeSettings'


@pytest.mark.parametrize(
    ("args", "flag", "says"),
    [
        (["-B", "0"], "--batch", "greater than 0"),
        (["-S", "-5"], "--budget-seconds", "greater than 0"),
        (["-H", "0.5"], "--headroom", "between 1 and 4"),
        (["-H", "4.5"], "--headroom", "between 1 and 4"),
        (["--memory-mb", "0"], "--memory-mb", "greater than 0"),
        (["--memory-mb", str(80 * 1024)], "--node-memory-gib", "larger node or a smaller sandbox"),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], flag: str, says: str) -> None:
    r = runner.invoke(app, [*EXAMPLE_ARGS, *NODE, *args])
    assert r.exit_code == 2, r.output
    assert flag in _flat(r.output) and says in _flat(r.output), r.output


def test_cli_needs_sizes_or_measure() -> None:
    r = runner.invoke(app, ["plan", "-B", "8", "-E", "1", "-T", "1", "-S", "60", "--cpu", "1"])
    assert r.exit_code == 2 and "give --memory-mb, or --measure IMAGE" in _flat(r.output), r.output


# --- measuring (a fake SDK client) ------------------------------------------------------------


class FakeSandbox:
    def __init__(self, client: FakeClient, n: int) -> None:
        self.client, self.id, self.cpu_usec = client, f"e-{n}", 1000

    def refresh(self) -> Any:
        usage = {"memory_bytes": 20 << 20, "cpu_usec": self.cpu_usec, **self.client.extra}
        if not self.client.usage:
            usage = {}
        return SimpleNamespace(usage=usage, telemetry={"oom_kills": self.client.oom})

    def exec(self, cmd: str, timeout: float) -> Any:
        self.cpu_usec += self.client.cpu_usec
        return SimpleNamespace(exit_code=self.client.exit_code, timed_out=False, duration=2.0, stderr="boom")


class FakeClient:
    def __init__(self, **kw: Any) -> None:
        self.created: list[FakeSandbox] = []
        self.stopped: list[str] = []
        self.extra = kw.get("extra", {"memory_peak_bytes": 100 << 20})
        self.cpu_usec = kw.get("cpu_usec", 1_500_000)
        self.exit_code = kw.get("exit_code", 0)
        self.oom = kw.get("oom", 0)
        self.usage = kw.get("usage", True)

    def create(self, image: str, **spec: Any) -> FakeSandbox:
        assert spec["labels"] == {"dsec-plan": "measure"} and spec["backend"] == "container"
        sb = FakeSandbox(self, len(self.created))
        self.created.append(sb)
        return sb

    def stop_many(self, ids: list[str]) -> None:
        self.stopped += ids


def _measure(client: FakeClient) -> dict[str, Any]:
    return measure(
        client, "python", "true", n=2, backend="container", cpu_limit=1.0, memory_limit_mb=2048, timeout=5
    )


def test_measure_takes_peak_memory_and_cpu_over_wall_time() -> None:
    c = FakeClient()
    m = _measure(c)
    assert m["memory_mb"] == 100  # the peak, not the 20 MiB left after
    assert m["cpu"] == 0.75  # 1.5 s of CPU over a 2 s exec
    assert [s["memory_after_mb"] for s in m["samples"]] == [20, 20]
    assert c.stopped == ["e-0", "e-1"] and m["notes"] == []


def test_measure_without_a_peak_falls_back_and_says_so() -> None:
    m = _measure(FakeClient(extra={}))
    assert m["memory_mb"] == 20 and "no memory peak" in m["notes"][0]


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"exit_code": 1}, "exited 1 in e-0: boom"),
        ({"oom": 1}, "out of memory"),
        ({"usage": False}, "no memory or CPU use"),  # an edge older than SandboxInfo.usage
    ],
)
def test_measure_failures_still_stop_the_sandboxes(kw: dict[str, Any], says: str) -> None:
    c = FakeClient(**kw)
    with pytest.raises(MeasureError, match=says):
        _measure(c)
    assert c.created and c.stopped == [s.id for s in c.created]


# --- cgroup usage reads (fake trees) -----------------------------------------------------------


def test_cgroup_usage_v2(tmp_path: Path) -> None:
    d = tmp_path / "dsec" / "s1"
    d.mkdir(parents=True)
    (d / "memory.current").write_text("1048576\n")
    (d / "memory.peak").write_text("4194304\n")
    (d / "cpu.stat").write_text("usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n")
    host = CgroupHost(root=tmp_path, version=2)
    assert host.usage("s1") == {"memory_bytes": 1 << 20, "memory_peak_bytes": 4 << 20, "cpu_usec": 2500}
    (d / "memory.peak").unlink()  # kernels before 5.19
    assert host.usage("s1") == {"memory_bytes": 1 << 20, "cpu_usec": 2500}
    assert host.usage("gone") == {}


def test_cgroup_usage_v1(tmp_path: Path) -> None:
    mounts = {n: tmp_path / n for n in ("memory", "cpuacct", "pids")}
    (mounts["memory"] / "dsec" / "s1").mkdir(parents=True)
    (mounts["cpuacct"] / "dsec" / "s1").mkdir(parents=True)
    (mounts["memory"] / "dsec" / "s1" / "memory.usage_in_bytes").write_text("2097152\n")
    (mounts["memory"] / "dsec" / "s1" / "memory.max_usage_in_bytes").write_text("8388608\n")
    (mounts["cpuacct"] / "dsec" / "s1" / "cpuacct.usage").write_text("7000123\n")  # ns
    host = CgroupHost(root=tmp_path, version=1, v1_mounts=mounts)
    assert host.usage("s1") == {"memory_bytes": 2 << 20, "memory_peak_bytes": 8 << 20, "cpu_usec": 7000}
