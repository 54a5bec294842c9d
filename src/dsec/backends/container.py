"""The container backend: crun over an overlayfs of composed layers.

Lifecycle of one sandbox (all host resources carry the prefix ``dsec``)::

    create:  config.json, then `dsec-shim crun-wrap` -> `crun run -d` with the shim control
             socketpair at fds 3-4; the wrapper first mounts, in a mount namespace of its own
             (so nothing lands in the host's mount table):
               tmpfs "dsec-upper" on <run>/sandboxes/<id>/up    (upper + work; size = disk quota)
               overlay "dsec-rootfs" on <run>/sandboxes/<id>/rootfs (layers as lowerdirs, top first)
             -> PID 1 is dsec-shim; ready when it answers a ping
    spawn:   one datagram to the shim with stdio fds + an exec cgroup fd (see dsec-shim.c)
    adopt:   after an edge restart: pidfd_open(shim) + pidfd_getfd(shim, 4) gives the control
             socket back; messages sent while the edge was away are still queued in it
    destroy: SIGKILL the shim (the pid namespace dies with it), crun delete, unmount, rm
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import CapacityExhausted, InternalError, InvalidRequest
from dsec.isolation import linux
from dsec.isolation.cgroups import CgroupHost
from dsec.isolation.idranges import IdRange, IdRanges, range_of
from dsec.isolation.spec import ID_RANGE, Limits, build_config

_HDR = struct.Struct("<IiiHHB")
_REPLY = struct.Struct("<Ii")
MAX_LAYERS = 500  # overlayfs stacks at most 500 lowers


class ShimChannel:
    """The edge's end of a sandbox's control socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._next = random.randrange(1 << 30, 1 << 31)
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def _new_id(self) -> int:
        self._next = (self._next + 1) & 0x7FFFFFFF
        return self._next

    def _on_readable(self) -> None:
        while True:
            try:
                msg = self.sock.recv(64)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:
                self.close()
                return
            kind = msg[:1]
            ident, value = _REPLY.unpack_from(msg, 1)
            if kind == b"R":
                fut = self._started.pop(ident, None)
                if fut and not fut.done():
                    fut.set_result(value)
            elif kind == b"F":
                fut = self._started.pop(ident, None)
                self._exited.pop(ident, None)
                if fut and not fut.done():
                    fut.set_exception(OSError(value, os.strerror(value)))
            elif kind == b"X":
                fut = self._exited.pop(ident, None)
                if fut and not fut.done():
                    fut.set_result(value)
            elif kind == b"p":
                pong = self._pongs.pop(ident, None)
                if pong and not pong.done():
                    pong.set_result(None)

    def _send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if self.closed:
            raise InternalError("the sandbox's control channel is closed")
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.send(data)
        except BlockingIOError as e:
            raise CapacityExhausted("the sandbox's control channel is congested; retry") from e

    async def ping(self, timeout: float = 5.0) -> None:
        ident = self._new_id()
        fut: asyncio.Future[None] = self._loop.create_future()
        self._pongs[ident] = fut
        self._send(b"P" + struct.pack("<I", ident))
        try:
            await asyncio.wait_for(fut, timeout)
        finally:
            self._pongs.pop(ident, None)

    async def spawn(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        cwd: str,
        uid: int,
        gid: int,
        stdio: tuple[int, int, int],
        cgroup_fds: Sequence[int] = (),
    ) -> tuple[int, int, asyncio.Future[int]]:
        """Start a process; returns (message id, pid inside, future of its wait status)."""
        env_items = [f"{k}={v}" for k, v in env.items()]
        ident = self._new_id()
        strings = [cwd, *argv, *env_items]
        if any("\0" in s for s in strings):
            raise InvalidRequest("arguments, environment and cwd must not contain NUL bytes")
        payload = b"S" + _HDR.pack(ident, uid, gid, len(argv), len(env_items), len(cgroup_fds))
        payload += b"".join(s.encode() + b"\0" for s in strings)
        if len(payload) > 262_000:
            raise InvalidRequest(
                "command line and environment exceed 256 KiB; pass large data through stdin or a file"
            )
        started: asyncio.Future[int] = self._loop.create_future()
        exited: asyncio.Future[int] = self._loop.create_future()
        self._started[ident] = started
        self._exited[ident] = exited
        try:
            self._send(payload, [*stdio, *cgroup_fds])
            pid = await started
        except BaseException:
            self._started.pop(ident, None)
            self._exited.pop(ident, None)
            raise
        return ident, pid, exited

    async def fill(self, src: int, dst: int, timeout: float = 5.0) -> tuple[int, asyncio.Future[int]]:
        """Have a child of the shim (inside the sandbox's cgroups) copy pipe `src` into the
        regular file `dst` until EOF; returns (message id, future of its wait status). The
        caller keeps its own copies of both fds. An init too old to know 'W' never answers:
        that is a TimeoutError after `timeout`."""
        ident = self._new_id()
        started: asyncio.Future[int] = self._loop.create_future()
        exited: asyncio.Future[int] = self._loop.create_future()
        self._started[ident] = started
        self._exited[ident] = exited
        try:
            self._send(b"W" + struct.pack("<I", ident), [src, dst])
            await asyncio.wait_for(started, timeout)
        except BaseException:
            self._started.pop(ident, None)
            self._exited.pop(ident, None)
            raise
        return ident, exited

    def signal(self, ident: int, sig: int) -> None:
        with contextlib.suppress(InternalError, OSError):
            self._send(b"K" + struct.pack("<Ii", ident, sig))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        err = InternalError("the sandbox stopped")
        for futs in (self._started, self._exited, self._pongs):
            for f in futs.values():
                if not f.done():
                    f.set_exception(err)
                    f.exception()  # mark retrieved: nobody may be waiting any more
            futs.clear()


