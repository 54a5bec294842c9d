"""The layer store: immutable, versioned filesystem layers and the images made of them.

On disk, under ``root``::

    layers/<name>/<version>/tree         the layer's filesystem tree (an overlayfs lowerdir)
    layers/<name>/<version>/layer.json   its metadata (:class:`Layer`)
    images/<name>.json                   an image: its layer refs in order, its config (:class:`Image`)
    staging/                             scratch space for layers being built (same filesystem)
    cache/<key>.json                     build cache: recipe digest -> layer ref

Trees are stored with ownership *shifted* by ``uid_offset`` (container uid N is host uid
``uid_offset + N``), the canonical range, which no sandbox runs as: each sandbox sees them
through idmapped mounts as owned by its own range (isolation/idranges.py). The content
digest of a layer is independent of that shift: it hashes the container-side ids.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from dsec import errors
from dsec.models.images import ImageConfig

ID_RANGE = 65536
"""How many uids/gids a container's user namespace maps."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
# An image name; `<project>/<name>`: a project's own (seen and used by its members only).
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_IMAGE_RE = re.compile(r"^(?:[a-z0-9][a-z0-9-]{0,62}/)?[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
_CHUNK = 1 << 20
_SKIP_XATTRS = frozenset({"security.selinux"})
_CAPS_XATTR = "security.capability"


def _check_name(kind: str, value: str, pattern: re.Pattern[str] = _NAME_RE) -> str:
    if value in (".", "..") or not pattern.match(value):
        raise ValueError(
            f"{kind} {value!r} is invalid: use 1-128 characters from letters, digits and '._+-', "
            "starting with a letter or digit"
        )
    return value


class LayerRef(BaseModel, frozen=True):
    """A layer's identity: ``name@version``."""

    name: str
    version: str

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return _check_name("layer name", v)

    @field_validator("version")
    @classmethod
    def _valid_version(cls, v: str) -> str:
        return _check_name("layer version", v)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> LayerRef:
        """Parse ``"name@version"``; raises :class:`errors.InvalidRequest` when malformed."""
        name, sep, version = text.partition("@")
        if not sep or not name or not version:
            raise errors.InvalidRequest(f"layer reference {text!r} is invalid: write it as name@version")
        try:
            return cls(name=name, version=version)
        except ValidationError as e:
            raise errors.InvalidRequest(f"layer reference {text!r} is invalid: {_first_error(e)}") from None


class Layer(BaseModel):
    """Metadata of a committed layer (``layer.json``)."""

    name: str
    version: str
    digest: str = Field(description="sha256:<hex> over the tree's canonical walk, shift-independent")
    size_bytes: int = Field(description="bytes of regular-file content (hard links counted once)")
    files: int = Field(description="entries in the tree (files, directories, links...), root excluded")
    created_at: float
    source: dict[str, Any] = Field(default_factory=dict)

    @property
    def ref(self) -> LayerRef:
        return LayerRef(name=self.name, version=self.version)


class Image(BaseModel):
    """An image: layers bottom first (base, then workspace layers, then toolkit layers)."""

    name: str
    layers: list[LayerRef]
    created_at: float = Field(default_factory=time.time)
    source: dict[str, Any] = Field(default_factory=dict)
    # What its sandboxes get by default (an OCI image's ENV, WORKDIR, USER...); empty for a
    # recipe's image and for one stored before images kept it.
    config: ImageConfig = Field(default_factory=ImageConfig)
    # What it is, whatever its name: sha256 over its layers' tree digests and its config (set
    # when stored; `name@<digest>` keeps naming this content after the name is given to another).
    digest: str | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return _check_name("image name", v, _IMAGE_RE)

    def usable_by(self, project: str) -> bool:
        """A snapshot, or an image named `<project>/...`, belongs to its project; any other
        image, and the platform's own projects (``_``-prefixed: pools, fncall workers), are
        usable by all."""
        owner = self.source.get("project") or (self.name.split("/")[0] if "/" in self.name else None)
        return owner is None or owner == project or project.startswith("_")


def _first_error(e: ValidationError) -> str:
    errs = e.errors()
    return str(errs[0]["msg"]) if errs else str(e)


def _as_ref(ref: LayerRef | str) -> LayerRef:
    return ref if isinstance(ref, LayerRef) else LayerRef.parse(ref)


def _make_ref(name: str, version: str) -> LayerRef:
    try:
        return LayerRef(name=name, version=version)
    except ValidationError as e:
        raise errors.InvalidRequest(f"layer {name}@{version} is invalid: {_first_error(e)}") from None


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o755)


# --------------------------------------------------------------------------- tree walking


