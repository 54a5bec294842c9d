"""IAM: bootstrap, tokens, nested projects and quotas, visibility, and atomic admission under contention."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.iam import IAM, Quota, Usage


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "iam.db"


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """The IAM's database: a SQLite file, or a fresh database on a real PostgreSQL."""
    if request.param == "sqlite":
        return tmp_path / "iam.db"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def iam(db: Path | str) -> Iterator[IAM]:
    i = IAM(db)
    i.bootstrap()
    yield i
    i.close()


# ---------------------------------------------------------------- bootstrap and tokens


def test_bootstrap_is_idempotent(db: Path | str) -> None:
    with IAM(db) as iam:
        token = iam.bootstrap()
        assert token is not None and token.startswith("dsec_")
        assert iam.bootstrap() is None
        admin = iam.authenticate(token)
        assert admin.admin and admin.name == "admin" and admin.projects == ["default"]
        default = iam.get_project("default")
        assert default.parent is None and default.quota == Quota()
    with IAM(db) as again:  # a restart does not mint a new admin token
        assert again.bootstrap() is None
        assert again.authenticate(token).id == admin.id
        assert [p.name for p in again.list_projects()] == ["default"]


def test_token_is_hashed_at_rest(db_path: Path) -> None:
    iam = IAM(db_path)
    admin_token = iam.bootstrap()
    assert admin_token is not None
    _, token = iam.create_principal("alice", ["default"])
    iam.close()
    blob = b"".join(p.read_bytes() for p in db_path.parent.iterdir() if p.name.startswith(db_path.name))
    for t in (admin_token, token):
        assert t.encode() not in blob
        assert t[len("dsec_") :].encode() not in blob


def test_auth_errors(iam: IAM) -> None:
    for missing in (None, ""):
        with pytest.raises(errors.AuthError, match="Authorization: Bearer <token>") as ei:
            iam.authenticate(missing)
        assert ei.value.status == 401
    with pytest.raises(errors.AuthError, match="invalid API token") as ei:
        iam.authenticate("dsec_not-a-real-token")
    assert type(ei.value) is errors.AuthError


def test_rotate_and_delete_invalidate_the_cache(iam: IAM) -> None:
    p, token = iam.create_principal("bob", ["default"])
    assert iam.authenticate(token).id == p.id
    assert iam.authenticate(token).id == p.id  # served from the cache
    new = iam.rotate_token(p.id)
    assert new != token
    with pytest.raises(errors.AuthError):
        iam.authenticate(token)
    assert iam.authenticate(new).name == "bob"
    iam.delete_principal(p.id)
    with pytest.raises(errors.AuthError):
        iam.authenticate(new)
    with pytest.raises(errors.NotFound):
        iam.delete_principal(p.id)
    with pytest.raises(errors.NotFound):
        iam.rotate_token(p.id)


def test_rotate_and_revoke_reach_other_processes_at_once(db: Path | str) -> None:
    """Two apiservers share one IAM file: a token rotated or revoked through one stops working
    in the other at once, although the other has it cached (TTL 1 h here)."""
    a = IAM(db, auth_cache_ttl_s=3600)
    b = IAM(db, auth_cache_ttl_s=3600)
    try:
        a.bootstrap()
        p, token = a.create_principal("leaky", ["default"])
        assert b.authenticate(token).id == p.id  # now cached in b
        new = a.rotate_token(p.id)
        with pytest.raises(errors.AuthError, match="revoked or was rotated"):
            b.authenticate(token)
        assert b.authenticate(new).id == p.id  # cached again
        a.revoke_token(p.id)
        with pytest.raises(errors.AuthError):
            b.authenticate(new)
        with pytest.raises(errors.AuthError):
            a.authenticate(new)
        assert b.find_principal("leaky").id == p.id  # the principal and its grants stay
        assert b.find_principal(p.id).projects == ["default"]
        again = b.rotate_token(p.id)  # an admin issues a new one
        assert a.authenticate(again).name == "leaky"
        # unrelated writes (reservations) in one process do not empty the other's cache
        b.authenticate(again)
        a.reserve("sb-1", "default", 1, 64)
        hits = b._auth_cache.copy()
        assert b.authenticate(again).name == "leaky" and b._auth_cache == hits
        with pytest.raises(errors.NotFound, match="no principal"):
            a.find_principal("nobody")
    finally:
        a.close()
        b.close()


def _reserve_pending_and_hang(db: str, ready: Any) -> None:
    iam = IAM(db, owner_lease_s=1.0)
    iam.reserve("pending-crashed", "default", 1, 64, pending=True)
    ready.set()
    time.sleep(3600)  # killed by the test: a crashed apiserver mid-create


def _start_hanging(db: Path | str, target: Any) -> Any:
    """`target(db, ready)` in a process of its own, once it is ready (an apiserver mid-work)."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(str(db), ready))
    proc.start()
    assert ready.wait(60)
    return proc


def _released_once_dead(reconciler: IAM, proc: Any) -> list[str]:
    """Kill `proc`; what the reconciler's next rounds release. Its flock (SQLite) or its
    session's lock (PostgreSQL) goes with it; the server notices a dead client's session
    within moments: polled briefly."""
    proc.kill()
    proc.join(30)
    released: list[str] = []
    for _ in range(100):
        released = reconciler.release_orphaned()
        if released:
            break
        time.sleep(0.02)
    return released


def test_pending_reservations_stay_while_their_create_runs(db: Path | str) -> None:
    """A create's reservation is never reconciled away while its process lives, however long
    the create takes; a crashed process's pending reservations are released by the next."""
    creator = IAM(db)
    reconciler = IAM(db)
    try:
        creator.bootstrap()
        creator.set_quota("default", Quota(max_sandboxes=2))
        creator.reserve("pending-slow", "default", 1, 64, pending=True)
        time.sleep(0.05)
        # old behaviour: anything older than the grace and not listed by an edge went
        assert reconciler.reconcile(set(), older_than_s=0.01) == []
        assert creator.reconcile(set(), older_than_s=0.01) == []
        assert reconciler.release_orphaned() == []
        assert set(reconciler.reservations()) == {"pending-slow"}
        # the create ends: re-keyed, the grace starts again, then the edges vouch for it
        creator.rekey("pending-slow", "n0-sandbox")
        assert reconciler.reconcile(set(), older_than_s=30) == []
        assert reconciler.reconcile({"n0-sandbox"}, older_than_s=0) == []
        proc = _start_hanging(db, _reserve_pending_and_hang)
        assert reconciler.release_orphaned() == []  # alive: kept
        with pytest.raises(errors.QuotaExceeded):
            reconciler.reserve("third", "default", 1, 64)
        assert _released_once_dead(reconciler, proc) == ["pending-crashed"]  # gone at once
        assert set(reconciler.reservations()) == {"n0-sandbox"}
        assert reconciler.usage("default").sandboxes == 1
        if isinstance(db, Path):
            assert not list((db.parent / (db.name + ".owners")).iterdir())[1:]  # only creator's
    finally:
        creator.close()
        reconciler.close()
    if isinstance(db, Path):
        assert list((db.parent / (db.name + ".owners")).iterdir()) == []  # closed: gone


def test_principal_validation(iam: IAM) -> None:
    with pytest.raises(errors.NotFound, match="'nope'"):
        iam.create_principal("carol", ["nope"])
    with pytest.raises(errors.InvalidRequest, match="at least one project"):
        iam.create_principal("carol", [])
    iam.create_principal("carol", ["default"])
    with pytest.raises(errors.Conflict, match="already exists"):
        iam.create_principal("carol", ["default"])
    with pytest.raises(errors.InvalidRequest):
        iam.create_principal("bad name", ["default"])


# ---------------------------------------------------------------- projects and quotas


