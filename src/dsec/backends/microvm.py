"""The microVM backend: each sandbox a QEMU `microvm` guest with its own kernel.

The pieces are in dsec.backends.qemu (QEMU, the guest kernel, EROFS layer disks, one VM) and
dsec.backends.guestchannel (the shim protocol framed on the guest's virtio-serial port); the
guest's init is dsec-guest (native/dsec-guest.c). Host side of one sandbox, in order:

    ids:     a host id range of its own (isolation/idranges.py); QEMU runs as its base uid
    cgroups: the sandbox's host cgroups, QEMU's only process: memory = guest RAM + QEMU's
             own, cpu quota, a small pids limit, the freezer (pause)
    layers:  each layer of the plan as a read-only EROFS disk (made once per layer, cached);
             the writable layer an ext4 disk of disk_mb, a sparse copy of a blank one
    start:   `dsec-shim vm-launch` (network namespace with tap0, privileges dropped) -> QEMU
             with -incoming, restored from the template of its shape (below)
    setup:   the agent's 'M' frame: fresh entropy and clock, layers under an overlay with
             the writable disk as upper, hostname, the guest's address behind tap0, the
             seccomp program and masked paths of a container, the processes' memory
    network: QEMU's namespace routes tap0 (below)
    ready:   the agent answers a ping

Templates: nothing the agent does before its hello depends on the sandbox (the layers are
mounted at setup), so one booted VM per shape (image and disk sizes, memory, vCPUs,
accelerator) is saved once per process (`Template`: its RAM and device state, sealed
memfds) and every sandbox of that shape is restored from it, mapping its RAM copy-on-write:
a restore instead of a boot (~0.15 s instead of ~1.5 s under TCG here), and the pages no
clone writes are one copy in host memory. A clone's QEMU is given only the kernel's header
(qemu.kernel_header: it would hold the whole image, 13.5 MiB, for a boot that never comes)
and runs without transparent huge pages (dsec-shim vm-launch). What an idle clone costs the
host then (Pss, under TCG here, docs/benchmarks.md): ~60 MiB, of which TCG's translation
cache ~27-32 MiB (filled by the restore, the setup and the first execs: tb-size is the
cap, and a smaller one slows them), the guest pages it wrote since the restore ~9 MiB
(more after real work: the guest's page cache and freed memory stay), QEMU's heap and
arenas ~13 MiB, its binary and libraries the rest.

Network: QEMU's namespace holds tap0 (192.168.127.1/30; the guest is .2 with its default
route there) and forwards to eth0, which the edge's NetHost links to its gateway when a
policy is set, masqueraded to the sandbox's address there: the gateway's copy of the
policy (and its anti-spoofing) applies to every packet of the guest, and the policy's inner
table hooks `forward` in the namespace (`net_hook`). The guest cannot reach the namespace's
own tables: they are outside the VM. With no policy there is no eth0, so nothing leaves the
namespace.

KVM: used where a guest really boots under it and a group may open /dev/kvm (probed once
per host boot, qemu.probe_kvm); otherwise TCG emulation, reported as `accelerated: false`.

Files: the writable layer is a disk only the guest kernel mounts (the host never parses a
file system a guest wrote), so the edge's file API runs the image's own tools inside
(dsec.edge.guestfiles). Forks: the guest flushes the disk and holds its writers (FIFREEZE),
QEMU is frozen, the disk is copied once per child, and each child starts on its copy.
Snapshots: with the disk held the same way, the agent writes the overlay's upper directory
as an OCI layer tar (dsec-guest.c, tar_layer) and the edge unpacks it like any untrusted
tarball into a layer of its store: a snapshot of a microVM is an image every backend runs.
Memory checkpoints: QEMU stops, writes the guest's RAM and devices to a file (a migration)
and the disk is copied while it is stopped, so both are of one instant; a restore starts a
new VM from them (`restores_at_create`: QEMU -incoming, the checkpoint's stream) and tells
the agent it resumed ('Z': fresh entropy, the clock, its name). A checkpoint restores only
onto the layers it was taken on (`shape.json`).
Not supported (each answers `unsupported_operation`): restoring a checkpoint into a running
sandbox, sessions, trusted execs, verify and protected paths, telemetry counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.aio import wait_for
from dsec.backends import base, qemu
from dsec.backends.base import (
    Backend,
    BackendHost,
    BackendUnavailable,
    Capability,
    SandboxHandle,
    WhileStopped,
    log_tail,
)
from dsec.backends.criu import CheckpointInfo
from dsec.backends.guestchannel import GuestChannel
from dsec.errors import InternalError, InvalidRequest, UnsupportedOperation
from dsec.isolation import linux
from dsec.isolation.cgroups import CgroupHost, ExecGroup
from dsec.isolation.idranges import IdRange
from dsec.isolation.procs import _awaited, run_process_quick
from dsec.isolation.seccomp import bpf_program
from dsec.isolation.spec import MASKED_PATHS, READONLY_PATHS
from dsec.native import ensure_tool

log = logging.getLogger("dsec.backends.microvm")

GUEST_KERNEL_MB = 64  # guest RAM on top of the sandbox's memory_mb: its kernel's own
QEMU_OVERHEAD_MB = 160  # QEMU's own memory, a ceiling: ~50 MiB private in an idle clone under TCG,
# of which TCG's translation cache is up to 32 MiB (see the module), plus the page cache of its disks
QEMU_PIDS = 64  # QEMU's threads
MAX_LAYERS = 20  # virtio-mmio transports of the microvm machine, less our other devices
GUEST_ADDR, GUEST_GW = "192.168.127.2/30", "192.168.127.1"
READY_TIMEOUT_S = 60.0
MAX_TEMPLATES = 8  # templates kept (the RAM a booted guest touched, ~150 MB each), the most recently used
SEALED = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


# The templates of this process, by shape, least recently used first: shared by the edges of
# one process (tests start many; a service runs one), immutable once made (sealed).
_TEMPLATES: dict[str, Template] = {}


@dataclass
class Template:
    """A VM booted to the agent's hello and saved: its RAM and its device state, each a
    sealed memfd the edge holds. Every clone maps the RAM copy-on-write (QEMU's
    memory-backend-file, share=off, over /proc/self/fd of a copy of the descriptor): pages a
    clone never writes stay one copy in the host's memory, however many clones; the device
    state (a few KB: RAM is left out of the stream, x-ignore-shared) is restored into each
    clone. Sealed against writes, growing and shrinking: a clone's QEMU can reopen the memfd
    read-write through its descriptor but can change nothing other clones map."""

    ram: int
    state: int
    made_s: float

    def open_state(self) -> int:
        """The state to restore, opened anew (the caller closes it): a file description of
        its own, so that clones restored at once do not share one read offset."""
        return os.open(f"/proc/self/fd/{self.state}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        for fd in (self.ram, self.state):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class MicroVm(SandboxHandle):
    """A sandbox of the microvm backend; `pid` is its QEMU."""

    id: str
    pid: int
    start_time: int
    dir: Path
    pidfd: int
    channel: GuestChannel
    qmp: qemu.Qmp
    exited: asyncio.Future[None]
    timings_ms: dict[str, float] = field(default_factory=dict)
    id_base: int = 0
    id_range: IdRange | None = None
    exit_status: tuple[int, int] | None = None

    def alive(self) -> bool:
        return not self.exited.done()

    def exit_reason(self) -> str:
        console = log_tail(self.dir / "console.log", 300)  # the guest writes it: only its tail is read
        if self.exit_status is not None and self.exit_status[0] in (os.CLD_KILLED, os.CLD_DUMPED):
            why = f"its QEMU was killed by {signal.Signals(self.exit_status[1]).name}"
        else:
            why = "its VM powered off (its kernel or init ended)"
        return f"{why}; console: {console}" if console else why

    def open_root(self) -> int:
        raise InternalError("a microVM's files are reached through its guest (MicrovmBackend.host_files)")

    def writable_layer(self) -> Path:
        return self.dir / "rw.ext4"

    def disk_usage(self) -> tuple[int, int, bool]:
        """As the guest reported it with its last process's exit (the host does not mount
        a file system a guest wrote)."""
        return self.channel.disk

    def seccomp_program(self) -> Path | None:
        return None

    def exec_group(self, cgroups: CgroupHost, name: str) -> ExecGroup:
        return base.ChannelGroup(self.channel)  # the agent kills the exec's guest cgroup

    def release(self) -> None:
        """Close this process's ends (the VM keeps running)."""
        self.channel.close()
        self.qmp.close()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.pidfd)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class MicrovmBackend(Backend):
    """Creates, adopts, pauses and destroys microVM sandboxes on this node."""

    name = "microvm"
    capabilities = frozenset(
        {Capability.EXEC, Capability.FILES, Capability.PAUSE, Capability.NETWORK, Capability.FORK}
        | {Capability.SNAPSHOT, Capability.CHECKPOINT, Capability.SESSIONS, Capability.TRUSTED_EXEC}
    )
    trusted_in_fresh_sandbox = True  # the agent may own the guest's kernel: a grader trusts none of it
    net_hook = "forward"  # the guest's packets are forwarded from tap0
    host_files = False  # the file API runs processes in the guest (dsec.edge.guestfiles)
    restores_at_create = True  # a memory checkpoint starts a new VM (see the module)
    dir_name = "microvm"

    def __init__(self, host: BackendHost) -> None:
        self.host = host
        self.cgroups = host.cgroups
        self.id_ranges = host.id_ranges
        self.shim = host.shim
        root = host.microvm_root or host.run_dir / "microvm-data"
        self.cache = root / "cache"
        self.vms_dir = host.run_dir / self.dir_name
        try:
            binary = qemu.find_qemu()
            vmlinuz, modules = qemu.guest_kernel(root.parent)
            agent = ensure_tool("dsec-guest", root / "bin")  # host-wide: built once per source
            initrd = qemu.build_initramfs(self.cache, agent, modules)
            header = qemu.kernel_header(self.cache, vmlinuz)
        except (qemu.QemuUnavailable, InternalError, OSError) as e:
            raise BackendUnavailable(str(e)) from e
        self.vms_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.base = qemu.GuestImage(binary, vmlinuz, initrd, (), header)
        self.kvm, why = qemu.probe_kvm(self.base, root / "probe")
        if not self.kvm:
            log.warning("microvm: running guests under TCG emulation (slow): %s", why)
        self.accel_detail = "kvm" if self.kvm else f"tcg ({why})"
        self.seccomp = bpf_program()  # the container profile, for the agent to install in the guest
        # /.dsec-tools (a session's bash) as the top layer: the agent binds it read-only
        self.tools_layer = _tools_layer(self.cache, host.tools_dir, host.uid_offset)
        self._layer_images: dict[Path, Path] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}  # (one event loop's: per backend)

    @property
    def accelerated(self) -> bool:  # type: ignore[override]
        return self.kvm

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["detail"] = {"accelerator": self.accel_detail, "kernel": self.base.vmlinuz.name}
        return out

    # --- create -------------------------------------------------------------------------

    async def create(self, plan: base.SandboxPlan) -> MicroVm:
        """The isolation recipe of one sandbox, in order (see the module); whatever a failed
        step leaves is removed."""
        t0 = time.perf_counter()
        lowers = [*([self.tools_layer] if self.tools_layer else []), *plan.lowerdirs]
        if len(lowers) > MAX_LAYERS:
            raise InvalidRequest(
                f"image has too many layers ({len(lowers)}) for a microVM (at most {MAX_LAYERS}); "
                "merge some layers"
            )
        d = self.vms_dir / plan.id
        ids = self.id_ranges.claim()  # ids
        vm: MicroVm | None = None
        try:
            d.mkdir(mode=0o700)
            mem_mb = plan.limits.memory_mb + GUEST_KERNEL_MB
            cpus = max(1, int(-(-plan.limits.cpu // 1)))
            self.cgroups.create_for_process(  # cgroups
                plan.id,
                cpu=plan.limits.cpu,
                memory_bytes=(mem_mb + QEMU_OVERHEAD_MB) << 20,
                pids=QEMU_PIDS,
            )
            shape = {"layers": [str(p) for p in lowers], "memory_mb": mem_mb, "cpus": cpus}
            ckpt = plan.restore_from
            if ckpt is not None:  # refused before anything starts
                _check_shape(ckpt, shape)
            image = await self._image(lowers)  # layers
            disk = d / "rw.ext4"
            fresh = plan.writable_from is None and ckpt is None
            blank = await self._blank_disk(plan, disk if fresh else None)
            if plan.writable_from is not None:  # a fork: the parent's disk, copied for it
                os.replace(plan.writable_from, disk)
            if ckpt is not None:  # a restore: the disk of the checkpoint's instant
                await _sparse_copy(ckpt / "disk.ext4", disk)
            (d / "shape.json").write_text(json.dumps(shape))  # what a checkpoint restores onto
            t1 = time.perf_counter()
            template = None if ckpt is not None else await self._template(image, blank, mem_mb, cpus)
            guest = await qemu.start_vm(  # start
                image, d, disk, memory_mb=mem_mb, cpus=cpus, kvm=self.kvm, incoming=True,
                confine=(self.shim, ids.base), place=lambda pid: self.cgroups.join(plan.id, pid),
                ram=None if template is None else (template.ram, False), anonymous_ram=template is None,
            )  # fmt: skip
            vm = self._attach(plan.id, d, guest, ids)
            (d / "pid").write_text(str(vm.pid))  # for the reconciler (remove_orphan)
            ids.bind(vm.pid, vm.start_time)
            await guest.qmp.ignore_shared()
            state = (
                template.open_state()
                if template is not None
                else os.open(ckpt / "memory", os.O_RDONLY | os.O_CLOEXEC)  # type: ignore[operator]
            )
            try:
                await guest.qmp.restore(state)
            finally:
                os.close(state)
            t2 = time.perf_counter()
            if template is None:  # the guest was set up before its checkpoint
                await vm.channel.resumed(qemu.resumed_body(plan.id), READY_TIMEOUT_S)
            else:
                body = qemu.setup_body(
                    nlower=len(image.layers), pids=plan.pids, hostname=plan.id, address=GUEST_ADDR,
                    gateway=GUEST_GW, seccomp=self.seccomp, masked=MASKED_PATHS, readonly=READONLY_PATHS,
                    memory_mb=plan.limits.memory_mb,
                )  # fmt: skip
                await vm.channel.setup(body, READY_TIMEOUT_S)  # setup
            await self._route_guest(vm)
            await vm.channel.ping(READY_TIMEOUT_S)  # ready
            t3 = time.perf_counter()
        except BaseException:
            if vm is not None:
                await self.destroy(vm)  # gives its range back
            else:
                self._teardown(plan.id, d)
                ids.release()
            raise
        vm.timings_ms = {
            "layer_preparation": (t1 - t0) * 1000,
            "runtime_start": (t2 - t1) * 1000,
            "ready": (t3 - t2) * 1000,
        }
        return vm

    async def _image(self, lowers: Sequence[Path]) -> qemu.GuestImage:
        """The layers as EROFS disks (each made once, from the store's canonical ids shown
        as the guest's own)."""
        idmap = [str(self.shim), "idmap-run", f"{self.host.uid_offset}:0:65536"]
        loop = asyncio.get_running_loop()
        disks = []
        for layer in lowers:
            img = self._layer_images.get(layer)
            if img is None or not img.exists():
                img = await loop.run_in_executor(None, qemu.layer_image, self.cache, layer, idmap)
                self._layer_images[layer] = img
            disks.append(img)
        return dataclasses.replace(self.base, layers=tuple(disks))

    async def _blank_disk(self, plan: base.SandboxPlan, disk: Path | None) -> Path:
        """The blank disk of the plan's size (made once), and a sparse copy of it at `disk`."""
        inodes = min(plan.disk_inodes, 65536, plan.disk_mb * 256)  # (inode tables: 256 bytes each)
        blank = self.cache / f"blank-{plan.disk_mb}m-{inodes}i.ext4"
        if not blank.exists():
            await asyncio.get_running_loop().run_in_executor(
                None, qemu.blank_disk, self.cache, plan.disk_mb, inodes
            )
        if disk is not None:
            await _sparse_copy(blank, disk)
        return blank

    async def copy_writable_disk(
        self, handle: SandboxHandle, dests: Sequence[Path], check: Callable[[int], None]
    ) -> None:
        """The guest flushes its writable disk and holds its writers (FIFREEZE), QEMU is
        frozen, `check` is given the blocks the disk holds (a sparse copy takes no more),
        the disk is copied once per destination; then all runs on. A paused VM is thawed
        for the flush and paused again."""
        vm = self._own(handle)
        async with self._disk_held(vm):
            await self.freeze(vm)
            try:
                check((vm.dir / "rw.ext4").stat().st_blocks * 512)
                for dest in dests:
                    await _sparse_copy(vm.dir / "rw.ext4", dest)
            finally:
                self.thaw(vm)

    @contextlib.asynccontextmanager
    async def _disk_held(self, vm: MicroVm) -> AsyncIterator[None]:
        """The guest's writable disk flushed and its writers held (FIFREEZE) while the body
        runs; a paused VM is thawed for it and paused again."""
        paused = self.cgroups.is_frozen(vm.id)
        if paused:
            self.cgroups.thaw(vm.id)
        try:
            await vm.channel.quiesce(True)
            try:
                yield
            finally:
                await vm.channel.quiesce(False)
        finally:
            if paused:
                await self.freeze(vm)

    @contextlib.asynccontextmanager
    async def writes_held(self, handle: SandboxHandle) -> AsyncIterator[None]:
        async with self._disk_held(self._own(handle)):
            yield

    async def archive_writable(self, handle: SandboxHandle, out: int, limit: int) -> None:
        """The agent's tar of the overlay's upper directory (see the module), with the disk
        held: the host reads no file system a guest wrote, only a stream it checks."""
        vm = self._own(handle)
        async with self._disk_held(vm):
            await vm.channel.archive(out, limit)

    async def checkpoint(
        self, handle: SandboxHandle, dest: Path, *, leave_running: bool, while_stopped: WhileStopped = None
    ) -> CheckpointInfo:
        """QEMU stops and writes the guest's RAM and devices to `dest`/memory (a migration to
        a file); the disk is copied while it is stopped (`dest`/disk.ext4), with the layers
        it runs on (`dest`/shape.json); then it runs on, or its processes are killed."""
        vm = self._own(handle)
        t0 = time.perf_counter()
        dest.mkdir(mode=0o700)
        paused = self.cgroups.is_frozen(vm.id)
        if paused:
            self.cgroups.thaw(vm.id)
        try:
            mem = os.open(dest / "memory", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                try:
                    await vm.qmp.save(mem, timeout=300.0)  # stops the VM
                except (RuntimeError, TimeoutError) as e:
                    raise InternalError(f"QEMU could not write the memory checkpoint: {e}") from e
            finally:
                os.close(mem)
            t1 = time.perf_counter()
            try:
                await _sparse_copy(vm.dir / "rw.ext4", dest / "disk.ext4")
                shutil.copyfile(vm.dir / "shape.json", dest / "shape.json")
                if while_stopped is not None:
                    await while_stopped()
            finally:
                await vm.qmp.cmd("cont")
            t2 = time.perf_counter()
            if not leave_running:
                await vm.channel.kill_all()
        finally:
            if paused:
                await self.freeze(vm)
        size = sum(p.stat().st_blocks * 512 for p in (dest / "memory", dest / "disk.ext4"))
        timings = {"memory": (t1 - t0) * 1000, "disk": (t2 - t1) * 1000}
        # no trees: the whole VM is checkpointed, its kernel and every process
        return CheckpointInfo.record(vm.id, dest, [], size, leave_running, timings)

    async def archive_tree(self, handle: SandboxHandle, path: str, out: int, limit: int) -> None:
        """The agent's archiver, given a path (dsec-guest.c's tar_path), with the disk held:
        no tool of the image the agent may have replaced, whoever holds the pids."""
        vm = self._own(handle)
        async with self._disk_held(vm):
            await vm.channel.archive(out, limit, path=path)

    def load_checkpoint(self, src: Path) -> CheckpointInfo:
        return CheckpointInfo.load(src)

    async def restore(self, handle: SandboxHandle, src: Path, *, group_name: str) -> list[int]:
        raise UnsupportedOperation(
            f"a microVM's memory checkpoint starts a new VM (its memory and its disk together); "
            f"restore checkpoint {src.name} into a new sandbox instead of sandbox {handle.id}",
            reason="backend",
            backend=self.name,
            operation="restore into a running sandbox",
        )

    async def _template(self, image: qemu.GuestImage, blank: Path, mem_mb: int, cpus: int) -> Template:
        """The template of this shape: a VM booted to the agent's hello, kept (made once per
        process). The guest's kernel has read the size of every disk by then: a clone's disks
        must be the same sizes (so: per image and disk size)."""
        sizes = ",".join(str(p.stat().st_size) for p in (*image.layers, blank))
        shape = f"{image.vmlinuz.name}:{image.initrd.name}:{sizes}:{mem_mb}:{cpus}:{self.kvm}"
        key = hashlib.sha256(shape.encode()).hexdigest()[:20]
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            template = _TEMPLATES.pop(key, None)
            if template is None:
                template = await self._make_template(image, blank, mem_mb, cpus)
                log.info("microvm: template %s (%s) made in %.2f s", key, shape, template.made_s)
            _TEMPLATES[key] = template  # (re)inserted last: the most recently used
            while len(_TEMPLATES) > MAX_TEMPLATES:
                _TEMPLATES.pop(next(iter(_TEMPLATES))).close()
        return template

    async def _make_template(self, image: qemu.GuestImage, blank: Path, mem_mb: int, cpus: int) -> Template:
        t = time.perf_counter()
        d = self.vms_dir / f".template-{secrets.token_hex(6)}"
        d.mkdir(mode=0o700)
        ids = self.id_ranges.claim()
        ram = os.memfd_create("dsec-template-ram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        state = os.memfd_create("dsec-template-state", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(ram, mem_mb << 20)
            disk = d / "rw.ext4"
            qemu.sparse_copy(blank, disk)
            guest = await qemu.start_vm(
                image, d, disk, memory_mb=mem_mb, cpus=cpus, kvm=self.kvm, confine=(self.shim, ids.base),
                ram=(ram, True),
            )  # fmt: skip
            try:
                await wait_for(guest.channel.hello, READY_TIMEOUT_S)
                await guest.qmp.ignore_shared()
                await guest.qmp.save(state)
            finally:
                await guest.kill()
            for fd in (ram, state):  # nothing may change them now: every clone maps them
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
        except BaseException:
            os.close(ram)
            os.close(state)
            raise
        finally:
            ids.release()
            shutil.rmtree(d, ignore_errors=True)
        return Template(ram, state, time.perf_counter() - t)

    async def _route_guest(self, vm: MicroVm) -> None:
        """QEMU's namespace: tap0 is the guest's gateway; what the guest sends leaves by
        eth0 (once NetHost links it) masqueraded to the sandbox's address, nothing else."""
        script = (
            "table ip dsecvm {\n"
            "  chain vmfwd {\n"
            "    type filter hook forward priority 0; policy drop;\n"
            f'    iifname "tap0" oifname "eth0" ip saddr {GUEST_ADDR.split("/")[0]} accept\n'
            '    iifname "eth0" oifname "tap0" ct state established,related accept\n'
            "  }\n"
            "  chain vmnat {\n"
            "    type nat hook postrouting priority 100;\n"
            '    oifname "eth0" masquerade\n'
            "  }\n"
            "}\n"
        )
        (vm.dir / "net.nft").write_text(script)
        ns = f"--net=/proc/{vm.pid}/ns/net"
        for argv in (
            ["nsenter", ns, "ip", "addr", "add", f"{GUEST_GW}/30", "dev", "tap0"],
            # the policy's refusals (ICMP admin-prohibited) reach the guest at once, however
            # many: the kernel's per-destination limit on ICMP errors would hold most back
            # (its only destination here is the guest)
            ["nsenter", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.ipv4.icmp_ratelimit=0"],
            ["nsenter", ns, "nft", "-f", str(vm.dir / "net.nft")],
        ):
            await _run_host(argv, vm.dir / "net.log")

    def _attach(self, sandbox_id: str, d: Path, guest: qemu.GuestVm, ids: IdRange | None) -> MicroVm:
        start = linux.proc_start_time(guest.pid)
        if start is None:
            raise ProcessLookupError(guest.pid)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        vm = MicroVm(
            sandbox_id, guest.pid, start, d, guest.pidfd, guest.channel, guest.qmp, exited,
            id_base=ids.base if ids else 0, id_range=ids,
        )  # fmt: skip

        def on_exit() -> None:
            loop.remove_reader(guest.pidfd)
            with contextlib.suppress(ChildProcessError, OSError):
                res = os.waitid(os.P_PIDFD, guest.pidfd, os.WEXITED | os.WNOHANG)
                if res is not None:
                    vm.exit_status = (res.si_code, res.si_status)
            _awaited.discard(guest.pid)
            vm.channel.close()
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(guest.pidfd, on_exit)
        return vm

    # --- adopt / destroy ------------------------------------------------------------------

    async def adopt(
        self, sandbox_id: str, pid: int, start_time: int, *, paused: bool = False
    ) -> MicroVm | None:
        d = self.vms_dir / sandbox_id
        if not (d / "qmp.sock").exists():
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        if linux.proc_start_time(pid) != start_time:
            os.close(pidfd)
            return None
        if paused:
            with contextlib.suppress(OSError):
                self.cgroups.thaw(sandbox_id)
        try:
            guest = await qemu.connect_vm(d, pid, pidfd, 0, timeout=5.0)
        except (qemu.QemuUnavailable, OSError):
            os.close(pidfd)
            return None
        uid = _uid_of(pid)
        ids = self.id_ranges.adopt(uid, pid, start_time) if uid else None
        vm = self._attach(sandbox_id, d, guest, ids)
        if not await self._answers(vm, 5.0):
            return None
        with contextlib.suppress(InternalError, TimeoutError):  # a fork the last edge left midway
            await vm.channel.quiesce(False)
        if paused:
            self.cgroups.freeze(sandbox_id)
        return vm

    async def destroy(self, handle: SandboxHandle) -> None:
        vm = self._own(handle)
        gone = await self._end(vm)
        self._teardown(vm.id, vm.dir)
        self._give_back_ids(vm, gone)

    def _teardown(self, sandbox_id: str, d: Path) -> None:
        self.cgroups.remove_sandbox(sandbox_id)  # kills what is left in it
        shutil.rmtree(d, ignore_errors=True)

    def _own(self, handle: SandboxHandle) -> MicroVm:
        if not isinstance(handle, MicroVm):
            raise InternalError(f"sandbox {handle.id} is not a microVM of this backend")
        return handle

    async def kill_user_processes(self, handle: SandboxHandle) -> None:
        await self._own(handle).channel.kill_all()

    # --- what is left on the host ----------------------------------------------------------

    def leftover_ids(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name for p in self.vms_dir.iterdir() if p.is_dir() and not p.name.startswith(".")}
        return set()

    async def remove_orphan(self, sandbox_id: str) -> None:
        """Kill and remove a VM no record claims: its QEMU dies with its cgroups; if it is
        this process's child (a record lost, not an edge restart), it is reaped too."""
        pid = None
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.vms_dir / sandbox_id / "pid").read_text())
        if pid is not None and pid not in self.cgroups.procs(sandbox_id):
            pid = None  # only a process still in the sandbox's cgroup is its QEMU
        self._teardown(sandbox_id, self.vms_dir / sandbox_id)
        if pid is not None:
            for _ in range(100):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        break
                except ChildProcessError:
                    break  # not ours: its parent reaps it
                await asyncio.sleep(0.01)
            _awaited.discard(pid)


def _tools_layer(cache: Path, tools: Path | None, uid_offset: int) -> Path | None:
    """The edge's tools (/.dsec-tools: a session's static bash) as a layer directory of the
    store's canonical ids (made once per content): root's, execute-only as on the host, so
    every shell is non-dumpable to the guest's other users. None without the tools."""
    bash = tools / "bash" if tools is not None else None
    if bash is None or not bash.is_file():
        return None
    digest = hashlib.sha256(bash.read_bytes()).hexdigest()[:16]
    layer = cache / f"tools-{digest}"
    if layer.is_dir():
        return layer
    tmp = cache / f".tools-{secrets.token_hex(6)}"
    (tmp / ".dsec-tools").mkdir(parents=True)
    shutil.copyfile(bash, tmp / ".dsec-tools" / "bash")
    for path, mode in ((tmp, 0o755), (tmp / ".dsec-tools", 0o755), (tmp / ".dsec-tools" / "bash", 0o711)):
        os.chown(path, uid_offset, uid_offset)
        os.chmod(path, mode)
    try:
        os.rename(tmp, layer)
    except OSError:  # another edge made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return layer


async def _sparse_copy(src: Path, dst: Path) -> None:
    """A disk image copied keeping its holes (what was never written costs nothing)."""
    argv = ["cp", "--sparse=always", "--reflink=auto", str(src), str(dst)]
    with open(os.devnull, "wb") as devnull:
        if await run_process_quick(argv, devnull.fileno()) != 0:
            raise InternalError(f"could not copy the disk image {src.name}")


def _check_shape(ckpt: Path, shape: dict[str, Any]) -> None:
    """A checkpoint's VM restores only onto the disks and the machine it had: its kernel has
    them mounted and sized (a layer replaced since, say by a new toolkit, would be another
    file system under its feet)."""
    try:
        saved = json.loads((ckpt / "shape.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"checkpoint {ckpt.name} holds no microVM state ({e})") from e
    if saved != shape:
        what = "layers" if saved.get("layers") != shape["layers"] else "memory and vCPUs"
        raise UnsupportedOperation(
            f"checkpoint {ckpt.name} was taken on other {what} than a sandbox of its image has "
            "now (the image or the edge's toolkit changed since); it cannot be restored: "
            "create from a snapshot instead",
            reason="checkpoint_stale",
        )


def _uid_of(pid: int) -> int | None:
    """The real uid of a process (a microVM's QEMU runs as its sandbox's id base)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    return None


async def _run_host(argv: list[str], log_path: Path) -> None:
    """A host tool for a sandbox's namespace; a failure says what it printed."""
    with open(log_path, "wb") as logf:
        rc = await run_process_quick(argv, logf.fileno())
    if rc != 0:
        msg = log_path.read_text(errors="replace").strip()[-400:]
        raise InternalError(f"setting up the microVM's network ({argv[2]}) failed: {msg}")
