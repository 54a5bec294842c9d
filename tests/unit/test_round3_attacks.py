"""Round three's attack review (issue #25) of items 7 (aggregate quotas for bursts) and 9
(failover for every call), as a hostile tenant and against a lost answer, with tricks the
first round's tests (test_capacity.py, test_client_failover.py) do not use. No root: the
apiservers run in process on the IAM's real databases (SQLite and PostgreSQL) with fake edges
and providers, the SDK against real loopback HTTP servers."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.client import Client
from dsec.models import Quota
from tests.unit.test_capacity import FakeEdge, FakeProvider, _close, _env, _refused, _tokens, db

__all__ = ["db"]  # (the fixture: SQLite and PostgreSQL)


# --- item 7: what a burst may hold, and who may cancel it -----------------------------------------


async def test_a_burst_counts_against_the_projects_cpu_and_memory_quotas(db: Path | str) -> None:
    """ATTACK (worked): a project held to 4 CPUs and 4 GiB, with no bound on its number of
    sandboxes, announced 1,000 one-CPU sandboxes: accepted, the edges were sent the pre-warm
    and the node provider asked for 31 more edges (machines the operator pays for). Bursts now
    count their CPUs and memory against max_cpu and max_memory_mb of the project and every
    ancestor, as they count sandboxes against max_sandboxes."""
    provider = FakeProvider(slots=10)
    edges = [FakeEdge("e0", 30)]
    a = await _env(db, edges, provider)
    b = await _env(db, edges, tokens=_tokens(a))
    a.iam.create_project("lab", quota=Quota(max_cpu=4, max_memory_mb=4096))
    a.iam.create_project("lab-child", parent="lab")
    _, carol = a.iam.create_principal("carol", ["lab"])
    try:
        for body, limit in (
            ({"count": 1000, "cpu": 1, "memory_mb": 256}, "max_cpu"),
            ({"count": 2, "cpu": 0.5, "memory_mb": 4096}, "max_memory_mb"),
        ):
            r = await a.call("POST", "/v1/capacity", carol, {"project": "lab", **body})
            _refused(r, "bursts_exceed_quota")
            assert r.json()["error"]["details"]["limit"] == limit
        assert provider.asked == [] and edges[0].prewarms == []
        # within the quotas: accepted, and then it counts, on every apiserver and in the subtree
        ok = {"project": "lab", "count": 3, "cpu": 1, "memory_mb": 1024, "when": 3600}
        assert (await a.call("POST", "/v1/capacity", carol, ok)).status_code == 200
        r = await b.call("POST", "/v1/capacity", carol, {**ok, "project": "lab-child", "count": 2})
        _refused(r, "bursts_exceed_quota")
        assert r.json()["error"]["details"] | {"announced": 3.0} == {
            "reason": "bursts_exceed_quota",
            "quota": 4.0,
            "announced": 3.0,
            "project": "lab",
            "limit": "max_cpu",
        }
        assert (
            await b.call("POST", "/v1/capacity", carol, {**ok, "project": "lab-child", "count": 1})
        ).is_success
    finally:
        await _close(a, b)


async def test_bursts_raced_on_two_apiservers_take_the_quota_once(db: Path | str) -> None:
    """Two apiservers each take a burst of the project's whole quota at the same moment, ten
    times over: one of each pair is refused, never both accepted."""
    a = await _env(db, [FakeEdge("e0", 30)])
    b = await _env(db, [FakeEdge("e0", 30)], tokens=_tokens(a))
    a.iam.create_project("race", quota=Quota(max_sandboxes=4))
    _, dave = a.iam.create_principal("dave", ["race"])
    body = {"project": "race", "count": 4, "when": 3600}
    try:
        for _ in range(10):
            ra, rb = await asyncio.gather(*(e.call("POST", "/v1/capacity", dave, body) for e in (a, b)))
            assert sorted([ra.status_code, rb.status_code]) == [200, 429], (ra.text, rb.text)
            burst = (ra if ra.status_code == 200 else rb).json()["id"]
            assert (await a.call("DELETE", f"/v1/capacity/{burst}", dave)).status_code == 200
    finally:
        await _close(a, b)


@pytest.mark.parametrize(
    "body",
    [
        {"count": 0},
        {"count": -1},
        {"count": 2**63},
        {"count": "1e3"},
        {"count": 1, "cpu": 0},
        {"count": 1, "cpu": -1},
        {"count": 1, "cpu": 1e308},
        {"count": 1, "memory_mb": -1},
        {"count": 1, "when": -1},
        {"count": 1, "when": 10**20},
        {"count": 1, "when": "2000-01-01T00:00:00"},  # no timezone
        {"count": 1, "project": "team-b"},  # not alice's
    ],
)
async def test_negative_huge_and_foreign_bursts_are_4xx(db: Path | str, body: dict[str, Any]) -> None:
    a = await _env(db, [FakeEdge("e0", 30)])
    try:
        r = await a.call("POST", "/v1/capacity", a.alice, {"project": "team-a", **body})
        assert 400 <= r.status_code < 500 and r.json()["error"]["code"], r.text
        assert a.iam.list_bursts(None) == [] and a.edges[0].prewarms == []
    finally:
        await _close(a)


async def test_a_childs_tenant_cannot_cancel_its_parents_burst(db: Path | str) -> None:
    """Cancel rights follow visibility: a principal of a parent project cancels its child's
    burst; one of the child cannot cancel the parent's (404, as for another tenant's)."""
    a = await _env(db, [FakeEdge("e0", 30)])
    a.iam.create_project("org")
    a.iam.create_project("org-team", parent="org")
    _, boss = a.iam.create_principal("boss", ["org"])
    _, member = a.iam.create_principal("member", ["org-team"])
    later = {"count": 1, "when": 3600}
    try:
        top = (await a.call("POST", "/v1/capacity", boss, {"project": "org", **later})).json()["id"]
        team = (await a.call("POST", "/v1/capacity", member, {"project": "org-team", **later})).json()["id"]
        r = await a.call("DELETE", f"/v1/capacity/{top}", member)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert {x.id: x.state for x in a.iam.list_bursts(None)}[top] == "scheduled"
        assert (await a.call("DELETE", f"/v1/capacity/{team}", boss)).json()["state"] == "cancelled"
    finally:
        await _close(a)


async def test_a_tenant_with_subprojects_cannot_take_every_pending_burst_slot(db: Path | str) -> None:
    opts: dict[str, Any] = {"capacity_max_bursts": 4, "capacity_max_bursts_per_project": 2}
    a = await _env(db, [FakeEdge("e0", 30)], **opts)
    a.iam.create_project("big")
    for child in ("big-1", "big-2"):
        a.iam.create_project(child, parent="big")
    _, eve = a.iam.create_principal("eve", ["big"])
    later = {"count": 1, "when": 3600}
    try:
        codes = []
        for project in ("big-1", "big-1", "big-2", "big-2"):
            r = await a.call("POST", "/v1/capacity", eve, {"project": project, **later})
            codes.append(r.status_code if r.status_code == 200 else r.json()["error"]["details"]["reason"])
        assert codes == [200, 200, "too_many_project_bursts", "too_many_project_bursts"], codes
        r = await a.call("POST", "/v1/capacity", a.bob, {"project": "team-b", **later})
        assert r.status_code == 200, r.text  # another tenant still gets its share
    finally:
        await _close(a)


# --- item 9: an answer lost after the apiserver took the call ------------------------------------


class Silent:
    """A loopback HTTP server that reads each request (head and body), records it and never
    answers: an apiserver that took the call and then hung, or whose answer was lost."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Idempotency-Key
        self.conns: list[socket.socket] = []
        self.readers: list[threading.Thread] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.readers.append(threading.Thread(target=self._read, args=(conn,), daemon=True))
            self.readers[-1].start()

    def settle(self) -> list[tuple[str, str, str | None]]:
        """The requests taken so far, once each connection made so far has been read."""
        for t in list(self.readers):
            t.join(10)
        return list(self.requests)

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            body += conn.recv(65536)
        method, path, _ = lines[0].split(" ", 2)
        self.requests.append((method, path, headers.get("idempotency-key")))

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    s = Silent()
    yield s
    s.close()


