"""The edge: the per-node agent. It admits, creates, runs, reaps and re-adopts sandboxes.

Call order: ``await Edge.start()`` (reconcile, re-adopt, start the reaper), then
any operation, then ``await Edge.close()``. The edge is the source of truth for
its sandboxes; its durable record is :class:`EdgeStore`.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import tarfile
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dsec import errors
from dsec.backends.container import (
    Container,
    ContainerBackend,
    ContainerPlan,
    fs_type,
    mounts_under,
    reap_strays,
    run_process_quick,
    spawn_quick,
    unmount_all,
    wait_quick,
)
from dsec.config import EdgeSettings
from dsec.edge import checkpoint as ckpt
from dsec.edge import trusted
from dsec.edge.files import MAX_ARCHIVE_ENTRIES, SandboxFiles, off_loop
from dsec.edge.fncall import FnCallPool, WorkerHost
from dsec.edge.pools import WarmPools
from dsec.edge.process import RawResult, run_process
from dsec.edge.sessions import Runner, Session, open_session, prepare_tools
from dsec.edge.snapshots import (
    check_fork_room,
    copy_tree,
    copy_tree_under,
    disk_usage,
    scrub,
    start_copy,
    strip_setid,
)
from dsec.edge.store import EdgeStore, Record
from dsec.isolation import linux
from dsec.isolation.cgroups import PID_RESERVE, CgroupHost
from dsec.isolation.denials import DeniedSyscalls, audit_session
from dsec.isolation.idranges import IdRanges
from dsec.isolation.netpolicy import NetHost
from dsec.isolation.spec import DEFAULT_PATH, ID_RANGE, Limits
from dsec.layers import LayerStore, import_dir_layer
from dsec.layers.store import Image
from dsec.models import (
    POOL_PROJECT,
    Checkpoint,
    CheckpointTree,
    EdgeStatus,
    ExecRequest,
    ExecResult,
    FileEdit,
    FileStat,
    FileWrite,
    FnCallRequest,
    FnCallResult,
    ForkLayer,
    JupyterRequest,
    JupyterResult,
    NetworkPolicy,
    PoolInfo,
    PoolSpec,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SessionCreate,
    SessionInfo,
    SessionResult,
    SessionRun,
    SnapshotInfo,
    Step,
)
from dsec.native import ensure_copy, ensure_shim, ensure_trusted
from dsec.privatefs import seal_data_dir
from dsec.trajlog import StepTag, TrajectoryLog, action_hash

log = logging.getLogger("dsec.edge")
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
# A fork stacks its parent's fork layers instead of copying them; beyond this depth the
# chain is flattened into one layer (overlayfs mount options are limited to a page).
MAX_FORK_CHAIN = 16


def _chain(extra_lower: str | None) -> list[str]:
    """A record's fork layers, top first (stored colon-separated; our paths have no colons)."""
    return extra_lower.split(":") if extra_lower else []


@dataclass
class Sandbox:
    """A live sandbox as the edge holds it in memory."""

    record: Record
    container: Container
    root_fd: int
    files: SandboxFiles
    uid: int
    gid: int
    home: str
    sessions: dict[str, Session] = field(default_factory=dict)
    counter: itertools.count[int] = field(default_factory=itertools.count)
    stopping: bool = False
    stats: Counter[str] = field(default_factory=Counter)  # timeouts, output_truncated, disk_full
    seen_events: dict[str, int] = field(default_factory=dict)  # kernel counters at the last look
    audit_session: int | None = None  # kernel audit session of all its processes
    disk_was_full: bool = False
    busy: int = 0  # operations in flight (execs, session runs, file ops): the idle reaper skips it

    @property
    def id(self) -> str:
        return self.record.id

    def info(self, edge: str) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            state=self.record.state,
            spec=self.record.spec,
            edge=edge,
            created_at=self.record.created_at,
            last_active=self.record.last_active,
            reason=self.record.reason,
            timings_ms=self.container.timings_ms,
        )


