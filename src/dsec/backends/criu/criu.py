"""CRIU itself: the version this needs (>= 4.2), unpacked from Debian's next release and run
through its own loader."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from dsec.backends.debian import DEBIAN_MIRROR, FetchError, fetch_tree
from dsec.errors import UnsupportedOperation

DEBIAN_SUITE = "forky"
MIN_CRIU = (4, 2)
_LIBDIR = "usr/lib/x86_64-linux-gnu"
_LOADER = f"{_LIBDIR}/ld-linux-x86-64.so.2"
_NAMESPACES = ("cgroup", "ipc", "uts", "net", "pid", "mnt")
# Flags of every dump and restore. --shell-job: a tree's session usually belongs to a
# process that exited (the `sh -c` that started it in the background).
_COMMON = ["--shell-job", "--manage-cgroups=ignore", "--file-locks"]


# --- CRIU installation ------------------------------------------------------------------


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

    def check(tree: Path, _work: Path) -> str:
        version = criu_version(tree)
        if version is None or version < MIN_CRIU:
            raise FetchError(f"the CRIU from {suite} does not run here (version {version})")
        return ".".join(map(str, version)) + "\n"

    try:
        fetch_tree(dest, "criu", suite=suite, mirror=mirror, check=check)
    except FetchError as e:
        raise UnsupportedOperation(str(e), reason="criu_unavailable") from e
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
