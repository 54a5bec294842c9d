"""The file API of a sandbox whose files the host cannot reach (a microVM: its writable
layer is a disk only its own kernel mounts, and the host never parses a file system a guest
wrote). Each operation is a process inside the sandbox, started like an exec as its root:
the image's own coreutils, findutils and tar, whose output comes back through the backend's
channel. What a sandbox could make them say is what it could have written into its files
anyway, so nothing here is trusted beyond that: sizes are capped on the host side, names
travel NUL-separated, paths are argv (never shell text), the tools are looked up on the
distribution's PATH only (not /usr/local/bin) and a call ends within TOOL_TIMEOUT_S. What
they print is checked before it leaves the edge: a listing's names and every stat's numbers
(`_plausible`), and an archive is parsed and rebuilt (dsec.edge.tarcheck), never forwarded
as the guest wrote it (its tar may write anything: absolute names, `..`, links out).

The semantics follow `dsec.edge.files.SandboxFiles` (the host-side implementation): the
same errors for the same conditions, listings sorted and capped, deletes that refuse a
non-empty directory without `recursive`, archives capped, new files owned by the sandbox's
user."""

from __future__ import annotations

import io
import math
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import PurePosixPath
from typing import IO

from dsec import errors
from dsec.edge.files import MAX_ARCHIVE_ENTRIES, MAX_LIST, MAX_READ, _norm, off_loop, replace_once
from dsec.edge.process import RawResult
from dsec.edge.tarcheck import rebuild
from dsec.models import ExecRequest, FileStat

Runner = Callable[[ExecRequest, bytes | None, int], Awaitable[RawResult]]

TOOL_TIMEOUT_S = 60  # a tool that hangs (the sandbox replaced it) holds a file call this long at most
# the distribution's tools, not what the sandbox put first on its PATH (/usr/local/bin)
_TOOL_ENV = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}

# `find -printf` of one entry: type, size, permission bits (octal), mtime, uid, gid, name
_STAT = r"%y\t%s\t%m\t%T@\t%U\t%G\t%f\0"
_TYPES = {"f": "file", "d": "dir", "l": "symlink"}
_WRITE = (
    'set -e; umask 022; mkdir -p -- "$(dirname -- "$1")"; '
    'if [ -d "$1" ] && [ ! -L "$1" ]; then echo "$1: Is a directory" >&2; exit 1; fi; '
    'cat > "$1"; chmod "$2" -- "$1"; [ "$3" = 0:0 ] || chown -h -- "$3" "$1"'
)
_DELETE = (
    'if [ -d "$1" ] && [ ! -L "$1" ]; then '
    'if [ "$2" = 1 ]; then exec rm -rf --one-file-system -- "$1"; else exec rmdir -- "$1"; fi; '
    'else exec rm -- "$1"; fi'
)


def _error(res: RawResult, path: str) -> errors.DsecError:
    """What a tool's failure means, in the host implementation's terms."""
    msg = res.stderr.decode(errors="replace").strip()
    if "No such file" in msg:
        return errors.FileNotFound(f"{path} does not exist in the sandbox")
    if "Is a directory" in msg:
        return errors.InvalidRequest(f"{path} is a directory; give a file path")
    if "Not a directory" in msg:
        return errors.InvalidRequest(f"a parent of {path} is not a directory")
    if "Directory not empty" in msg:
        return errors.Conflict(f"{path} is a non-empty directory; pass recursive=true")
    if "No space left" in msg or "Disk quota" in msg:
        return errors.QuotaExceeded(f"no space left writing {path}: the sandbox's disk_mb is full")
    if "Permission denied" in msg or "Operation not permitted" in msg or "Read-only" in msg:
        return errors.Forbidden(f"permission denied on {path}")
    if "Too many levels of symbolic links" in msg:
        return errors.PathEscape(f"{path} resolves through a link that loops")
    return errors.InvalidRequest(f"{path}: {msg[-300:] or f'exit code {res.exit_code}'}")


def _stat(fields: bytes, path: str | None = None) -> FileStat:
    """One `find -printf _STAT` entry: the stat of `path`, or of the entry it names in
    directory `path` (with `path` its parent: a listing)."""
    try:
        kind, size, mode, mtime, uid, gid, name = fields.decode(errors="surrogateescape").split("\t", 6)
        st = _file_stat(kind, int(size), int(mode, 8), float(mtime), int(uid), int(gid), name, path)
        _plausible(st, listing=path is None)
        return st
    except ValueError as e:  # the image's find is not GNU find, or something replaced it
        raise errors.InvalidRequest(
            f"the sandbox's find printed {fields[:80]!r}, not a file's metadata ({e}); "
            "the file API needs GNU findutils in the image"
        ) from e


def _plausible(st: FileStat, listing: bool) -> None:
    """What the sandbox's find printed is checked like any of its output: numbers a file
    can have, and in a listing a name of one entry (no '/', '.', '..' or nothing)."""
    if not 0 <= st.size < 2**63:
        raise ValueError(f"size {st.size}")
    if not 0 <= st.mode <= 0o7777:
        raise ValueError(f"mode {st.mode:o}")
    if not (math.isfinite(st.mtime) and abs(st.mtime) < 2**40):
        raise ValueError(f"mtime {st.mtime}")
    if not (0 <= st.uid < 2**32 and 0 <= st.gid < 2**32):
        raise ValueError(f"owner {st.uid}:{st.gid}")
    if listing and (st.name in ("", ".", "..") or "/" in st.name):
        raise ValueError(f"entry name {st.name[:80]!r}")


