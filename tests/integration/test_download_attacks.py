"""What a sandbox hands back is hostile: archives (built by the host from its files, or
made by a microVM guest's own `tar`, which its root may replace) and a guest's listings.
The edge forwards none of it unchecked: an archive that could write, or leave a link
pointing, outside where it is extracted is refused before its first byte, and the SDK's
extractor writes a clean one beneath the trainer's destination only."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from dsec import errors
from dsec.client._base import untar_local
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def _ok(edge, sid: str, cmd: str, timeout: int = 60) -> str:
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=timeout))
    assert r.exit_code == 0, (r.exit_code, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def _names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return tf.getnames()


async def test_a_containers_archive_carries_no_link_out_and_no_fifo(edge, tmp_path: Path):
    """The host builds the archive from the sandbox's files; a link out of the archived
    directory (absolute or by `..`) is a 403 naming it, a FIFO is left out, links that stay
    inside come last, and the SDK extracts the result beneath its destination."""
    sb = await edge.create(SandboxSpec(image="python"))
    await _ok(edge, sb.id, "mkdir -p /work/a/sub && echo ok > /work/a/ok && mkfifo /work/a/fifo")
    await _ok(edge, sb.id, "ln -s ../ok /work/a/sub/in && ln -s /etc/passwd /work/a/abs")
    with pytest.raises(errors.PathEscape, match="abs"):
        await edge.download_tar(sb.id, "/work/a")
    await _ok(edge, sb.id, "rm /work/a/abs && ln -s ../../etc/passwd /work/a/sub/up")
    with pytest.raises(errors.PathEscape, match="up"):
        await edge.download_tar(sb.id, "/work/a")
    with pytest.raises(errors.PathEscape):  # one link alone points out of its own archive
        await edge.download_tar(sb.id, "/work/a/sub/in")
    await _ok(edge, sb.id, "rm /work/a/sub/up")
    data = await edge.download_tar(sb.id, "/work/a")
    assert _names(data) == [".", "./ok", "./sub", "./sub/in"]
    untar_local(data, tmp_path / "dest")
    assert (tmp_path / "dest" / "sub" / "in").read_bytes() == b"ok\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


# The guest's tar, replaced by its root: each mode writes one crafted archive on stdout.
FAKE_TAR = r"""#!/usr/bin/python3
import io, sys, tarfile
mode = open("/tmp/tar-mode").read().strip()
out = sys.stdout.buffer
if mode == "huge":  # a header claiming 10 GiB, and no data
    ti = tarfile.TarInfo("./big")
    ti.size = 10 << 30
    out.write(ti.tobuf(format=tarfile.GNU_FORMAT) + bytes(1024))
    sys.exit(0)
def put(tf, name, kind=tarfile.REGTYPE, link="", data=b"pwned\n"):
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = kind, link
    if kind == tarfile.REGTYPE:
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    else:
        tf.addfile(ti)
with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tf:
    put(tf, "./", tarfile.DIRTYPE)
    if mode == "absolute":
        put(tf, "/root/.bashrc")
    elif mode == "dotdot":
        put(tf, "./../../pwned")
    elif mode == "through-link":
        put(tf, "./l", tarfile.SYMTYPE, ".")
        put(tf, "./l/x")
    elif mode == "link-out":
        put(tf, "./etc", tarfile.SYMTYPE, "../../../etc")
    elif mode == "chain":  # inside by its letters, outside once followed
        put(tf, "./l", tarfile.SYMTYPE, "d/..")
        put(tf, "./d", tarfile.SYMTYPE, ".")
    elif mode == "hardlink-out":
        put(tf, "./h", tarfile.LNKTYPE, "../../../etc/passwd")
    elif mode == "device":
        put(tf, "./null", tarfile.CHRTYPE)
        put(tf, "./ok", data=b"ok\n")
"""
REFUSED = ["absolute", "dotdot", "through-link", "link-out", "chain", "hardlink-out", "huge"]


async def test_a_microvm_guests_own_tar_and_find_cannot_reach_the_trainer(edge, tmp_path: Path):
    """The guest's root replaces /usr/bin/tar (the file API runs the image's tar inside):
    every crafted archive is refused by the edge's rebuild (or cleaned: a device node left
    out), never forwarded; the real tar's archive is rebuilt and extracts beneath the
    destination. A replaced find that lists names with '/' or '..' is a 4xx."""
    sb = await edge.create(SandboxSpec(image="python", backend="microvm", memory_mb=256))
    await _ok(edge, sb.id, "mkdir -p /work/x && echo real > /work/x/f")
    await _ok(edge, sb.id, "cp -p /usr/bin/tar /usr/bin/tar.orig")
    await edge.write_file(sb.id, "/usr/bin/tar", FAKE_TAR.encode(), 0o755)
    for mode in REFUSED:
        await edge.write_file(sb.id, "/tmp/tar-mode", mode.encode())
        with pytest.raises(errors.DsecError) as ei:
            await edge.download_tar(sb.id, "/work/x")
        assert not isinstance(ei.value, errors.InternalError), (mode, ei.value)
        assert isinstance(ei.value, errors.PathEscape | errors.PayloadTooLarge | errors.InvalidRequest), mode
    await edge.write_file(sb.id, "/tmp/tar-mode", b"device")
    assert _names(await edge.download_tar(sb.id, "/work/x")) == [".", "./ok"]
    await _ok(edge, sb.id, "mv /usr/bin/tar.orig /usr/bin/tar && ln -s f /work/x/in && mkfifo /work/x/p")
    data = await edge.download_tar(sb.id, "/work/x")
    assert _names(data) == [".", "./f", "./in"]
    untar_local(data, tmp_path / "dest")
    assert (tmp_path / "dest" / "in").read_bytes() == b"real\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]
    await _ok(edge, sb.id, "cp -p /usr/bin/find /usr/bin/find.orig")
    for name in ("../../etc/passwd", "a/b", ".."):
        lie = f"#!/bin/sh\nprintf 'f\\t1\\t644\\t1\\t0\\t0\\t{name}\\0'\n"
        await edge.write_file(sb.id, "/usr/bin/find", lie.encode(), 0o755)
        with pytest.raises(errors.InvalidRequest, match="name"):
            await edge.list_dir(sb.id, "/work")
    twice = "#!/bin/sh\nprintf 'f\\t1\\t644\\t1\\t0\\t0\\ta\\0f\\t1\\t644\\t1\\t0\\t0\\ta\\0'\n"
    await edge.write_file(sb.id, "/usr/bin/find", twice.encode(), 0o755)
    with pytest.raises(errors.InvalidRequest, match="twice"):
        await edge.list_dir(sb.id, "/work")
    await _ok(edge, sb.id, "mv /usr/bin/find.orig /usr/bin/find")
    assert {st.name for st in await edge.list_dir(sb.id, "/work/x")} == {"f", "in", "p"}
