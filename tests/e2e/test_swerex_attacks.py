"""SWE-ReX endpoints under attack, against a real `dsec up`: another tenant probing or
closing a sandbox's sessions, and zip bombs through `upload` with unzip=true."""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Iterator

import httpx
import pytest

from dsec.client import Client, Sandbox

pytestmark = [pytest.mark.root, pytest.mark.e2e]


@pytest.fixture(scope="module")
def owner_sandbox(service) -> Iterator[Sandbox]:
    with Client(service.url, service.token) as client:
        sb = client.create(image="python", memory_mb=512, ttl_idle_s=600)
        yield sb
        sb.stop()


@pytest.fixture(scope="module")
def stranger(service) -> str:
    admin = {"Authorization": f"Bearer {service.token}"}
    with httpx.Client(base_url=service.url, headers=admin, timeout=60) as http:
        assert http.post("/v1/projects", json={"name": "rex-stranger"}).status_code == 200
        r = http.post("/v1/principals", json={"name": "rex-stranger-user", "projects": ["rex-stranger"]})
        return str(r.json()["token"])


def rex(service, sid: str, token: str, endpoint: str, body: dict | None = None) -> httpx.Response:
    url = f"{service.url}/swerex/{sid}/{endpoint}"
    hdrs = {"X-API-Key": token}
    if body is None:
        return httpx.get(url, headers=hdrs, timeout=60)
    return httpx.post(url, json=body, headers=hdrs, timeout=60)


def run(service, sid: str, token: str, command: str, session: str = "main") -> httpx.Response:
    body = {"command": command, "session": session, "action_type": "bash", "check": "silent"}
    return rex(service, sid, token, "run_in_session", body)


def test_a_stranger_cannot_make_the_router_forget_or_probe_sessions(service, owner_sandbox, stranger):
    sid, me = owner_sandbox.id, service.token
    r = rex(service, sid, me, "create_session", {"session": "main", "session_type": "bash"})
    assert r.status_code == 200, r.text
    assert run(service, sid, me, "export X=5").status_code == 200
    ghost = sid[:-4] + "zzzz"
    # the stranger's probes: every one answers exactly like a sandbox that does not exist
    probes = [
        ("is_alive", None),
        ("close_session", {"session": "main", "session_type": "bash"}),
        ("run_in_session", {"session": "main", "action_type": "bash_interrupt"}),
        ("run_in_session", {"session": "nope", "action_type": "bash_interrupt"}),
        ("run_in_session", {"command": "echo hi", "session": "main", "action_type": "bash"}),
        ("create_session", {"session": "main", "session_type": "bash"}),
        ("close", {}),
    ]
    for endpoint, body in probes:
        real = rex(service, sid, stranger, endpoint, body)
        missing = rex(service, ghost, stranger, endpoint, body)
        assert real.status_code == missing.status_code == 404, (endpoint, body, real.text, missing.text)
        assert real.json().keys() == missing.json().keys(), (endpoint, real.text, missing.text)
    # ...and the owner's session is still known, with its state
    r = run(service, sid, me, "echo X=$X")
    assert r.status_code == 200 and r.json()["output"].strip() == "X=5", r.text
    # the owner's own interrupt on an idle session still answers at once
    r = rex(service, sid, me, "run_in_session", {"session": "main", "action_type": "bash_interrupt"})
    assert r.status_code == 200, r.text


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _bomb(members: dict[str, int]) -> bytes:
    buf = io.BytesIO()
    zero = bytes(1 << 20)
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name, mib in members.items():
            with zf.open(name, "w", force_zip64=True) as f:
                for _ in range(mib):
                    f.write(zero)
    return buf.getvalue()


@pytest.mark.parametrize(
    "members",
    [
        {"bomb.bin": 1024},  # one member, ~1000:1
        {f"part{i}.txt": 40 for i in range(16)},  # 640 MiB in total, each part below 1 GiB
    ],
    ids=["ratio", "total"],
)
def test_zip_bomb_is_refused_without_inflating(service, owner_sandbox, members):
    data = _bomb(members)
    assert len(data) < 2 << 20
    pid = service.procs["up"].pid
    before = _rss_kib(pid)
    t0 = time.monotonic()
    r = httpx.post(
        f"{service.url}/swerex/{owner_sandbox.id}/upload",
        headers={"X-API-Key": service.token},
        files={"file": ("bomb.zip", data)},
        data={"target_path": "/work/bomb", "unzip": "true"},
        timeout=120,
    )
    assert r.status_code == 413, r.text
    assert time.monotonic() - t0 < 10
    grown = _rss_kib(pid) - before
    assert grown < 100 * 1024, f"the service grew by {grown // 1024} MiB"
    assert "bomb" not in owner_sandbox.exec("ls /work").stdout


def test_small_zip_still_unpacks(service, owner_sandbox):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/a.py", "print('a')\n" * 1000)
        zf.writestr("../../esc.txt", "inside\n")
    r = httpx.post(
        f"{service.url}/swerex/{owner_sandbox.id}/upload",
        headers={"X-API-Key": service.token},
        files={"file": ("ok.zip", buf.getvalue())},
        data={"target_path": "/work/ok", "unzip": "true"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert owner_sandbox.files.read("/work/ok/esc.txt") == "inside\n"
    assert owner_sandbox.exec("wc -l < /work/ok/pkg/a.py").stdout.strip() == "1000"
