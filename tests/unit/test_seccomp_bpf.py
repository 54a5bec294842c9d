"""The seccomp profile compiled to classic BPF (what a microVM's guest agent installs before
every exec), loaded by the real kernel into a child process: what the profile denies is
denied with its errno, argument filters match only their pattern, the rest is allowed."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct

from dsec.isolation.seccomp import bpf_program, default_rules, parse_profile

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _in_filtered_child(program: bytes, probes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Run raw syscalls (name -> (number, args...)) in a child under `program`; errno of
    each (0: it succeeded)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            libc = ctypes.CDLL(None, use_errno=True)
            buf = ctypes.create_string_buffer(program, len(program))
            prog = _Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
            assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            assert libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0
            out = {}
            for name, (nr, *args) in probes.items():
                rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
                out[name] = ctypes.get_errno() if rc == -1 else 0
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_the_default_profile_compiles_and_holds_in_the_kernel() -> None:
    program = bpf_program()
    assert len(program) % 8 == 0 and 0 < len(program) // 8 < 4096
    probes = {
        "getpid": (39,),
        "ptrace_traceme": (101, 0, 0, 0, 0),
        "unshare_user": (272, 0x10000000),
        "clone3": (435, 0, 0),
        "prlimit64_pid1": (302, 1, 7, 0, 0),  # RLIMIT_NOFILE of PID 1: read only, still refused
        "prlimit64_self": (302, 0, 7, 0, 0),
        "personality_no_aslr": (135, 0x0040000),
        "personality_linux": (135, 0),
        "tiocsti": (16, 0, 0x5412, 0),
        "tiocgwinsz_bad_fd": (16, -1, 0x5413, 0),  # allowed by the filter: the kernel says EBADF
    }
    got = _in_filtered_child(program, probes)
    assert got["getpid"] == 0
    assert got["ptrace_traceme"] == errno.EPERM
    assert got["unshare_user"] == errno.EPERM
    assert got["clone3"] == errno.ENOSYS  # so libc falls back to clone, whose flags are filtered
    assert got["prlimit64_pid1"] == errno.EPERM and got["prlimit64_self"] == 0
    assert got["personality_no_aslr"] == errno.EPERM and got["personality_linux"] == 0
    assert got["tiocsti"] == errno.EPERM and got["tiocgwinsz_bad_fd"] == errno.EBADF


def test_argument_filters_compare_both_words_and_ne_inverts() -> None:
    rules = tuple(
        parse_profile(
            "eperm getpriority arg1 eq 0x100000007   # a 64-bit value: both words must match\n"
            "eperm getpgid arg0 ne 0                  # only pgid of self allowed\n"
        )
    )
    program = bpf_program(rules)
    got = _in_filtered_child(
        program,
        {
            "prio_exact": (140, 0, 0x100000007),
            "prio_low_word_only": (140, 0, 7),
            "pgid_self": (121, 0),
            "pgid_other": (121, 1),
        },
    )
    assert got["prio_exact"] == errno.EPERM
    assert got["prio_low_word_only"] != errno.EPERM  # the high word differs: not the rule's value
    assert got["pgid_self"] == 0 and got["pgid_other"] == errno.EPERM


def test_other_abis_are_refused_and_unknown_syscalls_are_a_load_error() -> None:
    program = bpf_program(default_rules())
    arch_check = struct.unpack_from("<HBBI", program, 8)
    assert arch_check[3] == 0xC000003E  # AUDIT_ARCH_X86_64; anything else is refused
    import pytest

    from dsec.errors import InternalError

    with pytest.raises(InternalError, match="unknown x86_64 syscall"):
        bpf_program(tuple(parse_profile("eperm no_such_call   # a typo\n")))
