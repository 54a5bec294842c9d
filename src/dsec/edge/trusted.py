"""Trusted execs: platform commands (verify, an exec marked ``trusted``) that run with the
image's own toolchain, whatever the sandbox did to its files.

A sandbox's root is root of its files: it can put a ``python3`` earlier on PATH, a ``.pth``
file in site-packages, replace /bin/sh or tar, write /etc/ld.so.preload. A command the
platform runs there to grade it must use none of that. So a trusted exec does not run in the
sandbox's root at all: the ``dsec-trusted`` helper (native/dsec-trusted.c) builds a root of
its own from the image's layers (read-only; forks', checkpoints' and snapshots' layers are
the sandbox's own writes, so they are left out), with only the task directories (default
/work) taken live from the sandbox, and for verify the protected paths bound read-only
straight from the host's vault. It runs in the sandbox's pid, net, ipc, uts and cgroup
namespaces, as an id that maps to a host id outside the sandbox's range, in a user namespace
of its own (the sandbox's root can neither signal, trace nor read it), with no capabilities,
no_new_privs, the sandbox's seccomp filter and a clean environment. Its exit status comes
from waitpid in a helper process that stays in the host's namespaces.

Nothing the agent does can watch or starve it: the agent's processes are frozen for its
whole run (`AgentFreeze`: the user's cgroup, not the sandbox's init), its command, env and
paths reach the helper in a memfd (never an argv or environ /proc shows), it runs in a
cgroup of its own with the sandbox's limits (outside the sandbox's: the memory and pids the
agent holds are not taken from it), and every mount point and scratch byte it needs is in
its own mounts, never in the agent's writable layer. When it still cannot run, the call
fails with `grader_unavailable` (an environment fault), never with an exit code.

Protected paths leave the sandbox by a host-side copy (openat2 walks that follow nothing)
into the vault, owned by the trusted id; nothing of the sandbox ever runs on them, and they
never come back into the sandbox's own root.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import posixpath
import re
import shutil
import signal
import stat
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec import errors
from dsec.aio import wait_for
from dsec.backends.base import SandboxHandle
from dsec.edge.files import MAX_ARCHIVE, MAX_ARCHIVE_ENTRIES, RESOLVE, RESOLVE_WALK, stats_sorted, walk_open
from dsec.edge.process import Outputs, PipeReader, RawResult, exit_code
from dsec.isolation import linux
from dsec.isolation.cgroups import CgroupHost, ExecGroup, keyed_value
from dsec.isolation.procs import sealed_memfd, spawn_quick, wait_quick
from dsec.isolation.spec import DEFAULT_PATH
from dsec.layers import LayerStore
from dsec.layers.store import Image

# The id a trusted command has inside its user namespace; on the host it is
# trusted_host_id(uid_offset), an id no sandbox maps.
TRUSTED_UID = 65533
DEFAULT_TASK_DIRS = ("/work",)
MAX_TASK_DIRS = 16
# Paths that are the image's: a task directory may not be or lie under one of them.
SYSTEM_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/sys",
    "/dev", "/tmp", "/boot", "/run", "/var/lib", "/.dsec", "/.dsec-tools",
)  # fmt: skip
_NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "cgroup")
# Layers a sandbox wrote (snapshots of it): never part of a trusted root.
_SANDBOX_LAYERS = frozenset({"snapshot"})
_KILL_WAIT_S = 5.0
FREEZE_TIMEOUT_S = 5.0  # the agent's processes must be stopped by then, or the command does not run
MAX_PROTECTED = 64  # protected paths per sandbox (the helper's limit)


def trusted_host_id(uid_offset: int) -> int:
    """The host uid and gid of every trusted command: just below the sandboxes' id range."""
    if uid_offset < 65536:
        raise errors.InternalError(
            f"trusted execs need uid_offset >= 65536 (it is {uid_offset}): their id lies below the sandboxes'"
        )
    return uid_offset - 65536 + TRUSTED_UID


