"""deploy/Containerfile and deploy/build-images, parsed (no build: tests/integration/
test_container_images.py builds and runs the images, opt-in).

The image recipe agrees with the manifests that run it: the base is an argument, the apiserver
stage runs as the uid apiserver.yaml demands, the entrypoints and ports are the ones the
manifests use, the build context lets in what the COPYs need, build-images tags what the
manifests pull.
"""

from __future__ import annotations

import fnmatch
import io
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
BUILD_IMAGES = ROOT / "deploy" / "build-images"
IGNORE = ROOT / ".containerignore"
K8S = ROOT / "deploy" / "kubernetes"


def instructions() -> list[dict[str, Any]]:
    parser = DockerfileParser(fileobj=io.BytesIO(CONTAINERFILE.read_bytes()))
    return list(parser.structure)


def stages() -> dict[str, list[dict[str, Any]]]:
    """Instructions by stage name (the FROM's `AS`), in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for ins in instructions():
        if ins["instruction"] == "FROM":
            name = ins["value"].split()[-1]
            current = out.setdefault(name, [])
        if current is not None:
            current.append(ins)
    return out


def values(stage: list[dict[str, Any]], instruction: str) -> list[str]:
    return [str(i["value"]) for i in stage if i["instruction"] == instruction]


def manifest_container(file: str, name: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((K8S / file).read_text()):
        if doc and doc["kind"] in ("Deployment", "DaemonSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] == name:
                    return dict(c)
    raise AssertionError(f"no container {name} in {file}")


def pod_security(file: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((K8S / file).read_text()):
        if doc and doc["kind"] in ("Deployment", "DaemonSet"):
            return dict(doc["spec"]["template"]["spec"].get("securityContext", {}))
    raise AssertionError(f"no workload in {file}")


def test_the_base_is_an_argument_with_debian_12_slim_as_default() -> None:
    first_from = next(i for i in instructions() if i["instruction"] == "FROM")
    args = [
        i for i in instructions() if i["instruction"] == "ARG" and i["startline"] < first_from["startline"]
    ]
    assert [a["value"] for a in args] == ["BASE=docker.io/library/debian:bookworm-slim"]
    assert first_from["value"] == "${BASE} AS python"
    # every other stage builds on a stage of this file: the base is the only image pulled
    names = list(stages())
    for ins in instructions():
        if ins["instruction"] == "FROM" and ins["startline"] != first_from["startline"]:
            assert ins["value"].split()[0] in names, ins["value"]


def test_the_targets_and_the_default() -> None:
    names = list(stages())
    assert names == ["python", "build", "apiserver", "edge"]  # edge last: the default target


def test_the_apiserver_stage_runs_as_the_uid_its_manifest_demands() -> None:
    stage = stages()["apiserver"]
    sec = pod_security("apiserver.yaml")
    assert sec["runAsNonRoot"] is True
    assert values(stage, "USER") == [f"{sec['runAsUser']}:{sec['runAsGroup']}"]
    assert f"--uid {sec['runAsUser']}" in " ".join(values(stage, "RUN"))
    c = manifest_container("apiserver.yaml", "apiserver")
    assert json.loads(values(stage, "ENTRYPOINT")[0]) == c["command"]
    assert values(stage, "EXPOSE") == [str(c["ports"][0]["containerPort"])]


def test_the_edge_stage_runs_as_root_with_the_entrypoint_its_manifest_calls() -> None:
    stage = stages()["edge"]
    assert values(stage, "USER") == []  # root: it is a container runtime (edge.yaml)
    c = manifest_container("edge.yaml", "edge")
    assert json.loads(values(stage, "ENTRYPOINT")[0]) == c["command"]
    assert values(stage, "EXPOSE") == [str(c["ports"][0]["containerPort"])]


def ignored(path: str) -> bool:
    """.containerignore's verdict on a context path (its last matching pattern wins)."""
    verdict = False
    for line in IGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").removeprefix("**/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(parts[-1], pattern):
            verdict = not negate
    return verdict


def test_the_build_context_lets_in_what_the_copies_need_and_no_venv() -> None:
    sources = []
    for ins in instructions():
        if ins["instruction"] == "COPY" and not ins["value"].startswith("--from"):
            sources += ins["value"].split()[:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src), f".containerignore leaves out {src}"
    assert ignored(".venv") and ignored(".git") and ignored("src/dsec/__pycache__")


def test_the_pip_ca_secret_is_the_one_build_images_passes() -> None:
    build = " ".join(values(stages()["build"], "RUN"))
    assert "--mount=type=secret,id=pip-ca" in build
    assert "id=pip-ca,src=" in BUILD_IMAGES.read_text()


def test_build_images_tags_what_the_manifests_pull() -> None:
    text = BUILD_IMAGES.read_text()
    defaults = dict(re.findall(r"\$\{(DSEC_(?:EDGE|APISERVER)_IMAGE):-([^}]+)\}", text))
    assert defaults["DSEC_EDGE_IMAGE"] == manifest_container("edge.yaml", "edge")["image"]
    assert defaults["DSEC_APISERVER_IMAGE"] == manifest_container("apiserver.yaml", "apiserver")["image"]
    assert '--build-arg "BASE=$base"' in text


def test_the_scripts_are_posix_sh() -> None:
    for script in (BUILD_IMAGES, ROOT / "deploy" / "container" / "dsec-k8s-edge"):
        assert script.read_text().startswith("#!/bin/sh\n")
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        subprocess.run(["sh", "-n", str(script)], check=True)