def test_project_names_and_duplicates(iam: IAM) -> None:
    for bad in ("", "Team", "-x", "a_b", "a" * 64):
        with pytest.raises(errors.InvalidRequest, match="invalid project name"):
            iam.create_project(bad)
    iam.create_project("a" * 63)
    iam.create_project("team-1")
    with pytest.raises(errors.Conflict, match="already exists"):
        iam.create_project("team-1")
    with pytest.raises(errors.NotFound, match="'ghost'"):
        iam.create_project("child", parent="ghost")
    with pytest.raises(errors.NotFound):
        iam.get_project("ghost")


def test_nested_quota_bounds(iam: IAM) -> None:
    iam.create_project("org", quota=Quota(max_sandboxes=10, max_cpu=8))
    with pytest.raises(errors.InvalidRequest, match=r"max_sandboxes=11 .* 'org'") as ei:
        iam.create_project("team", parent="org", quota=Quota(max_sandboxes=11))
    assert ei.value.status == 400
    with pytest.raises(errors.InvalidRequest, match="max_cpu"):
        iam.create_project("team", parent="org", quota=Quota(max_cpu=8.5))
    # None inherits; an unlimited dimension of the parent allows any value.
    team = iam.create_project("team", parent="org", quota=Quota(max_memory_mb=4096))
    assert team.quota == Quota(max_memory_mb=4096)
    assert iam.effective_quota("team") == Quota(max_sandboxes=10, max_cpu=8, max_memory_mb=4096)
    # Deeper nesting is bounded by the nearest explicit ancestor value.
    iam.create_project("squad", parent="team", quota=Quota(max_sandboxes=10))
    with pytest.raises(errors.InvalidRequest, match="'team'"):
        iam.create_project("squad2", parent="team", quota=Quota(max_memory_mb=5000))
    deep = "squad"
    for i in range(10):
        iam.create_project(f"d{i}", parent=deep)
        deep = f"d{i}"
    assert iam.effective_quota(deep).max_sandboxes == 10
    assert iam.get_project("d0").parent == "squad"


def test_set_quota_keeps_the_tree_consistent(iam: IAM) -> None:
    iam.create_project("org", quota=Quota(max_sandboxes=10))
    iam.create_project("team", parent="org", quota=Quota(max_sandboxes=8))
    iam.create_project("squad", parent="team", quota=Quota(max_sandboxes=6))
    with pytest.raises(errors.InvalidRequest, match="'team'"):
        iam.set_quota("org", Quota(max_sandboxes=7))  # team (8) would no longer fit
    with pytest.raises(errors.InvalidRequest, match="'squad'"):
        iam.set_quota("team", Quota(max_sandboxes=5))  # squad (6) would no longer fit
    with pytest.raises(errors.InvalidRequest, match="'org'"):
        iam.set_quota("team", Quota(max_sandboxes=11))
    assert iam.set_quota("org", Quota(max_sandboxes=8)).quota.max_sandboxes == 8
    assert iam.get_project("org").quota.max_sandboxes == 8
    with pytest.raises(errors.NotFound):
        iam.set_quota("ghost", Quota())


def test_set_quota_unset_inherits(iam: IAM) -> None:
    iam.create_project("org", quota=Quota(max_sandboxes=10))
    iam.create_project("team", parent="org", quota=Quota(max_sandboxes=8))
    iam.create_project("squad", parent="team", quota=Quota(max_sandboxes=6))
    assert iam.set_quota("team", Quota()).quota == Quota()
    assert iam.effective_quota("team").max_sandboxes == 10
    with pytest.raises(errors.InvalidRequest, match="'squad'"):
        iam.set_quota("org", Quota(max_sandboxes=5))  # squad (6) would exceed via the inherited bound


# ---------------------------------------------------------------- visibility


def test_visibility_includes_descendants(iam: IAM) -> None:
    iam.create_project("org")
    iam.create_project("team", parent="org")
    iam.create_project("squad", parent="team")
    iam.create_project("other")
    p, token = iam.create_principal("dev", ["team"])
    p = iam.authenticate(token)
    assert iam.visible_projects(p) == {"team", "squad"}
    iam.authorize(p, "team")
    iam.authorize(p, "squad")
    for name in ("org", "other", "default"):
        with pytest.raises(errors.Forbidden, match=f"'{name}'") as ei:
            iam.authorize(p, name)
        assert ei.value.status == 403
    # A project created later under a granted one is visible at once.
    iam.create_project("late", parent="squad")
    assert "late" in (iam.visible_projects(p) or set())
    iam.authorize(p, "late")
    admin = iam.create_principal("root2", [], admin=True)[0]
    assert iam.visible_projects(admin) is None
    iam.authorize(admin, "other")


# ---------------------------------------------------------------- admission


def test_reserve_release(iam: IAM) -> None:
    iam.create_project("p", quota=Quota(max_sandboxes=2, max_cpu=1.0, max_memory_mb=1024))
    iam.reserve("sb-1", "p", 0.5, 512)
    iam.reserve("sb-1", "p", 0.5, 512)  # idempotent
    assert iam.usage("p") == Usage(sandboxes=1, cpu=0.5, memory_mb=512)
    iam.reserve("sb-2", "p", 0.5, 512)
    with pytest.raises(errors.QuotaExceeded, match="project 'p' is out of sandboxes: 2 of 2") as ei:
        iam.reserve("sb-3", "p", 0.0, 0)
    assert ei.value.status == 429
    assert ei.value.details["dimension"] == "max_sandboxes"
    iam.release("sb-2")
    iam.release("sb-2")  # idempotent
    iam.release("never-existed")
    with pytest.raises(errors.QuotaExceeded, match=r"CPUs: 0\.5 of 1 in use and this sandbox needs 0\.75"):
        iam.reserve("sb-3", "p", 0.75, 1)
    with pytest.raises(errors.QuotaExceeded, match="MiB of memory") as ei:
        iam.reserve("sb-3", "p", 0.5, 513)
    assert ei.value.details == {
        "project": "p",
        "dimension": "max_memory_mb",
        "usage": 512,
        "limit": 1024,
        "requested": 513,
    }
    assert iam.reservations() == {"sb-1": "p"}
    with pytest.raises(errors.Conflict, match="'p'"):
        iam.reserve("sb-1", "default", 0.1, 1)
    with pytest.raises(errors.NotFound):
        iam.reserve("x", "ghost", 0.1, 1)
    with pytest.raises(errors.InvalidRequest):
        iam.reserve("x", "p", -1, 1)


def test_cpu_accounting_does_not_drift(iam: IAM) -> None:
    iam.create_project("p", quota=Quota(max_cpu=1.0))
    for i in range(10):
        iam.reserve(f"k{i}", "p", 0.1, 0)
    with pytest.raises(errors.QuotaExceeded):
        iam.reserve("k10", "p", 0.1, 0)
    for i in range(10):
        iam.release(f"k{i}")
    assert iam.usage("p") == Usage(sandboxes=0, cpu=0.0, memory_mb=0)


def test_rekey(iam: IAM) -> None:
    iam.reserve("tmp-1", "default", 1, 1)
    iam.rekey("tmp-1", "sb-1")
    iam.rekey("tmp-1", "sb-1")  # idempotent
    assert iam.reservations() == {"sb-1": "default"}
    with pytest.raises(errors.NotFound):
        iam.rekey("tmp-9", "sb-9")
    iam.reserve("tmp-2", "default", 1, 1)
    with pytest.raises(errors.Conflict):
        iam.rekey("tmp-2", "sb-1")
    iam.release("sb-1")
    assert iam.usage("default").sandboxes == 1


