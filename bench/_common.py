"""Helpers shared by the benchmarks: percentiles, table rows, timed baselines."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx


def pct(xs: list[float], p: float) -> float:
    """The p-quantile of `xs` (seconds) in milliseconds."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


def row(name: str, xs: list[float], base: float | None = None) -> str:
    if not xs:  # a baseline that could not run here (e.g. podman not installed)
        return f"| {name} | n/a | n/a |" + (" n/a |" if base is not None else "")
    ratio = f" {pct(xs, 0.5) / base:.2f}x |" if base else ""
    return f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.95):.2f} |{ratio}"


def timed_cmd(argv: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
    return out


def podman_run_true(rootfs: Path, n: int) -> list[float]:
    """`podman run --rm` of `rootfs` (overlay on top, runc: crun 1.8 refuses hybrid cgroups)."""
    if not shutil.which("podman"):
        return []
    argv = [
        "podman",
        "--cgroup-manager=cgroupfs",
        "--runtime",
        "runc",
        "run",
        "--rm",
        "--network=none",
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=32768:32768",
        "--rootfs",
        f"{rootfs}:O",
        "/bin/true",
    ]
    return timed_cmd(argv, n)


@contextlib.contextmanager
def running_service(edge_name: str) -> Iterator[tuple[str, str]]:
    """A real `dsec up` on a free port with a throwaway data dir (the shared layer store);
    yields (url, admin token) and stops it (SIGTERM: sandboxes stopped, nothing left)."""
    from dsec.service import free_port

    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
    port = free_port()
    run_dir = f"/run/dsec-bench-{port}"
    env = dict(
        os.environ,
        DSEC_EDGE_LAYERS_DIR="/var/lib/dsec/layers",
        DSEC_EDGE_RUN_DIR=run_dir,
        DSEC_CONFIG=str(tmp / "client.json"),
        DSEC_EDGE_NAME=edge_name,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli", "up", "--port", str(port), "--data-dir", str(tmp)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/v1/health").json().get("edges"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield url, (tmp / "admin-token").read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def in_process_edge(name: str) -> AsyncIterator[Any]:
    """An Edge in this process (root) with a throwaway run dir; closed and removed after."""
    from dsec.config import EdgeSettings
    from dsec.edge import Edge

    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    edge = Edge(EdgeSettings(name=name, run_dir=run_dir, reconcile_interval_s=3600, fncall_image=""))
    await edge.start()
    try:
        yield edge
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
