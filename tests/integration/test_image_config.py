"""Images keep their config (issue #26 item 1), on every backend.

A real image built with buildah (a Dockerfile FROM scratch: ENV PATH=/opt/mybin:..., ENV
JAVA_HOME, WORKDIR /app, USER app, EXPOSE, LABEL, ENTRYPOINT/CMD), saved as an OCI archive and
imported with `import_oci_archive`; its layer is stacked on the `python` image's (a userland
for the execs, sessions and the microVM's file tools: buildah here has no base image to pull)
with the imported config. Before, such a sandbox had the default PATH, no JAVA_HOME, cwd
/work and uid 0.

Then hostile images: a USER the image lacks, an /etc/passwd linked to the host's, one of
16 MiB, a WORKDIR through a link out of the root: each a clear 400 at create (nothing left
behind) or confined to the sandbox."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import errors
from dsec.layers import Image, LayerStore, import_dir_layer, import_oci_archive
from dsec.models import ExecRequest, ImageConfig, SandboxSpec, SessionCreate, SessionRun
from tests.conftest import LAYERS

pytestmark = [pytest.mark.root]

PATH = "/opt/mybin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOCKERFILE = f"""FROM scratch
COPY root/ /
COPY --chown=1234:2345 app/ /app/
COPY --chown=1234:2345 home/ /home/app/
ENV PATH={PATH}
ENV JAVA_HOME=/opt/jdk LAYERED=image
WORKDIR /app
USER app
EXPOSE 8080/tcp
LABEL org.example.task=swe-1
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["echo hi"]
"""


def _context(d: Path) -> None:
    python_etc = LAYERS / "layers" / "python"
    (tree,) = python_etc.glob("*/tree")  # the python image's users, plus the image's own
    (d / "root/etc").mkdir(parents=True)
    passwd = (tree / "etc/passwd").read_bytes() + b"app:x:1234:2345:App:/home/app:/bin/sh\n"
    (d / "root/etc/passwd").write_bytes(passwd)
    (d / "root/etc/group").write_bytes((tree / "etc/group").read_bytes() + b"appgrp:x:2345:\n")
    (d / "root/opt/mybin").mkdir(parents=True)
    (d / "root/opt/mybin/hello").write_text("#!/bin/sh\necho hello-from-mybin\n")
    (d / "root/opt/mybin/hello").chmod(0o755)
    (d / "root/opt/jdk/bin").mkdir(parents=True)
    (d / "app").mkdir()
    (d / "app/README").write_text("the task\n")
    (d / "home").mkdir()
    (d / "home/.profile").write_text("\n")
    (d / "Dockerfile").write_text(DOCKERFILE)


def _buildah(tmp: Path, *args: str) -> None:
    storage = ["--root", str(tmp / "storage"), "--runroot", str(tmp / "run"), "--storage-driver", "vfs"]
    subprocess.run(["buildah", *storage, *args], check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def config_image(python_image: str) -> Iterator[str]:
    """The image (its name in the test layer store); its image entries and new layer removed after."""
    if shutil.which("buildah") is None:
        pytest.fail("buildah is not installed (install.sh installs it)")
    store = LayerStore(LAYERS)
    name = f"cfgtest-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix="dsec-test-cfg-"))
    made: list[str] = []
    try:
        _context(tmp / "ctx")
        _buildah(tmp, "bud", "--isolation", "chroot", "-q", "-t", f"localhost/{name}:1", str(tmp / "ctx"))
        _buildah(tmp, "push", "-q", f"localhost/{name}:1", f"oci-archive:{tmp / 'image.tar'}")
        imported = import_oci_archive(store, f"{name}-oci", tmp / "image.tar")
        made.append(imported.name)
        base = store.get_image(python_image)
        store.put_image(
            Image(name=name, layers=[*base.layers, *imported.layers], config=imported.config, source={})
        )
        made.append(name)
        yield name
    finally:
        _remove_images(store, made)
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_images(store: LayerStore, names: list[str]) -> None:
    for n in names:
        if store.has_image(n):
            layers = store.get_image(n).layers
            store.delete_image(n)
            for ref in layers:
                if ref.name.startswith(("oci-", "cfgbad-")):
                    with contextlib.suppress(errors.DsecError):  # another image's too: kept
                        store.delete_layer(ref)


async def _out(edge, sid: str, cmd: str, **kw) -> str:
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=120, **kw))
    assert r.exit_code == 0, r
    return r.stdout


def test_the_import_keeps_the_whole_config(config_image: str) -> None:
    c = LayerStore(LAYERS).get_image(config_image).config
    assert (c.workdir, c.user, c.env["PATH"], c.env["JAVA_HOME"]) == ("/app", "app", PATH, "/opt/jdk")
    assert (c.entrypoint, c.cmd, c.exposed_ports) == (["/bin/sh", "-c"], ["echo hi"], ["8080/tcp"])
    assert c.labels["org.example.task"] == "swe-1"


async def test_sandboxes_execs_sessions_and_files_honour_the_image_config(edge, backend, config_image):
    sb = await edge.create(SandboxSpec(image=config_image, backend=backend, env={"LAYERED": "spec"}))
    try:
        assert (sb.spec.user, sb.spec.workdir) == ("app", "/app")  # what it runs with, shown
        cmd = 'echo "$PATH|$JAVA_HOME|$LAYERED|$HOME"; pwd; id -u; id -g; hello'
        assert await _out(edge, sb.id, cmd) == (
            f"{PATH}|/opt/jdk|spec|/home/app\n/app\n1234\n2345\nhello-from-mybin\n"
        )
        # image env < sandbox env < call env
        out = await _out(edge, sb.id, "echo $LAYERED $JAVA_HOME", env={"LAYERED": "call"})
        assert out == "call /opt/jdk\n"
        assert await _out(edge, sb.id, "id -u; pwd", user="root", cwd="/") == "0\n/\n"
        assert await _out(edge, sb.id, "id -u; id -g", user="nobody") == "65534\n65534\n"
        assert await _out(edge, sb.id, "id -u; id -g", user="app:appgrp") == "1234\n2345\n"
        # sessions: the same user, cwd and env
        s = (await edge.session_create(sb.id, SessionCreate(kind="bash"))).id
        r = await edge.session_run(sb.id, s, SessionRun(code='echo "$PWD $(id -u) $JAVA_HOME"; hello'))
        assert (r.output, r.exit_code) == ("/app 1234 /opt/jdk\nhello-from-mybin\n", 0), r
        p = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
        code = "import os; print(os.getcwd(), os.getuid(), os.getgid(), os.environ['JAVA_HOME'])"
        r = await edge.session_run(sb.id, p, SessionRun(code=code))
        assert (r.output, r.exit_code) == ("/app 1234 2345 /opt/jdk\n", 0), r
        # the file API writes as the sandbox's user (the image's): its processes can edit them
        await edge.write_file(sb.id, "/app/out.txt", b"x")
        assert await _out(edge, sb.id, "stat -c %u:%g /app/out.txt; echo y >> /app/out.txt") == "1234:2345\n"
        # a spec that names them wins over the image
        spec = SandboxSpec(image=config_image, backend=backend, user="root", workdir="/work")
        other = await edge.create(spec)
        try:
            assert await _out(edge, other.id, "id -u; pwd; echo $JAVA_HOME") == "0\n/work\n/opt/jdk\n"
        finally:
            await edge.stop(other.id)
    finally:
        await edge.stop(sb.id)


async def test_snapshots_and_forks_keep_the_image_config(edge, backend, config_image):
    sb = await edge.create(SandboxSpec(image=config_image, backend=backend))
    snap = None
    try:
        await _out(edge, sb.id, "echo mine > /app/state")
        snap = await edge.snapshot(sb.id)
        check = "id -u; pwd; cat state; echo $JAVA_HOME; hello"
        want = "1234\n/app\nmine\n/opt/jdk\nhello-from-mybin\n"
        restored = await edge.create(SandboxSpec(image=snap.id, backend=backend))
        try:
            assert (restored.spec.user, restored.spec.workdir) == ("app", "/app")
            assert await _out(edge, restored.id, check) == want
        finally:
            await edge.stop(restored.id)
        (kid,) = await edge.fork(sb.id, 1)
        try:
            assert await _out(edge, kid.id, check) == want
        finally:
            await edge.stop(kid.id)
    finally:
        await edge.stop(sb.id)
        if snap is not None:
            await edge.delete_snapshot(snap.id)


# --------------------------------------------------------------------------- hostile images


@pytest.fixture
def hostile(python_image: str) -> Iterator[object]:
    """`make(files, config)`: an image of the python layers plus a layer of `files` (bytes: a
    file, str: a symlink, int: a sparse file of that size) with `config`; removed after."""
    store = LayerStore(LAYERS)
    made: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="dsec-test-cfgbad-"))

    def make(files: dict[str, bytes | str | int], config: ImageConfig) -> str:
        name = f"cfgbad-{secrets.token_hex(4)}"
        src = tmp / name
        for rel, what in files.items():
            p = src / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(what, bytes):
                p.write_bytes(what)
            elif isinstance(what, str):
                p.symlink_to(what)
            else:
                with open(p, "wb") as f:
                    f.truncate(what)
        layer = import_dir_layer(store, name, "1", src)
        base = store.get_image(python_image)
        store.put_image(Image(name=name, layers=[*base.layers, layer.ref], config=config))
        made.append(name)
        return name

    try:
        yield make
    finally:
        _remove_images(store, made)
        shutil.rmtree(tmp, ignore_errors=True)


def _left(edge) -> list[str]:
    return sorted({c for c in edge.cgroups.listed_sandboxes() if c.startswith(f"{edge.name}-")})


@pytest.mark.parametrize(
    ("files", "user", "match"),
    [
        ({}, "ghost", "user 'ghost' is not in the image's /etc/passwd"),
        ({}, "app:ghosts", "group 'ghosts' is not in the image's /etc/group"),
        # a name only the host has, behind a link to the host's file: never read from the host
        ({"etc/passwd": "/proc/1/root/etc/passwd"}, "postgres", "passwd"),
        ({"etc/passwd": "../../../../../../../etc/passwd"}, "postgres", "passwd"),
        ({"etc/passwd": 16 << 20}, "app", "passwd"),
    ],
)
async def test_a_user_the_image_cannot_give_is_a_400_at_create(edge, backend, hostile, files, user, match):
    files = {"etc/group": b"root:x:0:\n", **files}
    files.setdefault("etc/passwd", b"root:x:0:0::/root:/bin/sh\napp:x:1234:2345::/:/bin/sh\n")
    name = hostile(files, ImageConfig(user=user))
    with pytest.raises(errors.InvalidRequest, match=match) as e:
        await edge.create(SandboxSpec(image=name, backend=backend))
    assert e.value.status == 400
    assert edge.list() == [] and _left(edge) == [] and edge.life.in_progress() == set()
    # the spec can still say who runs: the image is usable
    sb = await edge.create(SandboxSpec(image=name, backend=backend, user="4321"))
    try:
        assert await _out(edge, sb.id, "id -u; id -g") == "4321\n4321\n"
    finally:
        await edge.stop(sb.id)


async def test_a_workdir_through_a_link_stays_inside_the_sandbox(edge, hostile):
    outside = Path("/srv") / f"dsec-test-escape-{secrets.token_hex(4)}"
    link = {"escape": "../../../../../../../srv"}  # as seen from the host's /var/lib/dsec/...: its /srv
    name = hostile(link, ImageConfig(workdir=f"/escape/{outside.name}/sub"))
    assert ImageConfig(workdir="../../etc").workdir == "/etc"  # (an import normalises it)
    sb = await edge.create(SandboxSpec(image=name))
    try:
        assert await _out(edge, sb.id, "pwd -P; id -u") == f"{outside}/sub\n0\n"  # the sandbox's own /srv
        assert not outside.exists()
    finally:
        await edge.stop(sb.id)