def task_dirs(requested: Sequence[str] | None, workdir: str) -> list[str]:
    """The directories a trusted command sees as the sandbox has them: the caller's, or the
    sandbox's workdir and /work. Normalised, deduplicated, inner ones dropped (the outer bind
    holds them); a system path is refused (it would bring the sandbox's binaries back)."""
    raw = [*DEFAULT_TASK_DIRS, workdir] if requested is None else list(requested)
    if len(raw) > MAX_TASK_DIRS:
        raise errors.InvalidRequest(f"at most {MAX_TASK_DIRS} task_dirs, got {len(raw)}")
    out: list[str] = []
    for d in raw:
        if not d.startswith("/") or "\0" in d or len(d) > 1024:
            raise errors.InvalidRequest(f"task_dirs entry {d!r} must be an absolute path such as /work")
        p = posixpath.normpath(d)
        if p == "/" or any(p == s or p.startswith(s + "/") for s in SYSTEM_PATHS):
            if requested is None:
                continue  # a workdir such as /tmp: only /work is taken from the sandbox
            raise errors.InvalidRequest(
                f"task_dirs entry {d!r} is a system path: a trusted command takes the image's own "
                "/, /usr, /bin, /lib, /etc, /tmp...; name the directories that hold the task's files"
            )
        out.append(p)
    out = sorted(set(out))
    return [p for p in out if not any(p.startswith(q + "/") for q in out if q != p)]


def trusted_lowers(layers: LayerStore, image: Image) -> list[Path]:
    """The image's layer trees, top first, without the layers a sandbox wrote."""
    out = []
    for ref in reversed(image.layers):
        if layers.get_layer(ref).source.get("type") in _SANDBOX_LAYERS:
            continue
        out.append(layers.layer_path(ref))
    if not out:
        raise errors.InvalidRequest(
            f"image {image.name} has no layer of its own (only the sandbox's): "
            "nothing to run a trusted command with"
        )
    return out


# --- the vault: protected paths, copied out host-side --------------------------------------


@dataclass(frozen=True)
class Protected:
    """One protected path: `kind` d (directory), f (file) or l (symlink, `link` its text);
    `src` its copy in the vault (none for a symlink)."""

    path: str
    kind: str
    src: Path | None
    link: str = ""


