"""Archives out of a sandbox are hostile: the edge's rebuild (dsec.edge.tarcheck) and the
SDK's extractor (dsec.client._extract, through `untar_local`, what `download` runs) each
refuse what could write outside, or leave a link pointing outside, of where it belongs.

Crafted archives: CVE-2025-4517's link chain (Python's `data` filter on 3.11.7 lets it write
outside the destination), its hard-link variant (overwrites a file outside), links that
stay inside by their letters but not once followed, absolute names, `..`, files through a
link, hard links out, devices, sparse and huge size headers."""

from __future__ import annotations

import gc
import io
import os
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec import errors
from dsec.archive import ArchiveTree
from dsec.client._base import untar_local
from dsec.edge.tarcheck import rebuild

Entry = tuple[str, bytes, str | bytes | None]  # name, type, data (file) or link target


def tar_of(entries: list[Entry], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, kind, payload in entries:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                ti.linkname = str(payload)
                tf.addfile(ti)
            elif kind == tarfile.REGTYPE:
                data = payload if isinstance(payload, bytes) else b""
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def D(name: str) -> Entry:
    return (name, tarfile.DIRTYPE, None)


def F(name: str, data: bytes = b"pwned\n") -> Entry:
    return (name, tarfile.REGTYPE, data)


def S(name: str, target: str) -> Entry:
    return (name, tarfile.SYMTYPE, target)


def H(name: str, target: str) -> Entry:
    return (name, tarfile.LNKTYPE, target)


def cve_2025_4517(then: Callable[[str], list[Entry]]) -> bytes:
    """The published shape: directories of 247-byte names, each with a one-letter link to
    it, so the path the `data` filter resolves passes PATH_MAX and `os.path.realpath` stops
    following; a link at the bottom climbs back out; `escape` leads through it to the
    destination's parent; `then(escape)` uses it."""
    comp, steps, path = "d" * 247, "abcdefghijklmnop", ""
    entries: list[Entry] = []
    for letter in steps:
        entries += [D(os.path.join(path, comp)), S(os.path.join(path, letter), comp)]
        path = os.path.join(path, comp)
    deep = os.path.join(*steps, "l" * 254)
    entries += [S(deep, "../" * len(steps)), S("escape", deep + "/../")]
    return tar_of(entries + then("escape"))


HOSTILE = {
    "cve-2025-4517 file": cve_2025_4517(lambda esc: [F(f"{esc}/pwned")]),
    "cve-2025-4517 hard link": cve_2025_4517(lambda esc: [H("h", f"{esc}/victim"), F("h")]),
    "link inside by its letters, outside once followed": tar_of([F("f"), S("l", "d/.."), S("d", ".")]),
    "link through a link climbing out": tar_of([D("a"), S("a/up", ".."), S("x", "a/up/..")]),
    "absolute name": tar_of([F("/pwned")]),
    "dotdot name": tar_of([F("../pwned")]),
    "nested dotdot name": tar_of([D("a"), F("a/../../pwned")]),
    "absolute link": tar_of([S("l", "/etc/passwd")]),
    "dotdot link": tar_of([S("l", "../victim")]),
    "file through a link": tar_of([S("l", "."), F("l/pwned")]),
    "file, then a link over its directory": tar_of([F("d/x"), S("d", "..")]),
    "hard link out (absolute)": tar_of([H("h", "/etc/passwd")]),
    "hard link out (dotdot)": tar_of([H("h", "../victim")]),
    "hard link through a link": tar_of([S("l", "."), H("h", "l/victim")]),
    "hard link to nothing before it": tar_of([H("h", "later"), F("later")]),
    "a name twice": tar_of([F("a", b"1"), F("a", b"2")]),
    "link loop": tar_of([S("a", "b"), S("b", "a")]),
}


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """tmp/dest (the destination) beside tmp/victim (a file outside)."""
    (tmp_path / "victim").write_bytes(b"host file\n")
    return tmp_path


def outside(place: Path) -> set[str]:
    return {str(p.relative_to(place)) for p in place.rglob("*") if "dest" not in p.parts}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_sdk_writes_nothing_of_a_hostile_archive(place: Path, data: bytes) -> None:
    before = outside(place)
    with pytest.raises(errors.DsecError):
        untar_local(data, place / "dest")
    assert outside(place) == before
    assert (place / "victim").read_bytes() == b"host file\n"
    assert list((place / "dest").iterdir()) == []  # checked whole before a byte is written


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_edge_forwards_nothing_of_a_hostile_archive(data: bytes) -> None:
    spool = tempfile.TemporaryFile()  # noqa: SIM115
    with pytest.raises(errors.DsecError) as ei:
        rebuild(io.BytesIO(data), spool, "the archive of /work", 1 << 20, 1000)
    spool.close()  # the caller discards it: no tar stream of the rebuild may write into it later
    del ei
    gc.collect()


@pytest.mark.parametrize(
    "data",
    [
        tar_of([(name, kind, None)])
        for name, kind in (("dev", tarfile.CHRTYPE), ("blk", tarfile.BLKTYPE), ("fifo", tarfile.FIFOTYPE))
    ],
    ids=["char device", "block device", "fifo"],
)
def test_special_files_are_refused_by_the_sdk_and_left_out_by_the_edge(place: Path, data: bytes) -> None:
    with pytest.raises(errors.InvalidRequest):
        untar_local(data, place / "dest")
    assert list((place / "dest").iterdir()) == []
    out = io.BytesIO()
    rebuild(io.BytesIO(data), out, "a", 1 << 20, 1000)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tf:
        assert tf.getnames() == []


def test_links_already_in_the_destination_are_replaced_or_refused_never_followed(place: Path) -> None:
    dest = place / "dest"
    dest.mkdir()
    (dest / "f").symlink_to(place / "victim")  # a file's name: the link is replaced
    untar_local(tar_of([F("f", b"new\n")]), dest)
    assert (place / "victim").read_bytes() == b"host file\n"
    assert not (dest / "f").is_symlink() and (dest / "f").read_bytes() == b"new\n"
    (dest / "d").symlink_to(place)  # a directory's name: refused, nothing written through it
    with pytest.raises(errors.PathEscape):
        untar_local(tar_of([F("ok"), F("d/victim")]), dest)
    assert (place / "victim").read_bytes() == b"host file\n" and not (dest / "ok").exists()
    with pytest.raises(errors.PathEscape):  # nor a link of ours leading through it
        untar_local(tar_of([S("l", "d/victim")]), dest)
    assert not (dest / "l").exists()


def test_a_clean_archive_comes_out_whole_with_safe_modes(place: Path) -> None:
    entries = [
        D("./"),
        D("./bin"),
        F("./bin/tool", b"#!/bin/sh\n"),
        F("./data", b"x" * 5000),
        H("./data2", "./data"),
        S("./bin/up", "../data"),
        S("./here", "bin"),
        S("./through", "here/up"),
    ]
    buf = io.BytesIO(tar_of(entries))
    with tarfile.open(fileobj=buf, mode="a") as tf:  # set-id bits and wide modes
        ti = tarfile.TarInfo("./suid")
        ti.mode, ti.size = 0o6777, 1
        tf.addfile(ti, io.BytesIO(b"s"))
    raw = buf.getvalue()
    out = io.BytesIO()
    rebuild(io.BytesIO(raw), out, "a", 1 << 20, 1000)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tf:
        members = tf.getmembers()
    names = [m.name for m in members]
    assert names[-3:] == ["./bin/up", "./here", "./through"]  # links last
    assert names[0] == "." and "./data2" in names
    dest = place / "dest"
    untar_local(out.getvalue(), dest)
    assert (dest / "through").read_bytes() == b"x" * 5000
    assert (dest / "data2").stat().st_ino == (dest / "data").stat().st_ino
    assert stat.S_IMODE((dest / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "data").stat().st_mode) == 0o644
    untar_local(out.getvalue(), dest)  # again into the same place: replaced, not followed
    assert (dest / "bin" / "tool").read_bytes() == b"#!/bin/sh\n"


def test_the_rebuild_keeps_nothing_of_the_sources_headers() -> None:
    """pax records (xattrs, a path, user names), owners beyond range and absurd times are
    the guest's words: the rebuilt headers carry none of them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("./f")
        ti.size, ti.uname, ti.mtime, ti.uid = 1, "root", 1e30, 2**40
        ti.pax_headers = {"SCHILY.xattr.security.capability": "x", "comment": "y"}
        tf.addfile(ti, io.BytesIO(b"1"))
    out = io.BytesIO()
    rebuild(io.BytesIO(buf.getvalue()), out, "a", 1 << 20, 1000)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tf:
        (m,) = tf.getmembers()
    assert (m.name, m.uname, m.pax_headers, m.uid) == ("./f", "", {}, 65534)
    assert 0 <= m.mtime < 8**11


def test_sizes_are_bounded_while_streaming(tmp_path: Path) -> None:
    """A size header larger than the budget is refused before its data is read; one that
    is not followed by its data is a 4xx, not a short file; a sparse member counts whole."""
    header = tarfile.TarInfo("big")
    header.size = 10 << 30
    huge = header.tobuf(format=tarfile.GNU_FORMAT) + bytes(1024)
    with pytest.raises(errors.PayloadTooLarge):
        rebuild(io.BytesIO(huge), io.BytesIO(), "a", 64 << 20, 1000)
    with pytest.raises(errors.InvalidRequest):
        rebuild(io.BytesIO(huge), io.BytesIO(), "a", 20 << 30, 1000)
    with pytest.raises(errors.InvalidRequest):
        untar_local(huge, tmp_path / "dest")
    (tmp_path / "src").mkdir()
    subprocess.run(["truncate", "-s", "1G", str(tmp_path / "src" / "hole")], check=True)
    sparse = subprocess.run(
        ["tar", "--sparse", "-c", "-C", str(tmp_path / "src"), "hole"], check=True, capture_output=True
    ).stdout
    assert len(sparse) < 100_000
    with pytest.raises(errors.PayloadTooLarge):
        rebuild(io.BytesIO(sparse), io.BytesIO(), "a", 64 << 20, 1000)
    with pytest.raises(errors.InvalidRequest, match="sparse"):
        untar_local(sparse, tmp_path / "dest")
    assert not (tmp_path / "dest" / "hole").exists()
    many = tar_of([F(f"f{i}", b"") for i in range(20)])
    with pytest.raises(errors.PayloadTooLarge):
        rebuild(io.BytesIO(many), io.BytesIO(), "a", 1 << 20, 10)


def test_garbage_is_a_4xx() -> None:
    for data in (b"", b"not a tar" * 100, os.urandom(4096)):
        with pytest.raises(errors.InvalidRequest):
            rebuild(io.BytesIO(data), io.BytesIO(), "a", 1 << 20, 1000)


def test_checking_links_is_bounded_work() -> None:
    """Each link resolved once: a chain whose naive walk doubles at every level (2**60
    steps) resolves at once; a chain longer than the kernel follows is refused."""
    tree = ArchiveTree("a")
    tree.add("x", "dir")
    tree.add("l0", "link", "x")
    for i in range(1, 60):
        tree.add(f"l{i}", "link", f"l{i - 1}/../l{i - 1}")
    tree.check_links()
    tree = ArchiveTree("a")
    for i in range(60):
        tree.add(f"c{i}", "link", f"c{i + 1}")
    with pytest.raises(errors.InvalidRequest, match="chain"):
        tree.check_links()
