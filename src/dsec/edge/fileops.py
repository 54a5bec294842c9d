"""File operations on a sandbox through the edge: reads, writes, edits, listings, deletes,
tar uploads and archives, each logged as a step (the work itself is dsec.edge.files).

A collaborator of `Edge` (edge.py): what it needs of the rest of the edge is passed to its
constructor."""

from __future__ import annotations

import builtins
import contextlib
import io
import tarfile
from collections.abc import Callable, Coroutine
from pathlib import PurePosixPath
from typing import IO, Any

from dsec import errors
from dsec.backends.base import Capability
from dsec.edge.files import MAX_ARCHIVE_ENTRIES, SandboxFiles, off_loop
from dsec.edge.process import RawResult
from dsec.edge.sandbox import Sandbox
from dsec.models import ExecRequest, FileStat


class EdgeFiles:
    """The file API of the edge (see the module)."""

    def __init__(
        self,
        *,
        get: Callable[[str], Sandbox],
        active: Callable[[Sandbox], contextlib.AbstractContextManager[None]],
        run: Callable[..., Coroutine[Any, Any, RawResult]],
    ) -> None:
        self._get = get
        self._active = active  # an operation in flight (EdgeExec._active)
        self._run = run  # the one path of processes started on request (EdgeExec._run)

    # --- files ---------------------------------------------------------------------

    def _with_files(self, sandbox_id: str) -> Sandbox:
        sb = self._get(sandbox_id)
        sb.backend.require(Capability.FILES, "file operations")
        return sb

    # Every file operation counts as activity while it runs (see _active); those that may take
    # long (reads, listings, deletes, archives) run in the file pool, off the event loop.

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        sb = self._with_files(sandbox_id)
        with self._active(sb):
            if sb.guest is not None:
                return await sb.guest.read(path)
            return await sb.files.run(lambda f: f.read(path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        sb = self._with_files(sandbox_id)
        with self._active(sb):
            await (sb.guest or sb.files).write_charged(path, data, mode)

    async def edit_file(self, sandbox_id: str, path: str, old: str, new: str) -> int:
        sb = self._with_files(sandbox_id)
        with self._active(sb):
            return await (sb.guest or sb.files).edit(path, old, new)

    async def stat_file(self, sandbox_id: str, path: str) -> FileStat:
        sb = self._with_files(sandbox_id)
        if sb.guest is not None:
            with self._active(sb):
                return await sb.guest.stat(path)
        return sb.files.stat(path)

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileStat]:
        sb = self._with_files(sandbox_id)
        with self._active(sb):
            if sb.guest is not None:
                return await sb.guest.list(path)
            return await sb.files.run(lambda f: f.list(path))

    async def delete_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        sb = self._with_files(sandbox_id)
        with self._active(sb):
            if sb.guest is not None:
                return await sb.guest.delete(path, recursive)
            await sb.files.run(lambda f: f.delete(path, recursive))

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        """Unpack a tar into `path` with the sandbox's own tar, under its own isolation (so
        charged to it); the archive is checked off the event loop first."""
        sb = self._with_files(sandbox_id)

        new_files: list[str] = []  # regular files the upload makes (removed again if it fails)

        def check(f: SandboxFiles | None = None) -> None:
            size = 0
            try:
                with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                    for n, m in enumerate(tf, 1):
                        if n > MAX_ARCHIVE_ENTRIES:
                            raise errors.PayloadTooLarge(
                                f"the archive holds more than {MAX_ARCHIVE_ENTRIES} entries; split the upload"
                            )
                        size += m.size if m.isreg() else 0
                        if m.isreg() and f is not None and (name := _member_path(path, m.name)):
                            with contextlib.suppress(errors.DsecError, OSError):
                                f.stat(name)
                                continue
                            new_files.append(name)
            except (tarfile.TarError, EOFError) as e:
                raise errors.InvalidRequest(f"upload is not a readable tar archive: {e}") from e
            _room_for(sb, size, path)
            if f is not None:
                f._mkdirs(path)

        with self._active(sb):
            if sb.guest is not None:
                await off_loop(check)
                await sb.guest.mkdirs(path)
            else:
                await sb.files.run(check)
            tar = ExecRequest(
                cmd=["tar", "-x", "-C", path, "-f", "-"], cwd="/", timeout=600, max_output_bytes=65536
            )
            res = await self._run(sb, tar, stdin=data)
            if res.exit_code != 0 and sb.guest is None:
                await sb.files.run(lambda f: _remove(f, new_files))
        if res.exit_code != 0:
            msg = res.stderr.decode(errors="replace").strip()[-500:]
            if any(m in msg for m in _NO_ROOM) or res.exit_code == 128 + 9:  # (the OOM killer)
                raise errors.QuotaExceeded(
                    f"unpacking the tar into {path} ran out of room (disk_mb {sb.record.spec.disk_mb}, "
                    f"memory_mb {sb.record.spec.memory_mb}); nothing it added was kept: free some, "
                    "upload less, or create the sandbox with more"
                )
            raise errors.InvalidRequest(f"unpacking the tar into {path} failed: {msg or res.exit_code}")

    async def archive(self, sandbox_id: str, path: str) -> IO[bytes]:
        """A tar of `path` in an unlinked spool file (rewound; the caller closes it), built on
        the host from the sandbox's files without following links or leaving its root mount,
        capped at MAX_ARCHIVE bytes of file data (a sparse or huge file: a clear 413)."""
        sb = self._with_files(sandbox_id)
        with self._active(sb):
            if sb.guest is not None:
                return await sb.guest.archive(path)
            return await sb.files.run(lambda f: f.archive(path))

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        spool = await self.archive(sandbox_id, path)
        with spool:
            return await off_loop(spool.read)


# What GNU tar says when the sandbox's disk or memory is full (a short write, on a full tmpfs).
_NO_ROOM = ("No space left", "Disk quota", "Wrote only", "Cannot allocate memory")

# What a sandbox keeps free for its own processes when the platform writes files into memory.
MEMORY_RESERVE = 16 << 20


def _room_for(sb: Sandbox, nbytes: int, path: str) -> None:
    """Refuse, before anything is written, files that would not fit in the sandbox's memory
    when its writable layer lives there (a container's tmpfs upper): past memory_mb the
    cgroup's OOM killer would take the sandbox's own processes, init included."""
    if sb.guest is not None:  # a VM: its files are on a disk, a full one answers ENOSPC
        return
    used = sb.backend.cgroups.memory_bytes(sb.id)
    if used is None:
        return
    limit = sb.record.spec.memory_mb << 20
    room = limit - used - MEMORY_RESERVE
    if nbytes > room:
        raise errors.QuotaExceeded(
            f"writing {nbytes >> 20} MiB to {path} would not fit: the sandbox's files live in its "
            f"memory (memory_mb={sb.record.spec.memory_mb}, {used >> 20} MiB in use, "
            f"{max(room, 0) >> 20} MiB free for files); free some, write less, or create it with more"
        )


def _member_path(dest: str, name: str) -> str | None:
    """Where the sandbox's tar puts member `name` under `dest` (None: a name it refuses)."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("/", ".")]
    if not parts or ".." in parts:
        return None
    return str(PurePosixPath(dest, *parts))


def _remove(f: SandboxFiles, paths: builtins.list[str]) -> None:
    for p in paths:
        with contextlib.suppress(errors.DsecError, OSError):
            f.delete(p)
