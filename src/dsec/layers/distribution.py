"""Layers through an OCI registry (the distribution API, v2).

A dsec layer travels as one blob: a tar of its tree as the store holds it (owners in the
canonical range, xattrs, overlay whiteouts, holes), the archive `EdgeState.export_layer`
also writes; the blob's sha256 is its digest. An image travels as an OCI image manifest
(`application/vnd.oci.image.manifest.v1+json`) in one repository, tagged with the image's
name: its config blob is the dsec `Image` (JSON: name, layer refs, source), and each layer
descriptor carries the layer's ref and its tree digest (`tree_digest`) as annotations. A
puller checks both: the blob's sha256 while it streams, the unpacked tree's digest before
anything is committed.

The registry's URL names the repository in its path: ``http://host:5000/dsec`` is
repository ``dsec`` on ``http://host:5000`` (``dsec`` when there is no path). Tags are the
image names where they are valid tags; other names get a readable tag with a hash suffix.

Which blob holds a layer is recorded beside it in the store (`blob.json`), from a push or a
pull, so a layer already in the registry is not uploaded again (an archive is not
byte-for-byte reproducible, its digest is what was pushed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from dsec import errors
from dsec.layers.store import Image, LayerRef, LayerStore

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.dsec.image.config.v1+json"
LAYER_TYPE = "application/vnd.dsec.layer.v1.tar"
ANN_REF = "org.dsec.layer.ref"
ANN_TREE = "org.dsec.layer.tree-digest"
ANN_IMAGE = "org.dsec.image.name"
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHUNK = 1 << 20
_TAR = ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner"]


def split_url(url: str) -> tuple[str, str]:
    """``http://host:port/repo`` -> (``http://host:port``, ``repo``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise errors.InvalidRequest(
            f"registry URL {url!r} is invalid: write it as http(s)://host:port[/repository]"
        )
    repo = parts.path.strip("/") or "dsec"
    if not _REPO_RE.match(repo):
        raise errors.InvalidRequest(
            f"repository {repo!r} in registry URL {url!r} is invalid: lowercase letters, digits and "
            "separators ('.', '_', '-', '/')"
        )
    return f"{parts.scheme}://{parts.netloc}", repo


def image_tag(name: str) -> str:
    """The tag an image is stored under: its name where that is a valid tag."""
    if _TAG_RE.match(name):
        return name
    readable = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip(".-")[:100] or "image"
    return f"{readable}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a pulled manifest."""

    ref: LayerRef
    tree_digest: str
    blob: str
    size: int


@dataclass(frozen=True)
class Pulled:
    """An image's manifest as read from a registry."""

    image: Image
    layers: list[LayerEntry]
    digest: str  # the manifest's