@dataclass
class Container:
    id: str
    pid: int
    start_time: int
    dir: Path
    pidfd: int
    channel: ShimChannel
    exited: asyncio.Future[None]
    timings_ms: dict[str, float] = field(default_factory=dict)
    upper_fd: int = -1  # O_PATH on the writable layer's tmpfs root (upper/ and work/)
    id_base: int = 0  # the host uid (and gid) its root is: its own range (isolation/idranges.py)
    id_range: IdRange | None = None  # this process's claim on that range
    exit_status: tuple[int, int] | None = None  # (si_code, si_status) of the init, once reaped

    def exit_reason(self) -> str:
        if self.exit_status is None:
            return "its init exited"
        code, status = self.exit_status
        if code in (os.CLD_KILLED, os.CLD_DUMPED):
            return f"its init was killed by {signal.Signals(status).name}"
        return f"its init exited with status {status}"

    def disk_usage(self) -> tuple[int, int, bool]:
        """(bytes, inodes) used in the writable layer, and whether either is exhausted."""
        if self.upper_fd < 0:
            return 0, 0, False
        st = os.statvfs(f"/proc/{os.getpid()}/fd/{self.upper_fd}")
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return used, st.f_files - st.f_ffree, st.f_bavail == 0 or st.f_favail == 0

    @property
    def upper(self) -> Path:
        """The writable layer as this process reaches it (the tmpfs is in the sandbox's
        mount namespace only)."""
        if self.upper_fd < 0:
            raise InternalError(f"sandbox {self.id} has no handle on its writable layer")
        return Path(f"/proc/{os.getpid()}/fd/{self.upper_fd}/upper")  # usable by helper processes too

    @property
    def rootfs(self) -> Path:
        """The sandbox's root as the host reaches it (its mounts live only in its own
        mount namespace)."""
        return Path(f"/proc/{self.pid}/root")

    def alive(self) -> bool:
        return not self.exited.done()


@dataclass(frozen=True)
class ContainerPlan:
    id: str
    lowerdirs: list[Path]
    limits: Limits
    disk_mb: int
    env: dict[str, str]
    disk_inodes: int = 262144


