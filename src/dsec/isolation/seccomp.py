"""The seccomp profile: a commented data file turned into an OCI seccomp section."""

from __future__ import annotations

import functools
import platform
import struct
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


# --- the same profile as a classic BPF program (for a microVM's guest agent, which has no
# libseccomp: it installs this program before every exec) ---------------------------------

_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_ERRNO = {"eperm": 1, "enosys": 38}
_X32_BIT = 0x40000000
_UNISTD = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"


@functools.cache
def x86_64_syscalls(header: str = _UNISTD) -> dict[str, int]:
    """Syscall numbers of x86_64, from the kernel headers (libc6-dev, which install.sh installs)."""
    out: dict[str, int] = {}
    with open(header) as f:
        for line in f:
            words = line.split()
            if len(words) == 3 and words[0] == "#define" and words[1].startswith("__NR_"):
                out[words[1][5:]] = int(words[2])
    return out


def _insn(code: int, jt: int = 0, jf: int = 0, k: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06


def bpf_program(rules: tuple[Rule, ...] | None = None) -> bytes:
    """The profile as a `struct sock_filter` array for x86_64 (any other architecture, the
    32-bit ABI and x32 included, gets EPERM for every call: nothing in an image needs them)."""
    numbers = x86_64_syscalls()
    by_call: dict[str, list[Rule]] = {}
    for r in rules if rules is not None else default_rules():
        if r.syscall not in numbers:
            raise InternalError(f"seccomp profile: unknown x86_64 syscall {r.syscall!r}")
        by_call.setdefault(r.syscall, []).append(r)
    deny = _insn(_RET_K, k=_RET_ERRNO | _ERRNO["eperm"])
    prog = [
        _insn(_LD_W_ABS, k=4),  # seccomp_data.arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        deny,
        _insn(_LD_W_ABS, k=0),  # seccomp_data.nr
        _insn(_JGE_K, 0, 1, _X32_BIT),
        deny,
    ]
    for name, rs in by_call.items():
        block = _call_block(rs)
        if len(block) > 255:
            raise InternalError(f"seccomp profile: too many rules for {name}")
        prog.append(_insn(_JEQ_K, 0, len(block), numbers[name]))
        prog += block
    prog.append(_insn(_RET_K, k=_RET_ALLOW))
    return b"".join(prog)


def _call_block(rules: list[Rule]) -> list[bytes]:
    """The instructions after a matched syscall number: each rule's test, then allow. The
    accumulator holds the number again after every test (it is reloaded)."""
    out: list[bytes] = []
    for r in rules:
        ret = _insn(_RET_K, k=_RET_ERRNO | _ERRNO[r.action])
        if r.arg is None or r.value is None:
            out.append(ret)
            continue
        mask = r.mask if r.mask is not None else 0xFFFFFFFFFFFFFFFF
        value = r.value & mask
        low, high = 16 + 8 * r.arg, 16 + 8 * r.arg + 4  # seccomp_data.args[N], little endian
        # match = (arg & mask) == value, word by word; `ne` inverts it
        test = [
            _insn(_LD_W_ABS, k=low),
            _insn(_AND_K, k=mask & 0xFFFFFFFF),
            _insn(_JEQ_K, 0, 3, value & 0xFFFFFFFF),  # low differs: no match
            _insn(_LD_W_ABS, k=high),
            _insn(_AND_K, k=mask >> 32),
            _insn(_JEQ_K, 1, 0, value >> 32),  # high equal: match
        ]
        # here: no match (fallen or jumped to); next: match
        if r.op == "ne":
            out += [*test, ret, _insn(_JGE_K, 1, 1, 0)]  # no match -> ret; match -> skip the ret
        else:
            out += [*test, _insn(_JGE_K, 1, 1, 0), ret]  # no match -> skip the ret
        out.append(_insn(_LD_W_ABS, k=0))  # the number again, for the next rule's test
    out.append(_insn(_RET_K, k=_RET_ALLOW))
    return out
