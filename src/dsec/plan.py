"""Cluster sizing from one RL training step (`dsec plan`): pure arithmetic, no I/O.

A step runs B rollouts of E environment steps each; every env step keeps a sandbox busy
for T seconds, and the step may spend S seconds on rollouts. The work is B*E*T
sandbox-seconds, so at least C = B*E*T/S sandboxes must run at once; the plan asks for
ceil(C * H) (headroom H: stragglers, retries, uneven steps). Each node then holds as many
sandboxes as its cores, its memory and the edge's max sandboxes allow; the smallest of the
three is the binding constraint, and the edges needed are ceil(sandboxes / per node).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

HEADROOM_MIN = 1.0
HEADROOM_MAX = 4.0
_EPS = 1e-9  # float noise: 0.3 / 0.1 is 2.9999999999999996, and 3 sandboxes fit


class PlanError(ValueError):
    """An input out of range: `field` names it, the message says what to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PlanInput:
    batch: int  # B: rollouts per training step
    env_steps: float  # E: env steps per rollout (a mean may be fractional)
    step_seconds: float  # T: seconds a sandbox is busy per env step
    budget_seconds: float  # S: seconds a training step may spend on rollouts
    sandbox_cpu: float  # cores one busy sandbox uses
    sandbox_memory_mb: float  # memory one sandbox holds (MiB)
    node_cores: float
    node_memory_gib: float
    max_sandboxes_per_node: int
    headroom: float = 1.5

    def validate(self) -> None:
        positive = {
            "batch": (self.batch, "the number of rollouts per step"),
            "env_steps": (self.env_steps, "the env steps per rollout"),
            "step_seconds": (self.step_seconds, "the seconds a sandbox is busy per env step"),
            "budget_seconds": (self.budget_seconds, "the seconds a step may spend on rollouts"),
            "sandbox_cpu": (self.sandbox_cpu, "the cores per sandbox"),
            "sandbox_memory_mb": (self.sandbox_memory_mb, "the memory per sandbox"),
            "node_cores": (self.node_cores, "the cores per node"),
            "node_memory_gib": (self.node_memory_gib, "the memory per node"),
            "max_sandboxes_per_node": (self.max_sandboxes_per_node, "the edge's max sandboxes"),
        }
        for name, (value, what) in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise PlanError(name, f"{what} must be greater than 0 (got {value})")
        if not (HEADROOM_MIN <= self.headroom <= HEADROOM_MAX):
            raise PlanError(
                "headroom",
                f"headroom must be between {HEADROOM_MIN:g} and {HEADROOM_MAX:g} (got {self.headroom:g})",
            )


@dataclass(frozen=True)
class Plan:
    inputs: PlanInput
    busy_sandbox_seconds: float  # B*E*T: the work of one step
    min_concurrent: float  # B*E*T/S, before headroom
    sandboxes: int  # ceil(min_concurrent * H): sandboxes to run at once
    per_node_by_cpu: int
    per_node_by_memory: int
    per_node_by_max: int
    per_node: int  # the smallest of the three
    binding: str  # "cpu", "memory" or "max_sandboxes" (the first of a tie, in that order)
    edges: int
    total_cores: float  # sandboxes * cpu
    total_memory_gib: float  # sandboxes * memory
    node_cores_used: float  # on the fullest node
    node_memory_gib_used: float
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["inputs"] = asdict(self.inputs)
        return out


def _fit(capacity: float, each: float) -> int:
    return math.floor(capacity / each + _EPS)


def plan(inp: PlanInput) -> Plan:
    """Size the cluster for `inp` (see the module); raises PlanError on bad input."""
    inp.validate()
    busy = inp.batch * inp.env_steps * inp.step_seconds
    min_concurrent = busy / inp.budget_seconds
    sandboxes = max(1, math.ceil(min_concurrent * inp.headroom - _EPS))
    limits = {
        "cpu": _fit(inp.node_cores, inp.sandbox_cpu),
        "memory": _fit(inp.node_memory_gib * 1024, inp.sandbox_memory_mb),
        "max_sandboxes": int(inp.max_sandboxes_per_node),
    }
    binding = min(limits, key=lambda k: limits[k])  # dicts keep order: a tie names the first
    per_node = limits[binding]
    if per_node < 1:
        what = "cores" if binding == "cpu" else "memory"
        raise PlanError(
            "node_cores" if binding == "cpu" else "node_memory_gib",
            f"one sandbox needs more {what} than a node has: give a larger node or a smaller sandbox",
        )
    edges = math.ceil(sandboxes / per_node)
    warnings = []
    serial = inp.env_steps * inp.step_seconds
    if serial > inp.budget_seconds:
        warnings.append(
            f"one rollout's env steps alone take E*T = {serial:g} s, more than the budget S = "
            f"{inp.budget_seconds:g} s: no number of sandboxes meets it (fewer steps, faster steps "
            "or a longer budget)"
        )
    if sandboxes > inp.batch:
        warnings.append(
            f"{sandboxes} sandboxes is more than the {inp.batch} rollouts: with one sandbox per "
            f"rollout, {inp.batch} run every rollout at once"
        )
    on_full = min(per_node, sandboxes)
    return Plan(
        inputs=inp,
        busy_sandbox_seconds=busy,
        min_concurrent=min_concurrent,
        sandboxes=sandboxes,
        per_node_by_cpu=limits["cpu"],
        per_node_by_memory=limits["memory"],
        per_node_by_max=limits["max_sandboxes"],
        per_node=per_node,
        binding=binding,
        edges=edges,
        total_cores=sandboxes * inp.sandbox_cpu,
        total_memory_gib=sandboxes * inp.sandbox_memory_mb / 1024,
        node_cores_used=on_full * inp.sandbox_cpu,
        node_memory_gib_used=on_full * inp.sandbox_memory_mb / 1024,
        warnings=warnings,
    )