class ContainerBackend:
    """Creates, adopts and destroys container sandboxes on this node."""

    name = "container"

    def __init__(
        self,
        *,
        run_dir: Path,
        shim: Path,
        runtime: str,
        uid_offset: int,
        id_ranges: IdRanges,
        cgroups: CgroupHost,
        tools_dir: Path | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.sandboxes_dir = run_dir / "sandboxes"
        self.runtime_root = run_dir / "runtime"
        self.shim = shim
        self.runtime = shutil.which(runtime) or runtime
        self.uid_offset = uid_offset  # the layer store's canonical range
        self.id_ranges = id_ranges  # each sandbox's own range
        self.cgroups = cgroups
        self.tools_dir = tools_dir  # bound read-only at /.dsec-tools in every sandbox
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_root.mkdir(parents=True, exist_ok=True)
        # crun compiles the seccomp profile with libseccomp at every start (~1.3 ms) and keeps
        # the result in its state dir; the first start of each profile pays for it, later
        # ones hand crun that program (annotation run.oci.seccomp_bpf_data, which replaces
        # the seccomp section): the same filter, compiled once per edge process.
        self._seccomp_bpf: dict[str, str] = {}
        self._reaped_at = 0.0
        self._seccomp_learn: dict[str, str] = {}  # sandbox id -> profile key, to read after its start

    # --- create ---------------------------------------------------------------

    async def create(self, plan: ContainerPlan) -> Container:
        t0 = time.perf_counter()
        d = self.sandboxes_dir / plan.id
        ids = self.id_ranges.claim()
        try:
            mounts = self._prepare_rootfs(d, plan, ids.base)
            t1 = time.perf_counter()
            pid = await self._start_runtime(d, plan, mounts)
            now = time.monotonic()
            if now - self._reaped_at > 0.5:  # crun's intermediate processes, reparented to us
                self._reaped_at = now  # (a scan costs ~0.4 ms with 1,000 live: not per start)
                reap_strays()
            t2 = time.perf_counter()
            self._learn_seccomp(plan.id)
            container = self._attach(plan.id, d, pid, None)
            container.id_base, container.id_range = ids.base, ids
            ids.bind(container.pid, container.start_time)
            await container.channel.ping()
            t3 = time.perf_counter()
        except BaseException:
            self._seccomp_learn.pop(plan.id, None)
            await self._teardown(plan.id, d)
            ids.release()
            raise
        container.timings_ms = {
            "layer_preparation": (t1 - t0) * 1000,
            "runtime_start": (t2 - t1) * 1000,
            "ready": (t3 - t2) * 1000,
        }
        return container

    def _prepare_rootfs(self, d: Path, plan: ContainerPlan, base: int) -> list[str]:
        """Write the bundle; return the mount arguments for `dsec-shim crun-wrap`, which
        mounts the tmpfs upper, the layers (idmapped from the store's canonical range to
        the sandbox's own, `base`) and the overlay inside the runtime's own mount namespace."""
        up, rootfs, lowers = d / "up", d / "rootfs", d / "lower"
        d.mkdir(mode=0o711)  # the userns root must traverse it to reach rootfs
        d.chmod(0o711)
        up.mkdir()
        rootfs.mkdir()
        lowers.mkdir(mode=0o700)
        if len(plan.lowerdirs) > MAX_LAYERS:
            raise InvalidRequest(
                f"image has too many layers ({len(plan.lowerdirs)}, at most {MAX_LAYERS}) to stack; "
                "merge some layers"
            )
        tmpfs = f"size={plan.disk_mb}m,nr_inodes={plan.disk_inodes},mode=0755,uid={base},gid={base}"
        idmap = f"{self.uid_offset}:{base}:{ID_RANGE}" if base != self.uid_offset else "-"
        mounts = [str(up), tmpfs, str(rootfs), str(base), idmap, str(lowers), str(len(plan.lowerdirs))]
        mounts += [str(p) for p in plan.lowerdirs]
        config = build_config(
            hostname=plan.id,
            args=["/.dsec/shim", "init"],
            cgroups_path=self.cgroups.sandbox_path(plan.id),
            limits=plan.limits,
            uid_offset=base,
            id_range=ID_RANGE,
            env=plan.env,
            tools_dir=str(self.tools_dir) if self.tools_dir else None,
        )
        self._use_compiled_seccomp(plan.id, config)
        (d / "config.json").write_text(json.dumps(config))
        return mounts

    @staticmethod
    def _seccomp_key(profile: object) -> str:
        return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()

    def _use_compiled_seccomp(self, sandbox_id: str, config: dict[str, Any]) -> None:
        profile = config["linux"].get("seccomp")
        if profile is None:
            return
        key = self._seccomp_key(profile)
        bpf = self._seccomp_bpf.get(key)
        if bpf is None:
            self._seccomp_learn[sandbox_id] = key
            return
        # crun takes the program from the annotation and only the flags (logging of denials)
        # from the section.
        config["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ALLOW", "flags": profile.get("flags", [])}
        config.setdefault("annotations", {})["run.oci.seccomp_bpf_data"] = bpf

    def _learn_seccomp(self, sandbox_id: str) -> None:
        key = self._seccomp_learn.pop(sandbox_id, None)
        if key is None or key in self._seccomp_bpf:
            return
        with contextlib.suppress(OSError):
            data = (self.runtime_root / sandbox_id / "seccomp.bpf").read_bytes()
            if data and len(data) % 8 == 0:  # struct sock_filter: 8 bytes per instruction
                self._seccomp_bpf[key] = base64.b64encode(data).decode()

    async def _start_runtime(self, d: Path, plan: ContainerPlan, mounts: list[str]) -> int:
        edge_end, shim_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The shim keeps a copy of the edge end (fd 4): see adopt().
        with edge_end, shim_end, open(d / "runtime.log", "wb") as log:
            argv = [
                str(self.shim),
                "crun-wrap",
                str(shim_end.fileno()),
                str(edge_end.fileno()),
                "1" if self.cgroups.hybrid else "0",
                *mounts,
                "--",
                self.runtime,
                "--root",
                str(self.runtime_root),
                "run",
                "--detach",
                "--preserve-fds",
                "3",
                "--pid-file",
                str(d / "pid"),
                "--bundle",
                str(d),
                plan.id,
            ]
            rc = await run_process_quick(argv, log.fileno(), (shim_end.fileno(), edge_end.fileno()))
        if rc != 0:
            msg = (d / "runtime.log").read_text(errors="replace").strip()[-2000:]
            raise InternalError(f"the OCI runtime failed to start the sandbox: {msg or f'exit code {rc}'}")
        return int((d / "pid").read_text())

    def _attach(self, sandbox_id: str, d: Path, pid: int, start_time: int | None) -> Container:
        pidfd = os.pidfd_open(pid)
        try:
            actual = linux.proc_start_time(pid)
            if actual is None or (start_time is not None and actual != start_time):
                raise ProcessLookupError(pid)
            sock = socket.socket(fileno=linux.pidfd_getfd(pidfd, 4))
            try:
                upper_fd = linux.pidfd_getfd(pidfd, 5)
            except OSError:
                upper_fd = -1  # started without a writable-layer handle: no snapshots
        except BaseException:
            os.close(pidfd)
            raise
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            # The edge is a child subreaper, so the shim became our child when the
            # runtime exited: reap it, or it lingers as a zombie (and keeps cgroup refs).
            with contextlib.suppress(ChildProcessError, OSError):
                res = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
                if res is not None:
                    container.exit_status = (res.si_code, res.si_status)
            _awaited.discard(pid)
            if not exited.done():
                exited.set_result(None)

        container = Container(sandbox_id, pid, actual, d, pidfd, ShimChannel(sock), exited, upper_fd=upper_fd)
        _awaited.add(pid)  # reaped by on_exit (when it is our child: created by, not adopted into, us)
        loop.add_reader(pidfd, on_exit)
        return container

    # --- adopt / destroy --------------------------------------------------------

    async def adopt(self, sandbox_id: str, pid: int, start_time: int) -> Container | None:
        """Re-attach to a sandbox a previous edge process started, if it still runs."""
        d = self.sandboxes_dir / sandbox_id
        if not (d / "rootfs").is_dir():
            return None
        try:
            container = self._attach(sandbox_id, d, pid, start_time)
        except (ProcessLookupError, OSError):
            return None
        container.id_base = range_of(pid) or self.uid_offset
        container.id_range = self.id_ranges.adopt(container.id_base, pid, start_time)
        try:
            await container.channel.ping(timeout=2.0)
        except (TimeoutError, InternalError, OSError):
            await self.destroy(container)
            return None
        return container

    async def destroy(self, container: Container) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(container.pidfd, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(container.exited), 5.0)
        container.channel.close()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(container.pidfd)
        os.close(container.pidfd)
        if container.upper_fd >= 0:
            os.close(container.upper_fd)
            container.upper_fd = -1
        # With PID 1 gone and reaped, the pid namespace is empty: the runtime has
        # nothing left to stop, and removing its state ourselves saves a process.
        gone = container.exited.done()
        await self._teardown(container.id, container.dir, use_runtime=not gone)
        if container.id_range is not None:
            # An init that would not die keeps its range (its record names it) until it does.
            container.id_range.release(keep_holder=not gone)
            container.id_range = None

    async def _teardown(self, sandbox_id: str, d: Path, *, use_runtime: bool = True) -> None:
        """Remove every host resource of a sandbox; safe to call on partial state."""
        if use_runtime and (self.runtime_root / sandbox_id).exists():
            argv = [self.runtime, "--root", str(self.runtime_root), "delete", "--force", sandbox_id]
            with open(os.devnull, "wb") as devnull:
                await run_process_quick(argv, devnull.fileno())
        shutil.rmtree(self.runtime_root / sandbox_id, ignore_errors=True)
        self.cgroups.remove_sandbox(sandbox_id)
        for m in (d / "rootfs", d / "up"):
            unmount_all(m)
        shutil.rmtree(d, ignore_errors=True)

    def runtime_ids(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name for p in self.runtime_root.iterdir() if p.is_dir()}
        return set()

    def sandbox_dirs(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()}
        return set()

    async def remove_orphan(self, sandbox_id: str) -> None:
        """Kill and remove whatever is left of a sandbox no record claims."""
        pid_file = self.sandboxes_dir / sandbox_id / "pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            # Only a process that is still in this sandbox's cgroup is ours to kill.
            if pid in self.cgroups.procs(sandbox_id):
                os.kill(pid, signal.SIGKILL)
        await self._teardown(sandbox_id, self.sandboxes_dir / sandbox_id)


# Children this process waits for by pid (helpers being awaited, sandbox inits); any other
# child that exits is a stray: crun's intermediate processes, which the edge inherits as a
# child subreaper when their parents exit, and which nobody else would ever reap.
_awaited: set[int] = set()


def reap_strays(comms: frozenset[str] = frozenset({"crun", "runc"})) -> int:
    """Reap exited runtime processes nobody waits for; how many. Only zombies whose command
    is the runtime's are taken: other children (subprocess.run in a worker thread, say) are
    waited for by their owners, who must get their exit status."""
    me = os.getpid()
    n = 0
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        return 0
    kids: set[int] = set()
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{me}/task/{tid}/children") as f:
            kids.update(int(x) for x in f.read().split())
    for pid in kids - _awaited:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, _, rest = stat.partition("(")[2].rpartition(")")
        if rest.split()[:1] != ["Z"] or comm not in comms:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                n += 1
    return n


def spawn_quick(
    argv: Sequence[str], out_fd: int, err_fd: int, inherit: Sequence[int] = (), *, stdin_fd: int | None = None
) -> tuple[int, int]:
    """Start a helper program; its (pid, pidfd).

    posix_spawn (vfork under glibc) and a pidfd watched by the event loop: no
    fork of this large process and no child-watcher thread per process, which
    cost several ms per sandbox start under load (and more under uvloop).
    """
    # No stdin is an empty pipe, never the host's /dev/null: the OCI runtime chowns the
    # container process's stdio to the sandbox's root, and would so hand it the host's
    # /dev/null (chmod 000 from inside would then break every host program).
    empty = None
    if stdin_fd is None:
        empty = os.pipe2(os.O_CLOEXEC)
        os.close(empty[1])
        stdin_fd = empty[0]
    for fd in inherit:
        os.set_inheritable(fd, True)
    try:
        pid = os.posix_spawnp(
            argv[0],
            list(argv),
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                (os.POSIX_SPAWN_DUP2, out_fd, 1),
                (os.POSIX_SPAWN_DUP2, err_fd, 2),
            ],
        )
    finally:
        for fd in inherit:
            os.set_inheritable(fd, False)
        if empty is not None:
            os.close(empty[0])
    _awaited.add(pid)
    return pid, os.pidfd_open(pid)


