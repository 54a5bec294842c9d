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
* CRIU holds no descriptor on a host directory. Its binary and libraries, the images
  directory and (for a restore) a scratch work directory for its log are *detached
  mounts* (open_tree(OPEN_TREE_CLONE), owned by an anonymous mount namespace, not
  attached anywhere) reached as ``/proc/self/fd/N/...``: ``..`` at the root of a
  detached mount stays there, so whatever the sandbox makes CRIU resolve (a symlink to
  ``/proc/self/cwd/../..`` or ``/proc/<criu>/fd/N/..``) ends inside CRIU's own tree or
  the images, never on the host. The binary and the images are read-only, nosuid and
  nodev for a restore (the images are root's, 0644: readable by the restoring root id,
  writable by no sandbox id); only the per-restore work directory is writable. The
  helper's output goes to a memfd, copied into ``helper.log`` by the edge.
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
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsec.backends.container import Container, run_process_quick
from dsec.errors import InternalError, UnsupportedOperation
from dsec.isolation import linux
from dsec.isolation.cgroups import CgroupHost, kill_group

DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "forky"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
MIN_CRIU = (4, 2)
_LIBDIR = "usr/lib/x86_64-linux-gnu"
_LOADER = f"{_LIBDIR}/ld-linux-x86-64.so.2"
_NAMESPACES = ("cgroup", "ipc", "uts", "net", "pid", "mnt")
# Flags of every dump and restore. --shell-job: a tree's session usually belongs to a
# process that exited (the `sh -c` that started it in the background).
_COMMON = ["--shell-job", "--manage-cgroups=ignore", "--file-locks"]


# --- CRIU installation ------------------------------------------------------------------


