"""The edge's background care: the idle-TTL reaper, re-adoption of sandboxes an earlier edge
process started, and the reconciler that removes what no record claims.

A collaborator of `Edge` (edge.py): what it needs of the rest of the edge is passed to its
constructor."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from pathlib import Path

from dsec.backends import registry
from dsec.backends.base import Backend
from dsec.edge.core import EdgeCore, EdgePart
from dsec.edge.lifecycle import EdgeLifecycle
from dsec.edge.sandbox import Sandbox
from dsec.isolation.procs import (
    reap_strays,
    unmount_all,
)
from dsec.models import SandboxState

log = logging.getLogger("dsec.edge")


class EdgeReaper(EdgePart):
    """Reaping, re-adoption and reconciliation (see the module)."""

    def __init__(self, core: EdgeCore, *, life: EdgeLifecycle) -> None:
        super().__init__(core)
        self.life = life  # what is in progress; re-opening, pausing and stopping sandboxes

    # --- reaping, re-adoption, reconciliation ----------------------------------------

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                reap_strays()  # runtime processes exited since the last create
                await self.reap_idle()
                if self.store is not None and self._dirty_active:
                    dirty = dict(self._dirty_active)
                    self._dirty_active.clear()
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
            await (self.life.pause(sb.id) if sb.record.spec.ttl_action == "pause" else self.life.stop(sb.id))

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
        assert self.store is not None
        for rec in self.store.all():
            handle = None
            backend = self.backends.get(rec.spec.backend)
            if backend is None:
                log.warning(
                    "sandbox %s runs on backend %s, which this edge does not start", rec.id, rec.spec.backend
                )
            elif rec.pid is not None and rec.start_time is not None:
                paused = rec.state is SandboxState.PAUSED
                handle = await backend.adopt(rec.id, rec.pid, rec.start_time, paused=paused)
            if backend is None or handle is None:
                log.info("reaping sandbox %s: it did not survive the edge restart", rec.id)
                self.store.delete(rec.id)
                continue
            try:
                sb = self.life._open_sandbox(rec, backend, handle)
            except Exception:
                await backend.destroy(handle)
                self.store.delete(rec.id)
                continue
            self.sandboxes[rec.id] = sb
            with contextlib.suppress(OSError):  # a trusted exec the last edge process left running
                self.cgroups.end_trusted(rec.id)  # (its result had nobody to go to), the agent thawed
            if rec.spec.network is not None:
                try:
                    await self.life._apply_network(sb, rec.spec.network, check=False, resolv=False)
                except Exception:
                    log.exception("re-applying the network policy of %s failed", rec.id)
            self.life._watch_exit(sb)

    async def reconcile(self) -> dict[str, int]:
        """Remove host resources of this edge that no live sandbox claims."""
        known = set(self.sandboxes) | self.life.in_progress()
        mine = f"{self.name}-"
        orphans: dict[str, Backend] = {}
        for backend in self.backends.values():
            orphans.update(dict.fromkeys(backend.leftover_ids() - known, backend))
        default = self.backends.get(registry.DEFAULT) or next(iter(self.backends.values()), None)
        for c in self.cgroups.listed_sandboxes():  # a cgroup is every backend's; the default removes it
            if default is not None and c.startswith(mine) and c not in known:
                orphans.setdefault(c, default)
        for sid, backend in orphans.items():
            log.info("reconciler: removing orphan %s", sid)
            await backend.remove_orphan(sid)
        stray = [m for b in self.backends.values() for m in b.stray_mounts(known)]
        for m in sorted(stray, key=len, reverse=True):
            if Path(m) != self.settings.edge_run_dir / "forks":
                unmount_all(Path(m))
        return {"sandboxes": len(orphans), "mounts": len(stray)}
