"""Attacks on memory checkpoints from inside the sandbox.

CRIU restores a process's cwd, root and open files by the paths recorded at dump time, and
the sandbox controls those paths: it can swap a dumped directory for a symlink after the
dump (restore in place) or between the dumps of two process trees (the second tree runs
while the first is dumped, and the file copy is taken after both). A symlink through
/proc (``/proc/self/cwd/../..``, ``/proc/<criu pid>/cwd/..``) then leads CRIU, which runs in
the sandbox's pid namespace holding descriptors on host directories, to a host directory.
And a restored tree runs while the next tree is restored: it can walk CRIU's descriptors
through /proc itself. Every test here must end with no restored process holding a host
directory and no host file read; the restore is refused with reason ``file_changed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from pathlib import Path

import pytest

from dsec import errors
from dsec.backends import criu as ckpt
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

CRIU_DATA = Path(os.environ.get("DSEC_TEST_CRIU_DATA", "/var/lib/dsec"))
UP = "../" * 24  # more than enough to reach / from any host directory


@pytest.fixture(scope="session")
def criu() -> Path:
    try:
        return ckpt.ensure_criu(CRIU_DATA)
    except errors.UnsupportedOperation as e:
        pytest.skip(f"CRIU unavailable: {e}")


@pytest.fixture
async def cedge(python_image: str, edge_dirs: dict[str, Path]):
    """An edge whose data directory sits where the host's does, under world-traversable
    directories (pytest's own temporary directories are 0700, which would hide the host
    from the sandbox's mapped root by accident)."""
    from dsec.config import EdgeSettings
    from dsec.edge import Edge

    base = Path(f"/var/tmp/dsec-ckpt-test-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    e = Edge(
        EdgeSettings(
            name="t" + secrets.token_hex(4),
            reconcile_interval_s=3600,
            fncall_image="",
            **{**edge_dirs, "data_dir": base / "data"},
        )
    )
    await e.start()
    try:
        yield e
    finally:
        await e.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def marker(cedge) -> tuple[str, str]:
    """A host file the sandbox must never read: (its path relative to the host's /, content).
    World-readable, next to the edge's data directory."""
    secret = secrets.token_hex(16)
    path = Path(cedge.settings.data_dir).parent / "host-secret"
    path.write_text(secret)
    path.chmod(0o644)
    return str(path).lstrip("/"), secret


# The victim: its cwd is /work/p/lib and it holds /work/e open; once restored it tries to read the
# host secret relative to wherever its cwd and directory descriptor now are.
VICTIM = r"""
import os, sys, time
rel = "../" * 24 + sys.argv[1]  # from wherever on the host
os.makedirs("/work/p/lib", exist_ok=True)
os.makedirs("/work/e", exist_ok=True)
os.chdir("/work/p/lib")
dfd = os.open("/work/e", os.O_RDONLY | os.O_DIRECTORY)
with open("/tmp/victim.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    by_dirfd = lambda: open(os.open(rel, os.O_RDONLY, dir_fd=dfd))
    for how, opener in (("cwd", lambda: open(rel)), ("dirfd", by_dirfd)):
        try:
            data = opener().read()
        except OSError:
            continue
        with open("/tmp/leak", "a") as f:
            f.write(f"{how}:{data}\n")
    time.sleep(0.02)
"""

# Swaps /work/p (a parent of the victim's cwd) and /work/e for symlinks out of the sandbox:
# "dump": once the victim (an earlier tree) is dumped and stopped, before this tree is dumped
# itself (the copy of the files is taken after both dumps); "restore": this tree is dumped
# first, and swaps as soon as it runs again restored in a new sandbox (its init changed),
# while the victim's tree waits for its turn.
SWAPPER = r"""
import os, shutil, sys, time
target, when = sys.argv[1], sys.argv[2]
def start_time(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]
init = start_time(1)
open("/tmp/swapper.ready", "w").close()
while not os.path.exists("/tmp/victim.pid"):
    time.sleep(0.01)
victim = int(open("/tmp/victim.pid").read())
while True:
    if when == "dump":
        with open(f"/proc/{victim}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
    elif start_time(1) != init:
        break
    time.sleep(0.001)
criu_pid = max(victim, os.getpid()) + 1  # CRIU restores with the pids past every dumped one
t = target.replace("@CRIU@", str(criu_pid))
for d, to in (("/work/p", t + "var"), ("/work/e", t)):  # /work/p/lib becomes the host's /var/lib
    try:
        os.rename(d, d + ".old")
    except OSError:  # EXDEV: a directory of a lower layer (restored in a new sandbox)
        shutil.rmtree(d)
    os.symlink(to, d)
open("/tmp/swapped", "w").close()
time.sleep(3600)
"""


# Restored first, it scans every process it can see while the next tree is restored, and
# walks up from their cwd, root and descriptors towards the host secret.
SCANNER = r"""
import os, sys, time
rel = sys.argv[1]
up = "../" * 24
me = os.getpid()
open("/tmp/scanner.ready", "w").close()
while True:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in (1, me):
            continue
        links = ["cwd", "root"]
        try:
            links += [f"fd/{n}" for n in os.listdir(f"/proc/{p}/fd")]
        except OSError:
            pass
        for link in links:
            try:
                data = open(f"/proc/{p}/{link}/{up}{rel}").read()
            except OSError:
                continue
            with open("/tmp/leak", "a") as f:
                f.write(f"{p}/{link}:{data}\n")
"""


async def put(edge, sid: str, path: str, data: bytes) -> None:
    r = await edge.exec(sid, ExecRequest(cmd=f"cat > {path}", stdin=data.decode()))
    assert r.exit_code == 0, r


async def run(edge, sid: str, cmd: str) -> None:
    r = await edge.exec(sid, ExecRequest(cmd=cmd))
    assert r.exit_code == 0, r


async def wait_file(edge, sid: str, path: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = await edge.exec(sid, ExecRequest(cmd=f"test -e {path}"))
        if r.exit_code == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never appeared in {sid}")


def _mount_ids(pid: int) -> set[int]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return {int(line.split()[0]) for line in f}


def _mnt_id_of(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_PATH)
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    return None


def host_holdings(edge, sid: str) -> list[str]:
    """Every cwd, root or descriptor of a process of the sandbox on a mount the sandbox does
    not have (a host directory or file, or a detached mount of the platform). The init's
    handle on the writable layer (fd 5, see dsec-shim.c; it is non-dumpable) is the one
    expected exception."""
    sb = edge.sandboxes.get(sid)
    if sb is None:
        return []
    inside = _mount_ids(sb.handle.pid)
    bad = []
    for d, _, _ in os.walk(edge.cgroups.tracking_dir(sid)):
        with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
        for pid in (p for p in pids if p != sb.handle.pid):
            links = ["cwd", "root"]
            with contextlib.suppress(OSError):
                links += [f"fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")]
            for link in links:
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/{link}")
                    if not target.startswith("/") or target.startswith("/memfd:"):
                        continue  # pipes, sockets, anonymous inodes
                    mnt = _mnt_id_of(f"/proc/{pid}/{link}")
                    if mnt is not None and mnt not in inside:
                        bad.append(f"pid {pid} {link} -> {target} (mount {mnt})")
    return bad


async def leaked(edge, sid: str) -> str:
    if sid not in edge.sandboxes:
        return ""
    await asyncio.sleep(0.5)  # the restored processes look for it every 20 ms
    r = await edge.exec(sid, ExecRequest(cmd="cat /tmp/leak 2>/dev/null; true"))
    return r.stdout


async def restore_or_refuse(
    edge, cid: str, *, sandbox_id: str | None = None
) -> tuple[str | None, str | None]:
    """(restored sandbox id or None, refusal reason or None)."""
    try:
        info = await edge.restore(cid, sandbox_id=sandbox_id)
    except errors.UnsupportedOperation as e:
        return None, e.details["reason"]
    return info.id, None


async def start_victim(edge, sid: str, rel: str) -> None:
    await put(edge, sid, "/tmp/victim.py", VICTIM.encode())
    await run(edge, sid, f"nohup python3 /tmp/victim.py {rel} > /tmp/victim.log 2>&1 &")
    await wait_file(edge, sid, "/tmp/victim.pid")


@pytest.mark.parametrize(
    "swap",
    [
        # the cwd's parent and the open directory, through CRIU's own cwd (its images directory
        # on the host): /work/p/lib becomes the host's /var/lib, /work/e the host's /
        "mv p p.old && mv e e.old && ln -s /proc/self/cwd/{up}var p && ln -s /proc/self/cwd/{up} e",
        # through thread-self and a `..` chain, only the cwd itself
        "mv p/lib p/lib.old && ln -s /proc/thread-self/cwd/{up}usr/../var/lib p/lib",
        # relative symlinks
        "mv p p.old && mv e e.old && ln -s ../proc/self/cwd/{up}var p"
        " && ln -s ../../../proc/self/cwd/{up}usr e",
    ],
)
async def test_restore_in_place_refuses_a_directory_swapped_for_a_symlink(cedge, criu, marker, swap):
    edge = cedge
    rel, secret = marker
    sb = await edge.create(SandboxSpec(image="python"))
    await start_victim(edge, sb.id, rel)
    c = await edge.checkpoint(sb.id, leave_running=False)
    await asyncio.sleep(0.2)
    # after the dump: the recorded cwd and open directory become symlinks out of the sandbox
    await run(edge, sb.id, "cd /work && " + swap.format(up=UP))
    restored, reason = await restore_or_refuse(edge, c.id, sandbox_id=sb.id)
    holdings = host_holdings(edge, sb.id)
    leak = await leaked(edge, sb.id)
    assert secret not in leak, leak[:300]
    assert holdings == []
    assert reason == "file_changed", (restored, reason)
    # the sandbox is still usable and holds nothing of the host
    r = await edge.exec(sb.id, ExecRequest(cmd="echo ok"))
    assert r.stdout == "ok\n"


@pytest.mark.parametrize(
    ("when", "target"),
    [
        ("dump", "/proc/self/cwd/" + UP),
        ("dump", "/proc/@CRIU@/cwd/" + UP),  # CRIU seen as another process (its pid is predictable)
        ("restore", "/proc/self/cwd/" + UP),
        ("restore", "../../proc/thread-self/cwd/" + UP + "etc/..//"),  # relative
    ],
)
async def test_a_swap_between_the_trees_of_a_checkpoint_is_refused(cedge, criu, marker, when, target):
    edge = cedge
    rel, secret = marker
    sb = await edge.create(SandboxSpec(image="python"))
    await put(edge, sb.id, "/tmp/swapper.py", SWAPPER.encode())
    swapper = f"nohup python3 /tmp/swapper.py '{target}' {when} > /tmp/swapper.log 2>&1 &"
    if when == "dump":
        await start_victim(edge, sb.id, rel)  # tree 0, dumped first
        await run(edge, sb.id, swapper)
    else:
        await run(edge, sb.id, swapper)  # tree 0, restored first
        await start_victim(edge, sb.id, rel)
    await wait_file(edge, sb.id, "/tmp/swapper.ready")
    try:
        c = await edge.checkpoint(sb.id, leave_running=False)
    except errors.UnsupportedOperation as e:
        assert when == "dump" and e.details["reason"] == "file_changed", e
        r = await edge.exec(sb.id, ExecRequest(cmd="cat /tmp/swapped && pgrep -f victim.py"))
        assert r.exit_code == 0, r  # the attack landed, and a refused checkpoint left the processes running
        assert edge.list_checkpoints() == []
        return
    assert len(c.trees) == 2
    if when == "dump":
        assert (edge._checkpoint_dir(c.id) / "fs" / "work" / "p").is_symlink()  # the attack landed
    restored, reason = await restore_or_refuse(edge, c.id)
    try:
        holdings = host_holdings(edge, restored) if restored else []
        leak = await leaked(edge, restored) if restored else ""
        assert secret not in leak, leak[:300]
        assert holdings == []
        assert reason == "file_changed", (restored, reason)
    finally:
        if restored:
            await edge.stop(restored)
    assert not [s for s in edge.sandboxes if s != sb.id]  # a refused restore leaves no sandbox


async def test_a_restored_tree_cannot_walk_criu_descriptors_while_the_next_is_restored(cedge, criu, marker):
    edge = cedge
    rel, secret = marker
    sb = await edge.create(SandboxSpec(image="python"))
    await put(edge, sb.id, "/tmp/scanner.py", SCANNER.encode())
    await run(edge, sb.id, f"nohup python3 /tmp/scanner.py {rel} > /tmp/scanner.log 2>&1 &")  # tree 0
    await wait_file(edge, sb.id, "/tmp/scanner.ready")
    for _ in range(3):  # more trees: each is restored while the scanner runs
        await run(edge, sb.id, "nohup sleep 3600 > /dev/null 2>&1 &")
    c = await edge.checkpoint(sb.id, leave_running=False)
    assert len(c.trees) == 4
    restored, reason = await restore_or_refuse(edge, c.id)
    if reason is not None:
        # Nothing was swapped, but the scanner may be dumped while it holds /proc/<pid>/fd of a
        # process of a later tree open; that path does not exist before that tree is back, so
        # the check of recorded paths refuses (conservatively): nothing was leaked either way.
        assert reason == "file_changed" and restored is None
        return
    try:
        leak = await leaked(edge, restored)
        assert secret not in leak, leak[:300]
        assert host_holdings(edge, restored) == []
    finally:
        await edge.stop(restored)


async def test_without_the_path_check_criu_still_reaches_no_host_directory(cedge, criu, marker, monkeypatch):
    """Defence in depth: with the check of the recorded paths switched off, CRIU's view
    still ends at its detached mounts (their `..` stays put), so the swapped path resolves
    to nothing of the host; the restore fails or is refused and nothing is held."""
    edge = cedge
    rel, secret = marker
    monkeypatch.setattr(ckpt, "check_recorded_paths", lambda *a, **k: None, raising=False)
    sb = await edge.create(SandboxSpec(image="python"))
    await start_victim(edge, sb.id, rel)
    c = await edge.checkpoint(sb.id, leave_running=False)
    await asyncio.sleep(0.2)
    for t in (f"/proc/self/cwd/{UP}var/lib", f"/proc/thread-self/cwd/{UP}"):
        await run(edge, sb.id, f"cd /work && rm -rf p e && mkdir p && ln -s {t} p/lib && ln -s {t} e")
        _, reason = await restore_or_refuse(edge, c.id, sandbox_id=sb.id)
        assert host_holdings(edge, sb.id) == []
        assert secret not in await leaked(edge, sb.id)
        assert reason is not None  # CRIU finds nothing there, or the check after the restore refuses
        await ckpt.kill_user_processes(edge.cgroups, sb.id)


# --- the edge opens nothing by name where CRIU's restored processes can write ------------

# Tree 0, restored first: once the test says go, it waits for the CRIU that restores tree 1
# (which runs as the sandbox's root id: tree 0 may signal it), stops it right after the edge
# checked tree 1's paths, swaps tree 1's cwd for a symlink to CRIU's own cwd, wakes tree 1
# through a FIFO and lets CRIU go on.
CWD_SWAPPER = r"""
import os, signal, time
w = os.open("/work/wake", os.O_RDWR)  # keeps the FIFO's buffer while tree 1 is restored
open("/tmp/swapper.ready", "w").close()
while not os.path.exists("/tmp/go"):  # dumped here
    time.sleep(0.005)
me, criu = os.getpid(), None
while criu is None:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in (1, me, os.getppid()):  # the parent: the CRIU of tree 0
            continue
        try:
            argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"ld-linux" in argv[0] and b"restore" in argv:
            criu = int(p)
            break
os.kill(criu, signal.SIGSTOP)
os.rename("/work/t1", "/work/t1.old")
os.symlink("/proc/self/cwd", "/work/t1")
os.write(w, b"x")  # read by tree 1 as soon as it runs again
os.kill(criu, signal.SIGCONT)
time.sleep(3600)
"""

# Tree 1: restored with its cwd where CRIU's was, it plants `helper.log` (a symlink to a host
# path to create, or a FIFO that blocks whoever opens it) and `restore.log` (a symlink to a
# host secret) there: the edge used to append the first there and, after a failure, read
# both by name as host root. CRIU compares the cwd's mode with the dumped one: the attacker
# gives its cwd the mode of CRIU's (0700: the per-restore work directory CRIU had; 0755:
# the images, CRIU's cwd now).
PLANTER = r"""
import os, sys, time
create, secret, how, mode = sys.argv[1:5]
os.makedirs("/work/t1", exist_ok=True)
os.chmod("/work/t1", int(mode, 8))
os.chdir("/work/t1")
home = os.stat(".").st_dev
r = os.open("/work/wake", os.O_RDONLY)
open("/tmp/planter.ready", "w").close()
os.read(r, 1)  # dumped here; returns once restored and woken
done = []
for name, target in (("helper.log", create), ("restore.log", secret)):
    try:
        if name == "helper.log" and how == "fifo":
            os.mkfifo(".planted")
        else:
            os.symlink(target, ".planted")
        os.rename(".planted", name)
        done.append(name)
    except OSError as e:
        done.append(f"{name}: {e.strerror}")
with open("/tmp/planted", "w") as f:
    f.write(f"moved={os.stat('.').st_dev != home} {done}\n")
time.sleep(3600)
"""


@pytest.mark.parametrize(("how", "mode"), [("symlink", "700"), ("fifo", "700"), ("symlink", "755")])
async def test_a_restored_process_cannot_point_the_edge_s_criu_logs_at_the_host(cedge, criu, how, mode):
    edge = cedge
    base = Path(cedge.settings.data_dir).parent
    create, secret_file = base / "host-created", base / "host-secret"  # the first must not appear
    secret = "Error (x): " + secrets.token_hex(16)  # a line the log parser would quote
    secret_file.write_text(secret + "\n")
    sb = await edge.create(SandboxSpec(image="python"))
    await put(edge, sb.id, "/tmp/swapper.py", CWD_SWAPPER.encode())
    await put(edge, sb.id, "/tmp/planter.py", PLANTER.encode())
    await run(edge, sb.id, "mkdir -p /work && mkfifo /work/wake")
    await run(edge, sb.id, "nohup python3 /tmp/swapper.py > /tmp/swapper.log 2>&1 &")  # tree 0
    args = f"{create} {secret_file} {how} {mode}"
    await run(edge, sb.id, f"nohup python3 /tmp/planter.py {args} > /tmp/p.log 2>&1 &")  # tree 1
    await wait_file(edge, sb.id, "/tmp/swapper.ready")
    await wait_file(edge, sb.id, "/tmp/planter.ready")
    c = await edge.checkpoint(sb.id, leave_running=False)
    assert [t.cmdline.split()[-1] for t in c.trees] == ["/tmp/swapper.py", mode]
    await run(edge, sb.id, "touch /tmp/go")
    with pytest.raises(errors.UnsupportedOperation) as e:
        await edge.restore(c.id, sandbox_id=sb.id)
    # refused: by CRIU (the cwd's mode differs) or after it (a restored cwd outside the sandbox)
    assert e.value.details["reason"] == "file_changed", e.value
    assert not create.exists()
    assert secret not in str(e.value)
    assert secret_file.read_text() == secret + "\n"
    assert host_holdings(edge, sb.id) == []
    r = await edge.exec(sb.id, ExecRequest(cmd="echo ok"))  # the edge and the sandbox carry on
    assert r.stdout == "ok\n"


async def test_a_checkpoint_of_a_fork_child_copies_nothing_through_its_symlinks(cedge, criu):
    """A checkpoint of a fork's child merges the fork layer under the copy of the child's
    writable layer (dsec-copy -n). The child replaced a directory of the fork layer with a
    symlink to a host directory: the merge must not write the fork layer's files there."""
    edge = cedge
    host = Path(cedge.settings.data_dir).parent / "host-dir"
    host.mkdir()
    sb = await edge.create(SandboxSpec(image="python"))
    await run(edge, sb.id, "mkdir -p /work/d/sub && echo evil > /work/d/evil && echo x > /work/d/sub/f")
    (child,) = await edge.fork(sb.id, 1)
    await run(edge, child.id, f"rm -rf /work/d && ln -s {host} /work/d && nohup sleep 3600 >/dev/null 2>&1 &")
    c = await edge.checkpoint(child.id, leave_running=True)
    assert os.listdir(host) == []
    fs = edge._checkpoint_dir(c.id) / "fs"
    assert os.readlink(fs / "work/d") == str(host)  # the child's view, as it was


# --- quotas: checkpoints and fork layers are metered -------------------------------------


@pytest.fixture
async def api(cedge, tmp_path):
    """The apiserver in this process in front of the test's edge; (http client as a tenant of
    project "ckq" with max_snapshots=2, max_snapshot_mb=60, the IAM)."""
    import httpx

    from dsec.apiserver.app import create_api_app
    from dsec.edge.local import LocalEdge
    from dsec.iam import IAM, Quota

    iam = IAM(tmp_path / "iam.db")
    iam.bootstrap()
    iam.create_project("ckq", quota=Quota(max_snapshots=2, max_snapshot_mb=60))
    _, token = iam.create_principal("ckq-user", projects=["ckq"])
    app = create_api_app(
        iam=iam, cluster_token="test-cluster", local_edges=[LocalEdge(cedge, "http://local")]
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers=headers, timeout=120
        ) as c:
            yield c, iam
    iam.close()


async def test_checkpoints_count_against_the_snapshot_quota(cedge, criu, api):
    from dsec.iam import Quota

    http, iam = api
    r = await http.post("/v1/sandboxes", json={"image": "python", "project": "ckq", "memory_mb": 256})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    big = "import os, time; b = os.urandom(40 << 20); time.sleep(3600)"  # ~40 MiB of memory
    r = await http.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": f"nohup python3 -c '{big}' >/dev/null 2>&1 &"}
    )
    assert r.status_code == 200, r.text
    await asyncio.sleep(1.5)
    first = await http.post(f"/v1/sandboxes/{sid}/checkpoint", json={"leave_running": True})
    assert first.status_code == 201, first.text
    size_mb = first.json()["size_bytes"] >> 20
    assert size_mb >= 40
    assert iam.snapshot_reservations()[first.json()["id"]][1] >= size_mb
    # a second one: over max_snapshot_mb (60), refused and not kept
    second = await http.post(f"/v1/sandboxes/{sid}/checkpoint", json={"leave_running": True})
    assert second.status_code == 429 and second.json()["error"]["code"] == "quota_exceeded", second.text
    assert [c["id"] for c in (await http.get("/v1/checkpoints")).json()["checkpoints"]] == [
        first.json()["id"]
    ]
    assert len(cedge.list_checkpoints()) == 1  # nothing left on disk either
    # deleting gives the share back
    assert (await http.delete(f"/v1/checkpoints/{first.json()['id']}")).status_code == 204
    assert first.json()["id"] not in iam.snapshot_reservations()
    again = await http.post(f"/v1/sandboxes/{sid}/checkpoint", json={"leave_running": True})
    assert again.status_code == 201, again.text
    # a project at its count limit is refused before anything is dumped
    iam.set_quota("ckq", Quota(max_snapshots=1, max_snapshot_mb=60))
    before = len(os.listdir(cedge._checkpoints_dir()))
    r = await http.post(f"/v1/sandboxes/{sid}/checkpoint", json={"leave_running": True})
    assert r.status_code == 429 and "max_snapshots" in r.text
    assert len(os.listdir(cedge._checkpoints_dir())) == before


async def test_fork_layers_are_bounded_per_sandbox(cedge):
    from dsec.edge import snapshots

    edge = cedge
    sb = await edge.create(SandboxSpec(image="python"))
    await run(edge, sb.id, "mkdir -p /work && head -c 1000000 /dev/urandom > /work/blob")
    kids = []
    for _ in range(snapshots.MAX_FORK_LAYERS_PER_SANDBOX):
        kids += await edge.fork(sb.id, 1)
    with pytest.raises(errors.QuotaExceeded) as e:
        await edge.fork(sb.id, 1)
    assert e.value.details["limit"] == "fork_layers"
    layers = [d for d in (edge.settings.edge_run_dir / "forks").iterdir() if d.name.startswith(sb.id)]
    assert len(layers) == snapshots.MAX_FORK_LAYERS_PER_SANDBOX  # the refused one copied nothing
    await edge.stop(kids[0].id)  # its layer goes with its only child, and a fork fits again
    kids = kids[1:] + await edge.fork(sb.id, 1)
    # another sandbox is not affected by this one's forks
    other = await edge.create(SandboxSpec(image="python"))
    assert len(await edge.fork(other.id, 2)) == 2
