"""Dockerfile builds through buildah (dsec.layers.dockerbuild): real builds from a base image
in a local registry, the step cache, failures named by their step, and the attacks a
tenant's Dockerfile or context can try."""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.cluster.registry import RegistryServer, find_registry_bin, free_port
from dsec.isolation.cgroups import CgroupHost
from dsec.isolation.idranges import RANGE, IdRanges
from dsec.layers import LayerStore
from dsec.layers.dockerbuild import Builder, BuildLimits, BuildSpec
from dsec.layers.pull import PullPolicy

from . import oci_images

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed")
    try:
        find_registry_bin()
    except errors.DsecError as e:
        pytest.skip(str(e))
    root = Path(tempfile.mkdtemp(prefix="dsec-build-", dir="/tmp"))
    root.chmod(0o755)
    server = RegistryServer(root / "registry", port=free_port())
    try:
        server.start()
        host = f"127.0.0.1:{server.port}"
        oci_images.make_layout(root / "base", files={"etc/secret": b"base\n"})
        oci_images.push(root / "base", f"{host}/t/base:1")
        builder = Builder(
            LayerStore(root / "layers"), root / "builds",
            ranges=IdRanges(root / "ids", 100000 + RANGE), cgroups=CgroupHost.detect(),
            policy=PullPolicy(frozenset({host})), limits=BuildLimits(memory_bytes=512 << 20, timeout_s=120),
        )  # fmt: skip
        yield {"root": root, "host": host, "builder": builder}
    finally:
        server.remove()
        shutil.rmtree(root, ignore_errors=True)


def _tar(files: dict[str, bytes | str], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(raw), 1_700_000_000
            tf.addfile(info, io.BytesIO(raw))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return buf.getvalue()


def _build(env: dict[str, Any], files: dict[str, bytes | str], links: dict[str, str] | None = None,
           project: str = "p") -> tuple[Any, list[str]]:  # fmt: skip
    tar = env["root"] / "ctx.tar"
    tar.write_bytes(_tar(files, links))
    lines: list[str] = []
    image = env["builder"].build(
        BuildSpec(name=f"{project}/out:1", project=project), tar, lambda e: lines.append(e["line"])
    )
    return image, lines


def _multistage(host: str, last: str) -> str:
    return f"""# syntax is buildah's
ARG BASE={host}/t/base:1
FROM $BASE AS first
RUN echo built > /built
FROM ${{BASE}}
ENV GREETING=hello PATH=/opt/bin:/usr/bin:/bin
WORKDIR /app
COPY --from=first /built /app/built
COPY hello.txt ./
RUN <<EOF
read l < /app/built; echo "heredoc saw $l"
read l < /proc/self/uid_map; echo "uid_map $l"
EOF
USER 1234
ENTRYPOINT ["/bin/sh", "-c"]
RUN {last}
"""


def test_multistage_build_then_rebuild_reuses_every_step_but_the_changed_last(env: dict[str, Any]) -> None:
    files: dict[str, bytes | str] = {"Dockerfile": _multistage(env["host"], "echo one"), "hello.txt": "hi\n",
                                     ".dockerignore": "secret.txt\n", "secret.txt": "no\n"}  # fmt: skip
    image, lines = _build(env, files)
    out = "\n".join(lines)
    assert "heredoc saw built" in out
    uid_line = next(ln for ln in lines if ln.startswith("uid_map"))
    assert int(uid_line.split()[2]) >= 100000 + RANGE  # RUN is root of a userns of unprivileged ids
    assert image.config.env["GREETING"] == "hello" and image.config.env["PATH"] == "/opt/bin:/usr/bin:/bin"
    assert image.config.workdir == "/app" and image.config.user == "1234"
    assert image.config.entrypoint == ["/bin/sh", "-c"]
    assert image.source["type"] == "build" and image.source["project"] == "p"

    files["Dockerfile"] = _multistage(env["host"], "echo two")
    image2, lines = _build(env, files)
    out = "\n".join(lines)
    assert out.count("Using cache") >= 8, out  # every step before the last
    assert "two" in lines and "one" not in lines
    assert image2.layers[:-1] == image.layers[:-1] and image2.layers[-1] != image.layers[-1]


def test_a_failing_run_names_its_step_and_shows_its_output(env: dict[str, Any]) -> None:
    df = (
        f"FROM {env['host']}/t/base:1\nRUN echo fine\nRUN echo about to fail; echo oops >&2; exit 3\n"
        "RUN echo never\n"
    )
    with pytest.raises(errors.InvalidRequest) as e:
        _build(env, {"Dockerfile": df})
    assert e.value.details["reason"] == "build_failed"
    msg = str(e.value)
    assert "step 3/4 RUN echo about to fail" in msg and "exit 3" in msg and "oops" in msg


def test_run_has_no_network(env: dict[str, Any]) -> None:
    # the registry answers on this host: a RUN step must not reach it (nor anything else)
    port = env["host"].rsplit(":", 1)[1]
    df = f"FROM {env['host']}/t/base:1\nRUN exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNEC''TED\n"
    with pytest.raises(errors.InvalidRequest) as e:
        _build(env, {"Dockerfile": df})
    assert "\nCONNECTED" not in str(e.value) and "step 2/2" in str(e.value)
    assert "Connection refused" in str(e.value) or "unreachable" in str(e.value)


def test_a_context_link_pointing_out_is_refused(env: dict[str, Any]) -> None:
    df = f"FROM {env['host']}/t/base:1\nCOPY etc/ /stolen/\n"
    for target in ("/etc", "../../../../etc"):
        with pytest.raises(errors.PathEscape):
            _build(env, {"Dockerfile": df}, links={"etc": target})


@pytest.mark.parametrize(
    "line",
    [
        "RUN --mount=type=bind,source=/,target=/host cat /host/etc/shadow",
        "RUN --mount=type=bind,source=../..,target=/host true",
        "RUN --mount=type=cache,target=/c,source=../../../ true",
        "RUN --network=host true",
        "ADD http://example.com/x /x",
    ],
)
def test_host_and_network_reaching_instructions_are_refused(env: dict[str, Any], line: str) -> None:
    with pytest.raises(errors.InvalidRequest) as e:
        _build(env, {"Dockerfile": f"FROM {env['host']}/t/base:1\n{line}\n"})
    assert e.value.details["reason"] == "dockerfile_refused"


def test_from_scratch(env: dict[str, Any]) -> None:
    image, _ = _build(
        env, {"Dockerfile": 'FROM scratch\nCOPY hello.txt /\nCMD ["/hello.txt"]\n', "hello.txt": "x"}
    )
    assert image.config.cmd == ["/hello.txt"] and len(image.layers) == 1


def test_a_build_that_would_fill_the_edges_disk_is_stopped(env: dict[str, Any]) -> None:
    """No disk quota for builds yet: the builder keeps the disk it writes to from filling (here
    a floor above the disk's size, so the first command is stopped at once)."""
    import os

    st = os.statvfs(env["root"])
    b: Builder = env["builder"]
    full = Builder(
        b.store, b.root, ranges=b.ranges, cgroups=b.cgroups, policy=b.policy,
        limits=BuildLimits(timeout_s=120, min_free_bytes=st.f_blocks * st.f_frsize + 1),
    )  # fmt: skip
    tar = env["root"] / "ctx-full.tar"
    tar.write_bytes(_tar({"Dockerfile": "FROM scratch\nCOPY a /\n", "a": "x"}))
    with pytest.raises(errors.QuotaExceeded) as e:
        full.build(BuildSpec(name="p/full:1", project="p"), tar, lambda ev: None)
    assert e.value.details["reason"] == "build_disk"
