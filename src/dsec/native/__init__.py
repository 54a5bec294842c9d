"""The native helpers, built from their C sources on first use (static binaries, named by a
digest of their source so that an upgrade never runs a stale build):

* ``dsec-shim``: PID 1 of every sandbox and the runtime launcher (see dsec-shim.c).
* ``dsec-copy``: the parallel, exact tree copy behind forks and snapshots (see dsec-copy.c).
* ``dsec-trusted``: runs verify and trusted execs with the image's own toolchain (see dsec-trusted.c).
* ``dsec-guest``: PID 1 and agent of a microVM guest, in its initramfs (see dsec-guest.c).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from dsec.errors import InternalError

_FLAGS = {"dsec-shim": [], "dsec-copy": ["-pthread"], "dsec-trusted": [], "dsec-guest": []}


_INCLUDE = re.compile(rb'^#include "(dsec-[a-z]+\.h)"$', re.M)


def _source(name: str) -> bytes:
    """The helper's C source with the package's own headers inlined (one file to build,
    and the digest covers the headers too)."""
    here = resources.files("dsec.native")
    return _INCLUDE.sub(
        lambda m: here.joinpath(m.group(1).decode()).read_bytes(), here.joinpath(f"{name}.c").read_bytes()
    )


def digest(name: str) -> str:
    return hashlib.sha256(_source(name)).hexdigest()[:16]


def shim_digest() -> str:
    return digest("dsec-shim")


def ensure_tool(name: str, bin_dir: Path) -> Path:
    """Path of a static build of the named helper from this package's source (compiled if missing)."""
    target = bin_dir / f"{name}-{digest(name)}"
    if target.exists():
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise InternalError(
            f"{name} needs a C compiler: run the install script (it installs gcc and libc6-dev)"
        )
    bin_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"  # edges of one process may build at once
    src = bin_dir / f".{name}-{tag}.c"
    tmp = bin_dir / f".{name}-{tag}"
    src.write_bytes(_source(name))
    try:
        r = subprocess.run(
            [cc, "-static", "-O2", "-Wall", *_FLAGS[name], "-o", str(tmp), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise InternalError(f"building {name} failed: {r.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return target


def ensure_shim(bin_dir: Path) -> Path:
    return ensure_tool("dsec-shim", bin_dir)


def ensure_copy(bin_dir: Path) -> Path:
    return ensure_tool("dsec-copy", bin_dir)


def ensure_trusted(bin_dir: Path) -> Path:
    return ensure_tool("dsec-trusted", bin_dir)
