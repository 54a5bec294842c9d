"""`dsec plan`: size a cluster from one RL training step (the arithmetic is dsec.plan), with
per-sandbox memory and CPU given or measured on real sandboxes through the SDK."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import replace
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dsec import errors
from dsec.plan import HEADROOM_MAX, HEADROOM_MIN, Plan, PlanError, PlanInput, plan

console = Console()
err_console = Console(stderr=True)

# ~64 MiB touched and about one second of one busy core: an env step of a Python task
DEFAULT_MEASURE_CMD = (
    'python3 -c \'import time; d = b"x" * (64 << 20); end = time.time() + 1; '
    'exec("while time.time() < end: sum(range(1000))")\''
)
MEASURE_LABEL = "dsec-plan"

# PlanInput's fields as the options that set them (for error messages)
_FLAGS = {
    "batch": "--batch",
    "env_steps": "--env-steps",
    "step_seconds": "--step-seconds",
    "budget_seconds": "--budget-seconds",
    "headroom": "--headroom",
    "sandbox_cpu": "--cpu",
    "sandbox_memory_mb": "--memory-mb",
    "node_cores": "--node-cores",
    "node_memory_gib": "--node-memory-gib",
    "max_sandboxes_per_node": "--max-sandboxes",
}


class MeasureError(Exception):
    pass


def this_node() -> tuple[float, float]:
    """This machine's cores and memory (GiB): the default node shape."""
    try:
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        mem = 8 << 30
    return float(os.cpu_count() or 1), round(mem / 2**30, 2)


def default_max_sandboxes() -> int:
    from dsec.config import EdgeSettings

    return int(EdgeSettings.model_fields["max_sandboxes"].default)


def measure(
    client: Any,
    image: str,
    cmd: str,
    *,
    n: int,
    backend: str,
    cpu_limit: float,
    memory_limit_mb: int,
    timeout: float,
) -> dict[str, Any]:
    """Create `n` sandboxes of `image`, run `cmd` in each (one after another, so they do not
    share the CPU), read their memory and CPU use from the edge (SandboxInfo.usage) and stop
    them. Per sandbox: memory = the peak its cgroup held (the current use where the host
    keeps no peak), cpu = the CPU time the command took over its wall time. The result takes
    the largest of the sandboxes."""
    created: list[Any] = []
    samples: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        for _ in range(n):
            created.append(
                client.create(
                    image,
                    cpu=cpu_limit,
                    memory_mb=memory_limit_mb,
                    backend=backend,
                    ttl_idle_s=600,
                    labels={MEASURE_LABEL: "measure"},
                )
            )
        for sb in created:
            before = sb.refresh().usage
            r = sb.exec(cmd, timeout=timeout)
            after = sb.refresh()
            if after.telemetry.get("oom_kills", 0) > 0:
                raise MeasureError(
                    f"the command was killed out of memory at {memory_limit_mb} MiB: raise "
                    "--measure-memory-limit-mb"
                )
            if r.timed_out or r.exit_code != 0:
                why = "timed out" if r.timed_out else f"exited {r.exit_code}"
                raise MeasureError(f"the measure command {why} in {sb.id}: {r.stderr.strip()[-500:]}")
            usage = after.usage
            if "memory_bytes" not in usage or "cpu_usec" not in usage or "cpu_usec" not in before:
                raise MeasureError(
                    "the service reports no memory or CPU use for sandboxes (SandboxInfo.usage; an "
                    "older edge?): give --memory-mb and --cpu instead"
                )
            peak = usage.get("memory_peak_bytes")
            if peak is None:
                peak = usage["memory_bytes"]
                note = "this host keeps no memory peak: memory after the command, not its peak"
                if note not in notes:
                    notes.append(note)
            cpu_s = (usage["cpu_usec"] - before["cpu_usec"]) / 1e6
            samples.append(
                {
                    "sandbox": sb.id,
                    "exec_seconds": round(r.duration, 4),
                    "cpu_seconds": round(cpu_s, 4),
                    "cores": round(cpu_s / max(r.duration, 1e-3), 4),
                    "memory_peak_mb": round(peak / 2**20, 2),
                    "memory_after_mb": round(usage["memory_bytes"] / 2**20, 2),
                }
            )
    finally:
        with contextlib.suppress(errors.DsecError):
            client.stop_many([sb.id for sb in created])
    memory_mb = math.ceil(max(s["memory_peak_mb"] for s in samples))
    cpu = max(0.01, math.ceil(max(s["cores"] for s in samples) * 100) / 100)
    if cpu >= 0.9 * cpu_limit:
        notes.append(
            f"the command used about all of its CPU limit ({cpu_limit:g}): if it runs several "
            "threads, measure again with a larger --measure-cpu-limit"
        )
    if memory_mb >= 0.9 * memory_limit_mb:
        notes.append(
            f"the command held about all of its memory limit ({memory_limit_mb} MiB): measure "
            "again with a larger --measure-memory-limit-mb"
        )
    return {
        "image": image,
        "backend": backend,
        "command": cmd,
        "sandboxes": n,
        "cpu_limit": cpu_limit,
        "memory_limit_mb": memory_limit_mb,
        "samples": samples,
        "memory_mb": memory_mb,
        "cpu": cpu,
        "notes": notes,
    }


