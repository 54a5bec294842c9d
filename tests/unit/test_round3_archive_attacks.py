"""Round three's attack review of item 1 (issue #25): archives a sandbox produced, crafted
with tricks the first round's tests (test_archive_downloads.py) do not use, against the
edge's rebuild (dsec.edge.tarcheck.rebuild) and the SDK's extractor (dsec.client._extract,
through `untar_local`, what `download` runs).

Each test names the trick; the secure behaviour asserted is always the same: nothing is
written, or left pointing, outside the destination, a refusal is a DsecError (a 4xx) and
comes before the first byte is written, and an extraction's work is bounded."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import unicodedata
from pathlib import Path

import pytest

from dsec import errors
from dsec.client._base import untar_local
from dsec.edge.tarcheck import rebuild


def tar_of(
    members: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.GNU_FORMAT
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for m in members:
            if isinstance(m, tuple):
                info, data = m
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(m)
    return buf.getvalue()


def info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", pax: dict[str, str] | None = None):
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, link, 0o755 if kind == tarfile.DIRTYPE else 0o644
    ti.pax_headers = pax or {}
    return ti


def F(name: str, data: bytes = b"pwned\n", pax: dict[str, str] | None = None):
    return (info(name, pax=pax), data)


def D(name: str):
    return info(name, tarfile.DIRTYPE)


def S(name: str, target: str, pax: dict[str, str] | None = None):
    return info(name, tarfile.SYMTYPE, target, pax)


def H(name: str, target: str):
    return info(name, tarfile.LNKTYPE, target)


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """tmp/dest (the destination, made by the extraction) beside tmp/victim (a file outside)."""
    (tmp_path / "victim").write_bytes(b"host file\n")
    return tmp_path


def _in(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def _refused_whole(data: bytes, place: Path, kind: type[errors.DsecError] = errors.DsecError) -> None:
    """The SDK refuses `data` with nothing written; the edge's rebuild refuses it too."""
    with pytest.raises(kind):
        untar_local(data, place / "dest")
    assert _in(place / "dest") == [] and (place / "victim").read_bytes() == b"host file\n"
    with pytest.raises(kind):
        rebuild(io.BytesIO(data), io.BytesIO(), "the archive of /work", 1 << 30, 200_000)


# --- names no file system holds ---------------------------------------------------------------


def test_a_part_over_255_bytes_is_refused_before_a_byte_is_written(place: Path) -> None:
    """ATTACK (worked): a guest's tar (its root replaced it) names a member with a 300-byte
    part. The edge's rebuild forwarded it, and the SDK wrote the members before it, then
    stopped with a bare OSError (ENAMETOOLONG): a partial download, and no DsecError."""
    data = tar_of([F("ok", b"fine\n"), F("sub/" + "a" * 300)])
    _refused_whole(data, place, errors.InvalidRequest)
    for cut in (255, 254):  # the longest part a file system holds is still fine
        out = io.BytesIO()
        rebuild(io.BytesIO(tar_of([F("d/" + "b" * cut)])), out, "a", 1 << 20, 10)
        untar_local(out.getvalue(), place / f"ok{cut}")
        assert (place / f"ok{cut}" / "d" / ("b" * cut)).read_bytes() == b"pwned\n"


# --- a trainer on macOS or Windows: a case-insensitive, normalising destination ---------------


def _nfd(s: str) -> str:
    return unicodedata.normalize("NFD", s)


CASE_TRICKS = {
    # Q -> "." (the root), x -> q/..: on Linux q is no link and x stays at the root; where q
    # is Q, x is the destination's parent.
    "a link through a case variant of a link": tar_of([S("Q", "."), S("x", "q/..")]),
    "deeper, below a directory": tar_of([D("D"), S("D/Q", "."), S("x", "D/q/../..")]),
    "through a case variant of the directory holding a link": tar_of(
        [D("D"), S("D/l", "."), S("x", "d/l/../..")]
    ),
    "a Unicode normalisation variant": tar_of([S("\u00e9", "."), S("x", _nfd("\u00e9") + "/..")]),
    "an ignorable code point (HFS+ drops U+200C)": tar_of([S("ab", "."), S("x", "a\u200cb/..")]),
    # two links one name apart: which one stays there depends on the order they are made in
    "two links that differ only by case": tar_of([S("L", "sub/deeper"), S("l", "."), D("sub/deeper")]),
}


@pytest.mark.parametrize("data", CASE_TRICKS.values(), ids=CASE_TRICKS.keys())
def test_links_a_case_insensitive_destination_would_follow_out_are_refused(place: Path, data: bytes) -> None:
    """ATTACK (worked, on a trainer's macOS or Windows file system): every link stays inside
    by Linux's rules, so the edge forwarded these and the SDK made the links; where `q` is
    `Q` (or `é` its decomposed form, or U+200C nothing), `x` leads to the destination's
    parent. This host has no case-folding file system, so the rule itself is what is tested:
    no link may resolve through a name that folds to another link's."""
    _refused_whole(data, place, errors.DsecError)


