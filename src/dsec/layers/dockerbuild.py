"""Dockerfile builds on an edge, through buildah (what podman builds with), as hostile code.

    context tar (the client's) -> checked and extracted (dsec.archive's rules: no link leads
    out, no absolute name, no device; size-limited) -> Dockerfile checked (dsec.layers.
    dockerfile) -> base images fetched by skopeo under the pull policy into OCI layouts ->
    buildah, in namespaces of its own (dsec.isolation.buildns: user namespace mapped to an
    unprivileged host id range, an empty network namespace, a private mount namespace) and
    a cgroup with memory, pids and cpu limits: `pull oci:` the bases, `bud --layers`, `push
    oci:` the result -> imported into the layer store (import_oci_archive) as the project's
    image.

Each project has its own buildah storage (`<builds>/<project>/`), so tenants never share a
step cache; `--layers` caches each step by its inputs (a rebuild after changing the last
step reuses the others). The storage belongs to the id range its builds ran as; a build
asks for that range again, and when another holds it, the storage is shifted to the new
one. A project's builds run one at a time (its storage, its range).

Events (`emit`): {"type": "log", "line"} for every line of output (bounded: past
`max_log_bytes` the rest is dropped, and a note says so); a failing step raises
InvalidRequest (reason build_failed; details `step`, `tail`) naming the step
(`step 3/7 RUN make: exit 2`) with its output's tail.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import sys
import tarfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.archive import ArchiveTree, member_name
from dsec.isolation import buildns
from dsec.isolation.cgroups import CgroupHost, remove_tree
from dsec.isolation.idranges import RANGE, IdRanges
from dsec.layers.builders.oci import import_oci_archive
from dsec.layers.dockerfile import prepare
from dsec.layers.pull import PullPolicy, Reference, fetch_layout
from dsec.layers.store import Image, LayerStore
from dsec.layers.tool import run_tool

BUILDAH = "buildah"
Emit = Callable[[dict[str, Any]], None]
_STEP = re.compile(r"^(?:\[(\d+)/(\d+)\] )?STEP (\d+)/(\d+): (.*)$")
_REGISTRIES = 'unqualified-search-registries = ["localhost"]\nshort-name-mode = "disabled"\n'


@dataclass(frozen=True)
class BuildLimits:
    """What one build may take: the cgroup of the builder and its RUN steps, its time, the
    context it is given and the log it sends back."""

    memory_bytes: int = 4 << 30
    cpus: float = 2.0
    pids: int = 4096
    timeout_s: float = 1800.0
    max_context_bytes: int = 2 << 30
    max_log_bytes: int = 4 << 20
    # the disk the builds' storage is on keeps this much free: a build that takes it below is
    # stopped (no quota on disk yet: this keeps a build from filling the edge's disk)
    min_free_bytes: int = 4 << 30


@dataclass
class BuildSpec:
    """One build: the image `name` it makes (`<project>/...` decided by the apiserver)."""

    name: str
    project: str | None = None
    dockerfile: str = "Dockerfile"
    build_args: dict[str, str] = field(default_factory=dict)
    target: str | None = None


def _check_context(tf: tarfile.TarFile, max_bytes: int) -> list[tuple[str, tarfile.TarInfo]]:
    what = "the build context"
    tree = ArchiveTree(what)
    total = 0
    members = []
    for m in tf:
        name = tree.add_member(m)
        if m.isreg():
            total += m.size
            if total > max_bytes:
                raise errors.PayloadTooLarge(
                    f"{what} is over {max_bytes >> 20} MiB", reason="context_too_large"
                )
        members.append((name, m))
    tree.check_links()
    return members


def extract_context(tar: Path, dest: Path, max_bytes: int) -> None:
    """Unpack the client's context tar into `dest` (new): directories, regular files,
    symbolic links that stay inside it and hard links to an earlier file; nothing else."""
    try:
        with tarfile.open(tar, mode="r:*") as tf:
            members = _check_context(tf, max_bytes)
            dest.mkdir(mode=0o700)
            later = []
            for name, m in members:
                path = dest / name if name else dest
                if m.isdir():
                    path.mkdir(mode=0o755, parents=True, exist_ok=True)
                elif m.isfile():
                    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    assert src is not None
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                    with os.fdopen(os.open(path, flags, 0o600), "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                    os.chmod(path, (m.mode & 0o777) | 0o400)
                    os.utime(path, (m.mtime, m.mtime))  # (a step's cache key holds its files' times)
                else:
                    later.append((path, m))
            _links(dest, later)
            for name, m in reversed(members):
                if m.isdir() or m.issym():
                    os.utime(dest / name if name else dest, (m.mtime, m.mtime), follow_symlinks=False)
    except tarfile.TarError as e:
        raise errors.InvalidRequest(f"the build context is not a valid tar archive: {e}") from None


def _links(dest: Path, links: list[tuple[Path, tarfile.TarInfo]]) -> None:
    """Links last: nothing is ever written through one."""
    for path, m in links:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if m.issym():
            os.symlink(m.linkname, path)
        else:
            os.link(dest / member_name(m.linkname, "the build context"), path, follow_symlinks=False)


def _shift(root: Path, old: int, new: int) -> None:
    """Move a tree's owners from host range `old` to `new` (the storage's owner changed)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)]:
            st = os.lstat(n)
            uid = st.st_uid - old + new if old <= st.st_uid < old + RANGE else new
            gid = st.st_gid - old + new if old <= st.st_gid < old + RANGE else new
            os.lchown(n, uid, gid)


