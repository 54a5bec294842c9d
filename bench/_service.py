"""A real `dsec up` for the robustness runs (soak, API fuzz): like `_common.running_service`, but
it keeps the service log (for tracebacks) and yields the process id, edge name and dirs that
the leak checks need."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Target:
    """A running `dsec up`: where it listens and what it owns on the host."""

    url: str
    token: str
    pid: int
    edge: str
    run_dir: Path
    data_dir: Path
    log: Path | None = None


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"dsec up exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(url + "/v1/health", timeout=2)
            if r.status_code == 200 and r.json().get("edges"):
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_service(
    prefix: str = "rb",
    *,
    fncall: bool = False,
    keep_log: bool = True,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Target]:
    """`dsec up` on a free port with a throwaway data dir over the shared layer store.

    `fncall=False` starts no fncall worker sandboxes (a soak then owns every sandbox of the
    edge). The log stays in a temp dir (printed path) when `keep_log`; SIGTERM at the end."""
    from dsec.service import free_port

    tmp = Path(tempfile.mkdtemp(prefix=f"dsec-{prefix}-"))
    port = free_port()
    edge = (prefix + secrets.token_hex(4))[:12]
    run_dir = Path(f"/run/dsec-{prefix}-{port}")
    env = dict(
        os.environ,
        DSEC_EDGE_LAYERS_DIR=os.environ.get("DSEC_TEST_LAYERS", "/var/lib/dsec/layers"),
        DSEC_EDGE_RUN_DIR=str(run_dir),
        DSEC_CONFIG=str(tmp / "client.json"),
        DSEC_EDGE_NAME=edge,
        DSEC_EDGE_RECONCILE_INTERVAL_S="3600",
        **(extra_env or {}),
    )
    if not fncall:
        env["DSEC_EDGE_FNCALL_IMAGE"] = ""
    data = tmp / "data"
    log = tmp / "up.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsec.cli", "up", "--port", str(port), "--data-dir", str(data)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        token = (data / "admin-token").read_text().strip()
        yield Target(url, token, proc.pid, edge, run_dir, data, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with open("/proc/self/mounts") as m:  # never rmtree through a mount a killed edge left
            mounted = any(ln.split()[1].startswith(str(run_dir)) for ln in m)
        if not mounted:
            shutil.rmtree(run_dir, ignore_errors=True)
        if keep_log:
            shutil.rmtree(data, ignore_errors=True)
            print(f"service log: {log}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