class Edge:
    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.layers = LayerStore(settings.layer_root, settings.uid_offset)
        self.cgroups = CgroupHost.detect()
        self.store: EdgeStore | None = None
        self.backend: ContainerBackend | None = None
        self.sandboxes: dict[str, Sandbox] = {}
        self._creating: dict[str, SandboxSpec] = {}
        self._toolkit: list[str] = []
        self._trusted_tool: Path | None = None  # dsec-trusted, built on the first trusted exec
        self._vault_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._tasks: list[asyncio.Task[None]] = []
        # Stops started from exit callbacks; held so they are not garbage-collected mid-run.
        self._dirty_active: dict[str, float] = {}
        self.pools = WarmPools(self._create_for_pool, self.stop)
        self.fncall = FnCallPool(
            WorkerHost(
                create=self.create,
                stop=lambda sid: self.stop(sid, wait=False),
                container=lambda sid: self.sandboxes[sid].container,
                cgroups=self.cgroups,
                check_image=lambda image: self.layers.get_image(image),
            ),
            workers_per_image=settings.fncall_workers,
        )
        # Exec cgroups outlive an edge process when background jobs stay in them:
        # names carry this process's epoch so a restarted edge never collides.
        self._epoch = secrets.token_hex(3)
        self._lock_fd = -1
        self._lock_path: Path | None = None
        self._terminating: dict[str, asyncio.Task[None]] = {}
        # Sandboxes that died on their own (init killed, e.g. out of memory): their callers get
        # sandbox_failed with the reason instead of not_found (the most recent 10,000).
        self._failed: dict[str, Record] = {}
        self.trajlog = TrajectoryLog(settings.data_dir / f"trajlog-{settings.name}.db")
        self._inflight: dict[tuple[str, str, int], asyncio.Future[None]] = {}  # (project, trajectory, step)
        # Network policies: nothing is made on the host before the first one.
        self.net = NetHost(settings.name, platform=settings.platform_addresses)
        self.denials = DeniedSyscalls(self._on_denied_syscall)

    # --- lifecycle of the edge itself ------------------------------------------

    def _lock_name(self) -> None:
        """One edge per name per host: the reconciler treats `<name>-*` cgroups as its own.

        The lock file goes when its edge closes (removed while still locked), so a host that
        ran many short-lived edges (tests) keeps no file per name. A starter that opened the
        file just before its holder removed it finds its lock on an unlinked file: it retries."""
        lock_dir = Path("/run/dsec-edges")
        lock_dir.mkdir(parents=True, exist_ok=True)
        path = lock_dir / f"{self.name}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise errors.Conflict(
                    f"another edge named {self.name!r} runs on this host; give each edge its own --name"
                ) from None
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        self._lock_fd = fd
        self._lock_path = path

    async def start(self) -> None:
        s = self.settings
        self._lock_name()
        linux.become_subreaper()
        if s.cgroup_favordynmods and not self.cgroups.favor_dynamic_changes():
            log.info("cgroup2 favordynmods unavailable: the first exec after an idle moment may take ~10 ms")
        seal_data_dir(s.data_dir)  # 0700, its files 0600 (an older install is fixed here)
        shim = ensure_shim(s.data_dir / "bin")
        self._copy_tool = ensure_copy(s.data_dir / "bin")
        self._ensure_run_tmpfs()
        self._toolkit = [self._shim_layer(shim)]
        self.backend = ContainerBackend(
            run_dir=s.edge_run_dir,
            shim=shim,
            runtime=s.runtime,
            uid_offset=s.uid_offset,
            id_ranges=IdRanges(s.id_registry, s.uid_offset + ID_RANGE),
            cgroups=self.cgroups,
            tools_dir=prepare_tools(s.edge_run_dir / "tools"),
        )
        self.store = EdgeStore(s.db_path)
        await self.trajlog.start()
        await self.net.remove_leftovers()  # a crashed edge's gateway; policies are re-applied below
        if not self.denials.start():
            log.info("the kernel log is not readable: denied system calls are not counted")
        await self._readopt()
        await self.reconcile()
        self._tasks.append(asyncio.create_task(self._reaper(), name="dsec-reaper"))
        self._tasks.append(asyncio.create_task(self._reconciler(), name="dsec-reconciler"))
        self.pools.start()
        if s.fncall_image and self.layers.has_image(s.fncall_image):
            self.fncall.start(s.fncall_image)

    async def close(self, *, stop_sandboxes: bool = True) -> None:
        await self.fncall.close()
        pooled = await self.pools.close()
        await asyncio.gather(*(self.stop(sid) for sid in pooled), return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if stop_sandboxes:
            await asyncio.gather(*(self.stop(sid) for sid in list(self.sandboxes)), return_exceptions=True)
        else:
            for sb in self.sandboxes.values():
                self._detach(sb)
            self.sandboxes.clear()
        await asyncio.gather(*list(self._terminating.values()), return_exceptions=True)
        await self.net.close(keep=not stop_sandboxes)
        self.denials.close()
        if self.store is not None:
            self.store.touch_many(self._dirty_active)
            self.store.close()
            self.store = None
            await self.trajlog.close()
        self.cgroups.remove_parent_if_empty()
        self._unmount_forks_if_unused()
        self._unmount_run_tmpfs_if_unused()
        if self._lock_fd >= 0:
            assert self._lock_path is not None
            self._lock_path.unlink(missing_ok=True)  # still ours: we hold the lock
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _ensure_run_tmpfs(self) -> None:
        """Keep the edge's run dir (bundles, runtime state, fork layers) on a tmpfs. Where /run
        is a directory of the root file system (no systemd), a mkdir there costs ~0.2 ms on ext4
        against ~4 us on tmpfs, and crun writes several state files per start. The mount stays
        while sandboxes live (a restarted edge finds it) and goes with the last one."""
        d = self.settings.edge_run_dir
        d.mkdir(parents=True, exist_ok=True)
        if fs_type(d) != "tmpfs":
            linux.mount(
                f"dsec-run-{self.name}", str(d), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=0711"
            )

    def _unmount_run_tmpfs_if_unused(self) -> None:
        d = self.settings.edge_run_dir
        if self.sandboxes or not os.path.ismount(d):
            return
        if (self.backend is not None and self.backend.sandbox_dirs()) or mounts_under(d):
            return  # kept sandboxes (close(stop_sandboxes=False)) still live in it
        with open("/proc/self/mounts") as f:
            ours = any(ln.split()[:2] == [f"dsec-run-{self.name}", str(d)] for ln in f)
        if ours:
            unmount_all(d)

    def _shim_layer(self, shim_path: os.PathLike[str]) -> str:
        """The toolkit layer every sandbox gets on top: /.dsec/shim."""
        version = os.path.basename(shim_path).removeprefix("dsec-shim-")
        ref = f"dsec-shim@{version}"
        if not self.layers.has_layer(ref):
            with tempfile.TemporaryDirectory(prefix="dsec-shim-") as tmp:
                os.mkdir(os.path.join(tmp, ".dsec"), 0o755)
                shutil.copy2(shim_path, os.path.join(tmp, ".dsec", "shim"))
                import_dir_layer(self.layers, "dsec-shim", version, Path(tmp))
        return ref

    # --- create -------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{self.name}-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))

    def _admit(self, spec: SandboxSpec) -> None:
        live = [sb.record.spec for sb in self.sandboxes.values()] + list(self._creating.values())
        live += [SandboxSpec(cpu=0.01, memory_mb=16)] * len(self._terminating)  # counted until torn down
        if len(live) >= self.settings.max_sandboxes:
            raise errors.CapacityExhausted(
                f"edge {self.name} is full ({len(live)} sandboxes); try another edge"
            )
        cpu = sum(s.cpu for s in live) + spec.cpu
        mem = sum(s.memory_mb for s in live) + spec.memory_mb
        if cpu > self.settings.capacity_cpu or mem > self.settings.capacity_memory_mb:
            raise errors.CapacityExhausted(
                f"edge {self.name} has no room for cpu={spec.cpu} memory_mb={spec.memory_mb}; "
                "try another edge"
            )

    def _image(self, name: str) -> Image:
        return self.layers.get_image(name)

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None) -> SandboxInfo:
        if spec.network is not None:  # a rule to the platform's addresses: 400 before any work
            await self.net.check(spec.network)
        info = await self._create_plain(spec, sandbox_id)
        if spec.protected_paths:
            try:
                await self.protect(info.id, spec.protected_paths)
            except BaseException:
                await self.stop(info.id)
                raise
        return info

    async def _create_plain(self, spec: SandboxSpec, sandbox_id: str | None) -> SandboxInfo:
        t0 = time.perf_counter()
        image = self._image(spec.image)
        owner = image.source.get("project")  # snapshots belong to a project
        if owner is not None and owner != spec.project and not spec.project.startswith("_"):
            raise errors.ImageNotFound(f"there is no snapshot {spec.image!r} in project {spec.project!r}")
        if sandbox_id is None and spec.project != POOL_PROJECT and spec.network is None:
            pooled = self._claim_pooled(spec, t0)
            if pooled is not None:
                return pooled
        return await self._create(spec, sandbox_id, t0, image=image)

    async def _create_for_pool(self, spec: SandboxSpec) -> str:
        info = await self._create(spec, None, time.perf_counter())
        # Prime it: the first process in a fresh overlay pays for cold lookups of the
        # shell and its libraries (~1.5 ms); pay it now, not in the claimant's first exec.
        await self._run(self.sandboxes[info.id], ExecRequest(cmd="true", cwd="/", timeout=10))
        return info.id

    def _claim_pooled(self, spec: SandboxSpec, t0: float) -> SandboxInfo | None:
        assert self.store is not None
        while (sid := self.pools.take(spec)) is not None:
            sb = self.sandboxes.get(sid)
            if sb is None or sb.stopping or not sb.container.alive():
                continue
            now = time.time()
            sb.record.spec = spec
            sb.record.created_at = sb.record.last_active = now
            self.store.put(sb.record)
            sb.container.timings_ms = {"pool": (time.perf_counter() - t0) * 1000}
            sb.container.timings_ms["total"] = sb.container.timings_ms["pool"]
            return sb.info(self.name)
        return None

    async def _create(
        self,
        spec: SandboxSpec,
        sandbox_id: str | None,
        t0: float,
        *,
        extra_lower: str | None = None,
        layers_ready: asyncio.Future[None] | None = None,
        image: Image | None = None,
    ) -> SandboxInfo:
        """Start a sandbox. `extra_lower`: a fork's layer chain (colon-separated, top first),
        stacked under the toolkit. `layers_ready`: awaited after the runtime started and before
        anything reads the sandbox's files (a fork's layer may still be filling; see fork())."""
        assert self.backend is not None and self.store is not None
        image = image or self._image(spec.image)  # read once per create (a JSON file)
        self._admit(spec)
        sid = sandbox_id or self._new_id()
        self._creating[sid] = spec
        try:
            # The toolkit (the shim) stays on top: nothing a sandbox wrote can replace it.
            lowers = [self.layers.layer_path(r) for r in self._toolkit]
            lowers += [Path(p) for p in _chain(extra_lower)]
            lowers += self.layers.lowerdirs(image)
            env = {"PATH": DEFAULT_PATH, "HOSTNAME": sid, **spec.env}
            limits = Limits(spec.cpu, spec.memory_mb, spec.pids + PID_RESERVE)
            plan = ContainerPlan(sid, lowers, limits, spec.disk_mb, env, spec.disk_inodes)
            # The sandbox's first trajectory reservation (an fsync) overlaps the runtime start
            # instead of delaying its first operation (~1 ms off the first exec).
            prepared = asyncio.ensure_future(self.trajlog.prepare(sid))
            try:
                container = await self.backend.create(plan)
            finally:
                try:
                    await prepared
                except errors.DsecError as e:  # the first record() retries and reports it
                    log.warning("trajectory log: could not prepare %s: %s", sid, e)
            if layers_ready is not None:
                try:
                    await asyncio.shield(layers_ready)
                except BaseException:
                    await self.backend.destroy(container)
                    raise
            t_setup = time.perf_counter()
            ts = time.time()
            record = Record(
                sid,
                spec,
                SandboxState.RUNNING,
                container.pid,
                container.start_time,
                ts,
                ts,
                extra_lower=extra_lower,
            )
            try:
                self.cgroups.setup_user_group(sid, spec.pids)
                sb = self._open_sandbox(record, container)
                sb.files._mkdirs(spec.workdir)
                if spec.network is not None:
                    await self._apply_network(sb, spec.network)
                self.store.put(record)
            except BaseException:
                await self.backend.destroy(container)
                raise
        finally:
            self._creating.pop(sid, None)
        self.sandboxes[sid] = sb
        container.timings_ms["setup"] = (time.perf_counter() - t_setup) * 1000
        container.timings_ms["total"] = (time.perf_counter() - t0) * 1000
        self._watch_exit(sb)
        return sb.info(self.name)

    def _track_denials(self, sb: Sandbox) -> None:
        ses = audit_session(sb.container.pid)
        if ses is not None:
            self.denials.sessions[ses] = sb.id
            sb.audit_session = ses

    def _open_sandbox(self, record: Record, container: Container) -> Sandbox:
        root_fd = os.open(container.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            base = container.id_base  # the sandbox's own host id range
            files = SandboxFiles(
                root_fd,
                base,
                base,
                base,
                container.channel,  # charged writes: copied by a child of the sandbox's init
            )
            uid, gid, home = self._resolve_user(files, record.spec.user)
            files.uid, files.gid = uid + base, gid + base
        except BaseException:
            os.close(root_fd)
            raise
        sb = Sandbox(record, container, root_fd, files, uid, gid, home)
        self._track_denials(sb)
        return sb

    @staticmethod
    def _resolve_user(files: SandboxFiles, user: str) -> tuple[int, int, str]:
        """`root`, a name from the image's /etc/passwd, `uid` or `uid:gid`."""
        if user == "root":
            return 0, 0, "/root"
        name, _, group = user.partition(":")
        if name.isdigit() and (not group or group.isdigit()):
            uid = int(name)
            gid = int(group) if group else uid
            if not (0 <= uid < 65536 and 0 <= gid < 65536):
                raise errors.InvalidRequest(f"user {user!r}: ids must be below 65536")
            return uid, gid, "/"
        with contextlib.suppress(errors.DsecError):
            for line in files.read("/etc/passwd", 1 << 20).decode(errors="replace").splitlines():
                f = line.split(":")
                if len(f) >= 6 and f[0] == name:
                    return int(f[2]), int(f[3]), f[5] or "/"
        raise errors.InvalidRequest(f"user {user!r} does not exist in the image; use root, a uid, or uid:gid")

    def _watch_exit(self, sb: Sandbox) -> None:
        def on_exit(_: asyncio.Future[None]) -> None:
            if not sb.stopping and sb.id in self.sandboxes:
                events = self.cgroups.events(sb.id)
                reason = f"the sandbox failed: {sb.container.exit_reason()}"
                if events["oom_kills"]:
                    limit = sb.record.spec.memory_mb
                    reason += f" after {events['oom_kills']} out-of-memory kill(s) (memory_mb={limit})"
                log.warning("sandbox %s: %s", sb.id, reason)
                sb.record.state = SandboxState.FAILED
                sb.record.reason = reason
                self._failed[sb.id] = sb.record
                while len(self._failed) > 10_000:
                    self._failed.pop(next(iter(self._failed)))
                self._begin_stop(sb.id)

        sb.container.exited.add_done_callback(on_exit)

    # --- lookup --------------------------------------------------------------------

    def check_access(self, sandbox_id: str, projects: set[str] | None) -> None:
        """Hide sandboxes outside `projects` (None: every project) as if they did not exist."""
        sb = self.sandboxes.get(sandbox_id)
        rec = sb.record if sb is not None else self._failed.get(sandbox_id)
        if projects is not None and (rec is None or rec.spec.project not in projects):
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} does not exist or is not in your projects")

    def _lookup(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None and sandbox_id in self._failed:
            raise errors.SandboxFailed(
                f"sandbox {sandbox_id}: {self._failed[sandbox_id].reason}; this is an environment "
                "failure, not the task's: create a new sandbox",
                reason=self._failed[sandbox_id].reason,
            )
        if sb is None or sb.stopping or sb.record.spec.project.startswith("_"):
            raise errors.SandboxNotFound(
                f"sandbox {sandbox_id} does not exist on edge {self.name} (stopped or never created)"
            )
        return sb

    def _get(self, sandbox_id: str) -> Sandbox:
        """A sandbox for an operation: a paused one is resumed first, transparently."""
        sb = self._lookup(sandbox_id)
        if sb.record.state is SandboxState.PAUSED:
            self._resume(sb)
        now = time.time()
        sb.record.last_active = now
        self._dirty_active[sandbox_id] = now
        return sb

    def get(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox with its misbehaviour telemetry (a failed one: its state and reason)."""
        failed = self._failed.get(sandbox_id)
        if failed is not None and sandbox_id not in self.sandboxes:
            return SandboxInfo(
                id=failed.id,
                state=SandboxState.FAILED,
                spec=failed.spec,
                edge=self.name,
                created_at=failed.created_at,
                last_active=failed.last_active,
                reason=failed.reason,
            )
        sb = self._lookup(sandbox_id)
        info = sb.info(self.name)
        info.telemetry = self.telemetry(sb)
        return info

    async def sandbox_status(self, sandbox_id: str) -> SandboxInfo:
        """get() plus what takes a kernel round trip: refused connections of its network policy."""
        info = self.get(sandbox_id)
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.record.spec.network is not None:
            with contextlib.suppress(Exception):
                info.telemetry["denied_connections"] = (await self.net.counters(sb.id))["denied_packets"]
        return info

    def telemetry(self, sb: Sandbox) -> dict[str, int]:
        out = Counter(self.cgroups.events(sb.id))
        out.update(sb.stats)  # refused forks of finished calls, timeouts, truncations, full disks
        used, inodes, _ = sb.container.disk_usage()
        return {
            **{
                k: 0
                for k in (
                    "oom_kills",
                    "pids_limit_hits",
                    "timeouts",
                    "output_truncated",
                    "disk_full",
                    "denied_syscalls",
                )
            },
            **out,
            "disk_used_bytes": used,
            "disk_used_inodes": inodes,
        }

    async def _denied_connections(self, sb: Sandbox) -> int:
        """Packets the network policy refused since the last look (read after failed calls:
        a refused connection usually makes one fail)."""
        try:
            total = (await self.net.counters(sb.id))["denied_packets"]
        except Exception:
            return 0
        new = total - sb.seen_events.get("denied_connections", 0)
        sb.seen_events["denied_connections"] = total
        if new > 0:
            sb.stats["denied_connections"] += new
        return max(new, 0)

    def _on_denied_syscall(self, sandbox_id: str, syscall: int, comm: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None:
            sb.stats["denied_syscalls"] += 1

    def _misbehaviour(self, sb: Sandbox, res: RawResult, denied_before: int = 0) -> dict[str, int]:
        """Limit hits during one call, for its result and the trajectory. The kernel counters
        are read only when the call did not succeed (a clean exit leaves them alone, save a
        background process's misfortune, which the next failed call or GET reports)."""
        if res.timed_out:
            sb.stats["timeouts"] += 1
        if res.truncated:
            sb.stats["output_truncated"] += 1
        self.denials.drain()  # the kernel logged this call's denials already: count them now
        denied = sb.stats["denied_syscalls"] - denied_before
        if res.exit_code == 0 and not res.timed_out:
            if sb.disk_was_full:  # freed since? then the next fill counts again
                sb.disk_was_full = sb.container.disk_usage()[2]
            return {"denied_syscalls": denied} if denied else {}
        now = self.cgroups.events(sb.id)
        out = {k: v - sb.seen_events.get(k, 0) for k, v in now.items() if v > sb.seen_events.get(k, 0)}
        sb.seen_events.update(now)
        if denied:
            out["denied_syscalls"] = denied
        if res.pids_limit_hits:
            sb.stats["pids_limit_hits"] += res.pids_limit_hits
            out["pids_limit_hits"] = out.get("pids_limit_hits", 0) + res.pids_limit_hits
        _, _, full = sb.container.disk_usage()
        if full and not sb.disk_was_full:
            sb.stats["disk_full"] += 1
            out["disk_full"] = 1
        sb.disk_was_full = full
        return out

    # --- pause / resume --------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox and give back the memory the kernel can take."""
        sb = self._lookup(sandbox_id)
        if sb.record.state is not SandboxState.PAUSED:
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(None, self.cgroups.freeze, sb.id)
            sb.record.state = SandboxState.PAUSED
            if self.store is not None:
                self.store.put(sb.record)
            await asyncio.get_running_loop().run_in_executor(None, self.cgroups.reclaim, sb.id)
            sb.container.timings_ms["pause"] = (time.perf_counter() - t0) * 1000
        return sb.info(self.name)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self._lookup(sandbox_id)
        self._resume(sb)
        return sb.info(self.name)

    def _resume(self, sb: Sandbox) -> None:
        if sb.record.state is not SandboxState.PAUSED:
            return
        t0 = time.perf_counter()
        self.cgroups.thaw(sb.id)
        sb.record.state = SandboxState.RUNNING
        sb.record.last_active = time.time()
        if self.store is not None:
            self.store.put(sb.record)
        sb.container.timings_ms["resume"] = (time.perf_counter() - t0) * 1000

    # --- network policy ----------------------------------------------------------------

    async def _apply_network(self, sb: Sandbox, policy: NetworkPolicy, *, check: bool = True) -> None:
        timings = await self.net.apply(sb.id, sb.container.pid, policy, check=check)
        sb.files.write("/etc/resolv.conf", self.net.resolv_conf().encode())
        sb.container.timings_ms.update({f"network_{k}": v for k, v in timings.items()})

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy | None) -> dict[str, Any]:
        """Replace a running sandbox's egress allowlist atomically (None: detach it, back to
        loopback only). New connections follow it; established ones continue."""
        sb = self._get(sandbox_id)
        try:
            if policy is None:
                await self.net.remove(sb.id)
            else:
                await self._apply_network(sb, policy)
        except (OSError, RuntimeError) as e:
            raise errors.InternalError(f"network policy of {sb.id}: {e}") from e
        sb.record.spec = sb.record.spec.model_copy(update={"network": policy})
        if self.store is not None:
            self.store.put(sb.record)
        return await self.network(sandbox_id)

    async def network(self, sandbox_id: str) -> dict[str, Any]:
        """The sandbox's policy and its counters (denied packets, DNS answers)."""
        sb = self._lookup(sandbox_id)
        policy = sb.record.spec.network
        return {
            "policy": policy.model_dump(mode="json") if policy is not None else None,
            "counters": await self.net.counters(sb.id),
        }

    async def pause_project(self, project: str) -> builtins.list[str]:
        """Pause every sandbox of a project (a preempted job), concurrently."""
        ids = [
            sid for sid, sb in self.sandboxes.items() if sb.record.spec.project == project and not sb.stopping
        ]
        await asyncio.gather(*(self.pause(sid) for sid in ids))
        return ids

    def list(self, labels: dict[str, str] | None = None, project: str | None = None) -> list[SandboxInfo]:
        out = []
        for sb in self.sandboxes.values():
            spec = sb.record.spec
            if spec.project.startswith("_") or sb.stopping:  # pool and fncall workers are internal
                continue
            if project is not None and spec.project != project:
                continue
            if labels and any(spec.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(sb.info(self.name))
        return out

    # --- stop ----------------------------------------------------------------------

    async def stop(self, sandbox_id: str, *, wait: bool = True) -> None:
        """Stop a sandbox. It is gone for every caller at once; with `wait=False` the
        host resources are torn down in the background (close() waits for them)."""
        if sandbox_id not in self.sandboxes and self._failed.pop(sandbox_id, None) is not None:
            task = self._terminating.get(sandbox_id)  # it stopped itself: forget the failure
        else:
            task = self._begin_stop(sandbox_id)
        if wait and task is not None:
            await asyncio.shield(task)

    def _begin_stop(self, sandbox_id: str) -> asyncio.Task[None] | None:
        """Forget the sandbox now and start its teardown; the teardown task, if any."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            if sandbox_id in self._terminating:
                return self._terminating[sandbox_id]
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} does not exist on edge {self.name}")
        if sb.stopping:
            return self._terminating.get(sandbox_id)
        sb.stopping = True
        self.pools.forget(sandbox_id)
        self.sandboxes.pop(sandbox_id, None)
        self._dirty_active.pop(sandbox_id, None)
        if self.store is not None:
            self.store.delete(sandbox_id)
        task = asyncio.create_task(self._teardown(sb), name=f"dsec-stop-{sandbox_id}")
        self._terminating[sandbox_id] = task
        task.add_done_callback(lambda _: self._terminating.pop(sandbox_id, None))
        return task

    async def _teardown(self, sb: Sandbox) -> None:
        assert self.backend is not None
        if sb.record.state is SandboxState.PAUSED:
            with contextlib.suppress(OSError):
                self.cgroups.thaw(sb.id)  # a frozen init would take SIGKILL only after a thaw
        for s in sb.sessions.values():
            with contextlib.suppress(Exception):
                s.close(kill=False)  # the whole pid namespace dies with the shim
        sb.sessions.clear()
        os.close(sb.root_fd)
        shutil.rmtree(self._vault(sb.id), ignore_errors=True)
        if sb.audit_session is not None:
            self.denials.drain()  # its last records first
            self.denials.sessions.pop(sb.audit_session, None)
        try:
            await self.backend.destroy(sb.container)
        except Exception:
            log.exception("tearing down %s failed; the reconciler will retry", sb.id)
        try:
            await self.net.remove(sb.id)
        except Exception:
            log.exception("removing the network policy of %s failed", sb.id)
        self._release_fork_layers(sb.record.extra_lower)
        with contextlib.suppress(errors.DsecError):
            await self.trajlog.retire(sb.id)

    def _detach(self, sb: Sandbox) -> None:
        """Forget a sandbox in this process but leave it running (for a later adopt)."""
        for s in sb.sessions.values():
            with contextlib.suppress(Exception):
                s.close()
        sb.container.channel.close()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(sb.container.pidfd)
        os.close(sb.container.pidfd)
        if sb.container.upper_fd >= 0:
            os.close(sb.container.upper_fd)
        os.close(sb.root_fd)

    # --- exec ----------------------------------------------------------------------

    def _group_name(self, sb: Sandbox) -> str:
        return f"dsec-x{self._epoch}-{next(sb.counter)}"

    def _env(self, sb: Sandbox, extra: dict[str, str]) -> dict[str, str]:
        return {
            "PATH": DEFAULT_PATH,
            "HOME": sb.home,
            "LANG": "C.UTF-8",
            "HOSTNAME": sb.id,
            **sb.record.spec.env,
            **extra,
        }

    def _user(self, sb: Sandbox, user: str | None) -> tuple[int, int]:
        if user is None:
            return sb.uid, sb.gid
        uid, gid, _ = self._resolve_user(sb.files, user)
        return uid, gid

    def _run(
        self,
        sb: Sandbox,
        req: ExecRequest,
        *,
        stdin: bytes | None = None,
        cap: int | None = None,
        sink: Callable[[str, bytes], None] | None = None,
    ) -> Coroutine[Any, Any, RawResult]:
        """The one path every process started on request takes (exec, streams, archives)."""
        if req.trusted or req.task_dirs is not None:
            return self._run_trusted(sb, req, stdin=stdin, cap=cap, sink=sink)
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        uid, gid = self._user(sb, req.user)
        if stdin is None and req.stdin is not None:
            stdin = req.stdin.encode()
        return run_process(
            sb.container,
            self.cgroups,
            self._group_name(sb),
            argv,
            self._env(sb, req.env),
            cwd=req.cwd or sb.record.spec.workdir,
            uid=uid,
            gid=gid,
            stdin=stdin,
            timeout=req.timeout,
            cap=min(req.max_output_bytes, sb.record.spec.max_output_bytes) if cap is None else cap,
            sink=sink,
        )

    async def _run_trusted(
        self,
        sb: Sandbox,
        req: ExecRequest,
        *,
        protected: builtins.list[trusted.Protected] | None = None,
        stdin: bytes | None = None,
        cap: int | None = None,
        sink: Callable[[str, bytes], None] | None = None,
    ) -> RawResult:
        """Run `req` with the image's own toolchain (see dsec.edge.trusted)."""
        dirs = self._trusted_checks(sb, req)
        if self._trusted_tool is None:
            tool = await asyncio.get_running_loop().run_in_executor(
                None, ensure_trusted, self.settings.data_dir / "bin"
            )
            self.settings.edge_run_dir.joinpath("trusted").mkdir(mode=0o700, exist_ok=True)
            self._trusted_tool = tool
        assert self.backend is not None
        bpf = self.backend.runtime_root / sb.id / "seccomp.bpf"
        if not bpf.exists():
            raise errors.InternalError(f"sandbox {sb.id} has no compiled seccomp program for a trusted exec")
        spec = trusted.TrustedSpec(
            tool=self._trusted_tool,
            lowers=trusted.trusted_lowers(self.layers, self._image(sb.record.spec.image)),
            task_dirs=dirs,
            protected=protected or [],
            scratch=self.settings.edge_run_dir / "trusted",
            seccomp=bpf,
            uid_offset=self.settings.uid_offset,
            id_base=sb.container.id_base,
            tmp_mb=sb.record.spec.disk_mb,
        )
        if stdin is None and req.stdin is not None:
            stdin = req.stdin.encode()
        return await trusted.run_trusted(
            spec,
            sb.container,
            self.cgroups,
            self._group_name(sb),
            sb.root_fd,
            ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd),
            trusted.clean_env(req.env),
            # Not the workdir: `python3 -m X`, pytest's rootdir/conftest discovery and the like
            # load modules from their cwd, which would be the agent's files. A caller who
            # names a cwd in a task dir takes that on knowingly.
            cwd=req.cwd or "/",
            stdin=stdin,
            timeout=req.timeout,
            cap=min(req.max_output_bytes, sb.record.spec.max_output_bytes) if cap is None else cap,
            sink=sink,
        )

    @staticmethod
    def _trusted_checks(sb: Sandbox, req: ExecRequest) -> builtins.list[str]:
        """400s for what a trusted exec cannot do; its task directories."""
        if not req.trusted:
            raise errors.InvalidRequest("task_dirs applies to trusted execs only: pass trusted=true")
        if req.user is not None:
            raise errors.InvalidRequest(
                f"a trusted exec runs as the platform's own uid {trusted.TRUSTED_UID}, never as a "
                "sandbox user: drop `user`"
            )
        return trusted.task_dirs(req.task_dirs, sb.record.spec.workdir)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        sb = self._get(sandbox_id)
        action = {"op": "exec", **req.model_dump(include={"cmd", "stdin", "env", "cwd", "user"})}
        if req.trusted:  # another action than the same command untrusted (a replay must not mix them)
            action.update(trusted=True, task_dirs=req.task_dirs)

        async def run() -> dict[str, Any]:
            denied_before = sb.stats["denied_syscalls"]
            raw = await self._run(sb, req)
            result = raw.to_exec_result()
            result.misbehaviour = self._misbehaviour(sb, raw, denied_before)
            if (raw.exit_code != 0 or raw.timed_out) and sb.record.spec.network is not None:
                refused = await self._denied_connections(sb)
                if refused:
                    result.misbehaviour["denied_connections"] = refused
            return result.model_dump()

        obs, seq, replayed = await self._logged(sb, "exec", action, req.step, run)
        return ExecResult.model_validate({**obs, "seq": seq, "replayed": replayed})

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[tuple[str, bytes | ExecResult]]:
        """Like exec, yielding ("stdout" | "stderr", chunk) as output arrives, then ("result", ExecResult)."""
        sb = self._get(sandbox_id)
        queue: asyncio.Queue[tuple[str, bytes | ExecResult]] = asyncio.Queue()
        task = asyncio.create_task(
            self._run(sb, req, sink=lambda kind, chunk: queue.put_nowait((kind, chunk)))
        )
        task.add_done_callback(
            lambda t: (
                queue.put_nowait(("result", t.result().to_exec_result()))
                if not t.cancelled() and t.exception() is None
                else queue.put_nowait(("error", b""))
            )
        )
        with self._active(sb):
            try:
                while True:
                    kind, item = await queue.get()
                    if kind == "error":
                        task.result()  # re-raise the failure
                    yield kind, item
                    if kind == "result":
                        return
            finally:
                if not task.done():
                    task.cancel()

    # --- sessions ------------------------------------------------------------------

    async def session_create(self, sandbox_id: str, req: SessionCreate) -> SessionInfo:
        sb = self._get(sandbox_id)
        if len(sb.sessions) >= 64:
            raise errors.QuotaExceeded("a sandbox holds at most 64 sessions; close one first")
        uid, gid = self._user(sb, req.user)
        sid = f"s{self._epoch}{next(sb.counter)}"
        session = await open_session(
            sid,
            req.kind,
            Runner(sb.container, self.cgroups, uid, gid),
            self._env(sb, req.env),
            req.cwd or sb.record.spec.workdir,
        )
        if len(sb.sessions) >= 64 or self.sandboxes.get(sb.id) is not sb:  # changed meanwhile
            session.close()
            self._get(sandbox_id)  # gone: not found
            raise errors.QuotaExceeded("a sandbox holds at most 64 sessions; close one first")
        sb.sessions[sid] = session
        return SessionInfo(id=sid, kind=req.kind, created_at=session.created_at)

    def _session(self, sb: Sandbox, session_id: str) -> Session:
        s = sb.sessions.get(session_id)
        if s is None:
            raise errors.SessionNotFound(
                f"session {session_id} does not exist in sandbox {sb.id}; create one first"
            )
        return s

    async def session_run(self, sandbox_id: str, session_id: str, req: SessionRun) -> SessionResult:
        sb = self._get(sandbox_id)
        s = self._session(sb, session_id)
        # The session id is left out of the action: after a client restart the same step
        # may come through a new session of the same kind.
        action = {"op": "session", "kind": s.kind.value, "code": req.code}

        async def run() -> dict[str, Any]:
            try:
                cap = min(req.max_output_bytes, sb.record.spec.max_output_bytes)
                return (await s.run(req.code, req.timeout, cap)).model_dump()
            except errors.SessionNotFound:
                sb.sessions.pop(session_id, None)
                s.close()
                raise

        obs, seq, replayed = await self._logged(sb, "session", action, req.step, run)
        return SessionResult.model_validate({**obs, "seq": seq, "replayed": replayed})

    # --- the trajectory log ------------------------------------------------------------

    async def _logged(
        self,
        sb: Sandbox,
        kind: str,
        action: dict[str, Any],
        step: Step | None,
        run: Callable[[], Awaitable[dict[str, Any]]],
    ) -> tuple[dict[str, Any], int | None, bool]:
        """Run an operation once and log it; a tagged step already logged is replayed.

        Returns (observation, seq, replayed). The same tag arriving twice at once runs once:
        the second caller waits for the first.

        Step tags are scoped to the sandbox's project: a tag is found, replayed and refused
        only among what that project logged (a replay in a new sandbox of the same project
        works; another tenant's identical tag is another step, and a divergence shows only
        the caller's own project's action).
        """
        tag = StepTag(step.trajectory, step.index, sb.record.spec.project) if step else None
        key = (tag.scope, tag.trajectory, tag.index) if tag else None
        if tag is not None and key is not None:
            pending = self._inflight.get(key)
            if pending is not None:
                await asyncio.shield(pending)
            entry = self.trajlog.find_step(tag.trajectory, tag.index, tag.scope, sb.id)
            if entry is not None:
                if entry.action_hash != action_hash(action):
                    raise errors.TrajectoryDivergence(
                        f"step {tag.index} of trajectory {tag.trajectory!r} was logged with a different "
                        f"{entry.kind} action; resume from the logged steps or start a new trajectory id",
                        trajectory=tag.trajectory,
                        index=tag.index,
                        logged=entry.action,
                    )
                return dict(entry.observation or {}), entry.seq, True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if key is not None:
            self._inflight[key] = done
        try:
            t0 = time.perf_counter()
            with self._active(sb):
                obs = await run()
            timings = {"duration_ms": (time.perf_counter() - t0) * 1000}
            seq = await self.trajlog.record(sb.id, kind, action, obs, timings, tag)
            return obs, seq, False
        finally:
            if key is not None:
                self._inflight.pop(key, None)
            done.set_result(None)

    @contextlib.contextmanager
    def _active(self, sb: Sandbox) -> Iterator[None]:
        """An operation in flight on `sb`: the idle reaper leaves it alone until it ends, and
        its end counts as activity (a long exec must not be reaped the moment it returns)."""
        sb.busy += 1
        try:
            yield
        finally:
            sb.busy -= 1
            now = time.time()
            sb.record.last_active = now
            self._dirty_active[sb.id] = now

    async def write_logged(self, sandbox_id: str, req: FileWrite, data: bytes) -> None:
        sb = self._get(sandbox_id)
        digest = hashlib.sha256(data).hexdigest()
        action = {"op": "write", "path": req.path, "sha256": digest, "size": len(data), "mode": req.mode}

        async def run() -> dict[str, Any]:
            await sb.files.write_charged(req.path, data, req.mode)
            return {}

        await self._logged(sb, "file", action, req.step, run)

    async def edit_logged(self, sandbox_id: str, req: FileEdit) -> int:
        sb = self._get(sandbox_id)
        action = {"op": "edit", "path": req.path, "old": req.old, "new": req.new}

        async def run() -> dict[str, Any]:
            return {"size": await sb.files.edit(req.path, req.old, req.new)}

        obs, _, _ = await self._logged(sb, "file", action, req.step, run)
        return int(obs["size"])

    async def log_event(
        self, sandbox_id: str, kind: str, action: dict[str, Any], obs: dict[str, Any]
    ) -> None:
        """Log an operation that is not a step (delete, upload, snapshot, fork, pause...)."""
        await self.trajlog.record(sandbox_id, kind, action, obs, {})

    async def trajectory(
        self, sandbox_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> dict[str, Any]:
        """The logged operations in seq order (flushed first), gaps included, and the counts."""
        self._lookup(sandbox_id)
        await self.trajlog.flush()
        entries = self.trajlog.read(sandbox_id, after_seq=after_seq, limit=limit)
        return {
            "entries": [e.model_dump(mode="json") for e in entries],
            "stats": self.trajlog.stats(sandbox_id),
        }

    async def trajectory_export(self, sandbox_id: str, fmt: str) -> bytes:
        self._lookup(sandbox_id)
        if fmt not in ("jsonl", "parquet"):
            raise errors.InvalidRequest(f"unknown export format {fmt!r}: use jsonl or parquet")
        await self.trajlog.flush()
        with tempfile.TemporaryDirectory(prefix="dsec-export-") as tmp:
            path = Path(tmp) / f"trajectory.{fmt}"
            if fmt == "jsonl":
                self.trajlog.export_jsonl(sandbox_id, path)
            else:
                self.trajlog.export_parquet(sandbox_id, path)
            return path.read_bytes()

    def session_list(self, sandbox_id: str) -> builtins.list[SessionInfo]:
        sb = self._get(sandbox_id)
        return [SessionInfo(id=s.id, kind=s.kind, created_at=s.created_at) for s in sb.sessions.values()]

    async def session_close(self, sandbox_id: str, session_id: str) -> None:
        sb = self._get(sandbox_id)
        s = self._session(sb, session_id)
        sb.sessions.pop(session_id, None)
        await asyncio.get_running_loop().run_in_executor(None, s.close)

    # --- files ---------------------------------------------------------------------

    # Every file operation counts as activity while it runs (see _active); those that may take
    # long (reads, listings, deletes, archives) run in the file pool, off the event loop.

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        sb = self._get(sandbox_id)
        with self._active(sb):
            return await sb.files.run(lambda f: f.read(path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        sb = self._get(sandbox_id)
        with self._active(sb):
            await sb.files.write_charged(path, data, mode)

    async def edit_file(self, sandbox_id: str, path: str, old: str, new: str) -> int:
        sb = self._get(sandbox_id)
        with self._active(sb):
            return await sb.files.edit(path, old, new)

    def stat_file(self, sandbox_id: str, path: str) -> FileStat:
        return self._get(sandbox_id).files.stat(path)

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileStat]:
        sb = self._get(sandbox_id)
        with self._active(sb):
            return await sb.files.run(lambda f: f.list(path))

    async def delete_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        sb = self._get(sandbox_id)
        with self._active(sb):
            await sb.files.run(lambda f: f.delete(path, recursive))

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        """Unpack a tar into `path` with the sandbox's own tar, under its own isolation (so
        charged to it); the archive is checked off the event loop first."""
        sb = self._get(sandbox_id)

        def check(f: SandboxFiles) -> None:
            try:
                with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                    for n, _ in enumerate(tf, 1):
                        if n > MAX_ARCHIVE_ENTRIES:
                            raise errors.PayloadTooLarge(
                                f"the archive holds more than {MAX_ARCHIVE_ENTRIES} entries; split the upload"
                            )
            except (tarfile.TarError, EOFError) as e:
                raise errors.InvalidRequest(f"upload is not a readable tar archive: {e}") from e
            f._mkdirs(path)

        with self._active(sb):
            await sb.files.run(check)
            tar = ExecRequest(
                cmd=["tar", "-x", "-C", path, "-f", "-"], cwd="/", timeout=600, max_output_bytes=65536
            )
            res = await self._run(sb, tar, stdin=data)
        if res.exit_code != 0:
            msg = res.stderr.decode(errors="replace").strip()[-500:]
            raise errors.InvalidRequest(f"unpacking the tar into {path} failed: {msg}")

    async def archive(self, sandbox_id: str, path: str) -> IO[bytes]:
        """A tar of `path` in an unlinked spool file (rewound; the caller closes it), built on
        the host from the sandbox's files without following links or leaving its root mount,
        capped at MAX_ARCHIVE bytes of file data (a sparse or huge file: a clear 413)."""
        sb = self._get(sandbox_id)
        with self._active(sb):
            return await sb.files.run(lambda f: f.archive(path))

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        spool = await self.archive(sandbox_id, path)
        with spool:
            return await off_loop(spool.read)

    # --- protected paths (graders, reference answers) -------------------------------

    def _vault(self, sandbox_id: str) -> Path:
        return self.settings.data_dir / "vault" / sandbox_id

    def _vault_lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._vault_locks.get(sandbox_id)
        if lock is None:
            lock = self._vault_locks[sandbox_id] = asyncio.Lock()
        return lock

    def _vault_index(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """The vault's entries ({path, kind d|f|l, tree, link}); an older edge's tar blobs
        become trees here, once."""
        vault = self._vault(sandbox_id)
        index_file = vault / "index.json"
        index: list[dict[str, Any]] = json.loads(index_file.read_text()) if index_file.exists() else []
        if any("kind" not in e for e in index):
            owner = trusted.trusted_host_id(self.settings.uid_offset)
            for n, e in enumerate(index):
                if "kind" not in e:
                    tree = f"t{n}"
                    shutil.rmtree(vault / tree, ignore_errors=True)
                    kind, link = trusted.convert_blob(vault / e["blob"], vault / tree, e["dir"], owner)
                    e.update(kind=kind, tree=tree, link=link)
            index_file.write_text(json.dumps(index))
        return index

    def _protected(
        self, sandbox_id: str, index: builtins.list[dict[str, Any]]
    ) -> builtins.list[trusted.Protected]:
        vault = self._vault(sandbox_id)
        out = []
        for e in index:
            src = None if e["kind"] == "l" else vault / e["tree"]
            out.append(trusted.Protected(e["path"], e["kind"], src, e["link"]))
        return out

    @staticmethod
    async def _delete_path(sb: Sandbox, path: str) -> None:
        await sb.files.run(lambda f: f.delete(path, recursive=True))

    async def protect(self, sandbox_id: str, paths: builtins.list[str]) -> builtins.list[str]:
        """Move `paths` out of the sandbox into a vault on the host (root only): the agent's
        processes cannot read what is not there. They are copied by this process, from
        descriptors that follow nothing below each path's parent; no program of the sandbox
        runs. verify() binds them read-only into its trusted root, never into the sandbox's."""
        sb = self._get(sandbox_id)
        owner = trusted.trusted_host_id(self.settings.uid_offset)
        for raw in paths:
            if not raw.startswith("/") or "\0" in raw or os.path.normpath(raw) == "/":
                raise errors.InvalidRequest(
                    f"protected path {raw!r} must be absolute and not /, e.g. /grader"
                )
        async with self._vault_lock(sandbox_id):
            vault = self._vault(sandbox_id)
            vault.mkdir(parents=True, exist_ok=True, mode=0o700)
            index_file = vault / "index.json"
            index = self._vault_index(sandbox_id)
            if len(index) + len(paths) > trusted.MAX_PROTECTED:
                raise errors.InvalidRequest(
                    f"a sandbox holds at most {trusted.MAX_PROTECTED} protected paths "
                    f"({len(index)} already); protect their common parent instead"
                )
            done = []
            for raw in paths:
                path = os.path.normpath(raw)
                tree = f"t{len(index)}"
                dest = vault / tree
                shutil.rmtree(dest, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    dest.unlink()
                try:

                    def copy(f: SandboxFiles, p: str = path, d: Path = dest) -> tuple[str, str]:
                        return trusted.copy_out(f.root_fd, p, d, owner)

                    kind, link = await sb.files.run(copy)
                    for e in index:  # a path protected before, inside this one: its mount point
                        if kind == "d" and trusted.under(e["path"], path):
                            rel = e["path"][len(path) :]
                            trusted.make_mount_point(dest, rel, e["kind"], e["link"], owner)
                except BaseException:
                    shutil.rmtree(dest, ignore_errors=True)
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        dest.unlink()
                    raise
                index.append({"path": path, "kind": kind, "tree": tree, "link": link})
                index_file.write_text(json.dumps(index))
                await self._delete_path(sb, path)
                done.append(path)
        await self.log_event(sandbox_id, "protect", {"op": "protect", "paths": done}, {})
        return done

    async def verify(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        """Run the platform's verification: every agent process is killed (and its sessions
        closed), then `req` runs as a trusted exec (the image's own toolchain, the task
        directories as the agent left them, the protected paths bound read-only from the
        vault; see dsec.edge.trusted); whatever it started is killed after it."""
        sb = self._get(sandbox_id)
        req = req.model_copy(update={"trusted": True})
        dirs = self._trusted_checks(sb, req)  # a 400 before anything is killed
        for s in list(sb.sessions.values()):
            with contextlib.suppress(Exception):
                s.close(kill=False)
        sb.sessions.clear()
        await ckpt.kill_user_processes(self.cgroups, sb.id)  # nobody left to see or change anything
        action = {"op": "verify", **req.model_dump(include={"cmd", "env", "cwd", "user"})}
        if req.task_dirs is not None:
            action["task_dirs"] = req.task_dirs

        async def run() -> dict[str, Any]:
            async with self._vault_lock(sandbox_id):
                protected = self._protected(sandbox_id, self._vault_index(sandbox_id))
                made: builtins.list[str] = []
                try:
                    made = await sb.files.run(lambda f: trusted.prepare_mount_points(f, protected, dirs))
                    raw = await self._run_trusted(sb, req, protected=protected)
                finally:
                    await ckpt.kill_user_processes(self.cgroups, sb.id)  # nothing the verifier started stays
                    for path in made:
                        with contextlib.suppress(errors.DsecError):
                            await self._delete_path(sb, path)
            result = raw.to_exec_result()
            result.misbehaviour = self._misbehaviour(sb, raw)
            return result.model_dump()

        obs, seq, replayed = await self._logged(sb, "verify", action, req.step, run)
        return ExecResult.model_validate({**obs, "seq": seq, "replayed": replayed})

    # --- reaping, re-adoption, reconciliation ----------------------------------------

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                reap_strays()  # runtime processes exited since the last create
                await self.reap_idle()
                if self.store is not None and self._dirty_active:
                    dirty, self._dirty_active = self._dirty_active, {}
                    self.store.touch_many(dirty)
            except Exception:  # keep reaping whatever one failure was
                log.exception("idle reaper failed")

    @staticmethod
    def _is_idle(sb: Sandbox, now: float) -> bool:
        """Past its idle TTL with nothing in flight: no exec, session run or file operation
        (sb.busy), no session command (a session's lock)."""
        return (
            sb.record.spec.ttl_idle_s is not None
            and sb.record.state is SandboxState.RUNNING
            and not sb.stopping
            and sb.busy == 0
            and now - sb.record.last_active > sb.record.spec.ttl_idle_s
            and not any(s.lock.locked() for s in sb.sessions.values())
        )

    async def reap_idle(self) -> builtins.list[str]:
        now = time.time()
        idle = [sb for sb in self.sandboxes.values() if self._is_idle(sb, now)]

        async def reap(sb: Sandbox) -> None:
            if not self._is_idle(sb, time.time()):  # something started since the scan
                return
            await (self.pause(sb.id) if sb.record.spec.ttl_action == "pause" else self.stop(sb.id))

        await asyncio.gather(*(reap(sb) for sb in idle), return_exceptions=True)
        return [sb.id for sb in idle]

    async def _reconciler(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reconcile_interval_s)
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconciler failed")

    async def _readopt(self) -> None:
        assert self.backend is not None and self.store is not None
        for rec in self.store.all():
            container = None
            if rec.pid is not None and rec.start_time is not None:
                paused = rec.state is SandboxState.PAUSED
                if paused:  # a frozen init cannot answer the adoption ping
                    with contextlib.suppress(OSError):
                        self.cgroups.thaw(rec.id)
                container = await self.backend.adopt(rec.id, rec.pid, rec.start_time)
                if paused and container is not None:
                    self.cgroups.freeze(rec.id)
            if container is None:
                log.info("reaping sandbox %s: it did not survive the edge restart", rec.id)
                self.store.delete(rec.id)
                continue
            try:
                sb = self._open_sandbox(rec, container)
            except Exception:
                await self.backend.destroy(container)
                self.store.delete(rec.id)
                continue
            self.sandboxes[rec.id] = sb
            if rec.spec.network is not None:
                try:
                    await self._apply_network(sb, rec.spec.network, check=False)
                except Exception:
                    log.exception("re-applying the network policy of %s failed", rec.id)
            self._watch_exit(sb)

    async def reconcile(self) -> dict[str, int]:
        """Remove host resources of this edge that no live sandbox claims."""
        assert self.backend is not None
        known = set(self.sandboxes) | set(self._creating) | set(self._terminating)
        mine = f"{self.name}-"
        orphans = (self.backend.runtime_ids() | self.backend.sandbox_dirs()) - known
        orphans |= {c for c in self.cgroups.listed_sandboxes() if c.startswith(mine)} - known
        for sid in orphans:
            log.info("reconciler: removing orphan %s", sid)
            await self.backend.remove_orphan(sid)
        stray = [m for m in mounts_under(self.backend.sandboxes_dir) if m.split("/")[-2] not in known]
        for m in sorted(stray, key=len, reverse=True):
            if Path(m) != self.settings.edge_run_dir / "forks":
                unmount_all(Path(m))
        return {"sandboxes": len(orphans), "mounts": len(stray)}

    # --- memory checkpoints -----------------------------------------------------------

    def _checkpoints_dir(self) -> Path:
        return self.settings.data_dir / "checkpoints"

    def _checkpoint_dir(self, checkpoint_id: str) -> Path:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*-ckpt-[0-9a-f]{12}", checkpoint_id):
            raise errors.CheckpointNotFound(
                f"{checkpoint_id!r} is not a checkpoint id (like edge-ckpt-0123...)"
            )
        d = self._checkpoints_dir() / checkpoint_id
        if not (d / "checkpoint.json").is_file():
            raise errors.CheckpointNotFound(f"there is no checkpoint {checkpoint_id} on edge {self.name}")
        return d

    def _checkpoint_model(self, d: Path) -> Checkpoint:
        info = ckpt.CheckpointInfo.load(d)
        spec = SandboxSpec.model_validate_json((d / "spec.json").read_text())
        return Checkpoint(
            id=d.name,
            sandbox=info.sandbox,
            project=spec.project,
            image=spec.image,
            cpu=spec.cpu,
            memory_mb=spec.memory_mb,
            trees=[CheckpointTree(root=t.root, pids=t.pids, cmdline=t.cmdline) for t in info.trees],
            size_bytes=info.size_bytes,
            leave_running=info.leave_running,
            created_at=info.created_at,
            timings_ms=info.timings_ms,
        )

    async def checkpoint(self, sandbox_id: str, *, leave_running: bool = True) -> Checkpoint:
        """Checkpoint the sandbox's processes (CRIU) together with a copy of its files, taken
        while they are stopped, so that memory and files match. Only processes that run on
        their own can be checkpointed (not a running exec or a session: their pipes end in
        this edge); anything else fails with a coded reason that says what to do instead."""
        sb = self._get(sandbox_id)  # resumes a paused sandbox: CRIU cannot seize frozen tasks
        criu = ckpt.find_criu(self.settings.criu_root)
        cid = f"{self.name}-ckpt-{secrets.token_hex(6)}"
        dest = self._checkpoints_dir() / cid
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(dest.parent, 0o700)  # root's only: no sandbox id reaches another checkpoint

        async def copy_files() -> None:
            await copy_tree(self._copy_tool, sb.container.upper, dest / "fs", self._to_store(sb))
            for layer in _chain(sb.record.extra_lower):  # a fork's or a restored sandbox's layers
                await copy_tree_under(self._copy_tool, Path(layer), dest / "fs")

        t0 = time.perf_counter()
        info = await ckpt.dump(
            sb.container,
            dest,
            criu=criu,
            uid_offset=self.settings.uid_offset,
            leave_running=leave_running,
            while_stopped=copy_files,
        )
        (dest / "spec.json").write_text(sb.record.spec.model_dump_json())
        # Its size is what it keeps on the host: the images and the copy of the files (the
        # project's snapshot quota is charged with it).
        info.size_bytes += await asyncio.get_running_loop().run_in_executor(None, disk_usage, dest / "fs")
        info.timings_ms["total"] = (time.perf_counter() - t0) * 1000
        info.save()
        result = self._checkpoint_model(dest)
        await self.log_event(
            sandbox_id,
            "checkpoint",
            {"op": "checkpoint", "leave_running": leave_running},
            {"id": cid, "trees": [t.root for t in result.trees]},
        )
        return result

    async def restore(
        self,
        checkpoint_id: str,
        *,
        sandbox_id: str | None = None,
        labels: dict[str, str] | None = None,
        projects: set[str] | None = None,
    ) -> SandboxInfo:
        """Restore a checkpoint's processes: into a new sandbox stacking the checkpoint's files
        (the default; the checkpoint's spec), or into a running sandbox, whose processes are
        replaced (its files stay as they are: the processes' open files must still match)."""
        d = self._checkpoint_dir(checkpoint_id)
        spec = SandboxSpec.model_validate_json((d / "spec.json").read_text())
        if projects is not None and spec.project not in projects:
            raise errors.CheckpointNotFound(f"there is no checkpoint {checkpoint_id} in your projects")
        criu = ckpt.find_criu(self.settings.criu_root)
        t0 = time.perf_counter()
        if sandbox_id is not None:
            self.check_access(sandbox_id, projects)
            sb = self._get(sandbox_id)
            for s in list(sb.sessions.values()):
                with contextlib.suppress(Exception):
                    s.close(kill=False)
            sb.sessions.clear()
            await ckpt.kill_user_processes(self.cgroups, sb.id)
            roots = await ckpt.restore(
                sb.container, d, criu=criu, cgroups=self.cgroups, group_name=self._group_name(sb)
            )
            info = sb.info(self.name)
        else:
            if labels:
                spec = spec.model_copy(update={"labels": {**spec.labels, **labels}})
            spec = spec.model_copy(update={"labels": {**spec.labels, "dsec.restored-from": checkpoint_id}})
            # The checkpoint's files are stacked as they are (read-only, shared by every restore).
            info = await self._create(spec, None, t0, extra_lower=str(d / "fs"))
            sb = self.sandboxes[info.id]
            try:
                roots = await ckpt.restore(
                    sb.container, d, criu=criu, cgroups=self.cgroups, group_name=self._group_name(sb)
                )
            except BaseException:
                await self.stop(info.id)
                raise
            info = sb.info(self.name)
        info.timings_ms["restore"] = (time.perf_counter() - t0) * 1000
        await self.log_event(
            sb.id, "restore", {"op": "restore", "checkpoint": checkpoint_id}, {"roots": roots}
        )
        return info

    def list_checkpoints(self, projects: set[str] | None = None) -> builtins.list[Checkpoint]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for d in sorted(self._checkpoints_dir().iterdir()):
                with contextlib.suppress(errors.DsecError, OSError, ValueError):
                    c = self._checkpoint_model(d)
                    if projects is None or c.project in projects:
                        out.append(c)
        return out

    def delete_checkpoint(self, checkpoint_id: str, projects: set[str] | None = None) -> None:
        d = self._checkpoint_dir(checkpoint_id)
        if projects is not None and self._checkpoint_model(d).project not in projects:
            raise errors.CheckpointNotFound(f"there is no checkpoint {checkpoint_id} in your projects")
        users = [sb.id for sb in self.sandboxes.values() if str(d / "fs") in _chain(sb.record.extra_lower)]
        if users:
            raise errors.Conflict(
                f"checkpoint {checkpoint_id} holds the files of live sandboxes ({', '.join(users[:5])}); "
                "stop them first"
            )
        shutil.rmtree(d)

    # --- snapshots and forks ----------------------------------------------------------

    def _forks_root(self) -> Path:
        """Fork layers live in the edge's run dir, a tmpfs (see _ensure_run_tmpfs)."""
        root = self.settings.edge_run_dir / "forks"
        root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)  # root's only: the layers hold sandbox-owned (maybe setuid) files
        return root

    def _to_store(self, sb: Sandbox) -> tuple[int, int]:
        """The owner shift from the sandbox's own id range to the layer store's canonical one."""
        return sb.container.id_base, self.settings.uid_offset

    async def _frozen_copy(self, sb: Sandbox, dst: Path) -> None:
        """Copy the writable layer while the sandbox is frozen (a consistent point in time)."""
        was_paused = sb.record.state is SandboxState.PAUSED
        loop = asyncio.get_running_loop()
        if not was_paused:
            await loop.run_in_executor(None, self.cgroups.freeze, sb.id)
        try:
            await copy_tree(self._copy_tool, sb.container.upper, dst, self._to_store(sb))
        finally:
            if not was_paused:
                self.cgroups.thaw(sb.id)

    async def snapshot(self, sandbox_id: str, scrub_paths: builtins.list[str] | None = None) -> SnapshotInfo:
        sb = self._get(sandbox_id)
        if sb.record.extra_lower:
            raise errors.UnsupportedOperation(
                f"sandbox {sandbox_id} is a fork; snapshot the sandbox it was forked from, or fork a snapshot"
            )
        base = self._image(sb.record.spec.image)
        n = next(sb.counter)
        version = f"{int(time.time())}-{n}"
        loop = asyncio.get_running_loop()
        with self.layers.staging() as stage:
            await self._frozen_copy(sb, stage)
            lower = [self.layers.layer_path(r) for r in reversed(base.layers)]  # as the sandbox sees them

            def clean() -> builtins.list[str]:
                done = scrub(stage, scrub_paths or [], self.settings.uid_offset, lower)
                strip_setid(stage)  # no setuid file of a sandbox's in the layer store
                return done

            scrubbed = await loop.run_in_executor(None, clean)
            layer = await loop.run_in_executor(
                None,
                lambda: self.layers.commit_layer(
                    stage,
                    f"snap-{sandbox_id}",
                    version,
                    {"type": "snapshot", "sandbox": sandbox_id, "scrubbed": scrubbed},
                    shift=False,
                ),
            )
        name = f"snap-{sandbox_id}-{version}"
        image = Image(
            name=name,
            layers=[*base.layers, layer.ref],
            source={
                "type": "snapshot",
                "sandbox": sandbox_id,
                "project": sb.record.spec.project,
                "base": base.name,
                "scrubbed": scrubbed,
            },
        )
        self.layers.put_image(image)
        await self.log_event(sandbox_id, "snapshot", {"op": "snapshot", "scrub": scrubbed}, {"id": name})
        return SnapshotInfo(
            id=name,
            sandbox=sandbox_id,
            layer=str(layer.ref),
            size_bytes=layer.size_bytes,
            files=layer.files,
            scrubbed=scrubbed,
            created_at=layer.created_at,
        )

    def list_snapshots(self, projects: set[str] | None = None) -> builtins.list[dict[str, Any]]:
        return [
            i.model_dump(mode="json")
            for i in self.layers.list_images()
            if i.source.get("type") == "snapshot"
            and (projects is None or i.source.get("project") in projects)
        ]

    def delete_snapshot(self, name: str, projects: set[str] | None = None) -> None:
        image = self._image(name)
        if image.source.get("type") != "snapshot":
            raise errors.InvalidRequest(f"{name} is not a snapshot")
        if projects is not None and image.source.get("project") not in projects:
            raise errors.ImageNotFound(f"there is no snapshot {name!r} in your projects")
        if any(sb.record.spec.image == name for sb in self.sandboxes.values()):
            raise errors.Conflict(f"snapshot {name} is in use by live sandboxes; stop them first")
        self.layers.delete_image(name)
        with contextlib.suppress(errors.DsecError):
            self.layers.delete_layer(image.layers[-1])

    # --- moving images between edges (a snapshot restored where it was not made) ---------

    def image_manifest(self, name: str) -> dict[str, Any]:
        """An image and the digests of its layers, for another edge to pull it."""
        image = self._image(name)
        return {
            "image": image.model_dump(mode="json"),
            "digests": {str(r): self.layers.get_layer(r).digest for r in image.layers},
        }

    def missing_layers(self, manifest: dict[str, Any]) -> builtins.list[str]:
        return [ref for ref in manifest["digests"] if not self.layers.has_layer(ref)]

    async def export_layer(self, ref: str, dest: Path) -> None:
        """Write layer `ref` as a tar archive (owners as stored, xattrs, whiteouts, holes)."""
        tree = self.layers.layer_path(ref)
        if not tree.is_dir():
            raise errors.LayerNotFound(f"edge {self.name} has no layer {ref}")
        with open(dest, "wb") as out:
            argv = ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--sparse", "-C", str(tree)]
            rc = await run_process_quick([*argv, "-cf", "-", "."], out.fileno())
        if rc != 0:
            raise errors.InternalError(f"archiving layer {ref} failed (tar exit {rc})")

    async def import_layer(self, ref: str, digest: str, archive: Path) -> None:
        """Add a layer pulled from another edge; its content must hash to `digest`."""
        name, _, version = ref.partition("@")
        if self.layers.has_layer(ref):
            return
        with self.layers.staging() as stage, open(archive, "rb") as src, open(os.devnull, "wb") as devnull:
            argv = ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-xpf", "-", "-C", str(stage)]
            pid, pidfd = spawn_quick(argv, devnull.fileno(), devnull.fileno(), stdin_fd=src.fileno())
            if await wait_quick(pid, pidfd) != 0:
                raise errors.InvalidRequest(f"the archive of layer {ref} does not unpack")
            layer = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: self.layers.commit_layer(
                    stage, name, version, {"type": "pulled", "ref": ref}, shift=False
                ),
            )
        if layer.digest != digest:
            self.layers.delete_layer(ref)
            raise errors.InvalidRequest(
                f"layer {ref} arrived corrupted (digest {layer.digest}, expected {digest})"
            )

    def put_image(self, manifest: dict[str, Any]) -> None:
        image = Image.model_validate(manifest["image"])
        missing = self.missing_layers(manifest)
        if missing:
            raise errors.LayerNotFound(f"cannot register image {image.name}: layers {missing} are missing")
        self.layers.put_image(image)

    async def fork(self, sandbox_id: str, n: int) -> builtins.list[SandboxInfo]:
        """`n` new sandboxes from this one's current files, copy-on-write, independent afterwards.

        The parent is frozen while its writable layer is copied (a consistent point in time)
        into a shared layer that every child stacks read-only under its own empty writable
        layer, on top of the parent's own fork layers (a fork of a fork copies only what the
        parent wrote since its fork; chains longer than MAX_FORK_CHAIN are flattened).

        The children's runtimes start while the file contents are still being copied: the copy
        creates every directory first, and only then are the children started. Neither the
        runtime nor the shim looks up any path of these layers but directories (mount points,
        /.dsec) before `layers_ready`, and the edge reads nothing in a child (its user database,
        its workdir) before the copy is complete, so no overlayfs lookup can see a half-copied
        layer. Overlapping the two roughly halves a fork (both are CPU-bound).
        """
        if not 1 <= n <= 256:
            raise errors.InvalidRequest(f"fork count must be between 1 and 256, got {n}")
        sb = self._get(sandbox_id)
        spec = sb.record.spec
        for _ in range(n):
            self._admit(spec)
        check_fork_room(self._forks_root(), sandbox_id, sb.container.upper)  # before the copy
        t0 = time.perf_counter()
        shared = self._forks_root() / f"{sandbox_id}-{secrets.token_hex(4)}"
        tree = shared / "tree"
        parent_chain = _chain(sb.record.extra_lower)
        flatten = len(parent_chain) >= MAX_FORK_CHAIN
        chain = ":".join([str(tree), *([] if flatten else parent_chain)])
        was_paused = sb.record.state is SandboxState.PAUSED
        loop = asyncio.get_running_loop()
        if not was_paused:
            await loop.run_in_executor(None, self.cgroups.freeze, sb.id)
        # What the copy will hold, measured frozen (the upper is a tmpfs of its own): the
        # apiserver charges the project's snapshot quota with it.
        layer_bytes = sb.container.disk_usage()[0]
        copied: dict[str, float] = {}

        def copy_done(_: object) -> None:
            copied["t"] = time.perf_counter()
            if not was_paused:
                with contextlib.suppress(OSError):
                    self.cgroups.thaw(sb.id)

        copy = None
        ready: asyncio.Future[None] | None = None
        try:
            copy = start_copy(
                self._copy_tool,
                sb.container.upper,
                tree,
                shift=self._to_store(sb),
                what="copying the writable layer",
            )
            await copy.dirs()
            if flatten:  # merge the parent's chain in before any child starts
                await copy.wait()
                for layer in parent_chain:
                    await copy_tree_under(self._copy_tool, Path(layer), tree)
                layer_bytes = await loop.run_in_executor(None, disk_usage, tree)
            ready = asyncio.ensure_future(copy.wait())
            ready.add_done_callback(copy_done)
            labels = {**spec.labels, "dsec.fork-of": sandbox_id}
            child = spec.model_copy(update={"labels": labels})
            results = await asyncio.gather(
                *(self._create(child, None, t0, extra_lower=chain, layers_ready=ready) for _ in range(n)),
                return_exceptions=True,
            )
            await ready
        except BaseException:
            if ready is not None and not ready.done():
                ready.cancel()
            elif ready is None:
                copy_done(None)
            self._release_fork_layers(chain)
            raise
        finally:
            if copy is not None:
                copy.close()
        infos = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if not isinstance(r, SandboxInfo)]
        if failed:
            await asyncio.gather(*(self.stop(i.id) for i in infos), return_exceptions=True)
            self._release_fork_layers(chain)
            raise (
                failed[0] if isinstance(failed[0], errors.DsecError) else errors.InternalError(str(failed[0]))
            )
        for i in infos:
            i.timings_ms["fork_copy"] = (copied.get("t", t0) - t0) * 1000
            i.fork_layer = ForkLayer(id=shared.name, size_bytes=layer_bytes)
        await self.log_event(sandbox_id, "fork", {"op": "fork", "n": n}, {"ids": [i.id for i in infos]})
        return infos

    def _unmount_forks_if_unused(self) -> None:
        """Remove fork layers no live sandbox stacks (and the separate tmpfs older edges
        mounted for them, once empty)."""
        root = self.settings.edge_run_dir / "forks"
        if not root.is_dir():
            return
        used = {str(Path(p).parent) for sb in self.sandboxes.values() for p in _chain(sb.record.extra_lower)}
        for d in root.iterdir():
            if str(d) not in used:
                shutil.rmtree(d, ignore_errors=True)
        if not any(root.iterdir()):
            unmount_all(root)
            with contextlib.suppress(OSError):
                root.rmdir()

    def _release_fork_layers(self, chain: str | None) -> None:
        """Remove the fork layers of a chain that no live sandbox stacks any more."""
        used = {p for sb in self.sandboxes.values() for p in _chain(sb.record.extra_lower)}
        forks = self.settings.edge_run_dir / "forks"
        for path in _chain(chain):  # a checkpoint's files (also stacked) belong to the checkpoint
            if path not in used and Path(path).parent.parent == forks:
                shutil.rmtree(Path(path).parent, ignore_errors=True)

    # --- fncall ---------------------------------------------------------------------

    async def fncall_run(self, req: FnCallRequest) -> FnCallResult:
        return await self.fncall.run(req)

    async def fncall_jupyter(self, req: JupyterRequest) -> JupyterResult:
        return await self.fncall.jupyter(req)

    # --- pools ---------------------------------------------------------------------

    def configure_pool(self, spec: PoolSpec) -> PoolInfo:
        self._image(spec.image)
        return self.pools.configure(spec)

    def prewarm(self, spec: PoolSpec, count: int) -> PoolInfo:
        self._image(spec.image)
        return self.pools.prewarm(spec, count)

    # --- status ----------------------------------------------------------------------

    def status(self) -> EdgeStatus:
        specs = [
            sb.record.spec for sb in self.sandboxes.values() if not sb.record.spec.project.startswith("_")
        ]
        return EdgeStatus(
            name=self.name,
            healthy=True,
            backends=["container"],
            capacity={
                "sandboxes": self.settings.max_sandboxes,
                "cpu": self.settings.capacity_cpu,
                "memory_mb": self.settings.capacity_memory_mb,
            },
            used={
                "sandboxes": len(self.sandboxes) + len(self._creating),
                "pooled": self.pools.ready_count(),
                "cpu": sum(s.cpu for s in specs),
                "memory_mb": sum(s.memory_mb for s in specs),
            },
            sandboxes=len(specs),
            by_image=dict(Counter(s.image for s in specs)),
            by_project=dict(Counter(s.project for s in specs)),
            layers=[str(layer.ref) for layer in self.layers.list_layers()],
            images=[i.name for i in self.layers.list_images()],
            fork_layers=self._fork_layer_ids(),
        )

    def _fork_layer_ids(self) -> builtins.list[str]:
        """The fork layers on the run tmpfs (each charged to its project until it is gone)."""
        root = self.settings.edge_run_dir / "forks"
        try:
            return sorted(d.name for d in root.iterdir())
        except OSError:
            return []


def encode_content(data: bytes) -> tuple[str, str]:
    try:
        return data.decode(), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode(), "base64"
