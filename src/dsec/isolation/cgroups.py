"""cgroups for sandboxes and for single execs, on v1 (incl. hybrid) and v2 hosts.

The OCI runtime creates and limits a sandbox's cgroup (``/dsec/<sandbox>``).
Here we add what the runtime does not do: a child cgroup per exec or session,
so that a timeout can kill a whole process tree, even processes that called
setsid() or were reparented; the freezer of the user's processes alone (not the
init), which a trusted exec holds; and the trusted exec's own cgroup
(``/dsec-trusted/<sandbox>/<exec>``), outside the sandbox's, so that what the
user's processes hold (memory, pids) is not taken from it. Every host path comes
from :class:`CgroupHost` so that the logic runs on a fake tree in unit tests.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dsec.isolation import linux

PARENT = "dsec"
# Every process started on request lives under <sandbox>/dsec-user, limited to the
# sandbox's `pids`; the sandbox itself gets PID_RESERVE more, so its init can still
# start an exec (say, `kill -9 -1`) when something inside forks without end.
USER_GROUP = "dsec-user"
PID_RESERVE = 16
# Trusted execs (dsec.edge.trusted) run in <hierarchy>/dsec-trusted/<sandbox>/<exec>.
TRUSTED_PARENT = "dsec-trusted"
# v1: the hierarchies where a trusted exec has a group of its own (what the user's processes
# can hold on to); in the others it joins the sandbox's group.
_TRUSTED_OWN_V1 = ("memory", "pids")
_TRUSTED_CONTROLLERS = "+memory +pids +cpu"
# v1 hierarchies the runtime populates for a sandbox; we track execs in pids.
# the v1 hierarchies a host process of a sandbox joins (create_for_process)
_HOST_PROCESS_V1 = ("memory", "cpu", "cpuacct", "pids", "freezer")
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "cpuset", "pids", "freezer", "blkio", "devices", "systemd")


@dataclass(frozen=True)
class CgroupHost:
    """How this host mounts cgroups."""

    root: Path = Path("/sys/fs/cgroup")
    version: int = 2
    hybrid: bool = False
    v1_mounts: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def detect(
        cls, root: Path = Path("/sys/fs/cgroup"), mounts: Path = Path("/proc/self/mounts")
    ) -> CgroupHost:
        v1: dict[str, Path] = {}
        unified = False
        for line in mounts.read_text().splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            target, fstype, opts = Path(parts[1]), parts[2], parts[3].split(",")
            if target == root and fstype == "cgroup2":
                unified = True
            elif fstype == "cgroup" and target.parent == root:
                for opt in opts:
                    name = opt.removeprefix("name=")
                    if name in V1_CONTROLLERS:
                        v1[name] = target
        if unified:
            return cls(root=root, version=2)
        hybrid = (root / "unified" / "cgroup.controllers").exists()
        return cls(root=root, version=1, hybrid=hybrid, v1_mounts=v1)

    def favor_dynamic_changes(self) -> bool:
        """Remount the cgroup2 hierarchy with `favordynmods` (kernel >= 6.0).

        Moving a process into a cgroup takes a global percpu rwsem for writing, which
        waits for an RCU grace period unless one passed just before: the first exec
        or create after an idle moment cost ~10 ms here, 1-2 ms with this option.
        The price is a slightly slower fork/exit host-wide; it is a host tuning
        that outlives the edge (like a sysctl), not a resource to clean up.
        """
        target = self.root if self.version == 2 else self.root / "unified"
        if not (target / "cgroup.procs").exists():
            return False
        try:
            linux.mount("cgroup2", str(target), "cgroup2", linux.MS_REMOUNT, "favordynmods")
        except OSError:
            return False
        return True

    def sandbox_path(self, sandbox_id: str) -> str:
        """The OCI `cgroupsPath`: always set, or crun creates groups at the root."""
        return f"/{PARENT}/{sandbox_id}"

    def tracking_dir(self, sandbox_id: str) -> Path:
        """The cgroup whose cgroup.procs lists every process of the sandbox."""
        if self.version == 2:
            return self.root / PARENT / sandbox_id
        return self.v1_mounts.get("pids", self.root / "pids") / PARENT / sandbox_id

    def hierarchies(self) -> list[Path]:
        return [self.root] if self.version == 2 else list(self.v1_mounts.values())

    def sandbox_dirs(self, sandbox_id: str) -> list[Path]:
        return [h / PARENT / sandbox_id for h in self.hierarchies()]

    def listed_sandboxes(self) -> set[str]:
        """Sandbox ids that have a cgroup in any hierarchy (for the reconciler)."""
        out: set[str] = set()
        for h in self.hierarchies():
            for parent in (PARENT, TRUSTED_PARENT):
                with contextlib.suppress(FileNotFoundError):
                    out.update(p.name for p in (h / parent).iterdir() if p.is_dir())
        return out

    # --- sandbox-level --------------------------------------------------------

    def procs(self, sandbox_id: str) -> list[int]:
        return read_procs(self.tracking_dir(sandbox_id))

    def events(self, sandbox_id: str) -> dict[str, int]:
        """Kernel-counted limit hits of a sandbox: OOM kills (memory) and refused forks
        (pids, at the user group that holds the limit and at the sandbox's own)."""
        out = {"oom_kills": 0, "pids_limit_hits": 0}
        if self.version == 2:
            base = self.root / PARENT / sandbox_id
            out["oom_kills"] = keyed_value(base / "memory.events", "oom_kill")
            out["pids_limit_hits"] = keyed_value(base / "pids.events", "max")
            return out
        mem = self.v1_mounts.get("memory", self.root / "memory") / PARENT / sandbox_id
        out["oom_kills"] = keyed_value(mem / "memory.oom_control", "oom_kill")
        pids = self.tracking_dir(sandbox_id)
        out["pids_limit_hits"] = keyed_value(pids / "pids.events", "max") + keyed_value(
            pids / USER_GROUP / "pids.events", "max"
        )
        return out

    def memory_bytes(self, sandbox_id: str) -> int | None:
        if self.version == 2:
            f = self.root / PARENT / sandbox_id / "memory.current"
        else:
            f = (
                self.v1_mounts.get("memory", self.root / "memory")
                / PARENT
                / sandbox_id
                / "memory.usage_in_bytes"
            )
        try:
            return int(f.read_text())
        except (OSError, ValueError):
            return None

    def usage(self, sandbox_id: str) -> dict[str, int]:
        """What the sandbox uses now, read-only from its cgroup: memory_bytes (charged memory,
        page cache included), memory_peak_bytes (the most it held since it started; v2 needs
        memory.peak, kernel >= 5.19) and cpu_usec (CPU time of all its processes). A value the
        host does not count is left out."""
        out: dict[str, int] = {}
        current = self.memory_bytes(sandbox_id)
        if current is not None:
            out["memory_bytes"] = current
        if self.version == 2:
            base = self.root / PARENT / sandbox_id
            peak = _read_int(base / "memory.peak")
            cpu_usec = keyed_value(base / "cpu.stat", "usage_usec") if (base / "cpu.stat").exists() else None
        else:
            mem = self.v1_mounts.get("memory", self.root / "memory") / PARENT / sandbox_id
            peak = _read_int(mem / "memory.max_usage_in_bytes")
            acct = self.v1_mounts.get("cpuacct", self.root / "cpuacct") / PARENT / sandbox_id
            ns = _read_int(acct / "cpuacct.usage")
            cpu_usec = None if ns is None else ns // 1000
        if peak is not None:
            out["memory_peak_bytes"] = peak
        if cpu_usec is not None:
            out["cpu_usec"] = cpu_usec
        return out

    def remove_sandbox(self, sandbox_id: str) -> None:
        """Kill what is left and remove every cgroup of the sandbox (leaf first), its trusted
        execs' too."""
        self.end_trusted(sandbox_id)  # (thaws too: on v1 a frozen task takes SIGKILL only once thawed)
        for d in self.sandbox_dirs(sandbox_id):
            remove_tree(d)

    def end_trusted(self, sandbox_id: str) -> None:
        """Kill and remove what trusted execs of the sandbox left (an edge that died during
        one), and thaw its user's processes they had frozen."""
        for h in self.hierarchies():
            remove_tree(h / TRUSTED_PARENT / sandbox_id)
        self.thaw_user(sandbox_id)

    # --- pause / resume ---------------------------------------------------------

    def _freezer(self, sandbox_id: str) -> tuple[Path, str, str]:
        if self.version == 2:
            return self.root / PARENT / sandbox_id / "cgroup.freeze", "1", "0"
        return (
            self.v1_mounts.get("freezer", self.root / "freezer") / PARENT / sandbox_id / "freezer.state",
            "FROZEN",
            "THAWED",
        )

    def freeze(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        """Stop every process of the sandbox (the kernel's freezer) and wait until it holds."""
        path, frozen, _ = self._freezer(sandbox_id)
        path.write_text(frozen)
        end = time.monotonic() + timeout_s
        while not self.is_frozen(sandbox_id):
            if time.monotonic() > end:
                raise TimeoutError(f"sandbox {sandbox_id} did not freeze within {timeout_s} s")
            time.sleep(0.001)

    def is_frozen(self, sandbox_id: str) -> bool:
        path, frozen, _ = self._freezer(sandbox_id)
        if self.version == 2:
            events = (path.parent / "cgroup.events").read_text()
            return "frozen 1" in events
        return path.read_text().strip() == frozen

    def thaw(self, sandbox_id: str) -> None:
        path, _, thawed = self._freezer(sandbox_id)
        path.write_text(thawed)

    def reclaim(self, sandbox_id: str) -> None:
        """Give back what memory the kernel can take from a (frozen) sandbox: page cache
        at least; anonymous memory only where swap exists."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                (self.root / PARENT / sandbox_id / "memory.reclaim").write_text(str(1 << 40))
            return
        with contextlib.suppress(OSError):  # EBUSY when something could not be reclaimed
            (
                self.v1_mounts.get("memory", self.root / "memory")
                / PARENT
                / sandbox_id
                / "memory.force_empty"
            ).write_text("0")

    def remove_parent_if_empty(self) -> None:
        for h in self.hierarchies():
            for parent in (PARENT, TRUSTED_PARENT):
                with contextlib.suppress(OSError):
                    (h / parent).rmdir()

    # --- the user's processes frozen (while a trusted exec runs) ------------------------

    def user_freezer(self, sandbox_id: str) -> Path:
        """The cgroup that freezes the user's processes and not the init: dsec-user (v2), the
        freezer hierarchy's dsec-user (v1), which every exec's process joins at its start."""
        if self.version == 2:
            return self.user_dir(sandbox_id)
        return self.v1_mounts.get("freezer", self.root / "freezer") / PARENT / sandbox_id / USER_GROUP

    def freeze_user(self, sandbox_id: str) -> None:
        """Start freezing the user's processes (user_frozen says when it holds). New ones
        are frozen as they join (a spawn then waits for the thaw)."""
        d = self.user_freezer(sandbox_id)
        if self.version == 2:
            (d / "cgroup.freeze").write_text("1")
            return
        d.mkdir(exist_ok=True)
        self._gather_user(sandbox_id)
        (d / "freezer.state").write_text("FROZEN")

    def user_frozen(self, sandbox_id: str) -> bool:
        """Whether every process of the user is frozen now. v1: one started before its exec
        joined the freezer group (an older edge's, a restored one) is moved in, and the
        answer is no until it is frozen there too."""
        d = self.user_freezer(sandbox_id)
        if self.version == 2:
            return b"frozen 1" in _read_bytes(d / "cgroup.events")
        if _read_bytes(d / "freezer.state").strip() != b"FROZEN":
            return False
        return self._gather_user(sandbox_id) == 0

    def _gather_user(self, sandbox_id: str) -> int:
        """v1: move the user's processes (the pids hierarchy's dsec-user tree, read first) that
        are not in the freezer group into it; how many were not. A process that is not can
        only have been forked by one that is not either, which the first read holds: none is
        missed."""
        procs = _tree_procs(self.user_dir(sandbox_id))
        d = self.user_freezer(sandbox_id)
        have = set(read_procs(d))
        outside = 0
        for pid in procs:
            if pid not in have:
                try:
                    (d / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:
                    continue  # gone meanwhile
                outside += 1
        return outside

    def thaw_user(self, sandbox_id: str) -> None:
        d = self.user_freezer(sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            if self.version == 2:
                (d / "cgroup.freeze").write_text("0")
            else:
                (d / "freezer.state").write_text("THAWED")

    def user_dir(self, sandbox_id: str) -> Path:
        return self.tracking_dir(sandbox_id) / USER_GROUP

    def setup_user_group(self, sandbox_id: str, pids: int) -> None:
        """Create the parent of all exec cgroups, holding the user's pids limit.

        On v2 the limit stays on the sandbox's cgroup only: enabling the pids
        controller below it would need the init out of that cgroup.
        """
        d = self.user_dir(sandbox_id)
        d.mkdir(exist_ok=True)
        if self.version == 1:
            (d / "pids.max").write_text(str(pids))
            with contextlib.suppress(FileNotFoundError):  # no freezer hierarchy
                self.user_freezer(sandbox_id).mkdir(exist_ok=True)

    def create_for_process(self, sandbox_id: str, *, cpu: float, memory_bytes: int, pids: int) -> None:
        """The cgroups of a sandbox whose processes the edge starts itself (not an OCI
        runtime): a microVM's QEMU. Limits on the sandbox's group; join() puts a process in."""
        if self.version == 2:
            d = self.root / PARENT / sandbox_id
            d.mkdir(parents=True)
            _limit_v2(d, cpu, memory_bytes, pids)
            return
        for name in _HOST_PROCESS_V1:
            if name in self.v1_mounts:
                (self.v1_mounts[name] / PARENT / sandbox_id).mkdir(parents=True, exist_ok=True)
        dirs = {n: self.v1_mounts[n] / PARENT / sandbox_id for n in ("memory", "cpu", "pids")}
        _limit_v1(dirs, cpu, memory_bytes, pids)

    def create_limited(self, path: str, *, cpu: float, memory_bytes: int, pids: int) -> list[Path]:
        """A group `path` (relative, e.g. "dsec-build/<id>") with these limits in every
        hierarchy that has them; its directories, whose cgroup.procs a process writes itself
        into (an image build: dsec.isolation.buildns). remove_tree() each to end it."""
        if self.version == 2:
            d = self.root / path
            d.mkdir(parents=True)
            _limit_v2(d, cpu, memory_bytes, pids)
            return [d]
        dirs = {n: self.v1_mounts[n] / path for n in _HOST_PROCESS_V1 if n in self.v1_mounts}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        _limit_v1(dirs, cpu, memory_bytes, pids)
        return list(dirs.values())

    def join(self, sandbox_id: str, pid: int) -> None:
        """Move host process `pid` into the sandbox's cgroups (see create_for_process)."""
        dirs = (
            [self.root / PARENT / sandbox_id]
            if self.version == 2
            else [self.v1_mounts[n] / PARENT / sandbox_id for n in _HOST_PROCESS_V1 if n in self.v1_mounts]
        )
        for d in dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def open_exec_group(self, sandbox_id: str, name: str) -> ExecGroup:
        d = self.user_dir(sandbox_id) / name
        d.mkdir()
        try:
            fd = os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            d.rmdir()
            raise
        group = ExecGroup(d, fd, self.version)
        if self.version == 1:  # and the user's freezer group, so a trusted exec's freeze holds it
            with contextlib.suppress(FileNotFoundError):  # (no freezer hierarchy here)
                group.join_fds.append(_open_procs(self.user_freezer(sandbox_id)))
        return group

    def open_trusted_group(
        self, sandbox_id: str, name: str, *, cpu: float, memory_bytes: int, pids: int
    ) -> ExecGroup:
        """The cgroups of one trusted exec: a group of its own with the sandbox's limits,
        outside the sandbox's (what the user's processes hold is not taken from it) and outside
        dsec-user (frozen meanwhile); v1: the sandbox's own in the other hierarchies (cpu,
        devices, freezer, ...). `path` is the group that tracks its processes (pids)."""
        if self.version == 2:
            own = {"pids": self.root / TRUSTED_PARENT / sandbox_id / name}
        else:
            own = {n: self.v1_mounts[n] / TRUSTED_PARENT / sandbox_id / name for n in _TRUSTED_OWN_V1}
        made: list[Path] = []
        group = None
        try:
            for d in own.values():
                if self.version == 2:
                    for parent in (d.parent.parent, d.parent):  # controllers for the groups below
                        parent.mkdir(exist_ok=True)
                        _enable_controllers(parent)
                else:
                    d.parent.mkdir(parents=True, exist_ok=True)
                d.mkdir()
                made.append(d)
            if self.version == 2:
                _limit_v2(own["pids"], cpu, memory_bytes, pids)
            else:
                _limit_v1(own, None, memory_bytes, pids)
            group = ExecGroup(own["pids"], _open_procs(own["pids"]), self.version)
            group.own = made
            for n, d in own.items():
                if n != "pids":
                    group.join_fds.append(_open_procs(d))
            for n, h in self.v1_mounts.items() if self.version == 1 else ():
                if n not in _TRUSTED_OWN_V1 and (h / PARENT / sandbox_id).is_dir():
                    group.join_fds.append(_open_procs(h / PARENT / sandbox_id))
        except BaseException:
            if group is not None:
                group.close_fd()
            for d in made:
                remove_tree(d)
            raise
        return group


class ExecGroup:
    """A child cgroup holding one exec or session and all its descendants."""

    def __init__(self, path: Path, procs_fd: int, version: int) -> None:
        self.path = path
        self.procs_fd = procs_fd
        self.version = version
        self.join_fds: list[int] = []  # cgroup.procs of the other groups its process joins
        self.own: list[Path] = []  # groups removed with it besides `path` (a trusted exec's)

    def fds(self) -> list[int]:
        """Every cgroup.procs its process joins (the shim's child writes "0" to each)."""
        return [fd for fd in (self.procs_fd, *self.join_fds) if fd >= 0]

    def bind(self, ident: int) -> None:
        """Told the shim's id of the process started in it (a cgroup needs nothing more)."""

    def close_fd(self) -> None:
        for fd in self.fds():
            os.close(fd)
        self.procs_fd = -1
        self.join_fds = []

    def procs(self) -> list[int]:
        return read_procs(self.path)

    def kill(self) -> None:
        kill_group(self.path, self.version)

    def remove(self) -> None:
        self.close_fd()
        for d in dict.fromkeys([self.path, *self.own]):
            remove_tree(d)


def _open_procs(d: Path) -> int:
    return os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)


def _enable_controllers(d: Path) -> None:
    """Let the groups below `d` have memory, pids and cpu limits (v2); each one the host has."""
    try:
        (d / "cgroup.subtree_control").write_text(_TRUSTED_CONTROLLERS)
    except OSError:
        for c in _TRUSTED_CONTROLLERS.split():
            with contextlib.suppress(OSError):
                (d / "cgroup.subtree_control").write_text(c)


def _limit_v2(d: Path, cpu: float, memory_bytes: int, pids: int) -> None:
    (d / "memory.max").write_text(str(memory_bytes))
    with contextlib.suppress(OSError):  # no swap accounting: nothing to limit
        (d / "memory.swap.max").write_text("0")
    (d / "cpu.max").write_text(f"{max(1000, int(cpu * 100000))} 100000")
    (d / "pids.max").write_text(str(pids))


def _limit_v1(dirs: dict[str, Path], cpu: float | None, memory_bytes: int, pids: int) -> None:
    """The limits on v1 groups by hierarchy (memory, pids; cpu unless None)."""
    mem = dirs["memory"]
    (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
    with contextlib.suppress(OSError):  # no swap accounting: nothing to limit
        (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
    if cpu is not None:
        (dirs["cpu"] / "cpu.cfs_period_us").write_text("100000")
        (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpu * 100000))))
    (dirs["pids"] / "pids.max").write_text(str(pids))