def _apt_options(work: Path, mirror: str, suite: str) -> list[str]:
    (work / "state" / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (work / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (work / "sources.list.d").mkdir(exist_ok=True)
    (work / "preferences.d").mkdir(exist_ok=True)
    (work / "state" / "status").touch()
    (work / "sources.list").write_text(f"deb [signed-by={DEBIAN_KEYRING}] {mirror} {suite} main\n")
    opts = {
        "Dir::State": work / "state",
        "Dir::State::status": work / "state" / "status",  # empty: resolve the whole closure
        "Dir::Cache": work / "cache",
        "Dir::Etc::sourcelist": work / "sources.list",
        "Dir::Etc::sourceparts": work / "sources.list.d",
        "Dir::Etc::preferencesparts": work / "preferences.d",
        "APT::Architecture": "amd64",
        "APT::Install-Recommends": "false",
        "Debug::NoLocking": "true",
    }
    return [x for k, v in opts.items() for x in ("-o", f"{k}={v}")]


def criu_argv(root: Path | str, *args: str) -> list[str]:
    """Run the unpacked CRIU through its own loader and libraries (not the host's)."""
    return [f"{root}/{_LOADER}", "--library-path", f"{root}/{_LIBDIR}", f"{root}/usr/sbin/criu", *args]


def criu_version(root: Path) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(criu_argv(root, "--version"), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\d+)\.(\d+)", out.stdout)
    return (int(m[1]), int(m[2])) if m and out.returncode == 0 else None


def ensure_criu(data_dir: Path, *, mirror: str = DEBIAN_MIRROR, suite: str = DEBIAN_SUITE) -> Path:
    """CRIU >= 4.2 and the libraries it needs, unpacked under ``<data_dir>/criu``; idempotent.

    Debian 12's criu 3.17 fails on current kernels (vDSO) and Debian 13's 4.1 cannot
    dump any TCP socket on kernels >= 6.16 (SO_PASSCRED became unix-only; fixed in
    4.2), so the packages come from Debian forky through a private apt configuration (its own sources list,
    state and cache in a temporary directory): the host's apt sources and dpkg
    database are not touched and nothing is installed system-wide. Returns the root
    of the unpacked tree (``usr/sbin/criu``, ``usr/lib/x86_64-linux-gnu``)."""
    dest = data_dir / "criu"
    if (dest / ".ready").exists() and (criu_version(dest) or (0,)) >= MIN_CRIU:
        return dest
    if os.uname().machine != "x86_64":
        raise UnsupportedOperation(
            "memory checkpoints are packaged for x86_64 hosts only", reason="criu_unavailable"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dsec-criu-", dir=data_dir) as tmp:
        work = Path(tmp)
        opts = _apt_options(work / "apt", mirror, suite)
        for cmd in (
            ["apt-get", *opts, "update"],
            ["apt-get", *opts, "install", "-y", "--download-only", "criu"],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise UnsupportedOperation(
                    f"cannot download CRIU from {mirror} {suite}: {(r.stderr or r.stdout).strip()[-800:]}",
                    reason="criu_unavailable",
                )
        tree = work / "tree"
        tree.mkdir()
        for deb in sorted((work / "apt" / "cache" / "archives").glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True, timeout=300)
        version = criu_version(tree)
        if version is None or version < MIN_CRIU:
            raise UnsupportedOperation(
                f"the CRIU from {suite} does not run here (version {version})", reason="criu_unavailable"
            )
        (tree / ".ready").write_text(".".join(map(str, version)) + "\n")
        old = data_dir / f".criu-old-{os.getpid()}"
        if dest.exists():
            dest.rename(old)
        tree.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    return dest


def find_criu(dest: Path) -> Path:
    """The CRIU tree ensure_criu() unpacked at `dest` (``<data_dir>/criu``), or a clear error."""
    if not (dest / ".ready").exists() or not (dest / "usr" / "sbin" / "criu").exists():
        raise UnsupportedOperation(
            f"memory checkpoints need CRIU >= 4.2, which is not installed on this edge ({dest} is missing); "
            "run install.sh (or `python -c 'from dsec.edge.checkpoint import ensure_criu; "
            f'ensure_criu(Path("{dest.parent}"))\'`), or use pause() / snapshot() instead',
            reason="criu_unavailable",
        )
    return dest


# --- CRIU image files (protobuf; only the few fields we read or patch) --------------------


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def _enc_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        c, v = v & 0x7F, v >> 7
        out.append(c | (0x80 if v else 0))
        if not v:
            return bytes(out)


Field = tuple[int, int, int | bytes]


def _fields(b: bytes) -> list[Field]:
    out: list[Field] = []
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        v: int | bytes
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 2:
            n, i = _varint(b, i)
            v, i = b[i : i + n], i + n
        elif wt == 1:
            v, i = b[i : i + 8], i + 8
        elif wt == 5:
            v, i = b[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        out.append((num, wt, v))
    return out


def _encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for num, wt, v in fields:
        out += _enc_varint(num << 3 | wt)
        if wt == 0:
            assert isinstance(v, int)
            out += _enc_varint(v)
        elif wt == 2:
            assert isinstance(v, bytes)
            out += _enc_varint(len(v)) + v
        else:
            assert isinstance(v, bytes)
            out += v
    return bytes(out)


def _entries(data: bytes, magics: int) -> list[bytes]:
    """The protobuf entries of an image file: `magics` u32 magic words, then (u32 size, entry)*."""
    i, out = 4 * magics, []
    while i + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, i)
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def read_pstree(images: Path) -> list[tuple[int, int, list[int]]]:
    """(pid, ppid, thread ids) of every task in a dump, as the sandbox numbers them."""
    tasks = []
    for entry in _entries((images / "pstree.img").read_bytes(), 2):
        pid = ppid = 0
        threads: list[int] = []
        for num, wt, v in _fields(entry):
            if num == 1 and isinstance(v, int):
                pid = v
            elif num == 2 and isinstance(v, int):
                ppid = v
            elif num == 5:
                if isinstance(v, bytes) and wt == 2:  # packed
                    j = 0
                    while j < len(v):
                        t, j = _varint(v, j)
                        threads.append(t)
                elif isinstance(v, int):
                    threads.append(v)
        tasks.append((pid, ppid, threads))
    return tasks


def _patch_root_userns(images: Path, root_pid: int) -> None:
    """Make the tasks' user namespace CRIU's "root" one in the images, so a restore run
    inside the target sandbox's user namespace restores into it instead of creating one."""
    ids = _entries((images / f"ids-{root_pid}.img").read_bytes(), 2)[0]
    user_ns = next((v for num, _, v in _fields(ids) if num == 10), None)
    if not isinstance(user_ns, int):
        raise InternalError(f"CRIU images in {images} name no user namespace for task {root_pid}")
    path = images / "inventory.img"
    data = path.read_bytes()
    magic, n = struct.unpack_from("<II", data)
    body, rest = data[8 : 8 + n], data[8 + n :]
    out: list[Field] = []
    for num, wt, v in _fields(body):
        if num == 3 and isinstance(v, bytes):  # root_ids (task_kobj_ids_entry)
            v = _encode([(f, t, user_ns if f == 10 else x) for f, t, x in _fields(v)])
        out.append((num, wt, v))
    new = _encode(out)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(struct.pack("<II", magic, len(new)) + new + rest)
    tmp.replace(path)


# --- the paths a restore opens by name ------------------------------------------------

_RESOLVE_STRICT = linux.RESOLVE_BENEATH | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS


@dataclass
class RecordedFile:
    id: int
    name: str  # absolute, as the sandbox saw it at dump time
    mode: int | None  # st_mode at dump time, when CRIU recorded it


def recorded_files(images: Path) -> list[RecordedFile]:
    """Every regular-file entry of a dump (files.img: open files, cwd, root, executables,
    mapped files, fifos): the paths CRIU opens by name when it restores."""
    try:
        data = (images / "files.img").read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for entry in _entries(data, 2):
        for num, _, v in _fields(entry):
            if num != 3 or not isinstance(v, bytes):  # file_entry.reg
                continue
            fid, name, mode = 0, None, None
            for f, _, x in _fields(v):
                if f == 1 and isinstance(x, int):
                    fid = x
                elif f == 6 and isinstance(x, bytes):
                    name = os.fsdecode(x)
                elif f == 10 and isinstance(x, int):
                    mode = x
            if name is not None:
                out.append(RecordedFile(fid, name, mode))
    return out


def _remapped_ids(images: Path) -> set[int]:
    """Ids of files CRIU recreates itself (deleted files kept as ghosts, or linked)."""
    try:
        data = (images / "remap-fpath.img").read_bytes()
    except FileNotFoundError:
        return set()
    return {v for e in _entries(data, 2) for num, _, v in _fields(e) if num == 1 and isinstance(v, int)}


def _changed(root_fd: int, f: RecordedFile, remapped: set[int]) -> str | None:
    """Why recorded file `f` no longer resolves to what was dumped, seen from the
    sandbox's root without following any link; None when it does."""
    rel = f.name.lstrip("/") or "."
    if f.id in remapped:  # recreated by CRIU at that name: its directory must be genuine
        rel, want = os.path.dirname(rel) or ".", stat.S_IFDIR
    else:
        want = stat.S_IFMT(f.mode) if f.mode else 0
    try:
        fd = linux.openat2(root_fd, rel, os.O_PATH | os.O_NOFOLLOW, 0, _RESOLVE_STRICT)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EXDEV):
            return f"{f.name} now goes through a symbolic link"
        return f"{f.name}: {os.strerror(e.errno or 0)}"
    try:
        got = stat.S_IFMT(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if want and got != want:
        return f"{f.name} is no longer the same kind of file"
    return None


def check_recorded_paths(images: Path, root_fd: int, what: str, sandbox: str) -> None:
    """Refuse (reason file_changed) a dump whose recorded paths the sandbox changed, e.g. a
    dumped directory swapped for a symlink to /proc/self/cwd/.. or a symlinked parent."""
    remapped = _remapped_ids(images)
    for f in recorded_files(images):
        why = _changed(root_fd, f, remapped)
        if why is not None:
            raise UnsupportedOperation(
                f"cannot {what} sandbox {sandbox}: a file the processes hold changed since they were "
                f"dumped ({why}). Restore into a new sandbox from an untouched checkpoint, or take a new one",
                reason="file_changed",
            )


def _open_root(container: Container) -> int:
    """An O_PATH handle on the sandbox's root directory, in its mount namespace."""
    try:
        return os.open(f"/proc/{container.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise UnsupportedOperation(f"sandbox {container.id} is not running", reason="not_running") from e


def _mnt_id(fdinfo: str) -> int | None:
    try:
        with open(fdinfo) as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _shm_mnt_id() -> int | None:
    """The kernel's internal mount of memfds and SysV shared memory (in no namespace)."""
    fd = os.memfd_create("dsec-probe", os.MFD_CLOEXEC)
    try:
        return _mnt_id(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)


def foreign_holdings(container: Container, pids: Sequence[int]) -> list[str]:
    """Every cwd, root or path descriptor of `pids` (host pids of the sandbox's processes)
    on a mount outside the sandbox's mount namespace: a host directory or file, or a
    detached mount of the platform's. Pipes, sockets and anonymous inodes have no path;
    memfds live on the kernel's internal shm mount."""
    with open(f"/proc/{container.pid}/mountinfo") as f:
        allowed = {int(line.split()[0]) for line in f}
    shm = _shm_mnt_id()
    if shm is not None:
        allowed.add(shm)
    bad = []
    for pid in pids:
        links = ["cwd", "root"]
        with contextlib.suppress(OSError):
            links += [f"fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")]
        for link in links:
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if not target.startswith("/"):
                continue
            if link.startswith("fd/"):
                mnt = _mnt_id(f"/proc/{pid}/fdinfo/{link[3:]}")
            else:
                try:
                    fd = os.open(f"/proc/{pid}/{link}", os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    mnt = _mnt_id(f"/proc/self/fdinfo/{fd}")
                finally:
                    os.close(fd)
            if mnt is not None and mnt not in allowed:
                bad.append(f"process {pid} {link} -> {target}")
    return bad


# --- detached mounts ------------------------------------------------------------------

_SYS_OPEN_TREE = 428
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_AT_FDCWD = -100
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def detached_clone(path: Path, *, readonly: bool) -> int:
    """A detached bind mount of `path` (open_tree(OPEN_TREE_CLONE)), nosuid and nodev, as
    a close-on-exec fd. Its root is a mount root with no parent: ``..`` stays there, so
    nothing walked from it reaches the host's tree."""
    fd = int(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(path), _OPEN_TREE_CLONE | os.O_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise InternalError(f"open_tree({path}): {os.strerror(e)}")
    flags = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (_MOUNT_ATTR_RDONLY if readonly else 0)
    attr = _MountAttr(flags, 0, 0, 0)
    size = ctypes.sizeof(attr)
    if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), size) < 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise InternalError(f"mount_setattr({path}): {os.strerror(e)}")
    return fd


# --- running CRIU in a sandbox's namespaces ----------------------------------------------

# argv[1]: JSON {ns: {name: fd}, user: fd | null, cgroups: [path], last_pid: fd | null,
# min_pid: int, exe: [argv with @IMG@ and @WORK@], img: fd, work: fd}. Kept small: started with -S -I.
_HELPER = r"""
import ctypes, json, os, sys
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def setns(fd, what):
    if libc.setns(fd, 0) != 0:
        e = ctypes.get_errno()
        sys.exit(f"dsec-criu-helper: setns {what}: {os.strerror(e)}")
    os.close(fd)
for p in a["cgroups"]:
    with open(p, "w") as f:
        f.write("0")
for name, fd in a["ns"].items():
    setns(fd, name)
if a["user"] is not None:
    setns(a["user"], "user")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    try:
        os.setgroups([])
    except OSError:
        pass
if a["last_pid"] is not None:
    # In the pid namespace: move its cursor past every pid the images need.
    # Best effort (a write here has been seen to fail with EINVAL once in a while): without
    # it CRIU still gets its pids unless another process took one, which it then reports.
    for attempt in range(3):
        pid = os.fork()
        if pid == 0:
            fd = a["last_pid"]
            try:
                cur = int(os.pread(fd, 32, 0) or b"0")
                if cur < a["min_pid"]:
                    os.pwrite(fd, str(a["min_pid"]).encode(), 0)
            except OSError:
                os._exit(1)
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        if st == 0:
            break
    os.close(a["last_pid"])
pid = os.fork()
if pid == 0:
    os.setsid()
    img, work = f"/proc/self/fd/{a['img']}", f"/proc/self/fd/{a['work']}"
    argv = [x.replace("@IMG@", img).replace("@WORK@", work) for x in a["exe"]]
    os.execv(argv[0], argv)
_, st = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(st))
"""


async def _run_criu(
    container: Container,
    criu: Path,
    images: Path,
    args: list[str],
    *,
    as_userns_root: bool,
    work: Path | None = None,
    cgroups: Sequence[Path] = (),
    min_pid: int | None = None,
) -> int:
    """Run `criu ARGS` in the sandbox's namespaces; CRIU's exit code.

    ``@IMG@`` and ``@WORK@`` in ARGS name the images directory and the work directory (its
    log; `images` itself unless `work` is given, in which case the images are read-only).
    CRIU reaches its tree, the images and the work directory only through detached mounts
    (see detached_clone), and the helper's output lands in helper.log of the work directory."""
    if not container.alive():
        raise UnsupportedOperation(f"sandbox {container.id} is not running", reason="not_running")
    fds: list[int] = []
    logs = work or images

    def keep(fd: int) -> int:
        fds.append(fd)
        os.set_inheritable(fd, True)
        return fd

    try:
        ns = {n: keep(os.open(f"/proc/{container.pid}/ns/{n}", os.O_RDONLY)) for n in _NAMESPACES}
        user = keep(os.open(f"/proc/{container.pid}/ns/user", os.O_RDONLY)) if as_userns_root else None
        if not container.alive():  # the pid could have been reused between the check and the opens
            raise UnsupportedOperation(f"sandbox {container.id} is not running", reason="not_running")
        root = keep(detached_clone(criu, readonly=True))
        img = keep(detached_clone(images, readonly=work is not None))
        wrk = keep(detached_clone(work, readonly=False)) if work is not None else img
        last = keep(os.open("/proc/sys/kernel/ns_last_pid", os.O_RDWR)) if min_pid is not None else None
        spec = {
            "ns": ns,
            "user": user,
            "cgroups": [str(p) for p in cgroups],
            "last_pid": last,
            "min_pid": min_pid or 0,
            "img": img,
            "work": wrk,
            "exe": criu_argv(f"/proc/self/fd/{root}", *args),
        }
        argv = [sys.executable, "-S", "-I", "-c", _HELPER, json.dumps(spec)]
        log = os.memfd_create("dsec-criu-helper", os.MFD_CLOEXEC)  # no host file in CRIU's fd table
        try:
            rc = await run_process_quick(argv, log, fds)
            os.lseek(log, 0, os.SEEK_SET)
            with open(logs / "helper.log", "ab") as out, open(log, "rb", closefd=False) as src:
                shutil.copyfileobj(src, out)
        finally:
            os.close(log)
        return rc
    finally:
        for fd in fds:
            os.close(fd)


_REASONS = [
    (
        r"Connected TCP socket|TCP connection|tcp-established",
        "tcp_connection",
        "a process has an established TCP connection; close it before the checkpoint",
    ),
    (
        r"[Uu]nix socket|unix-sk|ext-unix-sk|external socket",
        "external_socket",
        "a process holds a Unix socket connected outside the dumped processes",
    ),
    (
        r"bad size|has bad mode|Can't open file",
        "file_changed",
        "a file the processes hold changed or vanished since the checkpoint; restore into a new sandbox",
    ),
    (
        r"Can't fork for \d+.*File exists|pid .* busy",
        "pid_in_use",
        "a pid the checkpointed processes need is taken in the target sandbox",
    ),
    (
        r"inotify|fanotify|perf_event|bpf|io_uring|userfaultfd|vfio|Can't dump.*tty|tty",
        "unsupported_resource",
        "a process holds a kernel object CRIU cannot checkpoint",
    ),
]


def _criu_error(images: Path, log_name: str, what: str, sandbox: str) -> UnsupportedOperation:
    text = ""
    with contextlib.suppress(OSError):
        text = (images / log_name).read_text(errors="replace")
    with contextlib.suppress(OSError):
        text += (images / "helper.log").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "Error" in ln or "dsec-criu-helper" in ln]
    # Noise of CRIU's probes in a sandbox, and the generic last words.
    noise = r"tun\.c|RLIMIT_NOFILE|cgroupd|kerndat|FAILED|killed by signal|Unable to detach"
    errs = [ln.split("): ", 1)[-1].strip() for ln in lines if not re.search(noise, ln)]
    detail = "; ".join(dict.fromkeys(errs[:3])) or "no error in the log"
    for pattern, reason, why in _REASONS:
        if any(re.search(pattern, e) for e in errs):
            return UnsupportedOperation(
                f"cannot {what} sandbox {sandbox}: {why} (CRIU: {detail}). "
                "Use pause() to keep the processes in memory, or snapshot()/fork() to keep only the files",
                reason=reason,
            )
    return UnsupportedOperation(
        f"cannot {what} sandbox {sandbox}: CRIU failed ({detail}). "
        "Use pause() to keep the processes in memory, or snapshot()/fork() to keep only the files",
        reason="criu_failed",
    )


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


def user_trees(container: Container) -> list[int]:
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


def _check_dumped(container: Container, images_dir: Path, trees: list[TreeInfo]) -> None:
    root = _open_root(container)
    try:
        for t in trees:
            check_recorded_paths(images_dir / t.dir, root, "checkpoint", container.id)
    finally:
        os.close(root)


def _host_root_id(container: Container) -> int:
    """The host uid the sandbox's root maps to."""
    with open(f"/proc/{container.pid}/uid_map") as f:
        for line in f:
            inside, outside, count = (int(x) for x in line.split())
            if inside <= 0 < inside + count:
                return outside - inside
    raise InternalError(f"sandbox {container.id} maps no root user")


def _make_work_dir(images_dir: Path, tree: str, owner: int) -> Path:
    work = Path(tempfile.mkdtemp(prefix=f".{tree}-restore-", dir=images_dir))
    os.chown(work, owner, owner)
    return work


def _check_restored(container: Container, cgroups: CgroupHost) -> list[str]:
    pids: list[int] = []
    for d, _, _ in os.walk(cgroups.tracking_dir(container.id)):
        with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
            pids += [int(x) for x in f.read().split()]
    return foreign_holdings(container, [p for p in pids if p != container.pid])


async def dump(
    container: Container,
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
            args = ["dump", "-t", str(ns_root), "-D", "@IMG@", "-o", "dump.log", "--leave-stopped", *_COMMON]
            rc = await _run_criu(container, criu, d, args, as_userns_root=False)
            stopped += _tree(root)  # criu leaves the dumped tree stopped (SIGSTOP), also on most errors
            if rc != 0:
                raise _criu_error(d, "dump.log", "checkpoint", container.id)
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
    info = CheckpointInfo(
        sandbox=container.id,
        images_dir=str(images_dir),
        trees=trees,
        size_bytes=size,
        leave_running=leave_running,
        created_at=time.time(),
        timings_ms={"dump": (t_dump - t0) * 1000, "while_stopped": (t_copy - t_dump) * 1000},
    )
    info.save()
    return info


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
    container: Container,
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
    proc = f"/proc/{container.pid}/root/proc"
    needed = [p for t in info.trees for p in t.pids]
    deadline = time.monotonic() + 2.0  # processes just killed are reaped by the init shortly
    while (busy := [p for p in needed if os.path.exists(f"{proc}/{p}")]) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    if busy:
        raise UnsupportedOperation(
            f"cannot restore into sandbox {container.id}: pid {busy[0]} is taken there by "
            f"{_cmdline_in(proc, busy[0])!r} and the checkpointed processes need it; restore into a new "
            "sandbox, or stop that process",
            reason="pid_in_use",
        )
    min_pid = max(p for t in info.trees for p in t.pids)
    group = cgroups.open_exec_group(container.id, group_name)
    group.close_fd()
    targets = _cgroup_targets(cgroups, container.id, group.path)
    restored: list[int] = []
    loop = asyncio.get_running_loop()
    owner = _host_root_id(container)
    root = _open_root(container)
    try:
        for tree in info.trees:
            d = images_dir / tree.dir
            # The paths CRIU opens by name, as the sandbox has them now (restoring in place,
            # or after an earlier tree of this checkpoint was restored and ran).
            await loop.run_in_executor(
                None, check_recorded_paths, d, root, "restore a checkpoint into", container.id
            )
            work = await loop.run_in_executor(None, _make_work_dir, images_dir, tree.dir, owner)
            try:
                args = ["restore", "-D", "@IMG@", "-W", "@WORK@", "-o", "restore.log"]
                rc = await _run_criu(
                    container,
                    criu,
                    d,
                    [*args, "--restore-detached", "--unprivileged", *_COMMON],
                    as_userns_root=True,
                    work=work,
                    cgroups=targets,
                    min_pid=min_pid,
                )
                if rc != 0:
                    raise _criu_error(work, "restore.log", "restore a checkpoint into", container.id)
            finally:
                await loop.run_in_executor(None, shutil.rmtree, work, True)
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


def _cmdline_in(proc: str, pid: int) -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


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
