"""apiserver and edges as separate processes: placement across two edges, retries, restarts."""

from __future__ import annotations

import glob
import json
import secrets
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from dsec import errors
from dsec.client import Client
from dsec.service import free_port

from .conftest import _env, start, wait_healthy

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def test_two_edges_share_load_and_survive_apiserver_restart(tmp_path, python_image):
    data = tmp_path / "data"
    run_id = secrets.token_hex(4)  # unique across concurrent pytest runs
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env["DSEC_EDGE_FNCALL_IMAGE"] = ""  # capacities below count user sandboxes only
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    procs = {
        "api": start(
            ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
        )
    }
    edges = {"ea": 3, "eb": 6}
    try:
        deadline = time.monotonic() + 30
        while not (data / "cluster-token").exists() or not (data / "admin-token").exists():
            assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()
            time.sleep(0.05)
        token = (data / "cluster-token").read_text().strip()
        admin = (data / "admin-token").read_text().strip()
        for name, cap in edges.items():
            port = free_port()
            procs[name] = start(
                [
                    "edge",
                    "--apiserver",
                    url,
                    "--name",
                    name,
                    "--port",
                    str(port),
                    "--data-dir",
                    str(data),
                    "--run-dir",
                    f"/run/dsec-e2e-{run_id}-{name}",
                    "--token",
                    token,
                    "--max-sandboxes",
                    str(cap),
                    "--no-keep-sandboxes",
                ],
                env,
                tmp_path / f"{name}.log",
            )
        wait_healthy(url, edges=2)
        with Client(url, admin) as c:
            sbs = [c.create("python", memory_mb=128) for _ in range(9)]
            per_edge = Counter(s.id.split("-")[0] for s in sbs)
            # placement spreads by load and never over-fills an edge: each edge has the final say
            assert per_edge == {"ea": 3, "eb": 6}, per_edge
            with pytest.raises(errors.CapacityExhausted) as exc:
                c.create("python", memory_mb=128)
            assert exc.value.status == 503
            for s in sbs:
                assert s.exec("hostname").stdout.strip() == s.id

            # restart the apiserver: it keeps no per-sandbox state, edges re-register
            old = procs.pop("api")
            old.terminate()
            old.wait(60)
            procs["api"] = start(
                ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
            )
            wait_healthy(url, edges=2)
        # a new connection (the old keep-alive ones died with the old apiserver process)
        with Client(url, admin) as c2:
            for s in sbs:
                assert c2.sandbox(s.id).exec("echo still here").stdout == "still here\n"
            c2.stop_many([s.id for s in sbs])
            assert c2.list() == []
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
    for name in edges:
        shutil.rmtree(f"/run/dsec-e2e-{run_id}-{name}", ignore_errors=True)
        assert not glob.glob(f"/sys/fs/cgroup/*/dsec/{name}-*")
        assert not [m for m in Path("/proc/mounts").read_text().splitlines() if f"dsec-{name}-" in m]


@pytest.mark.parametrize("through", ["relay", "registry"])
def test_snapshot_restores_on_another_edge(tmp_path, python_image, through, request):
    """The edge holding a snapshot is full: the apiserver moves the snapshot's layer to the
    other edge (its own layer store) over HTTP and restores it there; or, with a registry,
    the snapshot was pushed when made and the other edge pulls it (no relay)."""
    from .conftest import LAYERS

    data = tmp_path / "data"
    run_id = secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env["DSEC_EDGE_FNCALL_IMAGE"] = ""
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    procs = {
        "api": start(
            ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
        )
    }
    store_b = tmp_path / "layers-b"  # a second host's store: the base image, no snapshots
    subprocess.run(["cp", "-al", str(LAYERS), str(store_b)], check=True)
    store_a = LAYERS
    registry = None
    if through == "registry":
        registry = request.getfixturevalue("registry_server")
        env["DSEC_EDGE_REGISTRY"] = f"{registry.url}/t{secrets.token_hex(4)}"
        store_a = tmp_path / "layers-a"  # pushes record blobs beside layers: not in the shared store
        subprocess.run(["cp", "-al", str(LAYERS), str(store_a)], check=True)

    def edge(name: str, cap: int, layers: Path) -> subprocess.Popen[bytes]:
        return start(
            [
                "edge",
                "--apiserver",
                url,
                "--name",
                name,
                "--port",
                str(free_port()),
                "--data-dir",
                str(data),
                "--run-dir",
                f"/run/dsec-e2e-{run_id}-{name}",
                "--token",
                (data / "cluster-token").read_text().strip(),
                "--max-sandboxes",
                str(cap),
                "--no-keep-sandboxes",
            ],
            {**env, "DSEC_EDGE_LAYERS_DIR": str(layers)},
            tmp_path / f"{name}.log",
        )

    try:
        deadline = time.monotonic() + 30
        while not (data / "cluster-token").exists() or not (data / "admin-token").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        admin = (data / "admin-token").read_text().strip()
        procs["sa"] = edge("sa", 1, store_a)
        wait_healthy(url, edges=1)
        with Client(url, admin) as c:
            src = c.create("python", memory_mb=128)
            src.exec("mkdir -p /work && echo from-sa > /work/state")
            snap = src.snapshot()
            for f in (store_b / "images").glob("snap-*"):
                f.unlink()  # the copy of the store may hold other runs' snapshots
            procs["sb"] = edge("sb", 4, store_b)
            wait_healthy(url, edges=2)
            restored = c.create(snapshot=snap.id)  # sa is full (src): restored on sb
            assert restored.id.startswith("sb-")
            assert restored.files.read("/work/state") == "from-sa\n"
            layer_b = store_b / "layers" / snap.layer.split("@")[0]
            assert layer_b.is_dir()
            source = json.loads(next(layer_b.glob("*/layer.json")).read_text())["source"]
            assert source["type"] == ("registry" if registry else "pulled")
            if registry is not None:  # pushed by sa when made, pulled once by sb
                assert registry.requests("PUT", f"/manifests/{snap.id}") == 1
                assert registry.requests("GET", f"/manifests/{snap.id}") == 1
            restored.stop()
            src.stop()
            c.delete_snapshot(snap.id)  # from both edges
            assert not (store_b / "images" / f"{snap.id}.json").exists()
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
    for name in ("sa", "sb"):
        shutil.rmtree(f"/run/dsec-e2e-{run_id}-{name}", ignore_errors=True)
        assert not glob.glob(f"/sys/fs/cgroup/*/dsec/{name}-*")


