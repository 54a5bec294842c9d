"""Pulls by reference through a real `dsec up`, from a real registry that wants a login:
a project's login kept and never shown back, its image its own (seen and used by its members
only, no other name taken), a sandbox made from it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.client import Client
from dsec.cluster.registry import RegistryServer

from ..integration import oci_images
from .conftest import Service, dsec_up, tenants

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, python_image: str) -> Iterator[dict[str, Any]]:
    pytest.importorskip("bcrypt")
    with oci_images.auth_registry() as (reg, digests):
        local = json.dumps([f"127.0.0.1:{reg.port}"])
        extra = {"DSEC_EDGE_PULL_LOCAL_REGISTRIES": local, "DSEC_EDGE_FNCALL_IMAGE": ""}
        with dsec_up(tmp_path_factory.mktemp("dsec-pull"), extra) as svc:
            tokens = tenants(svc, "pa", "pb")
            yield {"svc": svc, "reg": reg, "digests": digests, "tokens": tokens}


def _client(w: dict[str, Any], project: str | None = None) -> Client:
    svc: Service = w["svc"]
    return Client(svc.url, svc.token if project is None else w["tokens"][project])


def test_a_project_pulls_with_its_login_and_runs_its_image(world: dict[str, Any]) -> None:
    reg: RegistryServer = world["reg"]
    ref = f"127.0.0.1:{reg.port}/team/small:1"
    with _client(world, "pa") as pa, _client(world, "pb") as pb:
        # No login yet: the registry refuses, and nothing is made.
        with pytest.raises(Exception) as e:
            pa.pull_image(ref, project="pa")
        assert getattr(e.value, "details", {}).get("reason") == "registry_auth", e.value
        pa.set_registry_login("pa", f"127.0.0.1:{reg.port}", oci_images.USER, oci_images.PASSWORD)
        shown = pa.registry_logins("pa")
        assert shown == [
            {
                "registry": f"127.0.0.1:{reg.port}",
                "username": oci_images.USER,
                "updated_at": shown[0]["updated_at"],
            }
        ]
        assert oci_images.PASSWORD not in json.dumps(shown)
        image = pa.pull_image(ref, project="pa")
        assert image["name"] == "pa/small:1"
        assert image["source"]["digest"] == world["digests"]["small"]
        assert image["config"]["workdir"] == "/app" and image["config"]["env"]["JAVA_HOME"] == "/opt/jdk"
        # Its members run it.
        with pa.create("pa/small:1", project="pa", memory_mb=128) as sb:
            r = sb.exec('echo "$(</app/hello.txt)"')  # (its only program: a static bash as /bin/sh)
            assert (r.stdout, r.exit_code) == ("hello\n", 0), r
            # ... as the image says: its USER (from its own /etc/passwd), WORKDIR and ENV
            r = sb.exec('echo "$UID $PWD $JAVA_HOME $PATH"')
            assert r.stdout == "1234 /app /opt/jdk /opt/bin:/usr/bin:/bin\n", r
        # Another project neither sees it, nor uses it, nor pulls into pa, nor takes its name.
        assert "pa/small:1" not in [i["name"] for i in pb.images()]
        assert "pa/small:1" in [i["name"] for i in pa.images()]
        with pytest.raises(Exception) as e:
            pb.create("pa/small:1", project="pb", memory_mb=128)
        assert getattr(e.value, "status", None) in (403, 404), e.value
        with pytest.raises(Exception) as e:
            pb.pull_image(ref, project="pa")
        assert getattr(e.value, "status", None) == 403
        with pytest.raises(Exception) as e:
            pb.pull_image(ref, project="pb", name="pa/small:1")
        assert getattr(e.value, "details", {}).get("reason") == "bad_name"
        with pytest.raises(Exception) as e:  # and pb's pull has no login of pa's
            pb.pull_image(ref, project="pb")
        assert getattr(e.value, "details", {}).get("reason") == "registry_auth"
        with pytest.raises(Exception) as e:  # a tenant pulls into a project, not a shared image
            pb.pull_image(ref)
        assert getattr(e.value, "details", {}).get("reason") == "project_required"
        with pytest.raises(Exception) as e:
            pb.registry_logins("pa")
        assert getattr(e.value, "status", None) == 403
        pa.delete_registry_login("pa", f"127.0.0.1:{reg.port}")
        assert pa.registry_logins("pa") == []


def test_bad_references_and_registries_are_4xx(world: dict[str, Any]) -> None:
    with _client(world, "pa") as pa:
        for ref, reason in (
            ("-rm/x", "bad_reference"),
            ("docker://evil/x", "bad_reference"),
            ("UPPER/case:1", "bad_reference"),
            ("169.254.169.254/latest:1", "registry_not_allowed"),
            ("localhost:1/x:1", "registry_not_allowed"),
        ):
            with pytest.raises(Exception) as e:
                pa.pull_image(ref, project="pa")
            err = e.value
            assert (
                400 <= getattr(err, "status", 500) < 500
                and getattr(err, "details", {}).get("reason") == reason
            ), (ref, err)
        with pytest.raises(Exception) as e:
            pa.set_registry_login("pa", "not a host", "u", "p")
        assert getattr(e.value, "status", None) == 400


def test_a_digest_pins_content_and_images_are_managed_over_http(world: dict[str, Any]) -> None:
    """`name:tag` resolves to a digest, kept by a sandbox; retagging does not change what the
    pinned `name@digest` gives; a project's members inspect and delete its images, no one else."""
    reg: RegistryServer = world["reg"]
    with _client(world, "pa") as pa, _client(world, "pb") as pb:
        pa.set_registry_login("pa", f"127.0.0.1:{reg.port}", oci_images.USER, oci_images.PASSWORD)
        first = pa.pull_image(f"127.0.0.1:{reg.port}/team/small:1", project="pa", name="env:1")
        digest = first["digest"]
        assert digest.startswith("sha256:") and pa.image("pa/env:1")["digest"] == digest
        with pa.create("pa/env:1", project="pa", memory_mb=128) as sb:
            assert sb.info is not None and sb.info.image_digest == digest
        # The name now given to other content: the pin still gives the first.
        second = pa.pull_image(f"127.0.0.1:{reg.port}/team/big:1", project="pa", name="env:1")
        assert second["digest"] != digest and pa.image("pa/env:1")["digest"] == second["digest"]
        assert pa.image(f"pa/env:1@{digest}")["digest"] == digest
        with pa.create(f"pa/env:1@{digest}", project="pa", memory_mb=128) as sb:
            assert sb.exec('echo "$(</app/hello.txt)"').stdout == "hello\n"
            assert sb.info is not None and sb.info.image_digest == digest
        with pa.create("pa/env:1", project="pa", memory_mb=128) as sb:
            assert sb.exec("test -e /app/hello.txt; echo $?").stdout == "1\n"
        # Another project: not found, not deletable.
        for call in (lambda: pb.image("pa/env:1"), lambda: pb.image(f"pa/env:1@{digest}")):
            with pytest.raises(Exception) as e:
                call()
            assert getattr(e.value, "status", None) == 404
        with pytest.raises(Exception) as e:  # nor runs it pinned by its digest
            pb.create(f"pa/env:1@{digest}", project="pb", memory_mb=128)
        assert getattr(e.value, "status", None) in (403, 404), e.value
        with pytest.raises(Exception) as e:
            pb.delete_image("pa/env:1")
        assert getattr(e.value, "status", None) == 403
        with pytest.raises(Exception) as e:  # and only admins delete shared images
            pa.delete_image("python")
        assert getattr(e.value, "status", None) == 403
        pa.delete_image("pa/env:1")
        for name in ("pa/env:1", f"pa/env:1@{digest}"):
            with pytest.raises(Exception) as e:
                pa.image(name)
            assert getattr(e.value, "status", None) == 404
