"""The soak (bench/soak.py) shortened for CI: 300 create -> exec -> stop cycles at concurrency 20
against a real `dsec up`, then nothing may be left on the host and memory must stay flat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench._service import Target
from bench.soak import SoakResult, run_soak

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def soak(service: Any) -> SoakResult:
    env = service.env
    t = Target(
        url=service.url,
        token=service.token,
        pid=service.procs["up"].pid,
        edge=env["DSEC_EDGE_NAME"],
        run_dir=Path(env["DSEC_EDGE_RUN_DIR"]),
        data_dir=service.data_dir,
    )
    res = run_soak(t, cycles=300, concurrency=20, memory_mb=128, max_growth=0.2, settle_timeout=15)
    print(res.report())
    return res


@pytest.mark.timeout(120)
def test_soak_cycles_all_succeed(soak: SoakResult) -> None:
    assert soak.ok == soak.cycles, soak.report()
    assert not soak.errors, soak.report()


def test_soak_leaves_nothing_behind(soak: SoakResult) -> None:
    leaks = {k: v for k, v in soak.leaks.items() if k != "zombies"}
    assert not leaks, soak.report()
    assert not soak.api_leftovers, soak.report()
    assert soak.end["fds"] <= soak.start["fds"] + 8, soak.report()


def test_soak_leaves_no_zombies(soak: SoakResult) -> None:
    assert "zombies" not in soak.leaks, soak.report()


def test_soak_memory_is_flat(soak: SoakResult) -> None:
    assert soak.growth <= soak.max_growth, soak.report()
