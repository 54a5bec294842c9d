"""Making layers: Debian roots with mmdebstrap, and imports of directories, tarballs and
OCI / docker archives.

Every builder fills a staging directory with *container-side* ownership and commits it with
``shift=True``, so the store applies the uid/gid offset exactly once.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import os
import platform
import posixpath
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import tomllib
import zlib
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import IO, Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from dsec import errors
from dsec.layers.store import Image, Layer, LayerRef, LayerStore, _make_ref

Progress = Callable[[str], None]

_CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
_OPAQUE_XATTR = "trusted.overlay.opaque"
_SKIP_XATTRS = frozenset({"security.selinux"})
_TAR_FORMATS = "a .tar, .tar.gz (or .tgz, .tar.xz, .tar.bz2) or, when the zstd tool is installed, .tar.zst"
_OCI_FORMATS = (
    "a `docker save` tar (manifest.json with Config and Layers), an OCI image layout directory "
    "(oci-layout, index.json, blobs/sha256/...) or a tar of an OCI image layout"
)


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


# --------------------------------------------------------------------------- recipes


_VARIANTS = frozenset(
    {
        "extract",
        "custom",
        "essential",
        "apt",
        "required",
        "minbase",
        "buildd",
        "important",
        "debootstrap",
        "standard",
    }
)
_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(:[a-z0-9-]+)?(=[A-Za-z0-9.+~:-]+)?$")
_SUITE_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,63}$")


class DebianRecipe(BaseModel):
    """A Debian root filesystem built by mmdebstrap."""

    model_config = ConfigDict(extra="forbid")

    name: str
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: list[str]
    mirror: str = "http://deb.debian.org/debian"

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        _make_ref(v, "1")
        return v

    @field_validator("suite")
    @classmethod
    def _valid_suite(cls, v: str) -> str:
        if not _SUITE_RE.match(v):
            raise ValueError(f"suite {v!r} is invalid: use a Debian suite or codename such as 'bookworm'")
        return v

    @field_validator("variant")
    @classmethod
    def _valid_variant(cls, v: str) -> str:
        if v not in _VARIANTS:
            raise ValueError(f"variant {v!r} is invalid: use one of {', '.join(sorted(_VARIANTS))}")
        return v

    @field_validator("packages")
    @classmethod
    def _valid_packages(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not _PKG_RE.match(p)]
        if bad:
            raise ValueError(f"package names {bad} are invalid: use Debian package names such as 'python3'")
        return v

    @field_validator("mirror")
    @classmethod
    def _valid_mirror(cls, v: str) -> str:
        if not re.match(r"^(https?|file)://[^\s,]+$", v):
            raise ValueError(f"mirror {v!r} is invalid: use an http://, https:// or file:// URL")
        return v

    def digest(self) -> str:
        """sha256 (hex) of the recipe's canonical JSON; the build-cache key.

        Package order and duplicates do not matter (mmdebstrap installs a set)."""
        canon = {
            "name": self.name,
            "suite": self.suite,
            "variant": self.variant,
            "packages": sorted(set(self.packages)),
            "mirror": self.mirror,
        }
        return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _recipes_dir() -> Any:
    return resources.files("dsec.layers").joinpath("recipes")


def list_recipes() -> list[str]:
    """Names of the recipes shipped with dsec (``src/dsec/layers/recipes/<name>.toml``)."""
    return sorted(p.name[: -len(".toml")] for p in _recipes_dir().iterdir() if p.name.endswith(".toml"))


def load_recipe(name: str) -> DebianRecipe:
    """The shipped recipe ``name``; :class:`errors.ImageNotFound` listing the known ones otherwise."""
    known = list_recipes()
    if name not in known:
        raise errors.ImageNotFound(
            f"there is no recipe for image {name!r}; known recipes: {', '.join(known) or 'none'}",
            image=name,
            available=known,
        )
    data = tomllib.loads(_recipes_dir().joinpath(f"{name}.toml").read_text(encoding="utf-8"))
    data.setdefault("name", name)
    try:
        return DebianRecipe.model_validate(data)
    except ValidationError as e:
        raise errors.InternalError(f"the shipped recipe {name!r} is invalid: {e}") from None


# --------------------------------------------------------------------------- mmdebstrap


def _run_logged(cmd: list[str], what: str, progress: Progress | None) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=40)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    except OSError as e:
        raise errors.InternalError(f"could not run {cmd[0]} for {what}: {e}") from None
    with proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            _say(progress, line)
        rc = proc.wait()
    if rc != 0:
        raise errors.InternalError(
            f"{os.path.basename(cmd[0])} failed (exit {rc}) for {what}; last output:\n" + "\n".join(tail),
            exit_code=rc,
        )


def _inside(tree: Path, p: Path) -> bool:
    try:
        return p.resolve().is_relative_to(tree.resolve())
    except OSError:
        return False


def _empty_dir(d: Path, keep: frozenset[str] = frozenset()) -> None:
    """Remove what ``d`` holds (not following symlinks), except the names in ``keep``."""
    for p in d.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _trim_debian_tree(tree: Path) -> None:
    """Drop apt's caches and package lists and /dev's device nodes; make sure /work exists."""
    cache = tree / "var/cache/apt"
    if cache.is_dir() and _inside(tree, cache):
        for p in cache.glob("*.bin"):
            if not p.is_symlink() and p.is_file():
                p.unlink()
    lists = tree / "var/lib/apt/lists"
    if lists.is_dir() and _inside(tree, lists):
        _empty_dir(lists, keep=frozenset({"partial", "lock"}))
        partial = lists / "partial"
        if partial.is_dir() and not partial.is_symlink():
            _empty_dir(partial)
    dev = tree / "dev"
    if dev.is_dir() and not dev.is_symlink():
        # mmdebstrap leaves device nodes in /dev; the runtime provides /dev, and layers carry no
        # device nodes other than overlay whiteouts
        for p in dev.iterdir():
            st = os.lstat(p)
            is_dev = stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            if is_dev and not _is_whiteout_dev(st.st_mode, st.st_rdev):
                p.unlink()
    work = tree / "work"
    if not os.path.lexists(work):
        work.mkdir()
        os.chown(work, 0, 0)
    if work.is_dir() and not work.is_symlink():
        os.chmod(work, 0o755)


def build_debian_layer(
    store: LayerStore,
    recipe: DebianRecipe,
    *,
    version: str | None = None,
    progress: Progress | None = None,
) -> Layer:
    """Build (or fetch from the build cache) the layer for ``recipe`` with mmdebstrap.

    ``version`` defaults to the first 12 hex digits of the recipe digest. A cache hit (or an
    existing layer of that name and version built from the same recipe) returns without
    running mmdebstrap."""
    key = recipe.digest()
    if version is None:
        cached = store.cache_get(key)
        if cached is not None:
            _say(progress, f"build cache hit: {cached}")
            return store.get_layer(cached)
        version = key[:12]
    ref = _make_ref(recipe.name, version)
    if store.has_layer(ref):
        existing = store.get_layer(ref)
        if existing.source.get("recipe_digest") != key:
            raise errors.Conflict(
                f"layer {ref} exists but was not built from this recipe (digest {key[:12]}); "
                "pick another version",
                layer=str(ref),
            )
        store.cache_put(key, ref)
        return existing
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise errors.InternalError("mmdebstrap is not installed on this host: apt-get install mmdebstrap")
    source = {"type": "debian", "recipe": recipe.model_dump(), "recipe_digest": key}
    with store.staging() as staging:
        tree = staging / "rootfs"
        cmd = [exe, "--mode=root", f"--variant={recipe.variant}", "--format=directory"]
        if recipe.packages:
            cmd.append("--include=" + ",".join(recipe.packages))
        cmd += [recipe.suite, str(tree), recipe.mirror]
        _say(progress, f"building {ref}: {' '.join(cmd)}")
        _run_logged(cmd, f"layer {ref}", progress)
        _trim_debian_tree(tree)
        _say(progress, f"committing {ref}")
        layer = store.commit_layer(tree, recipe.name, version, source, shift=True)
    store.cache_put(key, layer.ref)
    _say(progress, f"built {layer.ref} ({layer.digest}, {layer.size_bytes} bytes, {layer.files} files)")
    return layer


def build_recipe_image(store: LayerStore, name: str, *, progress: Progress | None = None) -> Image:
    """Build the shipped recipe ``name`` and store a one-layer image of the same name."""
    recipe = load_recipe(name)
    layer = build_debian_layer(store, recipe, progress=progress)
    image = Image(
        name=name,
        layers=[layer.ref],
        source={"type": "recipe", "recipe": name, "recipe_digest": recipe.digest()},
    )
    store.put_image(image)
    return image


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
    are turned into overlayfs ones."""

    def __init__(self, dest: Path, *, oci: bool, what: str) -> None:
        self.dest = os.fspath(dest)
        self.oci = oci
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


