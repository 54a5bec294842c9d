"""Real service processes on free ports: `dsec up`, or `dsec apiserver` + `dsec edge`s."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.service import free_port

from ..conftest import LAYERS

DSEC = [sys.executable, "-m", "dsec.cli"]


@dataclass
class Service:
    url: str
    token: str
    data_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.procs.pop(name)
        p.send_signal(sig)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_healthy(url: str, timeout: float = 120.0, edges: int = 1) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            r = httpx.get(url + "/v1/health", timeout=2)
            if r.status_code == 200 and r.json().get("edges", 0) >= edges:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")


def _env(tmp: Path, run_name: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DSEC_EDGE_LAYERS_DIR=str(LAYERS),
        DSEC_EDGE_RUN_DIR=f"/run/{run_name}",
        DSEC_CONFIG=str(tmp / "client.json"),
        DSEC_EDGE_RECONCILE_INTERVAL_S="3600",
        DSEC_EDGE_NAME="e" + secrets.token_hex(4),
        DSEC_EDGE_FNCALL_WORKERS="2",
        # builds' storage: its own, removed with the service (dsec_up), where the builds'
        # unprivileged ids reach it (not under pytest's 0700 tmp)
        DSEC_EDGE_BUILDS_DIR=f"/tmp/dsec-builds-{run_name}",
    )
    return env


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen([*DSEC, *args], env=env, stdout=f, stderr=subprocess.STDOUT)


def stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process (a stopped one is continued first), wait, SIGKILL what lingers."""
    for p in procs.values():
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
    for p in procs.values():
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def remove_run_dir(run_dir: str | Path) -> None:
    """An edge's run directory and what is mounted under it (its tmpfs: an edge killed with
    SIGKILL, or one that keeps its sandboxes, leaves it mounted)."""
    from dsec.isolation.procs import mounts_under, unmount_all

    run_dir = Path(run_dir)
    for m in sorted(mounts_under(run_dir), key=len, reverse=True):
        unmount_all(Path(m))
    shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def dsec_up(tmp: Path, extra_env: dict[str, str] | None = None) -> Iterator[Service]:
    """`dsec up` in `tmp` as a user runs it (with `extra_env` on top); stopped and cleaned
    up afterwards."""
    port = free_port()
    env = _env(tmp, f"dsec-e2e-{secrets.token_hex(4)}")  # unique across concurrent pytest runs
    env.update(extra_env or {})
    data = tmp / "data"
    proc = start(["up", "--port", str(port), "--data-dir", str(data)], env, tmp / "up.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
    except TimeoutError:
        proc.kill()
        raise RuntimeError((tmp / "up.log").read_text()[-3000:]) from None
    cfg = json.loads((tmp / "client.json").read_text())
    svc = Service(url, cfg["token"], data, {"up": proc}, env)
    yield svc
    for name in list(svc.procs):
        svc.stop(name)
    from dsec.isolation.procs import mounts_under, unmount_all

    run_dir = env["DSEC_EDGE_RUN_DIR"]
    for m in sorted(mounts_under(Path(run_dir).parent), key=len, reverse=True):  # a killed edge's
        if m == run_dir or m.startswith(f"{run_dir}/"):
            unmount_all(Path(m))
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(env["DSEC_EDGE_BUILDS_DIR"], ignore_errors=True)
    # uvicorn re-raises the signal after a graceful shutdown
    assert proc.returncode in (0, -15), (tmp / "up.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, python_image: str, code_image: str
) -> Iterator[Service]:
    """`dsec up` as a user runs it."""
    tmp = tmp_path_factory.mktemp("dsec-up")
    with dsec_up(tmp) as svc:
        os.environ["DSEC_CONFIG"] = str(tmp / "client.json")
        try:
            yield svc
        finally:
            os.environ.pop("DSEC_CONFIG", None)


@pytest.fixture
def cluster_dir() -> Iterator[Path]:
    """Where a cluster (cluster_up) lives: a directory PostgreSQL's user may reach; removed
    afterwards."""
    root = Path(tempfile.mkdtemp(prefix="dsec-cluster-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root / "cluster"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cluster_up(d: Path, apiservers: int = 2, edges: int = 2) -> dict[str, Any]:
    """`dsec cluster up --json` in `d` (no fncall workers: they are not what these tests
    look at); its JSON, or the test fails with the command's stderr."""
    env = {**os.environ, "DSEC_EDGE_FNCALL_IMAGE": ""}
    up = subprocess.run(
        [*DSEC, "cluster", "up", "--apiservers", str(apiservers), "--edges", str(edges), "--dir", str(d),
         "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr[-3000:]
    return dict(json.loads(up.stdout))


def tenants(svc: Service, *projects: str) -> dict[str, str]:
    """Make each project with a principal of its own (`<project>-user`); their tokens."""
    tokens = {}
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}) as admin:
        for project in projects:
            assert admin.post("/v1/projects", json={"name": project}).status_code == 200
            r = admin.post("/v1/principals", json={"name": f"{project}-user", "projects": [project]})
            assert r.status_code == 200, r.text
            tokens[project] = r.json()["token"]
    return tokens
