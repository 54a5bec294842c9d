"""What a sandbox did wrong, counted: limit hits (out-of-memory kills, refused forks, a full
disk), timeouts, truncated output, refused system calls and connections, per call and over
the sandbox's life (its telemetry).

A collaborator of `Edge` (edge.py): what it needs is passed to its constructor."""

from __future__ import annotations

from collections import Counter

from dsec.edge.core import EdgeCore, EdgePart
from dsec.edge.process import RawResult
from dsec.edge.sandbox import Sandbox
from dsec.isolation.denials import DeniedSyscalls


class Telemetry(EdgePart):
    """Misbehaviour of one call and telemetry of a sandbox (see the module)."""

    def __init__(self, core: EdgeCore) -> None:
        super().__init__(core)
        self.denials = DeniedSyscalls(self._on_denied_syscall)  # started and closed by the edge

    def counters(self, sb: Sandbox) -> dict[str, int]:
        """The sandbox's telemetry: limit hits since it started and its disk use."""
        out = Counter(self.cgroups.events(sb.id))
        out.update(sb.stats)  # refused forks of finished calls, timeouts, truncations, full disks
        used, inodes, _ = sb.handle.disk_usage()
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

    async def denied_connections(self, sb: Sandbox) -> int:
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

    def _on_denied_syscall(self, sandbox_id: str, syscall: int, comm: str, pid: int) -> None:
        sb = self.sandboxes.get(sandbox_id)
        # (not its init's own: the shim's threads start with clone3, which the profile answers
        # ENOSYS so that libc falls back to clone; native/dsec-landlock.h)
        if sb is not None and pid != sb.handle.pid:
            sb.stats["denied_syscalls"] += 1

    def misbehaviour(self, sb: Sandbox, res: RawResult, denied_before: int = 0) -> dict[str, int]:
        """Limit hits during one call, for its result and the trajectory. Forks refused in
        the call's own cgroup and a full disk count whatever its exit status (a program may
        catch EAGAIN or ENOSPC and carry on); the sandbox's kernel counters are read only
        when the call did not succeed (a clean exit leaves them alone, save a background
        process's misfortune, which the next failed call or GET reports)."""
        if res.timed_out:
            sb.stats["timeouts"] += 1
        if res.truncated:
            sb.stats["output_truncated"] += 1
        self.denials.drain()  # the kernel logged this call's denials already: count them now
        denied = sb.stats["denied_syscalls"] - denied_before
        out: dict[str, int] = {"denied_syscalls": denied} if denied else {}
        if res.pids_limit_hits:
            sb.stats["pids_limit_hits"] += res.pids_limit_hits
            out["pids_limit_hits"] = res.pids_limit_hits
        # The file system's own answer, read at the end of every call (a statvfs, ~2 us): full
        # now, and not at the end of the last one. The kernel counts no ENOSPC it returns, so a
        # call that fills the disk and frees it again before it ends is not seen.
        full = sb.handle.disk_usage()[2]
        if full and not sb.disk_was_full:
            sb.stats["disk_full"] += 1
            out["disk_full"] = 1
        sb.disk_was_full = full  # freed since? then the next fill counts again
        if res.exit_code == 0 and not res.timed_out:
            return out
        now = self.cgroups.events(sb.id)
        for k, v in now.items():
            if v > sb.seen_events.get(k, 0):
                out[k] = out.get(k, 0) + v - sb.seen_events.get(k, 0)
        sb.seen_events.update(now)
        return out