# --------------------------------------------------------------------------- OCI / docker archives


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class _HashingReader(io.RawIOBase):
    """Passes reads through, hashing (sha256) what went by."""

    def __init__(self, f: _Readable) -> None:
        self._f = f
        self.hash = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        n = len(data)
        memoryview(b).cast("B")[:n] = data
        self.hash.update(data)
        return n

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


class _Archive:
    """Read access to the files of an image archive (directory or tar)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def open(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        raise NotImplementedError

    def read_json(self, rel: str, limit: int = 16 << 20) -> Any:
        with self.open(rel) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise errors.InvalidRequest(f"{self.label}: {rel} is too large for a JSON document")
        try:
            return json.loads(data)
        except ValueError as e:
            raise errors.InvalidRequest(f"{self.label}: {rel} is not valid JSON ({e})") from None

    def close(self) -> None:
        return None


class _DirArchive(_Archive):
    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self.root = root.resolve()

    def _path(self, rel: str) -> Path:
        rel = _safe_relpath(rel, f"{self.label}: path")
        p = (self.root / rel).resolve()
        if not p.is_relative_to(self.root):
            raise errors.InvalidRequest(f"{self.label}: {rel!r} points outside the layout")
        return p

    def exists(self, rel: str) -> bool:
        return self._path(rel).is_file()

    def open(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        p = self._path(rel)
        if not p.is_file():
            raise errors.InvalidRequest(f"{self.label}: {rel} is missing")
        return open(p, "rb")


class _TarArchive(_Archive):
    def __init__(self, path: Path, tf: tarfile.TarFile) -> None:
        super().__init__(str(path))
        self.tf = tf
        self.members: dict[str, tarfile.TarInfo] = {}
        for m in tf.getmembers():
            with contextlib.suppress(errors.InvalidRequest):
                self.members[_safe_relpath(m.name.lstrip("/"), "member")] = m

    def exists(self, rel: str) -> bool:
        m = self.members.get(_safe_relpath(rel, f"{self.label}: path"))
        return m is not None and not m.isdir()

    def open(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        m = self.members.get(_safe_relpath(rel, f"{self.label}: path"))
        f = self.tf.extractfile(m) if m is not None else None
        if f is None:
            raise errors.InvalidRequest(f"{self.label}: {rel} is missing or not a file")
        return f

    def close(self) -> None:
        self.tf.close()


def _open_archive(path: Path) -> _Archive:
    if path.is_dir():
        return _DirArchive(path)
    if not path.is_file():
        raise errors.InvalidRequest(f"{path} does not exist; accepted: {_OCI_FORMATS}")
    try:
        tf = tarfile.open(path, mode="r:*")  # noqa: SIM115 - closed by _TarArchive.close()
        return _TarArchive(path, tf)
    except _TAR_ERRORS as e:
        raise errors.InvalidRequest(f"{path} is not a tar archive ({e}); accepted: {_OCI_FORMATS}") from None


_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_INDEX_TYPES = frozenset(
    {"application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"}
)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}


def _check_digest(value: Any, label: str) -> str:
    if not isinstance(value, str) or not _DIGEST_RE.match(value):
        raise errors.InvalidRequest(f"{label}: digest {value!r} is not a sha256:<64 hex> digest")
    return value


def _blob_path(digest: str) -> str:
    return "blobs/sha256/" + digest.split(":", 1)[1]


class _LayerSpec(BaseModel):
    path: str
    diff_id: str | None = None
    blob_digest: str | None = None
    media_type: str | None = None


class _ImageSpec(BaseModel):
    kind: str
    layers: list[_LayerSpec]
    config: dict[str, Any]
    extra: dict[str, Any] = {}


def _read_blob_json(ar: _Archive, digest: Any, label: str) -> Any:
    rel = _blob_path(_check_digest(digest, label))
    with ar.open(rel) as f:
        data = f.read(16 << 20)
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise errors.InvalidRequest(f"{ar.label}: blob {digest} does not match its digest")
    try:
        return json.loads(data)
    except ValueError as e:
        raise errors.InvalidRequest(f"{ar.label}: blob {digest} is not valid JSON ({e})") from None


def _diff_ids(config: dict[str, Any], n: int) -> list[str | None]:
    rootfs = config.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if (
        isinstance(ids, list)
        and len(ids) == n
        and all(isinstance(i, str) and _DIGEST_RE.match(i) for i in ids)
    ):
        return list(ids)
    return [None] * n


def _docker_spec(ar: _Archive, image_name: str) -> _ImageSpec:
    manifest = ar.read_json("manifest.json")
    if not isinstance(manifest, list) or not manifest or not all(isinstance(e, dict) for e in manifest):
        raise errors.InvalidRequest(
            f"{ar.label}: manifest.json is not a docker save manifest; accepted: {_OCI_FORMATS}"
        )
    entry = manifest[0]
    if len(manifest) > 1:
        wanted = {image_name, f"{image_name}:latest"}
        matches = [e for e in manifest if wanted & set(e.get("RepoTags") or [])]
        if len(matches) != 1:
            tags = [t for e in manifest for t in (e.get("RepoTags") or [])]
            raise errors.InvalidRequest(
                f"{ar.label} holds {len(manifest)} images; import it under one of their tags: "
                + ", ".join(tags)
            )
        entry = matches[0]
    layers = entry.get("Layers")
    cfg_path = entry.get("Config")
    if (
        not isinstance(layers, list)
        or not all(isinstance(p, str) for p in layers)
        or not isinstance(cfg_path, str)
    ):
        raise errors.InvalidRequest(
            f"{ar.label}: manifest.json lacks Config or Layers; accepted: {_OCI_FORMATS}"
        )
    config = ar.read_json(cfg_path)
    if not isinstance(config, dict):
        raise errors.InvalidRequest(f"{ar.label}: {cfg_path} is not an image config")
    ids = _diff_ids(config, len(layers))
    specs = []
    for p, d in zip(layers, ids, strict=True):
        m = re.match(r"^blobs/sha256/([0-9a-f]{64})$", p)
        specs.append(_LayerSpec(path=p, diff_id=d, blob_digest=f"sha256:{m.group(1)}" if m else None))
    return _ImageSpec(
        kind="docker-archive", layers=specs, config=config, extra={"repo_tags": entry.get("RepoTags") or []}
    )


def _pick_descriptor(ar: _Archive, descs: Any, image_name: str) -> dict[str, Any]:
    if not isinstance(descs, list) or not descs or not all(isinstance(d, dict) for d in descs):
        raise errors.InvalidRequest(f"{ar.label}: the image index lists no manifests")
    if len(descs) == 1:
        return dict(descs[0])
    by_name = [
        d
        for d in descs
        if (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") in (image_name, "latest")
        or (d.get("annotations") or {}).get("io.containerd.image.name", "").endswith(f"/{image_name}:latest")
    ]
    if len(by_name) == 1:
        return dict(by_name[0])
    arch = _ARCH.get(platform.machine(), platform.machine())
    by_arch = [
        d
        for d in descs
        if (d.get("platform") or {}).get("os") == "linux"
        and (d.get("platform") or {}).get("architecture") == arch
    ]
    if by_arch:
        return dict(by_arch[0])
    raise errors.InvalidRequest(
        f"{ar.label} holds {len(descs)} manifests and none is for linux/{arch} or named {image_name!r}"
    )


def _oci_spec(ar: _Archive, image_name: str) -> _ImageSpec:
    index = ar.read_json("index.json")
    if not isinstance(index, dict):
        raise errors.InvalidRequest(f"{ar.label}: index.json is not an OCI image index")
    descs = index.get("manifests")
    manifest: Any = None
    for _ in range(4):  # an index may point at a (multi-platform) index
        desc = _pick_descriptor(ar, descs, image_name)
        blob = _read_blob_json(ar, desc.get("digest"), f"{ar.label}: manifest")
        if not isinstance(blob, dict):
            raise errors.InvalidRequest(f"{ar.label}: manifest {desc.get('digest')} is not a JSON object")
        if (
            desc.get("mediaType") in _INDEX_TYPES
            or blob.get("mediaType") in _INDEX_TYPES
            or ("manifests" in blob and "layers" not in blob)
        ):
            descs = blob.get("manifests")
            continue
        manifest = blob
        break
    if manifest is None:
        raise errors.InvalidRequest(f"{ar.label}: image indexes nest too deeply")
    layers = manifest.get("layers")
    cfg_desc = manifest.get("config")
    if not isinstance(layers, list) or not isinstance(cfg_desc, dict):
        raise errors.InvalidRequest(f"{ar.label}: the image manifest lacks config or layers")
    config = _read_blob_json(ar, cfg_desc.get("digest"), f"{ar.label}: config")
    if not isinstance(config, dict):
        raise errors.InvalidRequest(f"{ar.label}: the image config is not a JSON object")
    ids = _diff_ids(config, len(layers))
    specs = []
    for ld, diff_id in zip(layers, ids, strict=True):
        if not isinstance(ld, dict):
            raise errors.InvalidRequest(f"{ar.label}: a layer descriptor is not a JSON object")
        digest = _check_digest(ld.get("digest"), f"{ar.label}: layer")
        specs.append(
            _LayerSpec(
                path=_blob_path(digest), diff_id=diff_id, blob_digest=digest, media_type=ld.get("mediaType")
            )
        )
    return _ImageSpec(kind="oci-layout", layers=specs, config=config)


def _image_spec(ar: _Archive, image_name: str) -> _ImageSpec:
    if ar.exists("manifest.json"):
        return _docker_spec(ar, image_name)
    if ar.exists("oci-layout") and ar.exists("index.json"):
        return _oci_spec(ar, image_name)
    raise errors.InvalidRequest(f"{ar.label} is not an image archive; accepted: {_OCI_FORMATS}")


def _oci_ref(digest: str) -> LayerRef:
    return LayerRef(name="oci-" + digest.split(":", 1)[1][:12], version="1")


def _import_oci_layer(store: LayerStore, ar: _Archive, spec: _LayerSpec) -> tuple[Layer, bool]:
    """One OCI layer blob -> one dsec layer; returns (layer, created)."""
    known = spec.diff_id or spec.blob_digest
    if known is not None and store.has_layer(_oci_ref(known)):
        return store.get_layer(_oci_ref(known)), False
    with ar.open(spec.path) as f:
        magic = f.read(4)
    if magic == _ZSTD_MAGIC or (spec.media_type or "").endswith("zstd"):
        raise errors.InvalidRequest(
            f"{ar.label}: layer {spec.path} is zstd-compressed; re-export the image with gzip or "
            "uncompressed layers"
        )
    what = f"{ar.label}: layer {spec.path}"
    with store.staging() as staging, ar.open(spec.path) as raw:
        tree = staging / "tree"
        tree.mkdir()
        raw_h = _HashingReader(raw)
        raw_buf = io.BufferedReader(raw_h, _CHUNK)
        unc_src: _Readable = (
            gzip.GzipFile(fileobj=raw_buf, mode="rb") if magic[:2] == _GZIP_MAGIC else raw_buf
        )
        unc_h = _HashingReader(unc_src)
        ex = _Extractor(tree, oci=True, what=what)
        try:
            with tarfile.open(fileobj=io.BufferedReader(unc_h, _CHUNK), mode="r|", bufsize=_CHUNK) as tf:
                ex.run(tf)
            unc_h.drain()
            raw_h.drain()
        except _TAR_ERRORS as e:
            raise errors.InvalidRequest(f"{what} is not a readable tar or tar+gzip layer ({e})") from None
        diff_id = "sha256:" + unc_h.hash.hexdigest()
        if spec.diff_id is not None and spec.diff_id != diff_id:
            raise errors.InvalidRequest(
                f"{what}: content digest {diff_id} does not match the config's {spec.diff_id}"
            )
        blob = "sha256:" + raw_h.hash.hexdigest()
        if spec.blob_digest is not None and spec.blob_digest != blob:
            raise errors.InvalidRequest(f"{what}: blob digest {blob} does not match {spec.blob_digest}")
        ref = _oci_ref(known or diff_id)
        if store.has_layer(ref):
            return store.get_layer(ref), False
        source = {"type": "oci-layer", "diff_id": diff_id, "blob_digest": blob, **ex.report()}
        return store.commit_layer(tree, ref.name, ref.version, source, shift=True), True


def _runtime_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("config")
    if not isinstance(inner, dict):
        return {}
    keys = ("Env", "Cmd", "Entrypoint", "WorkingDir", "User")
    return {k: inner[k] for k in keys if inner.get(k) is not None}


def import_oci_archive(
    store: LayerStore, image_name: str, archive: Path, *, progress: Progress | None = None
) -> Image:
    """Import a docker-save tar, an OCI image layout directory or a tar of one as ``image_name``.

    Each image layer becomes the dsec layer ``oci-<first 12 hex of its digest>@1`` (the
    uncompressed diff_id when the config gives it, else the blob digest), so layers shared
    between images are stored once. OCI whiteouts become overlayfs whiteouts. The returned
    image's ``source`` says which layers were created and which were already present."""
    try:
        Image(name=image_name, layers=[])
    except ValidationError as e:
        raise errors.InvalidRequest(f"image name {image_name!r} is invalid: {e.errors()[0]['msg']}") from None
    archive = Path(archive)
    ar = _open_archive(archive)
    try:
        spec = _image_spec(ar, image_name)
        if not spec.layers:
            raise errors.InvalidRequest(f"{ar.label}: the image has no layers")
        refs: list[LayerRef] = []
        created: list[str] = []
        reused: list[str] = []
        for i, ls in enumerate(spec.layers):
            _say(progress, f"layer {i + 1}/{len(spec.layers)}: {ls.path}")
            layer, new = _import_oci_layer(store, ar, ls)
            (created if new else reused).append(str(layer.ref))
            _say(progress, f"{'created' if new else 'reused'} layer {layer.ref} ({layer.digest})")
            refs.append(layer.ref)
    finally:
        ar.close()
    # a layer listed twice: only its topmost copy matters (it re-adds all the lower one adds)
    top_first: list[LayerRef] = []
    for ref in reversed(refs):
        if ref not in top_first:
            top_first.append(ref)
    image = Image(
        name=image_name,
        layers=list(reversed(top_first)),
        source={
            "type": spec.kind,
            "archive": str(archive.absolute()),
            "created_layers": created,
            "reused_layers": reused,
            "config": _runtime_config(spec.config),
            **spec.extra,
        },
    )
    store.put_image(image)
    _say(progress, f"image {image_name}: {', '.join(str(r) for r in image.layers)}")
    return image