def _own(root: Path, base: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)]:
            os.lchown(n, base, base)


class _Run:
    """buildah in its namespaces, one command after another, under one deadline."""

    def __init__(self, home: Path, base: int, cgroups: list[Path], deadline: float, limits: BuildLimits,
                 emit: Emit) -> None:  # fmt: skip
        exe = shutil.which(BUILDAH)
        if exe is None:
            raise errors.Unavailable(
                "buildah is not installed on this edge: run ./install.sh (it installs buildah)"
            )
        self.exe, self.home, self.base, self.cgroups = exe, home, base, cgroups
        self.deadline, self.limits, self.emit = deadline, limits, emit
        self.logged = 0
        self.tail: deque[str] = deque(maxlen=40)
        self.step: str | None = None

    def __call__(self, *args: str, quiet: bool = False) -> tuple[int, str]:
        import time

        h = self.home
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(h / "home"),
            "XDG_RUNTIME_DIR": str(h / "run"), "XDG_CONFIG_HOME": str(h / "home" / ".config"),
            "TMPDIR": str(h / "tmp"),
            "CONTAINERS_REGISTRIES_CONF": str(h / "registries.conf"), "BUILDAH_ISOLATION": "oci",
        }  # fmt: skip
        ns = [sys.executable, "-I", buildns.__file__, "--base", str(self.base),
              "--bind", f"{h / 'cache'}:/var/cache/containers"]  # fmt: skip
        for d in self.cgroups:
            ns += ["--cgroup", str(d)]
        argv = [*ns, "--", self.exe, "--root", str(h / "storage"), "--runroot", str(h / "run"),
                "--storage-driver", "overlay", *args]  # fmt: skip
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise errors.Unavailable("the build ran out of time", reason="build_timeout")
        done = run_tool(argv, env=env, timeout=left, on_line=None if quiet else self._log, check=self._room)
        if done.stopped:
            raise errors.QuotaExceeded(
                f"the build was stopped: it left the edge's disk less than "
                f"{self.limits.min_free_bytes >> 20} MiB free (what a build may write is bounded by it)",
                reason="build_disk",
            )
        if done.timed_out:
            raise errors.Unavailable(
                f"the build did not finish within {self.limits.timeout_s:.0f} s", reason="build_timeout"
            )
        return done.returncode, "\n".join(done.tail)

    def _room(self) -> bool:
        st = os.statvfs(self.home)
        return st.f_bavail * st.f_frsize >= self.limits.min_free_bytes

    def _log(self, line: str) -> None:
        m = _STEP.match(line)
        if m is not None:
            stage = f"stage {m[1]}/{m[2]} " if m[1] else ""
            self.step = f"{stage}step {m[3]}/{m[4]} {m[5][:200]}"
            self.tail.clear()
        else:
            self.tail.append(line)
        self.logged += len(line) + 1
        if self.logged <= self.limits.max_log_bytes:
            self.emit({"type": "log", "line": line})
        elif self.logged - len(line) - 1 <= self.limits.max_log_bytes:
            self.emit(
                {"type": "log", "line": f"(log over {self.limits.max_log_bytes} bytes: the rest is not sent)"}
            )


