"""A multi-turn shell task in a dsec sandbox, driven by a scripted policy through SandboxEnv.

Task: write /work/out.txt with the sorted unique words of /work/in.txt, one per line.
The validator is a pure function of the observation (it reads the snapshot of
/work/out.txt the env takes after each step) and gives partial credit. The "policy"
is a fixed list of commands standing in for a model. Needs a running `dsec up`.

    python examples/shell_task.py
"""

from __future__ import annotations

import sys

from dsec.adapters.gym import Observation, SandboxEnv, ShellTask

TEXT = "the quick brown fox\njumps over the lazy dog\nthe dog sleeps\n"
EXPECTED = sorted(set(TEXT.split()))

TASK = ShellTask(
    instruction="Write /work/out.txt containing the sorted unique words of /work/in.txt, one per line.",
    files={"/work/in.txt": TEXT},
    checked_files=("/work/out.txt",),
)

POLICY = [
    "ls /work",
    "cd /work && tr -s ' ' '\\n' < in.txt > words.txt",  # later steps rely on this cd
    "sort words.txt > out.txt",  # sorted, but duplicates remain: partial credit
    "sort -u words.txt > out.txt",
    "cat out.txt",
]


def validator(obs: Observation) -> float:
    """1.0 when out.txt is exactly right; else half the overlap (Jaccard) of its lines with the answer."""
    content = obs.files.get("/work/out.txt")
    if content is None:
        return 0.0
    lines = content.splitlines()
    if lines == EXPECTED:
        return 1.0
    overlap = len(set(lines) & set(EXPECTED)) / len(set(lines) | set(EXPECTED))
    return round(0.5 * overlap * (1.0 if len(lines) == len(set(lines)) else 0.5), 3)


def main() -> int:
    with SandboxEnv(TASK, validator, max_steps=len(POLICY)) as env:
        instruction, info = env.reset(seed=0)
        print(f"task: {instruction}  (sandbox {info['sandbox_id']})")
        reward, terminated, truncated = 0.0, False, False
        for command in POLICY:
            obs, reward, terminated, truncated, info = env.step(command)
            first = obs.splitlines()[0] if obs else ""
            print(f"step {info['step']}: reward={reward:.3f}  $ {command}  -> {first!r}")
            if terminated or truncated:
                break
    outcome = "solved" if terminated else "not solved"
    print(f"shell task {outcome} in {info['step']} steps, final reward {reward:.1f}")
    return 0 if terminated else 1


if __name__ == "__main__":
    sys.exit(main())
