"""Isolation tiers side by side (issue #13), with floors measured in the same run. As root:

    .venv/bin/python bench/bench_backends.py [--n 30] [--idle 100] [--idle-vm 8]
        [--backends container,gvisor,microvm]

Per backend: create -> first exec -> stop, exec round trip, fork x8 (where the backend
forks), pause + resume, memory checkpoint and restore (where it has them), and host memory
per idle sandbox (MemAvailable delta; microVMs: --idle-vm of them, each holds its guest's
RAM; and the Pss of the processes in its host cgroups, steadier on a shared machine: what
the kernel counts against each process, pages shared among n processes as 1/n each);
floors: `runsc do true` (a gVisor sandbox
with nothing of dsec), a bare QEMU microvm boot of the guest kernel to the agent's hello
(under the accelerator the backend uses: TCG on hosts whose KVM does not boot a guest), and
`unshare ... true` (namespaces only). Prints Markdown for docs/benchmarks.md: read the
ratios, not the absolute times (shared, noisy machines).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import pct, row, timed_cmd  # type: ignore[import-not-found]

from dsec import errors
from dsec.backends import qemu
from dsec.backends.base import Capability
from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.isolation.cgroups import read_procs
from dsec.models import ExecRequest, SandboxSpec


def sandbox_pss(edge: Edge, sandbox_id: str) -> int:
    """Bytes: the Pss of every process in the sandbox's host cgroups (smaps_rollup)."""
    total = 0
    for d in edge.cgroups.tracking_dir(sandbox_id).glob("**/"):
        for pid in read_procs(d):
            try:
                text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            except OSError:
                continue
            total += sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Pss:"))
    return total


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


