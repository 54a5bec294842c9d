"""Tenants against each other and against the service, through HTTP only, on a real `dsec up`:
two projects with their own principals (made through the API), one attacking the other.

- bodies: a chunked body without a token is refused before it is read, one with a token is
  cut off at the cap, and the service's peak RSS stays bounded;
- quota: prewarm is admin-only; a create slower than the reconciler's grace keeps its
  reservation, so a second create cannot slip past a 1-sandbox quota;
- listings: events, images, layers, edges, pools, metrics and every other GET route show a
  tenant nothing of the other project (sandbox ids, project names, snapshot names);
- tokens: rotate and revoke (API and CLI) take effect at once;
- malformed input: lone surrogates and too many environment variables are 4xx, not 500.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import DSEC, Service, dsec_up

pytestmark = [pytest.mark.root, pytest.mark.e2e]

GRACE_S = 0.05  # the reconciler's grace for reservations, shortened from 30 s
METRICS_TOKEN = "metrics_" + secrets.token_hex(16)
MiB = 1 << 20
SLOW_FILES = 4  # directories of 8,000 files moved to the vault by each create of the slow snapshot


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, python_image: str, code_image: str) -> Iterator[Service]:
    """`dsec up` with a reconciler that runs every 0.02 s and trusts nothing older than 0.05 s."""
    extra = {
        "DSEC_APISERVER_RECONCILE_INTERVAL_S": "0.02",
        "DSEC_APISERVER_RESERVATION_GRACE_S": str(GRACE_S),
        "DSEC_APISERVER_METRICS_TOKEN": METRICS_TOKEN,
    }
    with dsec_up(tmp_path_factory.mktemp("dsec-tenancy"), extra) as s:
        yield s


def http(svc: Service, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=svc.url, headers=headers, timeout=120)


class Tenant:
    def __init__(self, svc: Service, project: str, quota: dict[str, Any] | None = None) -> None:
        with http(svc, svc.token) as admin:
            r = admin.post("/v1/projects", json={"name": project, "quota": quota or {}})
            assert r.status_code == 200, r.text
            r = admin.post("/v1/principals", json={"name": f"{project}-user", "projects": [project]})
            assert r.status_code == 200, r.text
        self.project = project
        self.name = f"{project}-user"
        self.token: str = r.json()["token"]
        self.http = http(svc, self.token)
        OPEN_CLIENTS.append(self.http)

    def create(self, **spec: Any) -> str:
        r = self.http.post(
            "/v1/sandboxes", json={"image": "python", "memory_mb": 256, "project": self.project, **spec}
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


OPEN_CLIENTS: list[httpx.Client] = []


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for c in OPEN_CLIENTS:
        c.close()


@pytest.fixture(scope="module")
def pair(svc: Service) -> tuple[Tenant, Tenant]:
    suffix = secrets.token_hex(3)
    return Tenant(svc, f"victim-{suffix}"), Tenant(svc, f"attacker-{suffix}")


# --- bodies ---------------------------------------------------------------------------------------


def _rss_peak_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _raw_chunked(svc: Service, path: str, headers: dict[str, str], total: int) -> tuple[int, int, bytes]:
    """Stream a chunked JSON body of up to `total` bytes over a raw socket, watching for the
    answer after every chunk: (bytes sent when it came, status, head of the answer)."""
    port = int(svc.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n"
    )
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    chunk = b"a" * MiB
    framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    sent = 0
    try:
        sock.sendall(b'5\r\n{"a":\r\n')
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(framed)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        answer = b""
        while True:
            head_end = answer.find(b"\r\n\r\n")
            if head_end >= 0:
                m = re.search(rb"content-length: (\d+)", answer[:head_end].lower())
                if m is None or len(answer) >= head_end + 4 + int(m.group(1)):
                    break
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1") else 0
    return sent, status, answer[:2000]


@pytest.mark.parametrize(
    "path",
    [
        "/run_jupyter",
        "/run_code?token=dsec_wrong",
        "/sandboxfusion/dsec_wrong/run_jupyter",
        "/v1/fncall/jupyter",
    ],
)
def test_chunked_body_without_a_token_is_refused_before_it_is_read(svc: Service, path: str) -> None:
    pid = svc.procs["up"].pid
    _rss_peak_reset(pid)
    before = _rss_kib(pid, "VmRSS")
    sent, status, answer = _raw_chunked(svc, path, {}, 300 * MiB)
    assert status == 401, answer
    assert sent <= 8 * MiB, f"the 401 came after {sent / MiB:.0f} MiB"
    grown = _rss_kib(pid, "VmHWM") - before
    assert grown < 32 * 1024, f"the service grew by {grown // 1024} MiB"


def test_chunked_body_with_a_token_stops_at_the_cap(svc: Service, pair: tuple[Tenant, Tenant]) -> None:
    _, attacker = pair
    pid = svc.procs["up"].pid
    for path, headers in [
        (f"/run_jupyter?token={attacker.token}", {}),
        ("/v1/fncall/jupyter", {"Authorization": f"Bearer {attacker.token}"}),
        ("/v1/sandboxes", {"Authorization": f"Bearer {attacker.token}"}),  # a spec: small cap
    ]:
        _rss_peak_reset(pid)
        before = _rss_kib(pid, "VmRSS")
        sent, status, answer = _raw_chunked(svc, path, headers, 300 * MiB)
        assert status == 413, answer
        assert b'"payload_too_large"' in answer
        # the cap (160 MiB) plus what the loopback's socket buffers hold in flight when the
        # refusal is written (171 MiB once, on a loaded 2-core host)
        assert sent <= 180 * MiB, f"{path}: the 413 came after {sent / MiB:.0f} MiB"
        grown = _rss_kib(pid, "VmHWM") - before
        assert grown < 200 * 1024, f"{path}: the service grew by {grown // 1024} MiB for one body"


def test_httpx_streaming_a_big_body_gets_its_answer(svc: Service, pair: tuple[Tenant, Tenant]) -> None:
    """The same with an ordinary client: it streams and still reads the early answer."""
    _, attacker = pair

    def body() -> Iterator[bytes]:
        yield b'{"cells": ["'
        for _ in range(300):
            yield b"a" * MiB

    with httpx.Client(base_url=svc.url, timeout=120) as c:
        r = c.post("/run_jupyter", content=body())
        assert r.status_code == 401
        r = c.post(f"/run_jupyter?token={attacker.token}", content=body())
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        # the service still answers, and the attacker's next call works
        r = c.post(f"/run_code?token={attacker.token}", json={"code": "print(6*7)", "language": "python"})
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text


# --- quota ------------------------------------------------------------------------------------------


def test_prewarm_and_pool_configuration_are_admin_only(svc: Service) -> None:
    tenant = Tenant(svc, f"pw-{secrets.token_hex(3)}", {"max_sandboxes": 1})
    with http(svc, svc.token) as admin:
        pooled = admin.get("/v1/edges").json()["edges"][0]["used"]["pooled"]
        spec = {"image": "python", "memory_mb": 96, "cpu": 0.25, "project": tenant.project}
        r = tenant.http.post("/v1/pools/prewarm", json={"spec": spec, "count": 12})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden"), r.text
        r = tenant.http.post("/v1/pools", json={"image": "python", "memory_mb": 96, "min_size": 12})
        assert r.status_code == 403, r.text
        time.sleep(1.0)
        assert admin.get("/v1/edges").json()["edges"][0]["used"]["pooled"] == pooled
        assert not [p for p in admin.get("/v1/pools").json()["pools"] if p["spec"]["memory_mb"] == 96]


def _slow_image(svc: Service, tenant: Tenant, dirs: int = SLOW_FILES) -> tuple[str, list[str]]:
    """A snapshot whose creates are slow: protected paths (`dirs` directories of 8,000 files)
    are moved to the vault at create."""
    sid = tenant.create(disk_mb=4096, memory_mb=1024)
    r = tenant.http.post(
        f"/v1/sandboxes/{sid}/exec",
        json={
            # many files, not big ones: a big file is copied into the vault by a reflink where
            # the file system has them (0.06 s for 400 MiB here), a file at a time is not
            "cmd": f"python3 -c 'import os\nfor i in range(1, {dirs} + 1):\n"
            f'    os.mkdir(f"/work/big{{i}}")\n    for j in range(8000): '
            f'open(f"/work/big{{i}}/{{j}}", "w").write(str(j))\'',
            "timeout": 300,
        },
    )
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    r = tenant.http.post(f"/v1/sandboxes/{sid}/snapshot", json={})
    assert r.status_code == 201, r.text
    tenant.http.delete(f"/v1/sandboxes/{sid}")
    return r.json()["id"], [f"/work/big{i}" for i in range(1, dirs + 1)]


def test_a_slow_create_keeps_its_reservation(svc: Service) -> None:
    tenant = Tenant(svc, f"slow-{secrets.token_hex(3)}", {"max_sandboxes": 1})
    project = tenant.project
    image, protected = _slow_image(svc, tenant)
    done: dict[str, Any] = {}

    def slow() -> None:
        # The setup's stop releases its quota right after its response is written, and a
        # create on another connection can come first: refused (429) then. No probe is sent
        # before this create is admitted (below), so the quota is nobody else's: try again.
        deadline = time.monotonic() + 30
        while True:
            t0 = time.monotonic()
            r = tenant.http.post(
                "/v1/sandboxes",
                json={
                    "image": image,
                    "memory_mb": 256,
                    "project": project,
                    "protected_paths": protected,
                    "disk_mb": 4096,
                    "labels": {"test": "slow"},
                },
            )
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        done.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

    t = threading.Thread(target=slow)
    t.start()
    # Probe only once the slow create holds its reservation: its sandbox is listed from when
    # it runs, before its protected paths are moved to the vault (the slow part). A probe sent
    # at once could reach the apiserver first (a loaded host, another connection) and take the
    # quota as it should, the slow create being the one refused.
    listed = None
    while t.is_alive() and listed is None:
        r = tenant.http.get("/v1/sandboxes", params={"project": project, "label": "test=slow"})
        listed = next((i["id"] for i in r.json()["sandboxes"]), None)
        time.sleep(0.01)
    probing = time.monotonic()
    extra: list[str] = []
    refused = 0
    while t.is_alive():
        r = tenant.http.post("/v1/sandboxes", json={"image": "python", "memory_mb": 64, "project": project})
        if r.status_code == 201:
            extra.append(r.json()["id"])
        else:
            assert r.json()["error"]["code"] == "quota_exceeded", r.text
            refused += 1
        time.sleep(0.05)
    probed_s = time.monotonic() - probing
    t.join()
    for sid in extra:
        tenant.http.delete(f"/v1/sandboxes/{sid}")
    assert done["status"] == 201, done
    assert done["body"]["id"] == listed, (done["body"]["id"], listed)
    assert extra == [], f"{len(extra)} sandboxes admitted past a 1-sandbox quota during a slow create"
    # the test means something only if the create outlived the reconciler's grace by far
    # while it was probed
    assert probed_s > 3 * GRACE_S, f"the create was probed for only {probed_s:.2f} s"
    assert refused > 0
    # after the create, its reservation is the sandbox's: still counted, never reconciled away
    time.sleep(4 * GRACE_S)
    r = tenant.http.post("/v1/sandboxes", json={"image": "python", "memory_mb": 64, "project": project})
    assert r.status_code == 429, r.text
    tenant.http.delete(f"/v1/sandboxes/{done['body']['id']}")
    tenant.http.delete(f"/v1/snapshots/{image}")


async def test_a_cancelled_create_leaves_no_sandbox(svc: Service) -> None:
    """An SDK create cancelled while the apiserver is making its sandbox (a trainer's step
    deadline, `asyncio.wait_for`): the apiserver finishes it, and the SDK undoes it (the same
    create again by its idempotency key, then a stop), so nothing is left running or counted
    against the project's quota."""
    import asyncio

    from dsec.client import AsyncClient

    tenant = Tenant(svc, f"cancel-{secrets.token_hex(3)}", {"max_sandboxes": 1})
    image, protected = _slow_image(svc, tenant, dirs=2)
    query = {"project": tenant.project, "label": "test=cancel"}

    def listed() -> list[str]:
        return [i["id"] for i in tenant.http.get("/v1/sandboxes", params=query).json()["sandboxes"]]

    client = AsyncClient(svc.url, tenant.token)
    spec = {"project": tenant.project, "protected_paths": protected, "disk_mb": 4096, "memory_mb": 256}
    task = asyncio.create_task(client.create(image, labels={"test": "cancel"}, **spec))  # type: ignore[arg-type]
    # Cancel once the apiserver is making it: its sandbox is listed from when it runs, before
    # its protected paths are moved to the vault (the slow part).
    while not task.done() and not await asyncio.to_thread(listed):
        await asyncio.sleep(0.01)
    assert not task.done(), "the create ended before it could be cancelled: make it slower"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.aclose()  # (waits for the undo)
    assert await asyncio.to_thread(listed) == []
    sid = tenant.create()  # its one-sandbox quota is free again
    tenant.http.delete(f"/v1/sandboxes/{sid}")
    tenant.http.delete(f"/v1/snapshots/{image}")


