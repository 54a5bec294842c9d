"""`dsec cluster up` (issue #14): PostgreSQL, N apiservers and M edges, each edge a host of its
own in a network namespace; an edge cut off by its link going down or killed is given up;
`dsec cluster down` leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from dsec import errors
from dsec.client import Client

from .conftest import cluster_up

pytestmark = [pytest.mark.root, pytest.mark.e2e]

DSEC = [sys.executable, "-m", "dsec.cli"]


def _healthy(url: str) -> int:
    try:
        return int(httpx.get(url + "/v1/health", timeout=3).json().get("edges", 0))
    except httpx.HTTPError:
        return -1


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_cluster_up_runs_edges_as_hosts_and_down_removes_everything(cluster_dir):
    d = cluster_dir
    state = cluster_up(d)
    bridge = json.loads((d / "cluster.json").read_text())["bridge"]
    try:
        assert set(state) == {"apiservers", "edges", "token", "database", "registry"}
        urls = [a["url"] for a in state["apiservers"]]
        assert len(urls) == 2 and state["database"].startswith("postgresql://")
        assert state["registry"] and httpx.get(state["registry"] + "/v2/", timeout=10).status_code == 200
        own_net = os.readlink("/proc/self/ns/net")
        for e in state["edges"]:
            # the process itself, in a network namespace of its own, with its own address there
            assert b"edge" in Path(f"/proc/{e['pid']}/cmdline").read_bytes()
            assert os.readlink(f"/proc/{e['pid']}/ns/net") != own_net
            addrs = subprocess.run(
                ["ip", "-n", e["netns"], "-4", "-o", "addr"], capture_output=True, text=True
            )
            assert e["address"] in addrs.stdout
        for u in urls:
            _wait(lambda u=u: _healthy(u) == 2, 30, "both edges healthy")

        with Client(urls, state["token"]) as c:
            sbs = [c.create("python", memory_mb=64) for _ in range(6)]
            by_edge = Counter(s.id.split("-")[0] for s in sbs)
            assert set(by_edge) == {e["name"] for e in state["edges"]}, by_edge
            for s in sbs:
                assert s.exec("hostname").stdout.strip() == s.id
            e0, e1 = state["edges"]
            on = {e["name"]: [s for s in sbs if s.id.startswith(e["name"] + "-")] for e in state["edges"]}

            # e1 is cut off: its namespace's link goes down; within seconds it is given up
            subprocess.run(["ip", "-n", e1["netns"], "link", "set", "eth0", "down"], check=True)
            t = time.monotonic()
            _wait(lambda: _healthy(urls[0]) == 1, 15, "e1 given up")
            assert time.monotonic() - t < 10
            for s in on[e1["name"]]:
                with pytest.raises(errors.SandboxLost):
                    s.exec("true")
            assert on[e0["name"]][0].exec("echo still").stdout == "still\n"
            subprocess.run(["ip", "-n", e1["netns"], "link", "set", "eth0", "up"], check=True)
            _wait(lambda: _healthy(urls[1]) == 2, 20, "e1 back")

            # e0 is killed (SIGKILL, by the pid the cluster reported)
            os.kill(e0["pid"], signal.SIGKILL)
            _wait(lambda: _healthy(urls[0]) == 1, 15, "e0 given up")
            for s in on[e0["name"]]:
                with pytest.raises(errors.SandboxLost):
                    s.exec("true")
            fresh = c.create("python", memory_mb=64)
            assert fresh.id.startswith(e1["name"] + "-")
            # a snapshot goes to the cluster's registry when made
            fresh.exec("echo kept > /work/k")
            snap = fresh.snapshot()
            fresh.stop()
            tags = httpx.get(f"{state['registry']}/v2/dsec/tags/list", timeout=10).json()["tags"]
            assert snap.id in tags, tags
    finally:
        down = subprocess.run(
            [*DSEC, "cluster", "down", "--dir", str(d), "--purge"], capture_output=True, text=True
        )
    assert down.returncode == 0, down.stderr[-2000:]
    # nothing left: processes, namespaces, the bridge, mounts, the database server
    for m in [*state["apiservers"], *state["edges"]]:
        assert (
            not Path(f"/proc/{m['pid']}").exists()
            or b"dsec" not in Path(f"/proc/{m['pid']}/cmdline").read_bytes()
        )
    netns = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    assert not any(e["netns"] in netns for e in state["edges"])
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert bridge not in links
    from dsec.cluster.local import remove_edge_leftovers

    assert all(remove_edge_leftovers(e["name"]) == [] for e in state["edges"])  # e0's were killed by down
    mounts = Path("/proc/mounts").read_text()
    assert not any(e["name"] in mounts for e in state["edges"])
    for gone in (urls[0] + "/v1/health", state["registry"] + "/v2/"):
        with pytest.raises(httpx.HTTPError):
            httpx.get(gone, timeout=2)
    assert not d.exists()
