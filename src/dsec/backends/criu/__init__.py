"""Memory checkpoints: dump a sandbox's processes with CRIU and restore them, into the
same sandbox or into a new one.

What is dumped: every *user* process of the sandbox (each child of the init, with
its descendants, one CRIU image set per tree), never the init (`dsec-shim`) itself:
the init's control socket and its handle on the writable layer belong to the edge.
A restore starts the trees again inside a sandbox the edge created normally, so the
restored processes become children of that sandbox's init, in its user, pid, mount,
network, ipc, uts and cgroup namespaces, under its seccomp filter, capabilities and
cgroup limits. The files are not part of the CRIU images: the caller copies the
writable layer while the processes are stopped (``while_stopped``) and restores into
a sandbox whose root stacks that copy (like a fork), or into the same sandbox.

How CRIU runs (CRIU >= 4.2, from Debian forky, unpacked under ``<data>/criu``):

* dump: as host root (CRIU needs CAP_SYS_ADMIN in the initial user namespace to
  suspend the seccomp filter of a traced process and to read /proc/<pid>/map_files)
  but inside the sandbox's pid, mount, network, ipc, uts and cgroup namespaces, so
  that CRIU sees those as "its own" and dumps none of them. The processes' user
  namespace then differs from CRIU's, so CRIU records it; the images are patched
  afterwards (``inventory.img``: root user namespace := the tasks' one) so that a
  restore does not create a new user namespace.
* restore: as root of the sandbox's own user namespace (setns, then uid/gid 0) with
  ``--unprivileged``, in the same namespaces: restored processes are born in the
  target sandbox's user namespace with the ids and capabilities they had.
* CRIU holds no descriptor on a host directory. Its binary and libraries and the images
  directory are *detached mounts* (open_tree(OPEN_TREE_CLONE), owned by an anonymous
  mount namespace, not attached anywhere) reached as ``/proc/self/fd/N/...``: ``..`` at
  the root of a detached mount stays there, so whatever the sandbox makes CRIU resolve (a
  symlink to ``/proc/self/cwd/../..`` or ``/proc/<criu>/fd/N/..``) ends inside CRIU's own
  tree or the images, never on the host. For a restore both are read-only, nosuid and
  nodev (the images are root's, 0644: readable by the restoring root id, writable by no
  sandbox id), and nothing CRIU can reach is writable: it logs to its stdout (``-o -``),
  a memfd the edge reads back (at most LOG_LIMIT bytes). A restored process can end up
  where CRIU's cwd was (a path swapped for ``/proc/self/cwd`` after the check below, by a
  tree restored earlier); before, that was a per-restore work directory on the host, in
  which the edge then opened CRIU's logs by name as root, so the process could point them
  at any host file.
* Every path CRIU will open by name (``files.img``: cwd, root, executables, mapped and
  open files, fifos) is checked before a restore, and right after a dump, from the
  sandbox's root with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
  RESOLVE_NO_MAGICLINKS), with the recorded object type: a path the sandbox has
  changed since (a directory swapped for a symlink, a symlinked parent) refuses the
  checkpoint or the restore (reason ``file_changed``). After a restore, every process
  of the sandbox but its init is checked to hold no cwd, root or descriptor on a mount
  outside the sandbox's mount namespace; if one does, the restored processes are
  killed and the restore refused.
* a small Python helper (``_HELPER``) joins the cgroups, enters the namespaces,
  forks into the pid namespace and execs CRIU; for a restore it first moves the
  namespace's pid cursor past every pid in the images, so CRIU's own processes
  cannot take a pid a restored process needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsec.backends.base import SandboxHandle
from dsec.backends.criu.criu import (
    _COMMON,
    DEBIAN_SUITE,
    MIN_CRIU,
    criu_argv,
    criu_version,
    ensure_criu,
    find_criu,
)
from dsec.backends.criu.images import (
    Field,
    _patch_root_userns,
    read_pstree,
)
from dsec.backends.criu.paths import (
    RecordedFile,
    _open_root,
    check_recorded_paths,
    detached_clone,
    foreign_holdings,
    recorded_files,
    taken_pids,
)
from dsec.backends.criu.runner import _criu_error, _run_criu
from dsec.errors import UnsupportedOperation
from dsec.isolation.cgroups import CgroupHost, kill_group

# --- the process trees of a sandbox -----------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def _tree(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _ns_pid(host_pid: int) -> int:
    with open(f"/proc/{host_pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    raise ProcessLookupError(host_pid)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def _edge_objects() -> set[str]:
    """Pipes and sockets this (edge) process holds: a sandbox process sharing one is a
    running exec or session, whose other end cannot be checkpointed with it."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith(("pipe:", "socket:")):
                out.add(link)
    return out