def _file_stat(
    kind: str, size: int, mode: int, mtime: float, uid: int, gid: int, name: str, path: str | None
) -> FileStat:
    return FileStat(
        path=path if path is not None else name,
        name=PurePosixPath(path).name or "/" if path is not None else name,
        type=_TYPES.get(kind, "other"),  # type: ignore[arg-type]
        size=size,
        mode=mode,
        mtime=mtime,
        uid=uid,
        gid=gid,
    )


class GuestFiles:
    """The file API through processes inside the sandbox (see the module)."""

    def __init__(self, run: Runner, uid: int, gid: int) -> None:
        self._run = run  # an exec as the sandbox's root: (request, stdin, output cap) -> result
        self.uid, self.gid = uid, gid  # owner of new files: the sandbox's user

    async def _tool(
        self, argv: list[str], path: str, stdin: bytes | None = None, cap: int = 65536
    ) -> RawResult:
        req = ExecRequest(cmd=argv, cwd="/", user="0", timeout=TOOL_TIMEOUT_S, env=_TOOL_ENV)
        res = await self._run(req, stdin, cap)  # the cap of both output streams
        if res.timed_out:
            raise errors.InvalidRequest(f"the file operation on {path} did not finish in time")
        if res.exit_code != 0 and not res.truncated:  # (a tool stopped at the cap: the caller says)
            raise _error(res, path)
        return res

    async def read(self, path: str, max_bytes: int = MAX_READ) -> bytes:
        path = _norm(path)
        res = await self._tool(["cat", "--", path], path, cap=max_bytes)
        if res.truncated:
            raise errors.PayloadTooLarge(
                f"{path} is larger than {max_bytes} bytes; read it in parts with exec, or download it"
            )
        return res.stdout

    async def write_charged(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Written by a process of the sandbox: charged to it, as on the host."""
        path = _norm(path)
        if path == "/":
            raise errors.InvalidRequest("/ is a directory; give a file path")
        owner = f"{self.uid}:{self.gid}"
        await self._tool(["/bin/sh", "-c", _WRITE, "sh", path, f"{mode & 0o7777:o}", owner], path, data)

    async def edit(self, path: str, old: str, new: str) -> int:
        """Replace the single occurrence of `old` with `new`; returns the new size."""
        path = _norm(path)
        data = replace_once(await self.read(path), path, old, new)
        await self.write_charged(path, data, (await self.stat(path)).mode)
        return len(data)

    async def stat(self, path: str) -> FileStat:
        path = _norm(path)
        res = await self._tool(["find", path, "-maxdepth", "0", "-printf", _STAT], path)
        return _stat(res.stdout.rstrip(b"\0"), path)

    async def list(self, path: str, max_entries: int = MAX_LIST) -> list[FileStat]:
        """The entries of a directory, sorted by name; more than `max_entries` is refused."""
        path = _norm(path)
        # the trailing slash: a link to a directory is listed as that directory, as on the host
        argv = ["find", path.rstrip("/") + "/", "-mindepth", "1", "-maxdepth", "1", "-printf", _STAT]
        res = await self._tool(argv, path, cap=(max_entries + 1) * 400)
        entries = [e for e in res.stdout.split(b"\0") if e]
        if len(entries) > max_entries or res.truncated:
            raise errors.PayloadTooLarge(
                f"{path} has more than {max_entries} entries; list a subdirectory, or use "
                f"exec (e.g. `ls {path} | head`) or the archive download"
            )
        out = [_stat(e) for e in entries]
        if len({st.name for st in out}) != len(out):
            raise errors.InvalidRequest(f"the sandbox's find listed an entry of {path} twice")
        for st in out:
            st.path = str(PurePosixPath(path) / st.name)
        return sorted(out, key=lambda st: st.name)

    async def delete(self, path: str, recursive: bool = False) -> None:
        path = _norm(path)
        if PurePosixPath(path) == PurePosixPath("/"):
            raise errors.InvalidRequest("refusing to delete /")
        await self._tool(["/bin/sh", "-c", _DELETE, "sh", path, "1" if recursive else "0"], path)

    async def mkdirs(self, path: str) -> None:
        path = _norm(path)
        await self._tool(["mkdir", "-p", "--", path], path)

    async def archive(self, path: str, max_bytes: int = MAX_READ) -> IO[bytes]:
        """A tar of `path` (a directory's contents, or one file or link) made by the image's
        tar inside and rebuilt here (dsec.edge.tarcheck) into an unlinked spool file
        (rewound); beyond `max_bytes`, a clear 413. (It passes through the edge's memory:
        capped at MAX_READ, not the host archive's MAX_ARCHIVE.)"""
        path = _norm(path)
        st = await self.stat(path)
        pp = PurePosixPath(path)
        if st.type == "dir":
            argv = ["tar", "-c", "--one-file-system", "-C", path, "."]
        else:
            argv = ["tar", "-c", "-C", str(pp.parent), "--", pp.name]
        res = await self._tool(argv, path, cap=max_bytes)
        if res.truncated:
            raise errors.PayloadTooLarge(
                f"{path} holds more than {max_bytes} bytes; archive a subdirectory, or use exec"
            )
        spool = tempfile.TemporaryFile(prefix="dsec-archive-")  # noqa: SIM115 - handed to the caller
        try:  # the guest's tar is the agent's: parsed and rebuilt, never forwarded as it came
            what = f"the archive of {path}"
            await off_loop(
                lambda: rebuild(io.BytesIO(res.stdout), spool, what, max_bytes, MAX_ARCHIVE_ENTRIES)
            )
            spool.seek(0)
            return spool
        except BaseException:
            spool.close()
            raise
