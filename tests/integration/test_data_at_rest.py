"""The platform's data at rest from a sandbox's mapped ids on the host.

Every sandbox runs as a host id range of its own, and the layer store is owned by the
canonical range (``uid_offset``, 100000) that no sandbox has; a process that got out of its
sandbox, or any other host user, must read none of the platform's data files (IAM
database, trajectory logs, edge records, their WAL/SHM sidecars, tokens), nor reach the
layer store, the checkpoints or the fork layers. Tested from real processes with those
ids on the host."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.iam import IAM
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

PROBE = r"""
import json, os, sys
out = {}
for path in json.loads(sys.argv[1]):
    try:
        if os.path.isdir(path):
            os.listdir(path)
            out[path] = "listed"
        else:
            with open(path, "rb") as f:
                f.read(1)
            out[path] = "read"
        try:
            open(path if not os.path.isdir(path) else os.path.join(path, ".x"), "ab").close()
            out[path] += "+written"
        except OSError:
            pass
    except OSError as e:
        out[path] = e.strerror
print(json.dumps(out))
"""


def probe(paths: list[Path], uid: int) -> dict[str, str]:
    """What a host process with uid/gid `uid` (no groups) can do with each path."""
    r = subprocess.run(
        [HOST_PYTHON, "-S", "-c", PROBE, json.dumps([str(p) for p in paths])],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


async def test_data_files_are_private_to_root(edge):
    s = edge.settings
    iam = IAM(s.data_dir / "iam.db")  # as the apiserver opens it next to the edge's files
    try:
        iam.bootstrap()
        sb = await edge.create(SandboxSpec(image="python"))
        r = await edge.exec(sb.id, ExecRequest(cmd="echo step"))  # a trajectory entry
        assert r.exit_code == 0
        await edge.fork(sb.id, 1)
        files = sorted(p for p in s.data_dir.iterdir() if p.is_file())
        names = {p.name for p in files}
        assert {"iam.db", f"edge-{s.name}.db"} <= names
        assert any(n.endswith("-wal") for n in names), names  # the WAL sidecars exist and are covered
        assert mode(s.data_dir) == 0o700
        for p in files:
            assert mode(p) & 0o077 == 0, f"{p} is {oct(mode(p))}"
        forks = s.edge_run_dir / "forks"
        assert mode(forks) == 0o700
        targets = [s.data_dir, *files, edge.layers.root, forks]
        targets += list(forks.iterdir())
        # a layer tree file, owned by the sandbox ids (shifted): by path, out of reach
        layer = edge.layers.layer_path(edge.layers.get_image("python").layers[-1])
        targets.append(next(p for p in layer.rglob("*") if p.is_file() and not p.is_symlink()))
        base = edge.sandboxes[sb.id].handle.id_base  # the sandbox's own root
        for uid in (base, base + 1000, s.uid_offset, s.uid_offset + 1000, 65534):
            seen = probe(targets, uid)
            reached = {p: what for p, what in seen.items() if what in ("listed", "read") or "+" in what}
            assert reached == {}, (uid, reached)
    finally:
        iam.close()


async def test_checkpoint_images_are_out_of_reach(edge):
    from dsec.backends import criu as ckpt

    try:
        ckpt.find_criu(edge.settings.criu_root)
    except Exception as e:
        pytest.skip(f"CRIU unavailable: {e}")
    sb = await edge.create(SandboxSpec(image="python"))
    r = await edge.exec(sb.id, ExecRequest(cmd="nohup sleep 600 > /dev/null 2>&1 &"))
    assert r.exit_code == 0
    c = await edge.checkpoint(sb.id, leave_running=True)
    d = edge._checkpoint_dir(c.id)
    assert mode(d.parent) == 0o700 and mode(d) == 0o700
    images = sorted((d / "tree-0").iterdir())
    for p in images:  # root's, not writable by the restoring root id
        st = os.lstat(p)
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) & 0o022 == 0, p
    seen = probe([d.parent, d, *images[:5]], edge.settings.uid_offset)
    assert all(what not in ("listed", "read") and "+" not in what for what in seen.values()), seen
    # and it still restores (CRIU reads the images through its detached mount)
    info = await edge.restore(c.id)
    r = await edge.exec(info.id, ExecRequest(cmd="pgrep -x sleep"))
    assert r.exit_code == 0, r


async def test_an_existing_install_is_fixed_at_start(edge_dirs, python_image, tmp_path):
    from dsec.config import EdgeSettings
    from dsec.edge import Edge

    data = edge_dirs["data_dir"]
    data.mkdir(parents=True, mode=0o755)
    os.chmod(data, 0o755)
    IAM(data / "iam.db").close()
    old = [data / "iam.db", data / "admin-token", data / "trajlog-old.db-wal"]
    for p in old[1:]:
        p.write_text("x")
    for p in old:
        os.chmod(p, 0o644)
    e = Edge(
        EdgeSettings(
            name="tfix" + os.urandom(3).hex(), reconcile_interval_s=3600, fncall_image="", **edge_dirs
        )
    )
    await e.start()
    try:
        assert mode(data) == 0o700
        for p in old:
            assert mode(p) == 0o600, p
        IAM(data / "iam.db").close()
        assert mode(data / "iam.db") == 0o600
    finally:
        await e.close()