def test_an_idempotency_claim_and_its_reservation_are_one_transaction(iam: IAM) -> None:
    iam.create_project("p", quota=Quota(max_sandboxes=1))
    assert iam.begin_idempotent("alice", "k1", reserve=("pending-1", "p", 0.5, 64)) == ("new", None)
    assert iam.reservations() == {"pending-1": "p"} and iam.usage("p").sandboxes == 1
    with pytest.raises(errors.QuotaExceeded):  # refused: the key is not claimed either
        iam.begin_idempotent("alice", "k2", reserve=("pending-2", "p", 0.5, 64))
    assert iam.reservations() == {"pending-1": "p"}  # (the refused row was rolled back)
    assert iam.begin_idempotent("alice", "k2") == ("new", None)  # (free: a retry claims it)
    iam.end_idempotent("alice", "k2", None)
    # busy (this process is making it: a retry that came back here) and done reserve nothing
    state, _ = iam.begin_idempotent("alice", "k1", reserve=("pending-3", "p", 0.5, 64))
    assert state == "busy" and "pending-3" not in iam.reservations()
    iam.rekey("pending-1", "sb-1", ends=("alice", "k1", '{"id": "sb-1"}'))  # one commit for both
    assert iam.reservations() == {"sb-1": "p"}
    assert iam.begin_idempotent("alice", "k1", reserve=("pending-4", "p", 0.5, 64)) == (
        "done",
        '{"id": "sb-1"}',
    )
    assert iam.reservations() == {"sb-1": "p"}


def test_a_key_being_made_is_busy_everywhere_and_taken_over_once_its_maker_died(db: Path | str) -> None:
    """A retry of a create still in flight waits for it ("busy"), whether it came back to the
    apiserver process making it or went to another; once the maker died without ending the
    key, the next one takes it over (and looks for what it made)."""
    a, b = IAM(db), IAM(db)
    try:
        a.bootstrap()
        assert a.begin_idempotent("alice", "k", reserve=("pending-1", "default", 0.5, 64)) == ("new", None)
        for retry in (a, b):  # (same process: it was "taken over" by itself, made twice)
            assert retry.begin_idempotent("alice", "k", reserve=("pending-2", "default", 0.5, 64)) == (
                "busy",
                None,
            )
        a.rekey("pending-1", "sb-1", ends=("alice", "k", '{"id": "sb-1"}'))
        assert b.begin_idempotent("alice", "k") == ("done", '{"id": "sb-1"}')
        assert a.begin_idempotent("alice", "k2") == ("new", None)
        a.close()  # died mid-create: its key was never ended
        assert b.begin_idempotent("alice", "k2") == ("taken_over", None)
        assert b.begin_idempotent("alice", "k2") == ("busy", None)  # (now b makes it)
        b.end_idempotent("alice", "k2", None)
        assert b.begin_idempotent("alice", "k2") == ("new", None)
    finally:
        a.close()
        b.close()


def test_an_end_deferred_by_an_earlier_call_does_not_end_a_retry(iam: IAM) -> None:
    """A create whose key's end was deferred (the database was away), then the client's retry
    claims the key again: the reconciler's deferred end must not end the retry's key."""
    assert iam.begin_idempotent("alice", "k") == ("new", None)
    iam._unended[("alice", "k")] = None  # (what end_idempotent(defer=True) leaves when it fails)
    state, _ = iam.begin_idempotent("alice", "k")  # the retry (same process): it makes it now
    assert state == "busy"
    iam.end_idempotent("alice", "k", None)  # the first call ends; the retry begins again
    iam._unended[("alice", "k")] = None
    assert iam.begin_idempotent("alice", "k") == ("new", None)
    iam.release_orphaned()  # the reconciler's round
    assert iam.begin_idempotent("alice", "k") == ("busy", None)  # still the retry's


def test_a_failed_rekey_does_not_end_the_idempotency_key(iam: IAM) -> None:
    iam.reserve("sb-1", "default", 1, 1)
    iam.begin_idempotent("alice", "k", reserve=("pending-1", "default", 1, 1))
    with pytest.raises(errors.Conflict):
        iam.rekey("pending-1", "sb-1", ends=("alice", "k", "{}"))
    assert iam.begin_idempotent("alice", "k")[0] != "done"  # rolled back together


def test_ancestor_quota_limits_a_childs_burst(iam: IAM) -> None:
    iam.create_project("org", quota=Quota(max_sandboxes=5))
    iam.create_project("a", parent="org")
    iam.create_project("b", parent="org")
    iam.create_project("b1", parent="b")
    for i in range(3):
        iam.reserve(f"a{i}", "a", 0, 0)
    iam.reserve("b0", "b", 0, 0)
    iam.reserve("b1-0", "b1", 0, 0)
    with pytest.raises(errors.QuotaExceeded, match=r"project 'org' \(an ancestor of 'b1'\)") as ei:
        iam.reserve("b1-1", "b1", 0, 0)
    assert ei.value.details["project"] == "org"
    assert iam.usage("org") == Usage(sandboxes=5, cpu=0, memory_mb=0)
    assert iam.usage("b") == Usage(sandboxes=2, cpu=0, memory_mb=0)
    assert iam.usage("b", recursive=False).sandboxes == 1
    assert iam.usage("org", recursive=False).sandboxes == 0
    iam.release("a0")
    iam.reserve("b1-1", "b1", 0, 0)
    assert iam.usage("b1").sandboxes == 2


def test_reconcile_releases_stale_keys(iam: IAM) -> None:
    for k in ("live", "stale-1", "stale-2"):
        iam.reserve(k, "default", 1, 64)
    assert iam.reconcile({"live"}) == []  # all younger than 30 s
    time.sleep(0.6)
    iam.reserve("fresh", "default", 1, 64)  # (0.3 s of margin: a loaded host is slow)
    assert iam.reconcile({"live"}, older_than_s=0.3) == ["stale-1", "stale-2"]
    assert set(iam.reservations()) == {"live", "fresh"}
    assert iam.usage("default") == Usage(sandboxes=2, cpu=2, memory_mb=128)


def test_reconcile_spares_what_was_made_while_the_edges_were_asked(iam: IAM) -> None:
    """The reconciler asks the edges, then reconciles: a create that completed (re-keyed to
    its sandbox id) in between is missing from their answers without being gone."""
    iam.reserve("old", "default", 1, 64)
    time.sleep(0.05)
    asked_at = time.time()
    time.sleep(0.05)
    iam.reserve("pending-create", "default", 1, 64, pending=True)
    iam.rekey("pending-create", "n0-new")  # completed after the edges answered
    time.sleep(0.05)
    assert iam.reconcile(set(), older_than_s=0.04, as_of=asked_at) == ["old"]
    assert set(iam.reservations()) == {"n0-new"}
    assert iam.reconcile(set(), older_than_s=0.04) == ["n0-new"]  # asked again: it is gone


# ---------------------------------------------------------------- contention


def _hammer(reserve: Any, n: int, threads: int, cpu: float, mem: int, prefix: str) -> int:
    start = threading.Barrier(threads)

    def one(i: int) -> bool:
        if i < threads:
            start.wait()
        try:
            reserve(f"{prefix}-{i}", cpu, mem)
        except errors.QuotaExceeded:
            return False
        return True

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, range(n)))


@pytest.mark.parametrize(
    ("quota", "cpu", "mem", "expected"),
    [
        (Quota(max_sandboxes=50), 0.0, 0, 50),
        (Quota(max_cpu=10.0), 0.25, 0, 40),
        (Quota(max_memory_mb=1000), 0.0, 64, 15),
    ],
    ids=["sandboxes", "cpu", "memory"],
)
def test_concurrent_threads_shared_instance(
    iam: IAM, quota: Quota, cpu: float, mem: int, expected: int
) -> None:
    iam.create_project("hot", quota=quota)
    admitted = _hammer(lambda k, c, m: iam.reserve(k, "hot", c, m), 200, 16, cpu, mem, "t")
    assert admitted == expected
    assert len(iam.reservations()) == expected
    assert iam.usage("hot").sandboxes == expected


