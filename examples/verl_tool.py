"""Drive the verl tool adapter the way verl's rollout does: create, execute x3, calc_reward, release.

State persists across the calls of one trajectory (a Python variable and a file from
call 1 are visible in call 3) because the tool keeps one sandbox per trajectory.
Needs a running `dsec up`; verl itself is not needed.

    python examples/verl_tool.py
"""

from __future__ import annotations

import asyncio
import sys

from dsec.adapters.verl import DsecCodeTool
from dsec.client import AsyncClient


async def main() -> int:
    async with AsyncClient() as client, DsecCodeTool({"timeout": 30}, None, client=client) as tool:
        print("tool schema:", tool.get_openai_tool_schema()["function"]["name"])
        instance_id, _ = await tool.create(ground_truth="42 hello")
        calls = [
            {"code": "x = 21\nopen('/work/note.txt', 'w').write('hello')"},
            {"command": "cat /work/note.txt; echo; python3 --version"},
            {"code": "print(x * 2, open('/work/note.txt').read())"},
        ]
        sandboxes = set()
        for i, parameters in enumerate(calls, 1):
            response, step_reward, metrics = await tool.execute(instance_id, parameters)
            sandboxes.add(metrics["sandbox_id"])
            print(f"call {i}: exit={metrics['exit_code']} reward={step_reward} -> {response.text!r}")
        reward = await tool.calc_reward(instance_id)
        sandbox_id = tool.sandbox_id(instance_id)
        await tool.release(instance_id)
        gone = sandbox_id not in {info.id for info in await client.list()}
    ok = len(sandboxes) == 1 and reward == 1.0 and gone
    print(f"verl tool: {len(calls)} calls in {len(sandboxes)} sandbox, reward {reward:.1f}, released: {gone}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