class RegistryClient:
    """The distribution API over httpx (async). `counts` tallies requests by kind
    (``"GET blob"``, ``"PUT manifest"``...), which the tests read."""

    def __init__(self, url: str, *, timeout: float = 600.0, auth: tuple[str, str] | None = None) -> None:
        self.url = url
        self.base, self.repo = split_url(url)
        self.http = httpx.AsyncClient(
            base_url=self.base, timeout=httpx.Timeout(timeout, connect=10.0), auth=auth
        )
        self.counts: Counter[str] = Counter()

    async def aclose(self) -> None:
        await self.http.aclose()

    def _where(self) -> str:
        return f"registry {self.base} repository {self.repo}"

    async def _send(self, kind: str, method: str, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        self.counts[kind] += 1
        try:
            return await self.http.request(method, url, **kw)
        except httpx.HTTPError as e:
            raise errors.Unavailable(f"{self._where()} cannot be reached ({method} {url}): {e}") from None

    def _fail(self, what: str, r: httpx.Response) -> errors.DsecError:
        detail = r.text[:300]
        if r.status_code in (401, 403):
            return errors.Unavailable(f"{self._where()} refused {what} ({r.status_code}): {detail}")
        return errors.Unavailable(f"{self._where()} failed {what} (HTTP {r.status_code}): {detail}")

    # ---- blobs

    async def has_blob(self, digest: str) -> bool:
        r = await self._send("HEAD blob", "HEAD", f"/v2/{self.repo}/blobs/{digest}")
        if r.status_code == 404:
            return False
        if r.status_code != 200:
            raise self._fail(f"HEAD of blob {digest}", r)
        return True

    async def push_blob(self, path: Path, digest: str, size: int) -> None:
        """Upload `path` (whose sha256 is `digest`) unless the repository has it: POST an upload,
        then one monolithic PUT ?digest= streaming the file."""
        if await self.has_blob(digest):
            return
        r = await self._send("POST upload", "POST", f"/v2/{self.repo}/blobs/uploads/")
        if r.status_code != 202 or "location" not in r.headers:
            raise self._fail("starting a blob upload", r)
        location = httpx.URL(r.headers["location"])
        if not location.is_absolute_url:
            location = httpx.URL(self.base).join(location)
        target = location.copy_merge_params({"digest": digest})

        async def body() -> AsyncIterator[bytes]:
            with open(path, "rb") as f:
                while chunk := await asyncio.to_thread(f.read, _CHUNK):
                    yield chunk

        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        r = await self._send("PUT blob", "PUT", target, content=body(), headers=headers)
        if r.status_code != 201:
            raise self._fail(f"uploading blob {digest}", r)

    async def push_blob_bytes(self, data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if await self.has_blob(digest):
            return digest, len(data)
        r = await self._send("POST upload", "POST", f"/v2/{self.repo}/blobs/uploads/")
        if r.status_code != 202 or "location" not in r.headers:
            raise self._fail("starting a blob upload", r)
        target = httpx.URL(self.base).join(r.headers["location"]).copy_merge_params({"digest": digest})
        r = await self._send(
            "PUT blob", "PUT", target, content=data, headers={"Content-Type": "application/octet-stream"}
        )
        if r.status_code != 201:
            raise self._fail(f"uploading blob {digest}", r)
        return digest, len(data)

    async def pull_blob(self, digest: str, size: int, dest: Path, *, what: str) -> None:
        """Stream blob `digest` into `dest`, hashing as it arrives; a blob whose bytes do not
        hash to `digest` (or overrun `size`) is refused and `dest` removed."""
        if not _DIGEST_RE.match(digest):
            raise errors.LayerCorrupted(f"{what}: the manifest names blob {digest!r}, not a sha256 digest")
        h = hashlib.sha256()
        n = 0
        self.counts["GET blob"] += 1
        try:
            async with self.http.stream("GET", f"/v2/{self.repo}/blobs/{digest}") as r:
                if r.status_code != 200:
                    await r.aread()
                    if r.status_code == 404:
                        raise errors.LayerNotFound(f"{what}: blob {digest} is not in {self._where()}")
                    raise self._fail(f"GET of blob {digest}", r)
                with open(dest, "wb") as f:
                    async for chunk in r.aiter_raw(_CHUNK):
                        n += len(chunk)
                        if n > size:
                            raise errors.LayerCorrupted(
                                f"{what}: blob {digest} from {self._where()} is larger than the "
                                f"{size} bytes its manifest declares; refused, nothing was committed"
                            )
                        h.update(chunk)
                        f.write(chunk)
        except httpx.HTTPError as e:
            dest.unlink(missing_ok=True)
            raise errors.Unavailable(
                f"{what}: reading blob {digest} from {self._where()} failed: {e}"
            ) from None
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        got = "sha256:" + h.hexdigest()
        if got != digest or n != size:
            dest.unlink(missing_ok=True)
            raise errors.LayerCorrupted(
                f"{what}: blob {digest} from {self._where()} is corrupted: its {n} bytes hash to {got} "
                f"(expected {digest}, {size} bytes); refused, nothing was committed",
                blob=digest,
                got=got,
            )

    async def get_blob_bytes(self, digest: str, size: int, *, what: str, limit: int = 4 << 20) -> bytes:
        if size > limit:
            raise errors.LayerCorrupted(f"{what}: blob {digest} is {size} bytes, more than {limit}")
        r = await self._send("GET blob", "GET", f"/v2/{self.repo}/blobs/{digest}")
        if r.status_code != 200:
            raise self._fail(f"GET of blob {digest}", r)
        got = "sha256:" + hashlib.sha256(r.content).hexdigest()
        if got != digest:
            raise errors.LayerCorrupted(
                f"{what}: blob {digest} from {self._where()} is corrupted (hashes to {got})"
            )
        return r.content

    # ---- manifests

    async def put_manifest(self, tag: str, manifest: dict[str, Any]) -> str:
        data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        r = await self._send(
            "PUT manifest", "PUT", f"/v2/{self.repo}/manifests/{tag}", content=data,
            headers={"Content-Type": MANIFEST_TYPE},
        )  # fmt: skip
        if r.status_code != 201:
            raise self._fail(f"storing manifest {tag}", r)
        return r.headers.get("docker-content-digest") or "sha256:" + hashlib.sha256(data).hexdigest()

    async def get_manifest(self, tag: str) -> tuple[dict[str, Any], str] | None:
        """The manifest tagged `tag` and its digest, or None when the repository has no such tag."""
        r = await self._send(
            "GET manifest", "GET", f"/v2/{self.repo}/manifests/{tag}", headers={"Accept": MANIFEST_TYPE}
        )
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise self._fail(f"GET of manifest {tag}", r)
        digest = "sha256:" + hashlib.sha256(r.content).hexdigest()
        said = r.headers.get("docker-content-digest")
        if said and said != digest:
            raise errors.LayerCorrupted(f"manifest {tag} from {self._where()} hashes to {digest}, not {said}")
        try:
            body = r.json()
        except ValueError:
            raise errors.LayerCorrupted(f"manifest {tag} from {self._where()} is not JSON") from None
        return body, digest

    async def delete_manifest(self, digest: str) -> bool:
        """Delete the manifest `digest` (and so every tag naming it); False when the repository
        has no such manifest. The blobs stay until the registry's garbage collection."""
        if not _DIGEST_RE.match(digest):
            raise errors.InvalidRequest(f"manifest digest {digest!r} is not a sha256 digest")
        r = await self._send("DELETE manifest", "DELETE", f"/v2/{self.repo}/manifests/{digest}")
        if r.status_code == 404:
            return False
        if r.status_code == 405:
            raise errors.Unavailable(
                f"{self._where()} does not allow deletes (HTTP 405): set `storage.delete.enabled: true` "
                "in its config.yml"
            )
        if r.status_code != 202:
            raise self._fail(f"deleting manifest {digest}", r)
        return True

    # ---- images

    async def layer_refs(self, name: str) -> frozenset[str] | None:
        """The layer refs of image `name`, as its manifest's annotations name them (its config
        is not fetched): what placement ranks edges by when no edge holds the image. None when
        the registry lacks it."""
        got = await self.get_manifest(image_tag(name))
        if got is None:
            return None
        try:
            return frozenset(str(LayerRef.parse(d["annotations"][ANN_REF])) for d in got[0]["layers"])
        except (KeyError, TypeError, ValueError, errors.InvalidRequest) as e:
            what = f"image {name!r} in {self._where()}"
            raise errors.LayerCorrupted(f"{what}: malformed manifest ({e!r})") from None

    async def pull_manifest(self, name: str) -> Pulled | None:
        """An image's manifest and config, checked for shape; None when the registry lacks it."""
        got = await self.get_manifest(image_tag(name))
        if got is None:
            return None
        m, digest = got
        what = f"image {name!r} in {self._where()}"
        try:
            if m.get("mediaType", MANIFEST_TYPE) != MANIFEST_TYPE or m["config"]["mediaType"] != CONFIG_TYPE:
                raise errors.InvalidRequest(
                    f"{what} is not a dsec image (manifest {m.get('mediaType')}, config "
                    f"{m.get('config', {}).get('mediaType')}); push it with `dsec image push`"
                )
            cfg = m["config"]
            raw = await self.get_blob_bytes(cfg["digest"], int(cfg["size"]), what=what)
            image = Image.model_validate(json.loads(raw)["image"])
            entries = [
                LayerEntry(
                    ref=LayerRef.parse(d["annotations"][ANN_REF]),
                    tree_digest=str(d["annotations"][ANN_TREE]),
                    blob=str(d["digest"]),
                    size=int(d["size"]),
                )
                for d in m["layers"]
            ]
        except (KeyError, TypeError, ValueError, ValidationError) as e:
            if isinstance(e, errors.DsecError):
                raise
            raise errors.LayerCorrupted(f"{what}: the manifest or its config is malformed ({e!r})") from None
        if image.name != name or [e.ref for e in entries] != image.layers:
            raise errors.LayerCorrupted(f"{what}: the manifest's layers do not match its config")
        return Pulled(image, entries, digest)


# --------------------------------------------------------------------------- archives


def archive_layer(store: LayerStore, ref: LayerRef | str, dest: Path) -> tuple[str, int]:
    """Write layer `ref` as a tar (the blob), return its sha256 digest and size. Blocking."""
    tree = store.layer_path(ref)
    if not tree.is_dir():
        raise store._layer_not_found(LayerRef.parse(str(ref)))
    with open(dest, "wb") as out:
        r = subprocess.run(
            [*_TAR, "--sparse", "--sort=name", "-C", str(tree), "-cf", "-", "."],
            stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    if r.returncode != 0:
        raise errors.InternalError(
            f"archiving layer {ref} failed (tar exit {r.returncode}): {r.stderr[-300:]!r}"
        )
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest(), dest.stat().st_size


def unpack_and_commit(store: LayerStore, entry: LayerEntry, archive: Path, source: dict[str, Any]) -> None:
    """Unpack a verified blob into staging and commit it as `entry.ref`, only if its tree
    hashes to `entry.tree_digest` (nothing is committed otherwise). Blocking."""
    with store.staging() as stage:
        r = subprocess.run(
            [*_TAR, "-xpf", str(archive), "-C", str(stage)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            raise errors.LayerCorrupted(
                f"layer {entry.ref}: blob {entry.blob} does not unpack (tar exit {r.returncode}: "
                f"{r.stderr[-300:]!r}); nothing was committed"
            )
        store.commit_layer(
            stage, entry.ref.name, entry.ref.version, source, shift=False, expect_digest=entry.tree_digest
        )
    store.record_blob(entry.ref, entry.blob, entry.size)


async def push_image(store: LayerStore, client: RegistryClient, name: str) -> str:
    """Push image `name` from `store`: each layer's blob (unless the registry has it), the
    config, the manifest tagged with the name. Returns the manifest's digest."""
    image = store.get_image(name)
    loop = asyncio.get_running_loop()
    descriptors: list[dict[str, Any]] = []
    for ref in image.layers:
        layer = store.get_layer(ref)
        known = store.blob_of(ref)
        if known is not None and await client.has_blob(known[0]):
            digest, size = known
        else:
            fd, tmp = tempfile.mkstemp(prefix="push-", suffix=".tar", dir=store.root / "staging")
            os.close(fd)
            path = Path(tmp)
            try:
                digest, size = await loop.run_in_executor(None, archive_layer, store, ref, path)
                await client.push_blob(path, digest, size)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            store.record_blob(ref, digest, size)
        descriptors.append(
            {
                "mediaType": LAYER_TYPE,
                "digest": digest,
                "size": size,
                "annotations": {ANN_REF: str(ref), ANN_TREE: layer.digest},
            }
        )
    config = json.dumps({"image": image.model_dump(mode="json")}, sort_keys=True).encode()
    cdigest, csize = await client.push_blob_bytes(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": cdigest, "size": csize},
        "layers": descriptors,
        "annotations": {ANN_IMAGE: name},
    }
    return await client.put_manifest(image_tag(name), manifest)


async def pull_layer(store: LayerStore, client: RegistryClient, entry: LayerEntry) -> None:
    """Download one layer's blob (sha256 checked while streaming) and commit it (tree digest
    checked before the commit)."""
    if store.has_layer(entry.ref):
        return
    fd, tmp = tempfile.mkstemp(prefix="pull-", suffix=".tar", dir=store.root / "staging")
    os.close(fd)
    path = Path(tmp)
    try:
        await client.pull_blob(entry.blob, entry.size, path, what=f"layer {entry.ref}")
        source = {"type": "registry", "registry": client.url, "blob": entry.blob}
        await asyncio.get_running_loop().run_in_executor(None, unpack_and_commit, store, entry, path, source)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
