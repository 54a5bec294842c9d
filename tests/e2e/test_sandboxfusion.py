"""SandboxFusion compatibility through the real `sandbox-fusion` client and verl's code reward."""

from __future__ import annotations

import base64
import importlib.util
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.root, pytest.mark.e2e]

WHEELS = Path("/var/cache/dsec-test-wheels")


@pytest.fixture(scope="module")
def sf(service):
    import sandbox_fusion

    sandbox_fusion.set_sandbox_endpoint(f"{service.url}/sandboxfusion/{service.token}")
    return sandbox_fusion


def test_run_code_with_files_stdin_and_fetch(sf):
    req = sf.RunCodeRequest(
        code="import sys\nname = open('in/name.txt').read()\nprint(name, sys.stdin.read())\n"
        "open('out.txt', 'w').write(name.upper())",
        language="python",
        stdin="from stdin",
        files={"in/name.txt": base64.b64encode(b"dsec").decode()},
        fetch_files=["out.txt"],
    )
    r = sf.run_code(req, max_attempts=1)
    assert r.status == sf.RunStatus.Success
    assert r.run_result.stdout == "dsec from stdin\n"
    assert r.compile_result is None
    assert base64.b64decode(r.files["out.txt"]) == b"DSEC"


def test_failing_program_and_time_limit_are_failed_not_errors(sf):
    r = sf.run_code(sf.RunCodeRequest(code="raise SystemExit(3)", language="python"), max_attempts=1)
    assert r.status == sf.RunStatus.Failed and r.run_result.return_code == 3
    r = sf.run_code(
        sf.RunCodeRequest(code="while True: pass", language="python", run_timeout=0.5), max_attempts=1
    )
    assert r.status == sf.RunStatus.Failed
    assert r.run_result.status == sf.CommandRunStatus.TimeLimitExceeded
    r = sf.run_code(sf.RunCodeRequest(code="int main( {", language="cpp"), max_attempts=1)
    assert r.status == sf.RunStatus.Failed and r.run_result is None and r.compile_result.return_code != 0
    summary = sf.summary_run_code_result(r, sf.SummaryMapping(CompileFailed="CE"))
    assert summary == "CE"
    cpp = '#include <cstdio>\nint main(){int a,b;scanf("%d%d",&a,&b);printf("%d\\n",a*b);}'
    r = sf.run_code(sf.RunCodeRequest(code=cpp, language="cpp", stdin="6 7"), max_attempts=1)
    assert r.status == sf.RunStatus.Success and r.run_result.stdout == "42\n"


def test_jupyter_cells_share_one_interpreter(sf):
    r = sf.run_jupyter(
        sf.RunJupyterRequest(cells=["a = 123", "a", "print(a + 1)", "raise RuntimeError('x')"]),
        max_attempts=1,
    )
    assert r.status == sf.RunStatus.Failed  # the last cell raised
    assert r.cells[1].display == [{"text/plain": "123"}]
    assert r.cells[2].stdout == "124\n"
    assert r.cells[3].error[0]["ename"] == "RuntimeError"
    r = sf.run_jupyter(
        sf.RunJupyterRequest(cells=["import math", "print(math.factorial(5))"]), max_attempts=1
    )
    assert r.status == sf.RunStatus.Success and r.cells[1].stdout == "120\n"


def test_ping_auth_and_bad_requests(service):
    assert httpx.get(f"{service.url}/v1/ping").json() == "pong"
    r = httpx.post(f"{service.url}/run_code", json={"code": "print(1)", "language": "python"})
    assert r.status_code == 401
    r = httpx.post(f"{service.url}/run_code?token={service.token}", json={"language": "python"})
    assert r.status_code == 422  # as SandboxFusion: FastAPI validation
    r = httpx.post(
        f"{service.url}/run_code?token={service.token}", json={"code": "x", "language": "brainfuck"}
    )
    assert r.status_code == 422
    r = httpx.post(
        f"{service.url}/run_code?token={service.token}", json={"code": "print(1)", "language": "lean"}
    )
    assert r.status_code == 400 and "language 'lean' is not available" in r.json()["error"]["message"]
    # no language: SandboxFusion requires one, some clients omit it: python
    r = httpx.post(
        f"{service.url}/run_code",
        json={"code": "print(2)"},
        headers={"Authorization": f"Bearer {service.token}"},
    )
    assert r.json()["status"] == "Success" and r.json()["run_result"]["stdout"] == "2\n"


def _load_verl_reward():
    """verl's own sandbox_fusion reward module, loaded from the verl 0.9.1 wheel.

    verl's package __init__ imports torch and friends, which this machine does not
    need; the reward module itself uses only the standard library and requests, so
    it is loaded on its own under a minimal parent package.
    """
    WHEELS.mkdir(parents=True, exist_ok=True)
    wheel = next(WHEELS.glob("verl-0.9.1-*.whl"), None)
    if wheel is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "verl==0.9.1", "-d", str(WHEELS)],
            check=True,
        )
        wheel = next(WHEELS.glob("verl-0.9.1-*.whl"))
    root = WHEELS / "verl-0.9.1"
    if not (root / "verl").exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
    for name in ("verl", "verl.utils", "verl.utils.reward_score"):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules.setdefault(name, mod)
    import_utils = types.ModuleType("verl.utils.import_utils")
    import_utils.deprecated = lambda *a, **k: lambda f: f  # type: ignore[attr-defined]
    sys.modules.setdefault("verl.utils.import_utils", import_utils)
    spec = importlib.util.spec_from_file_location(
        "verl.utils.reward_score.sandbox_fusion",
        root / "verl/utils/reward_score/sandbox_fusion/__init__.py",
        submodule_search_locations=[str(root / "verl/utils/reward_score/sandbox_fusion")],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_verl_code_reward(service):
    reward = _load_verl_reward()
    url = f"{service.url}/run_code?token={service.token}"
    tests = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    bad = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    score, meta = reward.compute_score(url, None, 1024, good, tests)
    assert score == 1.0, meta
    score, _ = reward.compute_score(url, None, 1024, bad, tests)
    assert score == 0.0
