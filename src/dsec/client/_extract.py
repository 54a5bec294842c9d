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
owners; devices, FIFOs and sparse files are refused.

An archive that does not end with tar's end-of-archive blocks was cut short (tarfile stops
quietly at a header cut in half) and is refused. What is already in the destination is
checked up front too, so a refusal writes nothing: a link or a file where the archive has
a directory, a directory where it has a file or a link. Directories are walked as a chain
of open descriptors shared by consecutive members (`_Chain`), and an archive whose names
would take more than MAX_WALK_STEPS directory opens (deep names in an order that defeats
the chain; reopening each from the root, 5,000 files 1,000 levels down took 90 s) is
refused before anything is written."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path

from dsec import errors
from dsec.archive import ArchiveTree, member_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_WALK_STEPS = 4_000_000  # directory opens one extraction may take (see _Chain)
_END = 2 * tarfile.BLOCKSIZE  # the zero blocks that end every tar (the edge's CleanTar's too)


def extract(data: bytes, dest: str | Path) -> None:
    """Extract the tar `data` into directory `dest` (made if missing): see the module."""
    what = f"the downloaded archive (into {dest})"
    Path(dest).mkdir(parents=True, exist_ok=True)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the caller's own path
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            members = tf.getmembers()
            if data[tf.offset : tf.offset + _END] != bytes(_END):  # (tarfile stops at a cut header)
                raise errors.InvalidRequest(
                    f"{what} was cut short: it does not end with tar's end-of-archive blocks after "
                    f"{len(members)} members; download it again"
                )
            _Writer(root, what).run(tf, _checked(members, root, what))
    except (tarfile.TarError, EOFError) as e:
        raise errors.InvalidRequest(f"{what} is not a readable tar archive ({e})") from e
    finally:
        os.close(root)


def _checked(members: list[tarfile.TarInfo], root: int, what: str) -> Members:
    """Every member's normalised name, once the whole archive passed dsec.archive's rules."""

    def foreign(path: str) -> bool:  # a link already in the destination (not this archive's)
        try:
            return stat.S_ISLNK(os.stat(path, dir_fd=root, follow_symlinks=False).st_mode)
        except OSError:
            return False  # missing (or below a file): the kernel would stop there too

    tree = ArchiveTree(what, foreign)
    out = []
    for m in members:
        name = tree.add_member(m)
        out.append((name, m))
    _Chain(None, what).cost(*_walks(out))
    tree.check_links()
    _check_destination(root, out, what)
    return out


Members = list[tuple[str, tarfile.TarInfo]]


def _writing_order(members: Members) -> Members:
    """Members as the writer makes them: symbolic links last (the archive root left out)."""
    return [(n, m) for n, m in members if n and not m.issym()] + [(n, m) for n, m in members if m.issym()]


def _walks(members: Members) -> tuple[list[list[str]], list[list[str]]]:
    """The directories the writer walks, in its order: each member's parent (a directory's
    own path), and each hard link's target's parent."""
    dirs = [name.split("/") if m.isdir() else name.split("/")[:-1] for name, m in _writing_order(members)]
    sources = [[p for p in m.linkname.split("/") if p not in ("", ".")][:-1] for _, m in members if m.islnk()]
    return dirs, sources