def _sorted_entries(path: bytes) -> list[os.DirEntry[bytes]]:
    with os.scandir(path) as it:
        entries = list(it)
    entries.sort(key=lambda e: e.name)
    return entries


def _walk(root: Path) -> Iterator[tuple[bytes, bytes, os.stat_result]]:
    """Yield ``(relative path, full path, lstat)`` in a canonical order: the root first (relative
    path ``b"."``), then each directory's entries sorted bytewise by name, followed by its
    subdirectories' contents, depth first."""
    broot = os.fsencode(root)
    st = os.lstat(broot)
    yield b".", broot, st
    if not stat.S_ISDIR(st.st_mode):
        return
    stack: list[tuple[bytes, bytes]] = [(b"", broot)]
    while stack:
        rel_dir, full_dir = stack.pop()
        subdirs: list[tuple[bytes, bytes]] = []
        for entry in _sorted_entries(full_dir):
            rel = rel_dir + entry.name
            est = entry.stat(follow_symlinks=False)
            yield rel, entry.path, est
            if stat.S_ISDIR(est.st_mode):
                subdirs.append((rel + b"/", entry.path))
        stack.extend(reversed(subdirs))


def _xattrs(path: bytes) -> list[tuple[str, bytes]]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    out: list[tuple[str, bytes]] = []
    for n in sorted(names):
        if n in _SKIP_XATTRS:
            continue
        try:
            out.append((n, os.getxattr(path, n, follow_symlinks=False)))
        except OSError:
            continue
    return out


def _file_sha256(path: bytes, buf: memoryview) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0, closefd=True) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(buf[:n])
    return h.hexdigest()


def tree_digest(root: Path, id_offset: int = 0) -> tuple[str, int, int]:
    """Content digest of a tree: ``("sha256:<hex>", size_bytes, files)``.

    Hashes, per entry in canonical order: relative path, type, permission bits, uid and gid
    minus ``id_offset`` (so a shifted and an unshifted copy hash alike), size, sha256 of the
    content, symlink target, device numbers and extended attributes. Modification times are
    not hashed, so re-importing the same content gives the same digest.
    """
    h = hashlib.sha256(b"dsec-layer-digest-v1\n")
    buf = memoryview(bytearray(_CHUNK))
    by_inode: dict[tuple[int, int], str] = {}
    size = 0
    files = 0
    for rel, full, st in _walk(root):
        mode = st.st_mode
        fmt = stat.S_IFMT(mode)
        content = b""
        target = b""
        rdev = ""
        fsize = 0
        if fmt == stat.S_IFREG:
            key = (st.st_dev, st.st_ino)
            digest = by_inode.get(key)
            if digest is None:
                digest = _file_sha256(full, buf)
                by_inode[key] = digest
                size += st.st_size
            content = digest.encode()
            fsize = st.st_size
        elif fmt == stat.S_IFLNK:
            target = os.readlink(full)
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
            rdev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        if rel != b".":
            files += 1
        xattrs = b"".join(n.encode() + b"=" + v.hex().encode() + b";" for n, v in _xattrs(full))
        head = f"{fmt >> 12:o}\0{stat.S_IMODE(mode):o}\0{st.st_uid - id_offset}\0{st.st_gid - id_offset}"
        h.update(
            b"%d:%s\0%s\0%d\0%s\0%d:%s\0%s\0%s\n"
            % (len(rel), rel, head.encode(), fsize, content, len(target), target, rdev.encode(), xattrs)
        )
    return "sha256:" + h.hexdigest(), size, files


def shift_tree(root: Path, offset: int) -> None:
    """Add ``offset`` to the uid and gid of every entry of ``root`` (the root included).

    ``chown`` clears setuid/setgid bits and file capabilities, so both are put back. Entries
    whose ids are outside the container's range (``0..65535``) are refused.
    """
    seen: set[tuple[int, int]] = set()
    for rel, full, st in _walk(root):
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
        if not (0 <= st.st_uid < ID_RANGE and 0 <= st.st_gid < ID_RANGE):
            raise errors.InvalidRequest(
                f"{os.fsdecode(rel)!r} is owned by {st.st_uid}:{st.st_gid}, outside the container's "
                f"id range 0-{ID_RANGE - 1}; fix its ownership before importing"
            )
        is_link = stat.S_ISLNK(st.st_mode)
        caps: bytes | None = None
        if stat.S_ISREG(st.st_mode):
            try:
                caps = os.getxattr(full, _CAPS_XATTR, follow_symlinks=False)
            except OSError:
                caps = None
        os.chown(full, st.st_uid + offset, st.st_gid + offset, follow_symlinks=False)
        if not is_link and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(full, stat.S_IMODE(st.st_mode))
        if caps is not None:
            with contextlib.suppress(OSError):
                os.setxattr(full, _CAPS_XATTR, caps, follow_symlinks=False)