def _check_attached(sandbox: str, pids: list[int]) -> None:
    edge = _edge_objects()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in edge:
                        raise UnsupportedOperation(
                            f"cannot checkpoint sandbox {sandbox}: process {_ns_pid(pid)} "
                            f"({_cmdline(pid)}) is a running exec or session (its fd {fd} is connected "
                            "to the edge). Checkpoints cover background processes: start them with "
                            "`nohup CMD > FILE 2>&1 &`, and let execs finish / close sessions first",
                            reason="attached_process",
                        )


def user_trees(container: SandboxHandle) -> list[int]:
    """Host pids of the roots of the sandbox's user process trees (children of its init)."""
    return sorted(_children(container.pid))


# --- dump / restore ---------------------------------------------------------------------


@dataclass
class TreeInfo:
    dir: str  # sub-directory of the checkpoint holding this tree's CRIU images
    root: int  # pid of the tree's root inside the sandbox
    pids: list[int]  # every pid and tid of the tree inside the sandbox
    cmdline: str


@dataclass
class CheckpointInfo:
    sandbox: str
    images_dir: str
    trees: list[TreeInfo]
    size_bytes: int
    leave_running: bool
    created_at: float
    timings_ms: dict[str, float] = field(default_factory=dict)

    def save(self) -> None:
        (Path(self.images_dir) / "checkpoint.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def record(
        cls,
        sandbox: str,
        images_dir: Path,
        trees: list[TreeInfo],
        size: int,
        leave_running: bool,
        timings_ms: dict[str, float],
    ) -> CheckpointInfo:
        """A checkpoint made now, saved beside its images."""
        info = cls(sandbox, str(images_dir), trees, size, leave_running, time.time(), timings_ms)
        info.save()
        return info

    @classmethod
    def load(cls, images_dir: Path) -> CheckpointInfo:
        try:
            raw = json.loads((images_dir / "checkpoint.json").read_text())
        except (OSError, ValueError) as e:
            raise UnsupportedOperation(
                f"{images_dir} holds no usable memory checkpoint ({e})", reason="no_checkpoint"
            ) from e
        raw["trees"] = [TreeInfo(**t) for t in raw["trees"]]
        return cls(**raw)


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def _seal_tree(root: Path) -> None:
    """CRIU images: root's, readable (0644 / 0755), writable by nobody else."""
    os.chown(root, 0, 0)
    os.chmod(root, 0o755)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chown(os.path.join(dirpath, name), 0, 0, follow_symlinks=False)
            os.chmod(os.path.join(dirpath, name), 0o755, follow_symlinks=False)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chown(path, 0, 0)
                os.chmod(path, 0o644)


def _check_dumped(container: SandboxHandle, images_dir: Path, trees: list[TreeInfo]) -> None:
    root = _open_root(container)
    try:
        for t in trees:
            check_recorded_paths(images_dir / t.dir, root, "checkpoint", container.id)
    finally:
        os.close(root)


def _check_restored(container: SandboxHandle, cgroups: CgroupHost) -> list[str]:
    pids: list[int] = []
    for d, _, _ in os.walk(cgroups.tracking_dir(container.id)):
        with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
            pids += [int(x) for x in f.read().split()]
    return foreign_holdings(container, [p for p in pids if p != container.pid])