def test_case_variants_without_links_still_extract(place: Path) -> None:
    """Files that differ by case (Linux's own tree has some) are not refused: only links
    resolved through a case variant are."""
    data = tar_of([F("Makefile", b"1"), F("makefile", b"2"), D("Inc"), F("inc/x", b"3"), S("l", "Inc")])
    untar_local(data, place / "dest")
    assert (place / "dest" / "makefile").read_bytes() == b"2" and (place / "dest" / "l").is_symlink()


# --- the destination: what is there already, checked before anything is written ---------------


def test_a_directory_where_the_archive_has_a_file_is_refused_before_writing(place: Path) -> None:
    """ATTACK (worked): the archive's first members were written, then its file over a
    directory of the destination stopped the extraction midway (Conflict), leaving a partial
    download the trainer may read as whole."""
    dest = place / "dest"
    (dest / "later").mkdir(parents=True)
    with pytest.raises(errors.Conflict):
        untar_local(tar_of([F("a", b"new\n"), F("later")]), dest)
    assert _in(dest) == ["later"]
    with pytest.raises(errors.Conflict):  # a link's name too (links are made last of all)
        untar_local(tar_of([F("a", b"new\n"), S("later", "a")]), dest)
    assert _in(dest) == ["later"]


def test_a_file_or_link_where_the_archive_has_a_directory_is_refused_before_writing(place: Path) -> None:
    """ATTACK (worked): a file of the destination (an earlier download) on the way to a
    member stopped the extraction midway (PathEscape after the first members)."""
    dest = place / "dest"
    dest.mkdir()
    (dest / "d").write_bytes(b"old\n")
    (dest / "l").symlink_to(place)  # a trainer's own link: never followed, never replaced
    for later in ("d/x", "l/victim", "d/"):
        entry = D(later) if later.endswith("/") else F(later)
        with pytest.raises(errors.PathEscape):
            untar_local(tar_of([F("a", b"new\n"), entry]), dest)
        assert _in(dest) == ["d", "l"] and (place / "victim").read_bytes() == b"host file\n"


def test_files_and_links_of_an_earlier_download_are_replaced_never_followed(place: Path) -> None:
    """A symlink (to a host file) and a hard link (to a host file) where the archive has a
    file: the name is replaced, the host files untouched."""
    dest = place / "dest"
    dest.mkdir()
    (dest / "s").symlink_to(place / "victim")
    os.link(place / "victim", dest / "h")
    untar_local(tar_of([F("s", b"new s\n"), F("h", b"new h\n")]), dest)
    assert (place / "victim").read_bytes() == b"host file\n"
    assert (dest / "s").read_bytes() == b"new s\n" and not (dest / "s").is_symlink()
    assert (dest / "h").read_bytes() == b"new h\n" and (dest / "h").stat().st_nlink == 1


# --- bounded work ----------------------------------------------------------------------------


def _deep(depth: int, top: str) -> str:
    return "/".join([top] + ["d"] * (depth - 1))


def test_deep_names_out_of_order_are_refused_before_writing(place: Path) -> None:
    """ATTACK (worked): every member was reached by opening each directory from the root:
    5,000 files 1,000 levels down took the SDK 90 s for an 18 MB download, and members that
    alternate between two deep directories defeat any one-path cache. Now directories are
    walked as a chain shared by consecutive members, and an archive whose walk would still
    take more than MAX_WALK_STEPS opens is refused up front."""
    a, b = _deep(1000, "a"), _deep(1000, "b")
    members = [F(f"{a if i % 2 else b}/f{i}") for i in range(4100)]
    try:
        with pytest.raises(errors.PayloadTooLarge, match="directory steps"):
            untar_local(tar_of(members), place / "dest")
        assert _in(place / "dest") == []
    finally:  # (what an extractor that took it made: pytest's cleanup cannot remove it)
        subprocess.run(["rm", "-rf", "--", str(place / "dest")], check=True)


