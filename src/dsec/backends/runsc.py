"""gVisor's runsc: fetched from Debian, smoke-tested, and probed for the platforms that work.

Debian 12's runsc (20221219) has only the ptrace platform working here and fails `ls /`
(statx EINVAL) on current kernels. Debian 13 (trixie) and forky both ship release
20240729, but forky's build (0.0~20240729.0-7+b1) is compiled with Go 1.26, and gVisor's
pkg/goid reads runtime.g.goid at an offset right only up to Go 1.24: its sentry panics at
random once a task blocks on file I/O. So suites are tried in order (trixie first) and a
candidate is kept only when a sandbox doing file reads runs under it.
See docs/research/gvisor-runsc.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsec.backends.debian import DEBIAN_MIRROR, FetchError, fetch_tree

DEBIAN_SUITES = ("trixie", "forky")
MIN_RUNSC = 20240729  # release date; older ones fail on these kernels
BINARY = "usr/bin/runsc"
PLATFORMS = ("systrap", "ptrace", "kvm")  # in order of preference


class RunscUnavailable(RuntimeError):
    pass


def runsc_version(binary: Path) -> int | None:
    """The release date of `runsc --version`, or None when it does not run."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"runsc version \S*?(\d{8})", out.stdout)
    return int(m[1]) if out.returncode == 0 and m else None


def smoke_test(binary: Path, state: Path, platform: str = "systrap", timeout: float = 60.0) -> str | None:
    """None if this runsc runs a sandbox doing file I/O on `platform` here; else why not."""
    state.mkdir(parents=True, exist_ok=True)
    script = "for i in 1 2 3 4 5 6 7 8 9 10; do ls -la /usr/bin >/dev/null; done; echo ok"
    argv = [str(binary), "--root", str(state), "--network=none", f"--platform={platform}"]
    argv += ["do", "/bin/sh", "-c", script]
    try:
        r = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=state,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return None
    return f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"


def ensure_runsc(
    data_dir: Path, *, mirror: str = DEBIAN_MIRROR, suites: tuple[str, ...] = DEBIAN_SUITES
) -> Path:
    """runsc unpacked under ``<data_dir>/runsc`` (the binary at ``usr/bin/runsc``); idempotent."""
    dest = data_dir / "runsc"
    if (dest / ".ready").exists() and (runsc_version(dest / BINARY) or 0) >= MIN_RUNSC:
        return dest
    errors = []
    for suite in suites:

        def check(tree: Path, work: Path, suite: str = suite) -> str:
            version = runsc_version(tree / BINARY)
            if version is None or version < MIN_RUNSC:
                raise FetchError(f"the runsc from {suite} does not run here (version {version})")
            why = smoke_test(tree / BINARY, work / "smoke")
            if why is not None:
                raise FetchError(f"the runsc from {suite} fails its smoke test: {why}")
            return f"{version} {suite}\n"

        try:
            fetch_tree(dest, "runsc", suite=suite, mirror=mirror, only="runsc_", check=check)  # static: alone
        except FetchError as e:
            errors.append(str(e))
            continue
        return dest
    raise RunscUnavailable("no usable runsc: " + " | ".join(errors))


def find_runsc(root: Path) -> Path:
    """The runsc binary ensure_runsc() unpacked at `root`, or RunscUnavailable saying how to get it."""
    binary = root / BINARY
    if not (root / ".ready").exists() or not binary.exists():
        raise RunscUnavailable(
            f"runsc is not installed on this edge ({binary} is missing): run install.sh, or "
            f"`python -c 'from pathlib import Path; from dsec.backends.runsc import ensure_runsc; "
            f'ensure_runsc(Path("{root.parent}"))\'`'
        )
    return binary


def probe_platforms(
    binary: Path, state: Path, candidates: tuple[str, ...] = ("systrap", "ptrace")
) -> list[str]:
    """The platforms on which a sandbox runs here, in order of preference; probed once per
    kernel and runsc (cached in `state`). kvm is probed only when asked for: on hosts
    whose /dev/kvm cannot run a guest (PVM here) its sentry spins instead of failing."""
    key = {"kernel": os.uname().release, "runsc": runsc_version(binary), "candidates": list(candidates)}
    cache = state / "platforms.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        cached = json.loads(cache.read_text())
        if cached["key"] == key:
            return list(cached["works"])
    works = []
    work = Path(tempfile.mkdtemp(prefix="run-", dir=_mkdir(state)))  # edges may probe at once
    for platform in candidates:
        if platform == "kvm" and not Path("/dev/kvm").exists():
            continue
        argv = [str(binary), "--root", str(work / platform), "--network=none", f"--platform={platform}"]
        (work / platform).mkdir()
        try:
            r = subprocess.run(
                [*argv, "do", "/bin/true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=20,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0:
            works.append(platform)
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        tmp = work.with_suffix(".json")
        tmp.write_text(json.dumps({"key": key, "works": works}))
        tmp.replace(cache)
    return works


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d
