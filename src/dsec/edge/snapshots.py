"""Disk snapshots and forks of a live sandbox's writable layer.

A snapshot copies the writable layer (frozen for the copy) into the layer store
as an immutable layer, with declared paths removed and whited out, and registers
an image = the source image's layers + that layer: restoring is creating a
sandbox from that image. A fork copies the writable layer once into a shared
directory on a tmpfs and starts N sandboxes that stack it copy-on-write under
their own empty writable layers, so each is independent afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
from pathlib import Path, PurePosixPath

from dsec import errors
from dsec.backends.container import spawn_quick, wait_quick


class TreeCopy:
    """A running `dsec-copy` (see native/dsec-copy.c): exact (owners, modes, times, xattrs
    such as overlayfs opaque markers, whiteout devices, hard links, holes), parallel, and
    never following anything in the source, which a sandbox wrote."""

    def __init__(self, pid: int, pidfd: int, signal_r: int, err: int, what: str) -> None:
        self._pid, self._pidfd, self._err, self._what = pid, pidfd, err, what
        loop = asyncio.get_running_loop()
        self._dirs: asyncio.Future[None] = loop.create_future()
        self._signal_r = signal_r
        loop.add_reader(signal_r, self._on_signal)
        self._exit = asyncio.ensure_future(wait_quick(pid, pidfd))
        self._exit.add_done_callback(lambda _: self._on_signal())

    def _on_signal(self) -> None:
        if self._signal_r >= 0:
            asyncio.get_running_loop().remove_reader(self._signal_r)
            os.close(self._signal_r)
            self._signal_r = -1
        if not self._dirs.done():
            self._dirs.set_result(None)

    async def dirs(self) -> None:
        """Every directory exists in the destination (file contents may still be on their way)."""
        await asyncio.shield(self._dirs)

    async def wait(self) -> None:
        """The copy is complete; raises if it failed."""
        try:
            rc = await asyncio.shield(self._exit)
        except asyncio.CancelledError:
            self.kill()
            raise
        if rc != 0:
            os.lseek(self._err, 0, os.SEEK_SET)
            msg = os.read(self._err, 4000).decode(errors="replace").strip()
            raise errors.InternalError(f"{self._what} failed: {msg or f'exit code {rc}'}")

    def kill(self) -> None:
        if self._exit.done():  # reaped: its pidfd is closed (and the number may be reused)
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def close(self) -> None:
        self._on_signal()
        if self._err >= 0:
            os.close(self._err)
            self._err = -1


def start_copy(tool: Path, src: Path, dst: Path, *, merge: bool = False, what: str = "copying") -> TreeCopy:
    """Start copying the tree under `src` into `dst`. With `merge`, entries `dst` already has
    win (and its opaque directories hide what `src` has below them)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    err = os.memfd_create("dsec-copy-err", os.MFD_CLOEXEC)
    signal_r, signal_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    threads = str(max(2, min(8, os.cpu_count() or 2)))
    argv = [str(tool), "-j", threads, "-s", str(signal_w), *(["-n"] if merge else []), str(src), str(dst)]
    try:
        with open(os.devnull, "wb") as devnull:
            pid, pidfd = spawn_quick(argv, devnull.fileno(), err, (signal_w,))
    except BaseException:
        os.close(err)
        os.close(signal_r)
        raise
    finally:
        os.close(signal_w)
    return TreeCopy(pid, pidfd, signal_r, err, what)


async def copy_tree(tool: Path, src: Path, dst: Path) -> None:
    """Copy a writable layer exactly (see TreeCopy)."""
    copy = start_copy(tool, src, dst, what="copying the writable layer")
    try:
        await copy.wait()
    finally:
        copy.close()


async def copy_tree_under(tool: Path, lower: Path, dst: Path) -> None:
    """Merge a lower layer under what `dst` already holds (entries in `dst` win)."""
    copy = start_copy(tool, lower, dst, merge=True, what="flattening the parent fork layer")
    try:
        await copy.wait()
    finally:
        copy.close()


def scrub(tree: Path, paths: list[str], owner: int) -> list[str]:
    """Remove `paths` (absolute, as the sandbox sees them) from a layer tree and whiteout
    them, so they are absent from the layer and hide any copy in the layers below."""
    done = []
    for raw in paths:
        if not raw.startswith("/") or "\0" in raw:
            raise errors.InvalidRequest(f"scrub path {raw!r} must be absolute, e.g. /work/answers")
        rel = PurePosixPath(os.path.normpath(raw)).relative_to("/")
        if str(rel) in ("", "."):
            raise errors.InvalidRequest("refusing to scrub /")
        target = tree / rel
        parent = tree
        for part in rel.parts[:-1]:  # never follow a symlink out of the tree
            parent = parent / part
            if parent.is_symlink():
                parent.unlink()
            if not parent.exists():
                parent.mkdir(mode=0o755)
                os.chown(parent, owner, owner)
        if target.is_symlink() or target.is_file() or (target.exists() and not target.is_dir()):
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))  # an overlayfs whiteout
        os.chown(target, owner, owner)
        done.append("/" + str(rel))
    return done
