"""`dsec plan --measure` against a real `dsec up`: real sandboxes, their real cgroup use."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsec.cli.main import app
from dsec.client import Client

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def _left() -> list[str]:
    with Client() as c:
        return [i.id for i in c.list(labels={"dsec-plan": "measure"})]


def test_plan_measures_real_sandboxes_and_stops_them(service):
    args = ["plan", "-B", "512", "-E", "20", "-T", "2", "-S", "600", "--node-cores", "16"]
    args += ["--node-memory-gib", "64", "--measure", "python", "--measure-n", "2"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    m = out["measurement"]
    assert out["sources"] == {"cpu": "measured", "memory_mb": "measured"}
    assert len(m["samples"]) == 2 and m["image"] == "python"
    # the default workload touches 64 MiB and keeps its one core (the limit) busy for a second;
    # a loaded host gives it less than the whole core
    assert all(s["memory_peak_mb"] >= 64 for s in m["samples"]), m
    assert all(0 < s["cores"] <= 1.1 for s in m["samples"]), m
    assert out["inputs"]["sandbox_memory_mb"] == m["memory_mb"] >= 64
    assert out["inputs"]["sandbox_cpu"] == m["cpu"]
    assert out["sandboxes"] == 52 and out["edges"] >= 1
    assert _left() == []  # stopped

    # given values win over measured ones; the table names where each came from
    r = CliRunner().invoke(app, [*args, "--cpu", "0.5"])
    assert r.exit_code == 0, r.output
    assert "cpu given, memory measured" in r.output and "measured on 2 container sandboxes" in r.output
    assert _left() == []