def _read_bytes(f: Path) -> bytes:
    try:
        return f.read_bytes()
    except FileNotFoundError:
        return b""


def read_procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return []


def sigkill_each(pids: Iterable[int]) -> None:
    """SIGKILL these processes; one already gone is no error."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_group(d: Path, version: int, deadline_s: float = 5.0) -> None:
    """SIGKILL every process in cgroup `d` and its children, racing forks safely."""
    if version == 2 and (d / "cgroup.kill").exists():
        with contextlib.suppress(FileNotFoundError):
            (d / "cgroup.kill").write_text("1")
        return
    # v1: forbid new forks first, so the kill loop converges.
    with contextlib.suppress(OSError):
        (d / "pids.max").write_text("0")
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = _tree_procs(d)
        if not pids:
            return
        sigkill_each(pids)
        time.sleep(0.001)


def _read_int(f: Path) -> int | None:
    """A one-number cgroup file; None if it is absent or not a number."""
    try:
        return int(f.read_text())
    except (OSError, ValueError):
        return None


def keyed_value(f: Path | str, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file (`key value` lines); 0 if absent.
    (A raw read: it runs after every exec, and Path.read_text costs ~3x as much.)"""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 65536)
        finally:
            os.close(fd)
        want = key.encode()
        for line in data.split(b"\n"):
            k, _, v = line.partition(b" ")
            if k == want:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _subgroups(d: Path) -> list[Path]:
    """Child cgroups (directories: d_type from the directory read, no stat of each of the
    ~30 control files a v1 cgroup holds)."""
    with os.scandir(d) as it:
        return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]


def _tree_procs(d: Path) -> list[int]:
    out = read_procs(d)
    with contextlib.suppress(FileNotFoundError):
        for sub in _subgroups(d):
            out.extend(_tree_procs(sub))
    return out


def remove_tree(d: Path) -> None:
    """rmdir a cgroup and its children, killing what still lives in them."""
    try:
        subs = _subgroups(d)
    except FileNotFoundError:
        return
    for sub in subs:
        remove_tree(sub)
    for attempt in range(200):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            sigkill_each(read_procs(d))
            time.sleep(0.001 * min(attempt + 1, 20))
    d.rmdir()