class _Bound:
    def __init__(self, path: str) -> None:
        self.path = path
        self.entries = 0
        self.left = MAX_ARCHIVE

    def entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_ARCHIVE_ENTRIES:
            raise errors.PayloadTooLarge(
                f"{self.path} holds more than {MAX_ARCHIVE_ENTRIES} entries; protect a narrower path"
            )

    def data(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise errors.PayloadTooLarge(
                f"{self.path} holds more than {MAX_ARCHIVE} bytes; protect a narrower path"
            )


def copy_out(root_fd: int, path: str, dest: Path, owner: int) -> tuple[str, str]:
    """Copy `path` of a sandbox (its root: `root_fd`) to `dest` on the host, following
    nothing below the path's parent (which resolves inside the sandbox's root); files become
    `owner`'s, setuid/setgid/sticky bits and special files are left out. Returns (kind, link
    text): d, f, or l for a symlink (nothing copied)."""
    parent, name = posixpath.split(path)
    try:
        pfd = linux.openat2(root_fd, parent, os.O_PATH | os.O_DIRECTORY, 0, RESOLVE)
    except OSError as e:
        raise _vault_error(e, path) from e
    bound = _Bound(path)
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except OSError as e:
            raise _vault_error(e, path) from e
        if stat.S_ISLNK(st.st_mode):
            return "l", os.readlink(name, dir_fd=pfd)
        if stat.S_ISDIR(st.st_mode):
            try:
                src = linux.openat2(pfd, name, os.O_RDONLY | os.O_DIRECTORY, 0, RESOLVE_WALK)
            except OSError as e:
                raise _vault_error(e, path) from e
            try:
                os.mkdir(dest, 0o700)
                dst = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    _copy_dir(src, dst, owner, bound, path)
                    _finish(dst, st, owner)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
            return "d", ""
        if stat.S_ISREG(st.st_mode):
            dirfd = os.open(dest.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if not _copy_file(pfd, name, dirfd, dest.name, owner, bound):
                    raise errors.Conflict(f"{path} changed while it was being protected; retry")
            finally:
                os.close(dirfd)
            return "f", ""
        raise errors.InvalidRequest(
            f"{path} is not a file, directory or symbolic link; protect regular files and directories"
        )
    except RecursionError:
        raise errors.PayloadTooLarge(f"{path} is nested too deeply to protect") from None
    finally:
        os.close(pfd)


def _vault_error(e: OSError, path: str) -> errors.DsecError:
    if e.errno == errno.ENOENT:
        return errors.FileNotFound(f"{path} does not exist in the sandbox")
    if e.errno in (errno.ELOOP, errno.EXDEV):
        return errors.InvalidRequest(
            f"{path} leads through a link or onto another mount; protect a plain path"
        )
    if e.errno == errno.ENOTDIR:
        return errors.InvalidRequest(f"a parent of {path} is not a directory")
    return errors.InternalError(f"protecting {path}: {e.strerror}")


def _finish(fd: int, st: os.stat_result, owner: int) -> None:
    os.fchown(fd, owner, owner)
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)


def _copy_dir(src: int, dst: int, owner: int, bound: _Bound, shown: str) -> None:
    for name, st in stats_sorted(src):
        m = st.st_mode
        if stat.S_ISDIR(m):
            sub = walk_open(src, name, os.O_RDONLY | os.O_DIRECTORY, _vault_error, f"{shown}/{name}")
            if sub is None:
                continue  # a mount point inside, or swapped away meanwhile
            try:
                bound.entry()
                os.mkdir(name, 0o700, dir_fd=dst)
                dsub = linux.openat2(dst, name, os.O_RDONLY | os.O_DIRECTORY, 0, RESOLVE_WALK)
                try:
                    _copy_dir(sub, dsub, owner, bound, f"{shown}/{name}")
                    _finish(dsub, st, owner)
                finally:
                    os.close(dsub)
            finally:
                os.close(sub)
        elif stat.S_ISREG(m):
            _copy_file(src, name, dst, name, owner, bound)
        elif stat.S_ISLNK(m):
            try:
                target = os.readlink(name, dir_fd=src)
            except OSError:
                continue
            bound.entry()
            os.symlink(target, name, dir_fd=dst)
            os.chown(name, owner, owner, dir_fd=dst, follow_symlinks=False)
        # FIFOs, sockets, devices: nothing a grader needs, and nothing to carry out


def _copy_file(src_dir: int, name: str, dst_dir: int, dst_name: str, owner: int, bound: _Bound) -> bool:
    """Copy one regular file (exactly its size at open: cut if it grows). False if it is no
    longer a regular file."""
    try:
        fd = linux.openat2(src_dir, name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, 0, RESOLVE_WALK)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ELOOP, errno.ENOENT, errno.ENXIO):
            return False
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        bound.entry()
        bound.data(st.st_size)
        out = os.open(
            dst_name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dst_dir,
        )
        try:
            left = st.st_size
            while left > 0:
                try:
                    n = os.sendfile(out, fd, None, min(left, 1 << 24))
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS):
                        raise
                    chunk = os.read(fd, min(left, 1 << 20))
                    n = os.write(out, chunk) if chunk else 0
                if n == 0:
                    break  # shrank meanwhile
                left -= n
            _finish(out, st, owner)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return True


def make_mount_point(tree: Path, rel: str, kind: str, link: str, owner: int) -> None:
    """Inside a vault tree (ours), make the mount point of a protected path protected before
    it (and so missing from this copy)."""
    parts = [p for p in rel.split("/") if p]
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
                os.chown(part, owner, owner, dir_fd=fd, follow_symlinks=False)
            nxt = linux.openat2(fd, part, os.O_RDONLY | os.O_DIRECTORY, 0, RESOLVE_WALK)
            os.close(fd)
            fd = nxt
        leaf = parts[-1]
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
            if (kind == "d" and stat.S_ISDIR(st.st_mode)) or (kind == "f" and stat.S_ISREG(st.st_mode)):
                return
            raise errors.Conflict(f"{rel} exists in a protected copy with another type")
        if kind == "d":
            os.mkdir(leaf, 0o755, dir_fd=fd)
        elif kind == "f":
            os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd))
        else:
            os.symlink(link, leaf, dir_fd=fd)
        os.chown(leaf, owner, owner, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def under(path: str, parent: str) -> bool:
    return path.startswith(parent.rstrip("/") + "/")


def convert_blob(blob: Path, dest: Path, is_dir: bool, owner: int) -> tuple[str, str]:
    """A protected path kept by an older edge (a tar the host built from the sandbox's files)
    as a vault tree; (kind, link text) as copy_out returns."""
    with tarfile.open(blob) as tf:
        if not is_dir:
            member = next((m for m in tf if m.name not in (".", "./")), None)
            if member is None:
                raise errors.InternalError(f"the vault's {blob.name} is empty")
            if member.issym():
                return "l", member.linkname
            if not member.isreg():
                raise errors.InternalError(f"the vault's {blob.name} holds no regular file")
            src = tf.extractfile(member)
            assert src is not None
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out)
                os.fchmod(out.fileno(), member.mode & 0o777)
                os.fchown(out.fileno(), owner, owner)
            return "f", ""
        os.mkdir(dest, 0o700)
        tf.extractall(dest, filter="tar")  # no member lands outside dest; setuid bits cleared
    for dirpath, dirnames, filenames in os.walk(dest):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), owner, owner, follow_symlinks=False)
    os.chown(dest, owner, owner)
    return "d", ""