def test_concurrent_threads_separate_connections(db: Path | str) -> None:
    """16 threads, each with its own IAM (own SQLite connection): contention is resolved by SQLite itself."""
    with IAM(db) as setup:
        setup.create_project("org", quota=Quota(max_sandboxes=50, max_cpu=100))
        setup.create_project("hot", parent="org")
    local = threading.local()
    opened: list[IAM] = []
    lock = threading.Lock()

    def reserve(key: str, cpu: float, mem: int) -> None:
        if not hasattr(local, "iam"):
            local.iam = IAM(db)
            with lock:
                opened.append(local.iam)
        local.iam.reserve(key, "hot", cpu, mem)

    try:
        assert _hammer(reserve, 200, 16, 1.0, 0, "s") == 50
    finally:
        for i in opened:
            i.close()
    with IAM(db) as check:
        assert check.usage("org") == Usage(sandboxes=50, cpu=50, memory_mb=0)
        assert check.usage("hot", recursive=False).sandboxes == 50


def _process_worker(
    db_path: str, project: str, worker: int, n: int, cpu: float, mem: int, start: Any, out: Any
) -> None:
    iam = IAM(db_path)
    admitted = 0
    try:
        start.wait()
        for i in range(n):
            try:
                iam.reserve(f"w{worker}-{i}", project, cpu, mem)
                admitted += 1
            except errors.QuotaExceeded:
                pass
    finally:
        iam.close()
        out.put(admitted)


@pytest.mark.parametrize(
    ("quota", "cpu", "mem", "expected"),
    [
        (Quota(max_sandboxes=50), 0.0, 0, 50),
        (Quota(max_cpu=10.0), 0.5, 0, 20),
        (Quota(max_memory_mb=1000), 0.0, 64, 15),
    ],
    ids=["sandboxes", "cpu", "memory"],
)
def test_concurrent_processes(db: Path | str, quota: Quota, cpu: float, mem: int, expected: int) -> None:
    with IAM(db) as setup:
        setup.create_project("hot", quota=quota)
    ctx = multiprocessing.get_context("spawn")
    procs_n, per = 4, 50
    start, out = ctx.Barrier(procs_n), ctx.Queue()
    procs = [
        ctx.Process(target=_process_worker, args=(str(db), "hot", w, per, cpu, mem, start, out))
        for w in range(procs_n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    out.close()
    out.join_thread()
    assert sum(results) == expected
    with IAM(db) as check:
        assert len(check.reservations()) == expected
        assert check.usage("hot").sandboxes == expected


# ---------------------------------------------------------------- snapshot quotas


def test_snapshot_quota_fields_flow_through(iam: IAM) -> None:
    q = Quota(max_sandboxes=4, max_snapshots=3, max_snapshot_mb=100)
    assert iam.create_project("org", quota=q).quota == q
    assert iam.get_project("org").quota == q
    assert [p.quota for p in iam.list_projects() if p.name == "org"] == [q]
    assert iam.effective_quota("org") == q
    with pytest.raises(errors.InvalidRequest, match=r"max_snapshots=4 .* 3 snapshots .* 'org'"):
        iam.create_project("team", parent="org", quota=Quota(max_snapshots=4))
    with pytest.raises(errors.InvalidRequest, match="max_snapshot_mb"):
        iam.create_project("team", parent="org", quota=Quota(max_snapshot_mb=101))
    iam.create_project("team", parent="org", quota=Quota(max_snapshot_mb=50))
    assert iam.effective_quota("team") == Quota(max_sandboxes=4, max_snapshots=3, max_snapshot_mb=50)
    with pytest.raises(errors.InvalidRequest, match="'team'"):
        iam.set_quota("org", Quota(max_snapshot_mb=49))  # team (50) would no longer fit
    updated = Quota(max_snapshots=10, max_snapshot_mb=60)
    assert iam.set_quota("org", updated).quota == updated
    assert iam.get_project("org").quota == updated
    with pytest.raises(ValueError):
        Quota(max_snapshot_mb=-1)


def test_reserve_release_snapshots(iam: IAM) -> None:
    iam.create_project("p", quota=Quota(max_snapshots=3, max_snapshot_mb=100))
    iam.reserve_snapshot("snap-1", "p", 40)
    iam.reserve_snapshot("snap-1", "p", 40)  # idempotent
    assert iam.usage("p") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=1, snapshot_mb=40)
    iam.reserve_snapshot("snap-2", "p", 59.2)  # type: ignore[arg-type]  # rounded up to 60
    assert iam.snapshot_reservations() == {"snap-1": ("p", 40), "snap-2": ("p", 60)}
    with pytest.raises(
        errors.QuotaExceeded, match=r"project 'p' is out of MiB of snapshots: 100 of 100"
    ) as ei:
        iam.reserve_snapshot("snap-3", "p", 1)
    assert ei.value.status == 429
    assert ei.value.details == {
        "project": "p",
        "dimension": "max_snapshot_mb",
        "usage": 100,
        "limit": 100,
        "requested": 1,
    }
    assert "delete snapshots" in str(ei.value) and "max_snapshot_mb of project 'p'" in str(ei.value)
    iam.reserve_snapshot("snap-3", "p", 0)  # an empty snapshot still counts
    with pytest.raises(errors.QuotaExceeded, match="out of snapshots: 3 of 3") as ei:
        iam.reserve_snapshot("snap-4", "p", 0)
    assert ei.value.details["dimension"] == "max_snapshots"
    assert iam.usage("p") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=3, snapshot_mb=100)
    iam.release_snapshot("snap-2")
    iam.release_snapshot("snap-2")  # idempotent
    iam.release_snapshot("never-existed")
    assert iam.usage("p").snapshot_mb == 40
    iam.reserve_snapshot("snap-4", "p", 60)
    assert iam.usage("p") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=3, snapshot_mb=100)
    # A failed admission leaves nothing behind.
    assert set(iam.snapshot_reservations()) == {"snap-1", "snap-3", "snap-4"}


def test_snapshot_reservation_errors(iam: IAM) -> None:
    iam.create_project("p")
    iam.reserve_snapshot("s", "p", 10)
    with pytest.raises(errors.Conflict, match="'p'") as ei:
        iam.reserve_snapshot("s", "default", 10)
    assert ei.value.status == 409
    with pytest.raises(errors.Conflict, match="10 MiB"):
        iam.reserve_snapshot("s", "p", 11)  # a different size needs resize_snapshot
    with pytest.raises(errors.NotFound, match="'ghost'"):
        iam.reserve_snapshot("x", "ghost", 1)
    for bad in (-1, -0.5, float("nan"), float("inf")):
        with pytest.raises(errors.InvalidRequest, match="size_mb"):
            iam.reserve_snapshot("x", "p", bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidRequest, match="non-empty"):
        iam.reserve_snapshot("", "p", 1)
    with pytest.raises(errors.NotFound, match="'x'"):
        iam.resize_snapshot("x", 1)
    assert iam.snapshot_reservations() == {"s": ("p", 10)}
    assert iam.usage("p").snapshots == 1


