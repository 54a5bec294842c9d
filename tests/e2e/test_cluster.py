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

import httpx
import pytest

from dsec import errors
from dsec.client import Client
from dsec.cluster.local import remove_edge_leftovers
from dsec.service import free_port

from ..conftest import LAYERS
from .conftest import _env, remove_run_dir, start, stop_all, wait_healthy

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def test_two_edges_share_load_and_survive_apiserver_restart(tmp_path, python_image, registry_url):
    data = tmp_path / "data"
    run_id = secrets.token_hex(4)  # unique across concurrent pytest runs
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env["DSEC_EDGE_FNCALL_IMAGE"] = ""  # capacities below count user sandboxes only
    env["DSEC_EDGE_REGISTRY"] = registry_url  # as a cluster runs (the shared store has the image)
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


def _tenant(url: str, admin: str, project: str) -> str:
    """A project and a principal of its own; the principal's token."""
    auth = {"authorization": f"Bearer {admin}"}
    httpx.post(url + "/v1/projects", json={"name": project}, headers=auth).raise_for_status()
    r = httpx.post(
        url + "/v1/principals", json={"name": f"{project}-user", "projects": [project]}, headers=auth
    )
    r.raise_for_status()
    return str(r.json()["token"])


def test_a_snapshot_reaches_another_edge_only_through_the_registry(tmp_path, python_image, registry_server):
    """Two edges, each with a layer store of its own (the base image, no snapshots) and one
    registry, as `dsec cluster up` runs them. A snapshot made on `sa` is pushed when made;
    another project can neither use nor delete it (and `sb` fetches none of its layers for
    that project); its project's announced burst makes `sb` pull it and fill a warm pool;
    creates from it are served there (sa is full), forks of those work; deleting it
    through the apiserver removes its pool, every copy and its manifest in the registry,
    after which a create from it is image_not_found."""
    data = tmp_path / "data"
    run_id = secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env["DSEC_EDGE_FNCALL_IMAGE"] = ""
    env["DSEC_APISERVER_CAPACITY_LEAD_S"] = "0"
    repo = f"t{secrets.token_hex(4)}"
    env["DSEC_EDGE_REGISTRY"] = f"{registry_server.url}/{repo}"
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    procs = {
        "api": start(
            ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
        )
    }
    stores = {}
    for name in ("sa", "sb"):  # a second host's store: the base image, no snapshots
        stores[name] = tmp_path / f"layers-{name}"
        subprocess.run(["cp", "-al", str(LAYERS), str(stores[name])], check=True)
        for f in (stores[name] / "images").glob("snap-*"):
            f.unlink()  # the shared store may hold other runs' snapshots

    def edge(name: str, cap: int) -> subprocess.Popen[bytes]:
        return start(
            [
                "edge", "--apiserver", url, "--name", name, "--port", str(free_port()),
                "--data-dir", str(data), "--run-dir", f"/run/dsec-e2e-{run_id}-{name}",
                "--token", (data / "cluster-token").read_text().strip(),
                "--max-sandboxes", str(cap), "--no-keep-sandboxes",
            ],
            {**env, "DSEC_EDGE_LAYERS_DIR": str(stores[name])},
            tmp_path / f"{name}.log",
        )  # fmt: skip

    def manifest_status(tag: str) -> int:
        r = httpx.get(
            f"{registry_server.url}/v2/{repo}/manifests/{tag}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        return r.status_code

    shape = {"memory_mb": 64, "cpu": 0.5}
    try:
        deadline = time.monotonic() + 30
        while not (data / "cluster-token").exists() or not (data / "admin-token").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        admin = (data / "admin-token").read_text().strip()
        procs["sa"] = edge("sa", 1)
        wait_healthy(url, edges=1)
        mine, theirs = _tenant(url, admin, "p1"), _tenant(url, admin, "p2")
        with Client(url, mine) as c:
            src = c.create("python", project="p1", **shape)
            src.exec("mkdir -p /work && echo from-sa > /work/state")
            snap = src.snapshot()  # sa is full from now on (src)
        assert manifest_status(snap.id) == 200  # pushed when made
        procs["sb"] = edge("sb", 6)
        wait_healthy(url, edges=2)
        layer_b = stores["sb"] / "layers" / snap.layer.split("@")[0]

        with Client(url, theirs) as other:  # another project: nothing, and nothing pulled for it
            with pytest.raises(errors.ImageNotFound):
                other.create(snapshot=snap.id, project="p2", **shape)
            with pytest.raises(errors.ImageNotFound):
                other.delete_snapshot(snap.id)
        assert not layer_b.exists() and manifest_status(snap.id) == 200

        with Client(url, mine) as c:
            burst = c.announce_capacity("p1", 2, snap.id, **shape)  # type: ignore[arg-type]
            deadline = time.monotonic() + 120
            while (b := next(x for x in c.capacity() if x.id == burst.id)).state in (
                "scheduled",
                "provisioning",
            ):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert b.state == "ready" and b.prewarmed == {"sb": 2}, b.actions
            assert layer_b.is_dir()  # sb pulled it to pre-warm
            source = json.loads(next(layer_b.glob("*/layer.json")).read_text())["source"]
            assert source["type"] == "registry"

            def ready() -> int:
                r = httpx.get(url + "/v1/pools", headers={"authorization": f"Bearer {admin}"})
                return sum(p["ready"] for p in r.json()["pools"] if p["spec"]["image"] == snap.id)

            deadline = time.monotonic() + 120
            while ready() < 2:
                assert time.monotonic() < deadline, "the pool filled"
                time.sleep(0.2)
            restored = c.create(snapshot=snap.id, project="p1", **shape)
            assert restored.id.startswith("sb-")
            assert restored.info.timings_ms.get("pool") is not None  # from the warm pool
            assert restored.files.read("/work/state") == "from-sa\n"
            kids = restored.fork(2)
            assert [k.id.split("-")[0] for k in kids] == ["sb", "sb"]
            for k in kids:
                assert k.exec("cat /work/state").stdout == "from-sa\n"
            assert registry_server.requests("PUT", f"/{repo}/manifests/{snap.id}") == 1
            assert registry_server.requests("GET", f"/{repo}/manifests/{snap.id}") >= 1

            c.stop_many([*(k.id for k in kids), restored.id, src.id])
            c.delete_snapshot(snap.id)  # the pool's stock, both copies, the registry's manifest
            assert manifest_status(snap.id) == 404
            for store in stores.values():
                assert not (store / "images" / f"{snap.id}.json").exists()
            with pytest.raises(errors.ImageNotFound) as exc:
                c.create(snapshot=snap.id, project="p1", **shape)
            assert exc.value.status == 404
            assert c.list() == []
    finally:
        stop_all(procs)
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
    passed = False
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

        acked: dict[str, set[int]] = {}
        args = (url, admin, [s.id for s in sbs], stop, outcomes, acked)
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
            # nothing acknowledged is missing from the trajectory logs, through both kills
            assert sum(map(len, acked.values())) == outcomes["ok"]
            for sid, seqs in acked.items():
                t = c.sandbox(sid).trajectory()
                logged = {e.seq for e in t.entries}
                assert seqs <= logged, (sid, sorted(seqs - logged), t.stats)
            c.stop_many([s.id for s in sbs])
            assert c.list() == []
        passed = True
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
        if not passed:  # leave nothing either (the checks below are skipped)
            remove_edge_leftovers("fk")
            remove_run_dir(f"/run/dsec-e2e-{run_id}-fk")
    time.sleep(0.5)
    shutil.rmtree(f"/run/dsec-e2e-{run_id}-fk", ignore_errors=True)
    assert not glob.glob("/sys/fs/cgroup/*/dsec/fk-*")
    assert not [m for m in Path("/proc/mounts").read_text().splitlines() if f"dsec-e2e-{run_id}" in m]


def _load(
    url: str, token: str, ids: list[str], stop: object, outcomes: Counter[str], acked: dict[str, set[int]]
) -> None:
    """Keep calling exec on every sandbox while processes die under it; the trajectory seq of
    every exec acknowledged goes into `acked`."""
    with Client(url, token, retries=0) as c:
        while not stop.is_set():  # type: ignore[attr-defined]
            for sid in ids:
                try:
                    r = c.sandbox(sid).exec("true", timeout=5)
                    acked.setdefault(sid, set()).add(r.seq)
                    outcomes["ok"] += 1
                except errors.DsecError as e:
                    outcomes[e.code] += 1
                except Exception as e:  # a connection cut mid-request
                    outcomes[type(e).__name__] += 1


def test_a_sandbox_no_reservation_accounts_for_is_stopped(tmp_path, python_image):
    """What an edge runs that the control plane never accounted for (its create's apiserver
    died after the edge made it, or the answer was lost on the way) is an orphan: nobody knows
    of it and its quota is not counted. The apiserver stops it after `orphan_after_s`, and
    leaves every accounted sandbox alone. The orphan here is made by asking the edge directly
    (with the cluster token), as a create whose apiserver died would have left it."""
    data = tmp_path / "data"
    run_id = secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env.update(
        DSEC_EDGE_FNCALL_IMAGE="",
        DSEC_APISERVER_ORPHAN_AFTER_S="1.5",
        DSEC_APISERVER_RECONCILE_INTERVAL_S="0.5",
    )
    api_port, edge_port = free_port(), free_port()
    url = f"http://127.0.0.1:{api_port}"
    procs = {
        "api": start(
            ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
        )
    }
    try:
        deadline = time.monotonic() + 30
        while not (data / "cluster-token").exists() or not (data / "admin-token").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cluster = (data / "cluster-token").read_text().strip()
        admin = (data / "admin-token").read_text().strip()
        procs["edge"] = start(
            ["edge", "--apiserver", url, "--name", "or", "--port", str(edge_port), "--data-dir", str(data),
             "--run-dir", f"/run/dsec-e2e-{run_id}-or", "--token", cluster],
            env, tmp_path / "edge.log",
        )  # fmt: skip
        wait_healthy(url, edges=1)
        edge = httpx.Client(
            base_url=f"http://127.0.0.1:{edge_port}",
            headers={"Authorization": f"Bearer {cluster}"},
            timeout=60,
        )
        with Client(url, admin) as c, edge:
            kept = c.create("python", memory_mb=64)
            r = edge.post("/v1/sandboxes", json={"image": "python", "memory_mb": 64})
            assert r.status_code == 201, r.text
            orphan = r.json()["id"]
            t0 = time.monotonic()
            while orphan in {s["id"] for s in edge.get("/v1/sandboxes").json()["sandboxes"]}:
                assert time.monotonic() - t0 < 20, "the orphan was not stopped"
                time.sleep(0.2)
            assert time.monotonic() - t0 >= 1.5  # not before orphan_after_s
            time.sleep(2.0)  # several more rounds: the accounted sandbox stays
            assert [i.id for i in c.list()] == [kept.id]
            assert kept.exec("echo ok").stdout == "ok\n"
            kept.stop()
        assert "no reservation accounted for it" in (tmp_path / "api.log").read_text()
    finally:
        stop_all(procs)
        remove_edge_leftovers("or")
        remove_run_dir(f"/run/dsec-e2e-{run_id}-or")
