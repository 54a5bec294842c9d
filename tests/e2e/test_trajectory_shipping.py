"""The trajectory log survives its edge (issue #14): edges ship their logs to the control
plane; after an edge is lost, `sb.trajectory()` returns everything shipped and says how much
may be missing, and the logged steps replay in a new sandbox on another edge."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest

from dsec import errors
from dsec.client import Client
from dsec.cluster.local import remove_edge_leftovers
from dsec.service import free_port

from .conftest import _env, remove_run_dir, start, stop_all, wait_healthy

pytestmark = [pytest.mark.root, pytest.mark.e2e]

STEP = "echo step{i} >> /work/side; wc -l < /work/side"


def test_a_lost_edges_trajectory_is_read_from_the_control_plane_and_replays(tmp_path, python_image):
    run_id = secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env.update(DSEC_EDGE_FNCALL_IMAGE="", DSEC_APISERVER_EDGE_LOST_AFTER_S="3")
    env["DSEC_CLUSTER_TOKEN"] = "dsec_" + secrets.token_urlsafe(24)
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    data = tmp_path / "api"
    procs = {
        "api": start(["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "a.log")
    }
    for name in ("sa", "sb"):
        procs[name] = start(
            ["edge", "--apiserver", url, "--name", name, "--port", str(free_port()),
             "--data-dir", str(tmp_path / name), "--run-dir", f"/run/dsec-e2e-{run_id}-{name}",
             "--max-sandboxes", "10", "--no-keep-sandboxes"],
            env, tmp_path / f"{name}.log",
        )  # fmt: skip
    try:
        wait_healthy(url, edges=2)
        admin = (data / "admin-token").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=60) as http:
            for project in ("tp", "other"):
                assert http.post("/v1/projects", json={"name": project}).status_code == 200
            tok = http.post("/v1/principals", json={"name": "tp-user", "projects": ["tp"]}).json()["token"]
            other = http.post("/v1/principals", json={"name": "o-user", "projects": ["other"]}).json()[
                "token"
            ]
        c = Client(url, tok)
        made = [c.create("python", memory_mb=64, project="tp") for _ in range(4)]
        sb = next(s for s in made if s.id.startswith("sa-"))
        outs = [sb.exec(STEP.format(i=i), step=("traj-S", i)).stdout.strip() for i in range(6)]
        assert outs == [str(i) for i in range(1, 7)]
        before = sb.trajectory()
        time.sleep(2.5)  # shipped within about a second
        killed = procs.pop("sa")
        killed.kill()
        killed.wait()

        deadline = time.monotonic() + 15
        while True:
            try:
                sb.exec("true")
            except errors.SandboxLost:
                break
            except errors.Unavailable:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        t = sb.trajectory()
        assert t.source == "control-plane" and t.shipped is not None
        assert [e.seq for e in t.entries] == [e.seq for e in before.entries]
        assert [(e.trajectory, e.step) for e in t.entries if e.trajectory] == [
            ("traj-S", i) for i in range(6)
        ]
        assert t.shipped.shipped_seq == before.entries[-1].seq and "was lost" in t.shipped.note
        assert t.stats.acknowledged >= t.shipped.shipped_seq
        # only edges ship (the cluster token), and only their own sandboxes' entries
        row = [sb.id, 99, 99, "exec", "{}", None, "{}", None, None, None, 0.0, "tp"]
        forged = {"edge": "sb", "rows": [row]}
        tenant = {"Authorization": f"Bearer {tok}"}
        r = httpx.post(url + "/v1/edges/trajectories", json=forged, headers=tenant)
        assert r.status_code == 401, r.text
        auth = {"Authorization": f"Bearer {env['DSEC_CLUSTER_TOKEN']}"}
        r = httpx.post(url + "/v1/edges/trajectories", json=forged, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert [e.seq for e in sb.trajectory().entries] == [e.seq for e in before.entries]
        # only the sandbox's own project reads it
        with Client(url, other) as o, pytest.raises((errors.SandboxLost, errors.SandboxNotFound)):
            o.sandbox(sb.id).trajectory()

        # a new sandbox on the other edge replays the logged steps: same files, same tags
        new = c.create("python", memory_mb=64, project="tp")
        assert new.id.startswith("sb-")
        done = new.replay(t)
        assert done["replayed"] == 6
        assert new.exec("cat /work/side").stdout.split() == [f"step{i}" for i in range(6)]
        again = new.exec(STEP.format(i=3), step=("traj-S", 3))  # a rollout going on: already done
        assert again.replayed and again.stdout.strip() == "4"
        assert new.exec(STEP.format(i=6), step=("traj-S", 6)).stdout.strip() == "7"
        c.stop_many([s.id for s in made if not s.id.startswith("sa-")] + [new.id])
        c.close()
    finally:
        stop_all(procs)
        for name in ("sa", "sb"):
            remove_edge_leftovers(name)  # (the sandboxes of an edge killed and not restarted)
            remove_run_dir(f"/run/dsec-e2e-{run_id}-{name}")
