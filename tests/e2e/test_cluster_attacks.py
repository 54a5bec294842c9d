"""Attacks on a multi-node cluster (`dsec cluster up`: PostgreSQL, a registry, 2 apiservers, 2 edges
each in a network namespace of its own), as hostile code inside a sandbox and as a hostile tenant
holding a valid token for its own project only. Every test asserts the secure outcome: a failing
test is a finding.

- from inside sandboxes (no policy; a policy allowing 0.0.0.0/0 and some names), on each edge:
  PostgreSQL, the registry, the apiservers, both edges' APIs, the host (a listener of ours on every
  host address), cloud metadata, another tenant's sandbox, DNS names of the platform;
- tenant A against tenant B through each apiserver: B's sandbox, snapshot, trajectory, quota,
  idempotency key (and its recovery label), drains, listings;
- edge impostors: /v1/edges/register and /v1/edges/trajectories without the cluster token;
- the edges' own HTTP API reached from the host without the cluster token;
- image names with path tricks.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import cluster_up

pytestmark = [pytest.mark.root, pytest.mark.e2e]

DSEC = [sys.executable, "-m", "dsec.cli"]
EDGE_PORT = 8421
OPEN_POLICY = {
    "allow": [
        {"to": "0.0.0.0/0", "protocols": ["tcp", "udp"]},
        {"to": "example.com"},
        {"to": "localhost"},
        {"to": socket.gethostname().lower()},
    ]
}
POOL = cf.ThreadPoolExecutor(16)


# --- the cluster ---------------------------------------------------------------------------------


class Sentinel:
    """A TCP listener of ours on every host address: anything that connects is recorded (with what
    it sent first: an apiserver misled into calling it would send the cluster token)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.hits: list[tuple[str, bytes]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            conn.settimeout(1)
            data = b""
            with contextlib.suppress(OSError):
                data = conn.recv(4096)
            self.hits.append((peer[0], data))
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@dataclass
class Cluster:
    dir: Path
    apis: list[str]
    admin: str
    edges: list[dict[str, Any]]
    registry: str
    database: str
    bridge_ip: str
    pg_port: int
    cluster_token: str
    sentinel: Sentinel
    clients: list[httpx.Client] = field(default_factory=list)

    def http(self, token: str | None, api: int = 0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c = httpx.Client(base_url=self.apis[api], headers=headers, timeout=60)
        self.clients.append(c)
        return c

    @property
    def registry_port(self) -> int:
        return int(self.registry.rsplit(":", 1)[1])

    def api_ports(self) -> list[int]:
        return [int(u.rsplit(":", 1)[1]) for u in self.apis]


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    return sorted({m.group(1) for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", out)})


@pytest.fixture(scope="module")
def cluster(python_image: str) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="dsec-attack-", dir="/tmp"))
    os.chmod(root, 0o755)  # PostgreSQL's and the registry's users must reach their directories
    d = root / "cluster"
    sentinel = Sentinel()
    c: Cluster | None = None
    try:
        state = cluster_up(d)
        raw = json.loads((d / "cluster.json").read_text())
        c = Cluster(
            dir=d,
            apis=[a["url"] for a in state["apiservers"]],
            admin=state["token"],
            edges=state["edges"],
            registry=state["registry"],
            database=state["database"],
            bridge_ip=raw["subnet"].rsplit(".", 1)[0] + ".1",
            pg_port=int(raw["postgres"]["port"]),
            cluster_token=raw["cluster_token"],
            sentinel=sentinel,
        )
        yield c
    finally:
        if c is not None:
            for cl in c.clients:
                cl.close()
        sentinel.close()
        if (d / "cluster.json").exists():
            down = subprocess.run(
                [*DSEC, "cluster", "down", "--dir", str(d), "--purge"], capture_output=True, text=True
            )
            assert down.returncode == 0, down.stderr[-2000:]
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Tenant:
    project: str
    token: str
    https: list[httpx.Client]  # one per apiserver


def _tenant(c: Cluster, project: str) -> Tenant:
    admin = c.http(c.admin)
    r = admin.post("/v1/projects", json={"name": project, "quota": {}})
    assert r.status_code == 200, r.text
    r = admin.post("/v1/principals", json={"name": f"{project}-user", "projects": [project]})
    assert r.status_code == 200, r.text
    token = str(r.json()["token"])
    return Tenant(project, token, [c.http(token, i) for i in range(len(c.apis))])


@contextlib.contextmanager
def _pinned(c: Cluster, edge: str) -> Iterator[None]:
    """Every other edge drained (admin), so creates go to `edge`."""
    admin = c.http(c.admin)
    others = [e["name"] for e in c.edges if e["name"] != edge]
    for o in others:
        assert admin.post(f"/v1/edges/{o}/drain").status_code == 200
    try:
        yield
    finally:
        for o in others:
            admin.post(f"/v1/edges/{o}/undrain")


def _create(t: Tenant, api: int = 0, headers: dict[str, str] | None = None, **spec: Any) -> str:
    body = {"image": "python", "memory_mb": 128, "project": t.project, **spec}
    r = t.https[api].post("/v1/sandboxes", json=body, headers=headers or {})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _exec(t: Tenant, sid: str, cmd: str | list[str], timeout: int = 60) -> dict[str, Any]:
    r = t.https[0].post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": timeout})
    assert r.status_code == 200, r.text
    return dict(r.json())


@dataclass
class World:
    a: Tenant
    b: Tenant
    a_default: dict[str, str]  # edge name -> A's sandbox without a policy
    a_open: dict[str, str]  # edge name -> A's sandbox with OPEN_POLICY
    b_sid: str  # on edges[0], with a policy and a listener on :8080
    b_addr: str
    b_other: str  # on edges[1]
    b_snap: str
    b_key: str  # the Idempotency-Key B used
    b_trajectory: list[Any]

    def secrets_of_b(self) -> dict[str, str]:
        return {"project": self.b.project, "sid": self.b_sid, "other": self.b_other, "snapshot": self.b_snap}


ADDR_PY = (
    "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "s.connect(('192.0.2.123', 9)); print(s.getsockname()[0])"
)


@pytest.fixture(scope="module")
def world(cluster: Cluster) -> World:
    c = cluster
    suffix = secrets.token_hex(3)
    b, a = _tenant(c, f"victim-{suffix}"), _tenant(c, f"attacker-{suffix}")
    e0, e1 = (e["name"] for e in c.edges)
    key = "idem-" + secrets.token_hex(8)
    with _pinned(c, e0):
        futs = {
            "b": POOL.submit(
                _create, b, 0, {"Idempotency-Key": key}, network={"allow": [{"to": "0.0.0.0/0"}]}
            ),
            "ad": POOL.submit(_create, a),
            "ao": POOL.submit(_create, a, network=OPEN_POLICY),
        }
        got0 = {k: f.result() for k, f in futs.items()}
    with _pinned(c, e1):
        futs = {
            "b": POOL.submit(_create, b),
            "ad": POOL.submit(_create, a),
            "ao": POOL.submit(_create, a, network=OPEN_POLICY),
        }
        got1 = {k: f.result() for k, f in futs.items()}
    for sid in got0.values():
        assert sid.startswith(e0 + "-")
    for sid in got1.values():
        assert sid.startswith(e1 + "-")
    b_sid = got0["b"]
    _exec(b, b_sid, "echo b-secret > /work/secret; (setsid python3 -m http.server 8080 >/dev/null 2>&1 &)")
    b_addr = _exec(b, b_sid, ["python3", "-c", ADDR_PY])["stdout"].strip()
    r = b.https[0].post(f"/v1/sandboxes/{b_sid}/snapshot", json={})
    assert r.status_code == 201, r.text
    snap = str(r.json()["id"])
    r = b.https[0].get(f"/v1/sandboxes/{b_sid}/trajectory")
    assert r.status_code == 200, r.text
    return World(
        a=a, b=b,
        a_default={e0: got0["ad"], e1: got1["ad"]}, a_open={e0: got0["ao"], e1: got1["ao"]},
        b_sid=b_sid, b_addr=b_addr, b_other=got1["b"], b_snap=snap, b_key=key,
        b_trajectory=r.json()["entries"],
    )  # fmt: skip


def _leaks(text: str, secret: dict[str, str]) -> list[str]:
    return [k for k, v in secret.items() if v and v in text]


# --- (1) hostile code inside sandboxes ----------------------------------------------------------

PROBE_PY = r"""
import json, socket, sys, concurrent.futures as cf
targets, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
resolved = {}
for n in names:
    try:
        resolved[n] = sorted({i[4][0] for i in socket.getaddrinfo(n, None, socket.AF_INET)})
    except Exception as e:
        resolved[n] = []
def probe(t):
    kind, host, port = t
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        return [kind, host, port, "OPEN"]
    except ConnectionRefusedError:  # a reset from the target host itself: reached
        return [kind, host, port, "REACHED (refused)" if host != "127.0.0.1" else "refused-loopback"]
    except Exception as e:
        return [kind, host, port, type(e).__name__]
    finally:
        s.close()
ports = [int(p) for p in sys.argv[3].split(",") if p]
dns_targets = [["dns:" + n, a, p] for n, addrs in resolved.items() for a in addrs for p in ports]
with cf.ThreadPoolExecutor(64) as ex:
    res = list(ex.map(probe, targets + dns_targets))
print(json.dumps({"results": res, "resolved": resolved}))
"""


def _targets(c: Cluster, w: World) -> list[tuple[str, str, int]]:
    t: list[tuple[str, str, int]] = []
    for host in ("127.0.0.1", c.bridge_ip, *_host_addresses()):
        t.append(("postgres", host, c.pg_port))
        t.append(("host", host, c.sentinel.port))
        t.append(("host", host, 22))
    t.append(("registry", c.bridge_ip, c.registry_port))
    for p in c.api_ports():
        t.append(("apiserver", c.bridge_ip, p))
    for e in c.edges:
        t.append((f"edge:{e['name']}", e["address"], EDGE_PORT))
        t.append((f"edge-host:{e['name']}", e["address"], c.sentinel.port))
    t.append(("metadata", "169.254.169.254", 80))
    t.append(("other-sandbox", w.b_addr, 8080))
    return t


DNS_NAMES = [
    "localhost",
    socket.gethostname(),
    "postgres",
    "registry",
    "apiserver",
    "dsec-apiserver",
    "metadata.google.internal",
    "example.com",
]


@pytest.fixture(scope="module")
def probes(cluster: Cluster, world: World) -> dict[str, dict[str, Any]]:
    """Every target probed from each of A's sandboxes at once: {sandbox label: results}."""
    c, w = cluster, world
    targets = json.dumps(_targets(c, w))
    ports = ",".join(
        str(p) for p in {c.pg_port, c.registry_port, EDGE_PORT, c.sentinel.port, 80, *c.api_ports()}
    )
    labels = {f"default@{e}": sid for e, sid in w.a_default.items()}
    labels |= {f"open@{e}": sid for e, sid in w.a_open.items()}
    cmd = ["python3", "-c", PROBE_PY, targets, json.dumps(DNS_NAMES), ports]
    futs = {k: POOL.submit(_exec, w.a, sid, cmd, 90) for k, sid in labels.items()}
    out = {}
    for k, f in futs.items():
        r = f.result()
        assert r["exit_code"] == 0, r
        out[k] = json.loads(r["stdout"])
    return out


KINDS = ["postgres", "registry", "apiserver", "edge", "edge-host", "host", "metadata", "other-sandbox", "dns"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["default", "open"])
def test_sandbox_reaches_no_platform_address(
    probes: dict[str, dict[str, Any]], policy: str, kind: str
) -> None:
    opened = []
    for label, got in probes.items():
        if not label.startswith(policy + "@"):
            continue
        for k, host, port, outcome in got["results"]:
            if k.split(":")[0] == kind and outcome.startswith(("OPEN", "REACHED")):
                opened.append(f"{label} -> {k} {host}:{port} {outcome}")
    assert opened == [], opened


def test_sentinel_on_the_host_saw_no_sandbox(cluster: Cluster, probes: dict[str, dict[str, Any]]) -> None:
    assert cluster.sentinel.hits == [], cluster.sentinel.hits


def test_platform_names_resolve_to_nothing_reachable(probes: dict[str, dict[str, Any]]) -> None:
    """A name the platform or host may know (its hostname, localhost) gives the sandbox nothing it
    can connect to, even when its policy names it."""
    for label, got in probes.items():
        reached = [
            r for r in got["results"] if r[0].startswith("dns:") and r[3].startswith(("OPEN", "REACHED"))
        ]
        assert reached == [], (label, reached, got["resolved"])


def test_policy_rules_naming_platform_addresses_are_refused(cluster: Cluster, world: World) -> None:
    """An exact rule to an edge's, an apiserver's or the host's address is refused (400), whichever
    edge holds the sandbox (NetHost.check: 'sandboxes can never reach the platform's addresses')."""
    c, w = cluster, world
    addrs = [e["address"] for e in c.edges] + [c.bridge_ip, "169.254.169.254", w.b_addr]
    calls = [
        (edge, addr, POOL.submit(
            w.a.https[0].put, f"/v1/sandboxes/{sid}/network", json={"allow": [{"to": addr}]}
        ))
        for edge, sid in w.a_open.items()
        for addr in addrs
    ]  # fmt: skip
    accepted = [(edge, addr) for edge, addr, f in calls if f.result().status_code < 400]
    for _, sid in w.a_open.items():  # back to what it was
        w.a.https[0].put(f"/v1/sandboxes/{sid}/network", json=OPEN_POLICY)
    assert accepted == [], f"accepted rules (sandbox's edge, address): {accepted}"


# --- (2) tenant A against tenant B ------------------------------------------------------------------


def _b_alive(w: World) -> None:
    for sid in (w.b_sid, w.b_other):
        r = w.b.https[0].get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert _exec(w.b, w.b_sid, "cat /work/secret")["stdout"] == "b-secret\n"


OPS = [
    ("GET", "/v1/sandboxes/{sid}", None),
    ("POST", "/v1/sandboxes/{sid}/exec", {"cmd": "cat /work/secret"}),
    ("POST", "/v1/sandboxes/{sid}/exec/stream", {"cmd": "cat /work/secret"}),
    ("GET", "/v1/sandboxes/{sid}/files?path=/work/secret", None),
    ("GET", "/v1/sandboxes/{sid}/files/list?path=/work", None),
    ("PUT", "/v1/sandboxes/{sid}/files", {"path": "/work/pwned", "content": "x"}),
    ("GET", "/v1/sandboxes/{sid}/archive?path=/work", None),
    ("GET", "/v1/sandboxes/{sid}/trajectory", None),
    ("GET", "/v1/sandboxes/{sid}/trajectory/export", None),
    ("POST", "/v1/sandboxes/{sid}/fork", {"n": 1}),
    ("POST", "/v1/sandboxes/{sid}/snapshot", {}),
    ("POST", "/v1/sandboxes/{sid}/checkpoint", {}),
    ("POST", "/v1/sandboxes/{sid}/pause", None),
    ("PUT", "/v1/sandboxes/{sid}/network", {"allow": [{"to": "0.0.0.0/0"}]}),
    ("DELETE", "/v1/sandboxes/{sid}/network", None),
    ("POST", "/v1/sandboxes/{sid}/sessions", {}),
    ("DELETE", "/v1/sandboxes/{sid}", None),
    ("POST", "/v1/sandboxes/batch_stop", {"ids": ["{sid}", "{other}"]}),
    ("DELETE", "/v1/snapshots/{snap}", None),
    ("POST", "/v1/projects/{project}/pause", None),
    ("GET", "/v1/sandboxes?project={project}", None),
    ("POST", "/v1/sandboxes", {"image": "python", "memory_mb": 128, "project": "{project}"}),
]


def _fill(x: Any, w: World) -> Any:
    if isinstance(x, str):
        return x.format(sid=w.b_sid, other=w.b_other, snap=w.b_snap, project=w.b.project)
    if isinstance(x, list):
        return [_fill(v, w) for v in x]
    if isinstance(x, dict):
        return {k: _fill(v, w) for k, v in x.items()}
    return x


@pytest.mark.parametrize("api", [0, 1])
def test_tenant_cannot_touch_another_tenants_sandbox(cluster: Cluster, world: World, api: int) -> None:
    w = world
    client = w.a.https[api]
    futs = [
        (m, p, POOL.submit(client.request, m, _fill(p, w), json=_fill(body, w)) if body is not None
         else POOL.submit(client.request, m, _fill(p, w)))
        for m, p, body in OPS
    ]  # fmt: skip
    bad = []
    for m, p, f in futs:
        r = f.result()
        ok = r.status_code in (403, 404) or (p.endswith("batch_stop") and r.status_code == 200)
        if p.endswith("batch_stop") and r.status_code == 200:
            ok = not r.json().get("stopped")
        if not ok or "b-secret" in r.text:
            bad.append((m, p, r.status_code, r.text[:200]))
    assert bad == [], bad
    _b_alive(w)
    assert w.b_snap in w.b.https[0].get("/v1/snapshots").text
    r = w.b.https[0].get(f"/v1/sandboxes/{w.b_sid}/network")
    assert r.status_code == 200 and "0.0.0.0/0" in r.text, r.text


@pytest.mark.parametrize("edge", [0, 1])
def test_create_from_another_tenants_snapshot_is_refused(cluster: Cluster, world: World, edge: int) -> None:
    """On the edge that made it and on the one that would pull it from the registry."""
    c, w = cluster, world
    name = c.edges[edge]["name"]
    with _pinned(c, name):
        r = w.a.https[0].post(
            "/v1/sandboxes", json={"image": w.b_snap, "memory_mb": 128, "project": w.a.project}
        )
    if r.status_code == 201:
        sid = r.json()["id"]
        leaked = w.a.https[0].post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /work/secret"}).text
        w.a.https[0].delete(f"/v1/sandboxes/{sid}")
        pytest.fail(f"A made {sid} on {name} from B's snapshot {w.b_snap}: {leaked[:200]}")
    assert r.status_code in (403, 404), r.text


@pytest.mark.parametrize("api", [0, 1])
def test_reusing_another_tenants_idempotency_key_makes_your_own_sandbox(world: World, api: int) -> None:
    w = world
    r = w.a.https[api].post(
        "/v1/sandboxes",
        json={"image": "python", "memory_mb": 128, "project": w.a.project},
        headers={"Idempotency-Key": w.b_key},
    )
    assert r.status_code == 201, r.text
    got = r.json()
    w.a.https[api].delete(f"/v1/sandboxes/{got['id']}")
    assert got["id"] != w.b_sid and got["spec"]["project"] == w.a.project, got


@pytest.mark.parametrize("api", [0, 1])
def test_no_listing_shows_another_tenant(cluster: Cluster, world: World, api: int) -> None:
    """Every GET route of the OpenAPI document (ids filled with B's), and /metrics."""
    c, w = cluster, world
    client = w.a.https[api]
    spec = httpx.get(c.apis[api] + "/openapi.json", timeout=10).json()
    fill = {"sid": w.b_sid, "name": w.b_snap, "cid": w.b_sid + "x", "project": w.b.project}
    paths = ["/metrics"]
    for route, ops in spec["paths"].items():
        if "get" in ops and route != "/v1/events":
            paths.append(re.sub(r"\{(\w+)\}", lambda m: fill.get(m.group(1), "x"), route))
    params = {"path": "/work", "format": "jsonl"}
    futs = [(p, POOL.submit(client.get, p, params=params, headers={"X-API-Key": w.a.token})) for p in paths]
    bad = []
    for p, f in futs:
        r = f.result()
        hidden = {k: v for k, v in w.secrets_of_b().items() if v not in p}
        if r.status_code >= 500 or _leaks(r.text, hidden):
            bad.append((p, r.status_code, _leaks(r.text, hidden), r.text[:200]))
    assert bad == [], bad
    assert len(paths) > 20


def test_events_show_nothing_of_another_tenant(cluster: Cluster, world: World) -> None:
    c, w = cluster, world
    seen: list[str] = []
    ready = threading.Barrier(len(c.apis) + 1)

    def listen(api: int) -> None:
        auth = {"Authorization": f"Bearer {w.a.token}"}
        with (
            httpx.Client(base_url=c.apis[api], timeout=httpx.Timeout(30, read=2)) as cl,
            contextlib.suppress(httpx.ReadTimeout),
            cl.stream("GET", "/v1/events", headers=auth) as r,
        ):
            ready.wait(10)
            for line in r.iter_lines():
                seen.append(line)

    threads = [threading.Thread(target=listen, args=(i,)) for i in range(len(c.apis))]
    for t in threads:
        t.start()
    ready.wait(10)
    sid = _create(w.b)
    assert w.b.https[1].delete(f"/v1/sandboxes/{sid}").status_code == 204
    own = _create(w.a)
    w.a.https[0].delete(f"/v1/sandboxes/{own}")
    for t in threads:
        t.join(15)
    text = "\n".join(seen)
    assert sid not in text and w.b.project not in text, text[:500]
    assert own in text  # (the stream works)


def test_tenant_cannot_announce_capacity_for_another_project(world: World) -> None:
    w = world
    body = {"project": w.b.project, "count": 2, "memory_mb": 128}
    for cl in w.a.https:
        r = cl.post("/v1/capacity", json=body)
        assert r.status_code in (403, 404), r.text
        assert w.b.project not in cl.get("/v1/capacity").text


def test_tenant_cannot_drain_an_edge(cluster: Cluster, world: World) -> None:
    c, w = cluster, world
    for cl in w.a.https:
        for e in c.edges:
            for verb in ("drain", "undrain"):
                r = cl.post(f"/v1/edges/{e['name']}/{verb}")
                assert r.status_code == 403, r.text
    edges = c.http(c.admin, 1).get("/v1/edges").json()["edges"]
    assert not [e["name"] for e in edges if e.get("draining")]


def test_tenant_cannot_read_or_change_another_projects_quota(cluster: Cluster, world: World) -> None:
    w = world
    for cl in w.a.https:
        for m, p, body in [
            ("GET", f"/v1/projects/{w.b.project}", None),
            ("PUT", f"/v1/projects/{w.b.project}", {"quota": {"max_sandboxes": 0}}),
            ("PATCH", f"/v1/projects/{w.b.project}", {"quota": {"max_sandboxes": 0}}),
            ("POST", "/v1/projects", {"name": w.b.project, "quota": {"max_sandboxes": 0}}),
            ("POST", "/v1/principals", {"name": "evil", "projects": [w.b.project]}),
        ]:
            r = cl.request(m, p, json=body) if body is not None else cl.request(m, p)
            assert r.status_code in (403, 404, 405), (m, p, r.status_code, r.text)
            assert "max_sandboxes" not in r.text or r.status_code >= 400
    sid = _create(w.b)  # B can still create
    w.b.https[0].delete(f"/v1/sandboxes/{sid}")


# --- (3) edge impostors -----------------------------------------------------------------------------


def _edges_seen(c: Cluster) -> list[list[tuple[str, str]]]:
    out = []
    for i in range(len(c.apis)):
        edges = c.http(c.admin, i).get("/v1/edges").json()["edges"]
        out.append(sorted((e["name"], str(e.get("url"))) for e in edges))
    return out


def _stored_rows(c: Cluster, sid: str) -> int:
    import psycopg

    with psycopg.connect(c.database) as db:
        row = db.execute("SELECT count(*) FROM trajectory_entries WHERE sandbox_id = %s", (sid,)).fetchone()
    return int(row[0]) if row else 0


def _raw(host: str, port: int, request: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_edge_impostor_cannot_register_or_ship(cluster: Cluster, world: World) -> None:
    c, w = cluster, world
    before_edges = _edges_seen(c)
    before_rows = _stored_rows(c, w.b_sid)
    e0 = c.edges[0]["name"]
    evil = f"http://{c.bridge_ip}:{c.sentinel.port}"
    regs = [
        {"name": e0, "url": evil},
        {"name": "evil0", "url": evil},
        {"name": e0, "url": "http://127.0.0.1:1"},
    ]
    row = [
        w.b_sid,
        10**6,
        10**6,
        "exec",
        json.dumps({"cmd": "rm -rf /"}),
        "{}",
        "{}",
        None,
        None,
        "",
        time.time(),
        w.b.project,
    ]
    ship = {"edge": e0, "rows": [row], "stats": {w.b_sid: {"acknowledged": 10**6, "recorded": 0, "lost": 0}}}
    calls = []
    for api in c.apis:
        for tok in (None, w.a.token, w.b.token, "x"):
            h = {"Authorization": f"Bearer {tok}"} if tok else {}
            for r_ in regs:
                calls.append(
                    ("register", POOL.submit(httpx.post, api + "/v1/edges/register", json=r_, headers=h))
                )
            calls.append(
                ("ship", POOL.submit(httpx.post, api + "/v1/edges/trajectories", json=ship, headers=h))
            )
            # path variants that might dodge the exact-path check
            for p in (
                "/v1/edges/register/",
                "/v1//edges/register",
                "/v1/edges/./register",
                "/v1/edges/%72egister",
            ):
                calls.append(
                    (p, POOL.submit(httpx.post, api + p, json=regs[0], headers=h, follow_redirects=True))
                )
    bad = [
        (what, f.result().status_code, f.result().text[:150])
        for what, f in calls
        if f.result().status_code < 400
    ]
    port = int(c.apis[0].rsplit(":", 1)[1])
    body = json.dumps(regs[0]).encode()
    for path in (b"/v1/edges/register?x=1", b"/v1/edges//register", b"//v1/edges/register"):
        head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        raw = _raw(c.bridge_ip, port, head + body)
        if raw.split(b" ", 2)[1][:1] == b"2":
            bad.append((path.decode(), raw[:150]))
    assert bad == [], bad
    time.sleep(1.5)  # (a registered URL would be called within a status poll)
    assert _edges_seen(c) == before_edges
    assert [h for h in c.sentinel.hits if c.cluster_token.encode() in h[1]] == []
    assert _stored_rows(c, w.b_sid) == before_rows
    r = w.b.https[1].get(f"/v1/sandboxes/{w.b_sid}/trajectory")
    assert r.status_code == 200 and "rm -rf" not in r.text
    assert r.json()["entries"][: len(w.b_trajectory)] == w.b_trajectory
    assert w.b.https[1].get(f"/v1/sandboxes/{w.b_sid}").json()["edge"] == e0
    _b_alive(w)


# --- (4) the edges' own API from the host ---------------------------------------------------------


def test_edge_api_refuses_everything_but_the_cluster_token(cluster: Cluster, world: World) -> None:
    c, w = cluster, world
    routes = [
        ("GET", "/v1/sandboxes", None),
        ("GET", "/v1/edge/status", None),
        ("GET", "/v1/sandboxes/{sid}", None),
        ("POST", "/v1/sandboxes/{sid}/exec", {"cmd": "cat /work/secret"}),
        ("GET", "/v1/sandboxes/{sid}/files?path=/work/secret", None),
        ("GET", "/v1/sandboxes/{sid}/trajectory", None),
        ("DELETE", "/v1/sandboxes/{sid}", None),
        ("POST", "/v1/sandboxes", {"image": "python", "memory_mb": 128}),
        ("GET", "/v1/snapshots", None),
        ("GET", "/v1/images", None),
        ("GET", "/v1/layers", None),
        ("GET", "/v1/pools", None),
        ("POST", "/v1/projects/{project}/pause", None),
        ("POST", "/v1/pools/prewarm", {"spec": {"image": "python"}, "count": 1}),
        ("POST", "/v1/fncall/run", {"code": "print(1)", "language": "python"}),
        ("GET", "/openapi.json", None),
        ("GET", "/docs", None),
    ]
    calls = []
    for e in c.edges:
        base = f"http://{e['address']}:{EDGE_PORT}"
        for tok in (None, w.a.token, c.admin, "x"):
            h = {"Authorization": f"Bearer {tok}"} if tok else {}
            for m, p, body in routes:
                url = base + _fill(p, w)
                kw: dict[str, Any] = {"headers": h, "timeout": 20}
                if body is not None:
                    kw["json"] = _fill(body, w)
                calls.append((e["name"], tok is not None, m, p, POOL.submit(httpx.request, m, url, **kw)))
    bad = []
    for name, with_token, m, p, f in calls:
        r = f.result()
        if r.status_code < 400 or "b-secret" in r.text:
            bad.append((name, with_token, m, p, r.status_code, r.text[:120]))
    for e in c.edges:  # path tricks around the one open route
        for path in (b"/v1/health/../sandboxes", b"//v1/sandboxes", b"/v1/health/%2e%2e/sandboxes"):
            raw = _raw(
                e["address"], EDGE_PORT, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            if raw.split(b" ", 2)[1][:1] == b"2" and w.b_sid.encode() in raw:
                bad.append((e["name"], path.decode(), raw[:150]))
    assert bad == [], bad
    # the health check answers (the edges are up) and the cluster token works: the refusals are real
    for e in c.edges:
        assert httpx.get(f"http://{e['address']}:{EDGE_PORT}/v1/health", timeout=5).status_code == 200
    _b_alive(w)


# --- (5) image names with path tricks ---------------------------------------------------------------

BAD_IMAGES = [
    "../x",
    "..",
    "../../../../etc/passwd",
    "a/b",
    "a/../../b",
    "/etc",
    "%2e%2e",
    "%2e%2e%2fx",
    "x" * 300,
    "x" * 5000,
    "python/../python",
    "python@sha256:" + "0" * 64,
    "dsec/../python",
    "..\\x",
    "x\x00y",
    "x\ny",
    " python",
]


@pytest.mark.parametrize("api", [0, 1])
def test_image_names_with_path_tricks_are_a_clear_4xx(cluster: Cluster, world: World, api: int) -> None:
    c, w = cluster, world
    reg_before = httpx.get(c.registry + "/v2/_catalog", timeout=10).json()
    body = {"memory_mb": 128, "project": w.a.project}
    futs = [
        (img, POOL.submit(w.a.https[api].post, "/v1/sandboxes", json={**body, "image": img}))
        for img in BAD_IMAGES
    ]
    bad = []
    for img, f in futs:
        r = f.result()
        if r.status_code == 201:
            w.a.https[api].delete(f"/v1/sandboxes/{r.json()['id']}")
        if not 400 <= r.status_code < 500:
            bad.append((img[:40], r.status_code, r.text[:200]))
    assert bad == [], bad
    assert httpx.get(c.apis[api] + "/v1/health", timeout=5).json()["edges"] == 2
    assert httpx.get(c.registry + "/v2/_catalog", timeout=10).json() == reg_before
    assert _create(w.a, api)  # it keeps serving


def test_tenant_cannot_plant_the_idempotency_label(cluster: Cluster, world: World) -> None:
    """`dsec.idempotency` marks what a keyed create made; a create taken over from a dead apiserver
    adopts any sandbox carrying its digest, on every edge and of any project. A tenant must not be
    able to set it on its own sandbox (else a planted one is handed to the victim's retry)."""
    w = world
    planted = "0" * 32
    r = w.a.https[0].post(
        "/v1/sandboxes",
        json={
            "image": "python",
            "memory_mb": 128,
            "project": w.a.project,
            "labels": {"dsec.idempotency": planted},
        },
    )
    if r.status_code == 201:
        w.a.https[0].delete(f"/v1/sandboxes/{r.json()['id']}")
        assert r.json()["spec"]["labels"].get("dsec.idempotency") != planted, r.json()["spec"]["labels"]
    else:
        assert 400 <= r.status_code < 500, r.text
