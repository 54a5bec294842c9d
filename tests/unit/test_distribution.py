"""The registry client's pure parts (URLs, tags, manifests read through a fake transport)
and the store's digest check on commit; the real registry is in
tests/integration/test_registry.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest

from dsec import errors
from dsec.layers import LayerStore
from dsec.layers import distribution as dist
from dsec.layers.store import Image, LayerRef


def test_split_url_names_the_repository_in_the_path():
    assert dist.split_url("http://10.0.0.1:5000") == ("http://10.0.0.1:5000", "dsec")
    assert dist.split_url("https://reg.example:443/team/dsec/") == ("https://reg.example:443", "team/dsec")
    for bad in ("10.0.0.1:5000", "ftp://x/y", "http://h:1/Upper", "http://h:1/a//b"):
        with pytest.raises(errors.InvalidRequest):
            dist.split_url(bad)


def test_image_tags_are_names_where_valid_and_distinct_otherwise():
    assert dist.image_tag("python") == "python"
    assert dist.image_tag("snap-e1-123-4") == "snap-e1-123-4"
    a, b = dist.image_tag("py:3.11"), dist.image_tag("py+3.11")
    assert a != b and a.startswith("py-3.11-") and b.startswith("py-3.11-")
    assert all(c.isalnum() or c in "._-" for c in a + b)


def _fake_registry(blobs: dict[str, bytes], manifests: dict[str, bytes]) -> httpx.MockTransport:
    def handle(req: httpx.Request) -> httpx.Response:
        _, _, rest = req.url.path.partition("/v2/repo/")
        kind, _, key = rest.partition("/")
        if kind == "manifests" and key in manifests:
            return httpx.Response(200, content=manifests[key], headers={"Content-Type": dist.MANIFEST_TYPE})
        if kind == "blobs" and key in blobs:
            return httpx.Response(200, stream=httpx.ByteStream(blobs[key]))
        return httpx.Response(404)

    return httpx.MockTransport(handle)


def _manifest(image: Image, tree: str, layer_blob: bytes) -> tuple[dict[str, bytes], dict[str, bytes]]:
    cfg = json.dumps({"image": image.model_dump(mode="json")}).encode()
    cd = "sha256:" + hashlib.sha256(cfg).hexdigest()
    ld = "sha256:" + hashlib.sha256(layer_blob).hexdigest()
    m = {
        "schemaVersion": 2,
        "mediaType": dist.MANIFEST_TYPE,
        "config": {"mediaType": dist.CONFIG_TYPE, "digest": cd, "size": len(cfg)},
        "layers": [
            {"mediaType": dist.LAYER_TYPE, "digest": ld, "size": len(layer_blob),
             "annotations": {dist.ANN_REF: str(r), dist.ANN_TREE: tree}}
            for r in image.layers
        ],
    }  # fmt: skip
    return {cd: cfg, ld: layer_blob}, {image.name: json.dumps(m).encode()}


def _client(blobs: dict[str, bytes], manifests: dict[str, bytes]) -> dist.RegistryClient:
    c = dist.RegistryClient("http://reg:5000/repo")
    c.http = httpx.AsyncClient(base_url=c.base, transport=_fake_registry(blobs, manifests))
    return c


def test_pull_manifest_reads_refs_and_tree_digests():
    image = Image(name="img", layers=[LayerRef(name="a", version="1")])
    client = _client(*_manifest(image, "sha256:" + "1" * 64, b"layer"))

    async def run() -> dist.Pulled | None:
        try:
            return await client.pull_manifest("img")
        finally:
            await client.aclose()

    pulled = asyncio.run(run())
    assert pulled is not None and pulled.image.name == "img"
    assert [(str(e.ref), e.tree_digest, e.size) for e in pulled.layers] == [("a@1", "sha256:" + "1" * 64, 5)]
    assert asyncio.run(_client({}, {}).pull_manifest("img")) is None


def test_a_manifest_whose_layers_differ_from_its_config_is_refused():
    image = Image(name="img", layers=[LayerRef(name="a", version="1")])
    blobs, manifests = _manifest(image, "sha256:" + "1" * 64, b"layer")
    m = json.loads(manifests["img"])
    m["layers"][0]["annotations"][dist.ANN_REF] = "b@1"
    manifests["img"] = json.dumps(m).encode()
    with pytest.raises(errors.LayerCorrupted, match="do not match its config"):
        asyncio.run(_client(blobs, manifests).pull_manifest("img"))


def test_a_blob_that_does_not_hash_to_its_digest_is_removed(tmp_path: Path):
    digest = "sha256:" + hashlib.sha256(b"good").hexdigest()
    client = _client({digest: b"evil"}, {})
    dest = tmp_path / "blob"
    with pytest.raises(errors.LayerCorrupted, match="is corrupted: its 4 bytes hash to"):
        asyncio.run(client.pull_blob(digest, 4, dest, what="layer a@1"))
    assert not dest.exists()
    with pytest.raises(errors.LayerCorrupted, match="larger than"):
        asyncio.run(_client({digest: b"good and more"}, {}).pull_blob(digest, 4, dest, what="layer a@1"))
    assert not dest.exists()


def test_commit_with_a_wrong_expected_digest_commits_nothing(tmp_path: Path):
    store = LayerStore(tmp_path / "store", uid_offset=os.geteuid() if os.geteuid() else 0)
    with store.staging() as stage:
        (stage / "f").write_text("x")
        with pytest.raises(errors.LayerCorrupted, match="nothing was committed"):
            store.commit_layer(stage, "a", "1", {}, shift=False, expect_digest="sha256:" + "0" * 64)
    assert not store.has_layer("a@1")
    assert not any((store.root / "staging").iterdir())
