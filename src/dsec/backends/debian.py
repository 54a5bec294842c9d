"""Tools the backends need in a newer version than Debian 12 ships (CRIU, runsc), taken from
a later Debian release through a private apt configuration: its own sources list, state and
cache in a temporary directory, so the host's apt sources and dpkg database are untouched
and nothing is installed system-wide. The packages are unpacked into a tree of their own
under the data directory, replaced atomically."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


class FetchError(RuntimeError):
    """The package could not be downloaded, or what was unpacked does not run here."""


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


def fetch_tree(
    dest: Path,
    package: str,
    *,
    suite: str,
    mirror: str = DEBIAN_MIRROR,
    only: str | None = None,
    check: Callable[[Path, Path], str],
) -> None:
    """Download `package` (and what it depends on) from `suite`, unpack the .debs whose
    names start with `only` (all when None) into a new tree, run `check(tree, work)` (the
    text for the tree's `.ready` file, or FetchError), and put the tree at `dest`."""
    if os.uname().machine != "x86_64":
        raise FetchError(f"{package} is fetched for x86_64 hosts only")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"dsec-{package}-", dir=dest.parent) as tmp:
        work = Path(tmp)
        opts = _apt_options(work / "apt", mirror, suite)
        for cmd in (
            ["apt-get", *opts, "update"],
            ["apt-get", *opts, "install", "-y", "--download-only", "--no-install-recommends", package],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if r.returncode != 0:
                why = (r.stderr or r.stdout).strip()[-800:]
                raise FetchError(f"cannot download {package} from {mirror} {suite}: {why}")
        tree = work / "tree"
        tree.mkdir()
        debs = sorted((work / "apt" / "cache" / "archives").glob(f"{only or ''}*.deb"))
        if not debs:
            raise FetchError(f"apt downloaded no {package} package from {suite}")
        for deb in debs:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True, timeout=300)
        (tree / ".ready").write_text(check(tree, work))
        old = dest.parent / f".{dest.name}-old-{os.getpid()}"
        if dest.exists():
            dest.rename(old)
        tree.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
