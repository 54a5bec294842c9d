"""The container backend: crun over an overlayfs of composed layers.

Lifecycle of one sandbox (all host resources carry the prefix ``dsec``)::

    create:  config.json, then `dsec-shim crun-wrap` -> `crun run -d` with the shim control
             socketpair at fds 3-4; the wrapper first mounts, in a mount namespace of its own
             (so nothing lands in the host's mount table):
               "dsec-upper" on <run>/sandboxes/<id>/up    (upper + work; size = disk quota): an
                 ext4 on a loop device of its own (storage="disk", dsec.backends.writable), or a tmpfs
               overlay "dsec-rootfs" on <run>/sandboxes/<id>/rootfs (layers as lowerdirs, top first)
             -> PID 1 is dsec-shim; ready when it answers a ping
    spawn:   one datagram to the shim with stdio fds + an exec cgroup fd (see dsec-shim.c)
    adopt:   after an edge restart: pidfd_open(shim) + pidfd_getfd(shim, 4) gives the control
             socket back; messages sent while the edge was away are still queued in it
    destroy: SIGKILL the shim (the pid namespace dies with it), crun delete, unmount, rm
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends import criu
from dsec.backends.base import Backend, BackendHost, Capability, SandboxHandle, SandboxPlan, WhileStopped
from dsec.backends.shim import ShimChannel
from dsec.backends.writable import MOUNT_OPTIONS, LoopDisk
from dsec.errors import InternalError, InvalidRequest
from dsec.isolation import linux
from dsec.isolation.idranges import IdRange, range_of
from dsec.isolation.procs import _awaited, mounts_under, reap_strays, run_process_quick, unmount_all
from dsec.isolation.spec import ID_RANGE, build_config

log = logging.getLogger("dsec.backends.container")

MAX_LAYERS = 500  # overlayfs stacks at most 500 lowers


@dataclass
class Container(SandboxHandle):
    """A sandbox of the container backend: its init (dsec-shim) as PID 1 of a pid namespace."""

    id: str
    pid: int
    start_time: int
    dir: Path
    pidfd: int
    channel: ShimChannel
    exited: asyncio.Future[None]
    timings_ms: dict[str, float] = field(default_factory=dict)
    upper_fd: int = -1  # O_PATH on the writable layer's root (its ext4 or tmpfs: upper/ and work/)
    id_base: int = 0  # the host uid (and gid) its root is: its own range (isolation/idranges.py)
    id_range: IdRange | None = None  # this process's claim on that range
    exit_status: tuple[int, int] | None = None  # (si_code, si_status) of the init, once reaped
    runtime_state: Path = Path("/nonexistent")  # the OCI runtime's state directory of it

    def exit_reason(self) -> str:
        if self.exit_status is None:
            return "its init exited"
        code, status = self.exit_status
        if code in (os.CLD_KILLED, os.CLD_DUMPED):
            return f"its init was killed by {signal.Signals(status).name}"
        return f"its init exited with status {status}"

    def disk_usage(self) -> tuple[int, int, bool]:
        """(bytes, inodes) used in the writable layer, and whether either is exhausted. Full:
        no inode left, or less room than ext4 may refuse a write with (its ENOSPC can leave up
        to ~1 MiB: a 1 MiB write, and the next, refused with 0.2-0.7 MiB free; a tmpfs's 0)."""
        if self.upper_fd < 0:
            return 0, 0, False
        st = os.statvfs(f"/proc/{os.getpid()}/fd/{self.upper_fd}")
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        room = st.f_bavail * st.f_frsize
        return (
            used,
            st.f_files - st.f_ffree,
            room < min(1 << 20, st.f_blocks * st.f_frsize // 16) or st.f_favail == 0,
        )

    @property
    def upper(self) -> Path:
        """The writable layer as this process reaches it (its file system is mounted in the
        sandbox's mount namespace only)."""
        if self.upper_fd < 0:
            raise InternalError(f"sandbox {self.id} has no handle on its writable layer")
        return Path(f"/proc/{os.getpid()}/fd/{self.upper_fd}/upper")  # usable by helper processes too

    def writable_layer(self) -> Path:
        return self.upper

    @property
    def rootfs(self) -> Path:
        """The sandbox's root as the host reaches it (its mounts live only in its own
        mount namespace)."""
        return Path(f"/proc/{self.pid}/root")

    def open_root(self) -> int:
        return os.open(self.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def alive(self) -> bool:
        return not self.exited.done()

    def seccomp_program(self) -> Path | None:
        bpf = self.runtime_state / "seccomp.bpf"
        return bpf if bpf.exists() else None

    def release(self) -> None:
        """Close this process's descriptors on the sandbox (it keeps running)."""
        self.channel.close()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.pidfd)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        if self.upper_fd >= 0:
            # Once the sandbox is gone this may be the writable layer's last reference: its
            # close unmounts the file system there and then (an ext4's umount and its loop
            # device's release: ~2-15 ms; a big tmpfs's pages freed), off the event loop.
            _closer.submit(os.close, self.upper_fd)
            self.upper_fd = -1


_closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-layer-close")


def landlock_abi() -> int:
    """The host kernel's Landlock ABI version (0: none), as the shim asks it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, int(libc.syscall(444, None, 0, 1)))  # landlock_create_ruleset(.., _VERSION)


class ContainerBackend(Backend):
    """Creates, adopts and destroys container sandboxes on this node."""

    name = "container"
    capabilities = frozenset(Capability)
    dir_name = "sandboxes"  # under the run directory: one bundle directory per sandbox
    handle_class: type[Container] = Container
    stray_comms = frozenset({"crun", "runc"})  # the runtime's processes we reap as zombies

    def __init__(self, host: BackendHost) -> None:
        self.host = host
        self.run_dir = host.run_dir
        self.sandboxes_dir = host.run_dir / self.dir_name
        self.runtime_root = host.run_dir / "runtime"
        self.shim = host.shim
        self.runtime = shutil.which(host.runtime) or host.runtime
        self.uid_offset = host.uid_offset  # the layer store's canonical range
        self.id_ranges = host.id_ranges  # each sandbox's own range
        self.cgroups = host.cgroups
        self.tools_dir = host.tools_dir  # bound read-only at /.dsec-tools in every sandbox
        self.disks = host.disks  # writable layers on disk (storage="disk")
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_root.mkdir(parents=True, exist_ok=True)
        # crun compiles the seccomp profile with libseccomp at every start (~1.3 ms) and keeps
        # the result in its state dir; the first start of each profile pays for it, later
        # ones hand crun that program (annotation run.oci.seccomp_bpf_data, which replaces
        # the seccomp section): the same filter, compiled once per edge process.
        self._seccomp_bpf: dict[str, str] = {}
        self._reaped_at = 0.0
        self._seccomp_learn: dict[str, str] = {}  # sandbox id -> profile key, to read after its start
        if self.name == "container" and landlock_abi() < 6:
            log.warning(
                "this kernel has no Landlock signal scoping (ABI 6, Linux 6.12): container sandboxes "
                "run every exec at one level, so what one exec leaves running can kill a later one "
                "(native/dsec-landlock.h)"
            )

    # --- create ---------------------------------------------------------------

    async def create(self, plan: SandboxPlan) -> Container:
        """The isolation recipe of one sandbox, in order; whatever a failed step leaves is
        removed (`_teardown` is safe on partial state):

        1. ids: a host id range of its own, claimed host-wide (its user namespace maps it)
        2. layers: the writable layer's ext4 on a loop device (storage="disk"; a tmpfs for
           "memory"), size and inodes = disk quota; the bundle directory; the image's layers,
           idmapped from the store's range to its own, under an overlay, all mounted by
           crun-wrap in the runtime's own mount namespace
        3. config: namespaces (user, pid, mount, network, ipc, uts, cgroup), the cgroup
           and its limits, capabilities, masked paths, and the seccomp filter (compiled once
           per profile per edge process)
        4. start: `dsec-shim crun-wrap` -> `crun run`; PID 1 is dsec-shim, holding the
           control socket (fd 4) and the writable layer's handle (fd 5)
        5. cgroups: the user's group inside the sandbox's (its pids limit below the
           platform's reserve, so the platform can always start a process)
        6. ready: the shim answers a ping

        Network policy is the edge's (`NetHost`), applied in `handle.pid`'s network
        namespace once the sandbox's files are reachable (it writes resolv.conf)."""
        t0 = time.perf_counter()
        d = self.sandboxes_dir / plan.id
        ids = self.id_ranges.claim()  # 1
        container: Container | None = None
        disk = None
        try:
            disk = await self._disk(plan)  # 2
            mounts = self._layers(d, plan, ids.base, disk)
            self._config(d, plan, ids.base)  # 3
            t1 = time.perf_counter()
            pid = await self._start_runtime(d, plan, mounts)  # 4
            if disk is not None:  # mounted by the launcher, which is its only user from here
                disk.close()
            now = time.monotonic()
            if now - self._reaped_at > 0.5:  # crun's intermediate processes, reparented to us
                self._reaped_at = now  # (a scan costs ~0.4 ms with 1,000 live: not per start)
                reap_strays(self.stray_comms)
            t2 = time.perf_counter()
            self._learn_seccomp(plan.id)
            container = self._attach(plan.id, d, pid, None)
            container.id_base, container.id_range = ids.base, ids
            ids.bind(container.pid, container.start_time)
            self._after_start(container, plan)  # 5
            await container.channel.ping()  # 6
            t3 = time.perf_counter()
        except BaseException:
            if disk is not None:
                disk.close()
            self._seccomp_learn.pop(plan.id, None)
            if container is None:
                container = self._started_init(plan.id, d, ids)
            if container is not None:
                await self.destroy(container)  # gives its range back
            else:
                await self._teardown(plan.id, d)
                ids.release()
            raise
        container.timings_ms = {
            "layer_preparation": (t1 - t0) * 1000,
            "runtime_start": (t2 - t1) * 1000,
            "ready": (t3 - t2) * 1000,
        }
        return container

    def _started_init(self, sandbox_id: str, d: Path, ids: IdRange) -> Container | None:
        """The init the runtime started, when the create ends before it was attached (it was
        cancelled while `crun run` ran: the cancellation waits for it). It is then ended like
        any sandbox's init and reaped here: `crun delete` alone left it a zombie of the edge."""
        try:
            pid = int((d / "pid").read_text())
            if pid not in self.cgroups.procs(sandbox_id):  # gone (its pid maybe reused)
                return None
            container = self._attach(sandbox_id, d, pid, None)
        except (OSError, ValueError):
            return None
        container.id_base, container.id_range = ids.base, ids
        ids.bind(container.pid, container.start_time)
        return container

    async def _disk(self, plan: SandboxPlan) -> LoopDisk | None:
        """The writable layer's file system on a loop device of its own (storage="disk"), or
        None for a tmpfs (storage="memory"); its blank template is made once per shape."""
        if plan.storage == "memory":
            return None
        if self.disks is None:
            raise InternalError("this edge has no directory for writable layers on disk")
        if not self.disks.ready(plan.disk_mb, plan.disk_inodes):  # mkfs: off the loop, once
            await asyncio.get_running_loop().run_in_executor(
                None, self.disks.template, plan.disk_mb, plan.disk_inodes
            )
        try:
            return self.disks.attach(plan.disk_mb, plan.disk_inodes, plan.id)
        except OSError as e:
            raise InternalError(f"the writable layer on disk could not be made: {e}") from e

    def _layers(self, d: Path, plan: SandboxPlan, base: int, disk: LoopDisk | None) -> list[str]:
        """The bundle directory; the mount arguments for `dsec-shim crun-wrap`, which mounts
        the writable layer (`disk`'s ext4, or a tmpfs), the layers (idmapped from the store's
        canonical range to the sandbox's own, `base`) and the overlay inside the runtime's
        own mount namespace."""
        up, rootfs, lowers = d / "up", d / "rootfs", d / "lower"
        d.mkdir(mode=0o711)  # the userns root must traverse it to reach rootfs
        d.chmod(0o711)
        up.mkdir()
        rootfs.mkdir()
        lowers.mkdir(mode=0o700)
        if len(plan.lowerdirs) > MAX_LAYERS:
            raise InvalidRequest(
                f"image has too many layers ({len(plan.lowerdirs)}, at most {MAX_LAYERS}) to stack; "
                "merge some layers"
            )
        if disk is not None:  # the shim mounts "ext4=DEVICE,OPTIONS" as ext4, anything else as a tmpfs
            upper = f"ext4={disk.device},{MOUNT_OPTIONS}"
        else:
            upper = f"size={plan.disk_mb}m,nr_inodes={plan.disk_inodes},mode=0755,uid={base},gid={base}"
        idmap = f"{self.uid_offset}:{base}:{ID_RANGE}" if base != self.uid_offset else "-"
        mounts = [str(up), upper, str(rootfs), str(base), idmap, str(lowers), str(len(plan.lowerdirs))]
        return mounts + [str(p) for p in plan.lowerdirs]

    def _after_start(self, container: Container, plan: SandboxPlan) -> None:
        self.cgroups.setup_user_group(plan.id, plan.pids)

    def _config(self, d: Path, plan: SandboxPlan, base: int) -> None:
        """The OCI config: namespaces, cgroup and limits, capabilities, seccomp."""
        config = self._base_config(plan, base)
        self._use_compiled_seccomp(plan.id, config)
        self._write_config(d, config)

    def _write_config(self, d: Path, config: dict[str, Any]) -> None:
        (d / "config.json").write_text(json.dumps(config))

    def _base_config(self, plan: SandboxPlan, base: int) -> dict[str, Any]:
        return build_config(
            hostname=plan.id,
            args=["/.dsec/shim", "init"],
            cgroups_path=self.cgroups.sandbox_path(plan.id),
            limits=plan.limits,
            uid_offset=base,
            id_range=ID_RANGE,
            env=plan.env,
            tools_dir=str(self.tools_dir) if self.tools_dir else None,
        )

    @staticmethod
    def _seccomp_key(profile: object) -> str:
        return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()

    def _use_compiled_seccomp(self, sandbox_id: str, config: dict[str, Any]) -> None:
        profile = config["linux"].get("seccomp")
        if profile is None:
            return
        key = self._seccomp_key(profile)
        bpf = self._seccomp_bpf.get(key)
        if bpf is None:
            self._seccomp_learn[sandbox_id] = key
            return
        # crun takes the program from the annotation and only the flags (logging of denials)
        # from the section.
        config["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ALLOW", "flags": profile.get("flags", [])}
        config.setdefault("annotations", {})["run.oci.seccomp_bpf_data"] = bpf

    def _learn_seccomp(self, sandbox_id: str) -> None:
        key = self._seccomp_learn.pop(sandbox_id, None)
        if key is None or key in self._seccomp_bpf:
            return
        with contextlib.suppress(OSError):
            data = (self.runtime_root / sandbox_id / "seccomp.bpf").read_bytes()
            if data and len(data) % 8 == 0:  # struct sock_filter: 8 bytes per instruction
                self._seccomp_bpf[key] = base64.b64encode(data).decode()

    async def _start_runtime(self, d: Path, plan: SandboxPlan, mounts: list[str]) -> int:
        edge_end, shim_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The shim keeps a copy of the edge end (fd 4): see adopt().
        with edge_end, shim_end, open(d / "runtime.log", "wb") as log:
            argv = [
                *self._launcher("crun-wrap", shim_end, edge_end, mounts),
                "--root",
                str(self.runtime_root),
                "run",
                "--detach",
                "--preserve-fds",
                "3",
                "--pid-file",
                str(d / "pid"),
                "--bundle",
                str(d),
                plan.id,
            ]
            rc = await run_process_quick(argv, log.fileno(), (shim_end.fileno(), edge_end.fileno()))
        if rc != 0:
            msg = (d / "runtime.log").read_text(errors="replace").strip()[-2000:]
            raise InternalError(f"the OCI runtime failed to start the sandbox: {msg or f'exit code {rc}'}")
        return int((d / "pid").read_text())

    def _launcher(
        self, mode: str, shim_end: socket.socket, edge_end: socket.socket, mounts: list[str]
    ) -> list[str]:
        """dsec-shim's launcher of the runtime (crun-wrap; runsc-keep for gVisor): the two
        ends of the control socket, the mounts it makes, then the runtime's command."""
        hybrid = "1" if self.cgroups.hybrid else "0"
        ends = [str(shim_end.fileno()), str(edge_end.fileno())]
        return [str(self.shim), mode, *ends, hybrid, *mounts, "--", self.runtime]

    def _attach(self, sandbox_id: str, d: Path, pid: int, start_time: int | None) -> Container:
        pidfd = os.pidfd_open(pid)
        try:
            actual = linux.proc_start_time(pid)
            if actual is None or (start_time is not None and actual != start_time):
                raise ProcessLookupError(pid)
            sock = socket.socket(fileno=linux.pidfd_getfd(pidfd, 4))
            try:
                upper_fd = linux.pidfd_getfd(pidfd, 5)
            except OSError:
                upper_fd = -1  # started without a writable-layer handle: no snapshots
        except BaseException:
            os.close(pidfd)
            raise
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            # The edge is a child subreaper, so the shim became our child when the
            # runtime exited: reap it, or it lingers as a zombie (and keeps cgroup refs).
            with contextlib.suppress(ChildProcessError, OSError):
                res = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
                if res is not None:
                    container.exit_status = (res.si_code, res.si_status)
            _awaited.discard(pid)
            if not exited.done():
                exited.set_result(None)

        container = self.handle_class(
            sandbox_id,
            pid,
            actual,
            d,
            pidfd,
            ShimChannel(sock),
            exited,
            upper_fd=upper_fd,
            runtime_state=self.runtime_root / sandbox_id,
        )
        _awaited.add(pid)  # reaped by on_exit (when it is our child: created by, not adopted into, us)
        loop.add_reader(pidfd, on_exit)
        return container

    # --- adopt / destroy --------------------------------------------------------

    async def adopt(
        self, sandbox_id: str, pid: int, start_time: int, *, paused: bool = False
    ) -> Container | None:
        """Re-attach to a sandbox a previous edge process started, if it still runs."""
        d = self.sandboxes_dir / sandbox_id
        if not (d / "rootfs").is_dir():
            return None
        if paused:  # a frozen init cannot answer the adoption ping
            with contextlib.suppress(OSError, InternalError):
                self._thaw_for_adoption(sandbox_id)
        container = await self._adopt(sandbox_id, d, pid, start_time)
        if paused and container is not None:
            self._freeze_after_adoption(sandbox_id)
        return container

    def _thaw_for_adoption(self, sandbox_id: str) -> None:
        self.cgroups.thaw(sandbox_id)

    def _freeze_after_adoption(self, sandbox_id: str) -> None:
        self.cgroups.freeze(sandbox_id)

    def _id_base(self, container: Container) -> int:
        """The host id the sandbox's root is, from its init's user namespace."""
        return range_of(container.pid) or self.uid_offset

    async def _adopt(self, sandbox_id: str, d: Path, pid: int, start_time: int) -> Container | None:
        try:
            container = self._attach(sandbox_id, d, pid, start_time)
        except (ProcessLookupError, OSError):
            return None
        container.id_base = self._id_base(container)
        container.id_range = self.id_ranges.adopt(container.id_base, pid, start_time)
        return container if await self._answers(container, 2.0) else None

    async def destroy(self, handle: SandboxHandle) -> None:
        container = self._own(handle)
        gone = await self._end(container)
        # With PID 1 gone and reaped, the pid namespace is empty: the runtime has
        # nothing left to stop, and removing its state ourselves saves a process.
        await self._teardown(container.id, container.dir, use_runtime=not gone)
        self._give_back_ids(container, gone)

    def _own(self, handle: SandboxHandle) -> Container:
        if not isinstance(handle, Container):
            raise InternalError(f"sandbox {handle.id} is not a container of this backend")
        return handle

    async def kill_user_processes(self, handle: SandboxHandle) -> None:
        await criu.kill_user_processes(self.cgroups, handle.id)

    # --- memory checkpoints (CRIU: dsec.backends.criu) ---------------------------------

    def _criu(self) -> Path:
        return criu.find_criu(self.host.criu_root or self.run_dir / "criu")

    async def checkpoint(
        self, handle: SandboxHandle, dest: Path, *, leave_running: bool, while_stopped: WhileStopped = None
    ) -> criu.CheckpointInfo:
        return await criu.dump(
            handle,
            dest,
            criu=self._criu(),
            uid_offset=self.uid_offset,
            leave_running=leave_running,
            while_stopped=while_stopped,
        )

    async def restore(self, handle: SandboxHandle, src: Path, *, group_name: str) -> list[int]:
        return await criu.restore(handle, src, criu=self._criu(), cgroups=self.cgroups, group_name=group_name)

    def load_checkpoint(self, src: Path) -> criu.CheckpointInfo:
        return criu.CheckpointInfo.load(src)

    def require_checkpoint(self, operation: str = "checkpoint") -> None:
        super().require_checkpoint(operation)
        self._criu()  # not installed: a clear error before anything is copied or created

    async def _teardown(self, sandbox_id: str, d: Path, *, use_runtime: bool = True) -> None:
        """Remove every host resource of a sandbox; safe to call on partial state."""
        if use_runtime and (self.runtime_root / sandbox_id).exists():
            argv = [self.runtime, "--root", str(self.runtime_root), "delete", "--force", sandbox_id]
            with open(os.devnull, "wb") as devnull:
                await run_process_quick(argv, devnull.fileno())
        shutil.rmtree(self.runtime_root / sandbox_id, ignore_errors=True)
        self.cgroups.remove_sandbox(sandbox_id)
        for m in (d / "rootfs", d / "up"):
            unmount_all(m)
        shutil.rmtree(d, ignore_errors=True)

    def leftover_ids(self) -> set[str]:
        return self.runtime_ids() | self.sandbox_dirs()

    def stray_mounts(self, known: set[str]) -> list[str]:
        return [m for m in mounts_under(self.sandboxes_dir) if m.split("/")[-2] not in known]

    def runtime_ids(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name for p in self.runtime_root.iterdir() if p.is_dir()}
        return set()

    def sandbox_dirs(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()}
        return set()

    async def remove_orphan(self, sandbox_id: str) -> None:
        """Kill and remove whatever is left of a sandbox no record claims."""
        pid_file = self.sandboxes_dir / sandbox_id / "pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            # Only a process that is still in this sandbox's cgroup is ours to kill.
            if pid in self.cgroups.procs(sandbox_id):
                os.kill(pid, signal.SIGKILL)
        await self._teardown(sandbox_id, self.sandboxes_dir / sandbox_id)
