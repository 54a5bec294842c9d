"""An image's config (ENV, WORKDIR, USER...) read from a hostile OCI config, and USER resolved
from hostile /etc/passwd and /etc/group files in the image's layers (dsec.layers.userdb)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dsec import errors
from dsec.layers.store import Image, LayerRef
from dsec.layers.userdb import MAX_USERDB_BYTES, Account, read_image_file, resolve_user
from dsec.models import ImageConfig, PoolSpec, SandboxSpec
from tests.unit.test_layer_store import make_tree

OCI = {
    "config": {
        "Env": ["PATH=/opt/mybin:/usr/bin:/bin", "JAVA_HOME=/opt/jdk", "EMPTY=", "A=1=2"],
        "WorkingDir": "/app",
        "User": "app",
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["echo hi"],
        "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
        "Labels": {"org.example.k": "v"},
    }
}


def test_the_oci_config_is_kept_whole() -> None:
    c = ImageConfig.from_oci(OCI, "x.tar")
    assert c.env == {"PATH": "/opt/mybin:/usr/bin:/bin", "JAVA_HOME": "/opt/jdk", "EMPTY": "", "A": "1=2"}
    assert (c.workdir, c.user) == ("/app", "app")
    assert (c.entrypoint, c.cmd) == (["/bin/sh", "-c"], ["echo hi"])
    assert c.exposed_ports == ["53/udp", "8080/tcp"] and c.labels == {"org.example.k": "v"}
    assert ImageConfig.from_oci({}, "x") == ImageConfig() == ImageConfig.from_oci({"config": None}, "x")


def test_images_stored_before_configs_were_kept_still_read() -> None:
    old = {"name": "old", "layers": [{"name": "a", "version": "1"}], "created_at": 1.0, "source": {}}
    img = Image.model_validate_json(json.dumps(old))
    assert img.config == ImageConfig() and img.layers == [LayerRef(name="a", version="1")]


def test_a_spec_leaves_user_and_workdir_to_the_image_by_default() -> None:
    spec = SandboxSpec()
    assert spec.user is None and spec.workdir is None
    assert SandboxSpec(user="root", workdir="/work").user == "root"
    with pytest.raises(ValueError, match="absolute"):
        SandboxSpec(workdir="app")
    # a pool of the default shape still serves a default create (same key)
    assert PoolSpec().base_spec().user is None and PoolSpec().base_spec().workdir is None


@pytest.mark.parametrize(
    ("workdir", "expected"),
    [("../../etc", "/etc"), ("/app/../../..//x/./y", "/x/y"), ("//app", "/app"), ("rel", "/rel"), ("", None)],
)
def test_a_workdir_is_made_absolute_and_cannot_climb(workdir: str, expected: str | None) -> None:
    assert ImageConfig.from_oci({"config": {"WorkingDir": workdir}}, "x").workdir == expected


@pytest.mark.parametrize(
    "inner",
    [
        {"Env": [f"V{i}=x" for i in range(5000)]},  # too many
        {"Env": ["BIG=" + "x" * (300 * 1024)]},  # too large
        {"Env": ["NOEQUALS"]},
        {"Env": ["A\0B=1"]},
        {"Env": "PATH=/bin"},
        {"Env": [1]},
        {"WorkingDir": "/" + "a" * 300},
        {"WorkingDir": "/a\0b"},
        {"User": "a:b:c"},
        {"User": "a b"},
        {"User": "x" * 300},
        {"Entrypoint": ["x" * (300 * 1024)]},
        {"Cmd": ["a"] * 2000},
        {"ExposedPorts": {"99999/tcp": {}}},
        {"ExposedPorts": {"http": {}}},
        {"ExposedPorts": ["80"]},
        {"Labels": {"k": 1}},
        {"Labels": {f"k{i}": "v" for i in range(2000)}},
        "not an object",
    ],
)
def test_a_hostile_config_is_refused_by_name(inner: object) -> None:
    with pytest.raises(errors.InvalidRequest, match=r"^x\.tar: the image config"):
        ImageConfig.from_oci({"config": inner}, "x.tar")


# --------------------------------------------------------------------------- USER


PASSWD = (
    b"root:x:0:0:root:/root:/bin/bash\n"
    b"# a comment\n"
    b"garbage line\n"
    b"bad:x:notanumber:1::/:/bin/sh\n"
    b"huge:x:70000:70000::/:/bin/sh\n"
    b"app:x:1234:2345:App:/home/app:/bin/sh\n"
    b"nohome:x:77:78:::/bin/sh\n"
)
GROUP = b"root:x:0:\nappgrp:x:2345:\nother:x:4444:app\nbig:x:99999:\n"


def files(passwd: bytes | None = PASSWD, group: bytes | None = GROUP) -> dict[str, bytes | None]:
    return {"/etc/passwd": passwd, "/etc/group": group}


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ("root", Account(0, 0, "/root")),
        ("app", Account(1234, 2345, "/home/app")),
        ("app:other", Account(1234, 4444, "/home/app")),
        ("app:7", Account(1234, 7, "/home/app")),
        ("1000", Account(1000, 1000, "/")),  # a uid alone: gid = uid, as before
        ("0:0", Account(0, 0, "/")),  # root by number: what the default already is
        ("1000:appgrp", Account(1000, 2345, "/")),
        ("nohome", Account(77, 78, "/")),
    ],
)
def test_users_resolve_from_the_images_files(user: str, expected: Account) -> None:
    assert resolve_user(user, files().get) == expected


@pytest.mark.parametrize(
    ("user", "db", "match"),
    [
        ("nobody2", files(), "user 'nobody2' is not in the image's /etc/passwd"),
        ("app", files(passwd=None), "the image has none"),
        ("app:nogroup", files(), "group 'nogroup' is not in the image's /etc/group"),
        ("bad", files(), "not a number"),
        ("huge", files(), "below 65536"),
        ("app:big", files(), "below 65536"),
        ("70000", files(), "below 65536"),
        ("app:", files(), "invalid"),
        (":1", files(), "invalid"),
    ],
)
def test_a_user_the_image_lacks_is_a_clear_400(user: str, db: dict[str, bytes | None], match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match) as e:
        resolve_user(user, db.get)
    assert e.value.status == 400


# --------------------------------------------------------------------------- the layers' files


def layer(root: Path, name: str, entries: dict[str, bytes | str]) -> Path:
    """A layer tree (make_tree's: bytes a file, str a symlink, a key ending in / a directory)."""
    return make_tree(root / name, entries)


def test_the_topmost_layer_with_the_file_wins(tmp_path: Path) -> None:
    low = layer(tmp_path, "low", {"etc/passwd": b"low\n", "etc/group": b"g\n"})
    top = layer(tmp_path, "top", {"etc/passwd": b"top\n"})
    assert read_image_file([top, low], "/etc/passwd") == b"top\n"
    assert read_image_file([top, low], "/etc/group") == b"g\n"
    assert read_image_file([top, low], "/etc/shadow") is None
    assert read_image_file([], "/etc/passwd") is None


def test_links_out_of_the_image_are_never_followed(tmp_path: Path) -> None:
    low = layer(tmp_path, "low", {"etc/passwd": b"low\n"})
    for i, target in enumerate(("/etc/passwd", "../../../../../etc/passwd", "/proc/self/root/etc/passwd")):
        top = layer(tmp_path, f"top{i}", {"etc/passwd": target})
        with pytest.raises(errors.InvalidRequest, match="symbolic link"):
            read_image_file([top, low], "/etc/passwd")
    linked_etc = layer(tmp_path, "etclink", {"etc": "/etc"})
    with pytest.raises(errors.InvalidRequest, match="symbolic link"):
        read_image_file([linked_etc, low], "/etc/passwd")


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts are character devices 0:0 (mknod needs root)")
def test_whiteouts_and_opaque_directories_hide_what_is_below(tmp_path: Path) -> None:
    low = layer(tmp_path, "low", {"etc/passwd": b"low\n", "etc/group": b"g\n"})
    top = layer(tmp_path, "top", {"etc/": b""})
    os.mknod(top / "etc/passwd", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    assert read_image_file([top, low], "/etc/passwd") is None
    assert read_image_file([top, low], "/etc/group") == b"g\n"
    opaque = layer(tmp_path, "opaque", {"etc/": b""})
    os.setxattr(opaque / "etc", "trusted.overlay.opaque", b"y")
    assert read_image_file([opaque, low], "/etc/group") is None
    etc_file = layer(tmp_path, "file", {"etc": b"not a dir"})
    assert read_image_file([etc_file, low], "/etc/passwd") is None


def test_a_huge_or_special_passwd_is_refused_unread(tmp_path: Path) -> None:
    top = layer(tmp_path, "top", {"etc/": b""})
    with open(top / "etc/passwd", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: refused by its size, nothing read
    with pytest.raises(errors.InvalidRequest, match=f"larger than {MAX_USERDB_BYTES} bytes"):
        read_image_file([top], "/etc/passwd")
    os.unlink(top / "etc/passwd")
    os.mkfifo(top / "etc/passwd")  # a FIFO: never opened for reading (it would block)
    with pytest.raises(errors.InvalidRequest, match="not a regular file"):
        read_image_file([top], "/etc/passwd")
    with pytest.raises(errors.InvalidRequest, match="plain absolute path"):
        read_image_file([top], "/etc/../etc/passwd")