def test_resize_snapshot(iam: IAM) -> None:
    iam.create_project("org", quota=Quota(max_snapshot_mb=100))
    iam.create_project("team", parent="org")
    iam.reserve_snapshot("a", "team", 30)
    iam.reserve_snapshot("b", "org", 30)
    iam.resize_snapshot("a", 70)
    assert iam.usage("org").snapshot_mb == 100 and iam.usage("team").snapshot_mb == 70
    with pytest.raises(errors.QuotaExceeded, match=r"project 'org' \(an ancestor of 'team'\)") as ei:
        iam.resize_snapshot("a", 71)
    assert ei.value.details["requested"] == 1
    assert iam.snapshot_reservations()["a"] == ("team", 70)  # unchanged on refusal
    iam.resize_snapshot("a", 5)  # shrinking always succeeds
    iam.resize_snapshot("a", 5)
    assert iam.usage("org") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=2, snapshot_mb=35)
    assert iam.usage("team").snapshot_mb == 5
    with pytest.raises(errors.InvalidRequest):
        iam.resize_snapshot("a", -1)


def test_a_copy_reserves_what_is_left_before_it_is_made(iam: IAM) -> None:
    """A snapshot, fork layer or checkpoint about to be copied holds a slot and up to what the
    quota has left (its cap) before any byte is copied; it settles to its real size."""
    iam.create_project("org", quota=Quota(max_snapshots=3, max_snapshot_mb=100, max_memory_mb=1000))
    iam.create_project("team", parent="org", quota=Quota(max_memory_mb=500))
    iam.reserve_snapshot("kept", "team", 30)
    assert iam.reserve_snapshot_up_to("p1", "team", 4608) == 70  # the rest, not the bound
    assert iam.usage("org").snapshot_mb == 100
    with pytest.raises(errors.QuotaExceeded, match=r"'org' \(an ancestor of 'team'\) is out of MiB of snap"):
        iam.reserve_snapshot_up_to("p2", "team", 10)  # nothing left: refused before any copy
    assert iam.reserve_snapshot_up_to("p2", "team", 0) == 0  # (an empty one fits)
    with pytest.raises(errors.QuotaExceeded, match="out of snapshots: 3 of 3"):
        iam.reserve_snapshot_up_to("p3", "org", 0)
    iam.release_snapshot("p2")
    iam.rekey_snapshot("p1", "snap-1")  # settled: the real size
    iam.resize_snapshot("snap-1", 12)
    assert iam.snapshot_reservations() == {"kept": ("team", 30), "snap-1": ("team", 12)}
    assert iam.reserve_snapshot_up_to("p4", "org", 20) == 20  # at most what it asks
    assert iam.usage("org") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=3, snapshot_mb=62)
    with pytest.raises(errors.Conflict):
        iam.reserve_snapshot_up_to("p4", "org", 1)


def test_a_fork_layer_in_ram_counts_against_memory_too(iam: IAM) -> None:
    """A fork layer lives on the edge's run tmpfs: host memory, charged to max_memory_mb (and
    to the snapshot quota) for as long as it is held."""
    iam.create_project("org", quota=Quota(max_memory_mb=1024))
    iam.create_project("team", parent="org")
    for i in range(3):
        iam.reserve(f"sb{i}", "team", 1, 256)
    assert iam.reserve_snapshot_up_to("layer", "team", 2048, in_ram=True) == 256  # memory left
    assert iam.usage("org").memory_mb == 1024 and iam.usage("team", recursive=False).memory_mb == 1024
    with pytest.raises(errors.QuotaExceeded, match="out of MiB of memory"):
        iam.reserve("sb3", "team", 1, 16)  # the layer's memory is held
    with pytest.raises(errors.QuotaExceeded, match="max_memory_mb") as ei:
        iam.reserve_snapshot_up_to("other", "team", 1, in_ram=True)
    assert "children of earlier forks" in str(ei.value)
    iam.rekey_snapshot("layer", "fork:l1")
    with pytest.raises(errors.QuotaExceeded, match="out of MiB of memory"):
        iam.resize_snapshot("fork:l1", 300)
    iam.resize_snapshot("fork:l1", 100)  # the size copied
    assert iam.usage("org") == Usage(sandboxes=3, cpu=3, memory_mb=868, snapshots=1, snapshot_mb=100)
    iam.reserve("sb3", "team", 1, 156)
    iam.release("sb3")
    iam.release_snapshot("fork:l1")
    assert iam.usage("org") == Usage(sandboxes=3, cpu=3, memory_mb=768)
    iam.reserve_snapshot("snap", "team", 500)  # a snapshot on disk is no memory
    assert iam.usage("org").memory_mb == 768


def _reserve_copy_and_hang(db: str, ready: Any) -> None:
    iam = IAM(db, owner_lease_s=1.0)
    iam.reserve_snapshot_up_to("pending-copy", "default", 500, in_ram=True)
    ready.set()
    time.sleep(3600)  # killed by the test: an apiserver that died while an edge copied


def test_a_dead_apiservers_copy_in_flight_gives_its_reservation_back(db: Path | str) -> None:
    """A copy's reservation (up to all the quota has left) is pending while its apiserver
    lives, and released once it is gone: it never pins the quota for good."""
    with IAM(db) as reconciler:
        reconciler.bootstrap()
        reconciler.set_quota("default", Quota(max_snapshot_mb=600, max_memory_mb=600))
        proc = _start_hanging(db, _reserve_copy_and_hang)
        assert reconciler.release_orphaned() == []  # alive: kept
        assert reconciler.usage("default").memory_mb == 500
        assert reconciler.reserve_snapshot_up_to("mine", "default", 1000) == 100
        assert _released_once_dead(reconciler, proc) == ["pending-copy"]
        assert reconciler.usage("default") == Usage(
            sandboxes=0, cpu=0, memory_mb=0, snapshots=1, snapshot_mb=100
        )
        reconciler.rekey_snapshot("mine", "snap")  # settled: no longer pending, kept
        assert reconciler.release_orphaned() == []
        assert set(reconciler.snapshot_reservations()) == {"snap"}


def test_snapshot_quota_nested(iam: IAM) -> None:
    iam.create_project("org", quota=Quota(max_snapshots=5, max_snapshot_mb=1000))
    iam.create_project("a", parent="org", quota=Quota(max_snapshots=4))
    iam.create_project("b", parent="org")
    iam.create_project("b1", parent="b", quota=Quota(max_snapshot_mb=200))
    for i in range(3):
        iam.reserve_snapshot(f"a{i}", "a", 100)
    iam.reserve_snapshot("b0", "b", 100)
    # b1's own bound: 200 MiB.
    with pytest.raises(errors.QuotaExceeded, match=r"project 'b1' is out of MiB of snapshots"):
        iam.reserve_snapshot("b1-big", "b1", 201)
    iam.reserve_snapshot("b1-0", "b1", 200)
    # org holds 5 snapshots (siblings count against the parent), so a's own bound (4) is never reached.
    with pytest.raises(
        errors.QuotaExceeded, match=r"project 'org' \(an ancestor of 'a'\) is out of snapshots"
    ) as ei:
        iam.reserve_snapshot("a3", "a", 1)
    assert ei.value.details["project"] == "org"
    assert iam.usage("org") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=5, snapshot_mb=600)
    assert iam.usage("b") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=2, snapshot_mb=300)
    assert iam.usage("b", recursive=False) == Usage(
        sandboxes=0, cpu=0, memory_mb=0, snapshots=1, snapshot_mb=100
    )
    assert iam.usage("org", recursive=False).snapshots == 0
    iam.release_snapshot("b0")
    iam.reserve_snapshot("a3", "a", 1)
    with pytest.raises(errors.QuotaExceeded, match=r"project 'a' is out of snapshots: 4 of 4"):
        iam.release_snapshot("a0")
        iam.reserve_snapshot("a4", "a", 1)
        iam.reserve_snapshot("a5", "a", 1)  # the nearest bound is reported first
    assert iam.usage("a").snapshots == 4
    # The MiB bound of org, reached from a grandchild: org holds a1, a2, a3, a4 and b1-0 = 402 MiB.
    iam.release_snapshot("a4")
    iam.set_quota("org", Quota(max_snapshots=5, max_snapshot_mb=300))  # lowering below usage is allowed
    with pytest.raises(
        errors.QuotaExceeded, match=r"'org' \(an ancestor of 'b1'\) is out of MiB of snapshots"
    ):
        iam.reserve_snapshot("b1-1", "b1", 0)
    usages = iam.usages()
    assert set(usages) == {"default", "org", "a", "b", "b1"}
    assert usages["org"] == iam.usage("org") and usages["b1"] == iam.usage("b1")


