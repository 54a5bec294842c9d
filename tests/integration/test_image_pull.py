"""Pulling images by reference from a real registry (Debian's docker-registry, with htpasswd
auth), through skopeo, into a real layer store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import errors
from dsec.cluster.registry import RegistryServer, find_registry_bin
from dsec.layers import Image, LayerStore
from dsec.layers.pull import PullPolicy, Reference, RegistryAuth, pull_image

from . import oci_images
from .oci_images import PASSWORD, USER

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def auth_registry() -> Iterator[RegistryServer]:
    pytest.importorskip("bcrypt")
    try:
        find_registry_bin()
    except errors.DsecError as e:
        pytest.skip(str(e))
    with oci_images.auth_registry() as (server, digests):
        server.small_digest = digests["small"]  # type: ignore[attr-defined]
        yield server


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "layers")


def _policy(reg: RegistryServer, **kw: int) -> PullPolicy:
    return PullPolicy(local=frozenset({f"127.0.0.1:{reg.port}"}), **kw)  # type: ignore[arg-type]


def _pull(
    reg: RegistryServer, store: LayerStore, tmp: Path, path: str, *, max_bytes: int = 32 << 30
) -> Image:
    """Pull 127.0.0.1:<port>/`path` with the login, the registry listed as local."""
    ref = Reference.parse(f"127.0.0.1:{reg.port}/{path}")
    policy = _policy(reg, max_bytes=max_bytes)
    return pull_image(store, ref, "x", scratch=tmp / "s", policy=policy, auth=RegistryAuth(USER, PASSWORD))


def test_pull_with_credentials_keeps_layers_and_config(
    auth_registry: RegistryServer, store: LayerStore, tmp_path: Path
) -> None:
    ref = Reference.parse(f"127.0.0.1:{auth_registry.port}/team/small:1")
    seen: list[str] = []
    image = pull_image(
        store, ref, "small", scratch=tmp_path / "scratch", policy=_policy(auth_registry),
        auth=RegistryAuth(USER, PASSWORD), progress=seen.append,
    )  # fmt: skip
    assert image.source["type"] == "pull" and image.source["reference"] == str(ref)
    assert image.source["digest"] == auth_registry.small_digest  # type: ignore[attr-defined]
    assert image.config.env == {"PATH": "/opt/bin:/usr/bin:/bin", "JAVA_HOME": "/opt/jdk"}
    assert image.config.workdir == "/app" and image.config.user == "app"
    (top,) = store.lowerdirs(image)
    assert (top / "app" / "hello.txt").read_bytes() == b"hello\n"
    assert any("Copying blob" in line for line in seen), seen  # progress, from skopeo
    # Nothing of the download or the login is left behind.
    assert list((tmp_path / "scratch").iterdir()) == []
    # The same image pinned by its digest: the same layers, nothing new stored.
    pinned = Reference.parse(f"127.0.0.1:{auth_registry.port}/team/small@{auth_registry.small_digest}")  # type: ignore[attr-defined]
    again = pull_image(
        store,
        pinned,
        "small-pinned",
        scratch=tmp_path / "scratch",
        policy=_policy(auth_registry),
        auth=RegistryAuth(USER, PASSWORD),
    )
    assert again.layers == image.layers and again.source["created_layers"] == []


def test_pull_without_or_with_wrong_credentials_is_refused(
    auth_registry: RegistryServer, store: LayerStore, tmp_path: Path
) -> None:
    ref = Reference.parse(f"127.0.0.1:{auth_registry.port}/team/small:1")
    for auth in (None, RegistryAuth(USER, "Wr0ng-Pa55-x7")):
        with pytest.raises(errors.Forbidden) as e:
            pull_image(store, ref, "x", scratch=tmp_path / "s", policy=_policy(auth_registry), auth=auth)
        assert e.value.details["reason"] == "registry_auth"
        assert "Wr0ng-Pa55-x7" not in str(e.value.to_wire())  # never shown back
    assert store.list_images() == []


def test_a_wrong_digest_is_refused(auth_registry: RegistryServer, store: LayerStore, tmp_path: Path) -> None:
    with pytest.raises(errors.DsecError) as e:
        _pull(auth_registry, store, tmp_path, f"team/small@sha256:{'0' * 64}")
    assert e.value.status == 404 or e.value.details.get("reason") == "digest_mismatch", e.value
    assert store.list_images() == []


def test_missing_image_and_size_limit(
    auth_registry: RegistryServer, store: LayerStore, tmp_path: Path
) -> None:
    with pytest.raises(errors.ImageNotFound):
        _pull(auth_registry, store, tmp_path, "team/nothing:1")
    with pytest.raises(errors.QuotaExceeded) as e:
        _pull(auth_registry, store, tmp_path, "team/big:1", max_bytes=1 << 20)
    assert e.value.details["reason"] == "image_too_large"
    assert store.list_images() == [] and store.list_layers() == []  # refused before any blob


def test_a_registry_on_a_private_address_needs_the_operator(
    auth_registry: RegistryServer, store: LayerStore, tmp_path: Path
) -> None:
    """A pull is a request the edge makes for a tenant: not to loopback, private or
    link-local addresses (the cluster's own services, a cloud's metadata service) unless
    the operator lists the registry."""
    for text in (
        f"127.0.0.1:{auth_registry.port}/team/small:1",
        "169.254.169.254/latest/meta-data:1",
        "localhost:5000/x:1",
        "10.0.0.1/x:1",
        "[::1]:5000/x:1",
    ):
        with pytest.raises(errors.Forbidden) as e:
            pull_image(store, Reference.parse(text), "x", scratch=tmp_path / "s", policy=PullPolicy())
        assert e.value.details["reason"] == "registry_not_allowed", text
