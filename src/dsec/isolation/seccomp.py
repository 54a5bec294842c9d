"""The seccomp profile: a commented data file turned into an OCI seccomp section."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from importlib import resources
from typing import Any

from dsec.errors import InternalError

_ACTIONS = {
    "eperm": {"action": "SCMP_ACT_ERRNO", "errnoRet": 1},
    "enosys": {"action": "SCMP_ACT_ERRNO", "errnoRet": 38},
}
# The native architecture and the compat ones a process could switch to.
_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
_OPS = {"eq": "SCMP_CMP_EQ", "ne": "SCMP_CMP_NE", "masked_eq": "SCMP_CMP_MASKED_EQ"}


@dataclass(frozen=True)
class Rule:
    action: str
    syscall: str
    arg: int | None = None
    op: str | None = None
    value: int | None = None
    mask: int | None = None
    why: str = ""


def parse_profile(text: str) -> list[Rule]:
    rules: list[Rule] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        body, _, why = raw.partition("#")
        words = body.split()
        if not words:
            continue
        if words[0] not in _ACTIONS or len(words) not in (2, 5, 6):
            raise InternalError(f"seccomp profile line {lineno}: cannot parse {raw.strip()!r}")
        if not why.strip():
            raise InternalError(f"seccomp profile line {lineno}: every rule needs a '# why' comment")
        if len(words) == 2:
            rules.append(Rule(words[0], words[1], why=why.strip()))
            continue
        arg, op = words[2], words[3]
        if not arg.startswith("arg") or op not in _OPS:
            raise InternalError(f"seccomp profile line {lineno}: bad argument filter {raw.strip()!r}")
        value = int(words[4], 0)
        mask = int(words[5], 0) if len(words) == 6 else None
        if (op == "masked_eq") != (mask is not None):
            raise InternalError(f"seccomp profile line {lineno}: masked_eq needs a mask, others none")
        rules.append(Rule(words[0], words[1], int(arg[3:]), op, value, mask, why.strip()))
    return rules


@functools.cache
def default_rules() -> tuple[Rule, ...]:
    text = resources.files("dsec.isolation").joinpath("seccomp.profile").read_text()
    return tuple(parse_profile(text))


def oci_seccomp(rules: tuple[Rule, ...] | None = None) -> dict[str, Any]:
    """The `linux.seccomp` section of an OCI config."""
    syscalls: list[dict[str, Any]] = []
    for r in rules if rules is not None else default_rules():
        entry: dict[str, Any] = {"names": [r.syscall], **_ACTIONS[r.action]}
        if r.arg is not None and r.op is not None and r.value is not None:
            if r.op == "masked_eq":
                # OCI puts the mask in `value` and the expected value in `valueTwo`.
                arg = {"index": r.arg, "value": r.mask, "valueTwo": r.value, "op": _OPS[r.op]}
            else:
                arg = {"index": r.arg, "value": r.value, "op": _OPS[r.op]}
            entry["args"] = [arg]
        syscalls.append(entry)
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": _ARCHES.get(platform.machine(), []),
        "flags": ["SECCOMP_FILTER_FLAG_LOG"],
        "syscalls": syscalls,
    }