async def dump(
    container: SandboxHandle,
    images_dir: Path,
    *,
    criu: Path,
    uid_offset: int,
    leave_running: bool,
    while_stopped: Callable[[], Awaitable[None]] | None = None,
) -> CheckpointInfo:
    """Checkpoint every user process of a running sandbox into `images_dir` (created;
    must not exist). The processes stay stopped while `while_stopped` runs (copy the
    writable layer there, e.g. into ``images_dir / "fs"``, so files and memory match),
    then run on (`leave_running`) or are killed. The sandbox itself (its init) keeps running either way."""
    t0 = time.perf_counter()
    roots = user_trees(container)
    if not roots:
        raise UnsupportedOperation(
            f"sandbox {container.id} runs no processes to checkpoint; start them in the background "
            "(`nohup CMD > FILE 2>&1 &`) first, or use snapshot() to keep the files",
            reason="no_processes",
        )
    before = [p for r in roots for p in _tree(r)]
    _check_attached(container.id, before)
    already_stopped = {p for p in before if _state(p) in ("T", "t")}  # stay stopped afterwards
    images_dir.mkdir(parents=True)
    trees: list[TreeInfo] = []
    stopped: list[int] = []
    try:
        for i, root in enumerate(roots):
            d = images_dir / f"tree-{i}"
            d.mkdir()
            ns_root = _ns_pid(root)
            cmd = _cmdline(root)
            args = ["dump", "-t", str(ns_root), "-D", "@IMG@", "--leave-stopped", *_COMMON]
            rc, log = await _run_criu(container, criu, d, args, as_userns_root=False)
            stopped += _tree(root)  # criu leaves the dumped tree stopped (SIGSTOP), also on most errors
            if rc != 0:
                raise _criu_error(log, "checkpoint", container.id)
            pids = sorted({t for _, _, threads in read_pstree(d) for t in threads})
            _patch_root_userns(d, ns_root)
            trees.append(TreeInfo(d.name, ns_root, pids, cmd))
        # Every tree is stopped now; a later tree ran while an earlier one was dumped and may
        # have swapped a path the earlier one holds: refuse such a checkpoint at once.
        await asyncio.get_running_loop().run_in_executor(None, _check_dumped, container, images_dir, trees)
        t_dump = time.perf_counter()
        if while_stopped is not None:
            await while_stopped()
        t_copy = time.perf_counter()
    except BaseException:
        _signal_all([p for p in stopped if p not in already_stopped], signal.SIGCONT)  # nothing changed
        shutil.rmtree(images_dir, ignore_errors=True)
        raise
    if leave_running:
        _signal_all([p for p in stopped if p not in already_stopped], signal.SIGCONT)
    else:
        _signal_all(stopped, signal.SIGKILL)
    # The restore runs as the sandbox's root id: it must read the images (through a
    # detached read-only mount, so no path to them is needed) but write none of them, and
    # no other id may reach the checkpoint at all (the caller keeps the files here too).
    os.chmod(images_dir, 0o700)
    for t in trees:
        await asyncio.get_running_loop().run_in_executor(None, _seal_tree, images_dir / t.dir)
    size = sum(f.stat().st_size for f in images_dir.rglob("*.img"))
    timings = {"dump": (t_dump - t0) * 1000, "while_stopped": (t_copy - t_dump) * 1000}
    return CheckpointInfo.record(container.id, images_dir, trees, size, leave_running, timings)


def _cgroup_targets(cgroups: CgroupHost, sandbox_id: str, group: Path) -> list[Path]:
    """cgroup.procs files to join: the exec group in the tracking hierarchy, the
    sandbox's own cgroup in every other (v1) hierarchy."""
    tracking = cgroups.tracking_dir(sandbox_id)
    out = [group / "cgroup.procs"]
    for d in cgroups.sandbox_dirs(sandbox_id):
        if d != tracking and (d / "cgroup.procs").exists():
            out.append(d / "cgroup.procs")
    return out


