"""CRIU itself: the version this needs (>= 4.2), unpacked from Debian's next release and run
through its own loader."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsec.errors import UnsupportedOperation

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
            "run install.sh (or `python -c 'from dsec.backends.criu import ensure_criu; "
            f'ensure_criu(Path("{dest.parent}"))\'`), or use pause() / snapshot() instead',
            reason="criu_unavailable",
        )
    return dest
