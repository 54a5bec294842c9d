"""The microVM guest (issue #13) against the container backend, in the same run. As root:

    .venv/bin/python bench/bench_microvm.py [--n 10] [--idle 8]

The guest pieces directly (dsec.backends.qemu; the backend is not registered yet), under
whatever accelerator is given (TCG here: KVM does not boot a stock guest on these hosts):
cold boot to the agent's hello (the boot floor: the agent does nothing before it but load
its modules), cold boot to a first exec, a template's memory image restored to a first
exec, exec round trip, pause + resume (QMP stop/cont), and host memory per idle restored
guest (MemAvailable delta, and QEMU's proportional set size). The container backend's
create -> first exec -> stop and exec round trip are measured in the same run as the
reference. Prints Markdown for docs/benchmarks.md: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import pct, row  # type: ignore[import-not-found]
from bench_backends import mem_available  # type: ignore[import-not-found]

from dsec.backends import qemu
from dsec.backends.shim import Launch
from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.layers import LayerStore
from dsec.models import ExecRequest, SandboxSpec
from dsec.native import ensure_shim, ensure_tool

DATA = Path("/var/lib/dsec")
CACHE = DATA / "microvm" / "cache"


async def true_in(vm: qemu.GuestVm) -> None:
    fds = [os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC) for _ in range(3)]
    try:
        _, _, exited = await vm.channel.spawn(
            Launch(["/bin/true"], {}, "/", 0, 0), stdio=(fds[0], fds[1], fds[2])
        )
    finally:
        for fd in fds:
            os.close(fd)
    await asyncio.wait_for(exited, 60)


def pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


async def guest(image: qemu.GuestImage, work: Path, n: int, idle: int) -> dict[str, list[float] | float]:
    blank = qemu.blank_disk(CACHE, 512, 32768)
    serial = iter(range(1 << 30))

    async def new_vm(incoming: bool = False) -> qemu.GuestVm:
        d = work / f"vm{next(serial)}"
        d.mkdir()
        qemu.sparse_copy(blank, d / "rw.ext4")
        return await qemu.start_vm(image, d, d / "rw.ext4", incoming=incoming)

    def body() -> bytes:
        return qemu.setup_body(nlower=len(image.layers), pids=256, hostname="bench")

    hello, cold = [], []
    for _ in range(max(2, n // 4)):
        t = time.perf_counter()
        vm = await new_vm()
        await asyncio.wait_for(vm.channel.hello, 120)
        hello.append(time.perf_counter() - t)
        await vm.channel.setup(body())
        await true_in(vm)
        cold.append(time.perf_counter() - t)
        await vm.kill()
    state = work / "template.state"
    tmpl = await new_vm()
    await asyncio.wait_for(tmpl.channel.hello, 120)
    with open(state, "wb") as f:
        await tmpl.qmp.save(f.fileno())
    await tmpl.kill()

    async def clone() -> qemu.GuestVm:
        vm = await new_vm(incoming=True)
        with open(state, "rb") as f:
            await vm.qmp.restore(f.fileno())
        await vm.channel.setup(body())
        await true_in(vm)
        return vm

    restore = []
    for _ in range(n):
        t = time.perf_counter()
        vm = await clone()
        restore.append(time.perf_counter() - t)
        await vm.kill()
    vm = await clone()
    execs, pauses = [], []
    for _ in range(n):
        t = time.perf_counter()
        await true_in(vm)
        execs.append(time.perf_counter() - t)
        t = time.perf_counter()
        await vm.qmp.cmd("stop")
        await vm.qmp.cmd("cont")
        pauses.append(time.perf_counter() - t)
    await vm.kill()
    before = mem_available()
    vms = [await clone() for _ in range(idle)]
    await asyncio.sleep(2)
    per = (before - mem_available()) / idle
    per_pss = sum(pss(v.pid) for v in vms) / idle
    for v in vms:
        await v.kill()
    return {
        "hello": hello, "cold": cold, "restore": restore, "exec": execs, "pause": pauses,
        "idle_bytes": per, "idle_pss": per_pss,
    }  # fmt: skip


async def container(n: int) -> dict[str, list[float]]:
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/run"))
    edge = Edge(EdgeSettings(name="bench", run_dir=run_dir, reconcile_interval_s=3600, fncall_image=""))
    await edge.start()
    spec = SandboxSpec(memory_mb=256)
    cycle, execs = [], []
    try:
        await edge.stop((await edge.create(spec)).id)
        for _ in range(n):
            t = time.perf_counter()
            sb = await edge.create(spec)
            await edge.exec(sb.id, ExecRequest(cmd=["/bin/true"]))
            cycle.append(time.perf_counter() - t)
            await edge.stop(sb.id)
        sb = await edge.create(spec)
        for _ in range(n):
            t = time.perf_counter()
            await edge.exec(sb.id, ExecRequest(cmd=["/bin/true"]))
            execs.append(time.perf_counter() - t)
        await edge.stop(sb.id)
    finally:
        await edge.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"cycle": cycle, "exec": execs}


async def main(n: int, idle: int) -> None:
    vmlinuz, modules = qemu.guest_kernel(DATA)
    work = Path(tempfile.mkdtemp(prefix="dsec-microvm-bench-", dir="/var/tmp"))
    try:
        shim = ensure_shim(work / "bin")
        agent = ensure_tool("dsec-guest", work / "bin")
        store = LayerStore(DATA / "layers")
        idmap = [str(shim), "idmap-run", "100000:0:65536"]
        layers = [qemu.layer_image(CACHE, p, idmap) for p in store.lowerdirs(store.get_image("python"))]
        image = qemu.GuestImage(
            qemu.find_qemu(), vmlinuz, qemu.build_initramfs(CACHE, agent, modules), layers
        )
        ref = await container(n)
        res = await guest(image, work, n, idle)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = pct(ref["cycle"], 0.5)
    lines = ["| operation (microvm under TCG) | p50 ms | p95 ms | vs container |", "|---|---|---|---|"]
    lines.append(row("container: create -> first exec", ref["cycle"]))
    lines.append(row("container: exec /bin/true round trip", ref["exec"]))
    lines.append(row("microvm floor: cold boot to the agent's hello", res["hello"], base))  # type: ignore[arg-type]
    lines.append(row("microvm: cold boot -> first exec", res["cold"], base))  # type: ignore[arg-type]
    lines.append(row("microvm: template restore -> first exec", res["restore"], base))  # type: ignore[arg-type]
    ex = pct(ref["exec"], 0.5)
    lines.append(row("microvm: exec /bin/true round trip", res["exec"], ex))  # type: ignore[arg-type]
    lines.append(row("microvm: pause + resume (QMP stop/cont)", res["pause"]))  # type: ignore[arg-type]
    lines.append("")
    per, per_pss = float(res["idle_bytes"]), float(res["idle_pss"])  # type: ignore[arg-type]
    lines.append(
        f"- microvm: {per / 2**20:.0f} MiB of host memory per idle restored guest (MemAvailable delta "
        f"over {idle}; QEMU's Pss {per_pss / 2**20:.0f} MiB): {int(24 * 2**30 / max(per, 1))} fit in 24 GiB"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--idle", type=int, default=8)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    asyncio.run(main(a.n, a.idle))