def test_sandbox_and_snapshot_reservations_are_independent(iam: IAM) -> None:
    iam.create_project(
        "p", quota=Quota(max_sandboxes=1, max_memory_mb=100, max_snapshots=1, max_snapshot_mb=100)
    )
    iam.reserve("same-key", "p", 1, 100)
    iam.reserve_snapshot("same-key", "p", 100)  # another namespace: no Conflict
    assert iam.usage("p") == Usage(sandboxes=1, cpu=1, memory_mb=100, snapshots=1, snapshot_mb=100)
    iam.release("same-key")
    assert iam.usage("p") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=1, snapshot_mb=100)
    assert iam.snapshot_reservations() == {"same-key": ("p", 100)}
    assert iam.reservations() == {}
    iam.reserve("sb", "p", 1, 100)  # sandbox quota is back; snapshot usage does not count against it
    iam.release_snapshot("sb")  # a sandbox key is not a snapshot key
    iam.release_snapshot("same-key")
    assert iam.usage("p") == Usage(sandboxes=1, cpu=1, memory_mb=100, snapshots=0, snapshot_mb=0)
    assert iam.reservations() == {"sb": "p"}
    # Reconciliation of one kind never releases the other.
    iam.reserve_snapshot("snap", "p", 5)
    time.sleep(0.05)
    assert iam.reconcile(set(), older_than_s=0.01) == ["sb"]
    assert iam.snapshot_reservations() == {"snap": ("p", 5)}
    iam.reserve("sb2", "p", 1, 1)
    assert iam.reconcile_snapshots(set(), older_than_s=0.01) == ["snap"]
    assert iam.reservations() == {"sb2": "p"}
    assert iam.usage("p") == Usage(sandboxes=1, cpu=1, memory_mb=1, snapshots=0, snapshot_mb=0)


def test_reconcile_snapshots_keeps_live_and_young(iam: IAM) -> None:
    for k in ("live", "stale"):
        iam.reserve_snapshot(k, "default", 10)
    assert iam.reconcile_snapshots({"live"}) == []  # younger than 30 s
    time.sleep(0.05)
    iam.reserve_snapshot("fresh", "default", 1)
    assert iam.reconcile_snapshots({"live"}, older_than_s=0.04) == ["stale"]
    assert iam.usage("default").snapshot_mb == 11


@pytest.mark.parametrize(
    ("quota", "size", "expected"),
    [
        (Quota(max_snapshots=50), 10, 50),
        (Quota(max_snapshot_mb=1000), 64, 15),
    ],
    ids=["count", "mib"],
)
def test_concurrent_snapshot_reservations_shared_instance(
    iam: IAM, quota: Quota, size: int, expected: int
) -> None:
    iam.create_project("org", quota=quota)
    iam.create_project("hot", parent="org")
    admitted = _hammer(lambda k, c, m: iam.reserve_snapshot(k, "hot", m), 200, 16, 0, size, "t")
    assert admitted == expected
    assert len(iam.snapshot_reservations()) == expected
    assert iam.usage("org").snapshots == expected
    assert iam.usage("org").snapshot_mb == expected * size


def test_concurrent_snapshot_reservations_separate_connections(db: Path | str) -> None:
    """Sandboxes and snapshots admitted at once by 16 threads with their own connections."""
    with IAM(db) as setup:
        setup.create_project("org", quota=Quota(max_sandboxes=30, max_snapshots=40, max_snapshot_mb=700))
        setup.create_project("hot", parent="org")
    local = threading.local()
    opened: list[IAM] = []
    lock = threading.Lock()

    def mine() -> IAM:
        if not hasattr(local, "iam"):
            local.iam = IAM(db)
            with lock:
                opened.append(local.iam)
        i: IAM = local.iam
        return i

    def reserve(key: str, cpu: float, mem: int) -> None:
        if int(key.rsplit("-", 1)[1]) % 2:
            mine().reserve(key, "hot", cpu, mem)
        else:
            mine().reserve_snapshot(key, "hot", 10)

    try:
        assert _hammer(reserve, 200, 16, 0, 0, "s") == 30 + 40
    finally:
        for i in opened:
            i.close()
    with IAM(db) as check:
        assert check.usage("org") == Usage(sandboxes=30, cpu=0, memory_mb=0, snapshots=40, snapshot_mb=400)
        assert len(check.reservations()) == 30 and len(check.snapshot_reservations()) == 40


def _snapshot_process_worker(db_path: str, worker: int, n: int, start: Any, out: Any) -> None:
    iam = IAM(db_path)
    admitted = 0
    try:
        start.wait()
        for i in range(n):
            try:
                iam.reserve_snapshot(f"w{worker}-{i}", "hot", 64)
                admitted += 1
            except errors.QuotaExceeded:
                pass
    finally:
        iam.close()
        out.put(admitted)


