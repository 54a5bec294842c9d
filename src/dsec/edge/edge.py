"""The edge: the per-node agent. It admits, creates, runs, reaps and re-adopts sandboxes.

Call order: ``await Edge.start()`` (reconcile, re-adopt, start the reaper), then
any operation, then ``await Edge.close()``. The edge is the source of truth for
its sandboxes; its durable record is :class:`EdgeStore`.

`Edge` is a facade over collaborators, each in its own module, each an `EdgePart` over the
one `EdgeCore` they share (core.py: settings, stores, host pieces, the live sandboxes) and
given, when it is made, the other parts it calls:
`EdgeLifecycle` (admission, create, lookup, pause, network, stop), `EdgeExec` (execs,
sessions, the trajectory log), `EdgeFiles` (the file API), `EdgeVault` (protect, verify),
`EdgeState` (snapshots, forks, checkpoints), `LayerCache` (images through
the registry: pulls, pushes, eviction), `EdgeReaper` (idle TTL,
re-adoption, the reconciler) and `Telemetry` (misbehaviour counters). The backends run the
sandboxes (`dsec.backends`); the warm pools and the fncall pool take callables.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast

from dsec import errors
from dsec import models as wire
from dsec.backends import registry
from dsec.backends.base import Backend, BackendHost, BackendUnavailable
from dsec.backends.writable import WritableDisks
from dsec.config import EdgeSettings
from dsec.edge.core import EdgeCore
from dsec.edge.execs import EdgeExec
from dsec.edge.fileops import EdgeFiles
from dsec.edge.fncall import FnCallPool, WorkerHost
from dsec.edge.layercache import LayerCache
from dsec.edge.lifecycle import EdgeLifecycle
from dsec.edge.outputs import map_large_buffers
from dsec.edge.reaper import EdgeReaper
from dsec.edge.sessions import prepare_tools
from dsec.edge.state import EdgeState
from dsec.edge.store import EdgeStore
from dsec.edge.telemetry import Telemetry
from dsec.edge.vault import EdgeVault
from dsec.isolation import linux
from dsec.isolation.cgroups import CgroupHost
from dsec.isolation.idranges import IdRanges
from dsec.isolation.netpolicy import NetHost
from dsec.isolation.procs import fs_type, mounts_under, unmount_all
from dsec.isolation.spec import ID_RANGE
from dsec.layers import LayerStore, import_dir_layer
from dsec.native import ensure_copy, ensure_shim
from dsec.privatefs import seal_data_dir
from dsec.trajlog import TrajectoryLog

log = logging.getLogger("dsec.edge")
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
P = ParamSpec("P")
R = TypeVar("R")


class _Delegated(Generic[P, R]):
    """An operation of the facade: `method` of the part the edge holds as attribute `part`,
    looked up at each access and typed as the part declares it."""

    def __init__(self, part: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self.part = part
        self.name = method.__name__

    def __get__(self, edge: Edge, owner: type | None = None) -> Callable[P, R]:
        return cast(Callable[P, R], getattr(getattr(edge, self.part), self.name))


class Edge:
    """The facade: the edge process's own lifecycle, and every operation, each handed to
    the part that does it (see the module)."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.pulls = asyncio.Semaphore(2)  # image pulls at once (network, disk: see layers/pull.py)
        # What every part shares (see core.py); the network: nothing is made on the host
        # before the first policy. No sandbox's policy may reach the registry either (it
        # holds every project's snapshots and takes pushes unauthenticated).
        platform = [*settings.platform_addresses, *([settings.registry] if settings.registry else [])]
        self.core = EdgeCore(
            settings=settings,
            layers=LayerStore(settings.layer_root, settings.uid_offset),
            cgroups=CgroupHost.detect(),
            trajlog=TrajectoryLog(settings.data_dir / f"trajlog-{settings.name}.db"),
            net=NetHost(settings.name, platform=platform),
        )
        self.layers, self.cgroups, self.trajlog = self.core.layers, self.core.cgroups, self.core.trajlog
        self.sandboxes = self.core.sandboxes  # live ones by id, shared by every part
        self.backends = self.core.backends  # by name: the ones settings.backends names, started
        self._toolkit: list[str] = []  # the layers every sandbox gets on top (the shim), at start()
        self._disks = WritableDisks(settings.disk_dir)  # sandboxes' writable layers on disk
        self._copy_tool = Path("/nonexistent")  # dsec-copy, built at start()
        self._tasks: list[asyncio.Task[None]] = []
        # Exec cgroups outlive an edge process when background jobs stay in them:
        # names carry this process's epoch so a restarted edge never collides.
        self._epoch = secrets.token_hex(3)
        self._lock_fd = -1
        self._lock_path: Path | None = None

        # The parts, each given the core and, by name, what it calls of the others
        # (late-bound ones as callables).
        core = self.core
        self.monitor = Telemetry(core)
        self.denials = self.monitor.denials
        self.life = EdgeLifecycle(
            core,
            telemetry=self.monitor,
            toolkit=lambda: self._toolkit,
            run=lambda *a, **k: self.execs._run(*a, **k),
            protect=lambda sid, paths: self.vault.protect(sid, paths),
            vault_dir=lambda sid: self.vault._vault(sid),
            release_fork_layers=lambda chain: self.state._release_fork_layers(chain),
            using=lambda image, project: self.cache.using(image, project),
        )
        self.pools = self.life.pools
        # Images through the registry (pulled at first use, snapshots pushed), when one is set.
        self.cache = LayerCache(
            core,
            images_in_use=lambda: (
                {sb.record.spec.image for sb in self.sandboxes.values()}
                | {s.image for s in self.life._creating.values()}
                | set(self.life._terminating_images.values())
            ),
        )
        self.execs = EdgeExec(core, life=self.life, monitor=self.monitor, epoch=self._epoch)
        self.files = EdgeFiles(get=self.life._get, active=self.execs._active, run=self.execs._run)
        self.vault = EdgeVault(
            settings=settings, get=self.life._get, execs=self.execs, misbehaviour=self.monitor.misbehaviour
        )
        self.state = EdgeState(
            core,
            life=self.life,
            execs=self.execs,
            copy_tool=lambda: self._copy_tool,
            publish=self.cache.publish,
            unpublish=self.cache.unpublish,
        )
        self.reaper = EdgeReaper(core, life=self.life)
        self.fncall = FnCallPool(
            WorkerHost(
                create=self.life.create,
                stop=lambda sid: self.life.stop(sid, wait=False),
                handle=lambda sid: self.sandboxes[sid].handle,
                cgroups=self.cgroups,
                check_image=lambda image: self.layers.get_image(image),
            ),
            workers_per_image=settings.fncall_workers,
        )

    @property
    def net(self) -> NetHost:
        """The host's network policy machinery, shared by the parts."""
        return self.core.net

    @net.setter
    def net(self, host: NetHost) -> None:
        """Use another one (before start: a host with other platform addresses, say)."""
        self.core.net = host

    @property
    def store(self) -> EdgeStore | None:
        """The sandbox records, open while the edge runs."""
        return self.core.store

    @store.setter
    def store(self, store: EdgeStore | None) -> None:
        self.core.store = store

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
        map_large_buffers()  # (exec output: see dsec.edge.outputs)
        shim = ensure_shim(s.native_bin_dir)
        self._copy_tool = ensure_copy(s.native_bin_dir)
        self._ensure_run_tmpfs()
        self._toolkit = [self._shim_layer(shim)]
        host = BackendHost(
            run_dir=s.edge_run_dir,
            shim=shim,
            runtime=s.runtime,
            uid_offset=s.uid_offset,
            id_ranges=IdRanges(s.id_registry, s.uid_offset + ID_RANGE),
            cgroups=self.cgroups,
            net=self.net,
            tools_dir=prepare_tools(s.edge_run_dir / "tools"),
            criu_root=s.criu_root,
            runsc_root=s.runsc_dir,
            microvm_root=s.microvm_dir,
            disks=self._disks,
        )
        self.id_ranges = host.id_ranges  # sandboxes' and image builds' (dsec.layers.dockerbuild)
        for name in dict.fromkeys(s.backends):
            try:
                self.backends[name] = registry.start(name, host)
            except BackendUnavailable as e:  # reported absent (status, /v1/backends): no late failures
                self.core.absent_backends[name] = str(e)
                log.warning("backend %s is not available on edge %s: %s", name, self.name, e)
        self.store = EdgeStore(s.db_path)
        await self.trajlog.start()
        await self.net.remove_leftovers()  # a crashed edge's gateway; policies are re-applied below
        if not self.denials.start():
            log.info("the kernel log is not readable: denied system calls are not counted")
        await self.reaper._readopt()
        await self.reaper.reconcile()
        self._tasks.append(asyncio.create_task(self.reaper._reaper(), name="dsec-reaper"))
        self._tasks.append(asyncio.create_task(self.reaper._reconciler(), name="dsec-reconciler"))
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
                self.life._detach(sb)
            self.sandboxes.clear()
        await asyncio.gather(*list(self.life._terminating.values()), return_exceptions=True)
        await self.cache.aclose()
        await self.net.close(keep=not stop_sandboxes)
        self.denials.close()
        if self.store is not None:
            self.store.touch_many(self.core.dirty_active)
            self.store.close()
            self.store = None
            await self.trajlog.close()
        for backend in self.backends.values():
            backend.close()
        self._disks.close()
        self.cgroups.remove_parent_if_empty()
        self.state._unmount_forks_if_unused()
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
        if any(b.leftover_ids() for b in self.backends.values()) or mounts_under(d):
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

    # --- each operation, handed to its part ---------------------------------------------
    # EdgeLifecycle (lifecycle.py)

    @property
    def backend(self) -> Backend:
        """The default backend (the container one)."""
        return self.life.backend

    create = _Delegated("life", EdgeLifecycle.create)
    backend_for = _Delegated("life", EdgeLifecycle.backend_for)
    check_access = _Delegated("life", EdgeLifecycle.check_access)
    get = _Delegated("life", EdgeLifecycle.get)
    sandbox_status = _Delegated("life", EdgeLifecycle.sandbox_status)
    pause = _Delegated("life", EdgeLifecycle.pause)
    resume = _Delegated("life", EdgeLifecycle.resume)
    set_network = _Delegated("life", EdgeLifecycle.set_network)
    network = _Delegated("life", EdgeLifecycle.network)
    pause_project = _Delegated("life", EdgeLifecycle.pause_project)
    list = _Delegated("life", EdgeLifecycle.list)
    stop = _Delegated("life", EdgeLifecycle.stop)
    _detach = _Delegated("life", EdgeLifecycle._detach)

    # EdgeExec (execs.py)
    exec = _Delegated("execs", EdgeExec.exec)
    exec_stream = _Delegated("execs", EdgeExec.exec_stream)
    exec_reply = _Delegated("execs", EdgeExec.exec_reply)
    exec_events = _Delegated("execs", EdgeExec.exec_events)
    session_create = _Delegated("execs", EdgeExec.session_create)
    session_run = _Delegated("execs", EdgeExec.session_run)
    session_close = _Delegated("execs", EdgeExec.session_close)
    session_list = _Delegated("execs", EdgeExec.session_list)
    trajectory = _Delegated("execs", EdgeExec.trajectory)
    trajectory_export = _Delegated("execs", EdgeExec.trajectory_export)
    write_logged = _Delegated("execs", EdgeExec.write_logged)
    edit_logged = _Delegated("execs", EdgeExec.edit_logged)
    log_event = _Delegated("execs", EdgeExec.log_event)
    _run = _Delegated("execs", EdgeExec._run)

    # EdgeFiles (fileops.py)
    read_file = _Delegated("files", EdgeFiles.read_file)
    write_file = _Delegated("files", EdgeFiles.write_file)
    edit_file = _Delegated("files", EdgeFiles.edit_file)
    stat_file = _Delegated("files", EdgeFiles.stat_file)
    list_dir = _Delegated("files", EdgeFiles.list_dir)
    delete_file = _Delegated("files", EdgeFiles.delete_file)
    upload_tar = _Delegated("files", EdgeFiles.upload_tar)
    archive = _Delegated("files", EdgeFiles.archive)
    download_tar = _Delegated("files", EdgeFiles.download_tar)

    # EdgeVault (vault.py)
    protect = _Delegated("vault", EdgeVault.protect)
    verify = _Delegated("vault", EdgeVault.verify)
    _vault = _Delegated("vault", EdgeVault._vault)

    # EdgeState (state.py)
    snapshot = _Delegated("state", EdgeState.snapshot)
    list_snapshots = _Delegated("state", EdgeState.list_snapshots)
    delete_snapshot = _Delegated("state", EdgeState.delete_snapshot)
    fork = _Delegated("state", EdgeState.fork)
    checkpoint = _Delegated("state", EdgeState.checkpoint)
    restore = _Delegated("state", EdgeState.restore)
    list_checkpoints = _Delegated("state", EdgeState.list_checkpoints)
    delete_checkpoint = _Delegated("state", EdgeState.delete_checkpoint)
    _checkpoint_dir = _Delegated("state", EdgeState._checkpoint_dir)
    _checkpoints_dir = _Delegated("state", EdgeState._checkpoints_dir)

    # EdgeReaper (reaper.py)
    reap_idle = _Delegated("reaper", EdgeReaper.reap_idle)
    reconcile = _Delegated("reaper", EdgeReaper.reconcile)

    # --- fncall ---------------------------------------------------------------------
    fncall_run = _Delegated("fncall", FnCallPool.run)
    fncall_jupyter = _Delegated("fncall", FnCallPool.jupyter)

    # --- pools ---------------------------------------------------------------------

    # An image this edge lacks is pulled from the registry first (the same deduplicated,
    # verified path as a create's), so a pool asked for ahead of a burst can fill; each
    # refill holds the image like a create (`EdgeLifecycle._create_for_pool`).

    async def configure_pool(self, spec: wire.PoolSpec) -> wire.PoolInfo:
        await self.cache.ensure_image(spec.image)
        return self.pools.configure(spec)

    async def prewarm(self, spec: wire.PoolSpec, count: int, project: str | None = None) -> wire.PoolInfo:
        """`project`: whose burst it is (a snapshot of another project is image_not_found,
        not pulled)."""
        held = self.layers.has_image(spec.image)
        if held and project is not None and not self.life._image(spec.image).usable_by(project):
            raise errors.ImageNotFound(f"there is no snapshot {spec.image!r} in project {project!r}")
        await self.cache.ensure_image(spec.image, project)
        return self.pools.prewarm(spec, count)

    # --- status ----------------------------------------------------------------------

    def status(self) -> wire.EdgeStatus:
        specs = [
            sb.record.spec for sb in self.sandboxes.values() if not sb.record.spec.project.startswith("_")
        ]
        return wire.EdgeStatus(
            name=self.name,
            healthy=True,
            backends=sorted(self.backends),
            backend_info=[wire.BackendInfo(**self.backends[n].describe()) for n in sorted(self.backends)]
            + [
                wire.BackendInfo(name=n, available=False, reason=why)
                for n, why in sorted(self.core.absent_backends.items())
            ],
            capacity={
                "sandboxes": self.settings.max_sandboxes,
                "cpu": self.settings.capacity_cpu,
                "memory_mb": self.settings.capacity_memory_mb,
            },
            used={
                "sandboxes": len(self.sandboxes) + len(self.life._creating),
                "pooled": self.pools.ready_count(),
                "cpu": sum(s.cpu for s in specs),
                "memory_mb": sum(s.memory_mb for s in specs),
            },
            sandboxes=len(specs),
            by_image=dict(Counter(s.image for s in specs)),
            by_project=dict(Counter(s.project for s in specs)),
            layers=[str(layer.ref) for layer in self.layers.list_layers()],
            images=[i.name for i in self.layers.list_images()] + self.layers.pinned_names(),
            fork_layers=self._fork_layer_ids(),
            registry=bool(self.settings.registry),
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
