"""The gVisor backend: runsc (a user-space kernel, the sentry) over the same composed layers.

A gVisor sandbox is a container sandbox whose processes run on gVisor's kernel instead of
the host's. What it shares with the container backend: the per-sandbox id range, the
tmpfs writable layer and the idmapped layers under an overlay (mounted by the shim's
launcher in a mount namespace of its own), the OCI config, the shim as init and its
protocol, snapshots and forks from the writable layer, network policy in the sandbox's
network namespace. What differs, host by host (docs/research/gvisor-runsc.md):

    create:  `dsec-shim runsc-keep` (the keeper) mounts the layers like crun-wrap, makes a
             network namespace, starts `runsc run --detach` with the shim's end of the
             control socket at fd 3 and stays: it holds the edge's end (fd 4) and the
             writable layer (fd 5), reaps the sentry and the gofer, and exits with them.
             `handle.pid` is the keeper: its pidfd says when the sandbox is gone, its
             fds are what an edge that restarts takes back, its namespaces are the
             sandbox's mounts (the file API reaches the root through
             /proc/<keeper>/root/<bundle>/rootfs) and network (--network=host in it).
    exec:    the shim's protocol; each exec at a level of its own (a PID namespace, its
             /proc, a holder as its PID 1 that starts it: native/dsec-levels.h, dsec-gvisor.h);
             no host cgroup per exec (sandbox processes are not host processes): a timed-out
             exec's level is killed through the shim. The init keeps CAP_SYS_ADMIN (it makes
             the levels) and has no seccomp filter; each holder installs the profile on
             itself (`gvisor_rules`, sent to the init before its first ping).
    limits:  memory and cpu in the host cgroup of the sentry (an overrun ends the whole
             sandbox); the process limit as RLIMIT_NPROC inside (a host pids limit would
             crash the sentry when reached), the host's kept well above it.
    pause:   the host freezer on the sentry's cgroup (no runsc command runs while frozen).
    destroy: SIGKILL the keeper's children (the sentry and the gofer), `runsc delete`.

Not supported (each answers `unsupported_operation`):
- memory checkpoints: runsc cannot restore a sandbox whose processes hold host descriptors,
  and the shim's control socket is one;
- trusted execs, verify and protected paths: they join the sandbox's namespaces as host
  processes, and a gVisor sandbox's processes are not host processes;
- sessions: gVisor's /proc ignores the non-dumpable flag (another process of the sandbox can
  reopen a process's pipes through /proc/<pid>/fd), so a session run's output and state
  could be written by something else than the run;
- telemetry: forks refused and per-call OOM kills happen inside gVisor, where no host
  cgroup counts them (an OOM of the whole sandbox is reported as its failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.aio import wait_for
from dsec.backends.base import (
    BackendHost,
    BackendUnavailable,
    Capability,
    ChannelGroup,
    SandboxHandle,
    SandboxPlan,
)
from dsec.backends.container import Container, ContainerBackend
from dsec.backends.runsc import PLATFORMS, RunscUnavailable, find_runsc, probe_platforms
from dsec.errors import InternalError, InvalidRequest
from dsec.isolation.cgroups import CgroupHost, ExecGroup, sigkill_each
from dsec.isolation.procs import (
    _awaited,
    children_of,
    resolve_once,
    run_process_quick,
    spawn_quick,
    wait_quick,
)
from dsec.isolation.seccomp import Rule, bpf_program, default_rules
from dsec.isolation.spec import _mount

log = logging.getLogger("dsec.backends.gvisor")

READY_TIMEOUT_S = 30.0
F_SETSIG = 10
KEEP_BAD_TMP = 3  # the keeper's exit status: the rootfs's /tmp is no directory (dsec-shim.c)


def gvisor_rules() -> tuple[Rule, ...]:
    """The container profile as gVisor's sandboxes get it. syslog: gVisor's own log. The ENOSYS
    rules (clone3, so libc falls back to clone): the sentry answers them EPERM, which breaks
    every thread start; it implements what it implements, inside gVisor. gVisor gives PID 1 (a
    level's holder, to the processes of its level) no init protection: the shim ignores every
    catchable signal, and these rules keep the rest (SIGKILL, SIGSTOP) and its scheduling away
    from it; its limits are the profile's prlimit64 rule, on every backend. A signal on I/O
    readiness (fcntl F_SETSIG) could name SIGKILL for an owner that is PID 1: refused (SIGIO,
    the default, is ignored)."""
    keep = [r for r in default_rules() if r.syscall != "syslog" and r.action != "enosys"]
    pid1 = (
        "kill",
        "tkill",
        "tgkill",
        "rt_sigqueueinfo",
        "rt_tgsigqueueinfo",
        "pidfd_open",
        "sched_setaffinity",
        "sched_setscheduler",
        "sched_setparam",
        "migrate_pages",
        "move_pages",
    )
    why = "PID 1 (gVisor gives it no init protection)"
    return (
        *keep,
        *(Rule("eperm", name, 0, "eq", 1, why=why) for name in pid1),
        Rule("eperm", "fcntl", 1, "eq", F_SETSIG, why="F_SETSIG: a chosen signal on I/O readiness"),
    )


@dataclass
class GvisorSandbox(Container):
    """A sandbox of the gVisor backend; `pid` is its keeper (see the module's docstring)."""

    def exit_reason(self) -> str:
        if self.exit_status is None or self.exit_status == (os.CLD_EXITED, 0):
            return "its sentry exited (its init ended, or it was killed: out of memory, say)"
        return super().exit_reason().replace("its init", "its keeper")

    @property
    def rootfs(self) -> Path:
        return Path(f"/proc/{self.pid}/root{self.dir}/rootfs")

    def seccomp_program(self) -> Path | None:
        return None  # the profile is installed inside gVisor, by each exec level's holder

    def exec_group(self, cgroups: CgroupHost, name: str) -> ExecGroup:
        return ChannelGroup(self.channel, repeats=20)  # the shim signals the exec's session


class GvisorBackend(ContainerBackend):
    """Creates, adopts and destroys gVisor sandboxes on this node."""

    name = "gvisor"
    capabilities = frozenset(
        {Capability.EXEC, Capability.FILES, Capability.PAUSE, Capability.SNAPSHOT, Capability.FORK}
        | {Capability.NETWORK, Capability.SESSIONS, Capability.TRUSTED_EXEC}
    )
    trusted_in_fresh_sandbox = True  # its processes are the sentry's, not the host's
    dir_name = "gvisor"
    handle_class = GvisorSandbox
    stray_comms = frozenset({"runsc", "exe", "runsc-sandbox", "runsc-gofer"})

    def __init__(self, host: BackendHost) -> None:
        if host.runsc_root is None:
            raise BackendUnavailable("no runsc directory configured")
        try:
            binary = find_runsc(host.runsc_root)
        except RunscUnavailable as e:
            raise BackendUnavailable(str(e)) from e
        super().__init__(host)
        _traversable(self.sandboxes_dir, own=host.run_dir)
        if self.tools_dir is not None:
            self.tools_dir = _readable_tools(self.tools_dir, host.run_dir / "tools-gvisor")
        self.runtime = str(binary)
        self.runtime_root = host.run_dir / "runsc"
        self.runtime_root.mkdir(parents=True, exist_ok=True)
        works = probe_platforms(binary, host.runsc_root / "probe")  # host-wide, once per kernel
        if not works:
            raise BackendUnavailable(f"runsc runs on none of the platforms {', '.join(PLATFORMS)} here")
        self.platforms = works
        self.platform = works[0]
        self.seccomp = bpf_program(gvisor_rules())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "detail": {"platform": self.platform, "platforms": self.platforms}}

    def _flags(self) -> list[str]:
        """runsc keeps no flags in its state: every command repeats them."""
        return [
            "--root",
            str(self.runtime_root),
            f"--platform={self.platform}",
            "--network=host",  # the host kernel's stack in the sandbox's own namespace (the keeper's)
            "--overlay2=none",  # writes reach the writable layer (snapshots, forks)
            "--file-access=shared",  # and the edge's own writes (uploads) reach the sandbox
        ]  # (no --oci-seccomp: each exec level's holder installs the profile, see _config)

    # --- create ---------------------------------------------------------------

    def _config(self, d: Path, plan: SandboxPlan, base: int) -> None:
        config = self._base_config(plan, base)
        config["process"]["args"] = ["/.dsec/shim", "init", "gvisor"]  # (PID 1 ignores what it can)
        linux = config["linux"]
        # The keeper made the network namespace: the sentry stays in it.
        linux["namespaces"] = [n for n in linux["namespaces"] if n["type"] != "network"]
        # A host pids limit counts the sentry's threads and stubs, and reaching it crashes the
        # sentry: the user's limit is RLIMIT_NPROC inside, the host's far above it.
        linux["resources"]["pids"] = {"limit": 4 * plan.limits.pids + 64}
        # (soft: the user's; hard: with the platform's reserve, which the shim keeps for itself)
        nproc = {"type": "RLIMIT_NPROC", "hard": plan.limits.pids, "soft": plan.pids}
        config["process"]["rlimits"].append(nproc)
        # The kernel log inside is gVisor's own (no host message can reach it): let dmesg read it.
        # The init also makes each exec level's PID and mount namespace and mounts its /proc
        # (native/dsec-levels.h): CAP_SYS_ADMIN, and CAP_SETPCAP to take both out of the
        # bounding set of each level's holder, which starts the execs (dsec-gvisor.h).
        caps = config["process"]["capabilities"]  # (lists shared with the spec's defaults: copied)
        init_only = ["CAP_SYS_ADMIN", "CAP_SETPCAP"]
        config["process"]["capabilities"] = {k: [*v, "CAP_SYSLOG", *init_only] for k, v in caps.items()}
        # The profile is installed by each holder on itself (the init needs what it refuses:
        # namespaces, mount), so it holds for every exec and nothing the init starts escapes it.
        del linux["seccomp"]
        mounts = [m for m in config["mounts"] if m["type"] != "mqueue"]
        # runsc mounts a tmpfs of its own on an image's empty /tmp, whose files would be
        # outside the writable layer: bind the overlay's own /tmp instead.
        mounts.append(_mount("/tmp", "bind", f"{d}/rootfs/tmp", "rbind", "rw"))
        config["mounts"] = mounts
        self._write_config(d, config)

    async def _start_runtime(self, d: Path, plan: SandboxPlan, mounts: list[str]) -> int:
        edge_end, shim_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with edge_end, shim_end, open(d / "runtime.log", "wb") as logf:
            argv = [
                *self._launcher("runsc-keep", shim_end, edge_end, mounts),
                *self._flags(),
                "run",
                "--detach",
                "--pass-fd",
                "3:3",
                "--bundle",
                str(d),
                plan.id,
            ]
            pid, pidfd = spawn_quick(
                argv, logf.fileno(), logf.fileno(), (shim_end.fileno(), edge_end.fileno())
            )
            shim_end.close()
            (d / "keeper").write_text(str(pid))
            try:
                await self._until_ready(edge_end, pid, pidfd, d)
            except BaseException:  # a failed start, or a cancelled one (its caller went away)
                await asyncio.get_running_loop().run_in_executor(None, self._kill_start, pid, plan.id)
                raise
        return pid

    def _kill_start(self, keeper: int, sandbox_id: str) -> None:
        """End a start that did not finish (failed, or cancelled: its caller went away).
        Mid-start the keeper's child is `runsc run`, and the sentry and the gofer are its:
        everything below the keeper goes first (the keeper alone would leave them running),
        then the keeper, then what they left to this process is reaped."""
        victims = self._kill_sandbox(keeper, sandbox_id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(keeper, 0)  # nothing watches its pidfd yet (_attach does, once started)
        _awaited.discard(keeper)
        _reap(victims, sandbox_id)

    async def _until_ready(self, edge_end: socket.socket, pid: int, pidfd: int, d: Path) -> None:
        """The shim's first pong, or the keeper's exit status (runsc's, when it failed)."""
        loop = asyncio.get_running_loop()
        edge_end.setblocking(False)
        edge_end.send(b"C" + struct.pack("<I", 0) + self.seccomp)  # before any exec (dsec-gvisor.h)
        edge_end.send(b"P" + struct.pack("<I", 1))
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(edge_end.fileno(), resolve_once, ready)
        exited: asyncio.Future[int] = asyncio.ensure_future(wait_quick(pid, os.dup(pidfd)))
        os.close(pidfd)
        try:
            waiting: set[asyncio.Future[Any]] = {ready, exited}
            done, _ = await asyncio.wait(
                waiting, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # cancelled: the caller reaps the keeper (_kill_start), not this
            exited.cancel()
            raise
        finally:
            loop.remove_reader(edge_end.fileno())
        pong = b""
        if ready in done:
            with contextlib.suppress(BlockingIOError, OSError):
                pong = edge_end.recv(64)  # EOF (b""): runsc failed and every end of the shim's went
        if pong[:1] == b"p":
            exited.cancel()  # the keeper stays; its pidfd is watched from _attach on
            _awaited.add(pid)
            return
        if not exited.done():  # the keeper exits with runsc's status
            with contextlib.suppress(TimeoutError):
                await wait_for(asyncio.shield(exited), 5.0)
        ready.cancel()
        msg = (d / "runtime.log").read_text(errors="replace").strip()[-2000:]
        if exited.done() and not exited.cancelled():
            if exited.result() == KEEP_BAD_TMP:
                raise InvalidRequest(
                    "a gvisor sandbox needs /tmp to be a directory, and this one's (its image, or "
                    "the sandbox it was forked or snapshotted from) is a symlink or missing: make "
                    "/tmp a directory, or use backend='container'"
                )
            raise InternalError(f"runsc failed to start the sandbox (exit {exited.result()}): {msg}")
        exited.cancel()
        raise InternalError(f"the gVisor sandbox did not start within {READY_TIMEOUT_S:.0f} s: {msg}")

    def _after_start(self, container: Container, plan: SandboxPlan) -> None:
        """No user cgroup: sandbox processes are not host processes (see _config)."""

    def _learn_seccomp(self, sandbox_id: str) -> None:
        """The profile is installed inside gVisor (see `_config`): nothing compiled to keep."""

    # --- adopt / destroy ------------------------------------------------------------

    def _id_base(self, container: Container) -> int:
        """The sandbox's id range, from its writable layer (owned by the range's root)."""
        try:
            return os.stat(container.upper).st_uid
        except (OSError, InternalError):
            return self.uid_offset

    async def destroy(self, handle: SandboxHandle) -> None:
        container = self._own(handle)
        loop = asyncio.get_running_loop()
        victims = await loop.run_in_executor(None, self._kill_sandbox, container.pid, container.id)
        with contextlib.suppress(TimeoutError):
            await wait_for(asyncio.shield(container.exited), 5.0)
        await loop.run_in_executor(None, _reap, victims, container.id)
        container.release()
        await self._teardown(container.id, container.dir)
        self._give_back_ids(container, container.exited.done())

    def _kill_sandbox(self, keeper: int, sandbox_id: str) -> set[int]:
        """SIGKILL the sentry, the gofer and whatever they started: every process below the
        keeper, and whatever is in the sandbox's cgroup (where they are even when the keeper
        was killed); the processes killed. A keeper that is not ours any more (its pid
        reused) is left alone.

        Those the keeper does not reap (it died first, or exits as soon as its own children
        are gone) are reparented to this process, a subreaper, and must be reaped here
        (`_reap`) before `runsc delete`: it takes an unreaped sentry for a live one and
        waits for it to exit, 120 s."""
        with contextlib.suppress(OSError):
            self.cgroups.thaw(sandbox_id)  # frozen tasks take SIGKILL only once thawed
        cmdline = _read(f"/proc/{keeper}/cmdline")
        ours = b"runsc-keep" in cmdline and sandbox_id.encode() in cmdline
        victims: set[int] = set()
        for _ in range(100):  # until a round finds nothing new (a fork may race the kill)
            found = set(self.cgroups.procs(sandbox_id)) | (_descendants(keeper) if ours else set())
            if found <= victims:
                break
            sigkill_each(found - victims)
            victims |= found
        return victims

    async def _teardown(self, sandbox_id: str, d: Path, *, use_runtime: bool = True) -> None:
        if use_runtime and any(self.runtime_root.glob(f"{sandbox_id}_sandbox:*")):
            argv = [self.runtime, *self._flags(), "delete", "--force", sandbox_id]
            with open(os.devnull, "wb") as devnull:
                await run_process_quick(argv, devnull.fileno())
        for leftover in self.runtime_root.glob(f"*{sandbox_id}*"):  # runsc leaves its socket at times
            with contextlib.suppress(OSError):
                leftover.unlink()
        self.cgroups.remove_sandbox(sandbox_id)
        shutil.rmtree(d, ignore_errors=True)  # the mounts were the keeper's: gone with it

    def runtime_ids(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name.split("_sandbox:")[0] for p in self.runtime_root.glob("*_sandbox:*.state")}
        return set()

    def stray_mounts(self, known: set[str]) -> list[str]:
        return []  # every mount is in a keeper's namespace

    async def remove_orphan(self, sandbox_id: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            keeper = int((self.sandboxes_dir / sandbox_id / "keeper").read_text())
            await asyncio.get_running_loop().run_in_executor(None, self._kill_sandbox, keeper, sandbox_id)
        await self._teardown(sandbox_id, self.sandboxes_dir / sandbox_id)

    # --- pause / resume: the container backend's host freezer --------------------------
    # It stops the sentry and the gofer at once (runsc pause would cost a runsc process per
    # call, ~25 ms, on the path of every operation on a paused sandbox). While frozen no
    # runsc command may run (they wait on the sentry): nothing here issues one, and a
    # teardown thaws first.

    async def kill_user_processes(self, handle: SandboxHandle) -> None:
        from dsec.backends.shim import Launch

        devnull = [os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC) for _ in range(3)]
        try:
            launch = Launch(["/.dsec/shim", "kill-others"], {}, "/", 0, 0)
            _, _, exited = await handle.channel.spawn(launch, stdio=(devnull[0], devnull[1], devnull[2]))
        finally:
            for fd in devnull:
                os.close(fd)
        await wait_for(exited, 10.0)


def _traversable(d: Path, *, own: Path) -> None:
    """The sentry and the gofer run as the sandbox's unprivileged host ids and must reach its
    bundle: the edge's own directories (from `own` down) are made searchable by others; an
    ancestor above them that is not is an error that names it."""
    for p in [d, *d.parents]:
        mode = p.stat().st_mode
        if mode & 0o001:
            continue
        if p == own or own in p.parents or p == own.parent:  # the edge's run dir and its parent
            p.chmod((mode & 0o7777) | 0o011)
            continue
        raise BackendUnavailable(
            f"{p} is not searchable by others (mode {mode & 0o777:o}): gVisor's sentry runs as an "
            "unprivileged host id and must reach the sandbox bundles below it; chmod o+x it"
        )


def _readable_tools(tools: Path, dest: Path) -> Path:
    """The tools bound at /.dsec-tools (a session's bash), readable: the sentry loads a
    program by reading it as the process's user, so the host's execute-only copy (which makes
    each shell non-dumpable on the host's kernel, a flag gVisor's /proc ignores) cannot start
    there. Root's, read-only in the sandbox like the host's copy."""
    dest.mkdir(mode=0o755, exist_ok=True)
    for src in tools.iterdir():
        target = dest / src.name
        if src.is_file() and (not target.exists() or target.stat().st_size != src.stat().st_size):
            tmp = dest / f".{src.name}-{os.getpid()}"
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
    return dest


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, and so on), as /proc shows them now."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        kids = children_of(todo.pop()) - found
        found |= kids
        todo.extend(kids)
    return found


def _reap(victims: set[int], sandbox_id: str, timeout_s: float = 5.0) -> None:
    """Wait until each killed process is gone: reaped here when it is this process's child
    (or becomes one, reparented), by its own parent otherwise."""
    me = os.getpid()
    deadline = time.monotonic() + timeout_s
    while victims:
        for pid in list(victims):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    victims.discard(pid)
            except ChildProcessError:  # not ours: gone, someone else's, or its parent's to reap
                parent = _ppid(pid)
                if parent is None or (parent != me and parent not in victims):
                    victims.discard(pid)
        if not victims or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    if victims:
        log.warning("gvisor sandbox %s: processes %s outlived their kill", sandbox_id, sorted(victims))


def _ppid(pid: int) -> int | None:
    """The parent of a live (or zombie) process, None once it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(b")")[2].split()
    return int(fields[1]) if len(fields) > 1 else None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""
