"""What a backend is: the one interface the edge runs sandboxes through.

A backend turns a `SandboxPlan` (composed layers, limits, environment) into a running
sandbox and gives the edge a `SandboxHandle` to it. The edge never reaches past these two
classes and the shim protocol (`dsec.backends.shim`, which every backend's init or guest
agent speaks): it starts processes through `handle.channel`, reaches the files through
`handle.open_root()`, snapshots and forks from `handle.writable_layer()`, applies network
policy in the network namespace of `handle.pid`, and asks the backend to freeze, thaw,
checkpoint, restore, adopt and destroy.

Every backend declares what it can do (`capabilities`); the edge asks before each operation
(`backend.require(Capability.CHECKPOINT, "checkpoint")`) and a sandbox on a backend that
lacks it answers `unsupported_operation` naming the backend and the operation. Backends
are found by name in `dsec.backends.registry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dsec.aio import wait_for
from dsec.backends.shim import ShimChannel
from dsec.errors import InternalError, UnsupportedOperation
from dsec.isolation.cgroups import ExecGroup
from dsec.isolation.spec import Limits

if TYPE_CHECKING:
    from dsec.backends.writable import WritableDisks
    from dsec.isolation.cgroups import CgroupHost
    from dsec.isolation.idranges import IdRange, IdRanges
    from dsec.isolation.netpolicy import NetHost


WhileStopped = Callable[[], Awaitable[None]] | None  # what runs while a checkpoint holds the processes


class ChannelGroup(ExecGroup):
    """An exec's group where no host cgroup can hold it (its processes are not host
    processes: gVisor's, a VM's): killed through the init's channel, which signals the
    exec's process group (a guest agent: its guest cgroup) `repeats` times over, since what
    it forks meanwhile joins the group."""

    def __init__(self, channel: ShimChannel, repeats: int = 1) -> None:
        super().__init__(Path("/nonexistent/dsec-channel-group"), -1, 0)
        self.channel = channel
        self.repeats = repeats
        self.loop = asyncio.get_running_loop()
        self.ident: int | None = None

    def bind(self, ident: int) -> None:
        self.ident = ident

    def procs(self) -> list[int]:
        return []  # none of them is a host process

    def kill(self) -> None:
        """Called from a worker thread, like a cgroup kill: the channel is the loop's."""
        for i in range(self.repeats):
            if self.ident is None or self.channel.closed:
                return
            if i:
                time.sleep(0.005)
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self.loop.call_soon_threadsafe(self.channel.signal, self.ident, signal.SIGKILL)

    def remove(self) -> None:
        pass


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this host (a tool it needs is missing or does not work
    here): the edge reports it absent, with this as the reason."""


class Capability(StrEnum):
    """One thing a backend may or may not do for its sandboxes."""

    EXEC = "exec"  # processes with stdio, streamed, with signals
    # bash and Python sessions: what a run reports must be out of reach of every other process
    # of the sandbox (the session's shell and interpreter are non-dumpable, so their
    # descriptors cannot be reopened through /proc)
    SESSIONS = "sessions"
    FILES = "files"  # read/write/edit/list/archive through a handle on the root
    PAUSE = "pause"  # freeze every process, and thaw
    SNAPSHOT = "snapshot"  # copy the writable layer into a new image
    FORK = "fork"  # start copies from the writable layer of a live sandbox
    CHECKPOINT = "checkpoint"  # processes and memory to a directory, and back
    NETWORK = "network"  # the edge's nftables policy in the sandbox's network namespace
    TRUSTED_EXEC = "trusted_exec"  # the image's own toolchain over the agent's files (verify)
    TELEMETRY = "telemetry"  # per-call cgroup counters: forks refused, oom kills, disk full


@dataclass(frozen=True)
class SandboxPlan:
    """Everything a backend needs to start one sandbox, decided by the edge."""

    id: str
    lowerdirs: list[Path]  # the composed layers, top first (the toolkit, fork layers, the image)
    limits: Limits
    disk_mb: int
    env: dict[str, str]
    disk_inodes: int = 262144
    storage: str = "disk"  # the writable layer: "disk" (an ext4 of its own) or "memory" (a tmpfs)
    pids: int = 1024  # processes the sandbox's user may run (the limit keeps a reserve for us)
    # a disk-image writable layer to start from (a fork of a backend whose writable layer is
    # a disk: `Backend.copy_writable_disk`); moved into the sandbox, which owns it from then
    writable_from: Path | None = None
    # a memory checkpoint to start from, where the backend restores one at create (a VM: its
    # memory and its disk at one instant; `Backend.restores_at_create`)
    restore_from: Path | None = None


@dataclass(frozen=True)
class BackendHost:
    """What the edge gives every backend it starts: the host-wide pieces they share."""

    run_dir: Path  # this edge's run tmpfs
    shim: Path  # dsec-shim, the init (or guest agent) every sandbox runs
    runtime: str  # the OCI runtime the container backend drives
    uid_offset: int  # the layer store's canonical id range
    id_ranges: IdRanges  # each sandbox's own host id range
    cgroups: CgroupHost
    net: NetHost
    tools_dir: Path | None = None  # bound read-only at /.dsec-tools in every sandbox
    criu_root: Path | None = None  # where a CRIU the project built lives
    runsc_root: Path | None = None  # where install.sh unpacked gVisor's runsc
    microvm_root: Path | None = None  # the guest kernel, layer disk images and template VMs
    disks: WritableDisks | None = None  # writable layers on disk (storage="disk"), host-wide


class CheckpointTreeRecord(Protocol):
    root: int  # pid inside of the tree's first process
    pids: list[int]
    cmdline: str


class CheckpointRecord(Protocol):
    """What a backend's checkpoint says about itself (CRIU's: dsec.backends.criu.CheckpointInfo)."""

    sandbox: str
    size_bytes: int
    leave_running: bool
    created_at: float
    timings_ms: dict[str, float]

    @property
    def trees(self) -> Sequence[CheckpointTreeRecord]: ...

    def save(self) -> None: ...


class SandboxHandle(ABC):
    """A running sandbox, as its backend lets the edge reach it."""

    id: str
    pid: int  # a host process in the sandbox's namespaces (its init): network, checkpoint, trusted
    start_time: int  # that process's start time (a pid alone can be reused)
    id_base: int  # the host uid and gid the sandbox's root is
    exited: asyncio.Future[None]  # done when the sandbox's init is gone
    pidfd: int  # on `pid`, held by this process (-1 once released)
    id_range: IdRange | None  # this process's claim on the sandbox's id range
    timings_ms: dict[str, float]
    # Processes inside are started, signalled and fed through the shim's protocol, whatever
    # carries it (a socket to the container's init; a virtio-serial port to a guest agent).
    channel: ShimChannel

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def release(self) -> None:
        """Close this process's descriptors on the sandbox (it keeps running)."""

    @abstractmethod
    def exit_reason(self) -> str:
        """Why it stopped, in words for a user ("its init was killed by SIGKILL")."""

    @abstractmethod
    def open_root(self) -> int:
        """An O_PATH descriptor on the sandbox's root directory, for the file API."""

    @abstractmethod
    def writable_layer(self) -> Path:
        """The sandbox's writable layer, as host helper processes reach it."""

    @abstractmethod
    def disk_usage(self) -> tuple[int, int, bool]:
        """(bytes, inodes) used in the writable layer, and whether either is exhausted."""

    @abstractmethod
    def seccomp_program(self) -> Path | None:
        """The compiled seccomp filter of this sandbox (trusted execs run under it too)."""

    def exec_group(self, cgroups: CgroupHost, name: str) -> ExecGroup:
        """What holds one exec or session and everything it starts (killed as one at a
        timeout): a host cgroup below the sandbox's, where sandbox processes are host
        processes."""
        return cgroups.open_exec_group(self.id, name)


