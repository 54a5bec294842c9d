"""API fuzz: schemathesis against the OpenAPI document of a running `dsec up`, as the admin.

    .venv/bin/python bench/fuzz_api.py [--max-examples 50] [--time-limit 600] [--seed N]

Every operation of `/openapi.json` gets positive (schema-valid) and negative (schema-invalid)
examples; a finding is any 5xx response, any documented response whose body does not match its
schema, or a request that does not answer within `--request-timeout`. Findings are deduplicated
by (operation, kind, status) and printed with a reproducing curl command, the response, and
the service log lines (traceback) it wrote during that request. Exit 1 if there are findings.

To reach the real handlers instead of 404s, generated data is steered (`Fuzzer.prepare`):
  - path ids (`sid`, `ses`, `cid`, snapshot `name`, `token`) are, most of the time, live objects
    made for the operation: each operation gets fresh sandboxes (one paused if it matters), a
    bash session, the admin token;
  - counts are bounded (batch create count, fork n, pool sizes and prewarm count <= 2) and every
    `*timeout*` field is capped at 5 s, so one example cannot start hundreds of sandboxes or
    sleep for a day;
  - `images/build` recipes and `images/import` names get a `fuzz-` prefix: the layer store is
    shared with other runs and a real recipe would rebuild for minutes;
  - `GET /v1/events` is excluded: an endless SSE stream, no response to check; so are the token
    rotate/revoke calls, which would end the fuzzer's own admin token.
Snapshots and checkpoints the fuzz made are deleted at the end, sandboxes after each operation.

`Fuzzer` is the same logic for tests (tests/e2e/test_fuzz.py runs it shortened).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import hypothesis
import hypothesis.errors
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

try:
    from bench._service import Target, running_service
except ImportError:  # run as a script: bench/ is on sys.path
    from _service import Target, running_service  # type: ignore[no-redef]

EXCLUDED = {
    ("GET", "/v1/events"),  # an endless event stream: nothing to validate
    # these end the fuzzer's own (admin) credential, and every later request would be a 401
    ("POST", "/v1/token/rotate"),
    ("POST", "/v1/token/revoke"),
    ("POST", "/v1/principals/{who}/rotate"),
    ("POST", "/v1/principals/{who}/revoke"),
}
CHECKS = [not_a_server_error, response_schema_conformance]
BOUNDED = {"count": 2, "n": 2, "min_size": 2, "max_size": 2}
TIMEOUT_CAP = 5.0
# Random strings rarely name a path that means something inside a sandbox, and random lists are
# short: path-like fields sometimes get one of these, and string lists sometimes grow past every
# 16-bit count (both found 500s: a workdir of /proc/self, an argv of 70,000 items).
PATH_FIELDS = {"workdir", "cwd", "path", "dest", "src", "dir", "remote_path", "scrub", "protected_paths"}
NASTY_PATHS = [
    "/proc/self",
    "/proc/1/root",
    "/proc/self/fd/0",
    "/dev/null",
    "/dev/zero",
    "/sys/fs/cgroup",
    "/",
    "/..",
    "/work/../../etc",
    "//",
    "/etc/passwd/x",
    "/tmp/" + "a" * 300,
    "relative",
]
LONG_LIST = 70_000


@dataclass
class Finding:
    operation: str  # "POST /v1/sandboxes/{sid}/exec"
    kind: str  # "5xx" | "schema" | "timeout" | "transport"
    status: int | None
    title: str
    curl: str
    response: str
    log: str = ""
    count: int = 1

    @property
    def key(self) -> tuple[str, str, int | None]:
        return (self.operation, self.kind, self.status)

    def render(self) -> str:
        out = [
            f"[{self.kind}] {self.operation} -> {self.status} ({self.count}x): {self.title}",
            f"    request: {self.curl}",
            f"    response: {self.response}",
        ]
        if self.log:
            tail = self.log.splitlines()[-14:]  # the end of the traceback: dsec's frames and the error
            out.append("    service log:\n" + "\n".join("      " + ln for ln in tail))
        return "\n".join(out)


@dataclass
class Fuzzer:
    """Fuzz every operation of a running service `t` (admin token)."""

    t: Target
    max_examples: int = 25
    request_timeout: float = 30.0
    seed: int | None = None
    derandomize: bool = False
    deadline: float = float("inf")  # time.monotonic() after which no more requests are sent
    findings: dict[tuple[str, str, int | None], Finding] = field(default_factory=dict)
    calls: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.auth = {"Authorization": f"Bearer {self.t.token}", "X-API-Key": self.t.token}  # X-: swerex
        self.schema = schemathesis.openapi.from_url(
            self.t.url + "/openapi.json", headers=self.auth, timeout=30
        )
        self.http = httpx.Client(base_url=self.t.url, headers=self.auth, timeout=120)
        self.session = requests.Session()
        self.rng = random.Random(self.seed)
        self.live: dict[str, Any] = {}
        self.snapshots: set[str] = set()
        self.checkpoints: set[str] = set()

    def close(self) -> None:
        for name in self.snapshots:
            with contextlib.suppress(httpx.HTTPError):
                self.http.delete(f"/v1/snapshots/{name}")
        for cid in self.checkpoints:
            with contextlib.suppress(httpx.HTTPError):
                self.http.delete(f"/v1/checkpoints/{cid}")
        self._stop_all()
        self.http.close()
        self.session.close()

    # ------------------------------------------------------------------ operations

    def operations(self) -> list[Any]:
        ops = []
        for result in self.schema.get_all_operations():
            op = result.ok()
            if (op.method.upper(), op.path) not in EXCLUDED:
                ops.append(op)
        return ops

    @staticmethod
    def label(op: Any) -> str:
        return f"{op.method.upper()} {op.path}"

    # ------------------------------------------------------------------ fixtures per operation

    def _stop_all(self) -> None:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            sbs = self.http.get("/v1/sandboxes").json()["sandboxes"]
            ids = [s["id"] for s in sbs if not s["spec"]["project"].startswith("_")]  # not fncall workers
            if ids:
                self.http.post("/v1/sandboxes/batch_stop", json={"ids": ids})
        with contextlib.suppress(httpx.HTTPError):  # pools the fuzz configured keep no sandboxes
            for p in self.http.get("/v1/pools").json().get("pools", []):
                spec = {k: v for k, v in p.items() if k in ("image", "cpu", "memory_mb", "pids", "disk_mb")}
                if spec:
                    self.http.post("/v1/pools", json={**spec, "min_size": 0, "max_size": 0})

    def _fixtures(self, op: Any) -> None:
        """Fresh live objects for one operation (the previous one may have wiped or stopped them)."""
        self._stop_all()
        self.live = {}
        if "{sid}" not in op.path:
            return
        ids = []
        for _ in range(2):
            r = self.http.post("/v1/sandboxes", json={"image": "python", "memory_mb": 256, "cpu": 0.5})
            r.raise_for_status()
            ids.append(r.json()["id"])
        self.live["sid"] = ids
        if "{ses}" in op.path:
            r = self.http.post(f"/v1/sandboxes/{ids[0]}/sessions", json={"kind": "bash"})
            if r.is_success:
                self.live["ses"] = [r.json()["id"]]

    # ------------------------------------------------------------------ steering generated data

    def _pick(self, key: str, generated: Any) -> Any:
        pool = self.live.get(key) or []
        if key == "name":
            pool = sorted(self.snapshots)
        elif key == "cid":
            pool = sorted(self.checkpoints)
        elif key == "token":
            pool = [self.t.token]
        if pool and self.rng.random() < 0.85:
            return self.rng.choice(pool)
        return generated

    def _bound(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    if "timeout" in k and v > TIMEOUT_CAP:
                        v = TIMEOUT_CAP
                    elif k in BOUNDED and v > BOUNDED[k]:
                        v = BOUNDED[k]
                elif k in ("recipe",) and isinstance(v, str):
                    v = "fuzz-" + v
                elif k == "image" and isinstance(v, str) and self.rng.random() < 0.5:
                    v = "python"
                elif k in PATH_FIELDS and isinstance(v, str) and self.rng.random() < 0.3:
                    v = self.rng.choice(NASTY_PATHS)
                elif k in PATH_FIELDS and isinstance(v, list) and self.rng.random() < 0.3:
                    v = [self.rng.choice(NASTY_PATHS)]
                elif isinstance(v, list) and v and isinstance(v[0], str) and self.rng.random() < 0.05:
                    v = (v * (LONG_LIST // len(v) + 1))[:LONG_LIST]
                out[k] = self._bound(v, path)
            return out
        if isinstance(value, list):
            return [self._bound(v, path) for v in value]
        return value

    def prepare(self, case: Any) -> None:
        if case.path_parameters:
            case.path_parameters = {k: self._pick(k, v) for k, v in case.path_parameters.items()}
        if isinstance(case.query, dict):
            q = dict(case.query)
            if case.operation.path == "/v1/images/import" and isinstance(q.get("name"), str):
                q["name"] = "fuzz-" + q["name"]
            for k in PATH_FIELDS & q.keys():
                if isinstance(q[k], str) and self.rng.random() < 0.3:
                    q[k] = self.rng.choice(NASTY_PATHS)
            case.query = q
        if isinstance(case.body, dict | list):
            body = self._bound(case.body, case.operation.path)
            if case.operation.path == "/v1/sandboxes/batch_stop" and isinstance(body, dict):
                ids = body.get("ids")
                if isinstance(ids, list) and self.live.get("sid") and self.rng.random() < 0.5:
                    body["ids"] = [*ids[:2], self.live["sid"][-1]]
            case.body = body

    # ------------------------------------------------------------------ running

    def _log_offset(self) -> int:
        return self.t.log.stat().st_size if self.t.log and self.t.log.exists() else 0

    def _log_since(self, offset: int) -> str:
        if not self.t.log or not self.t.log.exists():
            return ""
        with open(self.t.log, "rb") as f:
            f.seek(offset)
            return f.read(64 * 1024).decode(errors="replace")

    def _record(self, f: Finding) -> None:
        old = self.findings.get(f.key)
        if old is None:
            self.findings[f.key] = f
        else:
            old.count += 1
            if not old.log and f.log:
                old.log = f.log

    def _remember(self, case: Any, response: Any) -> None:
        if response.status_code != 201:
            return
        with contextlib.suppress(ValueError, AttributeError):
            body = response.json()
            if case.operation.path.endswith("/snapshot"):
                self.snapshots.add(body["id"])
            elif case.operation.path.endswith("/checkpoint"):
                self.checkpoints.add(body["id"])

    def run_case(self, case: Any) -> None:
        if time.monotonic() > self.deadline:
            return
        self.prepare(case)
        op = self.label(case.operation)
        offset = self._log_offset()
        self.calls += 1
        try:
            response = case.call(
                base_url=self.t.url, session=self.session, headers=self.auth, timeout=self.request_timeout
            )
        except requests.Timeout:
            curl = case.as_curl_command(headers=self.auth)
            self._record(Finding(op, "timeout", None, f"no answer in {self.request_timeout} s", curl, ""))
            return
        except requests.RequestException as e:
            curl = case.as_curl_command(headers=self.auth)
            log = self._log_since(offset)
            self._record(Finding(op, "transport", None, f"{type(e).__name__}: {e}", curl, "", log))
            return
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        self._remember(case, response)
        try:
            case.validate_response(response, checks=CHECKS, headers=self.auth)
        except (FailureGroup, Failure) as group:
            failures = list(group.exceptions) if isinstance(group, FailureGroup) else [group]
            curl = case.as_curl_command(headers=self.auth)
            text = response.content[:600].decode(errors="replace")
            if (
                response.status_code == 511
                and case.operation.path.startswith("/swerex/")
                and b"swerexception" in (response.content or b"")
            ):
                return  # SWE-ReX's protocol: a remote exception is HTTP 511 with its class (docs/API.md)
            for failure in failures:
                kind = "5xx" if response.status_code >= 500 else "schema"
                title = (failure.title or type(failure).__name__) + ": " + failure.message.strip()[:400]
                self._record(
                    Finding(op, kind, response.status_code, title, curl, text, self._log_since(offset))
                )

    def fuzz(self, op: Any, modes: tuple[str, ...] = ("positive", "negative")) -> None:
        """`max_examples` examples per generation mode of one operation."""
        if time.monotonic() > self.deadline:
            return
        try:
            self._fixtures(op)
        except httpx.HTTPError as e:
            self._record(Finding(self.label(op), "fixture", None, f"could not set up: {e}", "", ""))
            return
        for mode in modes:
            strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

            @hypothesis.given(case=strategy)
            @hypothesis.settings(
                max_examples=self.max_examples,
                deadline=None,
                database=None,
                derandomize=self.derandomize,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: findings are collected, not raised
                suppress_health_check=list(HealthCheck),
                verbosity=hypothesis.Verbosity.quiet,
            )
            def run(case: Any) -> None:
                self.run_case(case)

            if self.seed is not None:
                run = hypothesis.seed(self.seed)(run)
            with contextlib.suppress(hypothesis.errors.Unsatisfiable):  # e.g. nothing to negate
                run()

    def fuzz_all(self) -> list[Finding]:
        for op in self.operations():
            self.fuzz(op)
        return list(self.findings.values())

    def report(self, elapsed: float) -> str:
        out = [
            f"fuzz: {len(self.operations())} operations, {self.calls} requests in {elapsed:.0f} s, "
            f"statuses {dict(sorted(self.statuses.items()))}, {len(self.findings)} findings"
        ]
        out += [f.render() for f in sorted(self.findings.values(), key=lambda f: f.key)]
        return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-examples", type=int, default=50, help="per operation and generation mode")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds; no request starts after it")
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--operation", action="append", default=[], help="only operations whose path contains this"
    )
    a = ap.parse_args()
    t0 = time.monotonic()
    with running_service("fuzz", fncall=True, extra_env={"DSEC_EDGE_FNCALL_WORKERS": "2"}) as t:
        fz = Fuzzer(
            t,
            max_examples=a.max_examples,
            request_timeout=a.request_timeout,
            seed=a.seed,
            deadline=t0 + a.time_limit,
        )
        try:
            for op in fz.operations():
                if not a.operation or any(s in fz.label(op) for s in a.operation):
                    fz.fuzz(op)
                    print(f"  {fz.label(op)}: {fz.calls} requests so far", file=sys.stderr)
        finally:
            fz.close()
        print(fz.report(time.monotonic() - t0))
    return 1 if fz.findings else 0


if __name__ == "__main__":
    sys.exit(main())
