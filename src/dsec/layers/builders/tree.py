"""A host directory imported as a layer: an exact copy with owners, modes, xattrs and whiteouts."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.layers.builders.common import _OPAQUE_XATTR, _SKIP_XATTRS
from dsec.layers.store import Layer, LayerStore, _make_ref

# --------------------------------------------------------------------------- metadata helpers


def _xattr_allowed(name: str) -> bool:
    """Imported xattrs: all but SELinux labels and overlayfs' own bookkeeping (redirects,
    metacopy, origin...) which must not come from outside; the opaque marker is kept."""
    if name in _SKIP_XATTRS:
        return False
    return not name.startswith("trusted.overlay.") or name == _OPAQUE_XATTR


def _is_whiteout_dev(mode: int, rdev: int) -> bool:
    return stat.S_ISCHR(mode) and os.major(rdev) == 0 and os.minor(rdev) == 0


def _copy_xattrs(src: str, dst: str) -> None:
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError:
        return
    for n in names:
        if not _xattr_allowed(n):
            continue
        with contextlib.suppress(OSError):
            os.setxattr(dst, n, os.getxattr(src, n, follow_symlinks=False), follow_symlinks=False)


def _copy_meta(src: str, dst: str, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    _copy_xattrs(src, dst)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_entry(sp: str, dp: str, st: os.stat_result, skipped: list[str]) -> bool:
    """Create the non-directory ``dp`` like ``sp``; False when skipped."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        shutil.copyfile(sp, dp, follow_symlinks=False)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(sp), dp)
    elif _is_whiteout_dev(mode, st.st_rdev):
        os.mknod(dp, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dp, 0o600)
    else:
        skipped.append(sp)
        return False
    return True


def _copy_tree(src: Path, dst: Path) -> list[str]:
    """Copy ``src`` into the existing empty ``dst`` keeping ids, modes, xattrs, mtimes and hard
    links. Device nodes other than overlay whiteouts, and sockets, are skipped (returned)."""
    skipped: list[str] = []
    links: dict[tuple[int, int], str] = {}
    dirs: list[tuple[str, str, os.stat_result]] = [(os.fspath(src), os.fspath(dst), os.lstat(src))]
    stack = [(os.fspath(src), os.fspath(dst))]
    while stack:
        s, d = stack.pop()
        with os.scandir(s) as it:
            entries = list(it)
        for e in entries:
            sp, dp = e.path, os.path.join(d, e.name)
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(dp, 0o700)
                dirs.append((sp, dp, st))
                stack.append((sp, dp))
                continue
            if st.st_nlink > 1:
                first = links.get((st.st_dev, st.st_ino))
                if first is not None:
                    os.link(first, dp, follow_symlinks=False)
                    continue
            if _copy_entry(sp, dp, st, skipped):
                if st.st_nlink > 1:
                    links[(st.st_dev, st.st_ino)] = dp
                _copy_meta(sp, dp, st)
    for sp, dp, st in reversed(dirs):  # children before parents, so mtimes stick
        _copy_meta(sp, dp, st)
    return skipped


def import_dir_layer(store: LayerStore, name: str, version: str, src: Path) -> Layer:
    """Copy the plain directory ``src`` (container-side ids) into the store as ``name@version``."""
    ref = _make_ref(name, version)
    src = Path(src)
    if src.is_symlink() or not src.is_dir():
        raise errors.InvalidRequest(f"cannot import {src} as layer {ref}: not a directory")
    with store.staging() as staging:
        tree = staging / "tree"
        tree.mkdir()
        skipped = _copy_tree(src, tree)
        source: dict[str, Any] = {"type": "dir", "path": str(src.absolute())}
        if skipped:
            source["skipped"] = len(skipped)
        return store.commit_layer(tree, name, version, source, shift=True)