class Backend(ABC):
    """Creates, adopts, pauses, checkpoints and destroys the sandboxes of one kind."""

    name: ClassVar[str]
    capabilities: ClassVar[frozenset[Capability]]
    cgroups: CgroupHost  # the host's cgroups (set by the backend's constructor)
    accelerated: ClassVar[bool] = True  # False: runs, but emulated (a microVM under TCG)
    # where the sandbox's own packets pass in the network namespace of `handle.pid` (the
    # network policy's inner table hooks there): output for processes in it, forward for a
    # VM's guest behind a tap
    net_hook: ClassVar[str] = "output"
    # whether the host reaches the sandbox's files (`handle.open_root()`); if not (a VM's
    # files are in a disk only its kernel mounts), the edge's file API runs processes inside
    host_files: ClassVar[bool] = True
    # whether a trusted exec (verify) runs in a fresh sandbox of this backend, given the task's
    # files as data (dsec.edge.gradersandbox), rather than as a host process that joins the
    # sandbox's namespaces (dsec-trusted: its processes must be host processes)
    trusted_in_fresh_sandbox: ClassVar[bool] = False
    # whether a memory checkpoint is restored by starting a new sandbox from it
    # (`SandboxPlan.restore_from`: a VM's memory and disk), rather than into a started one
    # (`restore`: CRIU's processes over the checkpoint's files)
    restores_at_create: ClassVar[bool] = False

    def require(self, capability: Capability, operation: str | None = None) -> None:
        """Refuse `operation` unless this backend declares `capability`."""
        if capability not in self.capabilities:
            op = operation or capability.value
            can = ", ".join(sorted(c.value for c in self.capabilities))
            raise UnsupportedOperation(
                f"the {self.name} backend does not support {op}; it supports: {can}",
                reason="backend",
                backend=self.name,
                operation=op,
            )

    def describe(self) -> dict[str, Any]:
        """The fields of a `dsec.models.BackendInfo`."""
        return {
            "name": self.name,
            "capabilities": sorted(c.value for c in self.capabilities),
            "accelerated": self.accelerated,
            "detail": {},
        }

    # --- lifecycle ----------------------------------------------------------------

    @abstractmethod
    async def create(self, plan: SandboxPlan) -> SandboxHandle:
        """Start a sandbox; ready for its first process when this returns."""

    @abstractmethod
    async def adopt(
        self, sandbox_id: str, pid: int, start_time: int, *, paused: bool = False
    ) -> SandboxHandle | None:
        """Re-attach to a sandbox an earlier edge process started, if it still runs (and
        leave it paused if it was)."""

    @abstractmethod
    async def destroy(self, handle: SandboxHandle) -> None:
        """Kill the sandbox and remove every host resource it had."""

    def detach(self, handle: SandboxHandle) -> None:
        """Let go of the sandbox in this process but leave it running (for a later adopt)."""
        handle.release()

    # Pause: the kernel's freezer on the sandbox's host cgroup, which holds whatever runs it
    # (its processes, gVisor's sentry, a VM's QEMU); a backend may do otherwise.

    async def freeze(self, handle: SandboxHandle) -> None:
        """Stop every process of the sandbox (pause; a consistent point for a copy of its files)."""
        await asyncio.get_running_loop().run_in_executor(None, self.cgroups.freeze, handle.id)

    def thaw(self, handle: SandboxHandle) -> None:
        """Let them run again. Quick: it is on the path of any operation on a paused sandbox."""
        self.cgroups.thaw(handle.id)

    async def reclaim(self, handle: SandboxHandle) -> None:
        """Give back what memory of a frozen sandbox the host can take (a pause does this)."""
        await asyncio.get_running_loop().run_in_executor(None, self.cgroups.reclaim, handle.id)

    async def _end(self, handle: SandboxHandle) -> bool:
        """SIGKILL the sandbox's host process (`pid`: its init, keeper or QEMU), wait for it
        to be reaped (5 s at most) and let go of it here; whether it is gone."""
        with contextlib.suppress(ProcessLookupError, OSError):
            if handle.pidfd >= 0:
                signal.pidfd_send_signal(handle.pidfd, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await wait_for(asyncio.shield(handle.exited), 5.0)
        handle.release()
        return handle.exited.done()

    @staticmethod
    def _give_back_ids(handle: SandboxHandle, gone: bool) -> None:
        """Release the sandbox's id range; a process that would not die keeps it (its record
        names it) until it does."""
        if handle.id_range is not None:
            handle.id_range.release(keep_holder=not gone)
            handle.id_range = None

    async def _answers(self, handle: SandboxHandle, timeout: float) -> bool:
        """Whether an adopted sandbox's init answers a ping; one that does not is destroyed."""
        try:
            await handle.channel.ping(timeout=timeout)
        except (TimeoutError, InternalError, OSError):
            await self.destroy(handle)
            return False
        return True

    # --- processes and memory ---------------------------------------------------------

    def require_checkpoint(self, operation: str = "checkpoint") -> None:
        """Refuse a checkpoint or restore early: the capability, and the tool it needs."""
        self.require(Capability.CHECKPOINT, operation)

    async def checkpoint(
        self, handle: SandboxHandle, dest: Path, *, leave_running: bool, while_stopped: WhileStopped = None
    ) -> CheckpointRecord:
        """Write the sandbox's processes and memory under `dest` (created here). They stay
        stopped while `while_stopped` runs (the edge copies the files then, so files and
        memory match), then run on (`leave_running`) or are killed."""
        self.require(Capability.CHECKPOINT)
        raise NotImplementedError

    async def restore(self, handle: SandboxHandle, src: Path, *, group_name: str) -> list[int]:
        """Start the processes of checkpoint `src` in the sandbox, whose files must be the
        checkpointed ones; the pids of the restored roots inside."""
        self.require(Capability.CHECKPOINT, "restore")
        raise NotImplementedError

    def load_checkpoint(self, src: Path) -> CheckpointRecord:
        """The record `checkpoint` wrote under `src`."""
        self.require(Capability.CHECKPOINT, "restore")
        raise NotImplementedError

    @abstractmethod
    async def kill_user_processes(self, handle: SandboxHandle) -> None:
        """Kill every process of the sandbox but its init (before a restore into it, and
        before and after a verifier runs)."""

    @contextlib.asynccontextmanager
    async def writes_held(self, handle: SandboxHandle) -> AsyncIterator[None]:
        """The sandbox's writable layer at one consistent point while the body reads it
        through the sandbox (a microVM's disk: flushed, its writers held); by default nothing
        is held (the host reads a container's files at its own pace)."""
        yield

    async def archive_writable(self, handle: SandboxHandle, out: int, limit: int) -> None:
        """Write the sandbox's writable layer as an OCI layer tar to `out` (at most `limit`
        bytes), at one consistent point: a snapshot where `host_files` is false (the host
        unpacks it as it unpacks any untrusted tarball)."""
        self.require(Capability.SNAPSHOT, "snapshot")
        raise NotImplementedError

    async def archive_tree(self, handle: SandboxHandle, path: str, out: int, limit: int) -> None:
        """Write the tree at `path` as the sandbox's processes see it (a directory's contents,
        or one file or link) as a tar to `out`, at most `limit` bytes, by the backend's own
        archiver, no program of the image: a trusted exec's copy of a task directory, and
        protect(), where `host_files` is false. FileNotFoundError where no link-free path
        leads to it."""
        self.require(Capability.TRUSTED_EXEC, "trusted exec")
        raise NotImplementedError

    async def copy_writable_disk(
        self, handle: SandboxHandle, dests: Sequence[Path], check: Callable[[int], None]
    ) -> None:
        """Copy the sandbox's writable disk to each of `dests`, at one consistent point (a
        fork, where `host_files` is false: the writable layer is a disk, and each child starts
        from a copy of it as its own). `check` is given the bytes the disk takes at that
        point, before anything is copied (it raises to refuse the copy)."""
        self.require(Capability.FORK, "fork")
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - a hook: most backends hold nothing of their own
        """Let go of what the backend holds for the edge process (its sandboxes are stopped
        or detached by then)."""

    # --- what is left on the host ------------------------------------------------------

    @abstractmethod
    def leftover_ids(self) -> set[str]:
        """Ids of the sandboxes this backend has state of on the host (live or not)."""

    @abstractmethod
    async def remove_orphan(self, sandbox_id: str) -> None:
        """Kill and remove whatever is left of a sandbox no record claims."""

    def stray_mounts(self, known: set[str]) -> list[str]:
        """Mounts of sandboxes that are not in `known`, for the reconciler to remove."""
        return []


def log_tail(path: Path, limit: int) -> str:
    """The last `limit` bytes of a log, stripped, for an error message: only the tail is read
    (a guest's console can grow to whatever its VM's memory allows)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - limit))
            return f.read(limit).decode(errors="replace").strip()
    except OSError:
        return ""