def _bad(field: str, message: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=f"'{_FLAGS.get(field, field)}'")


def plan_command(
    batch: Annotated[int, typer.Option("--batch", "-B", help="B: rollouts per training step")],
    env_steps: Annotated[float, typer.Option("--env-steps", "-E", help="E: env steps per rollout")],
    step_seconds: Annotated[
        float, typer.Option("--step-seconds", "-T", help="T: seconds a sandbox is busy per env step")
    ],
    budget_seconds: Annotated[
        float, typer.Option("--budget-seconds", "-S", help="S: seconds a step may spend on rollouts")
    ],
    headroom: Annotated[
        float,
        typer.Option("--headroom", "-H", help=f"H: sandboxes x H ({HEADROOM_MIN:g} to {HEADROOM_MAX:g})"),
    ] = 1.5,
    memory_mb: Annotated[
        float | None, typer.Option(help="memory one sandbox holds, MiB (else --measure)")
    ] = None,
    cpu: Annotated[float | None, typer.Option(help="cores one busy sandbox uses (else --measure)")] = None,
    measure_image: Annotated[
        str | None,
        typer.Option(
            "--measure",
            metavar="IMAGE",
            help="measure memory and CPU on real sandboxes of IMAGE (the SDK's service: DSEC_URL/"
            "DSEC_TOKEN or the client config); --memory-mb / --cpu, if given, win",
        ),
    ] = None,
    measure_cmd: Annotated[
        str, typer.Option(help="the representative command run in each measured sandbox")
    ] = DEFAULT_MEASURE_CMD,
    measure_n: Annotated[int, typer.Option(min=1, max=16, help="sandboxes to measure")] = 3,
    measure_timeout: Annotated[float, typer.Option(help="seconds the command may take")] = 120.0,
    measure_cpu_limit: Annotated[float, typer.Option(help="CPU limit of measured sandboxes")] = 1.0,
    measure_memory_limit_mb: Annotated[
        int, typer.Option(help="memory limit of measured sandboxes, MiB")
    ] = 2048,
    backend: Annotated[str, typer.Option(help="backend of the measured sandboxes")] = "container",
    node_cores: Annotated[float | None, typer.Option(help="cores per node (default: this machine's)")] = None,
    node_memory_gib: Annotated[
        float | None, typer.Option(help="memory per node, GiB (default: this machine's)")
    ] = None,
    max_sandboxes: Annotated[
        int | None,
        typer.Option(
            envvar="DSEC_EDGE_MAX_SANDBOXES", help="an edge's max sandboxes (default: EdgeSettings')"
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Size a cluster for an RL step: sandboxes >= B*E*T/S x headroom, then the edges, cores and
    memory that hold them given a node shape, and which of CPU, memory or the edge's max
    sandboxes limits a node."""
    # inputs first, so that a typo fails before any sandbox is made
    cores_here, mem_here = this_node()
    if measure_image is None and (memory_mb is None or cpu is None):
        missing = " and ".join(f for f, v in (("--memory-mb", memory_mb), ("--cpu", cpu)) if v is None)
        raise typer.BadParameter(f"give {missing}, or --measure IMAGE to measure them")
    # the sandbox's size may still be unknown (measured below): 1 stands in for it
    inputs = PlanInput(
        batch=batch,
        env_steps=env_steps,
        step_seconds=step_seconds,
        budget_seconds=budget_seconds,
        headroom=headroom,
        sandbox_cpu=cpu if cpu is not None else 1,
        sandbox_memory_mb=memory_mb if memory_mb is not None else 1,
        node_cores=node_cores if node_cores is not None else cores_here,
        node_memory_gib=node_memory_gib if node_memory_gib is not None else mem_here,
        max_sandboxes_per_node=max_sandboxes if max_sandboxes is not None else default_max_sandboxes(),
    )
    try:
        inputs.validate()
    except PlanError as e:
        raise _bad(e.field, e.message) from None

    measured: dict[str, Any] | None = None
    if measure_image is not None and (memory_mb is None or cpu is None):
        from dsec.client import Client

        if not as_json:
            err_console.print(f"measuring {measure_n} sandboxes of {measure_image} ...")
        try:
            with Client() as client:
                measured = measure(
                    client,
                    measure_image,
                    measure_cmd,
                    n=measure_n,
                    backend=backend,
                    cpu_limit=measure_cpu_limit,
                    memory_limit_mb=measure_memory_limit_mb,
                    timeout=measure_timeout,
                )
        except errors.DsecError as e:
            err_console.print(f"[red]error[/red] ({e.code}): {e.message}")
            raise typer.Exit(1) from None
        except MeasureError as e:
            err_console.print(f"[red]error[/red]: {e}")
            raise typer.Exit(1) from None
    sources = {
        "cpu": "given" if cpu is not None else "measured",
        "memory_mb": "given" if memory_mb is not None else "measured",
    }
    if measured is not None:
        cpu = cpu if cpu is not None else measured["cpu"]
        memory_mb = memory_mb if memory_mb is not None else measured["memory_mb"]
    assert cpu is not None and memory_mb is not None
    try:
        result = plan(replace(inputs, sandbox_cpu=cpu, sandbox_memory_mb=memory_mb))
    except PlanError as e:
        raise _bad(e.field, e.message) from None
    if as_json:
        print(json.dumps({**result.to_dict(), "sources": sources, "measurement": measured}))
        return
    _print(result, sources, measured)


def _print(p: Plan, sources: dict[str, str], measured: dict[str, Any] | None) -> None:
    i = p.inputs
    t = Table("", "value", "from", title="dsec plan", title_justify="left")
    t.add_row("rollouts per step", f"{i.batch}", "B")
    t.add_row("env steps per rollout", f"{i.env_steps:g}", "E")
    t.add_row("busy seconds per env step", f"{i.step_seconds:g}", "T")
    t.add_row("step budget (s)", f"{i.budget_seconds:g}", "S")
    t.add_row("sandbox-seconds per step", f"{p.busy_sandbox_seconds:g}", "B*E*T")
    t.add_row("concurrent sandboxes, at least", f"{p.min_concurrent:.1f}", "C = B*E*T/S")
    t.add_row("headroom", f"{i.headroom:g}x", "H")
    t.add_row("[bold]sandboxes[/bold]", f"[bold]{p.sandboxes}[/bold]", "ceil(C*H)")
    t.add_row(
        "per sandbox",
        f"{i.sandbox_cpu:g} CPU, {i.sandbox_memory_mb:g} MiB",
        f"cpu {sources['cpu']}, memory {sources['memory_mb']}",
    )
    t.add_row(
        "node",
        f"{i.node_cores:g} cores, {i.node_memory_gib:g} GiB",
        f"max {i.max_sandboxes_per_node} sandboxes",
    )
    mark = {k: " <" if p.binding == k else "" for k in ("cpu", "memory", "max_sandboxes")}
    t.add_row(
        "sandboxes per node",
        f"{p.per_node}",
        f"cpu {p.per_node_by_cpu}{mark['cpu']}, memory {p.per_node_by_memory}{mark['memory']}, "
        f"max {p.per_node_by_max}{mark['max_sandboxes']}",
    )
    t.add_row("binding constraint", p.binding, "")
    t.add_row("[bold]edges[/bold]", f"[bold]{p.edges}[/bold]", "ceil(sandboxes / per node)")
    t.add_row("cores in total", f"{p.total_cores:g}", "sandboxes x cpu")
    t.add_row("memory in total (GiB)", f"{p.total_memory_gib:.1f}", "sandboxes x memory")
    t.add_row("the fullest node uses", f"{p.node_cores_used:g} cores, {p.node_memory_gib_used:.1f} GiB", "")
    console.print(t)
    if measured is not None:
        console.print(
            f"measured on {measured['sandboxes']} {measured['backend']} sandboxes of "
            f"{measured['image']}: "
            + "; ".join(
                f"{s['cores']:g} cores, peak {s['memory_peak_mb']:g} MiB" for s in measured["samples"]
            )
        )
        for note in measured["notes"]:
            console.print(f"[yellow]note[/yellow]: {note}")
    for w in p.warnings:
        console.print(f"[yellow]warning[/yellow]: {w}")