# --- running -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrustedSpec:
    """What one trusted command gets (see native/dsec-trusted.c for each option)."""

    tool: Path
    lowers: Sequence[Path]
    task_dirs: Sequence[str]
    protected: Sequence[Protected]
    scratch: Path
    seccomp: Path | None
    uid_offset: int  # the layer store's canonical range (layers' owners, and the trusted id's)
    id_base: int  # the sandbox's own range
    tmp_mb: int  # its /tmp, /dev/shm and its writes in the task directories (each)
    cpu: float  # its own cgroup's limits: the sandbox's
    memory_bytes: int
    pids: int


# Variables that make a program load code named in them (a startup file, an agent, options):
# never taken from the image's ENV for a trusted command (the call may still set them).
_CODE_LOADING = frozenset({
    "BASH_ENV", "ENV", "PYTHONSTARTUP", "PYTHONHOME", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS", "PERL5OPT", "RUBYOPT", "PROMPT_COMMAND", "LD_PRELOAD", "LD_AUDIT", "GCONV_PATH",
})  # fmt: skip
# Path lists: of these, an entry in a task directory (the agent's files) or a relative one
# (the cwd's: the caller's choice, maybe a task directory) is left out, the rest kept.
_PATH_LISTS = frozenset({
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "NODE_PATH", "PERL5LIB", "PERLLIB", "RUBYLIB", "CLASSPATH",
    "GEM_PATH", "GEM_HOME", "GOPATH", "R_LIBS", "R_LIBS_USER", "LUA_PATH", "LUA_CPATH", "MANPATH",
})  # fmt: skip
_TOKENS = re.compile(r"[:;,\s=]+")


def _agents(path: str, dirs: Sequence[str]) -> bool:
    """Whether `path` names something the agent may have made: in a task directory, or relative."""
    if not path.startswith("/"):
        return True
    p = posixpath.normpath(path)
    return any(p == d or p.startswith(d.rstrip("/") + "/") for d in dirs)


def clean_env(
    extra: dict[str, str], image_env: dict[str, str] | None = None, task_dirs: Sequence[str] = ()
) -> dict[str, str]:
    """A trusted command's env: the image's ENV (its toolchain's PATH: a conda or JDK image's
    grader finds its tools; the image's, never the sandbox's), HOME a scratch dir, the call's.
    Nothing of the image's ENV may lead to the agent's files: path-list entries in `task_dirs`
    or relative are dropped, a variable naming a path there is dropped, and the variables
    that load code (`_CODE_LOADING`) are not taken from the image at all (an image's
    `ENV PATH=/app/node_modules/.bin:$PATH` would otherwise run the agent's `jest`)."""
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
    for key, value in (image_env or {}).items():
        if key in _CODE_LOADING or (key.startswith("LD_") and key != "LD_LIBRARY_PATH"):
            continue
        if key in _PATH_LISTS:
            kept = [p for p in value.split(":") if p and not _agents(p, task_dirs)]
            if kept:
                env[key] = ":".join(kept)
            continue
        if any(_agents(t, task_dirs) for t in _TOKENS.split(value) if "/" in t or t.startswith(".")):
            continue
        env[key] = value
    return {**env, "HOME": "/tmp", **extra}


