"""Each sandbox runs as a host id range of its own; the layer store is owned by a range
no sandbox has, reached through idmapped mounts.

Attacks are made from real host processes with the ids a sandbox's root has on the host
(what a process that got out of its sandbox would be, without capabilities): with one
shared range (every sandbox root host uid 100000, the code before this change), sandbox
A's root could signal sandbox B's processes, read their environment and reach their
files through /proc/<pid>/root, and owned every file of the layer store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec import errors
from dsec.backends import criu as ckpt
from dsec.isolation.idranges import RANGE, range_of
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
CRIU_DATA = Path(os.environ.get("DSEC_TEST_CRIU_DATA", "/var/lib/dsec"))

ATTACK = r"""
import json, os, signal, sys
pid, fd = int(sys.argv[1]), int(sys.argv[2])
out = {}
try:
    os.kill(pid, 0)
    out["signal"] = "sent"
except OSError as e:
    out["signal"] = e.strerror
for what, flags in (("read", os.O_RDONLY), ("write", os.O_WRONLY | os.O_APPEND)):
    try:  # reopening a handle checks the file's owner and mode
        g = os.open(f"/proc/self/fd/{fd}", flags)
        out[what] = "ok"
        os.close(g)
    except OSError as e:
        out[what] = e.strerror
