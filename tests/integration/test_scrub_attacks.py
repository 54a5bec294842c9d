"""Attacks on snapshot scrubbing: the sandbox plants another name for a file it knows will
be scrubbed (a hard link, a symlinked directory, a symlinked parent) before the snapshot.
Each snapshot is restored into a new sandbox, where the secret must be unreadable by
every name, and the layer itself must not hold it."""

from __future__ import annotations

import secrets

import pytest

from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def sh(edge, sid, cmd):
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=60))
    assert r.exit_code == 0, r.stderr
    return r.stdout


def layer_holds(edge, layer: str, secret: str) -> list[str]:
    tree = edge.layers.layer_path(layer)
    return [
        str(p)
        for p in tree.rglob("*")
        if p.is_file() and not p.is_symlink() and secret.encode() in p.read_bytes()
    ]


@pytest.mark.parametrize(
    ("plant", "scrub", "names"),
    [
        # a hard link elsewhere (and one in a directory that is itself scrubbed)
        (
            "mkdir -p /work/answers /var/tmp/x && echo {s} > /work/answers/key && "
            "ln /work/answers/key /var/tmp/x/copy && ln /work/answers/key /root/.k",
            ["/work/answers"],
            ["/work/answers/key", "/var/tmp/x/copy", "/root/.k"],
        ),
        # a hard link of a single scrubbed file
        (
            "mkdir -p /work && echo {s} > /work/key && ln /work/key /work/.key2",
            ["/work/key"],
            ["/work/key", "/work/.key2"],
        ),
        # the scrubbed path is a symlink to the real directory
        (
            "mkdir -p /srv/real /work && echo {s} > /srv/real/key && ln -s /srv/real /work/answers",
            ["/work/answers"],
            ["/work/answers/key", "/srv/real/key"],
        ),
        # a symlinked parent: /work -> /opt/w, relative
        (
            "mkdir -p /opt/w/answers && echo {s} > /opt/w/answers/key && rm -rf /work && ln -s opt/w /work",
            ["/work/answers/key"],
            ["/work/answers/key", "/opt/w/answers/key"],
        ),
        # a chain: symlinked parent pointing at a symlinked directory, with `..`
        (
            "mkdir -p /opt/a/b && echo {s} > /opt/a/b/key && ln -s /opt/a /opt/link && "
            "mkdir -p /work && ln -s ../opt/link/b /work/answers",
            ["/work/answers/key"],
            ["/work/answers/key", "/opt/a/b/key", "/opt/link/b/key"],
        ),
    ],
)
async def test_scrubbed_file_is_gone_by_every_name(edge, plant, scrub, names):
    secret = secrets.token_hex(12)
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(edge, sb.id, plant.format(s=secret))
    for n in names:  # every name reads the secret before
        assert secret in await sh(edge, sb.id, f"cat {n}")
    snap = await edge.snapshot(sb.id, scrub)
    new = None
    try:
        assert layer_holds(edge, snap.layer, secret) == []
        new = await edge.create(SandboxSpec(image=snap.id))
        found = await edge.exec(
            new.id, ExecRequest(cmd=f"grep -rls {secret} / --exclude-dir=proc --exclude-dir=sys")
        )
        assert found.stdout == "", found.stdout
        for n in names:
            r = await edge.exec(new.id, ExecRequest(cmd=f"cat {n}"))
            assert secret not in r.stdout, n
        # what was not scrubbed is still there: the links themselves, the image's files
        r = await edge.exec(new.id, ExecRequest(cmd="test -d /etc && python3 -c 'print(1)'"))
        assert r.stdout == "1\n"
    finally:
        if new is not None:
            await edge.stop(new.id)
        await edge.delete_snapshot(snap.id)


async def test_scrub_through_a_symlinked_parent_keeps_the_rest_of_the_directory(edge):
    """Resolving the parent scrubs only the file: the symlink and its other files stay."""
    secret = secrets.token_hex(12)
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(
        edge,
        sb.id,
        f"mkdir -p /opt/w && echo {secret} > /opt/w/key && echo keep > /opt/w/other && "
        "rm -rf /work && ln -s /opt/w /work",
    )
    snap = await edge.snapshot(sb.id, ["/work/key"])
    new = await edge.create(SandboxSpec(image=snap.id))
    try:
        assert await sh(edge, new.id, "readlink /work; cat /work/other") == "/opt/w\nkeep\n"
        r = await edge.exec(new.id, ExecRequest(cmd="cat /work/key /opt/w/key"))
        assert r.exit_code != 0 and secret not in r.stdout
    finally:
        await edge.stop(new.id)
        await edge.delete_snapshot(snap.id)


async def test_setuid_bits_do_not_reach_the_layer_store(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    await sh(
        edge,
        sb.id,
        "cp /bin/true /work-su 2>/dev/null || cp /usr/bin/true /work-su; "
        "chmod 6755 /work-su && mkdir -p /sg && chmod 2775 /sg",
    )
    snap = await edge.snapshot(sb.id, [])
    try:
        tree = edge.layers.layer_path(snap.layer)
        mode = (tree / "work-su").stat().st_mode
        assert mode & 0o6000 == 0 and mode & 0o777 == 0o755
        assert (edge.layers.root.stat().st_mode & 0o777) == 0o700  # and the store is root's only
    finally:
        await edge.delete_snapshot(snap.id)
