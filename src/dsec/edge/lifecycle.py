"""The life of a sandbox on its edge: admission and creation (a warm pool claim, or a new
sandbox on the backend its spec names), lookup, pause and resume, network policy, and stop.

A collaborator of `Edge` (edge.py): what it needs of the rest of the edge is passed to its
constructor (the parts it calls back into, protect and the fork layers, as callables)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.backends import registry
from dsec.backends.base import Backend, Capability, SandboxHandle, SandboxPlan
from dsec.edge.core import EdgeCore, EdgePart
from dsec.edge.files import SandboxFiles
from dsec.edge.guestfiles import GuestFiles
from dsec.edge.pools import WarmPools
from dsec.edge.process import RawResult
from dsec.edge.sandbox import Sandbox, _chain
from dsec.edge.store import Record
from dsec.edge.telemetry import Telemetry
from dsec.isolation.cgroups import PID_RESERVE
from dsec.isolation.denials import audit_session
from dsec.isolation.spec import DEFAULT_PATH, Limits
from dsec.layers import userdb
from dsec.layers.store import Image
from dsec.layers.userdb import resolve_user
from dsec.models import (
    DEFAULT_USER,
    DEFAULT_WORKDIR,
    POOL_PROJECT,
    ExecRequest,
    NetworkPolicy,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)

log = logging.getLogger("dsec.edge")
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class EdgeLifecycle(EdgePart):
    """Admission, create, lookup, pause, network, stop (see the module)."""

    def __init__(
        self,
        core: EdgeCore,
        *,
        telemetry: Telemetry,
        toolkit: Callable[[], list[str]],
        run: Callable[..., Coroutine[Any, Any, RawResult]],
        protect: Callable[[str, list[str]], Awaitable[object]],
        vault_dir: Callable[[str], Path],
        release_fork_layers: Callable[[str | None], None],
        using: Callable[[str, str], contextlib.AbstractAsyncContextManager[None]] | None = None,
    ) -> None:
        super().__init__(core)
        self.telemetry = telemetry.counters
        self.denials = telemetry.denials
        self._toolkit_of = toolkit  # the layers every sandbox gets on top (the shim)
        self._run = run  # EdgeExec._run
        self.protect = protect  # EdgeVault.protect
        self._vault = vault_dir  # EdgeVault._vault
        self._release_fork_layers = release_fork_layers  # EdgeState._release_fork_layers
        # LayerCache.using: the image held (pulled first when missing) for a create
        self._using = using or (lambda _image, _project: contextlib.nullcontext())
        self._creating: dict[str, SandboxSpec] = {}
        self._terminating: dict[str, asyncio.Task[None]] = {}  # teardowns in flight, held
        self._terminating_images: dict[str, str] = {}  # their images (not evicted meanwhile)
        # Sandboxes that died on their own (init killed, e.g. out of memory): their callers get
        # sandbox_failed with the reason instead of not_found (the most recent 10,000).
        self._failed: dict[str, Record] = {}
        self.pools = WarmPools(self._create_for_pool, self.stop)

    @property
    def _toolkit(self) -> list[str]:
        return self._toolkit_of()

    def in_progress(self) -> set[str]:
        """Sandboxes being created or torn down (the reconciler must not take them for orphans)."""
        return set(self._creating) | set(self._terminating)

    # --- create -------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{self.name}-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))

    @property
    def backend(self) -> Backend:
        """The default backend (the container one)."""
        return self.backend_for(registry.DEFAULT)

    def backend_for(self, name: str) -> Backend:
        b = self.backends.get(name)
        if b is None:
            why = self.core.absent_backends.get(name)
            raise errors.InvalidRequest(
                f"backend {name!r} is not available on edge {self.name}"
                f"{f' ({why})' if why else ''}; available: "
                f"{', '.join(sorted(self.backends)) or 'none (the edge has not started)'}",
                reason="unknown_backend",
                available=sorted(self.backends),
            )
        return b

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

    @staticmethod
    def _effective(spec: SandboxSpec, image: Image) -> SandboxSpec:
        """`spec` with the user and workdir it runs with: its own, else the image's USER and
        WORKDIR, else root and /work (what the record keeps and the sandbox's info shows)."""
        if spec.user is not None and spec.workdir is not None:
            return spec
        return spec.model_copy(
            update={
                "user": spec.user or image.config.user or DEFAULT_USER,
                "workdir": spec.workdir or image.config.workdir or DEFAULT_WORKDIR,
            }
        )

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None) -> SandboxInfo:
        if spec.network is not None:  # a rule to the platform's addresses: 400 before any work
            await self.net.check(spec.network)
        async with self._using(spec.image, spec.project):
            info = await self._create_plain(spec, sandbox_id)
        if spec.protected_paths:
            try:
                await self.protect(info.id, spec.protected_paths)
            except BaseException as e:
                await self.stop(info.id)
                if isinstance(e, errors.FileNotFound):
                    raise errors.FileNotFound(
                        f"{e.message}: protected_paths moves paths that image {spec.image!r} already "
                        "has. Bake the grader into the image (a snapshot of a sandbox you wrote it "
                        "into), or create the sandbox without it, write it, then protect it "
                        "(sb.protect([path]), POST /v1/sandboxes/{id}/protect)"
                    ) from None
                raise
        return info

    async def _create_plain(self, spec: SandboxSpec, sandbox_id: str | None) -> SandboxInfo:
        t0 = time.perf_counter()
        image = self._image(spec.image)
        if not image.usable_by(spec.project):  # snapshots belong to a project
            raise errors.ImageNotFound(f"there is no snapshot {spec.image!r} in project {spec.project!r}")
        if sandbox_id is None and spec.project != POOL_PROJECT and spec.network is None:
            pooled = self._claim_pooled(spec, t0, image)
            if pooled is not None:
                return pooled
        return await self._create(spec, sandbox_id, t0, image=image)

    async def _create_for_pool(self, spec: SandboxSpec) -> str:
        async with self._using(spec.image, spec.project):  # pulled again if evicted meanwhile
            info = await self._create(spec, None, time.perf_counter())
        # Prime it: the first process in a fresh overlay pays for cold lookups of the
        # shell and its libraries (~1.5 ms); pay it now, not in the claimant's first exec.
        await self._run(self.sandboxes[info.id], ExecRequest(cmd="true", cwd="/", timeout=10))
        return info.id

    def _claim_pooled(self, spec: SandboxSpec, t0: float, image: Image) -> SandboxInfo | None:
        assert self.store is not None
        while (sid := self.pools.take(spec)) is not None:  # (by the spec as given: None matches None)
            sb = self.sandboxes.get(sid)
            if sb is None or sb.stopping or not sb.handle.alive():
                continue
            now = time.time()
            sb.record.spec = self._effective(spec, image)
            sb.record.created_at = sb.record.last_active = now
            self.store.put(sb.record)
            sb.handle.timings_ms = {"pool": (time.perf_counter() - t0) * 1000}
            sb.handle.timings_ms["total"] = sb.handle.timings_ms["pool"]
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
        writable_from: Path | None = None,
        restore_from: Path | None = None,
    ) -> SandboxInfo:
        """Start a sandbox. `extra_lower`: a fork's layer chain (colon-separated, top first),
        stacked under the toolkit. `layers_ready`: awaited after the runtime started and before
        anything reads the sandbox's files (a fork's layer may still be filling; see fork())."""
        assert self.store is not None
        backend = self.backend_for(spec.backend)
        if spec.protected_paths:  # refused before anything is made
            backend.require(Capability.TRUSTED_EXEC, "protected paths (only verify reads them)")
        image = image or self._image(spec.image)  # read once per create (a JSON file)
        spec = self._effective(spec, image)
        self._admit(spec)
        sid = sandbox_id or self._new_id()
        self._creating[sid] = spec
        try:
            # The toolkit (the shim) stays on top: nothing a sandbox wrote can replace it.
            lowers = [self.layers.layer_path(r) for r in self._toolkit]
            lowers += [Path(p) for p in _chain(extra_lower)]
            lowers += self.layers.lowerdirs(image)
            env = {"PATH": DEFAULT_PATH, "HOSTNAME": sid, **image.config.env, **spec.env}
            limits = Limits(spec.cpu, spec.memory_mb, spec.pids + PID_RESERVE)
            plan = SandboxPlan(
                sid, lowers, limits, spec.disk_mb, env, spec.disk_inodes, spec.storage, spec.pids,
                writable_from=writable_from, restore_from=restore_from,
            )  # fmt: skip
            # The sandbox's first trajectory reservation (an fsync) overlaps the runtime start
            # instead of delaying its first operation (~1 ms off the first exec).
            prepared = asyncio.ensure_future(self._prepare_trajlog(sid))
            try:
                handle = await backend.create(plan)
            except BaseException:
                await prepared
                raise
            try:
                await prepared
            except BaseException:  # cancelled once started: nothing else would stop it
                await backend.destroy(handle)
                raise
            if layers_ready is not None:
                try:
                    await asyncio.shield(layers_ready)
                except BaseException:
                    await backend.destroy(handle)
                    raise
            t_setup = time.perf_counter()
            ts = time.time()
            record = Record(
                sid,
                spec,
                SandboxState.RUNNING,
                handle.pid,
                handle.start_time,
                ts,
                ts,
                extra_lower=extra_lower,
                image_digest=image.digest,
            )
            try:
                sb = self._open_sandbox(record, backend, handle, image)
                if sb.guest is not None:
                    await sb.guest.mkdirs(sb.workdir)
                else:
                    sb.files._mkdirs(sb.workdir)
                if spec.network is not None:
                    await self._apply_network(sb, spec.network)
                self.store.put(record)
            except BaseException:
                await backend.destroy(handle)
                raise
        finally:
            self._creating.pop(sid, None)
        self.sandboxes[sid] = sb
        handle.timings_ms["setup"] = (time.perf_counter() - t_setup) * 1000
        handle.timings_ms["total"] = (time.perf_counter() - t0) * 1000
        self._watch_exit(sb)
        return sb.info(self.name)

    async def _prepare_trajlog(self, sid: str) -> None:
        try:
            await self.trajlog.prepare(sid)
        except errors.DsecError as e:  # the first record() retries and reports it
            log.warning("trajectory log: could not prepare %s: %s", sid, e)

    def _track_denials(self, sb: Sandbox) -> None:
        ses = audit_session(sb.handle.pid)
        if ses is not None:
            self.denials.sessions[ses] = sb.id
            sb.audit_session = ses

    def _open_sandbox(
        self, record: Record, backend: Backend, handle: SandboxHandle, image: Image | None = None
    ) -> Sandbox:
        """The live sandbox of a record: its user resolved, its image's env kept (`image`: read
        from the store when not given, as at an adopt; one gone since gives an empty config)."""
        if image is None:
            with contextlib.suppress(errors.DsecError):
                image = self._image(record.spec.image)
        # A backend without host file access (a microVM's files are in its guest) has no root.
        root_fd = handle.open_root() if backend.host_files else -1
        try:
            base = handle.id_base  # the sandbox's own host id range
            files = SandboxFiles(
                root_fd,
                base,
                base,
                base,
                handle.channel,  # charged writes: copied by a child of the sandbox's init
            )
            users = self._user_files(files, image)
            uid, gid, home = resolve_user(record.spec.user or DEFAULT_USER, users)
            files.uid, files.gid = uid + base, gid + base
        except BaseException:
            if root_fd >= 0:
                os.close(root_fd)
            raise
        env = dict(image.config.env) if image is not None else {}
        sb = Sandbox(record, backend, handle, root_fd, files, uid, gid, home, image_env=env, users=users)
        if root_fd < 0 and Capability.FILES in backend.capabilities:
            sb.guest = GuestFiles(lambda req, data, cap: self._run(sb, req, stdin=data, cap=cap), uid, gid)
        self._track_denials(sb)
        return sb

    def _user_files(self, files: SandboxFiles, image: Image | None) -> userdb.Reader:
        """Where a sandbox's users are read: its own root as it is now, on the host (openat2
        inside the root, bounded); where the host cannot reach its files (a microVM), the
        image's layers as stacked (links refused), so names work on every backend."""
        if files.root_fd < 0:
            lowers = self.layers.lowerdirs(image) if image is not None else []
            return lambda path: userdb.read_image_file(lowers, path)

        def read(path: str) -> bytes | None:
            try:
                return files.read(path, userdb.MAX_USERDB_BYTES)
            except errors.FileNotFound:
                return None
            except errors.DsecError as e:  # too large, not a regular file, a link that leaves
                raise errors.InvalidRequest(
                    f"the sandbox's {path} cannot be read for its users ({e.message}); give a uid or "
                    "uid:gid",
                    reason="unsafe_user_database",
                ) from None

        return read

    def _watch_exit(self, sb: Sandbox) -> None:
        def on_exit(_: asyncio.Future[None]) -> None:
            if not sb.stopping and sb.id in self.sandboxes:
                events = self.cgroups.events(sb.id)
                reason = f"the sandbox failed: {sb.handle.exit_reason()}"
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

        sb.handle.exited.add_done_callback(on_exit)

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
        """The sandbox with its misbehaviour telemetry and resource use (a failed one: its state
        and reason)."""
        failed = self._failed.get(sandbox_id)
        if failed is not None and sandbox_id not in self.sandboxes:
            return failed.info(self.name)  # its state: FAILED (_watch_exit)
        sb = self._lookup(sandbox_id)
        info = sb.info(self.name)
        info.telemetry = self.telemetry(sb)
        info.usage = self.cgroups.usage(sb.id)
        return info

    async def sandbox_status(self, sandbox_id: str) -> SandboxInfo:
        """get() plus what takes a kernel round trip: refused connections of its network policy."""
        info = self.get(sandbox_id)
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb.record.spec.network is not None:
            with contextlib.suppress(Exception):
                info.telemetry["denied_connections"] = (await self.net.counters(sb.id))["denied_packets"]
        return info

    # --- pause / resume --------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox and give back the memory the kernel can take."""
        sb = self._lookup(sandbox_id)
        if sb.record.state is not SandboxState.PAUSED:
            sb.backend.require(Capability.PAUSE, "pause")
            t0 = time.perf_counter()
            await sb.backend.freeze(sb.handle)
            sb.record.state = SandboxState.PAUSED
            if self.store is not None:
                self.store.put(sb.record)
            await sb.backend.reclaim(sb.handle)
            sb.handle.timings_ms["pause"] = (time.perf_counter() - t0) * 1000
        return sb.info(self.name)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self._lookup(sandbox_id)
        self._resume(sb)
        return sb.info(self.name)

    def _resume(self, sb: Sandbox) -> None:
        if sb.record.state is not SandboxState.PAUSED:
            return
        t0 = time.perf_counter()
        sb.backend.thaw(sb.handle)
        sb.record.state = SandboxState.RUNNING
        sb.record.last_active = time.time()
        if self.store is not None:
            self.store.put(sb.record)
        sb.handle.timings_ms["resume"] = (time.perf_counter() - t0) * 1000

    # --- network policy ----------------------------------------------------------------

    async def _apply_network(
        self, sb: Sandbox, policy: NetworkPolicy, *, check: bool = True, resolv: bool = True
    ) -> None:
        """`resolv`: (re)write the sandbox's resolv.conf (not when re-applying a stored policy
        after an edge restart: the file is still there, and a paused VM could not write it)."""
        timings = await self.net.apply(sb.id, sb.handle.pid, policy, check=check, hook=sb.backend.net_hook)
        if not resolv:
            pass
        elif sb.guest is not None:
            await sb.guest.write_charged("/etc/resolv.conf", self.net.resolv_conf().encode())
        else:
            sb.files.write("/etc/resolv.conf", self.net.resolv_conf().encode())
        sb.handle.timings_ms.update({f"network_{k}": v for k, v in timings.items()})

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy | None) -> dict[str, Any]:
        """Replace a running sandbox's egress allowlist atomically (None: detach it, back to
        loopback only). New connections follow it; established ones continue."""
        sb = self._get(sandbox_id)
        sb.backend.require(Capability.NETWORK, "network policy")
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
        self._terminating_images[sandbox_id] = sb.record.spec.image  # its layers stay until torn down

        def done(_: object) -> None:
            self._terminating.pop(sandbox_id, None)
            self._terminating_images.pop(sandbox_id, None)

        task.add_done_callback(done)
        return task

    async def _teardown(self, sb: Sandbox) -> None:
        if sb.record.state is SandboxState.PAUSED:
            with contextlib.suppress(OSError):
                sb.backend.thaw(sb.handle)  # a frozen init would take SIGKILL only after a thaw
        for s in sb.sessions.values():
            with contextlib.suppress(Exception):
                s.close(kill=False)  # the whole pid namespace dies with the shim
        sb.sessions.clear()
        if sb.root_fd >= 0:
            os.close(sb.root_fd)
        shutil.rmtree(self._vault(sb.id), ignore_errors=True)
        if sb.audit_session is not None:
            self.denials.drain()  # its last records first
            self.denials.sessions.pop(sb.audit_session, None)
        try:
            await sb.backend.destroy(sb.handle)
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
        sb.backend.detach(sb.handle)
        if sb.root_fd >= 0:
            os.close(sb.root_fd)
