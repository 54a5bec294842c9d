"""Node loss is an answer, not a hang (issue #14): an edge that stops answering is given up
within seconds; its sandboxes answer sandbox_lost (410), calls in flight end at once, their
quota is released, new work goes elsewhere; when it answers again, what was given up is
stopped there (nothing counted twice, nothing left running), and an edge back within the
window keeps its sandboxes."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time

import httpx
import pytest

from dsec import errors
from dsec.client import Client
from dsec.cluster.local import remove_edge_leftovers
from dsec.service import free_port

from .conftest import _env, remove_run_dir, start, stop_all, wait_healthy

pytestmark = [pytest.mark.root, pytest.mark.e2e]

LOST_AFTER_S = 3.0


def _healthy_edges(url: str) -> int:
    return int(httpx.get(url + "/v1/health", timeout=5).json().get("edges", 0))


def _wait(cond, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_an_edge_that_stops_answering_is_given_up_and_reconciled(tmp_path, python_image):
    run_id = secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env["DSEC_EDGE_FNCALL_IMAGE"] = ""
    env["DSEC_CLUSTER_TOKEN"] = "dsec_" + secrets.token_urlsafe(24)
    env["DSEC_APISERVER_EDGE_LOST_AFTER_S"] = str(LOST_AFTER_S)
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    data = tmp_path / "api"
    procs = {
        "api": start(
            ["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "api.log"
        )
    }

    def edge(name: str) -> None:
        procs[name] = start(
            ["edge", "--apiserver", url, "--name", name, "--port", str(ports[name]),
             "--data-dir", str(tmp_path / name), "--run-dir", f"/run/dsec-e2e-{run_id}-{name}",
             "--max-sandboxes", "10", "--no-keep-sandboxes"],
            env, tmp_path / f"{name}.log",
        )  # fmt: skip

    ports = {"la": free_port(), "lb": free_port()}
    for name in ports:
        edge(name)
    try:
        wait_healthy(url, edges=2)
        admin = (data / "admin-token").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=60) as http:
            assert (
                http.post("/v1/projects", json={"name": "nl", "quota": {"max_sandboxes": 8}}).status_code
                == 200
            )
            tok = http.post("/v1/principals", json={"name": "nl-user", "projects": ["nl"]}).json()["token"]
            assert http.post("/v1/projects", json={"name": "nl-other"}).status_code == 200
            other_tok = http.post(
                "/v1/principals", json={"name": "nl-other-user", "projects": ["nl-other"]}
            ).json()["token"]
        c = Client(url, tok)
        other = Client(url, other_tok)
        sbs = [c.create("python", memory_mb=64, project="nl") for _ in range(6)]
        on_b = [s for s in sbs if s.id.startswith("lb-")]
        on_a = [s for s in sbs if s.id.startswith("la-")]
        assert on_a and on_b, [s.id for s in sbs]

        # 1. edge lb stops answering (SIGSTOP: its sandboxes run on, it answers nothing) while
        # an exec waits on it: the exec ends with sandbox_lost soon after, not at its timeout
        caught: list[BaseException] = []

        def wait_exec() -> None:
            try:
                on_b[0].exec("sleep 60", timeout=120)
            except BaseException as e:
                caught.append(e)

        waiter = threading.Thread(target=wait_exec)
        waiter.start()
        time.sleep(0.5)
        os.kill(procs["lb"].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        waiter.join(30)
        assert not waiter.is_alive()
        took = time.monotonic() - stopped_at
        assert caught and isinstance(caught[0], errors.SandboxLost), caught
        assert caught[0].status == 410 and took < LOST_AFTER_S + 4, took
        _wait(lambda: _healthy_edges(url) == 1, 10, "unhealthy")
        # its sandboxes answer sandbox_lost at once; their quota is free: new creates go to la
        for s in on_b:
            t = time.monotonic()
            with pytest.raises(errors.SandboxLost) as ei:
                s.exec("true")
            assert time.monotonic() - t < 2 and ei.value.code == "sandbox_lost"
            # to another tenant a lost sandbox is not found, as any id it may not see: no oracle
            with pytest.raises(errors.SandboxNotFound):
                other.get(s.id)
            with pytest.raises(errors.SandboxNotFound):
                other.sandbox(s.id).exec("true")
        fresh = [c.create("python", memory_mb=64, project="nl") for _ in range(len(on_b))]
        assert all(s.id.startswith("la-") for s in fresh)
        with pytest.raises(errors.QuotaExceeded):  # 8 = the survivors on la + the fresh ones... and no more
            for _ in range(8):
                fresh.append(c.create("python", memory_mb=64, project="nl"))
        assert len(on_a) + len(fresh) == 8
        # the listing still answers (the silent edge is not asked)
        t = time.monotonic()
        assert {i.id for i in c.list(project="nl")} == {s.id for s in on_a + fresh}
        assert time.monotonic() - t < 3

        # 2. lb answers again: what was given up is stopped there, the ids stay lost
        os.kill(procs["lb"].pid, signal.SIGCONT)
        _wait(lambda: _healthy_edges(url) == 2, 15, "back")
        _wait(lambda: not _on_edge(ports["lb"], env), 15, "the lost sandboxes stopped on lb")
        with pytest.raises(errors.SandboxLost):
            on_b[1].exec("true")

        # 3. edge la is killed (SIGKILL: its sandboxes survive it) and comes back after it was
        # given up: it re-adopts its survivors, the control plane stops them; the quota
        # was released once, nothing runs unaccounted
        killed = procs.pop("la")
        killed.kill()
        killed.wait()
        _wait(lambda: _healthy_edges(url) == 1, 10, "la given up")
        for s in on_a + fresh:
            with pytest.raises(errors.SandboxLost):
                s.exec("true")
        edge("la")
        _wait(lambda: _healthy_edges(url) == 2, 60, "la back")
        _wait(lambda: not _on_edge(ports["la"], env), 15, "the survivors stopped on la")
        assert c.list(project="nl") == []
        with pytest.raises(errors.SandboxNotFound):  # lost now by the edge's record too (not its view)
            other.get(on_a[0].id)
        room = [c.create("python", memory_mb=64, project="nl") for _ in range(8)]  # the whole quota again
        c.stop_many([s.id for s in room])
        c.close()
        other.close()
    finally:
        stop_all(procs)
        for name in ports:
            remove_edge_leftovers(name)  # (the sandboxes of an edge killed and not restarted)
            remove_run_dir(f"/run/dsec-e2e-{run_id}-{name}")


def _on_edge(port: int, env: dict[str, str]) -> list[object]:
    """What an edge itself lists (asked directly, with the cluster token)."""
    auth = {"Authorization": f"Bearer {env['DSEC_CLUSTER_TOKEN']}"}
    r = httpx.get(f"http://127.0.0.1:{port}/v1/sandboxes", headers=auth, timeout=10)
    return list(r.json()["sandboxes"])