# --- listings -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def victim_state(svc: Service, pair: tuple[Tenant, Tenant]) -> dict[str, str]:
    """The victim's sandbox, a snapshot of it, and what a leak would show."""
    victim, _ = pair
    sid = victim.create(labels={"secret": "label-value"})
    r = victim.http.post(f"/v1/sandboxes/{sid}/snapshot", json={"scrub": ["/work/answer-key"]})
    assert r.status_code == 201, r.text
    return {"sid": sid, "snapshot": r.json()["id"], "project": victim.project, "label": "label-value"}


def _leaks(text: str, state: dict[str, str]) -> list[str]:
    return [v for k, v in state.items() if v in text]


def test_events_only_of_your_projects(svc: Service, pair: tuple[Tenant, Tenant]) -> None:
    victim, attacker = pair
    seen: dict[str, list[str]] = {"victim": [], "attacker": []}
    stop = threading.Event()

    def listen(who: str, token: str) -> None:
        with httpx.Client(base_url=svc.url, timeout=httpx.Timeout(30, read=2)) as c:
            try:
                with c.stream("GET", "/v1/events", headers={"Authorization": f"Bearer {token}"}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            seen[who].append(line)
                        if stop.is_set():
                            return
            except httpx.ReadTimeout:
                return

    threads = [
        threading.Thread(target=listen, args=("victim", victim.token)),
        threading.Thread(target=listen, args=("attacker", attacker.token)),
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    sid = victim.create()
    victim.http.delete(f"/v1/sandboxes/{sid}")
    own = attacker.create()
    attacker.http.delete(f"/v1/sandboxes/{own}")
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(10)
    assert any(sid in e for e in seen["victim"]) and len([e for e in seen["victim"] if sid in e]) == 2
    assert not [e for e in seen["attacker"] if sid in e or victim.project in e], seen["attacker"]
    assert len([e for e in seen["attacker"] if own in e]) == 2, seen["attacker"]  # created, stopped
    assert httpx.get(svc.url + "/v1/events", timeout=5).status_code == 401


def test_images_layers_edges_pools_show_nothing_of_other_projects(
    svc: Service, pair: tuple[Tenant, Tenant], victim_state: dict[str, str]
) -> None:
    victim, attacker = pair
    for path in ("/v1/images", "/v1/layers", "/v1/edges", "/v1/pools", "/v1/snapshots", "/v1/sandboxes"):
        r = attacker.http.get(path)
        assert r.status_code == 200, (path, r.text)
        assert _leaks(r.text, victim_state) == [], f"{path} shows {_leaks(r.text, victim_state)}"
        assert httpx.get(svc.url + path, timeout=10).status_code == 401, path
    # the shared images are there for everyone; the victim sees its snapshot, admins all
    names = [i["name"] for i in attacker.http.get("/v1/images").json()["images"]]
    assert "python" in names
    assert victim_state["snapshot"] in [i["name"] for i in victim.http.get("/v1/images").json()["images"]]
    edges = attacker.http.get("/v1/edges").json()["edges"]
    assert edges and all(e["url"] is None for e in edges)
    assert "python" in edges[0]["images"]
    mine = victim.http.get("/v1/layers").text
    assert victim_state["sid"] in mine  # its own snapshot's layer
    with http(svc, svc.token) as admin:
        everything = admin.get("/v1/edges").text + admin.get("/v1/layers").text + admin.get("/v1/images").text
        assert _leaks(everything, victim_state) != []


def test_metrics_need_a_token_and_hide_projects_from_tenants(
    svc: Service, pair: tuple[Tenant, Tenant], victim_state: dict[str, str]
) -> None:
    _, attacker = pair
    assert httpx.get(svc.url + "/metrics", timeout=10).status_code == 401
    assert (
        httpx.get(svc.url + "/metrics", headers={"Authorization": "Bearer x"}, timeout=10).status_code == 401
    )
    text = attacker.http.get("/metrics").text
    assert "dsec_live_sandboxes" in text and "dsec_exec_seconds" in text
    assert _leaks(text, victim_state) == []
    assert not re.search(r'project="(?!\*)', text)
    for token in (svc.token, METRICS_TOKEN):
        # the per-project gauges follow the watcher's view of the edges (polled every second)
        deadline = time.monotonic() + 15
        while True:
            full = httpx.get(svc.url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            assert full.status_code == 200
            if f'project="{victim_state["project"]}"' in full.text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert f'project="{victim_state["project"]}"' in full.text


def test_no_get_route_leaks_another_project(
    svc: Service, pair: tuple[Tenant, Tenant], victim_state: dict[str, str]
) -> None:
    """Every GET route in the OpenAPI document, called by the attacker (with the victim's ids
    where a route takes one), shows nothing of the victim; without a token, only /v1/health,
    /v1/version and the docs answer."""
    _, attacker = pair
    spec = httpx.get(svc.url + "/openapi.json", timeout=10).json()
    fill = {"sid": victim_state["sid"], "name": victim_state["snapshot"], "cid": victim_state["sid"] + "x"}
    checked = []
    for route, ops in spec["paths"].items():
        if "get" not in ops or route == "/v1/events":  # a stream: test_events_only_of_your_projects
            continue
        path = re.sub(r"\{(\w+)\}", lambda m: fill.get(m.group(1), "x"), route)
        params = {"path": "/work", "format": "jsonl"}
        r = attacker.http.get(path, params=params, headers={"X-API-Key": attacker.token})
        assert r.status_code < 500, (route, r.status_code, r.text[:300])
        if any(v in path for v in victim_state.values()):
            assert r.status_code == 404, (route, r.status_code, r.text[:300])  # like a missing one
        hidden = {k: v for k, v in victim_state.items() if v not in path}  # not what it was told
        assert _leaks(r.text, hidden) == [], f"GET {route} shows {_leaks(r.text, hidden)}"
        anonymous = httpx.get(svc.url + path, params=params, timeout=10)
        if route in ("/v1/health", "/v1/version", "/v1/ping", "/sandboxfusion/{token}/v1/ping"):
            assert anonymous.status_code == 200 and _leaks(anonymous.text, victim_state) == []
        else:
            assert anonymous.status_code == 401, (route, anonymous.status_code)
        checked.append(route)
    assert len(checked) >= 20, checked


# --- tokens ------------------------------------------------------------------------------------------


def test_rotate_and_revoke_take_effect_at_once(svc: Service, tmp_path: Path) -> None:
    tenant = Tenant(svc, f"tok-{secrets.token_hex(3)}")
    old = tenant.token
    assert tenant.http.get("/v1/principals/me").json()["principal"]["name"] == tenant.name  # cached now
    # the principal rotates its own token with the CLI: printed once, written to its config
    cfg = tmp_path / "client.json"
    cfg.write_text(json.dumps({"url": svc.url, "token": old}))
    env = {**os.environ, "DSEC_CONFIG": str(cfg)}
    env.pop("DSEC_TOKEN", None)
    out = subprocess.run([*DSEC, "token", "rotate"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip()
    assert new.startswith("dsec_") and new != old
    assert json.loads(cfg.read_text())["token"] == new
    assert tenant.http.get("/v1/sandboxes").status_code == 401  # the old one, at once
    with http(svc, new) as c:
        assert c.get("/v1/sandboxes").status_code == 200
    # a tenant cannot rotate or revoke anyone else's
    with http(svc, new) as c:
        assert c.post("/v1/principals/admin/rotate").status_code == 403
        assert c.post("/v1/principals/admin/revoke").status_code == 403
    # an admin revokes it (CLI), then issues a new one (API)
    admin_env = {**env, "DSEC_CONFIG": str(tmp_path / "admin.json")}
    (tmp_path / "admin.json").write_text(json.dumps({"url": svc.url, "token": svc.token}))
    out = subprocess.run(
        [*DSEC, "token", "revoke", tenant.name], env=admin_env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    with http(svc, new) as c:
        assert c.get("/v1/sandboxes").status_code == 401
        assert c.post("/v1/token/rotate").status_code == 401  # a revoked token cannot mint another
    with http(svc, svc.token) as admin:
        r = admin.post(f"/v1/principals/{tenant.name}/rotate")
        assert r.status_code == 200
        issued = r.json()["token"]
        assert admin.post("/v1/principals/nobody/revoke").status_code == 404
    with http(svc, issued) as c:
        assert c.get("/v1/sandboxes").status_code == 200
        # a leaked token, revoked by its holder
        assert c.post("/v1/token/revoke").status_code == 200
        assert c.get("/v1/sandboxes").status_code == 401


# --- malformed input -------------------------------------------------------------------------------


def test_lone_surrogates_and_huge_environments_are_4xx(svc: Service, pair: tuple[Tenant, Tenant]) -> None:
    _, attacker = pair
    sid = attacker.create()
    h = {"Authorization": f"Bearer {attacker.token}", "Content-Type": "application/json"}
    bodies = [
        (f"/v1/sandboxes/{sid}/exec", '{"cmd": ["echo", "\\ud800"]}'),
        (f"/v1/sandboxes/{sid}/exec", '{"cmd": "echo $A", "env": {"A": "\\udfff"}}'),
        (f"/v1/sandboxes/{sid}/sessions", '{"env": {"\\ud83d": "1"}}'),
        (f"/v1/sandboxes/{sid}/exec/stream", '{"cmd": "echo \\ud800"}'),
        ("/v1/fncall/run", '{"code": "print(\\"\\ud800\\")"}'),
        (f"/run_code?token={attacker.token}", '{"code": "print(\\"\\udc00\\")", "language": "python"}'),
        (f"/v1/sandboxes/{sid}/files/edit", '{"path": "/work/x", "old": "\\ud800", "new": "y"}'),
    ]
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        for path, body in bodies:
            r = c.post(path, content=body.encode(), headers=h)
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            assert "surrogate" in r.text
        many = {f"V{i}": "x" for i in range(70000)}
        for path, body in [
            (f"/v1/sandboxes/{sid}/exec", {"cmd": "true", "env": many}),
            (f"/v1/sandboxes/{sid}/sessions", {"env": many}),
            (f"/v1/sandboxes/{sid}/exec", {"cmd": "true", "env": {"BIG": "x" * (2 * MiB)}}),
        ]:
            r = c.post(path, json=body, headers=h)
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            assert r.json()["error"]["code"] == "invalid_request" and "env" in r.text
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ok", "env": {"A": "1"}}, headers=h)
        assert r.json()["stdout"] == "ok\n"
    attacker.http.delete(f"/v1/sandboxes/{sid}")


def test_a_project_tier_policy_is_inherited_and_only_narrowed(svc: Service) -> None:
    """allowed_backends: a minimum tier an operator sets per project; children inherit it and
    may only narrow it; a create (or batch) asking for another tier is refused with forbidden."""
    suffix = secrets.token_hex(3)
    parent, child = f"strict-{suffix}", f"strict-{suffix}-kid"
    with http(svc, svc.token) as admin:
        r = admin.post("/v1/projects", json={"name": parent, "allowed_backends": ["gvisor"]})
        assert r.status_code == 200 and r.json()["allowed_backends"] == ["gvisor"], r.text
        r = admin.post(
            "/v1/projects", json={"name": child, "parent": parent, "allowed_backends": ["container"]}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert "may only narrow" in r.json()["error"]["message"] and "gvisor" in r.json()["error"]["message"]
        r = admin.post("/v1/projects", json={"name": child, "parent": parent})
        assert r.status_code == 200, r.text
        r = admin.post("/v1/principals", json={"name": f"{child}-user", "projects": [child]})
        token = r.json()["token"]
        r = admin.post("/v1/projects", json={"name": f"x-{suffix}", "allowed_backends": ["Bad Name"]})
        assert r.status_code == 422 or r.status_code == 400, r.text
    with http(svc, token) as user:
        for body in (
            {"image": "python", "project": child},  # the default tier is container: refused
            {"image": "python", "project": child, "backend": "container"},
        ):
            r = user.post("/v1/sandboxes", json=body)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["code"] == "forbidden" and "gvisor" in err["message"], err
        r = user.post("/v1/sandboxes/batch", json={"count": 2, "spec": {"image": "python", "project": child}})
        assert r.status_code == 200 and r.json()["sandboxes"] == [], r.text
        assert {e["code"] for e in r.json()["errors"]} == {"forbidden"}
        r = user.post(
            "/v1/sandboxes", json={"image": "python", "project": child, "backend": "gvisor", "memory_mb": 256}
        )
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = user.get("/v1/projects")
        mine = {p["name"]: p for p in r.json()["projects"]}
        assert mine[child]["allowed_backends"] is None  # inherits: the effective policy is the parent's
        r = user.get("/v1/backends")
        assert r.status_code == 200 and {b["name"] for b in r.json()["backends"]} >= {"container", "gvisor"}
        assert user.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_a_project_limited_to_microvms_refuses_a_container(svc: Service) -> None:
    """The strongest tier as a project's policy: a container create is forbidden (naming the
    allowed backend), a microVM create works and runs on its own kernel."""
    project = f"vm-only-{secrets.token_hex(3)}"
    with http(svc, svc.token) as admin:
        r = admin.post("/v1/projects", json={"name": project, "allowed_backends": ["microvm"]})
        assert r.status_code == 200, r.text
        r = admin.post("/v1/principals", json={"name": f"{project}-user", "projects": [project]})
        token = r.json()["token"]
    with http(svc, token) as user:
        r = user.post("/v1/sandboxes", json={"image": "python", "project": project, "backend": "container"})
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "forbidden" and "microvm" in err["message"], err
        vm = {"image": "python", "project": project, "backend": "microvm", "memory_mb": 256}
        r = user.post("/v1/sandboxes", json=vm)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = user.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "uname -r; echo $((6*7))"})
        assert r.status_code == 200 and r.json()["stdout"].split()[1] == "42", r.text
        assert r.json()["stdout"].split()[0] != os.uname().release
        r = user.get("/v1/backends")
        vm = next(b for b in r.json()["backends"] if b["name"] == "microvm")
        assert vm["available"] and set(vm["capabilities"]) == {
            "exec", "files", "fork", "network", "pause", "snapshot", "checkpoint", "sessions", "trusted_exec"
        }  # fmt: skip
        assert user.delete(f"/v1/sandboxes/{sid}").status_code == 204