async def restore(
    container: SandboxHandle,
    images_dir: Path,
    *,
    criu: Path,
    cgroups: CgroupHost,
    group_name: str,
) -> list[int]:
    """Restore the checkpoint in `images_dir` into a running sandbox, whose files must be
    the checkpointed ones (a new sandbox stacking the copy made during dump(), or the same
    sandbox with its user processes gone). The processes join cgroup `group` (an exec
    cgroup of the sandbox named `group_name`, created here) and become children of the sandbox's
    init; returns the pids of the restored tree roots inside the sandbox."""
    info = CheckpointInfo.load(images_dir)
    needed = [p for t in info.trees for p in t.pids]
    root = _open_root(container)
    try:
        deadline = time.monotonic() + 2.0  # processes just killed are reaped by the init shortly
        while (busy := taken_pids(root, needed)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        os.close(root)
    if busy:
        pid, cmdline = next(iter(busy.items()))
        raise UnsupportedOperation(
            f"cannot restore into sandbox {container.id}: pid {pid} is taken there by "
            f"{cmdline!r} and the checkpointed processes need it; restore into a new "
            "sandbox, or stop that process",
            reason="pid_in_use",
        )
    min_pid = max(p for t in info.trees for p in t.pids)
    group = cgroups.open_exec_group(container.id, group_name)
    group.close_fd()
    targets = _cgroup_targets(cgroups, container.id, group.path)
    restored: list[int] = []
    loop = asyncio.get_running_loop()
    root = _open_root(container)
    try:
        for tree in info.trees:
            d = images_dir / tree.dir
            # The paths CRIU opens by name, as the sandbox has them now (restoring in place,
            # or after an earlier tree of this checkpoint was restored and ran).
            await loop.run_in_executor(
                None, check_recorded_paths, d, root, "restore a checkpoint into", container.id
            )
            rc, log = await _run_criu(
                container,
                criu,
                d,
                ["restore", "-D", "@IMG@", "--restore-detached", "--unprivileged", *_COMMON],
                as_userns_root=True,
                cgroups=targets,
                min_pid=min_pid,
            )
            if rc != 0:
                raise _criu_error(log, "restore a checkpoint into", container.id)
            restored.append(tree.root)
        bad = await loop.run_in_executor(None, _check_restored, container, cgroups)
        if bad:
            raise UnsupportedOperation(
                f"cannot restore a checkpoint into sandbox {container.id}: a restored process holds "
                f"a file outside the sandbox ({'; '.join(bad[:3])}); the files changed since the "
                "checkpoint. Restore into a new sandbox from an untouched checkpoint",
                reason="file_changed",
            )
    except BaseException:
        await asyncio.get_running_loop().run_in_executor(None, group.remove)  # kills what was restored
        raise
    finally:
        os.close(root)
    return restored


def _kill_user_processes(cgroups: CgroupHost, sandbox_id: str) -> None:
    d = cgroups.user_dir(sandbox_id)
    limit = None
    with contextlib.suppress(OSError):
        limit = (d / "pids.max").read_text().strip()
    try:
        kill_group(d, cgroups.version)  # on v1 this sets pids.max to 0 to stop forks
    finally:
        if limit is not None:
            (d / "pids.max").write_text(limit)


async def kill_user_processes(cgroups: CgroupHost, sandbox_id: str) -> None:
    """Kill every process of the sandbox but its init (before a restore in place)."""
    await asyncio.get_running_loop().run_in_executor(None, _kill_user_processes, cgroups, sandbox_id)


__all__ = [
    "DEBIAN_SUITE",
    "MIN_CRIU",
    "CheckpointInfo",
    "Field",
    "RecordedFile",
    "TreeInfo",
    "check_recorded_paths",
    "criu_argv",
    "criu_version",
    "detached_clone",
    "dump",
    "ensure_criu",
    "find_criu",
    "foreign_holdings",
    "kill_user_processes",
    "read_pstree",
    "recorded_files",
    "restore",
    "user_trees",
]