def test_a_call_whose_answer_never_came_is_sent_again_only_if_keyed(silent: Silent) -> None:
    """Both apiservers take every call and never answer (the read times out with the
    connection still open: the call may be running). A fork, a batch create, a snapshot, a
    session, a checkpoint, a restore, a verify (a grader run twice) and a token rotation are
    sent once, to one apiserver, and fail; a create goes to the other with the same
    idempotency key (one sandbox however often it is sent)."""
    other = Silent()
    try:
        with Client(url=[silent.url, other.url], token="t", timeout=0.3, retries=2) as c:
            sb = c.sandbox("sb1")
            once = {
                "fork": lambda: sb.fork(2),
                "batch": lambda: c.create_many(3),
                "snapshot": lambda: sb.snapshot(),
                "sessions": lambda: sb.session(),
                "checkpoint": lambda: sb.checkpoint(),
                "restore": lambda: c.restore("ck1"),
                "verify": lambda: sb.verify("pytest -q"),
                "rotate": lambda: c.rotate_token(),
            }
            for call in once.values():
                with pytest.raises(errors.Unavailable):
                    call()
            with pytest.raises(errors.Unavailable):
                c.create("python")
        sent = silent.settle() + other.settle()
        for name in once:
            assert sum(path.endswith(f"/{name}") for _, path, _ in sent) == 1, (name, sent)
        creates = [key for _, path, key in sent if path == "/v1/sandboxes"]
        assert len(creates) == 3 and len(set(creates)) == 1 and creates[0]  # a try and 2 retries, one key
        assert silent.requests and other.requests  # the client moved between them
    finally:
        other.close()


def test_a_response_cut_after_the_server_took_the_call_is_not_sent_again(silent: Silent) -> None:
    """The server reads a fork, starts its answer and dies: the fork fails `unavailable` and
    is not repeated on the other apiserver; the client's next call goes to the other."""
    half = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = half.accept()
        seen.append(conn.recv(65536))
        conn.sendall(b'HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{"sandboxes": [')
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{half.getsockname()[1]}"
        with Client(url=[url, silent.url], token="t", timeout=0.3, retries=0) as c:
            with pytest.raises(errors.Unavailable):
                c.sandbox("sb1").fork(3)
            t.join(5)
            assert len(seen) == 1 and b"/fork" in seen[0] and silent.settle() == []
            with pytest.raises(errors.Unavailable):
                c.sandbox("sb1").refresh()
            assert [r[:2] for r in silent.settle()] == [("GET", "/v1/sandboxes/sb1")]
    finally:
        half.close()
