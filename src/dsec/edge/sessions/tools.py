"""The trusted tools bound read-only into every sandbox at /.dsec-tools (a static bash),
and quoting for the scripts the edge hands it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from dsec.errors import InvalidRequest
from dsec.isolation.spec import TOOLS_DIR

HOST_BASH = Path("/bin/bash-static")  # Debian's bash-static: no ld.so, no libc from the sandbox
TRUSTED_BASH = f"{TOOLS_DIR}/bash"


def prepare_tools(tools_dir: Path) -> Path | None:
    """The host directory bound read-only at /.dsec-tools in every sandbox (None without
    bash-static: bash sessions then fail with a clear error). The bash is root-owned and
    execute-only: a sandbox process cannot read it, so the kernel marks every run's shell
    non-dumpable and nothing else in the sandbox can open its descriptors through /proc."""
    if not HOST_BASH.exists():
        return None
    tools_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    tools_dir.chmod(0o755)
    target = tools_dir / "bash"
    if not target.exists() or target.stat().st_size != HOST_BASH.stat().st_size:
        tmp = tools_dir / f".bash-{os.getpid()}"
        shutil.copyfile(HOST_BASH, tmp)
        os.chown(tmp, 0, 0)
        os.chmod(tmp, 0o711)
        os.replace(tmp, target)
    _learn_defaults(target)
    return tools_dir


# The options a fresh run's shell starts with (`set -o` names, `shopt` names), learnt from
# the trusted bash itself: a run's start then sets only the options its state changes.
# Unknown (None): every carried option is set.
_defaults: tuple[frozenset[str], frozenset[str]] | None = None


def _learn_defaults(bash: Path) -> None:
    global _defaults
    try:
        show = 'builtin printf "%s\\n%s\\n" "$SHELLOPTS" "$BASHOPTS"'
        r = subprocess.run(
            [str(bash), "--noprofile", "--norc", "-c", show],
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=True,
        )
        setopts, shopts = r.stdout.decode().split("\n")[:2]
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError, ValueError):
        _defaults = None
        return
    _defaults = (frozenset(setopts.split(":")) - {""}, frozenset(shopts.split(":")) - {""})


def ansi_c_quote(code: str) -> str:
    """Quote `code` as a bash $'...' string that decodes back to the same bytes."""
    raw = code.encode(errors="surrogateescape")
    if b"\0" in raw:
        raise InvalidRequest("bash session input must not contain NUL bytes")
    return "$'" + "".join(chr(b) if b in _SAFE else f"\\x{b:02x}" for b in raw) + "'"


_SAFE = frozenset(
    b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-+=.,:/@%^*()[]{}<>|;&~!?#$`"'
)
