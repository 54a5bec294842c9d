"""File operations on a sandbox's root filesystem, from the host, without escapes.

Every path is resolved with openat2(2) relative to an O_PATH descriptor of the
sandbox's rootfs, with RESOLVE_IN_ROOT (symlinks and `..` cannot climb out of
the root), RESOLVE_NO_MAGICLINKS (no /proc/<pid>/root style jumps) and
RESOLVE_NO_XDEV (never cross into another mount). Hard links cannot point
outside either: the overlay holds only the sandbox's own files, and writes
through it copy up instead of touching a lower layer. Files we create are
owned by the sandbox user's mapped id.

Hostile content, bounded work:

* Only regular files are read or written, opened with O_NONBLOCK and checked
  with fstat (a FIFO, socket or device is refused by name, never waited on).
* A read takes at most its cap + 1 bytes from the open descriptor, so a file
  that grows between the size check and the read cannot push past the cap.
* Writes are charged to the sandbox: the edge opens (and creates) the file,
  then the sandbox's init forks a child, inside the sandbox's cgroups, that
  copies the data from a pipe into that descriptor (see dsec-shim.c, 'W').
  Its pages count against the sandbox's memory limit, like a write by its own
  processes; no sandbox binary runs, and the path was resolved by us.
* Listings stop at MAX_LIST entries; recursive deletes never cross a mount
  (each directory is opened with RESOLVE_NO_XDEV); archives are built here,
  on the host, from the same descriptors (never with the sandbox's own tar),
  through `dsec.edge.tarcheck.CleanTar` into a bounded spool file.
* Everything that may take long (reads, listings, deletes, archives) runs in
  a small thread pool of its own, off the event loop, on a duplicate of the
  root descriptor (so a sandbox stopped meanwhile cannot make it resolve
  against a recycled descriptor number).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import os
import signal
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import IO, TYPE_CHECKING, Any, TypeVar

from dsec import errors
from dsec.aio import wait_for
from dsec.edge.tarcheck import CleanTar
from dsec.isolation import linux
from dsec.isolation.procs import fd_ready
from dsec.models import FileStat

if TYPE_CHECKING:
    from dsec.backends.shim import ShimChannel

RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV
# Inside a tree being deleted or archived: never follow anything, never leave the mount.
RESOLVE_WALK = (
    linux.RESOLVE_BENEATH | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV
)
MAX_READ = 64 * 1024 * 1024
MAX_LIST = 10_000  # entries one listing returns at most
MAX_ARCHIVE = 512 * 1024 * 1024  # bytes of one archive download (sizes as stored, sparse files count whole)
MAX_ARCHIVE_ENTRIES = 200_000
WRITE_TIMEOUT_S = 120.0  # a charged write whose copier makes no progress (stopped from inside) ends here
F_SETPIPE_SZ = 1031

_T = TypeVar("_T")
# File work that may take long runs here: off the event loop, and apart from the default
# executor that the trajectory log's commits use (a flood of listings must not delay them).
_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsec-files")


def stats_sorted(dirfd: int, names: list[str] | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """The entries of a directory (or the given `names` in it), sorted by name, with their
    own stats (links not followed); an entry gone meanwhile is left out."""
    if names is None:
        with os.scandir(dirfd) as it:
            names = [e.name for e in it]
    for name in sorted(names):
        try:
            yield name, os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            continue


def walk_open(
    dfd: int, name: str, flags: int, error: Callable[[OSError, str], Exception], shown: str
) -> int | None:
    """Open entry `name` of directory `dfd` in a tree being walked (RESOLVE_WALK). None where
    it is no part of the walk: on another mount, a link, gone meanwhile, or a FIFO or device
    with nothing behind it. Any other failure raises `error(e, shown)`."""
    try:
        return linux.openat2(dfd, name, flags, 0, RESOLVE_WALK)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ELOOP, errno.ENOENT, errno.ENXIO):
            return None
        raise error(e, shown) from e


async def off_loop(fn: Callable[[], _T]) -> _T:
    return await asyncio.get_running_loop().run_in_executor(_pool, fn)


def _kind(mode: int) -> str:
    return {
        stat.S_IFIFO: "a FIFO",
        stat.S_IFSOCK: "a socket",
        stat.S_IFCHR: "a character device",
        stat.S_IFBLK: "a block device",
        stat.S_IFDIR: "a directory",
        stat.S_IFLNK: "a symbolic link",
    }.get(stat.S_IFMT(mode), "not a regular file")


def _norm(path: str) -> str:
    if not path or "\0" in path:
        raise errors.InvalidRequest("path must be a non-empty string without NUL bytes")
    if not path.startswith("/"):
        raise errors.InvalidRequest(f"path {path!r} must be absolute, e.g. /work/{path}")
    return path


# What an errno means to a file API caller: the error and its message ({path}: the path,
# {short}: its first 80 characters).
_ERRNO_ERRORS: dict[int, tuple[type[errors.DsecError], str]] = {
    errno.ENOENT: (errors.FileNotFound, "{path} does not exist in the sandbox"),
    errno.EXDEV: (errors.PathEscape, "{path} leads out of the sandbox's file system"
                   " (another mount); use a plain path"),
    errno.ELOOP: (errors.PathEscape, "{path} resolves through a link that leaves the sandbox or loops"),
    errno.EISDIR: (errors.InvalidRequest, "{path} is a directory; give a file path"),
    errno.ENOTDIR: (errors.InvalidRequest, "a parent of {path} is not a directory"),
    errno.EEXIST: (errors.FileExists_, "{path} already exists"),
    errno.ENAMETOOLONG: (errors.InvalidRequest, "{short}...: a name in it is longer than 255 bytes;"
                                                " use shorter names"),
    errno.ENOSPC: (errors.QuotaExceeded, "no space left writing {path}: the sandbox's disk_mb is full"),
    errno.EACCES: (errors.Forbidden, "permission denied on {path}"),
    errno.EPERM: (errors.Forbidden, "permission denied on {path}"),
    # a socket, or a FIFO without a reader, opened for writing
    errno.ENXIO: (errors.InvalidRequest, "{path} is a socket or FIFO, not a regular file;"
                                 " the file API reads and writes regular files only"),
    errno.EBUSY: (errors.Conflict, "{path} is a mount point or in use in the sandbox; it cannot be removed"),
    errno.EFBIG: (errors.QuotaExceeded, "{path} would exceed the largest file size allowed"),
    errno.ENOMEM: (errors.QuotaExceeded, "the sandbox's memory is full writing {path}: its files"
                                   " live in memory (memory_mb); free some or create the sandbox with more"),
}  # fmt: skip


def _map_error(e: OSError, path: str) -> errors.DsecError:
    known = _ERRNO_ERRORS.get(e.errno or 0)
    if known is None:
        return errors.InternalError(f"{path}: {e.strerror}")
    cls, message = known
    return cls(message.format(path=path, short=path[:80]))


def replace_once(raw: bytes, path: str, old: str, new: str) -> bytes:
    """An edit: the text of `path` with the single occurrence of `old` replaced by `new`."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise errors.InvalidRequest(f"{path} is not UTF-8 text; edit works on text files") from e
    count = text.count(old)
    if count != 1:
        where = "does not occur" if count == 0 else f"occurs {count} times"
        raise errors.EditMismatch(
            f"the old string {where} in {path}; it must match exactly once "
            "(add surrounding lines to make it unique)",
            occurrences=count,
        )
    data = text.replace(old, new, 1).encode()
    if len(data) > MAX_READ:
        raise errors.PayloadTooLarge(f"the edited {path} would have more than {MAX_READ} bytes")
    return data


