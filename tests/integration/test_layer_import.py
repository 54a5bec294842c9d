"""Importing docker-save tars, OCI layouts and tarballs, then stacking them with a real overlayfs."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.layers import LayerStore, import_oci_archive, import_tarball_layer, tree_digest, unpack_layer_stream

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown, mknod, trusted.* xattrs, mount"),
]
OFFSET = 100000
Entry = tuple[str, bytes | None, bytes, dict[str, Any]]


@pytest.fixture
def dsec_dir() -> Iterator[Path]:
    """A scratch directory whose name carries the dsec prefix; removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="dsec-test-layers-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- building archives by hand


def _entry(name: str, *, data: bytes | None = None, kind: bytes = tarfile.REGTYPE, **kw: Any) -> Entry:
    return (name, data, kind, kw)


def make_tar(entries: list[Entry], *, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data, kind, kw in entries:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.mode = int(kw.get("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644))
            ti.uid = int(kw.get("uid", 0))
            ti.gid = int(kw.get("gid", 0))
            ti.mtime = 1_700_000_000
            ti.linkname = str(kw.get("linkname", ""))
            if "pax" in kw:
                ti.pax_headers = dict(kw["pax"])
            if kind == tarfile.REGTYPE:
                payload = data or b""
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            else:
                tf.addfile(ti)
    return buf.getvalue()


LAYER1 = make_tar(
    [
        _entry("./", kind=tarfile.DIRTYPE),
        _entry("etc/", kind=tarfile.DIRTYPE),
        _entry("etc/hello", data=b"hello\n"),
        _entry("etc/gone", data=b"bye\n"),
        _entry("etc/hello2", kind=tarfile.LNKTYPE, linkname="etc/hello"),
        _entry("etc/user-owned", data=b"u\n", uid=1000, gid=1000, pax={"SCHILY.xattr.user.dsec": "x"}),
        _entry("opq/", kind=tarfile.DIRTYPE),
        _entry("opq/old", data=b"old\n"),
        _entry("usr/", kind=tarfile.DIRTYPE),
        _entry("usr/bin/", kind=tarfile.DIRTYPE),
        _entry("usr/bin/sutool", data=b"#!/bin/sh\n", mode=0o4755),
        _entry("bin", kind=tarfile.SYMTYPE, linkname="usr/bin"),
    ]
)
LAYER2 = make_tar(
    [
        _entry("etc/", kind=tarfile.DIRTYPE),
        _entry("etc/.wh.gone"),
        _entry("etc/added", data=b"added\n", pax={"SCHILY.xattr.trusted.overlay.redirect": "/opq"}),
        _entry("opq/", kind=tarfile.DIRTYPE),
        _entry("opq/.wh..wh..opq"),
        _entry("opq/new", data=b"new\n"),
    ]
)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


CONFIG = {
    "architecture": "amd64",
    "os": "linux",
    "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/work"},
    "rootfs": {"type": "layers", "diff_ids": [sha(LAYER1), sha(LAYER2)]},
}


def docker_save_tar(path: Path, config: dict[str, Any] = CONFIG) -> Path:
    cfg = json.dumps(config).encode()
    cfg_name = hashlib.sha256(cfg).hexdigest() + ".json"
    files = {
        cfg_name: cfg,
        "aaa111/layer.tar": LAYER1,
        "bbb222/layer.tar": LAYER2,
        "manifest.json": json.dumps(
            [
                {
                    "Config": cfg_name,
                    "RepoTags": ["dsectest:latest"],
                    "Layers": ["aaa111/layer.tar", "bbb222/layer.tar"],
                }
            ]
        ).encode(),
    }
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def oci_layout_dir(path: Path) -> Path:
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        d = sha(data)
        (blobs / d.split(":")[1]).write_bytes(data)
        return {"digest": d, "size": len(data)}

    gz1, gz2 = gzip.compress(LAYER1, mtime=0), gzip.compress(LAYER2, mtime=0)
    layer_type = "application/vnd.oci.image.layer.v1.tar+gzip"
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **put(json.dumps(CONFIG).encode()),
        },
        "layers": [{"mediaType": layer_type, **put(gz1)}, {"mediaType": layer_type, **put(gz2)}],
    }
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(json.dumps(manifest).encode())}
    (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    return path


@contextlib.contextmanager
def overlay(lowerdirs: list[Path], work: Path) -> Iterator[tuple[Path, Path]]:
    upper, wdir, merged = work / "dsec-upper", work / "dsec-work", work / "dsec-merged"
    for d in (upper, wdir, merged):
        d.mkdir()
    opts = f"lowerdir={':'.join(map(str, lowerdirs))},upperdir={upper},workdir={wdir}"
    subprocess.run(["mount", "-t", "overlay", "dsec-test-ovl", "-o", opts, str(merged)], check=True)
    try:
        yield merged, upper
    finally:
        subprocess.run(["umount", str(merged)], check=False)
        shutil.rmtree(upper, ignore_errors=True)
        shutil.rmtree(wdir, ignore_errors=True)
        with contextlib.suppress(OSError):
            merged.rmdir()


# ---------------------------------------------------------------- tests


def check_layer_trees(store: LayerStore, bottom: Path, top: Path) -> None:
    """The stored trees: shifted ownership, kept setuid, overlayfs-form whiteouts."""
    st = os.lstat(bottom / "usr/bin/sutool")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OFFSET, OFFSET, 0o4755)
    assert os.lstat(bottom / "etc/user-owned").st_uid == OFFSET + 1000
    assert os.getxattr(bottom / "etc/user-owned", "user.dsec") == b"x"
    assert os.lstat(bottom / "etc/hello").st_ino == os.lstat(bottom / "etc/hello2").st_ino
    assert os.readlink(bottom / "bin") == "usr/bin" and os.lstat(bottom / "bin").st_uid == OFFSET
    assert os.lstat(bottom).st_uid == OFFSET
    wh = os.lstat(top / "etc/gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0) and wh.st_uid == OFFSET
    assert not os.path.lexists(top / "etc/.wh.gone")
    assert not os.path.lexists(top / "opq/.wh..wh..opq")
    assert os.getxattr(top / "opq", "trusted.overlay.opaque") == b"y"
    assert os.listxattr(top / "etc/added") == []  # overlayfs bookkeeping is never imported


def test_docker_save_then_oci_layout_share_layers_and_stack_in_overlay(dsec_dir: Path) -> None:
    store = LayerStore(dsec_dir / "dsec-store")
    img = import_oci_archive(store, "dsectest", docker_save_tar(dsec_dir / "dsec-image.tar"))
    assert [r.name for r in img.layers] == ["oci-" + sha(LAYER1)[7:19], "oci-" + sha(LAYER2)[7:19]]
    assert {r.version for r in img.layers} == {"1"}
    assert img.source["type"] == "docker-archive"
    assert img.source["created_layers"] == [str(r) for r in img.layers]
    assert img.config.workdir == "/work" and img.config.env == {"PATH": "/usr/bin:/bin"}
    assert img.config.cmd == ["/bin/sh"] and "config" not in img.source  # kept once: Image.config
    assert store.get_image("dsectest") == img

    # the same layers, gzip-compressed in an OCI layout (directory, then tarred): stored once
    layout = oci_layout_dir(dsec_dir / "dsec-layout")
    img2 = import_oci_archive(store, "dsectest-oci", layout)
    assert img2.layers == img.layers and img2.source["reused_layers"] == [str(r) for r in img.layers]
    layout_tar = dsec_dir / "dsec-layout.tar"
    with tarfile.open(layout_tar, "w") as tf:
        tf.add(layout, arcname=".")
    img3 = import_oci_archive(store, "dsectest-oci-tar", layout_tar)
    assert img3.layers == img.layers and img3.source["type"] == "oci-layout"
    assert len(store.list_layers()) == 2

    lowers = store.lowerdirs(img)
    top, bottom = lowers
    assert bottom == store.layer_path(img.layers[0]) and top == store.layer_path(img.layers[1])
    check_layer_trees(store, bottom, top)
    before = [tree_digest(p, OFFSET)[0] for p in lowers]
    assert before == [store.get_layer(r).digest for r in reversed(img.layers)]

    with overlay(lowers, dsec_dir) as (merged, upper):
        assert (merged / "etc/hello").read_bytes() == b"hello\n"  # from the bottom layer
        assert (merged / "etc/added").read_bytes() == b"added\n"  # from the top layer
        assert not os.path.lexists(merged / "etc/gone")  # whited out by the top layer
        assert sorted(os.listdir(merged / "opq")) == ["new"]  # opaque: lower opq/old hidden
        assert sorted(os.listdir(merged / "etc")) == ["added", "hello", "hello2", "user-owned"]
        assert (merged / "bin/sutool").read_bytes() == b"#!/bin/sh\n"
        (merged / "etc/written").write_bytes(b"w\n")
        (merged / "etc/hello").write_bytes(b"changed\n")
        os.unlink(merged / "etc/added")
        assert (upper / "etc/written").read_bytes() == b"w\n"
        assert (upper / "etc/hello").read_bytes() == b"changed\n"
        assert stat.S_ISCHR(os.lstat(upper / "etc/added").st_mode)  # overlay's own whiteout
    assert [tree_digest(p, OFFSET)[0] for p in lowers] == before  # layers untouched
    assert (bottom / "etc/hello").read_bytes() == b"hello\n" and not (bottom / "etc/written").exists()
    assert not os.path.ismount(dsec_dir / "dsec-merged")


@pytest.mark.parametrize(
    "hostile",
    [
        {"Env": [f"V{i}=" + "x" * 1000 for i in range(1000)]},  # 1 MB of environment
        {"WorkingDir": "/" + "deep/" * 100},
        {"User": "a:b:c"},
        {"Labels": {"k": {"not": "a string"}}},
    ],
)
def test_an_image_config_over_its_bounds_is_refused_before_any_layer(dsec_dir: Path, hostile: Any) -> None:
    store = LayerStore(dsec_dir / "dsec-store")
    archive = docker_save_tar(dsec_dir / "dsec-image.tar", {**CONFIG, "config": hostile})
    with pytest.raises(errors.InvalidRequest, match="the image config"):
        import_oci_archive(store, "dsectest", archive)
    assert store.list_layers() == [] and store.list_images() == []


def test_tarball_layer_import_and_compressions(dsec_dir: Path) -> None:
    store = LayerStore(dsec_dir / "dsec-store")
    plain = dsec_dir / "dsec-root.tar"
    plain.write_bytes(LAYER1)
    layer = import_tarball_layer(store, "root", "1", plain)
    assert layer.digest == tree_digest(store.layer_path(layer.ref), OFFSET)[0]
    gz = dsec_dir / "dsec-root.tar.gz"
    gz.write_bytes(gzip.compress(LAYER1))
    assert import_tarball_layer(store, "root-gz", "1", gz).digest == layer.digest
    if shutil.which("zstd"):
        zst = dsec_dir / "dsec-root.tar.zst"
        subprocess.run(["zstd", "-q", "-o", str(zst), str(plain)], check=True)
        assert import_tarball_layer(store, "root-zst", "1", zst).digest == layer.digest
    # a plain tarball keeps '.wh.' names as ordinary files (only OCI layers have OCI whiteouts)
    wh = dsec_dir / "dsec-wh.tar"
    wh.write_bytes(LAYER2)
    tree = store.layer_path(import_tarball_layer(store, "wh", "1", wh).ref)
    assert (tree / "etc/.wh.gone").is_file()
    bad = dsec_dir / "dsec-bad.tar"
    bad.write_bytes(b"this is not a tar archive at all" * 64)
    with pytest.raises(errors.InvalidRequest, match=r"\.tar\.gz"):
        import_tarball_layer(store, "bad", "1", bad)


@pytest.mark.parametrize(
    "entries",
    [
        [_entry("../evil", data=b"x")],
        [_entry("ok/", kind=tarfile.DIRTYPE), _entry("ok/../../evil", data=b"x")],
        [_entry("/etc/evil", data=b"x")],
        [_entry("esc", kind=tarfile.SYMTYPE, linkname=".."), _entry("esc/evil", data=b"x")],
        [_entry("esc", kind=tarfile.SYMTYPE, linkname="/tmp"), _entry("esc/evil", data=b"x")],
        [_entry("hl", kind=tarfile.LNKTYPE, linkname="../evil")],
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "through-symlink", "through-abs-symlink", "hardlink-out"],
)
def test_tarball_escapes_are_refused(dsec_dir: Path, entries: list[Entry]) -> None:
    store = LayerStore(dsec_dir / "dsec-store")
    evil = dsec_dir / "dsec-evil.tar"
    evil.write_bytes(make_tar(entries, fmt=tarfile.GNU_FORMAT))
    (dsec_dir / "evil").write_bytes(b"host file")
    with pytest.raises(errors.InvalidRequest):
        import_tarball_layer(store, "evil", "1", evil)
    assert (dsec_dir / "evil").read_bytes() == b"host file"
    assert not (dsec_dir / "dsec-store" / "evil").exists()
    assert not Path("/tmp/evil").exists() or Path("/tmp/evil").stat().st_mtime < 1_700_000_001
    assert store.list_layers() == []
    assert list((store.root / "staging").iterdir()) == []


@pytest.mark.parametrize(
    "entries",
    [
        [_entry(".wh...")],
        [_entry("a/", kind=tarfile.DIRTYPE), _entry("a/.wh...")],
        [_entry("a/", kind=tarfile.DIRTYPE), _entry("a/.wh..")],
        [_entry(".wh.")],
        [_entry("esc", kind=tarfile.SYMTYPE, linkname=".."), _entry("esc/.wh.x")],
        [_entry("esc", kind=tarfile.SYMTYPE, linkname=".."), _entry("esc/.wh..wh..opq")],
    ],
    ids=["top-dotdot", "nested-dotdot", "dot", "empty", "through-symlink", "opaque-through-symlink"],
)
def test_an_untrusted_layer_stream_cannot_whiteout_its_way_out(dsec_dir: Path, entries: list[Entry]) -> None:
    """A guest's writable layer (a microVM's snapshot) is unpacked with OCI whiteouts: a
    whiteout naming '..' or '.' (it would remove the directory above, then put a device node
    there) or reached through a symlink is refused, and nothing outside is touched."""
    stage = dsec_dir / "staging" / "stage"
    stage.mkdir(parents=True)
    (dsec_dir / "staging" / "neighbour").write_bytes(b"kept")
    (dsec_dir / "x").write_bytes(b"host file")
    with pytest.raises(errors.InvalidRequest):
        unpack_layer_stream(io.BytesIO(make_tar(entries)), stage, "a guest's layer")
    assert (dsec_dir / "staging" / "neighbour").read_bytes() == b"kept"
    assert (dsec_dir / "x").read_bytes() == b"host file" and stage.is_dir()
    assert not os.path.lexists(dsec_dir / ".wh..wh..opq")


def test_an_untrusted_layer_stream_cannot_inflate_a_sparse_header(dsec_dir: Path) -> None:
    """A sparse member's header claims its full size while the stream holds only its data
    blocks: a few KiB of a guest's layer stream would be written out here as the whole size
    in zeros. The guest's archiver never writes one: refused, before any of it is written."""
    src = dsec_dir / "src"
    src.mkdir()
    with open(src / "hole", "wb") as f:
        f.truncate(256 << 20)
    argv = ["tar", "--sparse", "-c", "-C", str(src), "hole"]
    stream = subprocess.run(argv, check=True, capture_output=True)
    assert len(stream.stdout) < 100_000
    stage = dsec_dir / "stage"
    stage.mkdir()
    with pytest.raises(errors.InvalidRequest, match="sparse"):
        unpack_layer_stream(io.BytesIO(stream.stdout), stage, "a guest's layer")
    assert not (stage / "hole").exists()


def test_device_nodes_other_than_whiteouts_are_skipped(dsec_dir: Path) -> None:
    store = LayerStore(dsec_dir / "dsec-store")
    tar = dsec_dir / "dsec-dev.tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, major, minor in (("dev/null", 1, 3), ("wh", 0, 0)):
            ti = tarfile.TarInfo(name)
            ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, major, minor
            tf.addfile(ti)
    tar.write_bytes(buf.getvalue())
    layer = import_tarball_layer(store, "dev", "1", tar)
    tree = store.layer_path(layer.ref)
    assert not os.path.lexists(tree / "dev/null")
    assert stat.S_ISCHR(os.lstat(tree / "wh").st_mode)
    assert layer.source["skipped"] == 1


def test_invalid_image_archives_say_what_is_accepted(dsec_dir: Path) -> None:
    store = LayerStore(dsec_dir / "dsec-store")
    not_image = dsec_dir / "dsec-plain.tar"
    not_image.write_bytes(LAYER1)
    junk = dsec_dir / "dsec-junk.bin"
    junk.write_bytes(b"\x00junk" * 100)
    empty_dir = dsec_dir / "dsec-empty"
    empty_dir.mkdir()
    for archive in (not_image, junk, empty_dir, dsec_dir / "dsec-missing.tar"):
        with pytest.raises(errors.InvalidRequest, match="docker save") as ei:
            import_oci_archive(store, "x", archive)
        assert "OCI image layout" in str(ei.value)
    # a layer whose content does not match the config's diff_id is refused
    bad = json.loads(json.dumps(CONFIG))
    bad["rootfs"]["diff_ids"][1] = sha(b"something else")
    layout = oci_layout_dir(dsec_dir / "dsec-layout")
    idx = json.loads((layout / "index.json").read_text())
    man_path = layout / "blobs/sha256" / idx["manifests"][0]["digest"].split(":")[1]
    man = json.loads(man_path.read_text())
    cfg = json.dumps(bad).encode()
    (layout / "blobs/sha256" / hashlib.sha256(cfg).hexdigest()).write_bytes(cfg)
    man["config"]["digest"] = sha(cfg)
    man_bytes = json.dumps(man).encode()
    (layout / "blobs/sha256" / hashlib.sha256(man_bytes).hexdigest()).write_bytes(man_bytes)
    idx["manifests"][0]["digest"] = sha(man_bytes)
    (layout / "index.json").write_text(json.dumps(idx))
    with pytest.raises(errors.InvalidRequest, match="does not match"):
        import_oci_archive(store, "x", layout)
    with pytest.raises(errors.ImageNotFound):
        store.get_image("x")
