"""The state of a sandbox beyond its processes: snapshots, forks, memory checkpoints. A
snapshot reaches other edges through the registry (pushed when made, its manifest deleted
with it; `dsec.edge.layercache`).

A part of `Edge` (edge.py): what it uses of the rest of the edge is declared at the top of
`EdgeState`, and nothing else is reached."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.backends.base import Capability
from dsec.edge.core import EdgeCore, EdgePart
from dsec.edge.execs import EdgeExec
from dsec.edge.lifecycle import EdgeLifecycle
from dsec.edge.sandbox import MAX_FORK_CHAIN, Sandbox, _chain
from dsec.edge.snapshots import (
    check_cap,
    check_fork_count,
    check_fork_room,
    check_run_tmpfs_room,
    copy_tree,
    copy_tree_under,
    disk_usage,
    over_cap,
    record_fork_layer,
    scrub,
    spool_room,
    stacked_bytes,
    start_copy,
    strip_setid,
)
from dsec.isolation.procs import (
    unmount_all,
)
from dsec.layers import shift_tree, unpack_layer_stream
from dsec.layers.store import Image
from dsec.models import (
    POOL_PROJECT,
    Checkpoint,
    CheckpointTree,
    ForkLayer,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
    inherited_labels,
)

log = logging.getLogger("dsec.edge")


class EdgeState(EdgePart):
    """Snapshot, fork, checkpoint and restore (see the module)."""

    def __init__(
        self,
        core: EdgeCore,
        *,
        life: EdgeLifecycle,
        execs: EdgeExec,
        copy_tool: Callable[[], Path],
        publish: Callable[[str], Awaitable[str | None]] | None = None,
        unpublish: Callable[[str, set[str] | None], Awaitable[bool]] | None = None,
    ) -> None:
        super().__init__(core)
        self._publish = publish  # LayerCache.publish: a snapshot to the registry, when one is set
        self._unpublish = unpublish  # LayerCache.unpublish: its manifest deleted there
        self.life = life  # access, admission, create and stop of the sandboxes made from state
        self.execs = execs  # exec cgroup names and the trajectory's events
        self._copy_tool_of = copy_tool  # dsec-copy, built when the edge starts

    @property
    def _copy_tool(self) -> Path:
        return self._copy_tool_of()

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
        spec = SandboxSpec.model_validate_json((d / "spec.json").read_text())
        info = self.life.backend_for(spec.backend).load_checkpoint(d)
        shape = spec.model_dump(include={"project", "image", "cpu", "memory_mb", "backend"})
        trees = [CheckpointTree(root=t.root, pids=t.pids, cmdline=t.cmdline) for t in info.trees]
        return Checkpoint(
            id=d.name, sandbox=info.sandbox, trees=trees, size_bytes=info.size_bytes,
            leave_running=info.leave_running, created_at=info.created_at, timings_ms=info.timings_ms,
            **shape,
        )  # fmt: skip

    async def checkpoint(
        self, sandbox_id: str, *, leave_running: bool = True, max_bytes: int | None = None
    ) -> Checkpoint:
        """Checkpoint the sandbox's processes (CRIU) together with a copy of its files, taken
        while they are stopped, so that memory and files match. Only processes that run on
        their own can be checkpointed (not a running exec or a session: their pipes end in
        this edge); anything else fails with a coded reason that says what to do instead.
        `max_bytes`: what was reserved for it (quota_exceeded past it: its files alone before
        anything is written, the whole once written, and then it is not kept)."""
        sb = self.life._get(sandbox_id)  # resumes a paused sandbox: CRIU cannot seize frozen tasks
        sb.backend.require_checkpoint()
        check_cap("the checkpoint", sandbox_id, sb.handle.disk_usage()[0], max_bytes)
        cid = f"{self.name}-ckpt-{secrets.token_hex(6)}"
        dest = self._checkpoints_dir() / cid
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(dest.parent, 0o700)  # root's only: no sandbox id reaches another checkpoint

        async def copy_files() -> None:
            await copy_tree(self._copy_tool, sb.handle.writable_layer(), dest / "fs", self._to_store(sb))
            for layer in _chain(sb.record.extra_lower):  # a fork's or a restored sandbox's layers
                await copy_tree_under(self._copy_tool, Path(layer), dest / "fs")

        t0 = time.perf_counter()
        # (a backend whose files are a disk copies it with the memory itself)
        while_stopped = copy_files if sb.backend.host_files else None
        info = await sb.backend.checkpoint(
            sb.handle, dest, leave_running=leave_running, while_stopped=while_stopped
        )
        (dest / "spec.json").write_text(sb.record.spec.model_dump_json())
        # Its size is what it keeps on the host: the images and the copy of the files (the
        # project's snapshot quota is charged with it).
        if sb.backend.host_files:
            info.size_bytes += await asyncio.get_running_loop().run_in_executor(None, disk_usage, dest / "fs")
        info.timings_ms["total"] = (time.perf_counter() - t0) * 1000
        if max_bytes is not None and info.size_bytes > max_bytes:
            shutil.rmtree(dest, ignore_errors=True)
            raise over_cap("the checkpoint", sandbox_id, info.size_bytes, max_bytes)
        info.save()
        result = self._checkpoint_model(dest)
        await self.execs.log_event(
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
        backend = self.life.backend_for(spec.backend)
        backend.require_checkpoint("restore")
        t0 = time.perf_counter()
        if sandbox_id is not None:
            self.life.check_access(sandbox_id, projects)
            sb = self.life._get(sandbox_id)
            other = sb.record.spec.backend
            if other != spec.backend or backend.restores_at_create:  # refused before anything is touched
                why = (
                    f"was taken on the {spec.backend} backend; sandbox {sb.id} runs on {other}"
                    if other != spec.backend
                    else f"is a whole {spec.backend} (its memory and its disk together)"
                )
                raise errors.UnsupportedOperation(
                    f"checkpoint {checkpoint_id} {why}: restore it into a new sandbox", reason="backend"
                )
            sb.backend.require_checkpoint("restore")
            for s in list(sb.sessions.values()):
                with contextlib.suppress(Exception):
                    s.close(kill=False)
            sb.sessions.clear()
            await sb.backend.kill_user_processes(sb.handle)
            roots = await sb.backend.restore(sb.handle, d, group_name=self.execs._group_name(sb))
        else:
            labels = inherited_labels({**spec.labels, **(labels or {})}, restored_from=checkpoint_id)
            spec = spec.model_copy(update={"labels": labels})
            if backend.restores_at_create:  # a new VM from the checkpoint's memory and disk
                info = await self.life._create(spec, None, t0, restore_from=d)
                sb, roots = self.sandboxes[info.id], []
            else:  # the checkpoint's files stacked as they are (read-only, shared by every restore)
                info = await self.life._create(spec, None, t0, extra_lower=str(d / "fs"))
                sb = self.sandboxes[info.id]
                try:
                    roots = await sb.backend.restore(sb.handle, d, group_name=self.execs._group_name(sb))
                except BaseException:
                    await self.life.stop(info.id)
                    raise
        info = sb.info(self.name)
        info.timings_ms["restore"] = (time.perf_counter() - t0) * 1000
        await self.execs.log_event(
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
        return sb.handle.id_base, self.settings.uid_offset

    async def _frozen_copy(self, sb: Sandbox, dst: Path, cap: int | None) -> None:
        """Copy the writable layer while the sandbox is frozen (a consistent point in time),
        refused before the copy if it holds more than `cap` (holes stay holes)."""
        was_paused = sb.record.state is SandboxState.PAUSED
        if not was_paused:
            await sb.backend.freeze(sb.handle)
        try:
            check_cap("the snapshot", sb.id, sb.handle.disk_usage()[0], cap)
            await copy_tree(self._copy_tool, sb.handle.writable_layer(), dst, self._to_store(sb))
        finally:
            if not was_paused:
                sb.backend.thaw(sb.handle)

    async def _guest_layer(self, sb: Sandbox, stage: Path, cap: int | None) -> None:
        """A writable layer only the guest's kernel reads (a microVM's disk): its backend
        streams it as an OCI layer tar, which is unpacked here like any tarball nothing
        vouches for, its owners shifted into the store's range (ids beyond a container's are
        refused with the path named).

        The tar holds a sparse file's holes as zeros, so the spool is capped before a byte
        lands: at `cap` (what the project's quota has left), at what the disk can hold with
        the headers of every inode (names of up to 4 KiB), and at what the store's file
        system can take twice (the spool, then the layer unpacked from it)."""
        spec = sb.record.spec
        bounds = {"disk": (spec.disk_mb << 20) + spec.disk_inodes * 10240, "store": spool_room(stage.parent)}
        if cap is not None:
            bounds["cap"] = cap
        binding = min(bounds, key=lambda k: bounds[k])
        limit = bounds[binding]
        loop = asyncio.get_running_loop()
        with tempfile.TemporaryFile(dir=stage.parent) as spool:
            try:
                await sb.backend.archive_writable(sb.handle, spool.fileno(), limit)
            except errors.CapacityExhausted:
                if binding == "cap":
                    raise over_cap("the snapshot", sb.id, limit + 1, limit) from None
                if binding == "store":
                    raise errors.CapacityExhausted(
                        f"the snapshot of sandbox {sb.id} needs more than the {limit >> 20} MiB this "
                        f"edge's layer store can take now; retry later, or make the sandbox's files smaller"
                    ) from None
                raise
            spool.seek(0)

            def unpack() -> None:
                unpack_layer_stream(spool, stage, f"the writable layer of sandbox {sb.id}")
                shift_tree(stage, self.settings.uid_offset)

            await loop.run_in_executor(None, unpack)

    async def snapshot(
        self, sandbox_id: str, scrub_paths: builtins.list[str] | None = None, *, max_bytes: int | None = None
    ) -> SnapshotInfo:
        """A snapshot of the sandbox's files (see the module). `max_bytes`: what was reserved
        for it: a copy that would be bigger is refused (quota_exceeded) before it is made."""
        sb = self.life._get(sandbox_id)
        sb.backend.require(Capability.SNAPSHOT, "snapshot")
        if sb.record.extra_lower:
            raise errors.UnsupportedOperation(
                f"sandbox {sandbox_id} is a fork; snapshot the sandbox it was forked from, or fork a snapshot"
            )
        base = self.life._image(sb.record.spec.image)
        n = next(sb.counter)
        version = f"{int(time.time())}-{n}"
        loop = asyncio.get_running_loop()
        with self.layers.staging() as stage:
            if sb.backend.host_files:
                await self._frozen_copy(sb, stage, max_bytes)
            else:
                await self._guest_layer(sb, stage, max_bytes)
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
            config=base.config,  # a restore runs as its source did: env, workdir, user
            source={
                "type": "snapshot",
                "sandbox": sandbox_id,
                "project": sb.record.spec.project,
                "base": base.name,
                "scrubbed": scrubbed,
            },
        )
        self.layers.put_image(image)
        if self._publish is not None:
            try:
                await self._publish(name)  # any edge can restore it
            except errors.DsecError as e:
                log.warning("snapshot %s stays on edge %s only: pushing it failed: %s", name, self.name, e)
        await self.execs.log_event(
            sandbox_id, "snapshot", {"op": "snapshot", "scrub": scrubbed}, {"id": name}
        )
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

    async def delete_snapshot(self, name: str, projects: set[str] | None = None) -> None:
        """Delete snapshot `name` here and its manifest in the registry (checked there too: a
        snapshot of one of `projects`), the registry's first so that no edge pulls it again.
        A snapshot only the registry has (its edge gone) is deleted there."""
        image = self.layers.get_image(name) if self.layers.has_image(name) else None
        if image is not None:
            if image.source.get("type") != "snapshot":
                raise errors.InvalidRequest(f"{name} is not a snapshot")
            if projects is not None and image.source.get("project") not in projects:
                raise errors.ImageNotFound(f"there is no snapshot {name!r} in your projects")
            users = [sb for sb in self.sandboxes.values() if sb.record.spec.image == name]
            if any(sb.record.spec.project != POOL_PROJECT for sb in users):  # (warm stock goes)
                raise errors.Conflict(f"snapshot {name} is in use by live sandboxes; stop them first")
        unpublished = self._unpublish is not None and await self._unpublish(name, projects)
        if image is None:
            if not unpublished:
                raise errors.ImageNotFound(f"there is no snapshot {name!r} on edge {self.name}")
            return
        pooled = self.life.pools.drop(name)
        await asyncio.gather(*(self.life.stop(sid) for sid in pooled))
        self.layers.delete_image(name)
        with contextlib.suppress(errors.DsecError):
            self.layers.delete_layer(image.layers[-1])

    async def _fork_disks(self, sb: Sandbox, n: int, cap: int | None) -> builtins.list[SandboxInfo]:
        """A fork where the writable layer is a disk (a microVM): the backend copies it once
        per child at one consistent point, and each child starts on its copy, its own from
        then on (no shared layer: a disk cannot be stacked). The copies live on the run tmpfs
        (host memory): with the parent frozen, what they take (the disk's allocated bytes
        each, holes stay holes) is refused before the copy over `cap` (what was reserved for
        them all) or what the tmpfs must keep free; each child's `fork_layer` is its own
        copy's size (charged to the project until the child stops)."""
        t0 = time.perf_counter()
        scratch = self.settings.edge_run_dir / "fork-disks"
        scratch.mkdir(mode=0o700, exist_ok=True)
        disks = [scratch / f"{sb.id}-{secrets.token_hex(6)}.img" for _ in range(n)]
        labels = inherited_labels(sb.record.spec.labels, fork_of=sb.id)
        child = sb.record.spec.model_copy(update={"labels": labels})

        def room(disk_bytes: int) -> None:
            check_cap("the fork's disk copies", sb.id, n * disk_bytes, cap)
            check_run_tmpfs_room(scratch, sb.id, n * disk_bytes)

        try:
            await sb.backend.copy_writable_disk(sb.handle, disks, room)
            sizes = [d.stat().st_blocks * 512 for d in disks]
            results = await asyncio.gather(
                *(self.life._create(child, None, t0, writable_from=d) for d in disks), return_exceptions=True
            )
        finally:
            for d in disks:  # moved into the children that started; the rest go
                d.unlink(missing_ok=True)
        infos = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if not isinstance(r, SandboxInfo)]
        if failed:
            await asyncio.gather(*(self.life.stop(i.id) for i in infos), return_exceptions=True)
            raise (
                failed[0] if isinstance(failed[0], errors.DsecError) else errors.InternalError(str(failed[0]))
            )
        for i, size in zip(infos, sizes, strict=True):
            i.fork_layer = ForkLayer(id=i.id, size_bytes=size)
        return infos

    async def fork(
        self, sandbox_id: str, n: int, *, max_layer_bytes: int | None = None
    ) -> builtins.list[SandboxInfo]:
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

        `max_layer_bytes`: what was reserved for the shared layer (its project's quota), or
        for a microVM's disk copies together; a bigger copy is refused (quota_exceeded)
        before anything is copied.
        """
        if not 1 <= n <= 256:
            raise errors.InvalidRequest(f"fork count must be between 1 and 256, got {n}")
        sb = self.life._get(sandbox_id)
        sb.backend.require(Capability.FORK, "fork")
        spec = sb.record.spec
        for _ in range(n):
            self.life._admit(spec)
        if not sb.backend.host_files:
            return await self._fork_disks(sb, n, max_layer_bytes)
        return await self._fork_layers(sb, n, max_layer_bytes)

    async def _fork_layers(self, sb: Sandbox, n: int, cap: int | None) -> builtins.list[SandboxInfo]:
        """The fork of a backend whose writable layer is a directory the host reaches (see
        fork). The layer is measured with the parent frozen and refused before the copy if it
        is over `cap` (what was reserved for it) or the parent's share of the run tmpfs."""
        sandbox_id, spec = sb.id, sb.record.spec
        forks = self._forks_root()
        check_fork_count(forks, sandbox_id)  # before anything is frozen
        t0 = time.perf_counter()
        shared = forks / f"{sandbox_id}-{secrets.token_hex(4)}"
        tree = shared / "tree"
        parent_chain = _chain(sb.record.extra_lower)
        flatten = len(parent_chain) >= MAX_FORK_CHAIN
        chain = ":".join([str(tree), *([] if flatten else parent_chain)])
        was_paused = sb.record.state is SandboxState.PAUSED
        if not was_paused:
            await sb.backend.freeze(sb.handle)
        # What the copy will hold, measured frozen (the upper is a tmpfs of its own): the
        # apiserver charges the project's snapshot quota with it.
        layer_bytes = sb.handle.disk_usage()[0]
        copied: dict[str, float] = {}

        def copy_done(_: object) -> None:
            copied["t"] = time.perf_counter()
            if not was_paused:
                with contextlib.suppress(OSError):
                    sb.backend.thaw(sb.handle)

        copy = None
        ready: asyncio.Future[None] | None = None
        try:
            need = layer_bytes + sum(stacked_bytes(Path(p)) for p in parent_chain if flatten)
            check_fork_room(forks, sandbox_id, need, cap=cap, budget=spec.disk_mb << 20)
            record_fork_layer(shared, need)  # (counted against the parent's share from now on)
            copy = start_copy(
                self._copy_tool,
                sb.handle.writable_layer(),
                tree,
                shift=self._to_store(sb),
                what="copying the writable layer",
            )
            await copy.dirs()
            if flatten:  # merge the parent's chain in before any child starts
                await copy.wait()
                for layer in parent_chain:
                    await copy_tree_under(self._copy_tool, Path(layer), tree)
                layer_bytes = await asyncio.get_running_loop().run_in_executor(None, disk_usage, tree)
                record_fork_layer(shared, layer_bytes)
            ready = asyncio.ensure_future(copy.wait())
            ready.add_done_callback(copy_done)
            labels = inherited_labels(spec.labels, fork_of=sandbox_id)
            child = spec.model_copy(update={"labels": labels})
            results = await asyncio.gather(
                *(
                    self.life._create(child, None, t0, extra_lower=chain, layers_ready=ready)
                    for _ in range(n)
                ),
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
            await asyncio.gather(*(self.life.stop(i.id) for i in infos), return_exceptions=True)
            self._release_fork_layers(chain)
            raise (
                failed[0] if isinstance(failed[0], errors.DsecError) else errors.InternalError(str(failed[0]))
            )
        for i in infos:
            i.timings_ms["fork_copy"] = (copied.get("t", t0) - t0) * 1000
            i.fork_layer = ForkLayer(id=shared.name, size_bytes=layer_bytes)
        await self.execs.log_event(sandbox_id, "fork", {"op": "fork", "n": n}, {"ids": [i.id for i in infos]})
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