@dataclasses.dataclass(eq=False)
class SandboxFiles:
    """File operations on one sandbox; `uid`/`gid` are the host ids new files get.

    `channel`: the sandbox's init, which runs the copies of charged writes; without one
    (tests of this module alone) writes are done by this process."""

    root_fd: int
    uid: int
    gid: int
    id_offset: int
    channel: ShimChannel | None = None

    @contextlib.contextmanager
    def pinned(self) -> Iterator[SandboxFiles]:
        """A copy on a duplicate of the root descriptor, for work in another thread: the
        sandbox may be stopped (its descriptor closed, the number reused) meanwhile."""
        fd = os.dup(self.root_fd)
        try:
            yield dataclasses.replace(self, root_fd=fd)
        finally:
            os.close(fd)

    async def run(self, fn: Callable[[SandboxFiles], _T]) -> _T:
        """`fn(files)` in the file pool, on a pinned copy."""
        with self.pinned() as f:
            return await off_loop(lambda: fn(f))

    @contextlib.contextmanager
    def _open(self, path: str, flags: int, mode: int = 0) -> Iterator[int]:
        try:
            # openat2 rejects O_PATH combined with other flags, hence no O_NOCTTY there.
            extra = 0 if flags & os.O_PATH else os.O_NOCTTY
            fd = linux.openat2(self.root_fd, path, flags | extra, mode, RESOLVE)
        except OSError as e:
            raise self._error(e, path) from e
        try:
            yield fd
        finally:
            os.close(fd)

    def _error(self, e: OSError, path: str) -> errors.DsecError:
        if e.errno == errno.ENXIO:
            with contextlib.suppress(errors.DsecError, OSError):
                kind = _kind(self._lstat(path).st_mode)
                return errors.InvalidRequest(
                    f"{path} is {kind}, not a regular file; the file API reads and writes regular files only"
                )
        return _map_error(e, path)

    def _lstat(self, path: str) -> os.stat_result:
        pp = PurePosixPath(path)
        with self._open(str(pp.parent), os.O_PATH | os.O_DIRECTORY) as dfd:
            return os.stat(pp.name or ".", dir_fd=dfd, follow_symlinks=False)

    def _mkdirs(self, path: str) -> None:
        """Create `path` and its missing parents, one component at a time, inside the root."""
        parts = PurePosixPath(path).parts[1:]
        cur = "/"
        for part in parts:
            nxt = str(PurePosixPath(cur) / part)
            try:
                with self._open(cur, os.O_PATH | os.O_DIRECTORY) as dfd:
                    os.mkdir(part, 0o755, dir_fd=dfd)
                    os.chown(part, self.uid, self.gid, dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                pass
            except errors.DsecError:  # already worded (some are OSErrors too: FileNotFound, PathEscape)
                raise
            except OSError as e:
                raise _map_error(e, nxt) from e
            cur = nxt

    def read(self, path: str, max_bytes: int = MAX_READ) -> bytes:
        """The file's bytes; more than `max_bytes` is refused, however the file changes meanwhile."""
        path = _norm(path)
        with self._open(path, os.O_RDONLY | os.O_NONBLOCK) as fd:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise errors.InvalidRequest(f"{path} is a directory; use list")
            if not stat.S_ISREG(st.st_mode):
                raise errors.InvalidRequest(
                    f"{path} is {_kind(st.st_mode)}, not a regular file; the file API reads "
                    "regular files only"
                )
            too_big = errors.PayloadTooLarge(
                f"{path} has more than {max_bytes} bytes; use the archive download for large files"
            )
            if st.st_size > max_bytes:
                raise too_big
            chunks = []
            left = max_bytes + 1  # one byte more than allowed tells a file that grew past the cap
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            if left <= 0:
                raise too_big
            return b"".join(chunks)

    # --- writes ----------------------------------------------------------------------

    def open_for_write(self, path: str, mode: int = 0o644) -> tuple[int, bool]:
        """Create or truncate `path` (parents made as needed): (an O_WRONLY descriptor of a
        regular file, whether we created it). The caller closes the descriptor."""
        path = _norm(path)
        parent = str(PurePosixPath(path).parent)
        if parent != "/":
            self._mkdirs(parent)
        try:
            fd = linux.openat2(
                self.root_fd, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_CLOEXEC,
                mode & 0o7777, RESOLVE,
            )  # fmt: skip
        except FileExistsError:
            pass
        except OSError as e:
            raise self._error(e, path) from e
        else:
            try:
                os.fchown(fd, self.uid, self.gid)
            except BaseException:
                os.close(fd)
                raise
            return fd, True
        # Exists (or is a symlink, followed inside the root): rewrite in place.
        with self._open(path, os.O_WRONLY | os.O_NONBLOCK) as fd:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise errors.InvalidRequest(
                    f"{path} exists and is {_kind(st.st_mode)}, not a regular file; delete it first"
                )
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            return os.dup(fd), False

    def _unlink_same(self, path: str, fd: int) -> None:
        """Remove `path` if it is still the file open as `fd` (nothing the sandbox put there since)."""
        pp = PurePosixPath(path)
        with self._open(str(pp.parent), os.O_PATH | os.O_DIRECTORY) as dfd:
            st, mine = os.stat(pp.name, dir_fd=dfd, follow_symlinks=False), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(pp.name, dir_fd=dfd)

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write from this process (charged to the edge, not the sandbox): only for the
        platform's own small files (resolv.conf) and for tests without a sandbox."""
        fd, _ = self.open_for_write(path, mode)
        try:
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                except OSError as e:
                    raise _map_error(e, path) from e
                view = view[n:]
            os.fchmod(fd, mode & 0o7777)
        finally:
            os.close(fd)

    async def write_charged(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write `data` to `path`, charged to the sandbox (see the module docstring)."""
        if self.channel is None:
            self.write(path, data, mode)
            return
        path = _norm(path)
        fd, created = self.open_for_write(path, mode)
        try:
            await charged_fill(self.channel, fd, path, data)
            os.fchmod(fd, mode & 0o7777)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # give back what a failed write took
            if created:  # and leave no empty file behind
                with contextlib.suppress(errors.DsecError, OSError):
                    self._unlink_same(path, fd)
            raise
        finally:
            os.close(fd)

    async def edit(self, path: str, old: str, new: str) -> int:
        """Replace the single occurrence of `old` with `new`; returns the new size."""
        path = _norm(path)
        data = replace_once(await self.run(lambda f: f.read(path)), path, old, new)
        with self._open(path, os.O_PATH) as fd:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        await self.write_charged(path, data, mode)
        return len(data)

    # --- metadata, listings, deletes -------------------------------------------------

    def stat(self, path: str) -> FileStat:
        path = _norm(path)
        parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        with self._open(parent, os.O_PATH | os.O_DIRECTORY) as dfd:
            try:
                st = os.stat(name or ".", dir_fd=dfd, follow_symlinks=False)
            except OSError as e:
                raise _map_error(e, path) from e
        return _to_stat(path, name or "/", st, self.id_offset)

    def list(self, path: str, max_entries: int = MAX_LIST) -> list[FileStat]:
        """The entries of a directory, sorted by name; more than `max_entries` is refused."""
        path = _norm(path)
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as fd:
            # Names first (plain strings, which the garbage collector does not track), then the
            # stats: refusing a huge directory allocates no objects that would make a full
            # collection stall the event loop.
            names: list[str] = []
            with os.scandir(fd) as it:
                for entry in it:
                    if len(names) >= max_entries:
                        raise errors.PayloadTooLarge(
                            f"{path} has more than {max_entries} entries; list a subdirectory, or use "
                            f"exec (e.g. `ls {path} | head`) or the archive download"
                        )
                    names.append(entry.name)
            return [
                _to_stat(str(PurePosixPath(path) / name), name, st, self.id_offset)
                for name, st in stats_sorted(fd, names)
            ]

    def delete(self, path: str, recursive: bool = False) -> None:
        path = _norm(path)
        pp = PurePosixPath(path)
        if pp == PurePosixPath("/"):
            raise errors.InvalidRequest("refusing to delete /")
        with self._open(str(pp.parent), os.O_PATH | os.O_DIRECTORY) as dfd:
            try:
                st = os.stat(pp.name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    if not recursive:
                        os.rmdir(pp.name, dir_fd=dfd)
                    else:
                        _rmtree_at(dfd, pp.name, path)
                else:
                    os.unlink(pp.name, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ENOTEMPTY:
                    raise errors.Conflict(f"{path} is a non-empty directory; pass recursive=true") from e
                if e.errno == errno.EXDEV:
                    raise errors.Conflict(
                        f"{path} is or holds a mount point ({e.filename or path}); the file API never "
                        "deletes across a mount: delete what is beside it instead"
                    ) from e
                raise _map_error(e, path) from e

    # --- archives --------------------------------------------------------------------

    def archive(
        self,
        path: str,
        max_bytes: int = MAX_ARCHIVE,
        *,
        max_entries: int = MAX_ARCHIVE_ENTRIES,
        any_link_target: bool = False,
    ) -> IO[bytes]:
        """A tar of `path` (a directory's contents, or one file or link), built here from
        descriptors opened without following anything and without leaving the sandbox's
        root mount, into an unlinked spool file (rewound). At most `max_bytes` of file data
        and `max_entries` entries: beyond either a clear 413. (`any_link_target`: see
        dsec.archive.ArchiveTree.)"""
        path = _norm(path)
        pp = PurePosixPath(path)
        spool = tempfile.TemporaryFile(prefix="dsec-archive-")  # noqa: SIM115 - handed to the caller
        what = f"the archive of {path}"
        try:
            with CleanTar(spool, what, max_bytes, max_entries, any_link_target=any_link_target) as tf:
                budget = _Budget(path, max_bytes, max_entries)
                if pp == PurePosixPath("/"):
                    with self._open("/", os.O_RDONLY | os.O_DIRECTORY) as fd:
                        self._tar_dir(tf, fd, ".", budget)
                else:
                    with self._open(str(pp.parent), os.O_PATH | os.O_DIRECTORY) as dfd:
                        try:
                            st = os.stat(pp.name, dir_fd=dfd, follow_symlinks=False)
                        except OSError as e:
                            raise _map_error(e, path) from e
                        if stat.S_ISDIR(st.st_mode):
                            try:
                                fd = linux.openat2(
                                    dfd, pp.name, os.O_RDONLY | os.O_DIRECTORY, 0, RESOLVE_WALK
                                )
                            except OSError as e:
                                raise _map_error(e, path) from e
                            try:
                                self._tar_dir(tf, fd, ".", budget)
                            finally:
                                os.close(fd)
                        else:
                            self._tar_entry(tf, dfd, pp.name, pp.name, st, budget)
            spool.seek(0)
            return spool
        except BaseException:
            spool.close()
            raise

    def _tar_dir(self, tf: CleanTar, fd: int, arcname: str, budget: _Budget) -> None:
        st = os.fstat(fd)
        tf.addfile(self._info(arcname, st, tarfile.DIRTYPE))
        budget.entry(arcname)
        for name, est in stats_sorted(fd):
            self._tar_entry(tf, fd, name, f"{arcname}/{name}", est, budget)  # "./a/b", as tar -C dir .

    def _tar_entry(
        self, tf: CleanTar, dfd: int, name: str, arcname: str, st: os.stat_result, budget: _Budget
    ) -> None:
        m = st.st_mode
        if stat.S_ISDIR(m):
            sub = walk_open(dfd, name, os.O_RDONLY | os.O_DIRECTORY, _map_error, arcname)
            if sub is None:
                return  # a mount point (or swapped away meanwhile): not part of the archive
            try:
                self._tar_dir(tf, sub, arcname, budget)
            finally:
                os.close(sub)
        elif stat.S_ISLNK(m):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                return
            info = self._info(arcname, st, tarfile.SYMTYPE)
            info.linkname = target
            budget.entry(arcname)
            tf.addfile(info)
        elif stat.S_ISREG(m):
            fd = walk_open(dfd, name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, _map_error, arcname)
            if fd is None:
                return
            with os.fdopen(fd, "rb", buffering=0) as f:
                fst = os.fstat(f.fileno())
                if not stat.S_ISREG(fst.st_mode):
                    return
                budget.entry(arcname)
                budget.data(arcname, fst.st_size)
                info = self._info(arcname, fst, tarfile.REGTYPE)
                info.size = fst.st_size
                # Exactly st_size bytes go in, whatever the file does meanwhile (grown: cut; shrunk: zeros).
                tf.addfile(info, _Exactly(f, fst.st_size))
        # FIFOs, sockets and device nodes are left out: not data (dsec.edge.tarcheck)

    def _info(self, arcname: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(arcname)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        off = self.id_offset
        info.uid = st.st_uid - off if off <= st.st_uid < off + 65536 else 65534
        info.gid = st.st_gid - off if off <= st.st_gid < off + 65536 else 65534
        info.uname = info.gname = ""
        return info


class _Budget:
    def __init__(self, path: str, max_bytes: int, max_entries: int = MAX_ARCHIVE_ENTRIES) -> None:
        self.path = path
        self.left = max_bytes
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.entries = 0

    def entry(self, name: str) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise errors.PayloadTooLarge(
                f"{self.path} holds more than {self.max_entries} entries; archive a subdirectory"
            )

    def data(self, name: str, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise errors.PayloadTooLarge(
                f"the archive of {self.path} would hold more than {self.max_bytes} bytes ({name} alone "
                f"has {size}; sparse files count at their full size): archive a narrower path"
            )


class _Exactly:
    """A reader of exactly `size` bytes of `f`: cut past it, zeros if the file shrank."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f = f
        self.left = size

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        n = self.left if n < 0 else min(n, self.left)
        chunk = self.f.read(n) or b""
        if not chunk:
            chunk = bytes(n)
        self.left -= len(chunk)
        return chunk


async def _feed(w: int, data: bytes, exited: asyncio.Future[int], deadline: float) -> None:
    """Write `data` into the non-blocking pipe `w` until done, the reader ends, or the deadline."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(w, view) :]
            continue
        except BlockingIOError:
            pass
        except BrokenPipeError:
            return  # the copier ended early: its status says why
        with fd_ready(w, write=True) as writable:
            left = deadline - time.monotonic()
            waits: list[asyncio.Future[Any]] = [writable, exited]
            await asyncio.wait(waits, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError


async def _start_fill(channel: ShimChannel, r: int, fd: int, path: str) -> tuple[int, asyncio.Future[int]]:
    try:
        return await channel.fill(r, fd)
    except TimeoutError as e:
        raise errors.Unavailable(
            "the sandbox's init did not take the write (it predates charged writes, or is "
            "frozen); retry, or recreate the sandbox"
        ) from e
    except OSError as e:
        if e.errno == errno.EAGAIN:
            raise errors.QuotaExceeded("the sandbox is at its pids limit: no room for the file copier") from e
        raise _map_error(e, path) from e


async def charged_fill(channel: ShimChannel, fd: int, path: str, data: bytes) -> None:
    """Copy `data` into the open file `fd` from a child of the sandbox's init (charged to the
    sandbox). Maps the copier's end to an error: ENOSPC disk full, SIGKILL memory full."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        os.set_blocking(w, False)  # ours: fed from the event loop; the copier's end blocks
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, F_SETPIPE_SZ, max(65536, min(len(data), 1 << 20)))
        ident, exited = await _start_fill(channel, r, fd, path)
        os.close(r)
        r = -1
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        try:
            await _feed(w, data, exited, deadline)
            os.close(w)
            w = -1
            status = await wait_for(asyncio.shield(exited), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            channel.signal(ident, signal.SIGKILL)
            raise errors.Unavailable(
                f"writing {path} made no progress for {WRITE_TIMEOUT_S:.0f} s (the sandbox's processes "
                "are stopped or starve it); retry"
            ) from None
        except BaseException:
            channel.signal(ident, signal.SIGKILL)
            raise
    finally:
        for x in (r, w):
            if x >= 0:
                os.close(x)
    _check_fill(status, path)


def _check_fill(status: int, path: str) -> None:
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) == signal.SIGKILL:
            raise errors.QuotaExceeded(
                f"the sandbox's memory is full writing {path}: its files live in memory (memory_mb); "
                "free some, or create the sandbox with more memory"
            )
        raise errors.Conflict(f"writing {path} was interrupted by a signal from inside the sandbox; retry")
    code = os.WEXITSTATUS(status)
    raise _map_error(OSError(code, os.strerror(code)), path)


def _rmtree_at(dfd: int, name: str, shown: str) -> None:
    """Remove `name` (a directory under `dfd`) and everything in it, on this mount only: each
    directory is opened with RESOLVE_NO_XDEV, so a mount point inside stops the delete (EXDEV)."""
    try:
        fd = linux.openat2(dfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, RESOLVE_WALK)
    except OSError as e:
        e.filename = shown
        raise
    try:
        # One snapshot of the names (a sandbox that keeps adding entries cannot keep this
        # thread busy), as plain strings: the garbage collector does not track them, so
        # 200,000 entries do not set off a full collection that stalls the event loop.
        dirs: list[str] = []
        files: list[str] = []
        with os.scandir(fd) as it:
            for entry in it:
                (dirs if entry.is_dir(follow_symlinks=False) else files).append(entry.name)
        for child in dirs:
            _rmtree_at(fd, child, f"{shown}/{child}")
        for child in files:
            try:
                os.unlink(child, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.EBUSY:  # a file bind-mounted over: another mount
                    raise OSError(errno.EXDEV, "a mount point", f"{shown}/{child}") from e
                raise
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise OSError(errno.EXDEV, "a mount point", shown) from e
        raise


def _to_stat(path: str, name: str, st: os.stat_result, offset: int) -> FileStat:
    m = st.st_mode
    kind = (
        "file" if stat.S_ISREG(m) else "dir" if stat.S_ISDIR(m) else "symlink" if stat.S_ISLNK(m) else "other"
    )
    return FileStat(
        path=path,
        name=name,
        type=kind,
        size=st.st_size,
        mode=stat.S_IMODE(m),
        mtime=st.st_mtime,
        uid=st.st_uid - offset if st.st_uid >= offset else 65534,
        gid=st.st_gid - offset if st.st_gid >= offset else 65534,
    )
