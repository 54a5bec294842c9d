"""Trusted execs (verify, an exec marked ``trusted``) where the edge cannot run the command as
a host process beside the sandbox's (dsec.edge.trusted): a gVisor sandbox's processes live in
its sentry's kernel, a microVM's in a guest kernel the agent, root there, may own. A grader
there could trust nothing the sandbox shows it, so it runs in a **fresh sandbox of the same
backend** (`Backend.trusted_in_fresh_sandbox`), which shares no sentry or guest kernel, no
process and no file with the agent's:

- its root: the toolkit and the image's own layers (never a snapshot's layer, a fork's or a
  checkpoint's: the agent's writes), under an empty writable layer;
- the task directories (default /work): the agent's, copied in as data. The edge takes an
  archive of each out of the agent's sandbox (a gVisor sandbox's by its own walk of the
  files, following nothing; a microVM's by its agent's own archiver, `Backend.archive_tree`:
  no tool of the image, outside the user's cgroup, the disk's writers held) through
  `dsec.edge.tarcheck.CleanTar` (nothing through a link, links written last; their targets
  kept as data, `any_link_target`), and the fresh sandbox's own tar (the image's, which
  nothing of the agent touched) unpacks it into the emptied directory;
- the protected paths: from the host's vault, root's, each readable and executable as its
  owner had it and writable by nobody the command runs as (the container backend binds
  them read-only); where the agent left a link or a file in place of a parent inside a task
  directory, a directory replaces it first;
- the command: uid 65533, no capabilities, the sandbox's seccomp profile and limits (plus
  room for the copied files), a clean environment, no network (its loopback only). Its exit
  status is the fresh sandbox's init's waitpid, its output its pipes; the sandbox is
  destroyed after it, with everything it started.

The agent cannot see it, signal it or share its CPU quota, memory or pids; it changes only
its own files, which the command reads as data (a grader should still open them with
O_NOFOLLOW, as on every backend). On a microVM the archiver runs under a guest kernel the
agent may own: what it can then make the command see is what it could have written into
its files, or nothing (the call fails: `grader_unavailable`, an environment fault, never an
exit code). Differences from the container backend: the task files are a copy
taken when the command starts (a live agent's later writes are not seen; `verify` kills it
first anyway), bounded (`MAX_COPY_BYTES`, `MAX_COPY_ENTRIES`, or the sandbox's own disk
quota beyond those), and the command cannot reach the agent's live processes (its network
and its loopback are its own). Its image needs `sh` and `tar`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import secrets
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from dsec import errors
from dsec.aio import wait_for
from dsec.backends.base import SandboxHandle, SandboxPlan
from dsec.backends.shim import Launch
from dsec.edge.core import EdgeCore, EdgePart
from dsec.edge.files import MAX_ARCHIVE, MAX_ARCHIVE_ENTRIES, off_loop
from dsec.edge.process import PipeReader, RawResult, run_process, spawn
from dsec.edge.sandbox import Sandbox
from dsec.edge.tarcheck import CleanTar, rebuild
from dsec.edge.trusted import TRUSTED_UID, Protected, convert_blob, trusted_lowers
from dsec.isolation.cgroups import PID_RESERVE, CgroupHost
from dsec.isolation.procs import sealed_memfd
from dsec.isolation.spec import DEFAULT_PATH, Limits
from dsec.layers.store import Image
from dsec.models import SandboxSpec

log = logging.getLogger("dsec.edge")

MAX_COPY_BYTES = MAX_ARCHIVE  # file data of the task directories, at least (or the disk quota)
MAX_COPY_ENTRIES = MAX_ARCHIVE_ENTRIES  # their entries, at least (or the inode quota)
UNPACK_TIMEOUT_S = 600.0
_MIB = 1 << 20
# A channel that carries stdin as bytes (a microVM's) holds at most 16 MiB the process has
# not read yet: a larger archive goes in pieces to a file of the fresh sandbox first.
STREAM_MAX = 8 << 20
# What the fresh sandbox's own shell runs, the archive "$1" ("-": stdin; "": none): a task
# directory emptied, then unpacked into...
_TASK = (
    'src=$1; shift; rm -rf -- "$1" && mkdir -p -- "$1" || exit 1; '
    '[ -z "$src" ] || tar -x --numeric-owner -C "$1" -f "$src" || exit 1; '
    'case $src in /*) rm -f -- "$src";; esac'
)
# ... and the protected paths: parents inside task directories made directories (where the
# agent left a link or a file), the paths themselves removed, then the vault's copies.
_PROTECTED = (
    'src=$1; shift; fix=1; for a; do if [ "$a" = -- ]; then fix=0; continue; fi; '
    'if [ $fix = 1 ]; then { [ -L "$a" ] || { [ -e "$a" ] && [ ! -d "$a" ]; }; } && rm -f -- "$a"; '
    '[ -d "$a" ] || mkdir -- "$a" || exit 1; else rm -rf -- "$a" || exit 1; fi; done; '
    'tar -x --numeric-owner -C / -f "$src" || exit 1; case $src in /*) rm -f -- "$src";; esac'
)
_APPEND = 'cat >> "$1"'


class GraderSandboxes(EdgePart):
    """Runs trusted commands in fresh sandboxes (see the module)."""

    def __init__(
        self,
        core: EdgeCore,
        *,
        toolkit: Callable[[], list[str]],
        image: Callable[[str], Image],
        new_id: Callable[[], str],
        making: dict[str, SandboxSpec],
    ) -> None:
        super().__init__(core)
        self._toolkit = toolkit  # the layers every sandbox gets on top
        self._image = image
        self._new_id = new_id
        # the sandboxes being made (EdgeLifecycle's): a grader's is one while it lives, so it
        # counts in the edge's load, holds its image and is no orphan to the reconciler
        self._making = making

    async def run(
        self,
        sb: Sandbox,
        dirs: Sequence[str],
        protected: Sequence[Protected],
        argv: list[str],
        env: dict[str, str],
        *,
        cwd: str,
        group_name: str,
        stdin: bytes | None,
        timeout: float,
        cap: int,
        sink: Callable[[str, bytes], None] | None = None,
    ) -> RawResult:
        """Run `argv` in a fresh sandbox holding the task directories `dirs` of `sb` and its
        `protected` paths; its result."""
        t0 = time.perf_counter()
        with contextlib.ExitStack() as spools:
            copies = [(d, await self._task_archive(sb, d, spools)) for d in dirs]
            try:
                shown = await off_loop(lambda: _protected_archive(protected, spools))
            except OSError as e:
                raise errors.GraderUnavailable(
                    f"the trusted command of sandbox {sb.id} could not be set up: its protected paths "
                    f"are not all in the host's vault ({e})"
                ) from e
            size = sum(_size(a) for _, a in copies) + _size(shown)
            handle, gid = await self._fresh(sb, size)
            t1 = time.perf_counter()
            try:
                for d, archive in copies:
                    await _unpack(handle, self.cgroups, group_name, _TASK, [d], archive)
                if protected:
                    await _unpack(
                        handle, self.cgroups, group_name, _PROTECTED, _fix_args(protected, dirs), shown
                    )
                spools.close()
                t2 = time.perf_counter()
                # As dsec-trusted execs it: a program that is not there is status 127, not a 400
                run = argv if argv[:2] == ["/bin/sh", "-c"] else ["/bin/sh", "-c", 'exec "$@"', "sh", *argv]
                raw = await run_process(
                    handle,
                    self.cgroups,
                    group_name,
                    Launch(run, env, cwd=cwd, uid=TRUSTED_UID, gid=TRUSTED_UID),
                    stdin=stdin,
                    timeout=timeout,
                    cap=cap,
                    sink=sink,
                )
            finally:
                await asyncio.shield(self._end(sb, handle, gid))
        log.debug(
            "trusted exec of %s in %s: %d bytes copied out in %.0f ms, in %.0f ms; command %.0f ms",
            sb.id, gid, size, (t1 - t0) * 1000, (t2 - t1) * 1000, raw.duration * 1000,
        )  # fmt: skip
        return raw

    async def _task_archive(self, sb: Sandbox, path: str, spools: contextlib.ExitStack) -> IO[bytes] | None:
        """The agent's task directory as a checked archive (None: no directory there; the
        command then sees an empty one, as on the container backend)."""
        spec = sb.record.spec
        most = max(MAX_COPY_BYTES, spec.disk_mb * _MIB)
        entries = max(MAX_COPY_ENTRIES, spec.disk_inodes)
        try:
            if sb.guest is not None:
                spool, kind = await guest_archive(sb, path, most, entries)
                spools.callback(spool.close)
                return spool if kind == "d" else None
            if sb.files.stat(path).type != "dir":
                return None
            spool = await sb.files.run(
                lambda f: f.archive(path, most, max_entries=entries, any_link_target=True)
            )
        except errors.FileNotFound:
            return None
        except (errors.InvalidRequest, errors.PathEscape, errors.InternalError) as e:
            # (what the agent did to its files: the copy fails, and with it the command, never
            # with an exit code)
            raise errors.GraderUnavailable(
                f"the task directory {path} of sandbox {sb.id} cannot be copied for its trusted command "
                f"(it runs in a sandbox of its own on the {sb.backend.name} backend): {e.message}"
            ) from e
        spools.callback(spool.close)
        return spool

    async def _fresh(self, sb: Sandbox, copied: int) -> tuple[SandboxHandle, str]:
        """A fresh sandbox of `sb`'s backend and image, with room for `copied` bytes more."""
        spec, backend = sb.record.spec, sb.backend
        # Whole multiples of the sandbox's disk (a microVM's template is per disk size).
        staged = 0 if sb.handle.channel.passes_fds else copied  # (a piece-by-piece copy: see _unpack)
        disk = spec.disk_mb * (1 + -(-(copied + staged) // (spec.disk_mb * _MIB)))
        in_memory = backend.host_files and spec.storage == "memory"  # (a tmpfs: its pages are memory)
        memory = spec.memory_mb + (disk - spec.disk_mb if in_memory else 0)
        gid = self._new_id()
        lowers = [self.layers.layer_path(r) for r in self._toolkit()]
        lowers += trusted_lowers(self.layers, self._image(spec.image))
        plan = SandboxPlan(
            gid,
            lowers,
            Limits(spec.cpu, memory, spec.pids + PID_RESERVE),
            disk,
            {"PATH": DEFAULT_PATH, "HOSTNAME": gid},
            spec.disk_inodes * (disk // spec.disk_mb),
            spec.storage,
            spec.pids,
        )
        self._making[gid] = spec.model_copy(update={"memory_mb": memory, "disk_mb": disk})
        try:
            return await backend.create(plan), gid
        except errors.DsecError as e:
            self._making.pop(gid, None)
            raise errors.GraderUnavailable(
                f"the sandbox for the trusted command of sandbox {sb.id} could not start: {e.message}"
            ) from e
        except BaseException:
            self._making.pop(gid, None)
            raise

    async def _end(self, sb: Sandbox, handle: SandboxHandle, gid: str) -> None:
        try:
            await sb.backend.destroy(handle)
        except Exception:
            log.exception("removing the trusted command's sandbox %s of %s failed", gid, sb.id)
        finally:
            self._making.pop(gid, None)


async def _unpack(
    handle: SandboxHandle,
    cgroups: CgroupHost,
    group_name: str,
    script: str,
    args: list[str],
    archive: IO[bytes] | None,
) -> None:
    """Run `script` (the image's own sh and tar) as the fresh sandbox's root with `archive`
    (on its stdin, or where a channel carries stdin as bytes and it is larger than
    STREAM_MAX, in a file of the sandbox made piece by piece); a failure is the platform's
    (`grader_unavailable`), with what the tools said."""
    src = "" if archive is None else "-"
    size = _size(archive)
    if archive is not None and not handle.channel.passes_fds and size > STREAM_MAX:
        src = f"/tmp/.dsec-in-{secrets.token_hex(8)}.tar"
        for at in range(0, size, STREAM_MAX):
            piece = os.pread(archive.fileno(), STREAM_MAX, at)
            with contextlib.closing(_Fd(sealed_memfd("dsec-task-piece", piece))) as fd:
                await _tool(handle, cgroups, group_name, ["sh", "-c", _APPEND, "sh", src], fd.fd)
        archive = None
    elif archive is not None:
        os.lseek(archive.fileno(), 0, os.SEEK_SET)
    with contextlib.closing(_Fd(archive.fileno() if archive is not None else -1, own=False)) as fd:
        await _tool(handle, cgroups, group_name, ["sh", "-c", script, "sh", src, *args], fd.fd)


class _Fd:
    def __init__(self, fd: int, *, own: bool = True) -> None:
        self.fd, self.own = fd, own

    def close(self) -> None:
        if self.own and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


async def _tool(
    handle: SandboxHandle, cgroups: CgroupHost, group_name: str, argv: list[str], stdin: int
) -> None:
    """One tool of the fresh sandbox, as its root, `stdin` on its stdin (-1: /dev/null)."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    nul = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    err = PipeReader(err_r, 4096)
    try:
        launch = Launch(argv, {"PATH": DEFAULT_PATH, "LC_ALL": "C"}, "/", 0, 0)
        stdio = (os.dup(stdin if stdin >= 0 else nul), os.dup(nul), err_w)
        proc = await spawn(handle, cgroups, f"{group_name}-in", launch, stdio=stdio)
        try:  # (on a timeout the sandbox is destroyed, with it)
            status = await wait_for(asyncio.shield(proc.exited), UNPACK_TIMEOUT_S)
        except TimeoutError:
            raise errors.GraderUnavailable(
                "copying the task's files into the trusted command's sandbox took over "
                f"{UNPACK_TIMEOUT_S:.0f} s"
            ) from None
        with contextlib.suppress(TimeoutError):
            await wait_for(asyncio.shield(err.eof), 1.0)
        err.drain()
    except errors.InvalidRequest as e:  # (no sh in the image)
        raise errors.GraderUnavailable(
            f"the trusted command's sandbox cannot take the task's files: {e.message}"
        ) from e
    finally:
        err.close()
        os.close(nul)
    if status != 0:
        said = bytes(err.buf).decode(errors="replace").strip()[-400:]
        raise errors.GraderUnavailable(
            f"the trusted command's sandbox could not take the task's files (status {status}; the "
            f"image needs sh and tar): {said}"
        )


async def guest_archive(sb: Sandbox, path: str, most: int, entries: int) -> tuple[IO[bytes], str]:
    """`path` of a sandbox whose files the host cannot reach (a microVM), written by its
    backend's own archiver (no tool of the image, which the agent may have replaced; not in
    its cgroup, so whatever pids it holds) with its writes held, then parsed and rebuilt
    (dsec.edge.tarcheck; link targets kept as text); (the clean archive, rewound; what the
    path is: d, f or l). errors.FileNotFound where no link-free path leads there."""
    what = f"the archive of {path}"
    with tempfile.TemporaryFile(prefix="dsec-guest-tree-") as raw:
        try:
            await sb.backend.archive_tree(sb.handle, path, raw.fileno(), most + entries * 1024)
        except FileNotFoundError as e:
            raise errors.FileNotFound(f"{path} does not exist in the sandbox (or lies through a link)") from e
        except errors.CapacityExhausted as e:
            raise errors.PayloadTooLarge(f"{path} holds more than {most} bytes") from e
        raw.seek(0)
        spool = tempfile.TemporaryFile(prefix="dsec-guest-tree-")  # noqa: SIM115 - handed to the caller
        try:
            kind = await off_loop(lambda: _rebuilt(raw, spool, what, most, entries))
        except BaseException:
            spool.close()
            raise
    return spool, kind


def _rebuilt(raw: IO[bytes], spool: IO[bytes], what: str, most: int, entries: int) -> str:
    try:
        with tarfile.open(fileobj=raw, mode="r|") as tf:
            first = next(iter(tf), None)
    except (tarfile.TarError, EOFError) as e:
        raise errors.InvalidRequest(f"{what}: not a tar archive ({e})") from e
    kind = "d" if first is not None and first.isdir() and first.name in (".", "./") else "f"
    if first is not None and first.issym():
        kind = "l"
    raw.seek(0)
    rebuild(raw, spool, what, most, entries, any_link_target=True)
    spool.seek(0)
    return kind


async def copy_out_of_guest(sb: Sandbox, path: str, dest: Path, owner: int) -> tuple[str, str]:
    """protect() of a sandbox whose files the host cannot reach (a microVM): its archiver's
    tar of `path` (guest_archive), unpacked into the vault at `dest` as `owner`'s
    (dsec.edge.trusted.convert_blob), which then holds it as it holds a host-side copy;
    nothing on the host follows a link in it. (kind, link text) as trusted.copy_out."""
    blob = dest.with_name(dest.name + ".tar")
    spool, kind = await guest_archive(sb, path, MAX_ARCHIVE, MAX_ARCHIVE_ENTRIES)
    with spool:
        await off_loop(lambda: _spool_to(spool, blob))
    try:
        return await off_loop(lambda: convert_blob(blob, dest, kind == "d", owner))
    finally:
        blob.unlink(missing_ok=True)


def _spool_to(spool: IO[bytes], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(spool, out)


def _size(spool: IO[bytes] | None) -> int:
    return os.fstat(spool.fileno()).st_size if spool is not None else 0


def _task_of(path: str, dirs: Sequence[str]) -> str | None:
    return next((d for d in dirs if path.startswith(d.rstrip("/") + "/")), None)


def _fix_args(protected: Sequence[Protected], dirs: Sequence[str]) -> list[str]:
    """The protected paths' parents that lie inside a task directory (the agent's: each made
    a directory where it is not one), shallow first; then "--" and the paths themselves."""
    parents: dict[str, None] = {}
    for p in sorted(protected, key=lambda p: (p.path.count("/"), p.path)):
        task = _task_of(p.path, dirs)
        if task is None:
            continue
        parent = posixpath.dirname(p.path)
        chain = []
        while parent != task and parent.startswith(task + "/"):
            chain.append(parent)
            parent = posixpath.dirname(parent)
        parents.update(dict.fromkeys(reversed(chain)))
    return [*parents, "--", *(p.path for p in protected)]


def _shown_mode(mode: int) -> int:
    """The owner's read and execute bits for everyone, write for nobody but root: the command
    reads a protected file as its owner could, and changes nothing of it."""
    rx = (mode >> 6) & 0o5
    return (mode & 0o700) | (rx << 3) | rx


def _protected_archive(protected: Sequence[Protected], spools: contextlib.ExitStack) -> IO[bytes] | None:
    """One archive of every protected path from the vault (ours: trees the edge copied),
    named from /, root's, with `_shown_mode`; a path protected inside another comes from its
    own copy (the outer copy holds only its mount point there)."""
    if not protected:
        return None
    spool = tempfile.TemporaryFile(prefix="dsec-protected-")  # noqa: SIM115 - closed by `spools`
    spools.callback(spool.close)
    paths = [p.path for p in protected]
    with CleanTar(spool, "the protected paths", 1 << 62, 1 << 40, any_link_target=True) as tf:
        for p in sorted(protected, key=lambda p: (p.path.count("/"), p.path)):
            inner = [q for q in paths if q != p.path and q.startswith(p.path.rstrip("/") + "/")]
            for name, info, src in _members(p):
                full = "/" + name
                if any(full == q or full.startswith(q + "/") for q in inner):
                    continue
                if src is None:
                    tf.addfile(info)
                else:
                    with open(src, "rb") as f:  # (the vault's own file, made by the edge)
                        tf.addfile(info, f)
    spool.seek(0)
    return spool


def _members(p: Protected) -> Iterator[tuple[str, tarfile.TarInfo, str | None]]:
    """The members of one protected path: (name, header, file to read or None)."""
    name = p.path.lstrip("/")
    if p.kind == "l":
        info = _info(name, tarfile.SYMTYPE, 0o777)
        info.linkname = p.link
        yield name, info, None
        return
    if p.src is None:
        return
    st = os.lstat(p.src)
    if p.kind == "f":
        info = _info(name, tarfile.REGTYPE, st.st_mode)
        info.size = st.st_size
        yield name, info, str(p.src)
        return
    yield name, _info(name, tarfile.DIRTYPE, st.st_mode), None
    for top, subdirs, files in os.walk(p.src):  # (never through a link: followlinks is off)
        rel = os.path.relpath(top, p.src)
        for entry in sorted(subdirs) + sorted(files):
            path = os.path.join(top, entry)
            member = posixpath.normpath(posixpath.join(name, rel, entry))
            est = os.lstat(path)
            if stat.S_ISLNK(est.st_mode):
                info = _info(member, tarfile.SYMTYPE, 0o777)
                info.linkname = os.readlink(path)
                yield member, info, None
            elif stat.S_ISDIR(est.st_mode):
                yield member, _info(member, tarfile.DIRTYPE, est.st_mode), None
            elif stat.S_ISREG(est.st_mode):
                info = _info(member, tarfile.REGTYPE, est.st_mode)
                info.size = est.st_size
                yield member, info, path
        subdirs.sort()


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = _shown_mode(stat.S_IMODE(mode)) if kind != tarfile.SYMTYPE else 0o777
    info.uid = info.gid = 0
    info.mtime = int(time.time())
    return info
