"""Helpers shared by the benchmarks: percentiles, table rows, timed baselines."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path


def pct(xs: list[float], p: float) -> float:
    """The p-quantile of `xs` (seconds) in milliseconds."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


def row(name: str, xs: list[float], base: float | None = None) -> str:
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
    argv = ["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "--rm", "--network=none",
            "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768",
            "--rootfs", f"{rootfs}:O", "/bin/true"]  # fmt: skip
    return timed_cmd(argv, n)
