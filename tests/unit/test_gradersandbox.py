"""The pure parts of a trusted exec in a fresh sandbox (dsec.edge.gradersandbox) and of the
transports it and the sessions use where the channel carries bytes (a microVM's): what the
protected paths become, which parents are made directories, the archive's link rules, and a
regular file given as stdin."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
import struct
import tarfile
from pathlib import Path

import pytest

from dsec import errors
from dsec.backends.guestchannel import GuestChannel
from dsec.backends.shim import Launch
from dsec.edge.gradersandbox import _fix_args, _protected_archive, _shown_mode
from dsec.edge.sessions.session import _parse_reply
from dsec.edge.tarcheck import CleanTar
from dsec.edge.trusted import Protected


def test_a_protected_file_is_read_as_its_owner_could_and_written_by_nobody() -> None:
    assert _shown_mode(0o600) == 0o644
    assert _shown_mode(0o700) == 0o755
    assert _shown_mode(0o640) == 0o644
    assert _shown_mode(0o200) == 0o200  # (root's own write bit: the command is never root)
    assert _shown_mode(0o777) == 0o755


def test_only_parents_inside_a_task_directory_are_fixed() -> None:
    protected = [
        Protected("/work/tests/unit/data", "d", None),
        Protected("/work/a", "f", None),
        Protected("/usr/local/bin/grade", "l", None, "/opt/x"),  # the image's parents: left alone
        Protected("/data/deep/x", "f", None),
    ]
    assert _fix_args(protected, ["/data", "/work"]) == [
        "/data/deep",
        "/work/tests",  # (each one's own parents before it)
        "/work/tests/unit",
        "--",
        "/work/tests/unit/data",
        "/work/a",
        "/usr/local/bin/grade",
        "/data/deep/x",
    ]


def test_the_protected_archive_is_roots_and_an_inner_path_comes_from_its_own_copy(tmp_path: Path) -> None:
    outer, inner = tmp_path / "t0", tmp_path / "t1"
    (outer / "ref").mkdir(parents=True)  # the inner path's mount point in the outer copy
    (outer / "ref" / "stale").write_text("mount point only")
    (outer / "run.sh").write_text("echo run\n")
    os.chmod(outer / "run.sh", 0o700)
    os.symlink("/etc/passwd", outer / "link")  # a link is text: never followed here
    inner.mkdir()
    (inner / "answer").write_text("42\n")
    os.chmod(inner / "answer", 0o600)
    protected = [
        Protected("/opt/task/ref", "d", inner),
        Protected("/opt/task", "d", outer),
        Protected("/usr/local/bin/grade", "l", None, "/opt/task/run.sh"),
    ]
    with contextlib.ExitStack() as spools:
        spool = _protected_archive(protected, spools)
        assert spool is not None
        with tarfile.open(fileobj=spool) as tf:
            members = {m.name: m for m in tf}
    assert set(members) == {
        "opt/task", "opt/task/ref", "opt/task/ref/answer", "opt/task/run.sh", "opt/task/link",
        "usr/local/bin/grade",
    }  # fmt: skip
    assert all((m.uid, m.gid) == (0, 0) for m in members.values())
    assert members["opt/task/run.sh"].mode == 0o755 and members["opt/task/ref/answer"].mode == 0o644
    assert members["opt/task/link"].linkname == "/etc/passwd"
    assert members["usr/local/bin/grade"].linkname == "/opt/task/run.sh"


def _tar(*members: tuple[str, bytes, str]) -> list[tarfile.TarInfo]:
    out = []
    for name, kind, target in members:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = target
        out.append(info)
    return out


def test_links_are_data_in_a_task_copy_but_nothing_goes_through_one() -> None:
    venv = _tar(
        ("work/.venv/bin", tarfile.DIRTYPE, ""),
        ("work/.venv/bin/python", tarfile.SYMTYPE, "/usr/bin/python3"),
    )
    # a download: links stay inside the archive
    with pytest.raises(errors.PathEscape), CleanTar(io.BytesIO(), "a download", 1 << 20, 100) as tf:
        for m in venv:
            tf.addfile(m)
    with CleanTar(io.BytesIO(), "a task copy", 1 << 20, 100, any_link_target=True) as tf:
        for m in venv:
            tf.addfile(m)
    through = _tar(
        ("w/l", tarfile.SYMTYPE, "/usr/lib/python3"), ("w/l/sitecustomize.py", tarfile.REGTYPE, "")
    )
    copy = CleanTar(io.BytesIO(), "a task copy", 1 << 20, 100, any_link_target=True)
    with pytest.raises(errors.PathEscape), copy as tf:
        for m in through:
            tf.addfile(m, io.BytesIO(b""))


def test_a_stream_reply_carries_the_stray_output_and_its_cut() -> None:
    def field(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b

    body = bytes([1]) + field(b"out") + field(b"err") + field(b"Traceback") + field(b"stray") + b"\x01"
    assert _parse_reply(body, True) == (True, True, "out", "err", "Traceback", "stray")
    with pytest.raises(ValueError):
        _parse_reply(body[:-1], True)  # no truncation byte
    with pytest.raises(ValueError):
        _parse_reply(body, False)  # a socket driver's reply has three fields


async def test_a_regular_file_as_stdin_reaches_the_guest_whole_then_its_end() -> None:
    """A bash run's script (a sealed memfd) and a task's archive are regular files: sent from
    their offset, in frames, then an empty frame (before: only the end, nothing of them)."""
    host, guest = socket.socketpair()
    ch = GuestChannel(host)
    data = os.urandom(3 << 20)
    fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    task = asyncio.ensure_future(ch.spawn(Launch(["cat"], {}, "/", 0, 0), stdio=(fd, out_w, out_w)))
    guest.setblocking(False)
    got, ended, answered = bytearray(), False, False
    buf = b""
    for _ in range(2000):
        with contextlib.suppress(BlockingIOError):
            buf += guest.recv(1 << 20)
        while len(buf) >= 9:
            kind, ident, n = struct.unpack_from("<cII", buf)
            if len(buf) < 9 + n:
                break
            body, buf = buf[9 : 9 + n], buf[9 + n :]
            if kind == b"S" and not answered:
                guest.sendall(struct.pack("<cII", b"R", ident, 4) + struct.pack("<i", 7))
                answered = True
            elif kind == b"I":
                got += body
                ended = not body
        if ended:
            break
        await asyncio.sleep(0.001)
    assert ended and bytes(got) == data
    await asyncio.wait_for(task, 2)
    for x in (fd, out_r, out_w):
        os.close(x)
    ch.close()
    guest.close()