def test_kill_9_of_edge_and_apiserver_under_load_loses_nothing(tmp_path, python_image):
    import signal
    import threading

    data = tmp_path / "data"
    run_id = secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env["DSEC_EDGE_FNCALL_IMAGE"] = ""
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"

    def apiserver() -> subprocess.Popen[bytes]:
        return start(
            ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
        )

    def edge() -> subprocess.Popen[bytes]:
        argv = ["edge", "--apiserver", url, "--name", "fk", "--port", str(edge_port), "--data-dir", str(data)]
        argv += [
            "--run-dir",
            f"/run/dsec-e2e-{run_id}-fk",
            "--token",
            (data / "cluster-token").read_text().strip(),
        ]
        return start(argv, env, tmp_path / "edge.log")

    edge_port = free_port()
    procs = {"api": apiserver()}
    try:
        deadline = time.monotonic() + 30
        while not (data / "cluster-token").exists() or not (data / "admin-token").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        admin = (data / "admin-token").read_text().strip()
        procs["edge"] = edge()
        wait_healthy(url, edges=1)
        with Client(url, admin) as c:
            sbs = [c.create("python", memory_mb=128) for _ in range(6)]
            for i, s in enumerate(sbs):
                s.exec(f"echo {i} > /work/mark; nohup sleep 600 >/dev/null 2>&1 &")
        stop = threading.Event()
        outcomes: Counter[str] = Counter()

        args = (url, admin, [s.id for s in sbs], stop, outcomes)
        workers = [threading.Thread(target=_load, args=args) for _ in range(3)]
        for w in workers:
            w.start()
        time.sleep(1.0)
        procs["edge"].send_signal(signal.SIGKILL)
        procs["edge"].wait()
        time.sleep(0.5)
        procs["edge"] = edge()
        wait_healthy(url, edges=1)
        time.sleep(1.0)
        procs["api"].send_signal(signal.SIGKILL)
        procs["api"].wait()
        procs["api"] = apiserver()
        wait_healthy(url, edges=1)
        time.sleep(1.0)
        stop.set()
        for w in workers:
            w.join(30)
        assert outcomes["ok"] > 50, outcomes
        with Client(url, admin) as c:
            # nothing lost: every sandbox, its files and its background process
            assert sorted(i.id for i in c.list()) == sorted(s.id for s in sbs)
            for i, s in enumerate(sbs):
                r = c.sandbox(s.id).exec("cat /work/mark; pgrep -c sleep")
                assert r.stdout == f"{i}\n1\n", r
            c.stop_many([s.id for s in sbs])
            assert c.list() == []
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
    time.sleep(0.5)
    shutil.rmtree(f"/run/dsec-e2e-{run_id}-fk", ignore_errors=True)
    assert not glob.glob("/sys/fs/cgroup/*/dsec/fk-*")
    assert not [m for m in Path("/proc/mounts").read_text().splitlines() if f"dsec-e2e-{run_id}" in m]


def _load(url: str, token: str, ids: list[str], stop: object, outcomes: Counter[str]) -> None:
    """Keep calling exec on every sandbox while processes die under it."""
    with Client(url, token, retries=0) as c:
        while not stop.is_set():  # type: ignore[attr-defined]
            for sid in ids:
                try:
                    c.sandbox(sid).exec("true", timeout=5)
                    outcomes["ok"] += 1
                except errors.DsecError as e:
                    outcomes[e.code] += 1
                except Exception as e:  # a connection cut mid-request
                    outcomes[type(e).__name__] += 1