def test_concurrent_snapshot_processes(db: Path | str) -> None:
    with IAM(db) as setup:
        setup.create_project("hot", quota=Quota(max_snapshot_mb=1000))
    ctx = multiprocessing.get_context("spawn")
    procs_n, per = 4, 25
    start, out = ctx.Barrier(procs_n), ctx.Queue()
    procs = [
        ctx.Process(target=_snapshot_process_worker, args=(str(db), w, per, start, out))
        for w in range(procs_n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    out.close()
    out.join_thread()
    assert sum(results) == 15
    with IAM(db) as check:
        assert check.usage("hot") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=15, snapshot_mb=960)


# ---------------------------------------------------------------- schema migration

# The schema as dsec wrote it at version 1 (before snapshot quotas), verbatim.
_V1_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS projects (
        name TEXT PRIMARY KEY,
        parent TEXT REFERENCES projects(name),
        max_sandboxes INTEGER,
        max_cpu REAL,
        max_memory_mb INTEGER,
        created_at REAL NOT NULL,
        used_sandboxes INTEGER NOT NULL DEFAULT 0,
        used_cpu_m INTEGER NOT NULL DEFAULT 0,
        used_memory_mb INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS projects_parent ON projects(parent)",
    """CREATE TABLE IF NOT EXISTS principals (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        admin INTEGER NOT NULL,
        token_hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS grants (
        principal_id TEXT NOT NULL REFERENCES principals(id) ON DELETE CASCADE,
        project TEXT NOT NULL REFERENCES projects(name),
        PRIMARY KEY (principal_id, project)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS reservations (
        key TEXT PRIMARY KEY,
        project TEXT NOT NULL REFERENCES projects(name),
        cpu_m INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS reservations_project ON reservations(project)",
    "CREATE INDEX IF NOT EXISTS reservations_created ON reservations(created_at)",
)


def _make_v1_db(path: Path) -> None:
    db = sqlite3.connect(str(path), isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        for stmt in _V1_SCHEMA:
            db.execute(stmt)
        db.execute("PRAGMA user_version = 1")
        now = time.time()
        db.execute(
            "INSERT INTO projects (name, parent, max_sandboxes, max_cpu, max_memory_mb, created_at,"
            " used_sandboxes, used_cpu_m, used_memory_mb) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            ("default", None, None, None, None, now, 1, 500, 64),
        )
        db.execute(
            "INSERT INTO projects (name, parent, max_sandboxes, max_cpu, max_memory_mb, created_at,"
            " used_sandboxes, used_cpu_m, used_memory_mb) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            ("team", "default", 5, 2.0, None, now, 1, 500, 64),
        )
        db.execute(
            "INSERT INTO reservations (key, project, cpu_m, memory_mb, created_at) VALUES (?, ?, ?, ?, ?)",
            ("sb-old", "team", 500, 64, now),
        )
        db.execute(
            "INSERT INTO principals (id, name, admin, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
            ("pr_1", "admin", 1, "0" * 64, now),
        )
        db.execute("INSERT INTO grants (principal_id, project) VALUES (?, ?)", ("pr_1", "default"))
    finally:
        db.close()


def test_migrates_a_v1_database(db_path: Path) -> None:
    _make_v1_db(db_path)
    with IAM(db_path) as iam:
        assert iam.bootstrap() is None  # the admin survives
        team = iam.get_project("team")
        assert team.parent == "default"
        assert team.quota == Quota(max_sandboxes=5, max_cpu=2.0)
        assert team.quota.max_snapshots is None and team.quota.max_snapshot_mb is None
        assert iam.usage("default") == Usage(sandboxes=1, cpu=0.5, memory_mb=64, snapshots=0, snapshot_mb=0)
        assert iam.reservations() == {"sb-old": "team"}
        assert iam.snapshot_reservations() == {}
        # The new columns and table work.
        iam.set_quota("team", Quota(max_sandboxes=5, max_cpu=2.0, max_snapshots=1))
        iam.reserve_snapshot("snap", "team", 3)
        with pytest.raises(errors.QuotaExceeded, match="out of snapshots"):
            iam.reserve_snapshot("snap2", "team", 3)
        iam.release("sb-old")
        assert iam.usage("default") == Usage(sandboxes=0, cpu=0, memory_mb=0, snapshots=1, snapshot_mb=3)
    with IAM(db_path) as again:  # opening a migrated database is a no-op
        assert again.usage("team").snapshot_mb == 3
        assert again.allowed_backends("team") is None  # an older project allows every backend
        assert again.get_project("team").quota.max_snapshots == 1
    db = sqlite3.connect(str(db_path))
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 12
        assert db.execute("SELECT COUNT(*) FROM lost_sandboxes").fetchone()[0] == 0  # (v5)
        assert db.execute("SELECT COUNT(*) FROM idempotency").fetchone()[0] == 0  # (v6)
        assert db.execute("SELECT COUNT(*) FROM trajectory_shipped").fetchone()[0] == 0  # (v7)
        assert db.execute("SELECT COUNT(*) FROM bursts").fetchone()[0] == 0  # (v9)
        cols = {r[1] for r in db.execute("PRAGMA table_info(projects)")}
        assert {"max_snapshots", "max_snapshot_mb", "used_snapshots", "used_snapshot_mb"} <= cols
        assert "allowed_backends" in cols
        assert "owner" in {r[1] for r in db.execute("PRAGMA table_info(reservations)")}
        assert {"owner", "in_ram"} <= {r[1] for r in db.execute("PRAGMA table_info(snapshot_reservations)")}
    finally:
        db.close()


def test_concurrent_openers_migrate_once(db_path: Path) -> None:
    _make_v1_db(db_path)
    with ThreadPoolExecutor(8) as pool:
        opened = list(pool.map(lambda _: IAM(db_path), range(8)))
    try:
        for i in opened:
            assert i.usage("team") == Usage(sandboxes=1, cpu=0.5, memory_mb=64)
        opened[0].reserve_snapshot("s", "team", 1)
        assert opened[-1].usage("default").snapshots == 1
    finally:
        for i in opened:
            i.close()


def test_refuses_a_newer_database(db_path: Path) -> None:
    with IAM(db_path):
        pass
    db = sqlite3.connect(str(db_path))
    try:
        db.execute("PRAGMA user_version = 99")
    finally:
        db.close()
    with pytest.raises(errors.InvalidRequest, match="upgrade dsec"):
        IAM(db_path)


def test_a_principal_name_cannot_look_like_a_principal_id(tmp_path) -> None:
    """Principals are found by name or id (rotate, revoke): a name shaped like another's id
    would let an admin's "revoke NAME" hit the wrong principal."""
    iam = IAM(tmp_path / "iam.db")
    iam.create_project("p")
    victim, _ = iam.create_principal("victim", ["p"])
    with pytest.raises(errors.InvalidRequest):
        iam.create_principal(victim.id, ["p"])
    with pytest.raises(errors.InvalidRequest):
        iam.create_principal("pr_0123456789abcdef", ["p"])
    iam.create_principal("pr_not_an_id", ["p"])  # other names starting with pr_ are fine


def test_tier_policy_is_inherited_and_only_narrowed(db: Path | str) -> None:
    with IAM(db) as iam:
        iam.bootstrap()
        iam.create_project("sec", allowed_backends=["gvisor", "microvm"])
        iam.create_project("sec-a", parent="sec")  # inherits
        iam.create_project("sec-b", parent="sec", allowed_backends=["microvm"])  # narrows
        iam.create_project("sec-b-c", parent="sec-b", allowed_backends=["microvm", "microvm"])
        with pytest.raises(errors.InvalidRequest, match="may only narrow") as ei:
            iam.create_project("sec-d", parent="sec", allowed_backends=["container", "gvisor"])
        assert ei.value.details["allowed"] == ["gvisor", "microvm"]
        with pytest.raises(errors.NotFound):
            iam.get_project("sec-d")  # nothing was created
        assert iam.allowed_backends("default") is None
        assert iam.allowed_backends("sec-a") == ["gvisor", "microvm"]
        assert iam.allowed_backends("sec-b-c") == ["microvm"]
        assert iam.get_project("sec-b-c").allowed_backends == ["microvm"]
        iam.check_backend("default", "container")
        iam.check_backend("sec-a", "gvisor")
        for project, backend in (("sec-a", "container"), ("sec-b", "gvisor"), ("sec-b-c", "container")):
            with pytest.raises(errors.Forbidden) as fe:
                iam.check_backend(project, backend)
            assert fe.value.status == 403 and fe.value.code == "forbidden"
            assert backend in fe.value.message and fe.value.details["allowed"][0] in fe.value.message
    with IAM(db) as again:  # stored
        assert again.allowed_backends("sec-b-c") == ["microvm"]


def test_check_create_is_authorize_then_the_tier_policy(iam: IAM) -> None:
    iam.create_project("sec", allowed_backends=["gvisor"])
    iam.create_project("sec-a", parent="sec")
    alice, _ = iam.create_principal("alice", ["sec"])
    admin, _ = iam.create_principal("root", ["default"], admin=True)
    iam.check_create(alice, "sec-a", "gvisor")  # granted through its ancestor
    with pytest.raises(errors.Forbidden) as fe:
        iam.check_create(alice, "sec-a", "container")
    assert fe.value.details["reason"] == "backend_not_allowed"
    with pytest.raises(errors.Forbidden) as fe:  # (not granted: as authorize, before the policy)
        iam.check_create(alice, "default", "container")
    assert "no access" in fe.value.message
    with pytest.raises(errors.Forbidden):  # an unknown project is not told apart from a refused one
        iam.check_create(alice, "nope", "gvisor")
    with pytest.raises(errors.NotFound):
        iam.check_create(admin, "nope", "gvisor")
    with pytest.raises(errors.Forbidden):  # the tier policy binds admins too
        iam.check_create(admin, "sec", "container")


def test_postgres_openers_migrate_once_and_refuse_a_newer_schema(pg_url: str) -> None:
    """Several apiservers starting at once on one PostgreSQL database make the schema once
    (under the write lock); a database a newer dsec migrated is refused with what to do."""
    import psycopg

    with ThreadPoolExecutor(8) as pool:
        opened = list(pool.map(lambda _: IAM(pg_url), range(8)))
    try:
        assert [i.bootstrap() is not None for i in opened].count(True) == 1
        assert len(opened[3].list_projects()) == 1
    finally:
        for i in opened:
            i.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        (v,) = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()  # type: ignore[misc]
        conn.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (v + 1,))
        # tokens are stored hashed here too
        hashes = [r[0] for r in conn.execute("SELECT token_hash FROM principals")]
        assert hashes and all(len(h) == 64 for h in hashes)
    with pytest.raises(errors.InvalidRequest, match="upgrade dsec") as ei:
        IAM(pg_url)
    assert ":***@" in ei.value.message and pg_url.split(":")[2].split("@")[0] not in ei.value.message


# ---------------------------------------------------------------- PostgreSQL's server-side admission


def _counting_transactions(iam: IAM) -> list[int]:
    """Count the write transactions `iam` opens statement by statement (the slow path)."""
    opened = [0]
    begin = iam._db.begin_write

    def counted() -> None:
        opened[0] += 1
        begin()

    iam._db.begin_write = counted  # type: ignore[method-assign]
    return opened


def test_postgres_admits_and_settles_a_create_in_one_call_each(pg_url: str) -> None:
    """A keyed create's claim + reservation, and its rekey + the key's end, are one server-side
    function call each on PostgreSQL (no transaction opened statement by statement); what
    they leave is what the statement-by-statement path leaves."""
    with IAM(pg_url) as iam:
        iam.bootstrap()
        iam.create_project("p", quota=Quota(max_sandboxes=2, max_cpu=1.0, max_memory_mb=256))
        opened = _counting_transactions(iam)
        assert iam.begin_idempotent("alice", "k1", reserve=("pending-1", "p", 0.5, 64)) == ("new", None)
        iam.reserve("pending-2", "p", 0.25, 64, pending=True)
        assert iam.reservations() == {"pending-1": "p", "pending-2": "p"}
        iam.rekey("pending-1", "sb-1", ends=("alice", "k1", '{"id": "sb-1"}'))
        iam.rekey("pending-2", "sb-2")
        assert opened == [0]
        assert iam.reservations() == {"sb-1": "p", "sb-2": "p"}
        assert iam.usage("p") == Usage(sandboxes=2, cpu=0.75, memory_mb=128)
        assert iam.begin_idempotent("alice", "k1", reserve=("pending-3", "p", 0.5, 64)) == (
            "done",
            '{"id": "sb-1"}',
        )
        # Past the quota: the function leaves it to the Python, which words the refusal.
        with pytest.raises(errors.QuotaExceeded, match="project 'p' is out of sandboxes: 2 of 2"):
            iam.begin_idempotent("alice", "k2", reserve=("pending-4", "p", 0.1, 1))
        assert opened[0] >= 2
        assert iam.reservations() == {"sb-1": "p", "sb-2": "p"}
        assert iam.begin_idempotent("alice", "k2") == ("new", None)  # (not claimed by the refusal)


def _admission_step(iam: IAM, op: tuple[Any, ...]) -> Any:
    """Do `op` (reserve, begin, rekey, release and their arguments); what it answered, or the
    refusal (its class, message and details)."""
    kind, *args = op
    try:
        if kind == "reserve":
            return iam.reserve(*args[:4], pending=args[4])
        if kind == "begin":
            return iam.begin_idempotent(args[0], args[1], reserve=tuple(args[2:]))  # type: ignore[arg-type]
        if kind == "rekey":
            return iam.rekey(args[0], args[1], ends=args[2])
        return iam.release(args[0])
    except errors.DsecError as e:
        return (type(e).__name__, e.message, e.details)


def _random_admission_op(rng: Any, i: int, keys: list[str]) -> tuple[Any, ...]:
    project = rng.choice(["org", "a", "b", "b1", "ghost"])
    cpu = rng.choice([0, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0005])
    mem = rng.choice([0, 1, 64, 100, 150])
    roll = rng.random()
    if roll < 0.3:
        return ("reserve", rng.choice([*keys[-5:], f"r{i}"]), project, cpu, mem, rng.random() < 0.5)
    if roll < 0.6:
        key = f"pending-{i}" if rng.random() < 0.9 or not keys else rng.choice(keys)
        return ("begin", rng.choice(["alice", "bob"]), f"k{rng.randrange(40)}", key, project, cpu, mem)
    if roll < 0.8 and keys:
        result = rng.choice([None, f'{{"i": {i}}}'])
        ends = rng.choice([None, ("alice", f"k{rng.randrange(40)}", result)])
        return ("rekey", rng.choice(keys), rng.choice([f"sb-{i}", *keys[-3:]]), ends)
    return ("release", rng.choice([*keys, "none"]))


def test_postgres_server_side_admission_agrees_with_the_python(postgres_server: Any) -> None:
    """The same sequence of reservations, keyed claims, rekeys and releases over a nested
    project tree (each limit met exactly and passed by one unit, then a random walk under
    tight CPU, memory and count limits and a CPU limit whose millicores are a rounding tie)
    gives the same answers and the same books with PostgreSQL's functions as with the
    statement-by-statement path (what SQLite runs)."""
    import random
    import secrets

    names = [f"dsec_agree_{secrets.token_hex(3)}_{i}" for i in range(2)]
    urls = [postgres_server.create_database(n) for n in names]
    try:
        fast, slow = IAM(urls[0]), IAM(urls[1])
        slow._db.has_functions = False  # type: ignore[misc]
        try:
            for iam in (fast, slow):
                iam.bootstrap()
                iam.create_project("org", quota=Quota(max_sandboxes=9, max_cpu=3.0, max_memory_mb=900))
                iam.create_project("a", parent="org", quota=Quota(max_cpu=1.0005))  # a tie: 1000.5 m
                iam.create_project("b", parent="org", quota=Quota(max_memory_mb=300))
                iam.create_project("b1", parent="b", quota=Quota(max_sandboxes=3, max_cpu=0.7))
                iam.create_project("c", parent="org", quota=Quota(max_cpu=0.7, max_memory_mb=300))
            ops: list[tuple[Any, ...]] = [
                ("reserve", "c-1", "c", 0.3, 150, False),
                ("begin", "alice", "kc", "c-2", "c", 0.3, 150),
                ("reserve", "c-3", "c", 0.1, 0, True),
                ("reserve", "c-4", "c", 0.001, 0, False),
                ("release", "c-3"),
                ("reserve", "c-5", "c", 0.1, 1, False),
                ("release", "c-1"),
                ("reserve", "c-6", "c", 0.301, 0, False),
                ("reserve", "c-7", "c", 0.3, 150, False),
            ]
            rng = random.Random(1234)
            keys: list[str] = []
            opened = _counting_transactions(fast)
            fast_paths = 0
            for i in range(400 + len(ops)):
                op = ops[i] if i < len(ops) else _random_admission_op(rng, i, keys)
                before = opened[0]
                assert _admission_step(fast, op) == _admission_step(slow, op), (i, op)
                fast_paths += opened[0] == before and op[0] != "release"
                added = {"reserve": op[1:2], "begin": op[3:4], "rekey": op[1:3]}.get(op[0], ())
                keys += [k for k in added if k not in keys]
                assert fast.reservations() == slow.reservations(), (i, op)
                assert fast.usages() == slow.usages(), (i, op)
            assert fast_paths > 20  # (the functions took the common cases, not the fallback)
        finally:
            fast.close()
            slow.close()
    finally:
        for n in names:
            postgres_server.drop_database(n)