def test_deep_names_in_order_extract_whole_and_leave_no_descriptor_open(place: Path) -> None:
    """The same depth in tar's own order (the chain reuses the open directories): whole, and
    no descriptor left open, after a success or a refusal."""
    deep = _deep(1000, "a")
    before = len(os.listdir("/proc/self/fd"))
    try:
        files = [F(f"{deep}/f{i}", str(i).encode()) for i in range(2000)]
        untar_local(tar_of([*files, S("top", deep)]), place / "dest")
        assert (place / "dest" / "top" / "f1999").read_bytes() == b"1999"
        assert len(os.listdir("/proc/self/fd")) == before
        (place / "other" / "a").mkdir(parents=True)
        (place / "other" / "a" / "d").write_bytes(b"")  # a file on the way: refused at level 2
        with pytest.raises(errors.PathEscape):
            untar_local(tar_of([F(f"{deep}/f")]), place / "other")
        assert len(os.listdir("/proc/self/fd")) == before
    finally:  # (pytest's own cleanup recurses once per level: past Python's limit here)
        subprocess.run(["rm", "-rf", "--", str(place / "dest")], check=True)


# --- header tricks: refused by both sides, nothing written -------------------------------------

HEADER_TRICKS = {
    "pax path: absolute": tar_of([F("ok", pax={"path": "/etc/cron.d/x"})], tarfile.PAX_FORMAT),
    "pax path: climbs with ..": tar_of([F("ok", pax={"path": "a/../../x"})], tarfile.PAX_FORMAT),
    "pax path: a NUL byte": tar_of([F("ok", pax={"path": "a\0/../../x"})], tarfile.PAX_FORMAT),
    "pax linkpath: out": tar_of([S("l", "ok", pax={"linkpath": "../../etc"})], tarfile.PAX_FORMAT),
    "pax path: a second name for a directory, then a file through a link of it": tar_of(
        [D("d"), S("l", "d", pax={"path": "d"}), F("d/x")], tarfile.PAX_FORMAT
    ),
    "GNU long name climbing out after 60 levels": tar_of([F("a/" * 60 + "../" * 61 + "x")]),
    "GNU long link climbing out": tar_of([S("l", "../" * 200 + "etc")]),
    "a directory, a link of its name, a file through it": tar_of([D("d"), S("d", ".."), F("d/victim")]),
    "a hard link to a symbolic link": tar_of([S("l", "../victim"), H("h", "l")]),
    "a hard link to a directory": tar_of([D("d"), H("h", "d")]),
    "a hard link to itself": tar_of([H("h", "h")]),
    "one name three ways": tar_of([F("a"), F("./a"), F("a/")]),
    "the archive root as a file": tar_of([F(".")]),
    "the archive root as a link": tar_of([S("./", "..")]),
    "a chain of 41 links": tar_of([S(f"l{i}", f"l{i + 1}") for i in range(41)] + [F("l41")]),
}


@pytest.mark.parametrize("data", HEADER_TRICKS.values(), ids=HEADER_TRICKS.keys())
def test_header_tricks_are_refused_whole(place: Path, data: bytes) -> None:
    _refused_whole(data, place)


def test_an_archive_cut_short_is_refused_whole_and_trailing_garbage_is_ignored(place: Path) -> None:
    """ATTACK (worked): an archive cut at a member's header (tarfile stops there without a
    word) extracted its first members as if whole. Now an archive must end with tar's end
    blocks, as every one the edge sends does; one cut inside a member's data was already
    refused. Bytes after the end blocks are never read as members."""
    whole = tar_of([F("a", b"x" * 1000), F("b", b"y" * 1000)])
    for cut in (512 * 3 + 500, 512 * 3, 512 * 4 + 100, 512 * 6 + 512):
        with pytest.raises(errors.InvalidRequest):
            untar_local(whole[:cut], place / "dest")
        assert _in(place / "dest") == []
    untar_local(whole + tar_of([F("../after", b"hidden")]), place / "dest")
    assert _in(place / "dest") == ["a", "b"] and not (place / "after").exists()


@pytest.mark.parametrize("fmt", ["gnu", "posix-0.0", "posix-0.1", "posix-1.0"])
def test_sparse_members_are_refused_by_the_sdk_and_count_whole_at_the_edge(
    place: Path, tmp_path: Path, fmt: str
) -> None:
    """GNU tar's sparse formats (a few KiB of stream claiming 1 GiB): the SDK refuses them,
    the edge's rebuild counts them at their full size against its budget."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sp", "wb") as f:
        f.truncate(1 << 30)
        f.seek(5000)
        f.write(b"x")
    kind, _, version = fmt.partition("-")
    argv = [
        "tar",
        "-c",
        f"--format={kind}",
        "--sparse",
        *([f"--sparse-version={version}"] if version else []),
    ]
    data = subprocess.run([*argv, "-C", str(src), "sp"], check=True, capture_output=True).stdout
    assert len(data) < 1 << 20
    with pytest.raises(errors.InvalidRequest, match="sparse"):
        untar_local(data, place / "dest")
    assert _in(place / "dest") == []
    with pytest.raises(errors.PayloadTooLarge):
        rebuild(io.BytesIO(data), io.BytesIO(), "the archive of /work", 64 << 20, 1000)
