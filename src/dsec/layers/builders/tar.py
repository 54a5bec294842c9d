"""Tarballs imported as layers, extracted safely (no escapes, whiteouts honoured)."""

from __future__ import annotations

import contextlib
import gzip
import lzma
import os
import posixpath
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from dsec import errors
from dsec.layers.builders.common import _CHUNK, _OPAQUE_XATTR, _TAR_FORMATS, _ZSTD_MAGIC
from dsec.layers.builders.tree import _xattr_allowed
from dsec.layers.store import Layer, LayerStore, _make_ref

# --------------------------------------------------------------------------- safe tar extraction


def _safe_relpath(name: str, what: str) -> str:
    """A tar member or archive path, normalised; "" for the root. Refuses absolute paths and
    paths that climb out with '..'."""
    if "\0" in name:
        raise errors.InvalidRequest(f"{what} {name!r} contains a NUL byte")
    if name.startswith("/"):
        raise errors.InvalidRequest(f"{what} {name!r} is an absolute path; only relative paths are accepted")
    norm = posixpath.normpath(name) if name else "."
    if norm == ".." or norm.startswith("../"):
        raise errors.InvalidRequest(f"{what} {name!r} escapes the archive root with '..'")
    return "" if norm == "." else norm


def _remove(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class _Extractor:
    """Extracts a tar stream into ``dest`` without ever writing outside it.

    Entries are created with ``O_NOFOLLOW``/``O_EXCL`` under parents that are checked to be
    real directories (never symlinks), and hard links must name an entry already inside the
    tree. Ownership is kept numerically (container-side). With ``oci=True``, OCI whiteouts
    are turned into overlayfs ones. With ``sparse=False`` a sparse member is refused: its
    header can claim any size with no data behind it (a few blocks of stream, terabytes of
    zeros written here)."""

    def __init__(self, dest: Path, *, oci: bool, what: str, sparse: bool = True) -> None:
        self.dest = os.fspath(dest)
        self.oci = oci
        self.sparse = sparse
        self.what = what
        self.safe_dirs: set[str] = {""}
        self.dir_times: dict[str, int] = {}
        self.skipped: list[str] = []
        self.whiteouts = 0
        self.opaque = 0
        self.entries = 0

    def run(self, tf: tarfile.TarFile) -> None:
        for m in tf:
            self.member(tf, m)
        for path in sorted(self.dir_times, key=lambda p: p.count("/"), reverse=True):
            mt = self.dir_times[path]
            with contextlib.suppress(OverflowError, ValueError, OSError):
                os.utime(self._full(path), ns=(mt, mt), follow_symlinks=False)

    def _full(self, rel: str) -> str:
        return os.path.join(self.dest, rel) if rel else self.dest

    def _parent(self, rel: str) -> str:
        """Make sure every ancestor of ``rel`` is a real directory inside the tree; return the
        full path of ``rel``."""
        parent = posixpath.dirname(rel)
        if parent not in self.safe_dirs:
            cur = ""
            for comp in parent.split("/"):
                cur = posixpath.join(cur, comp) if cur else comp
                if cur in self.safe_dirs:
                    continue
                full = self._full(cur)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    os.mkdir(full, 0o755)
                else:
                    if not stat.S_ISDIR(st.st_mode):
                        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
                        raise errors.InvalidRequest(
                            f"{self.what}: member {rel!r} lies below {cur!r}, which is {kind}; refusing to "
                            "extract through it"
                        )
                self.safe_dirs.add(cur)
        return self._full(rel)

    def _clear(self, full: str, keep_dir: bool) -> None:
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return
        if keep_dir and stat.S_ISDIR(st.st_mode):
            return
        _remove(full)
        if stat.S_ISDIR(st.st_mode):
            self.safe_dirs = {""}

    def member(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        rel = _safe_relpath(m.name, f"{self.what}: member")
        if m.issparse() and not self.sparse:
            raise errors.InvalidRequest(
                f"{self.what}: member {m.name[:200]!r} is a sparse file; the guest's archiver makes none"
            )
        if self.oci and self._oci_whiteout(rel):
            return
        if rel == "":
            if not m.isdir():
                raise errors.InvalidRequest(f"{self.what}: the archive root {m.name!r} is not a directory")
            self._meta(self.dest, m, "")
            return
        full = self._parent(rel)
        self.entries += 1
        if m.isdir():
            self._clear(full, keep_dir=True)
            if not os.path.lexists(full):
                os.mkdir(full, 0o700)
            self.safe_dirs.add(rel)
            self._meta(full, m, rel)
            return
        if m.islnk():
            self._hardlink(rel, full, m)
            return
        self._clear(full, keep_dir=False)
        if m.isreg():
            self._write(tf, m, full)
        elif m.issym():
            os.symlink(m.linkname, full)
        elif m.ischr() and m.devmajor == 0 and m.devminor == 0:
            os.mknod(full, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        elif m.isfifo():
            os.mkfifo(full, 0o600)
        else:
            self.skipped.append(rel)
            self.entries -= 1
            return
        self._meta(full, m, rel)

    def _write(self, tf: tarfile.TarFile, m: tarfile.TarInfo, full: str) -> None:
        src = tf.extractfile(m)
        if src is None:
            raise errors.InvalidRequest(f"{self.what}: member {m.name!r} has no data")
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb", closefd=True) as out, src:
            shutil.copyfileobj(src, out, _CHUNK)

    def _hardlink(self, rel: str, full: str, m: tarfile.TarInfo) -> None:
        target_rel = _safe_relpath(m.linkname, f"{self.what}: hard link target of {m.name!r}")
        if not target_rel:
            raise errors.InvalidRequest(f"{self.what}: hard link {m.name!r} points at the archive root")
        target = self._parent(target_rel)
        try:
            tst = os.lstat(target)
        except FileNotFoundError:
            raise errors.InvalidRequest(
                f"{self.what}: hard link {m.name!r} points at {m.linkname!r}, which is not in the archive "
                "before it"
            ) from None
        if stat.S_ISDIR(tst.st_mode):
            raise errors.InvalidRequest(f"{self.what}: hard link {m.name!r} points at a directory")
        if target_rel == rel:
            return
        self._clear(full, keep_dir=False)
        os.link(target, full, follow_symlinks=False)

    def _meta(self, full: str, m: tarfile.TarInfo, rel: str) -> None:
        os.chown(full, m.uid, m.gid, follow_symlinks=False)
        if not m.issym():
            os.chmod(full, m.mode & 0o7777)
        for key, value in m.pax_headers.items():
            if key.startswith("SCHILY.xattr."):
                name = key[len("SCHILY.xattr.") :]
                if not _xattr_allowed(name):
                    continue
                with contextlib.suppress(OSError):
                    os.setxattr(full, name, value.encode("utf-8", "surrogateescape"), follow_symlinks=False)
        mtime = int(m.mtime * 1_000_000_000)
        if m.isdir():
            self.dir_times[rel] = mtime
        else:
            with contextlib.suppress(OverflowError, ValueError, OSError):  # absurd mtimes: keep "now"
                os.utime(full, ns=(mtime, mtime), follow_symlinks=False)

    def _oci_whiteout(self, rel: str) -> bool:
        base = posixpath.basename(rel)
        if not base.startswith(".wh."):
            return False
        parent_rel = posixpath.dirname(rel)
        if base == ".wh..wh..opq":
            self._parent(rel)  # the directory (and its ancestors) must be real directories
            parent = self._full(parent_rel)
            os.setxattr(parent, _OPAQUE_XATTR, b"y", follow_symlinks=False)
            self.opaque += 1
            return True
        if base.startswith(".wh..wh."):
            return True  # other aufs bookkeeping entries: meaningless for overlayfs
        name = base[len(".wh.") :]
        if name in ("", ".", ".."):  # ".wh..." would whiteout (and first remove) the parent
            raise errors.InvalidRequest(f"{self.what}: whiteout {rel!r} names no file")
        target_rel = posixpath.join(parent_rel, name) if parent_rel else name
        full = self._parent(target_rel)
        self._clear(full, keep_dir=False)
        os.mknod(full, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        os.chown(full, 0, 0, follow_symlinks=False)
        self.whiteouts += 1
        return True

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"entries": self.entries}
        if self.oci:
            out["whiteouts"] = self.whiteouts
            out["opaque_dirs"] = self.opaque
        if self.skipped:
            out["skipped"] = len(self.skipped)
            out["skipped_examples"] = self.skipped[:10]
        return out


_TAR_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError)


@contextlib.contextmanager
def _open_tar_stream(path: Path) -> Iterator[tarfile.TarFile]:
    """A streaming TarFile for ``path``: plain, gzip, bzip2, xz or (with the zstd tool) zstd."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _ZSTD_MAGIC:
        with tarfile.open(path, mode="r|*", bufsize=_CHUNK) as tf:
            yield tf
        return
    zstd = shutil.which("zstd")
    if zstd is None:
        raise errors.InvalidRequest(
            f"{path} is zstd-compressed but the zstd tool is not installed on this host"
        )
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([zstd, "-dcq", "--", str(path)], stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        ok = False
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|", bufsize=_CHUNK) as tf:
                yield tf
            while proc.stdout.read(_CHUNK):
                pass
            ok = True
        finally:
            proc.stdout.close()
            if not ok and proc.poll() is None:
                proc.kill()
            rc = proc.wait()
        if rc != 0:
            err.seek(0)
            msg = err.read().decode(errors="replace").strip()[-500:]
            raise errors.InvalidRequest(f"{path} could not be decompressed by zstd: {msg}")


def unpack_layer_stream(src: BinaryIO, dest: Path, what: str) -> dict[str, Any]:
    """Unpack an OCI layer tar that nothing vouches for (a guest's writable layer, say) from
    ``src`` into ``dest``, as ``import_tarball_layer`` unpacks a tarball: nothing outside
    ``dest``, nothing through a symlink, OCI whiteouts as overlayfs ones, device nodes left
    out, sparse members refused. Owners stay as archived (container-side). What it held,
    for the layer's source."""
    ex = _Extractor(dest, oci=True, what=what, sparse=False)
    try:
        with tarfile.open(fileobj=src, mode="r|", bufsize=_CHUNK) as tf:
            ex.run(tf)
    except _TAR_ERRORS as e:
        raise errors.InvalidRequest(f"{what} is not a readable tar archive ({e})") from None
    return ex.report()


def import_tarball_layer(store: LayerStore, name: str, version: str, tar_path: Path) -> Layer:
    """Import a root-filesystem tarball as ``name@version``.

    Members with absolute paths or '..' escapes are refused, nothing is extracted through a
    symlink, and device nodes other than overlay whiteouts (char 0:0) are skipped."""
    ref = _make_ref(name, version)
    tar_path = Path(tar_path)
    if not tar_path.is_file():
        raise errors.InvalidRequest(f"cannot import {tar_path} as layer {ref}: not a file")
    with store.staging() as staging:
        tree = staging / "tree"
        tree.mkdir()
        ex = _Extractor(tree, oci=False, what=str(tar_path))
        try:
            with _open_tar_stream(tar_path) as tf:
                ex.run(tf)
        except _TAR_ERRORS as e:
            raise errors.InvalidRequest(
                f"{tar_path} is not a readable tar archive ({e}); accepted: {_TAR_FORMATS}"
            ) from None
        source = {"type": "tarball", "path": str(tar_path.absolute()), **ex.report()}
        return store.commit_layer(tree, name, version, source, shift=True)
