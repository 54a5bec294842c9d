"""OCI image layouts and docker-save archives imported as images, each layer verified by digest."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import platform
import re
import tarfile
from pathlib import Path
from typing import IO, Any, Protocol

from pydantic import BaseModel, ValidationError

from dsec import errors
from dsec.layers.builders.common import _CHUNK, _GZIP_MAGIC, _OCI_FORMATS, _ZSTD_MAGIC, Progress, _say
from dsec.layers.builders.tar import _TAR_ERRORS, _Extractor, _safe_relpath
from dsec.layers.store import Image, Layer, LayerRef, LayerStore
from dsec.models.images import ImageConfig

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


def import_oci_archive(
    store: LayerStore, image_name: str, archive: Path, *, progress: Progress | None = None
) -> Image:
    """Import a docker-save tar, an OCI image layout directory or a tar of one as ``image_name``.

    Each image layer becomes the dsec layer ``oci-<first 12 hex of its digest>@1`` (the
    uncompressed diff_id when the config gives it, else the blob digest), so layers shared
    between images are stored once. OCI whiteouts become overlayfs whiteouts. The image keeps
    its config (ENV, WORKDIR, USER, ENTRYPOINT/CMD, exposed ports, labels: :class:`ImageConfig`),
    refused when malformed or over its bounds before any layer is read. The returned
    image's ``source`` says which layers were created and which were already present."""
    try:
        Image(name=image_name, layers=[])
    except ValidationError as e:
        raise errors.InvalidRequest(f"image name {image_name!r} is invalid: {e.errors()[0]['msg']}") from None
    archive = Path(archive)
    ar = _open_archive(archive)
    try:
        spec = _image_spec(ar, image_name)
        config = ImageConfig.from_oci(spec.config, ar.label)  # refused before any layer is read
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
            **spec.extra,
        },
        config=config,
    )
    store.put_image(image)
    _say(progress, f"image {image_name}: {', '.join(str(r) for r in image.layers)}")
    return image