class AgentFreeze:
    """The agent's processes (the sandbox's user cgroup, not its init) frozen while trusted
    commands run: one hold per command, frozen at the first and thawed after the last. The
    freeze starts and the thaw ends on the event loop, so no start can follow a thaw out of
    order. A process that joins meanwhile (an exec or session run) is frozen as it joins."""

    def __init__(self, cgroups: CgroupHost) -> None:
        self.cgroups = cgroups
        self._holds: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def hold(self, sandbox_id: str, timeout: float = FREEZE_TIMEOUT_S) -> AsyncIterator[None]:
        n = self._holds.get(sandbox_id, 0)
        self._holds[sandbox_id] = n + 1
        try:
            await self._frozen(sandbox_id, n == 0, timeout)
            yield
        finally:
            self._holds[sandbox_id] -= 1
            if not self._holds[sandbox_id]:
                del self._holds[sandbox_id]
                with contextlib.suppress(OSError):  # (a sandbox stopped meanwhile)
                    self.cgroups.thaw_user(sandbox_id)

    async def _frozen(self, sandbox_id: str, first: bool, timeout: float) -> None:
        end = time.monotonic() + timeout
        try:
            if first:
                self.cgroups.freeze_user(sandbox_id)
            while not self.cgroups.user_frozen(sandbox_id):
                if time.monotonic() > end:
                    raise errors.GraderUnavailable(
                        f"the processes of sandbox {sandbox_id} did not stop within {timeout:g} s "
                        "(one may be stuck in the kernel): the trusted command did not run"
                    )
                await asyncio.sleep(0.001)
        except OSError as e:
            raise errors.GraderUnavailable(
                f"cannot freeze the processes of sandbox {sandbox_id} for a trusted command: {e}"
            ) from e