async def wait_quick(pid: int, pidfd: int) -> int:
    """Wait for a process started by spawn_quick (closes its pidfd); its exit code."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, resolve_once, done)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        _awaited.discard(pid)


async def run_process_quick(argv: Sequence[str], log_fd: int, inherit: Sequence[int] = ()) -> int:
    """Run a helper program with stdout and stderr on `log_fd` and wait for it; its exit code."""
    pid, pidfd = spawn_quick(argv, log_fd, log_fd, inherit)
    return await wait_quick(pid, pidfd)


def resolve_once(fut: asyncio.Future[None]) -> None:
    """Event-loop callback: mark `fut` done unless it already is."""
    if not fut.done():
        fut.set_result(None)


def mounts_under(prefix: Path) -> list[str]:
    out = []
    p = str(prefix).rstrip("/") + "/"
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target.startswith(p):
                out.append(target)
    return out


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest mount point prefix)."""
    p = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            target = fields[1].replace("\\040", " ")
            inside = p == target or p.startswith(target.rstrip("/") + "/")
            if inside and len(target) >= len(best):
                best, kind = target, fields[2]
    return kind


def unmount_all(target: Path) -> None:
    """Unmount `target` (stacked mounts included); ignore it if nothing is mounted."""
    for _ in range(8):
        try:
            linux.umount(str(target))
        except OSError as e:
            if e.errno in (22, 2):  # EINVAL: not a mount point; ENOENT
                return
            if e.errno == 16:  # EBUSY: still referenced somewhere; detach lazily
                linux.umount(str(target), detach=True)
            else:
                raise
