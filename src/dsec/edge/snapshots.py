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
from dsec.isolation.procs import spawn_quick, wait_quick
from dsec.isolation.spec import ID_RANGE


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


def start_copy(
    tool: Path,
    src: Path,
    dst: Path,
    *,
    merge: bool = False,
    shift: tuple[int, int] | None = None,
    what: str = "copying",
) -> TreeCopy:
    """Start copying the tree under `src` into `dst`. With `merge`, entries `dst` already has
    win (and its opaque directories hide what `src` has below them). With `shift` (from,
    to), owners move from one 65536-id range to another: a sandbox's writable layer, owned
    by the sandbox's own range, lands in the store's canonical one."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    err = os.memfd_create("dsec-copy-err", os.MFD_CLOEXEC)
    signal_r, signal_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    threads = str(max(2, min(8, os.cpu_count() or 2)))
    argv = [str(tool), "-j", threads, "-s", str(signal_w), *(["-n"] if merge else [])]
    if shift is not None and shift[0] != shift[1]:
        argv += ["-u", f"{shift[0]}:{shift[1]}:{ID_RANGE}"]
    argv += [str(src), str(dst)]
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


async def copy_tree(tool: Path, src: Path, dst: Path, shift: tuple[int, int] | None = None) -> None:
    """Copy a writable layer exactly (see TreeCopy), owners shifted by `shift` (see start_copy)."""
    copy = start_copy(tool, src, dst, shift=shift, what="copying the writable layer")
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


_WHITEOUT = os.makedev(0, 0)
_MAX_LINKS = 40  # symlinks followed while resolving one path, like the kernel


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == _WHITEOUT


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


class _View:
    """The tree a sandbox sees: `layers` stacked like overlayfs (first on top), read
    without following anything on the host (every component is lstat'ed in each layer)."""

    def __init__(self, layers: list[Path]) -> None:
        self.layers = [str(x) for x in layers]

    def lookup(self, dirs: list[str], name: str) -> tuple[str, list[str], os.stat_result] | None:
        """Entry `name` of the directory whose copies in the layers are `dirs` (top first):
        (kind "dir" or "other", its copies (dirs) or [its one path], its lstat), or None."""
        found: list[str] = []
        first: os.stat_result | None = None
        for d in dirs:
            path = os.path.join(d, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if _is_whiteout(st):
                break
            if stat.S_ISDIR(st.st_mode):
                if first is None:
                    first = st
                found.append(path)
                if _is_opaque(path):
                    break
                continue
            if first is None:
                return "other", [path], st
            break  # a non-directory below a directory is hidden, and so is all below it
        return ("dir", found, first) if first is not None else None

    def resolve(self, rel: list[str], *, follow_last: bool) -> tuple[list[str], list[str]] | None:
        """The symlink-free path (components) that `rel` names in the sandbox, and the
        directory copies of its parent; None if it cannot be resolved (a loop, a dangling
        or non-directory component)."""
        todo = list(rel)
        real: list[str] = []
        chain: list[list[str]] = [self.layers]  # copies of each prefix of `real`
        links = 0
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if real:
                    real.pop()
                    chain.pop()
                continue
            entry = self.lookup(chain[-1], part)
            is_link = entry is not None and entry[0] == "other" and stat.S_ISLNK(entry[2].st_mode)
            if entry is not None and is_link and (todo or follow_last):
                links += 1
                if links > _MAX_LINKS:
                    return None
                target = os.readlink(entry[1][0])
                if target.startswith("/"):
                    real, chain = [], [self.layers]
                todo = target.split("/") + todo
                continue
            if not todo:
                real.append(part)
                return real, chain[-1]
            if entry is None or entry[0] != "dir":
                return None  # an intermediate component that is no directory
            real.append(part)
            chain.append(entry[1])
        return (real, chain[-1]) if real else None


def _make_parents(tree: Path, real: list[str], view: _View, owner: int) -> Path:
    """The parent of `real` in `tree` (the top layer), created like the directories below
    (mode and owner of the first copy in a lower layer) where the top layer lacks them."""
    parent = tree
    for i, part in enumerate(real[:-1]):
        parent = parent / part
        if os.path.lexists(parent):
            continue  # resolve() found it to be a directory in this layer
        mode, uid, gid = 0o755, owner, owner
        entry = view.resolve(real[: i + 1], follow_last=False)
        if entry is not None:
            found = view.lookup(entry[1], part)
            if found is not None and found[0] == "dir":
                st = found[2]
                mode, uid, gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
        parent.mkdir(mode=0o700)
        os.chown(parent, uid, gid)
        os.chmod(parent, mode)
    return parent


def _inodes(path: Path) -> set[tuple[int, int]]:
    """(dev, ino) of the non-directories at or under `path` (lstat, never following)."""
    out: set[tuple[int, int]] = set()
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return {(st.st_dev, st.st_ino)} if st.st_nlink > 1 else out
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            sub = os.lstat(os.path.join(dirpath, name))
            if sub.st_nlink > 1:
                out.add((sub.st_dev, sub.st_ino))
    return out


def _whiteout(target: Path, owner: int) -> None:
    if os.path.lexists(target):
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    os.mknod(target, stat.S_IFCHR | 0o000, _WHITEOUT)  # an overlayfs whiteout
    os.chown(target, owner, owner)


def _scrub_real(tree: Path, real: list[str], view: _View, owner: int, links: set[tuple[int, int]]) -> None:
    parent = _make_parents(tree, real, view, owner)
    target = parent / real[-1]
    if os.path.lexists(target):
        links |= _inodes(target)
    _whiteout(target, owner)


def scrub(tree: Path, paths: list[str], owner: int, lower: list[Path] | None = None) -> list[str]:
    """Remove `paths` (absolute, as the sandbox sees them) from a layer tree and whiteout
    them, so they are absent from the layer and hide any copy in the layers below.

    A path is resolved the way the sandbox resolves it, through `tree` stacked on `lower`
    (the image's layers, top first): a symlinked parent or a symlink at the path itself
    scrubs what it leads to (and the link itself); nothing on the host is followed. Every
    other name of a scrubbed file in `tree` (a hard link, anywhere) is removed too."""
    view = _View([tree, *(lower or [])])
    done: list[str] = []
    real: list[list[str]] = []
    literal: list[PurePosixPath] = []
    for raw in paths:  # resolve every path before changing anything
        if not raw.startswith("/") or "\0" in raw:
            raise errors.InvalidRequest(f"scrub path {raw!r} must be absolute, e.g. /work/answers")
        # (lstrip: for "//x", POSIX normpath keeps the leading //)
        rel = PurePosixPath(os.path.normpath("/" + raw.lstrip("/"))).relative_to("/")
        if str(rel) in ("", "."):
            raise errors.InvalidRequest("refusing to scrub /")
        # The name itself, in its real parent directory (a symlinked parent resolved) ...
        named = view.resolve(list(rel.parts), follow_last=False)
        if named is None:  # a parent that leads nowhere: scrub the literal path, as before
            literal.append(rel)
        else:
            real.append(named[0])
            # ... and, if it is a symlink, what it leads to (as the sandbox would read it).
            target = view.resolve(list(rel.parts), follow_last=True)
            if target is not None and target[0] != named[0]:
                real.append(target[0])
        done.append("/" + str(rel))
    links: set[tuple[int, int]] = set()
    for parts in real:
        _scrub_real(tree, parts, view, owner, links)
    for rel in literal:
        _scrub_literal(tree, rel, owner)
    if links:  # every other name of a scrubbed file
        for dirpath, _, filenames in os.walk(tree):
            for name in filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) in links:
                    _whiteout(Path(path), owner)
    return done


def _scrub_literal(tree: Path, rel: PurePosixPath, owner: int) -> None:
    parent = tree
    for part in rel.parts[:-1]:  # never follow a symlink out of the tree
        parent = parent / part
        if parent.is_symlink() or (os.path.lexists(parent) and not parent.is_dir()):
            parent.unlink()
        if not parent.exists():
            parent.mkdir(mode=0o755)
            os.chown(parent, owner, owner)
    _whiteout(parent / rel.parts[-1], owner)


def strip_setid(tree: Path) -> int:
    """Clear the setuid and setgid bits of every regular file in a layer made from a
    sandbox: its files belong to sandbox ids, and no host user may gain one. Returns how
    many files were changed."""
    n = 0
    for dirpath, _, filenames in os.walk(tree):
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                n += 1
    return n


# Fork layers live on the edge's run tmpfs, shared by every tenant: each source sandbox may
# hold this many at once, together no more than its own disk_mb, and a copy must leave a
# quarter of the tmpfs free for the others.
MAX_FORK_LAYERS_PER_SANDBOX = 8
FORK_TMPFS_RESERVE = 0.25
_LAYER_SIZE = "size"  # beside a fork layer's tree: the bytes it was admitted with


def disk_usage(tree: Path) -> int:
    """Bytes a tree occupies (allocated blocks; hard links once), never following links."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def over_cap(what: str, sandbox_id: str, needed: int, cap: int) -> errors.QuotaExceeded:
    """The refusal of a copy bigger than the bytes reserved for it before it began (`cap`:
    what its project's quota had left, or less if the caller asked for less)."""
    return errors.QuotaExceeded(
        f"{what} of sandbox {sandbox_id} needs {-(-needed // (1 << 20))} MiB, more than the "
        f"{cap >> 20} MiB reserved for it (what its project's quota has left, or the max_bytes "
        "asked if less); delete snapshots or checkpoints, stop the children of earlier forks, "
        "or make the sandbox's files smaller",
        limit="max_bytes",
        needed_bytes=needed,
        cap_bytes=cap,
    )


def check_cap(what: str, sandbox_id: str, needed: int, cap: int | None) -> None:
    if cap is not None and needed > cap:
        raise over_cap(what, sandbox_id, needed, cap)


def stacked_bytes(tree: Path) -> int:
    """What a layer stacked under a sandbox holds: a fork layer's (`<forks>/<id>/tree`) as
    recorded when it was made, any other (a checkpoint's files, an older edge's) measured."""
    if tree.name == "tree":
        with contextlib.suppress(OSError, ValueError):
            return int((tree.parent / _LAYER_SIZE).read_text())
    return disk_usage(tree)


def record_fork_layer(layer_dir: Path, size: int) -> None:
    layer_dir.mkdir(mode=0o700, exist_ok=True)
    (layer_dir / _LAYER_SIZE).write_text(str(size))


def check_fork_count(forks: Path, sandbox_id: str) -> None:
    """Refuse (quota_exceeded) a fork of a sandbox that already holds its most fork layers."""
    held = [d for d in forks.iterdir() if d.name.startswith(f"{sandbox_id}-")]
    if len(held) >= MAX_FORK_LAYERS_PER_SANDBOX:
        raise errors.QuotaExceeded(
            f"sandbox {sandbox_id} already has {len(held)} fork layers alive (at most "
            f"{MAX_FORK_LAYERS_PER_SANDBOX}); stop the children of earlier forks, or fork a snapshot",
            limit="fork_layers",
        )


def check_fork_room(forks: Path, sandbox_id: str, need: int, *, cap: int | None, budget: int) -> None:
    """Refuse (quota_exceeded) a fork layer of `need` bytes (measured with the source frozen)
    before it is copied: over `cap` (the bytes reserved for it), over the source's share of
    the run tmpfs (`budget` for all its fork layers together), or past what the tmpfs `forks`
    is on must keep free for the others."""
    check_cap("the fork layer", sandbox_id, need, cap)
    held = sum(stacked_bytes(d / "tree") for d in forks.iterdir() if d.name.startswith(f"{sandbox_id}-"))
    if held + need > budget:
        raise errors.QuotaExceeded(
            f"forking sandbox {sandbox_id} would copy {need >> 20} MiB into the edge's shared fork space, "
            f"where its fork layers hold {held >> 20} MiB already: together at most its disk_mb "
            f"({budget >> 20} MiB); stop the children of earlier forks, or fork a snapshot",
            limit="fork_space",
        )
    check_run_tmpfs_room(forks, sandbox_id, need)


def check_run_tmpfs_room(directory: Path, sandbox_id: str, need: int) -> None:
    """Refuse (quota_exceeded) a fork's copy of `need` bytes into the run tmpfs `directory`
    is on past what that tmpfs must keep free for the others."""
    st = os.statvfs(directory)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if need > free - FORK_TMPFS_RESERVE * size:
        raise errors.QuotaExceeded(
            f"forking sandbox {sandbox_id} would copy {need >> 20} MiB into the edge's shared fork "
            f"space, which has {max(0, free) >> 20} MiB free of {size >> 20} MiB; stop other forks' "
            "children, make the sandbox's writable layer smaller, or fork a snapshot",
            limit="fork_space",
        )


def spool_room(directory: Path, margin: int = 256 << 20) -> int:
    """Bytes a spool in `directory` may take when what it holds is then unpacked beside it
    (both on that file system), keeping `margin` free."""
    st = os.statvfs(directory)
    return max(0, (st.f_bavail * st.f_frsize - margin) // 2)
