"""The API fuzz (bench/fuzz_api.py) shortened for CI: schemathesis against `/openapi.json` of a
real `dsec up`, as the admin. Any 5xx or response that breaks its documented schema fails.
The bugs it found are kept below as exact reproducers (regressions)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench._service import Target
from bench.fuzz_api import Fuzzer

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

FUZZ_SECONDS = 60.0

# Bugs the fuzz found, fixed: (id, reproducer: request args, what it was). Each must answer 4xx.
REGRESSIONS: list[tuple[str, dict[str, Any], str]] = [
    (
        "trajectory-after-seq-overflow-500",
        {"method": "GET", "url": "/v1/sandboxes/{sid}/trajectory", "params": {"after_seq": -(2**72)}},
        "a trajectory read with after_seq outside SQLite's integer range -> OverflowError -> 500",
    ),
    (
        "fncall-nul-in-file-name-500",
        {
            "method": "POST",
            "url": "/v1/fncall/jupyter",
            "json": {"cells": ["1"], "fetch_files": ["a\u0000b"], "files": {"": None}},
        },
        "fncall: a NUL byte in a file name reached the runner ('embedded null byte') -> 500",
    ),
    (
        "sandboxfusion-invalid-field-500",
        {"method": "POST", "url": "/run_code", "json": {"code": "print(1)", "compile_timeout": -1}},
        "SandboxFusion /run_code and /run_jupyter (and /sandboxfusion/{token}/...) build FnCallRequest / "
        "JupyterRequest inside the handler: an out-of-range field (compile_timeout <= 0, total_timeout 0, "
        "memory_limit_MB < -1) raises pydantic ValidationError -> 500 instead of 400",
    ),
    (
        "fncall-non-ascii-file-500",
        {
            "method": "POST",
            "url": "/v1/fncall/run",
            "json": {"code": "print(1)", "language": "python", "files": {"a.txt": "\u00e9"}},
        },
        "fncall: a `files` value that is not ASCII base64 reaches the runner's b64decode -> "
        "'runner failure: ValueError' answered as 500 internal instead of 400 invalid_request",
    ),
    (
        "step-index-overflow-500",
        {
            "method": "POST",
            "url": "/v1/sandboxes/{sid}/exec",
            "json": {"cmd": "true", "step": {"trajectory": "t", "index": 2**64}},
        },
        "a step index >= 2**63 (Step.index has no upper bound) -> 'OverflowError: Python int too large "
        "to convert to SQLite INTEGER' in the trajectory log -> 500 on every logged call (exec, verify, "
        "files PUT/edit, sessions)",
    ),
    (
        "workdir-on-another-mount-500",
        {"method": "POST", "url": "/v1/sandboxes", "json": {"image": "python", "workdir": "/proc/self"}},
        "a workdir on another mount (/proc): the worded path_escape was caught as an OSError and "
        "re-mapped with no errno -> 'internal: /proc/self: None' 500 (round three)",
    ),
    (
        "argv-of-70000-items-500",
        {"method": "POST", "url": "/v1/sandboxes/{sid}/exec", "json": {"cmd": ["true", *["x"] * 70_000]}},
        "more than 65,535 argv items overflowed the spawn message's 16-bit count: struct.error -> 500",
    ),
    (
        "cwd-not-a-directory-500",
        {"method": "POST", "url": "/v1/sandboxes/{sid}/exec", "json": {"cmd": "pwd", "cwd": "/dev/null"}},
        "an exec whose cwd is not a directory: ENOTDIR from the spawn -> 'internal' 500",
    ),
    (
        "scrub-double-slash-500",
        {"method": "POST", "url": "/v1/sandboxes/{sid}/snapshot", "json": {"scrub": ["//"]}},
        "a scrub path of '//' (POSIX normpath keeps a leading //) -> ValueError in relative_to -> 500",
    ),
    (
        "protect-double-slash",
        {"method": "POST", "url": "/v1/sandboxes/{sid}/protect", "json": {"paths": ["//"]}},
        "protecting '//' (normpath keeps it: not seen as /)",
    ),
]


def _target(service: Any) -> Target:
    return Target(
        url=service.url,
        token=service.token,
        pid=service.procs["up"].pid,
        edge=service.env["DSEC_EDGE_NAME"],
        run_dir=Path(service.env["DSEC_EDGE_RUN_DIR"]),
        data_dir=service.data_dir,
        log=service.data_dir.parent / "up.log",
    )


@pytest.fixture(scope="module")
def fuzz(service: Any) -> Iterator[Fuzzer]:
    fz = Fuzzer(
        _target(service),
        max_examples=15,
        request_timeout=20,
        seed=12345,
        derandomize=True,
        deadline=time.monotonic() + FUZZ_SECONDS,
    )
    try:
        fz.fuzz_all()
    finally:
        fz.close()
    yield fz


@pytest.mark.timeout(150)
def test_fuzz_finds_no_unknown_bugs(fuzz: Fuzzer) -> None:
    assert fuzz.calls > 200, "the fuzz sent too few requests to mean anything"
    found = list(fuzz.findings.values())
    assert not found, "\n".join(f.render() for f in found)


@pytest.mark.parametrize("request_args", [pytest.param(args, id=bug_id) for bug_id, args, _ in REGRESSIONS])
def test_known_bug_is_fixed(service: Any, request_args: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {service.token}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as http:
        sid = None
        args = dict(request_args)
        if "{sid}" in args["url"]:
            sid = http.post("/v1/sandboxes", json={"image": "python", "memory_mb": 256}).json()["id"]
            args["url"] = args["url"].format(sid=sid)
        try:
            r = http.request(**args)
        finally:
            if sid:
                http.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code < 500, f"{r.status_code} {r.text[:300]}"
