"""Who loads what: the SDK is light, and neither server drags in the other's code.

Each import runs in a fresh interpreter (this test process has loaded everything)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SERVER = ("dsec.apiserver", "dsec.edge", "dsec.backends", "dsec.isolation", "dsec.layers", "dsec.http")
PROBE = r"""
import json, sys
import {module}
maps = open("/proc/self/maps").read()
print(json.dumps({{"modules": sorted(m for m in sys.modules if m.startswith("dsec")),
                  "ctypes": "ctypes" in sys.modules,
                  "libs": sorted({{l.split()[-1] for l in maps.splitlines() if ".so" in l}})}}))
"""


def loaded(module: str) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout)
    return out


def within(modules: object, packages: tuple[str, ...]) -> list[str]:
    assert isinstance(modules, list)
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


@pytest.mark.parametrize("module", ["dsec", "dsec.client", "dsec.models"])
def test_the_sdk_loads_no_server_code_and_no_native_library(module):
    seen = loaded(module)
    assert within(seen["modules"], SERVER) == []
    assert not seen["ctypes"]  # no libc / libnftables handle behind a trainer's `import dsec`
    libs = seen["libs"]
    assert isinstance(libs, list)
    assert not [lib for lib in libs if "nftables" in lib or "seccomp" in lib]


def test_the_apiserver_loads_no_edge_backend_or_isolation_code():
    seen = loaded("dsec.apiserver.app")
    assert within(seen["modules"], ("dsec.edge", "dsec.backends", "dsec.isolation")) == []


def test_the_edge_server_loads_nothing_of_the_apiserver():
    seen = loaded("dsec.edge.server")
    assert within(seen["modules"], ("dsec.apiserver",)) == []
    assert "dsec.edge.edge" in seen["modules"]  # the probe sees what it loads
