"""dsec-copy (native/dsec-copy.c), the copy behind forks and snapshots: exactly what `cp -a`
makes, and overlayfs merge semantics with -n."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from dsec.native import ensure_copy


@pytest.fixture(scope="module")
def copy_tool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dsec-copy, built from source once for this module."""
    return ensure_copy(tmp_path_factory.mktemp("bin"))

pytestmark = pytest.mark.root


def make_tree(s: Path) -> None:
    (s / "a/b/c").mkdir(parents=True)
    (s / "empty").mkdir()
    (s / "opq").mkdir()
    (s / "big").write_bytes(os.urandom(20_000_000))  # > one chunk: copied in parallel pieces
    os.chmod(s / "big", 0o444)
    (s / "a/f").write_text("hi")
    os.chown(s / "a/f", 100005, 100007)
    os.chmod(s / "a/f", 0o4750)
    with open(s / "sparse", "wb") as f:
        f.truncate(50 << 20)
        f.seek(30_000_000)
        f.write(b"x")
    os.link(s / "a/f", s / "a/b/hard")
    os.symlink("/etc/passwd", s / "abs")
    os.lchown(s / "abs", 100001, 100001)
    os.symlink("../f", s / "a/b/rel")
    os.symlink("nowhere", s / "dangling")
    os.mkfifo(s / "fifo")
    os.mknod(s / "a/wh", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # an overlayfs whiteout
    os.setxattr(s / "opq", "trusted.overlay.opaque", b"y")
    os.setxattr(s / "a/f", "user.k", b"val")
    for i in range(50):
        (s / f"a/b/c/n{i}").write_text(str(i))
    os.utime(s / "a/b", (978307200, 978307200))
    os.chown(s, 100000, 100000)
    os.chmod(s, 0o711)


def describe(root: Path) -> dict[str, tuple[object, ...]]:
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in ["", *dns, *fns]:
            p = Path(dp, n) if n else Path(dp)
            st = os.lstat(p)
            link = stat.S_ISLNK(st.st_mode)
            xattrs = {} if link else {k: os.getxattr(p, k, follow_symlinks=False) for k in os.listxattr(p)}
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(root))] = (
                st.st_mode,
                st.st_uid,
                st.st_gid,
                st.st_size,
                st.st_nlink,
                st.st_rdev,
                None if link else st.st_mtime_ns,
                xattrs,
                data,
                os.readlink(p) if link else None,
            )
    return out


def test_copy_is_exactly_cp_a(tmp_path: Path, copy_tool: Path) -> None:
    tool = copy_tool
    src, ours, theirs = tmp_path / "src", tmp_path / "ours", tmp_path / "theirs"
    src.mkdir()
    make_tree(src)
    subprocess.run([str(tool), "-j", "3", str(src), str(ours)], check=True)
    subprocess.run(["cp", "-a", str(src), str(theirs)], check=True)
    want = describe(theirs)
    assert describe(ours) == want
    assert describe(src) == want
    assert os.stat(ours / "a/f").st_ino == os.stat(ours / "a/b/hard").st_ino
    assert os.stat(ours / "sparse").st_blocks < 1024  # holes stay holes


def test_merge_keeps_upper_entries_and_respects_opaque_dirs(tmp_path: Path, copy_tool: Path) -> None:
    tool = copy_tool
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "keep").mkdir(parents=True)
    (lower / "keep/l").write_text("lower")
    (lower / "hidden").mkdir()
    (lower / "hidden/old").write_text("old")
    (lower / "both").write_text("lower")
    (lower / "deleted").write_text("lower")
    (upper / "keep").mkdir(parents=True)
    (upper / "keep/u").write_text("upper")
    (upper / "hidden").mkdir()
    os.setxattr(upper / "hidden", "trusted.overlay.opaque", b"y")
    (upper / "both").write_text("upper")
    os.mknod(upper / "deleted", stat.S_IFCHR, os.makedev(0, 0))
    subprocess.run([str(tool), "-n", str(lower), str(upper)], check=True)
    assert sorted(os.listdir(upper / "keep")) == ["l", "u"]
    assert os.listdir(upper / "hidden") == []  # opaque: nothing from below
    assert (upper / "both").read_text() == "upper"
    assert stat.S_ISCHR(os.lstat(upper / "deleted").st_mode)  # the whiteout wins


def test_merge_never_writes_through_an_upper_symlink(tmp_path: Path, copy_tool: Path) -> None:
    """An upper entry that is not a directory hides the lower directory of that name whole
    (overlayfs); the merge must not walk into it either: a sandbox's symlink there (to a host
    directory, absolute or relative) would take every lower entry below it onto the host, and
    a whiteout there failed the copy."""
    tool = copy_tool
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    for d in ("abs", "rel"):
        (tmp_path / f"host-{d}").mkdir()
        (lower / d / "sub").mkdir(parents=True)
        (lower / d / "evil").write_text("written by the sandbox")
        (lower / d / "big").write_bytes(b"x" * 20_000_000)  # > one chunk: created in phase 1
        (lower / d / "sub/deeper").write_text("x")
        os.symlink("/etc/passwd", lower / d / "lnk")
        os.mkfifo(lower / d / "fifo")
        os.link(lower / d / "evil", lower / d / "hard")
    (lower / "gone/sub").mkdir(parents=True)  # a directory the upper deleted (a whiteout)
    (lower / "gone/sub/f").write_text("x")
    upper.mkdir()
    os.mknod(upper / "gone", stat.S_IFCHR, os.makedev(0, 0))
    os.symlink(tmp_path / "host-abs", upper / "abs")
    os.symlink("../host-rel", upper / "rel")
    r = subprocess.run([str(tool), "-n", str(lower), str(upper)], capture_output=True, text=True)
    assert os.listdir(tmp_path / "host-abs") == [] and os.listdir(tmp_path / "host-rel") == []
    assert r.returncode == 0, r.stderr
    assert os.readlink(upper / "abs") == str(tmp_path / "host-abs")
    assert os.readlink(upper / "rel") == "../host-rel"
    assert stat.S_ISCHR(os.lstat(upper / "gone").st_mode)  # and the deleted directory stays deleted


def test_copy_reports_failures(tmp_path: Path, copy_tool: Path) -> None:
    tool = copy_tool
    r = subprocess.run(
        [str(tool), str(tmp_path / "missing"), str(tmp_path / "d")], capture_output=True, text=True
    )
    assert r.returncode == 1 and "missing" in r.stderr
    assert subprocess.run([str(tool), "-j", "0", "a", "b"], capture_output=True).returncode == 2
