"""The native helper (dsec-shim), built from its C source on first use."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from dsec.errors import InternalError


def _source() -> bytes:
    return resources.files("dsec.native").joinpath("dsec-shim.c").read_bytes()


def shim_digest() -> str:
    return hashlib.sha256(_source()).hexdigest()[:16]


def ensure_shim(bin_dir: Path) -> Path:
    """Path of a static dsec-shim built from this package's source (compiled if missing)."""
    target = bin_dir / f"dsec-shim-{shim_digest()}"
    if target.exists():
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise InternalError(
            "dsec-shim needs a C compiler: run the install script (it installs gcc and libc6-dev)"
        )
    bin_dir.mkdir(parents=True, exist_ok=True)
    src = bin_dir / f".dsec-shim-{os.getpid()}.c"
    tmp = bin_dir / f".dsec-shim-{os.getpid()}"
    src.write_bytes(_source())
    try:
        r = subprocess.run(
            [cc, "-static", "-O2", "-Wall", "-o", str(tmp), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise InternalError(f"building dsec-shim failed: {r.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return target
