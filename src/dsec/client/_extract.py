"""Extracting a downloaded archive on the trainer's host, whatever Python's `tarfile`
filters do in this version (before 3.11.13 / 3.12.11 the `data` filter let a chain of
links write outside the destination: CVE-2025-4517).

The archive is the sandbox's, even after the edge rebuilt it: this module checks it again
with the rules the edge applies (dsec.archive), all of it before a byte is written, then
writes it under one directory it holds open. Every step below it is an `openat`-style call
relative to a descriptor (`dir_fd=`): directories are opened with O_NOFOLLOW|O_DIRECTORY
and made with mkdir, files are created with O_CREAT|O_EXCL|O_NOFOLLOW after whatever was
at their name (a file or link of an earlier download) is unlinked, hard links are linked
without following, and symbolic links are made last, after they were resolved against the
archive and the destination (one already there that a link would pass through is refused),
so nothing is ever followed that this extraction did not check. Permissions as the `data`
filter gives them (no setuid, setgid or sticky bit, no write for group and others), no
owners; devices, FIFOs and sparse files are refused."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

from dsec import errors
from dsec.archive import ArchiveTree, member_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def extract(data: bytes, dest: str | Path) -> None:
    """Extract the tar `data` into directory `dest` (made if missing): see the module."""
    what = f"the downloaded archive (into {dest})"
    Path(dest).mkdir(parents=True, exist_ok=True)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the caller's own path
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            members = _checked(tf.getmembers(), root, what)
            _Writer(root, what).run(tf, members)
    except (tarfile.TarError, EOFError) as e:
        raise errors.InvalidRequest(f"{what} is not a readable tar archive ({e})") from e
    finally:
        os.close(root)


def _checked(members: list[tarfile.TarInfo], root: int, what: str) -> list[tuple[str, tarfile.TarInfo]]:
    """Every member's normalised name, once the whole archive passed dsec.archive's rules."""

    def foreign(path: str) -> bool:  # a link already in the destination (not this archive's)
        try:
            return stat.S_ISLNK(os.stat(path, dir_fd=root, follow_symlinks=False).st_mode)
        except OSError:
            return False  # missing (or below a file): the kernel would stop there too

    tree = ArchiveTree(what, foreign)
    out = []
    for m in members:
        name = member_name(m.name, what)
        if m.isdir():
            tree.add(name, "dir")
        elif m.issparse():
            raise errors.InvalidRequest(
                f"{what}: {m.name[:200]!r} is a sparse file; dsec's edge never sends one"
            )
        elif m.isreg():
            tree.add(name, "file")
        elif m.issym():
            tree.add(name, "link", m.linkname)
        elif m.islnk():
            tree.add(name, "file", member_name(m.linkname, what))
        else:
            raise errors.InvalidRequest(
                f"{what}: {m.name[:200]!r} is a device, FIFO or other special file; a download holds "
                "only files, directories and links"
            )
        out.append((name, m))
    for name, kind in tree.kinds.items():  # (files and links there are replaced, not followed)
        if name and kind not in ("file", "link") and foreign(name):
            raise errors.PathEscape(
                f"{what}: {name[:200]!r} is a directory in the archive and a symbolic link in the "
                "destination; nothing is extracted through it (remove it, or extract elsewhere)"
            )
    tree.check_links()
    return out


def _safe_mode(mode: int) -> int:
    """The `data` filter's file permissions: no set-id or sticky bit, no write for group or
    others, executable for them only if for the owner, always readable and writable by it."""
    mode &= 0o755
    if not mode & stat.S_IXUSR:
        mode &= ~0o111
    return mode | 0o600


class _Writer:
    def __init__(self, root: int, what: str) -> None:
        self.root = root
        self.what = what

    def run(self, tf: tarfile.TarFile, members: list[tuple[str, tarfile.TarInfo]]) -> None:
        for name, m in members:
            if not name:
                continue  # the archive root: the destination itself
            if m.issym():
                continue  # made last, below
            with self._parent(name) as (parent, base):
                if m.isdir():
                    self._mkdir(parent, base, name)
                elif m.islnk():
                    self._hardlink(tf, m, parent, base, name)
                else:
                    self._file(tf, m, parent, base)
        for name, m in members:
            if m.issym():
                with self._parent(name) as (parent, base):
                    self._clear(parent, base, name)
                    os.symlink(m.linkname, base, dir_fd=parent)

    @contextlib.contextmanager
    def _parent(self, name: str) -> Iterator[tuple[int, str]]:
        """The directory holding `name`, open (every step O_NOFOLLOW, made if missing), and
        the last part of `name`."""
        *dirs, base = name.split("/")
        fd = os.dup(self.root)
        try:
            for i, part in enumerate(dirs):
                nxt = self._opendir(fd, part, "/".join(dirs[: i + 1]))
                os.close(fd)
                fd = nxt
            yield fd, base
        finally:
            os.close(fd)

    def _opendir(self, parent: int, part: str, shown: str) -> int:
        try:
            try:
                return os.open(part, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=parent)
                return os.open(part, _DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise errors.PathEscape(
                    f"{self.what}: {shown[:200]!r} in the destination is a symbolic link or not a "
                    "directory; nothing is extracted through it (remove it, or extract elsewhere)"
                ) from e
            raise

    def _mkdir(self, parent: int, base: str, name: str) -> None:
        os.close(self._opendir(parent, base, name))

    def _clear(self, parent: int, base: str, name: str) -> None:
        """Unlink what an earlier extraction left at `base` (never follows it); a directory
        there is refused."""
        try:
            st = os.stat(base, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise errors.Conflict(
                f"{self.what}: {name[:200]!r} is a directory in the destination and a file or link in "
                "the archive; remove it, or extract elsewhere"
            )
        os.unlink(base, dir_fd=parent)

    def _file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, parent: int, base: str) -> None:
        self._clear(parent, base, m.name)
        fd = os.open(base, _FILE_FLAGS, 0o600, dir_fd=parent)
        with open(fd, "wb", closefd=True) as out:
            src = tf.extractfile(m)
            if src is not None:
                shutil.copyfileobj(src, out, 1 << 20)
            os.fchmod(fd, _safe_mode(m.mode))
            with contextlib.suppress(OverflowError, ValueError, OSError):
                os.utime(fd, (m.mtime, m.mtime))

    def _hardlink(self, tf: tarfile.TarFile, m: tarfile.TarInfo, parent: int, base: str, name: str) -> None:
        """A hard link to a file this extraction made (checked: an earlier regular member);
        a copy where the destination cannot link (another mount, a file system without)."""
        self._clear(parent, base, name)
        with self._parent(member_name(m.linkname, self.what)) as (src_dir, src_base):
            try:
                os.link(src_base, base, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
                return
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
        self._file(tf, m, parent, base)