class Builder:
    """An edge's Dockerfile builds (see the module). `root`: its directory on disk."""

    def __init__(self, store: LayerStore, root: Path, *, ranges: IdRanges, cgroups: CgroupHost,
                 policy: PullPolicy, limits: BuildLimits | None = None) -> None:  # fmt: skip
        self.store, self.root, self.ranges, self.cgroups = store, root, ranges, cgroups
        self.policy, self.limits = policy, limits or BuildLimits()
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()

    def build(self, spec: BuildSpec, context_tar: Path, emit: Emit) -> Image:
        key = spec.project or "_shared"
        with self._mutex:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            return self._build(spec, key, context_tar, emit)

    def _build(self, spec: BuildSpec, key: str, context_tar: Path, emit: Emit) -> Image:
        import time

        deadline = time.monotonic() + self.limits.timeout_s
        for d in (self.root, self.root / "projects", self.root / "work"):
            d.mkdir(mode=0o711, parents=True, exist_ok=True)  # (the builder's range passes through)
            os.chmod(d, 0o711)
        home = self.root / "projects" / key
        for sub in ("storage", "run", "home", "cache", "tmp"):
            (home / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        (home / "registries.conf").write_text(_REGISTRIES)
        owner_file = home / "owner"
        old = int(owner_file.read_text()) if owner_file.exists() else None
        ids = self.ranges.claim(prefer=None if old is None else old // RANGE)
        # The same paths at every build of the project: buildah's cache key of a COPY holds
        # where the context was.
        work = self.root / "work" / key
        shutil.rmtree(work, ignore_errors=True)
        cg: list[Path] = []
        try:
            if old is None:
                _own(home, ids.base)
            elif old != ids.base:
                emit({"type": "log", "line": "(moving the build cache to another id range)"})
                _shift(home, old, ids.base)
            owner_file.write_text(str(ids.base))
            os.chown(owner_file, 0, 0)
            work.mkdir(mode=0o700, parents=True)
            extract_context(context_tar, work / "ctx", self.limits.max_context_bytes)
            df = prepare(self._dockerfile(work / "ctx", spec.dockerfile), spec.build_args)
            (work / "Dockerfile").write_text(df.text)
            (work / "out").mkdir()
            lim = self.limits
            cg = self.cgroups.create_limited(
                f"dsec-build/{key}-{secrets.token_hex(4)}",
                cpu=lim.cpus,
                memory_bytes=lim.memory_bytes,
                pids=lim.pids,
            )
            run = _Run(home, ids.base, cg, deadline, self.limits, emit)
            _own(work, ids.base)
            self._bases(run, work, df.bases, emit)
            # One tag per image name, kept: removing it would remove the untagged step images
            # under it, the cache of the next build.
            tag = f"localhost/dsec-build-out:{hashlib.sha256(spec.name.encode()).hexdigest()[:32]}"
            args = ["bud", "--layers", "--pull=false", "--network", "none", "--isolation", "oci",
                    "-f", str(work / "Dockerfile"), "-t", tag]  # fmt: skip
            for k, v in spec.build_args.items():
                args += ["--build-arg", f"{k}={v}"]
            if spec.target:
                args += ["--target", spec.target]
            code, text = run(*args, str(work / "ctx"))
            if code != 0:
                raise _failure(run, text, code)
            code, text = run("push", tag, f"oci:{work / 'out'}:image", quiet=True)
            if code != 0:
                raise errors.Unavailable(f"the built image could not be exported: {text[-800:]}")
            image = import_oci_archive(self.store, spec.name, work / "out")
        finally:
            for d in cg:
                remove_tree(d)
                with contextlib.suppress(OSError):  # the dsec-build parent, once no build uses it
                    d.parent.rmdir()
            ids.release()
            shutil.rmtree(work, ignore_errors=True)
        image.source.update({"type": "build", "dockerfile": spec.dockerfile, "steps": df.steps})
        image.source.pop("archive", None)
        if spec.project is not None:
            image.source["project"] = spec.project
        self.store.put_image(image)
        return image

    @staticmethod
    def _dockerfile(ctx: Path, rel: str) -> str:
        name = member_name(rel, "the Dockerfile's path")
        path = ctx / name
        if path.is_symlink() or not path.is_file():
            raise errors.InvalidRequest(
                f"the context has no file {rel!r} (the Dockerfile)", reason="no_dockerfile"
            )
        return path.read_text(errors="replace")

    def _bases(self, run: _Run, work: Path, bases: list[str], emit: Emit) -> None:
        """Each image the Dockerfile starts from, fetched under the pull policy and put in
        the build's storage under the name the Dockerfile gives it."""
        for i, written in enumerate(dict.fromkeys(bases)):
            ref = Reference.parse(written)
            d = work / "bases" / str(i)
            d.mkdir(mode=0o700, parents=True)
            layout, _, _ = fetch_layout(
                ref, d, policy=self.policy, progress=lambda line: emit({"type": "log", "line": line})
            )
            _own(d, run.base)
            code, text = run("pull", "-q", f"oci:{layout}:image", quiet=True)
            if code != 0:
                raise errors.Unavailable(f"base image {written} could not be loaded: {text[-800:]}")
            image_id = text.strip().splitlines()[-1]
            for name in dict.fromkeys([written, str(ref)]):
                run("tag", image_id, name, quiet=True)


def _failure(run: _Run, text: str, code: int) -> errors.InvalidRequest:
    last = [ln for ln in text.splitlines() if ln.startswith("Error:")]
    status = re.search(r"exit status (\d+)", last[-1]) if last else None
    what = f"exit {status[1]}" if status else (last[-1][7:300] if last else f"buildah exited with {code}")
    step = run.step or "the build"
    tail = [ln for ln in run.tail if not ln.startswith("Error:")][-30:]
    return errors.InvalidRequest(
        f"{step}: {what}\n" + "\n".join(tail), reason="build_failed", step=run.step, tail=tail
    )
