"""The edge's background care: the idle-TTL reaper, re-adoption of sandboxes an earlier edge
process started, and the reconciler that removes what no record claims.

A part of `Edge` (edge.py): what it uses of the rest of the edge is declared at the top of
`EdgeReaper`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.backends.container import (
    Container,
    ContainerBackend,
    mounts_under,
    reap_strays,
    unmount_all,
)
from dsec.config import EdgeSettings
from dsec.edge.sandbox import Sandbox
from dsec.edge.store import EdgeStore, Record
from dsec.isolation.cgroups import CgroupHost
from dsec.models import (
    NetworkPolicy,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)

log = logging.getLogger("dsec.edge")


class EdgeReaper:
    """Reaping, re-adoption and reconciliation (see the module)."""

    # What this part uses of the edge (set by Edge).
    settings: EdgeSettings
    name: str
    cgroups: CgroupHost
    sandboxes: dict[str, Sandbox]
    backend: ContainerBackend | None
    store: EdgeStore | None
    _dirty_active: dict[str, float]
    _terminating: dict[str, asyncio.Task[None]]
    _creating: dict[str, SandboxSpec]

    if TYPE_CHECKING:

        async def _apply_network(self, sb: Sandbox, policy: NetworkPolicy, *, check: bool = True) -> None: ...

        def _open_sandbox(self, record: Record, container: Container) -> Sandbox: ...

        def _watch_exit(self, sb: Sandbox) -> None: ...

        async def pause(self, sandbox_id: str) -> SandboxInfo: ...

        async def stop(self, sandbox_id: str, *, wait: bool = True) -> None: ...

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