def _check_destination(root: int, members: Members, what: str) -> None:
    """Refuse, before a byte is written, what the destination holds that the archive cannot
    replace: a link or a file where it has a directory (nothing is extracted through one), a
    directory where it has a file or a link. (Files and links there are replaced.)"""
    chain = _Chain(root, what, create=False)
    try:
        for name, m in _writing_order(members):  # (the walks `cost` counted)
            *dirs, base = name.split("/")
            parent = chain.walk(dirs)
            if parent is None:
                continue  # a directory on the way is missing: made by the extraction
            try:
                st = os.stat(base, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if m.isdir() and not stat.S_ISDIR(st.st_mode):
                raise chain.refusal(name)
            if not m.isdir() and stat.S_ISDIR(st.st_mode):
                raise errors.Conflict(
                    f"{what}: {name[:200]!r} is a directory in the destination and a file or link in "
                    "the archive; remove it, or extract elsewhere"
                )
    finally:
        chain.close()


class _Chain:
    """Directories of the destination walked from `root` one part at a time (O_NOFOLLOW,
    made if missing when `create`), kept open along the last path walked so that the next
    walk starts where the two share a prefix. Descriptors are kept every STRIDE levels (and
    at the end), so a chain holds few even 2,000 levels down. `root` None: nothing is opened,
    the opens a walk would take are only counted (`cost`)."""

    STRIDE = 16

    def __init__(self, root: int | None, what: str, *, create: bool = True) -> None:
        self.root, self.what, self.create = root, what, create
        self.parts: list[str] = []
        self.fds: dict[int, int] = {}  # level (parts walked) -> its directory's descriptor
        self.missing: list[str] | None = None  # (not `create`) a path found missing
        self.steps = 0

    def cost(self, *orders: list[list[str]]) -> None:
        """Refuse an archive whose walks (each order of paths on a chain of its own, as the
        writer walks them) would take more than MAX_WALK_STEPS directory opens."""
        for paths in orders:
            self.parts, self.fds = [], {}
            for parts in paths:
                self.walk(parts)
                if self.steps > MAX_WALK_STEPS:
                    raise errors.PayloadTooLarge(
                        f"{self.what}: its names take more than {MAX_WALK_STEPS} directory steps to "
                        "extract (deep names out of order); download a narrower path"
                    )

    def walk(self, parts: list[str]) -> int | None:
        """The directory `parts` lead to, open; None if one is missing (not `create`)."""
        if self.missing is not None and parts[: len(self.missing)] == self.missing:
            return None
        same = 0
        for mine, theirs in zip(self.parts, parts, strict=False):
            if mine != theirs:
                break
            same += 1
        for level in [lv for lv in self.fds if lv > same]:
            self._close(self.fds.pop(level))
        start = max((lv for lv in self.fds if lv <= same), default=0)
        self.parts = parts[:start]
        self.steps += len(parts) - start
        fd = self.fds.get(start, -1 if self.root is None else self.root)
        for level in range(start + 1, len(parts) + 1):
            try:
                nxt = -1 if self.root is None else self._open(fd, parts[level - 1], parts[:level])
            finally:  # the directory before: kept only every STRIDE levels
                if fd not in (self.root, self.fds.get(level - 1)):
                    self._close(fd)
            if nxt is None:
                self.missing = parts[:level]
                return None
            fd = nxt
            self.parts.append(parts[level - 1])
            if level % self.STRIDE == 0 or level == len(parts):
                self.fds[level] = fd
        return fd

    def _open(self, parent: int, part: str, shown: list[str]) -> int | None:
        try:
            try:
                return os.open(part, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not self.create:
                    return None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=parent)
                return os.open(part, _DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise self.refusal("/".join(shown)) from e
            raise

    def _close(self, fd: int | None) -> None:
        if self.root is not None and fd is not None and fd != self.root:
            os.close(fd)

    def refusal(self, name: str) -> errors.PathEscape:
        return errors.PathEscape(
            f"{self.what}: {name[:200]!r} is a directory in the archive and a symbolic link or not a "
            "directory in the destination; nothing is extracted through it (remove it, or extract "
            "elsewhere)"
        )

    def close(self) -> None:
        fds, self.fds, self.parts = self.fds, {}, []
        for fd in fds.values():
            self._close(fd)


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
        self.dirs = _Chain(root, what)  # members' parents, in archive order
        self.sources = _Chain(root, what)  # hard links' targets' parents

    def run(self, tf: tarfile.TarFile, members: Members) -> None:
        try:
            for name, m in _writing_order(members):  # (the archive root is the destination)
                if m.isdir():
                    self.dirs.walk(name.split("/"))
                    continue
                parent, base = self._parent(self.dirs, name)
                if m.issym():  # last: everything else is written
                    self._clear(parent, base, name)
                    os.symlink(m.linkname, base, dir_fd=parent)
                elif m.islnk():
                    self._hardlink(tf, m, parent, base, name)
                else:
                    self._file(tf, m, parent, base)
        finally:
            self.dirs.close()
            self.sources.close()

    @staticmethod
    def _parent(chain: _Chain, name: str) -> tuple[int, str]:
        """The directory holding `name`, open (every step O_NOFOLLOW, made if missing; held
        by `chain`), and the last part of `name`."""
        *dirs, base = name.split("/")
        fd = chain.walk(dirs)
        assert fd is not None  # (made if missing)
        return fd, base

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
        src_dir, src_base = self._parent(self.sources, member_name(m.linkname, self.what))
        try:
            os.link(src_base, base, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
            return
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
        self._file(tf, m, parent, base)
