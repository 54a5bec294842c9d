"""Every code block of README.md, run as written (#25): the README cannot drift from what dsec
does. The block marked `service` (`./install.sh up`) is the `dsec up` the others talk to; the
others run in order, `sh` in bash from the checkout, `python` in the venv's Python, and must
succeed. A block is left out only with a `<!-- readme-test: skip (why) -->` line above it.

What the blocks see is what a user's machine has after `./install.sh up`, moved aside so the
test runs next to others: the service's data dir, port, run dir and client config are this
test's own (DSEC_DATA_DIR, `--port`, DSEC_EDGE_RUN_DIR, DSEC_CONFIG); the cluster's directory
is `cluster` inside that data dir, as /var/lib/dsec/cluster is by default (DSEC_CLUSTER_DIR);
the layer store is the tests' shared one (DSEC_EDGE_LAYERS_DIR)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.service import free_port

from ..conftest import LAYERS
from .conftest import DSEC, remove_run_dir, stop_all, wait_healthy

pytestmark = [pytest.mark.root, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARK = re.compile(r"^<!-- readme-test: (service|skip) \((.+)\) -->$")
FENCE = re.compile(r"^```([\w-]*)\s*$")
RUNNABLE = ("sh", "python")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence
    lang: str
    code: str
    mark: str = ""  # "service" or "skip"
    why: str = ""


def parse(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with the readme-test mark on the line above."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        mark = MARK.match(lines[start - 1]) if start > 0 else None
        out.append(
            Block(start + 1, m.group(1), "\n".join(body) + "\n", *(mark.groups() if mark else ("", "")))
        )
        i += 1
    return out


BLOCKS = parse(README.read_text())


def test_every_block_runs_or_says_why() -> None:
    service = [b for b in BLOCKS if b.mark == "service"]
    assert len(service) == 1 and service[0] is BLOCKS[0], "the first block must be the service"
    for b in BLOCKS:
        assert b.lang in RUNNABLE or b.mark == "skip", (
            f"README.md:{b.line}: a ```{b.lang} block cannot run: use sh or python, "
            "or mark it `<!-- readme-test: skip (why) -->`"
        )


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The service block started (in the background) and the environment every block gets."""
    tmp = tmp_path_factory.mktemp("readme")
    data = tmp / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
    env.update(
        DSEC_DATA_DIR=str(data),
        DSEC_CONFIG=str(tmp / "client.json"),
        DSEC_CLUSTER_DIR=str(data / "cluster"),
        DSEC_EDGE_LAYERS_DIR=str(LAYERS),
        DSEC_EDGE_RUN_DIR=f"/run/dsec-readme-{secrets.token_hex(4)}",
        DSEC_EDGE_NAME="r" + secrets.token_hex(4),
        DSEC_EDGE_FNCALL_IMAGE="",  # (no block makes a stateless call: no workers)
    )
    port = free_port()
    log = tmp / "service.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            ["bash", "-c", BLOCKS[0].code.strip() + f" --port {port}"],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240  # (install.sh builds an image whose recipe changed)
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(TimeoutError):
                wait_healthy(f"http://127.0.0.1:{port}", timeout=1)
                break
        # install.sh ends in `exec dsec up`: the process started is the service itself
        assert b"up" in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        yield env
    finally:
        _cluster_down(env)  # (a cluster block that failed half way)
        stop_all({"up": proc})
        remove_run_dir(env["DSEC_EDGE_RUN_DIR"])
    assert proc.returncode in (0, -15), log.read_text()[-3000:]


def _cluster_down(env: dict[str, str]) -> None:
    if (Path(env["DSEC_CLUSTER_DIR"]) / "cluster.json").exists():
        subprocess.run([*DSEC, "cluster", "down", "--purge"], env=env, capture_output=True, timeout=300)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}-{b.lang}" for b in BLOCKS])
def test_readme_block(block: Block, readme_env: dict[str, str]) -> None:
    if block.mark == "skip":
        pytest.skip(block.why)
    if block.mark == "service":
        return  # (readme_env runs it)
    argv = ["bash", "-euo", "pipefail", "-c", block.code]
    if block.lang == "python":
        argv = [sys.executable, "-c", block.code]
    try:
        r = subprocess.run(argv, cwd=ROOT, env=readme_env, capture_output=True, text=True, timeout=280)
    finally:
        _cluster_down(readme_env)
    assert r.returncode == 0, (
        f"README.md:{block.line} failed (exit {r.returncode}):\n{block.code}\n"
        f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    )


def test_a_protected_path_the_image_lacks_says_what_to_do(readme_env: dict[str, str]) -> None:
    """`create(protected_paths=["/grader"])` on an image without /grader: refused (no sandbox
    left), and the message gives the sequence the README shows."""
    from dsec import errors
    from dsec.client import Client

    cfg = json.loads(Path(readme_env["DSEC_CONFIG"]).read_text())
    with Client(cfg["url"], cfg["token"]) as c:
        with pytest.raises(errors.FileNotFound) as refused:
            c.create("python", protected_paths=["/grader"])
        assert "/grader" in refused.value.message
        assert "sb.protect([path])" in refused.value.message and "snapshot" in refused.value.message
        assert c.list() == []