async def measure(edge: Edge, backend: str, n: int, idle: int) -> dict[str, list[float] | float]:
    spec = SandboxSpec(backend=backend, memory_mb=256)
    await edge.stop((await edge.create(spec)).id)  # warm caches
    cycle = []
    for _ in range(n):
        t = time.perf_counter()
        sb = await edge.create(spec)
        await edge.exec(sb.id, ExecRequest(cmd=["/bin/true"]))
        await edge.stop(sb.id)
        cycle.append(time.perf_counter() - t)
    sb = await edge.create(spec)
    execs = []
    for _ in range(n):
        t = time.perf_counter()
        await edge.exec(sb.id, ExecRequest(cmd=["/bin/true"]))
        execs.append(time.perf_counter() - t)
    forks, pauses = [], []
    can_fork = Capability.FORK in edge.backends[backend].capabilities
    for _ in range(max(3, n // 10)):
        if can_fork:
            t = time.perf_counter()
            kids = await edge.fork(sb.id, 8)
            forks.append(time.perf_counter() - t)
            await asyncio.gather(*(edge.stop(k.id) for k in kids))
        t = time.perf_counter()
        await edge.pause(sb.id)
        await edge.resume(sb.id)
        pauses.append(time.perf_counter() - t)
    await edge.stop(sb.id)
    ckpts, restores = await checkpoints(edge, spec, max(3, n // 10))
    before = mem_available()
    ids = [(await edge.create(spec)).id for _ in range(idle)]
    for i in ids:
        await edge.exec(i, ExecRequest(cmd=["/bin/true"]))
    await asyncio.sleep(1)
    per = (before - mem_available()) / idle
    pss = sum(sandbox_pss(edge, i) for i in ids) / idle
    await asyncio.gather(*(edge.stop(i) for i in ids))
    return {
        "cycle": cycle, "exec": execs, "fork8": forks, "pause": pauses, "checkpoint": ckpts,
        "restore": restores, "idle_bytes": per, "idle_pss": pss, "idle": idle,
    }  # fmt: skip


async def checkpoints(edge: Edge, spec: SandboxSpec, n: int) -> tuple[list[float], list[float]]:
    """Memory checkpoint (left running) of a sandbox with a background process, and a restore
    of it into a new sandbox, where the backend has them (CRIU: where it runs here)."""
    if Capability.CHECKPOINT not in edge.backends[spec.backend].capabilities:
        return [], []
    sb = await edge.create(spec)
    await edge.exec(sb.id, ExecRequest(cmd="sleep 1000 > /dev/null 2>&1 &"))
    ckpts, restores = [], []
    try:
        for _ in range(n):
            t = time.perf_counter()
            c = await edge.checkpoint(sb.id)
            ckpts.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = await edge.restore(c.id)
            restores.append(time.perf_counter() - t)
            await edge.stop(r.id)
            edge.delete_checkpoint(c.id)
    except errors.UnsupportedOperation as e:
        print(f"{spec.backend}: no checkpoints here ({e.message})")
    await edge.stop(sb.id)
    return ckpts, restores


async def main(n: int, idle: int, idle_vm: int, backends: list[str]) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    edge = Edge(EdgeSettings(name="bench", run_dir=run_dir, reconcile_interval_s=3600, fncall_image=""))
    await edge.start()
    results = {}
    try:
        for b in backends:
            if b not in edge.backends:
                print(f"{b}: not available here ({edge.core.absent_backends.get(b)})")
                continue
            results[b] = await measure(edge, b, n, idle_vm if b == "microvm" else idle)
        floors = {"unshare": timed_cmd(["unshare", "-fpmniu", "--mount-proc", "true"], n)}
        gv = edge.backends.get("gvisor")
        if gv is not None:
            state = Path(tempfile.mkdtemp(prefix="runsc-floor-", dir="/run"))
            argv = [
                gv.runtime,
                "--root",
                str(state),
                "--network=none",
                f"--platform={gv.platform}",
                "do",
                "true",
            ]
            floors["runsc do true"] = timed_cmd(argv, n)
            shutil.rmtree(state, ignore_errors=True)
        vm = edge.backends.get("microvm")
        if vm is not None:
            boots = [qemu.time_to_hello(vm.base, kvm=vm.kvm, timeout=120) for _ in range(max(3, n // 5))]
            floors[f"qemu -M microvm boot to hello ({'kvm' if vm.kvm else 'tcg'})"] = [
                b for b in boots if b is not None
            ]
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    base = results.get("container")
    lines = ["| operation | p50 ms | p95 ms | vs container |", "|---|---|---|---|"]
    for what, label in (
        ("cycle", "create -> first exec -> stop"),
        ("exec", "exec /bin/true round trip"),
        ("fork8", "fork x8"),
        ("pause", "pause + resume"),
        ("checkpoint", "memory checkpoint (left running)"),
        ("restore", "restore into a new sandbox"),
    ):
        for b, res in results.items():
            xs = res[what]
            assert isinstance(xs, list)
            if not xs:
                lines.append(f"| {b}: {label} | unsupported | | |")
                continue
            ref = base[what] if base else None
            lines.append(row(f"{b}: {label}", xs, pct(ref, 0.5) if isinstance(ref, list) else None))
    for name, xs in floors.items():
        lines.append(row(f"floor: {name}", xs))
    lines.append("")
    vm_res = results.get("microvm")
    vm_floor = next((xs for name, xs in floors.items() if name.startswith("qemu")), None)
    if vm_res and vm_floor:
        cyc = vm_res["cycle"]
        assert isinstance(cyc, list)
        lines.append(
            f"- microvm create -> exec -> stop p50 is {pct(cyc, 0.5) / pct(vm_floor, 0.5):.2f}x a bare "
            "QEMU boot of its kernel to the agent's hello (it restores a template VM instead of booting)"
        )
    gv_res, floor = results.get("gvisor"), floors.get("runsc do true")
    if gv_res and floor:
        cyc = gv_res["cycle"]
        assert isinstance(cyc, list)
        lines.append(
            f"- gvisor create -> exec -> stop p50 is {pct(cyc, 0.5) / pct(floor, 0.5):.2f}x `runsc do true`"
        )
    for b, res in results.items():
        per = float(res["idle_bytes"])  # type: ignore[arg-type]
        lines.append(
            f"- {b}: {per / 2**20:.1f} MiB of host memory per idle sandbox "
            f"(MemAvailable delta over {int(res['idle'])}): {int(24 * 2**30 / max(per, 1))} fit in 24 GiB; "  # type: ignore[arg-type]
            f"Pss of its processes {float(res['idle_pss']) / 2**20:.1f} MiB"  # type: ignore[arg-type]
        )
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--idle", type=int, default=100)
    ap.add_argument("--idle-vm", type=int, default=8)
    ap.add_argument("--backends", default="container,gvisor,microvm")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    asyncio.run(main(a.n, a.idle, a.idle_vm, a.backends.split(",")))