def remove_tree(path: Path) -> None:
    """Remove a tree (a layer moved out by `LayerStore.delete_layer(trash=)`)."""
    _rmtree(path)


def _rmtree(path: Path) -> None:
    if path.is_symlink() or not path.exists():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    shutil.rmtree(path)


# --------------------------------------------------------------------------- the store


class LayerStore:
    """Immutable, versioned layers and the images stacked from them."""

    def __init__(self, root: Path, uid_offset: int = 100000) -> None:
        if uid_offset < 0:
            raise errors.InvalidRequest(f"uid_offset must be >= 0, got {uid_offset}")
        self.root = Path(root).absolute()
        self.uid_offset = uid_offset
        self._old_digests: dict[tuple[str, tuple[str, ...], str], str] = {}  # see _with_digest
        for sub in ("layers", "images", "staging", "cache"):
            _mkdir(self.root / sub)
        # Root's only at the top: layer trees are owned by sandbox ids (shifted), and a file
        # a sandbox made setuid must not be reachable by any host user. Overlay lower
        # directories are looked up by the mounter (root), so sandboxes need no path here.
        if os.geteuid() == 0:
            os.chmod(self.root, 0o700)

    # ---- layers

    def _layer_dir(self, ref: LayerRef) -> Path:
        return self.root / "layers" / ref.name / ref.version

    def layer_path(self, ref: LayerRef | str) -> Path:
        """The layer's filesystem tree, to be used as an overlayfs lowerdir."""
        return self._layer_dir(_as_ref(ref)) / "tree"

    def _read_layer(self, ref: LayerRef) -> Layer | None:
        try:
            data = (self._layer_dir(ref) / "layer.json").read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Layer.model_validate_json(data)
        except ValidationError as e:
            raise errors.InternalError(f"layer {ref} has a corrupt layer.json: {_first_error(e)}") from None

    def has_image(self, name: str) -> bool:
        try:
            self.get_image(name)
        except errors.DsecError:
            return False
        return True

    def has_layer(self, ref: LayerRef | str) -> bool:
        return (self._layer_dir(_as_ref(ref)) / "layer.json").is_file()

    def get_layer(self, ref: LayerRef | str) -> Layer:
        ref = _as_ref(ref)
        layer = self._read_layer(ref)
        if layer is None:
            raise self._layer_not_found(ref)
        return layer

    def _layer_not_found(self, ref: LayerRef) -> errors.LayerNotFound:
        versions = self._versions(ref.name)
        have = f"; versions of {ref.name!r} in the store: {', '.join(versions)}" if versions else ""
        return errors.LayerNotFound(
            f"layer {ref} is not in the layer store at {self.root}{have}. Build it from a recipe "
            "(dsec.layers.build_debian_layer) or import it from a directory, a tarball or an "
            "OCI/docker archive (dsec.layers.import_dir_layer / import_tarball_layer / import_oci_archive)",
            layer=str(ref),
        )

    def _versions(self, name: str) -> list[str]:
        d = self.root / "layers" / name
        if not _NAME_RE.match(name) or not d.is_dir():
            return []
        return sorted(v.name for v in d.iterdir() if (v / "layer.json").is_file())

    def list_layers(self) -> list[Layer]:
        out: list[Layer] = []
        base = self.root / "layers"
        for name_dir in sorted(base.iterdir()):
            if not name_dir.is_dir() or not _NAME_RE.match(name_dir.name):
                continue
            for v in sorted(name_dir.iterdir()):
                if not _NAME_RE.match(v.name):
                    continue
                layer = self._read_layer(LayerRef(name=name_dir.name, version=v.name))
                if layer is not None:
                    out.append(layer)
        return out

    def delete_layer(self, ref: LayerRef | str, *, trash: list[Path] | None = None) -> None:
        """Delete a layer; refused (:class:`errors.Conflict`) while an image references it.
        ``trash``: the layer is only moved out of the store (at once) and its directory
        appended there, for the caller to remove (off an event loop)."""
        ref = _as_ref(ref)
        if not self.has_layer(ref):
            raise self._layer_not_found(ref)
        users = [img.name for img in self.list_images() if ref in img.layers]
        if users:
            raise errors.Conflict(
                f"layer {ref} is used by image(s) {', '.join(users)}; delete those images first",
                images=users,
            )
        layer_dir = self._layer_dir(ref)
        bin_ = Path(tempfile.mkdtemp(prefix="delete-", dir=self.root / "staging"))
        os.rename(layer_dir, bin_ / "layer")
        if trash is not None:
            trash.append(bin_)
        else:
            _rmtree(bin_)
        with contextlib.suppress(OSError):
            layer_dir.parent.rmdir()  # only succeeds when no other version is left

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh, empty directory on the store's filesystem, removed on exit unless committed."""
        path = Path(tempfile.mkdtemp(prefix="stage-", dir=self.root / "staging"))
        os.chmod(path, 0o755)
        try:
            yield path
        finally:
            if os.path.lexists(path):
                _rmtree(path)

    def commit_layer(
        self,
        staging_dir: Path,
        name: str,
        version: str,
        source: dict[str, Any],
        *,
        shift: bool,
        expect_digest: str | None = None,
    ) -> Layer:
        """Move ``staging_dir`` (the layer's tree) into the store as ``name@version``.

        ``shift=True`` means the tree carries container-side ids (as from mmdebstrap or a
        tarball) and the uid/gid offset is applied to every entry; ``shift=False`` means it is
        already shifted. Layers are immutable: committing an existing ``name@version`` returns
        it when the digest matches and raises :class:`errors.Conflict` otherwise.
        ``expect_digest``: the digest the tree must have (a layer pulled from elsewhere); any
        other is :class:`errors.LayerCorrupted` and nothing is committed.
        """
        ref = _make_ref(name, version)
        staging_dir = Path(staging_dir).absolute()
        if staging_dir.is_symlink() or not staging_dir.is_dir():
            raise errors.InvalidRequest(f"cannot commit {staging_dir}: not a directory")
        digest, size, files = tree_digest(staging_dir, 0 if shift else self.uid_offset)
        if expect_digest is not None and digest != expect_digest:
            raise errors.LayerCorrupted(
                f"layer {ref} is corrupted: its tree hashes to {digest}, expected {expect_digest}; "
                "nothing was committed",
                layer=str(ref),
            )
        existing = self._read_layer(ref)
        if existing is not None:
            return self._same_or_conflict(existing, digest)
        if shift:
            shift_tree(staging_dir, self.uid_offset)
        layer = Layer(
            name=ref.name,
            version=ref.version,
            digest=digest,
            size_bytes=size,
            files=files,
            created_at=time.time(),
            source=source,
        )
        wrapper = Path(tempfile.mkdtemp(prefix="commit-", dir=self.root / "staging"))
        try:
            os.chmod(wrapper, 0o755)
            try:
                os.rename(staging_dir, wrapper / "tree")
            except OSError as e:
                if e.errno == errno.EXDEV:
                    raise errors.InvalidRequest(
                        f"cannot commit {staging_dir}: it must be on the store's filesystem "
                        "(use LayerStore.staging())"
                    ) from None
                raise
            _atomic_write(wrapper / "layer.json", layer.model_dump_json(indent=2).encode())
            final = self._layer_dir(ref)
            _mkdir(final.parent)
            try:
                os.rename(wrapper, final)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # lost a race against a concurrent commit of the same name@version
                other = self._read_layer(ref)
                if other is None:
                    raise errors.InternalError(f"layer {ref} is half-written in {final}") from None
                return self._same_or_conflict(other, digest)
        finally:
            if os.path.lexists(wrapper):
                _rmtree(wrapper)
        return layer

    def blob_of(self, ref: LayerRef | str) -> tuple[str, int] | None:
        """The registry blob (digest, size) that holds this layer, once pushed or pulled."""
        try:
            data = json.loads((self._layer_dir(_as_ref(ref)) / "blob.json").read_bytes())
            return str(data["digest"]), int(data["size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def record_blob(self, ref: LayerRef | str, digest: str, size: int) -> None:
        d = self._layer_dir(_as_ref(ref))
        if d.is_dir():
            _atomic_write(d / "blob.json", json.dumps({"digest": digest, "size": size}).encode())

    @staticmethod
    def _same_or_conflict(existing: Layer, digest: str) -> Layer:
        if existing.digest == digest:
            return existing
        raise errors.Conflict(
            f"layer {existing.ref} already exists with digest {existing.digest} and layers are "
            f"immutable; this content has digest {digest}: commit it under a new version",
            layer=str(existing.ref),
        )

    # ---- images

    def _image_file(self, name: str) -> Path:
        """The file of image `name`, or of `name@sha256:<hex>` (a pin: what the name was when
        it had that digest, kept after the name is given to other content)."""
        name, _, digest = name.partition("@")
        try:
            _check_name("image name", name, _IMAGE_RE)
        except ValueError as e:
            raise errors.InvalidRequest(str(e)) from None
        enc = name.replace("/", "%")  # ('%' is in no name)
        if not digest:
            return self.root / "images" / f"{enc}.json"
        if not _DIGEST_RE.match(digest):
            raise errors.InvalidRequest(f"{digest[:80]!r} is not an image digest: sha256:<64 hex digits>")
        return self.root / "images" / "pinned" / f"{enc}@{digest[7:]}.json"

    def image_digest(self, image: Image) -> str:
        """sha256 over the image's layers (their tree digests, bottom first) and its config."""
        doc = {
            "layers": [self.get_layer(r).digest for r in image.layers],
            "config": image.config.model_dump(mode="json"),
        }
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    def get_image(self, name: str) -> Image:
        path = self._image_file(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            names = [i.name for i in self.list_images()]
            have = ", ".join(names) if names else "none"
            raise errors.ImageNotFound(
                f"image {name!r} is not in the layer store; available images: {have}",
                image=name,
                available=names,
            ) from None
        try:
            return self._with_digest(Image.model_validate_json(data))
        except ValidationError as e:
            why = _first_error(e)
            raise errors.InternalError(f"image {name!r} has a corrupt file {path}: {why}") from None

    def _with_digest(self, image: Image) -> Image:
        """An image stored before images had digests gets its digest (not written back: a
        write could race a newer image of that name), computed once per process: creates and
        status reads call this, and the layers' files are not read each time."""
        if image.digest is None:
            key = (image.name, tuple(str(r) for r in image.layers), image.config.model_dump_json())
            image.digest = self._old_digests.get(key)
            if image.digest is None:
                with contextlib.suppress(errors.DsecError):
                    image.digest = self._old_digests[key] = self.image_digest(image)
        return image

    def put_image(self, image: Image) -> None:
        """Store ``image`` (replacing one of the same name); all its layers must exist."""
        path = self._image_file(image.name)
        if not image.layers:
            raise errors.InvalidRequest(f"image {image.name!r} has no layers")
        for ref in image.layers:
            if not self.has_layer(ref):
                raise self._layer_not_found(ref)
        image.digest = self.image_digest(image)
        data = image.model_dump_json(indent=2).encode()
        _mkdir(self.root / "images" / "pinned")
        _atomic_write(self._image_file(f"{image.name}@{image.digest}"), data)  # (before the name)
        _atomic_write(path, data)

    def list_images(self) -> list[Image]:
        out: list[Image] = []
        for p in sorted((self.root / "images").glob("*.json")):
            if p.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError, ValidationError):
                out.append(self._with_digest(Image.model_validate_json(p.read_bytes())))
        return out

    def pinned_names(self) -> list[str]:
        """Every `name@sha256:<hex>` the store can give (an image's content when it had that
        digest: the current ones and those since renamed)."""
        out = []
        for p in sorted((self.root / "images" / "pinned").glob("*@*.json")):
            enc, _, hexdigest = p.name.removesuffix(".json").rpartition("@")
            out.append(f"{enc.replace('%', '/')}@sha256:{hexdigest}")
        return out

    def delete_image(self, name: str) -> None:
        """Remove the name and every pin of it (their layers stay until pruned)."""
        path = self._image_file(name)
        if not path.exists():
            self.get_image(name)  # raises ImageNotFound with the available names
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if "@" not in name:
            for pin in (self.root / "images" / "pinned").glob(
                f"{glob.escape(name.replace('/', '%'))}@*.json"
            ):
                pin.unlink(missing_ok=True)

    def lowerdirs(self, image: Image) -> list[Path]:
        """The image's layer trees in overlayfs ``lowerdir=`` order: TOP layer first."""
        out: list[Path] = []
        for ref in reversed(image.layers):
            if not self.has_layer(ref):
                raise self._layer_not_found(ref)
            out.append(self.layer_path(ref))
        return out

    # ---- build cache

    def _cache_file(self, key: str) -> Path:
        if not _KEY_RE.match(key):
            raise errors.InvalidRequest(f"cache key {key!r} is invalid: use letters, digits and '._:-'")
        return self.root / "cache" / f"{key}.json"

    def cache_get(self, key: str) -> LayerRef | None:
        """The layer built from recipe digest ``key``, or None (also when it was deleted)."""
        path = self._cache_file(key)
        try:
            ref = LayerRef.model_validate_json(path.read_bytes())
        except (FileNotFoundError, ValidationError):
            return None
        return ref if self.has_layer(ref) else None

    def cache_put(self, key: str, ref: LayerRef) -> None:
        _atomic_write(self._cache_file(key), ref.model_dump_json().encode())