print(json.dumps(out))
"""


def as_host_uid(uid: int, pid: int, path: Path) -> dict[str, str]:
    """What a host process with uid/gid `uid` (no groups, no capabilities) holding an O_PATH
    handle on `path` (as a leaked descriptor would give it) can do to `pid` and the file."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
    try:
        r = subprocess.run(
            [HOST_PYTHON, "-S", "-c", ATTACK, str(pid), str(fd)],
            user=uid,
            group=uid,
            extra_groups=[],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


async def sh(edge, sid: str, cmd: str, **kw) -> str:
    r = await edge.exec(sid, ExecRequest(cmd=cmd, **kw))
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def base_of(edge, sid: str) -> int:
    c = edge.sandboxes[sid].handle
    assert range_of(c.pid) == c.id_base
    return c.id_base


def sandbox_pids(edge, sid: str) -> list[int]:
    pids = []
    for d, _, _ in os.walk(edge.cgroups.tracking_dir(sid)):
        with open(os.path.join(d, "cgroup.procs")) as f:
            pids += [int(x) for x in f.read().split()]
    return pids


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def owners(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid


async def test_every_sandbox_has_its_own_range_and_sees_its_layers_as_its_own(edge):
    s = edge.settings
    a = await edge.create(SandboxSpec(image="python"))
    b = await edge.create(SandboxSpec(image="python"))
    try:
        ba, bb = base_of(edge, a.id), base_of(edge, b.id)
        assert ba != bb and abs(ba - bb) >= RANGE
        for base in (ba, bb):
            assert base % RANGE == 0 and base >= s.uid_offset + RANGE  # above the store's range
            assert (await sh(edge, a.id if base == ba else b.id, "cat /proc/self/uid_map")).split() == [
                "0",
                str(base),
                str(RANGE),
            ]
        # The image's files keep their owners inside (root's, and a user's home)...
        assert (await sh(edge, a.id, "stat -c '%u:%g' / /usr/bin /etc/passwd")).split() == ["0:0"] * 3
        # ...though no file of the layer store belongs to either sandbox's range on the host.
        layer = edge.layers.layer_path(edge.layers.get_image("python").layers[-1])
        seen = {owners(p) for p in list(layer.rglob("*"))[:2000]}
        assert all(not (base <= u < base + RANGE) for u, _ in seen for base in (ba, bb)), seen
        assert any(s.uid_offset <= u < s.uid_offset + RANGE for u, _ in seen)
        # The layers are read-only mounts even to the sandbox's root, under the overlay.
        r = await edge.exec(a.id, ExecRequest(cmd="touch /usr/bin/x && stat -c %u /usr/bin/x"))
        assert r.exit_code == 0 and r.stdout.strip() == "0"  # a copy-up into its own upper
        assert not (layer / "usr" / "bin" / "x").exists()
    finally:
        await edge.stop(a.id)
        await edge.stop(b.id)


async def test_root_of_one_sandbox_cannot_reach_another_sandboxs_processes_or_files(edge):
    a = await edge.create(SandboxSpec(image="python"))
    b = await edge.create(SandboxSpec(image="python"))
    forks = []
    try:
        await sh(edge, b.id, "echo b-secret > /work/secret && chmod 600 /work/secret")
        await sh(edge, b.id, "mkdir -p /work/u && echo mine > /work/u/f && chown -R 1000:1000 /work/u")
        await sh(edge, b.id, "nohup sleep 1000 >/dev/null 2>&1 &")
        await sh(edge, b.id, "nohup su -s /bin/sh nobody -c 'sleep 1001' >/dev/null 2>&1 &")
        forks = await edge.fork(b.id, 1)  # a layer of B's files, in the store's range
        layer = Path(edge.sandboxes[forks[0].id].record.extra_lower.split(":")[0])
        upper = edge.sandboxes[b.id].handle.upper
        sleeps: list[int] = []
        for _ in range(100):  # su starts its sleep in the background
            sleeps = [p for p in sandbox_pids(edge, b.id) if comm(p) == "sleep"]
            if len(sleeps) == 2:
                break
            await asyncio.sleep(0.05)
        root_pid = next(p for p in sleeps if os.stat(f"/proc/{p}").st_uid == base_of(edge, b.id))
        user_pid = next(p for p in sleeps if p != root_pid)
        ba, bb = base_of(edge, a.id), base_of(edge, b.id)
        # Control: B's own ids reach B's process and file (the probe itself works).
        own = as_host_uid(bb, root_pid, upper / "work" / "secret")
        assert own == {"signal": "sent", "read": "ok", "write": "ok"}, own
        # A's root and A's users: no signal to B's processes, no access to B's files, even
        # holding a handle on them; nor write access to the store's copy of B's files.
        for uid, pid, path in (
            (ba, root_pid, upper / "work" / "secret"),
            (ba + 65534, user_pid, upper / "work" / "secret"),
            (ba + 1000, root_pid, upper / "work" / "u" / "f"),
            (ba + 1000, user_pid, layer / "work" / "u" / "f"),
            (ba, root_pid, layer / "work" / "u"),
        ):
            seen = as_host_uid(uid, pid, path)
            assert seen["signal"] == "Operation not permitted", (uid, path, seen)
            assert seen["write"] in ("Permission denied", "Is a directory"), (uid, path, seen)
            if path.name != "u":  # mode 0644 files are readable by anyone holding them
                assert path.stat().st_mode & 0o004 or seen["read"] == "Permission denied", (uid, path, seen)
    finally:
        for sb in [*forks, a, b]:
            await edge.stop(sb.id)


async def test_ranges_are_given_back_and_not_shared_while_in_use(edge):
    made = [await edge.create(SandboxSpec(image="python")) for _ in range(3)]
    bases = {base_of(edge, sb.id) for sb in made}
    assert len(bases) == 3
    gone = made[0]
    gone_base = base_of(edge, gone.id)
    await edge.stop(gone.id)
    registry = edge.settings.id_registry
    assert (registry / str(gone_base // RANGE)).read_text() == ""  # released
    for sb in made[1:]:
        pid = edge.sandboxes[sb.id].handle.pid
        assert (registry / str(base_of(edge, sb.id) // RANGE)).read_text().split()[0] == str(pid)
    new = await edge.create(SandboxSpec(image="python"))
    try:
        assert base_of(edge, new.id) not in {base_of(edge, sb.id) for sb in made[1:]}
    finally:
        for sb in [*made[1:], new]:
            await edge.stop(sb.id)


FILES = (
    "mkdir -p /work/u && echo data > /work/u/f && chown -R 1000:1000 /work/u "
    "&& chown 0:1000 /work && chmod 4755 /work/u/f"
)


async def test_forks_and_snapshots_keep_owners_across_ranges(edge):
    s = edge.settings
    src = await edge.create(SandboxSpec(image="python"))
    snap = None
    children = []
    try:
        await sh(edge, src.id, FILES)
        children = await edge.fork(src.id, 2)
        for c in children:
            assert base_of(edge, c.id) != base_of(edge, src.id)
            assert (await sh(edge, c.id, "stat -c %u:%g /work/u /work/u/f /work")).split() == [
                "1000:1000",
                "1000:1000",
                "0:1000",
            ]
            # the user owns its files in the child too (it can write them)
            await sh(edge, c.id, "echo more >> /work/u/f", user="1000")
        # The fork layer on the host is in the store's canonical range.
        layer = Path(edge.sandboxes[children[0].id].record.extra_lower.split(":")[0])
        assert owners(layer / "work" / "u" / "f") == (s.uid_offset + 1000, s.uid_offset + 1000)
        assert owners(layer / "work") == (s.uid_offset, s.uid_offset + 1000)
        snap = await edge.snapshot(src.id, [])
        stored = next(
            p
            for r in edge.layers.get_image(snap.id).layers
            if (p := edge.layers.layer_path(r) / "work" / "u" / "f").exists()
        )
        assert owners(stored) == (s.uid_offset + 1000, s.uid_offset + 1000)
        assert not os.lstat(stored).st_mode & 0o6000  # set-id bits never reach the store
        restored = await edge.create(SandboxSpec(image=snap.id))
        children.append(restored)
        assert (await sh(edge, restored.id, "stat -c %u:%g /work/u/f; cat /work/u/f")).split() == [
            "1000:1000",
            "data",
        ]
    finally:
        for c in children:
            await edge.stop(c.id)
        await edge.stop(src.id)
        if snap is not None:
            await edge.delete_snapshot(snap.id)


async def test_trusted_execs_see_the_owners_the_sandbox_sees(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    try:
        await sh(edge, sb.id, FILES)
        r = await edge.exec(
            sb.id, ExecRequest(cmd="stat -c %u:%g /usr/bin /etc/passwd /work/u/f", trusted=True)
        )
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split() == ["0:0", "0:0", "1000:1000"]
        assert (await sh(edge, sb.id, "id -u", trusted=True)).strip() == "65533"
    finally:
        await edge.stop(sb.id)


@pytest.fixture(scope="session")
def criu() -> Path:
    try:
        return ckpt.ensure_criu(CRIU_DATA)
    except errors.UnsupportedOperation as e:
        pytest.skip(f"CRIU unavailable: {e}")


async def test_checkpoints_restore_into_another_range(edge, criu):
    s = edge.settings
    src = await edge.create(SandboxSpec(image="python"))
    new_id = None
    info = None
    try:
        await sh(edge, src.id, FILES)
        await sh(edge, src.id, "nohup su -s /bin/sh nobody -c 'sleep 1000' >/dev/null 2>&1 &")
        info = await edge.checkpoint(src.id, leave_running=True)
        fs = edge._checkpoint_dir(info.id) / "fs"
        assert owners(fs / "work" / "u" / "f") == (s.uid_offset + 1000, s.uid_offset + 1000)
        restored = await edge.restore(info.id)
        new_id = restored.id
        assert base_of(edge, new_id) != base_of(edge, src.id)
        out = await sh(edge, new_id, "stat -c %u:%g /work/u/f; ps -o user= -C sleep")
        assert out.split() == ["1000:1000", "nobody"]
    finally:
        if new_id is not None:
            await edge.stop(new_id)
        await edge.stop(src.id)
        if info is not None:
            edge.delete_checkpoint(info.id)