class _Launch:
    """The helper's descriptors while it starts: those it inherits are closed here once it
    runs (or on failure); ours (the read ends) are handed to the result collection."""

    def __init__(self) -> None:
        self.theirs: list[int] = []
        self.ours: list[int] = []

    def give(self, fd: int) -> int:
        self.theirs.append(fd)
        return fd

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self.ours.append(r)
        self.theirs.append(w)
        return r, w

    def close(self, fds: list[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        fds.clear()


def _helper_args(
    spec: TrustedSpec, container: SandboxHandle, group: ExecGroup, root_fd: int, launch: _Launch
) -> list[str]:
    """Every option but the command's: namespaces, cgroups, layers, mounts, ids."""
    args = []
    for n in _NAMESPACES:
        fd = launch.give(os.open(f"/proc/{container.pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC))
        args += ["--ns", n, str(fd)]
    if not container.alive():  # the pid could have been reused between the check and the opens
        raise errors.SandboxNotRunning(f"sandbox {container.id} is not running")
    for fd in group.fds():  # its own group, and on v1 the sandbox's in the other hierarchies
        args += ["--cgroup", str(fd)]
    args += ["--root", str(launch.give(os.dup(root_fd))), "--scratch", str(spec.scratch)]
    for lower in spec.lowers:
        args += ["--lower", str(lower)]
    for task in spec.task_dirs:
        args += ["--task", task]
    for p in sorted(spec.protected, key=lambda p: (p.path.count("/"), p.path)):
        args += ["--protect", p.kind, p.link if p.kind == "l" else str(p.src), p.path]
    if spec.seccomp is not None:
        args += ["--seccomp", str(launch.give(os.open(spec.seccomp, os.O_RDONLY | os.O_CLOEXEC)))]
    args += ["--ids", str(spec.id_base), str(trusted_host_id(spec.uid_offset)), str(TRUSTED_UID)]
    args += ["--layer-ids", str(spec.uid_offset)]
    args += ["--tmp-mb", str(spec.tmp_mb)]
    return args


def _options_fd(args: Sequence[str]) -> int:
    """A sealed memfd holding the helper's options, each NUL-terminated: what /proc shows of
    the helper (and of its child in the sandbox's pid namespace) is `dsec-trusted <fd>`."""
    return sealed_memfd("dsec-trusted-options", b"".join(a.encode() + b"\0" for a in args))


async def run_trusted(
    spec: TrustedSpec,
    container: SandboxHandle,
    cgroups: CgroupHost,
    group_name: str,
    root_fd: int,
    argv: Sequence[str],
    env: dict[str, str],
    *,
    cwd: str,
    stdin: bytes | None,
    timeout: float,
    cap: int,
    sink: Callable[[str, bytes], None] | None = None,
) -> RawResult:
    """Run `argv` as a trusted command of the sandbox of `container`; its result. The whole
    process tree lives in its own exec cgroup, killed at a timeout, at the output cap, and
    after the command ends (nothing it started outlives it)."""
    t0 = time.perf_counter()
    if not container.alive():
        raise errors.SandboxNotRunning(f"sandbox {container.id} is not running")
    trusted_host_id(spec.uid_offset)
    if any("\0" in a for a in (*argv, *env, *env.values(), cwd)):
        raise errors.InvalidRequest("the command, its environment and cwd cannot hold NUL characters")
    try:
        group = cgroups.open_trusted_group(
            container.id, group_name, cpu=spec.cpu, memory_bytes=spec.memory_bytes, pids=spec.pids
        )
    except OSError as e:
        raise errors.GraderUnavailable(f"cannot create the trusted command's cgroup: {e}") from e
    launch = _Launch()
    try:
        args = _helper_args(spec, container, group, root_fd, launch)
        status_r, status_w = launch.pipe()
        out_r, out_w = launch.pipe()
        err_r, err_w = launch.pipe()
        if stdin:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            launch.ours.append(in_w)
        else:
            in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
        launch.give(in_r)
        args += ["--status", str(status_w), "--cwd", cwd]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        options = launch.give(_options_fd([*args, "--", *argv]))
        inherit = [*launch.theirs, *group.fds()]
        pid, pidfd = spawn_quick([str(spec.tool), str(options)], out_w, err_w, inherit, stdin_fd=in_r, env={})
    except BaseException:
        launch.close(launch.theirs)
        launch.close(launch.ours)
        group.remove()
        raise
    launch.close(launch.theirs)
    group.close_fd()
    outputs = Outputs(out_r, err_r, cap, sink)
    out, err = outputs.out, outputs.err
    status = PipeReader(status_r, 65536)
    try:
        timed_out, helper_rc = await _wait(pid, pidfd, group, outputs, (in_w, stdin), timeout)
    finally:
        status.drain()  # the helper has exited: its whole report is in the pipe
        outputs.close()
        status.close()
        refused = keyed_value(group.path / "pids.events", "max")
        await asyncio.get_running_loop().run_in_executor(None, _end_group, group)
    code = _result(bytes(status.buf), container.id)
    if code is None and not timed_out and helper_rc not in (None, -signal.SIGKILL):
        detail = bytes(err.buf).decode(errors="replace").strip()[-300:]
        raise errors.GraderUnavailable(
            f"the trusted command of sandbox {container.id} could not start "
            f"(helper exit {helper_rc}): {detail}"
        )
    return RawResult(
        stdout=bytes(out.buf),
        stderr=bytes(err.buf),
        exit_code=code if code is not None else 137,
        duration=time.perf_counter() - t0,
        truncated=outputs.truncated,
        timed_out=timed_out,
        pids_limit_hits=refused,
    )


def _end_group(group: ExecGroup) -> None:
    """Kill what is left of the command's tree and remove its cgroups."""
    group.kill()
    group.remove()


async def _wait(
    pid: int, pidfd: int, group: ExecGroup, outputs: Outputs, feed: tuple[int, bytes | None], timeout: float
) -> tuple[bool, int | None]:
    """Wait for the helper (its end, the output cap, or the timeout); kill what is left of the
    command's tree; (whether it timed out, the helper's exit code). The helper is always reaped."""
    loop = asyncio.get_running_loop()
    exited = asyncio.ensure_future(wait_quick(pid, pidfd))
    timed_out = False
    try:
        with outputs.watching(exited, timeout, *feed):
            await outputs.settled
            if not exited.done():
                timed_out = not outputs.truncated
                await loop.run_in_executor(None, group.kill)  # the command and all it started
                try:
                    await wait_for(asyncio.shield(exited), _KILL_WAIT_S)
                except TimeoutError:  # the helper itself hangs (it never should): it is ours to kill
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            # Whatever the command left running goes with it: it must not outlive the call.
            await loop.run_in_executor(None, group.kill)
            with contextlib.suppress(TimeoutError):
                await wait_for(asyncio.gather(outputs.out.eof, outputs.err.eof), 0.5)
            outputs.drain()
    finally:
        if not exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.shield(exited)  # reaped by its own task even if we are cancelled here
    return timed_out, exited.result() if exited.done() and not exited.exception() else None


def _result(report: bytes, sandbox_id: str) -> int | None:
    """The command's exit code from the helper's report; None when it was killed unreported."""
    code = None
    for line in report.decode(errors="replace").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "E":
            raise errors.GraderUnavailable(
                f"the trusted command of sandbox {sandbox_id} could not be set up: {rest}"
            )
        if kind == "X":
            with contextlib.suppress(ValueError):
                code = exit_code(int(rest))
    return code
