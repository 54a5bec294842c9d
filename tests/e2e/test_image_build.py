"""Dockerfile builds through a real `dsec up`, from a client that only uploads its context:
the log streamed, the image its project's own, a failing step named, the CLI's -t."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.client import Client

from ..integration import oci_images
from .conftest import DSEC, dsec_up, tenants

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

DOCKERFILE = """ARG BASE
FROM $BASE AS tool
RUN echo built-in-stage-one > /made
FROM $BASE
ENV GREETING=hello
WORKDIR /app
COPY --from=tool /made ./made
COPY hello.txt ./
USER app
RUN echo "step sees $GREETING as $(id -u 2>/dev/null || echo $UID)"
"""


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, python_image: str, registry_server: Any
) -> Iterator[dict[str, Any]]:
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed (./install.sh installs it)")
    tmp = tmp_path_factory.mktemp("dsec-build")
    host = registry_server.url.removeprefix("http://")
    oci_images.make_layout(tmp / "base")
    oci_images.push(tmp / "base", f"{host}/t/base:1")
    extra = {"DSEC_EDGE_PULL_LOCAL_REGISTRIES": json.dumps([host]), "DSEC_EDGE_FNCALL_IMAGE": ""}
    with dsec_up(tmp, extra) as svc:
        tokens = tenants(svc, "pa", "pb")
        yield {"svc": svc, "base": f"{host}/t/base:1", "tokens": tokens, "tmp": tmp}


def _context(d: Path, dockerfile: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "Dockerfile").write_text(dockerfile)
    (d / "hello.txt").write_text("hello\n")
    return d


def test_a_project_builds_over_http_and_runs_the_image(world: dict[str, Any], tmp_path: Path) -> None:
    ctx = _context(tmp_path / "ctx", DOCKERFILE)
    lines: list[str] = []
    with Client(world["svc"].url, world["tokens"]["pa"]) as pa:
        image = pa.build_image(
            ctx, "app:1", project="pa", build_args={"BASE": world["base"]}, on_log=lines.append
        )
        assert image["name"] == "pa/app:1" and image["digest"].startswith("sha256:")
        assert image["config"]["workdir"] == "/app" and image["config"]["env"]["GREETING"] == "hello"
        assert any("step sees hello as 1234" in line for line in lines), lines[-20:]
        shutil.rmtree(ctx)  # the context was uploaded: nothing of the client's is read later
        with pa.create("pa/app:1", project="pa", memory_mb=128) as sb:
            r = sb.exec('echo "$(<made) $(<hello.txt) $UID $PWD"')
            assert r.stdout == "built-in-stage-one hello 1234 /app\n", r
        # A failing step names itself and shows its output; nothing is stored under the name.
        bad = _context(tmp_path / "bad", "ARG BASE\nFROM $BASE\nRUN echo about-to-fail; exit 3\n")
        with pytest.raises(errors.InvalidRequest) as e:
            pa.build_image(bad, "bad:1", project="pa", build_args={"BASE": world["base"]})
        assert e.value.details.get("reason") == "build_failed", e.value
        assert "RUN echo about-to-fail" in e.value.message and "about-to-fail" in str(
            e.value.details.get("tail")
        )
        with pytest.raises(errors.ImageNotFound):
            pa.image("pa/bad:1")
    with Client(world["svc"].url, world["tokens"]["pb"]) as pb:
        with pytest.raises(errors.Forbidden):  # not into another project
            pb.build_image(bad, "x:1", project="pa", build_args={"BASE": world["base"]})
        with pytest.raises(errors.DsecError) as e:  # nor a shared image
            pb.build_image(bad, "x:1", build_args={"BASE": world["base"]})
        assert e.value.status == 403


def test_the_cli_builds_with_tag_and_file(world: dict[str, Any], tmp_path: Path) -> None:
    ctx = _context(tmp_path / "ctx", "")
    (ctx / "build.Dockerfile").write_text(DOCKERFILE)
    env = {**os.environ, "DSEC_URL": world["svc"].url, "DSEC_TOKEN": world["tokens"]["pa"]}
    r = subprocess.run(
        [*DSEC, "image", "build", "-t", "cli:1", "-f", "build.Dockerfile", "--project", "pa",
         "--build-arg", f"BASE={world['base']}", "--json", str(ctx)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["name"] == "pa/cli:1"
