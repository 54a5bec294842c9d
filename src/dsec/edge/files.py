"""File operations on a sandbox's root filesystem, from the host, without escapes.

Every path is resolved with openat2(2) relative to an O_PATH descriptor of the
sandbox's rootfs, with RESOLVE_IN_ROOT (symlinks and `..` cannot climb out of
the root), RESOLVE_NO_MAGICLINKS (no /proc/<pid>/root style jumps) and
RESOLVE_NO_XDEV (never cross into another mount). Hard links cannot point
outside either: the overlay holds only the sandbox's own files, and writes
through it copy up instead of touching a lower layer. Files we create are
owned by the sandbox user's mapped id.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import PurePosixPath

from dsec import errors
from dsec.isolation import linux
from dsec.models import FileStat

RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV
MAX_READ = 64 * 1024 * 1024


def _norm(path: str) -> str:
    if not path or "\0" in path:
        raise errors.InvalidRequest("path must be a non-empty string without NUL bytes")
    if not path.startswith("/"):
        raise errors.InvalidRequest(f"path {path!r} must be absolute, e.g. /work/{path}")
    return path


def _map_error(e: OSError, path: str) -> errors.DsecError:
    if e.errno == errno.ENOENT:
        return errors.FileNotFound(f"{path} does not exist in the sandbox")
    if e.errno == errno.EXDEV:
        return errors.PathEscape(
            f"{path} leads out of the sandbox's file system (another mount); use a plain path"
        )
    if e.errno == errno.ELOOP:
        return errors.PathEscape(f"{path} resolves through a link that leaves the sandbox or loops")
    if e.errno == errno.EISDIR:
        return errors.InvalidRequest(f"{path} is a directory; give a file path")
    if e.errno == errno.ENOTDIR:
        return errors.InvalidRequest(f"a parent of {path} is not a directory")
    if e.errno == errno.EEXIST:
        return errors.FileExists_(f"{path} already exists")
    if e.errno == errno.ENOSPC:
        return errors.QuotaExceeded(f"no space left writing {path}: the sandbox's disk_mb is full")
    if e.errno in (errno.EACCES, errno.EPERM):
        return errors.Forbidden(f"permission denied on {path}")
    return errors.InternalError(f"{path}: {e.strerror}")


class SandboxFiles:
    """File operations on one sandbox; `uid`/`gid` are the host ids new files get."""

    def __init__(self, root_fd: int, uid: int, gid: int, id_offset: int) -> None:
        self.root_fd = root_fd
        self.uid = uid
        self.gid = gid
        self.id_offset = id_offset

    @contextlib.contextmanager
    def _open(self, path: str, flags: int, mode: int = 0) -> Iterator[int]:
        try:
            # openat2 rejects O_PATH combined with other flags, hence no O_NOCTTY there.
            extra = 0 if flags & os.O_PATH else os.O_NOCTTY
            fd = linux.openat2(self.root_fd, path, flags | extra, mode, RESOLVE)
        except OSError as e:
            raise _map_error(e, path) from e
        try:
            yield fd
        finally:
            os.close(fd)

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
            cur = nxt

    def read(self, path: str, max_bytes: int = MAX_READ) -> bytes:
        path = _norm(path)
        with self._open(path, os.O_RDONLY | os.O_NONBLOCK) as fd:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise errors.InvalidRequest(f"{path} is a directory; use list")
            if not stat.S_ISREG(st.st_mode):
                raise errors.InvalidRequest(f"{path} is not a regular file")
            if st.st_size > max_bytes:
                raise errors.PayloadTooLarge(
                    f"{path} has {st.st_size} bytes, more than {max_bytes}; use download for large files"
                )
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = _norm(path)
        parent = str(PurePosixPath(path).parent)
        if parent != "/":
            self._mkdirs(parent)
        try:
            with self._open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & 0o7777) as fd:
                os.fchown(fd, self.uid, self.gid)
                self._write_fd(fd, path, data, mode)
        except errors.FileExists_:
            # Exists (or is a symlink, followed inside the root): rewrite in place.
            with self._open(path, os.O_WRONLY | os.O_NONBLOCK) as fd:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise errors.InvalidRequest(f"{path} exists and is not a regular file") from None
                os.ftruncate(fd, 0)
                self._write_fd(fd, path, data, mode)

    @staticmethod
    def _write_fd(fd: int, path: str, data: bytes, mode: int) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except OSError as e:
                raise _map_error(e, path) from e
            view = view[n:]
        os.fchmod(fd, mode & 0o7777)

    def edit(self, path: str, old: str, new: str) -> int:
        """Replace the single occurrence of `old` with `new`; returns the new size."""
        raw = self.read(path)
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
        with self._open(path, os.O_PATH) as fd:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        data = text.replace(old, new, 1).encode()
        self.write(path, data, mode)
        return len(data)

    def stat(self, path: str) -> FileStat:
        path = _norm(path)
        parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        with self._open(parent, os.O_PATH | os.O_DIRECTORY) as dfd:
            try:
                st = os.stat(name or ".", dir_fd=dfd, follow_symlinks=False)
            except OSError as e:
                raise _map_error(e, path) from e
        return _to_stat(path, name or "/", st, self.id_offset)

    def list(self, path: str) -> list[FileStat]:
        path = _norm(path)
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as fd:
            out = []
            for entry in os.scandir(fd):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append(_to_stat(str(PurePosixPath(path) / entry.name), entry.name, st, self.id_offset))
        out.sort(key=lambda s: s.name)
        return out

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
                        _rmtree_at(dfd, pp.name)
                else:
                    os.unlink(pp.name, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ENOTEMPTY:
                    raise errors.Conflict(f"{path} is a non-empty directory; pass recursive=true") from e
                raise _map_error(e, path) from e


def _rmtree_at(dfd: int, name: str) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _rmtree_at(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


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
