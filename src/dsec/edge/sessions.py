"""Persistent sessions: a bash shell or a Python interpreter that keeps its state.

bash: every run is a process of its own, started through the shim like an exec (own exec
cgroup, own process group, fresh pipes), running the platform's static bash from the
read-only /.dsec-tools mount. Its exit status is the shim's waitpid of that process, so
nothing defined in the shell can change what is reported. The state carries over between
runs as data only: the run's EXIT trap, in the shell itself (no fork), first turns off what
could make a builtin's failure end the shell, then writes the state as bash prints it
(`declare -p`, `declare -F`, `declare -f`, NUL-separated) to a per-run pipe; a trap that runs
to its end leaves the shell's exit status as the code left it. The dump is complete when
the shell has exited: the edge takes it then and closes the pipe, parses it with a strict
tokenizer and limits (only when it differs from the last one) and builds the next run's
start from it: cwd (the spawn's cwd), functions (env entries `BASH_FUNC_<name>%%`, bash's own
one-definition importer), variables, aliases and options (only those that differ from a
fresh shell's) as assignments and builtin calls the edge quotes itself. A dump that is
missing, incomplete or malformed leaves the previous state. The code comes through a
per-run sealed memfd and is run by `eval` after the state is in place; stdout and stderr
share one pipe (the output keeps its order), stdin is /dev/null. What a run's background
jobs write after it ended, to its output or its dump, goes to a closed pipe, never into a
later run.

Changed semantics against a long-lived shell: `jobs`, `%1` and `wait` do not reach jobs of
an earlier run (they keep running); `exit N` ends only that run (its status is N); traps do
not carry over; functions or aliases named `builtin` or `exec`, namerefs and variables the
shell maintains itself are not carried over; a run whose functions cannot be told apart in
`declare -f` (a here-document holding a line that closes a definition followed by another
function's header) keeps the previous state; with `set -v` carried over, the first line of
the dump is echoed at the end of each run's output.

python: one interpreter whose driver loop lives in a closure (nothing it uses per run is
looked up in a namespace user code can reach by name; the user code gets its own `__main__`
module). Each run is one datagram on a control socket carrying a per-run nonce and, as
SCM_RIGHTS, three fresh pipes: the code, the reply and the stray output (fd 1 and 2 of the
interpreter during that run; /dev/null between runs). The reply is a binary record that
must carry the nonce; anything else is a protocol violation and the session is reported
broken. Every pipe of a run is closed when it ends, so nothing is buffered between runs. A
timeout sends SIGINT (KeyboardInterrupt, state kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec.backends.container import Container
from dsec.edge.process import PipeReader, Spawned, exit_code, feed_pipe, kill_except, release_group, spawn
from dsec.errors import InternalError, InvalidRequest, SessionNotFound
from dsec.isolation.cgroups import CgroupHost, ExecGroup
from dsec.isolation.spec import TOOLS_DIR
from dsec.models import SessionKind, SessionResult

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
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" b" _-+=.,:/@%^*()[]{}<>|;&~!?#$`\""
)

# --- bash: the run's start and the dump of its state ----------------------------------------

# The run's EXIT trap, in the shell itself: no fork, only builtins (`builtin` itself is never
# carried over as a function or alias). Line 1, alone on its line so that nothing after it is
# parsed with the run's aliases, keeps the options the code left and turns off everything
# that could make a builtin's failure end the shell (errexit, nounset, posix, SIGPIPE) or
# trace into the output; it writes nowhere (stdout and stderr closed: no path is opened). A
# trap that runs to its end leaves the shell's exit status as the code left it (bash
# restores it), and nothing the trap runs can fail fatally once line 1 ran. Line 2 writes
# the state to the run's dump pipe (fd 4) as bash prints it (`declare -p`, `declare -F`,
# `declare -f`), NUL-separated; the edge parses that with a strict tokenizer.
_QUIET = (
    "__dsec_o=$SHELLOPTS __dsec_b=$BASHOPTS; builtin set +eEuvxTk +o pipefail +o posix; "
    "builtin shopt -u expand_aliases; builtin trap - ERR DEBUG RETURN; builtin trap '' PIPE;"
)
_DUMP = (
    # ... and again without the redirection when it failed (no descriptor left):
    # a failure on the left of || does not end the shell under errexit
    f"{{ {_QUIET} }} >&- 2>&- || {{ {_QUIET} }}\n"
    "{ builtin printf 'C\\0%s\\0O\\0%s\\0%s\\0P\\0' \"$PWD\" \"$__dsec_o\" \"$__dsec_b\"; "
    "builtin declare -p; builtin printf '\\0L\\0'; builtin declare -p BASH_ALIASES; "
    "builtin printf '\\0F\\0'; builtin declare -F; builtin printf '\\0'; builtin declare -f; "
    "builtin printf '\\0E\\0'; } 2>&- >&4\n"
)


def _prelude(sid: str) -> str:
    # fd 0: the run's script (state, then the code), 1: output, 2: the dump pipe. The script
    # is read whole from the descriptor (`read -d ''`) before any of it runs; the code runs
    # through `eval` on line 1, so its line numbers are the caller's.
    return (
        f"builtin : dsec-session-{sid}; builtin trap -- {_DUMP_Q} EXIT; "
        # The script is read from the descriptor itself, never through a path such as
        # /dev/fd/3: the sandbox's root can replace /dev/fd or /dev/stdin. /dev/null it cannot
        # (a bind mount of the host's, root's: EBUSY, EPERM), and the code must not inherit
        # the script's memfd (any dumpable child would let another process reopen it).
        "exec 4>&2 2>&1 3<&0 0</dev/null; IFS= builtin read -r -d '' -u 3 __dsec_s; exec 3<&-; "
        'builtin eval "$__dsec_s" || builtin exit 125; builtin unset -v __dsec_s; '
        'builtin eval "$__dsec_c"'
    )


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_FUNC_NAME = re.compile(r"[A-Za-z0-9_.:@+][A-Za-z0-9_.:@+-]{0,127}")
_INT = re.compile(r"-?[0-9]{1,20}")
_NOT_CARRIED = frozenset({"builtin", "exec"})  # what the start itself calls after the state is in
_SKIP_VARS = frozenset(
    (  # noqa: SIM905
        "BASH BASHPID BASH_ARGC BASH_ARGV BASH_ARGV0 BASH_CMDS BASH_COMMAND BASH_EXECUTION_STRING "
        "BASH_LINENO BASH_REMATCH BASH_SOURCE BASH_SUBSHELL BASH_VERSINFO BASH_VERSION BASHOPTS "
        "SHELLOPTS EUID UID PPID GROUPS FUNCNAME HISTCMD LINENO RANDOM SRANDOM SECONDS EPOCHSECONDS "
        "EPOCHREALTIME PIPESTATUS DIRSTACK SHLVL _ COMP_WORDBREAKS OPTIND PWD IFS BASH_ALIASES"
    ).split()
)
_SET_OPTS = frozenset(
    (  # noqa: SIM905
        "allexport braceexpand errexit errtrace functrace hashall interactive-comments keyword "
        "noclobber noglob nolog notify nounset physical pipefail posix"
    ).split()
)
_LATE_OPTS = ("xtrace", "verbose")  # set right before the code: nothing of ours is traced
_SHOPTS = frozenset(
    (  # noqa: SIM905
        "autocd assoc_expand_once cdable_vars cdspell checkhash checkjobs checkwinsize cmdhist compat31 "
        "compat32 compat40 compat41 compat42 compat43 compat44 complete_fullquote direxpand dirspell "
        "dotglob execfail expand_aliases extdebug extglob extquote failglob force_fignore "
        "globasciiranges globskipdots globstar gnu_errfmt histappend histreedit histverify "
        "hostcomplete huponexit inherit_errexit interactive_comments lastpipe lithist "
        "localvar_inherit localvar_unset mailwarn no_empty_cmd_completion nocaseglob nocasematch "
        "noexpand_translation nullglob patsub_replacement progcomp progcomp_alias promptvars "
        "shift_verbose sourcepath varredir_close xpg_echo"
    ).split()
)
# Variables whose assignment changes options (dotglob, posix, the compat* options)
_OPT_VARS = frozenset({"GLOBIGNORE", "POSIXLY_CORRECT", "POSIX_PEDANTIC", "BASH_COMPAT"})
_VAR_ATTRS = frozenset("aAilurx")
_VAR_ATTRS_T = _VAR_ATTRS | {"t"}
_FN_ATTRS = frozenset("fxt")
_DUMP_Q = ansi_c_quote(_DUMP)
MAX_DUMP = 8 << 20
MAX_VARS = 8192
MAX_ELEMENTS = 200_000
MAX_FUNCS = 2048
MAX_FUNC_BYTES = 160 << 10  # functions travel in the spawn's environment (the shim's 256 KiB)
MAX_ALIASES = 4096
DUMP_PIPE = 1 << 20  # the dump pipe's size: a dump up to this never waits for the edge
DUMP_WATCH = 0.05  # a run still going after this long has its dump read as it comes

Value = str | list[tuple[str, str]]


@dataclass
class BashState:
    cwd: str
    vars: list[tuple[str, str, Value]] = field(default_factory=list)
    funcs: list[tuple[str, str, str]] = field(default_factory=list)  # (x/t attrs, name, "() {...}")
    aliases: list[tuple[str, str]] = field(default_factory=list)
    setopts: set[str] | None = None  # None: bash's defaults
    shopts: set[str] | None = None
    ifs: str | None = None  # None: bash's default
    # The state part of the script and the environment, built once: a state is never changed
    # after it is parsed (a run that changes it makes a new one).
    _head: tuple[str, str] | None = field(default=None, repr=False, compare=False)
    _env: dict[str, str] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def initial(cls, cwd: str, env: dict[str, str]) -> BashState:
        vars_: list[tuple[str, str, Value]] = [
            ("x", k, v) for k, v in env.items() if _NAME.fullmatch(k) and k not in _SKIP_VARS
        ]
        return cls(cwd=cwd, vars=vars_)

    def _build_head(self) -> tuple[str, str]:
        q = ansi_c_quote
        out = []
        for attrs, name, value in self.vars:
            flags = "-g" + "".join(a for a in attrs if a in _VAR_ATTRS)
            if isinstance(value, str):
                out.append(f"builtin declare {flags} -- {name}={q(value)}")
            else:  # a compound assignment is syntax only as a statement of its own
                keys = (lambda k: q(k)) if "A" in attrs else (lambda k: k)
                items = " ".join(f"[{keys(k)}]={q(v)}" for k, v in value)
                out.append(f"builtin declare {flags.replace('r', '')} -- {name}; {name}=({items})")
                if "r" in attrs:
                    out.append(f"builtin declare -gr -- {name}")
        if self.ifs is not None:
            out.append(f"IFS={q(self.ifs)}")
        for name, value in self.aliases:
            out.append(f"BASH_ALIASES[{q(name)}]={q(value)}")
        hidden = [q(name) for attrs, name, _ in self.funcs if "x" not in attrs]
        if hidden:
            out.append("builtin export -nf -- " + " ".join(hidden))
        traced = [q(name) for attrs, name, _ in self.funcs if "t" in attrs]
        if traced:
            out.append("builtin declare -ft -- " + " ".join(traced))
        # Only what differs from a fresh shell's options, unless a variable of the state
        # changed options when it was assigned (then all of them).
        base = _defaults if _defaults is not None and not _OPT_VARS & {n for _, n, _ in self.vars} else None
        if self.shopts is not None:
            on = self.shopts & _SHOPTS
            off = _SHOPTS - self.shopts
            if base is not None:
                on, off = on - base[1], off & base[1]
            if on:
                out.append("builtin shopt -s " + " ".join(sorted(on)))
            if off:
                out.append("builtin shopt -u " + " ".join(sorted(off)))
        late = ""
        if self.setopts is not None:
            opts = [
                ("-o " if o in self.setopts else "+o ") + o
                for o in sorted(_SET_OPTS)
                if base is None or (o in self.setopts) != (o in base[0])
            ]
            if opts:
                out.append("builtin set " + " ".join(opts))
            late = "".join(f" builtin set -o {o};" for o in _LATE_OPTS if o in self.setopts)
        out.append("")
        return "\n".join(out), late

    def script(self, code: str) -> bytes:
        """The run's script: the state as assignments and builtin calls, then the code."""
        if self._head is None:
            self._head = self._build_head()
        head, late = self._head
        tail = "__dsec_c=" + ansi_c_quote(f"builtin unset -v __dsec_c;{late} {code}") + "\n"
        return (head + tail).encode(errors="surrogateescape")

    def env(self) -> dict[str, str]:
        if self._env is None:
            env = {"PWD": self.cwd}
            for _, name, text in self.funcs:
                env[f"BASH_FUNC_{name}%%"] = text
            self._env = env
        return self._env


class BadDump(Exception):
    pass


# `declare -p` as bash 5.2 prints it: `declare -<attrs or -> NAME[=VALUE]`, one a line; a
# value is "..." (\ before " \ $ `) or, with anything unprintable in it, $'...' (bash's
# ansic_quote: \E \a \b \f \n \r \t \v \\ \' and three-digit octal); an array is
# ([i]=v [j]=w), an associative one ([k]=v ["k 2"]=w ) (a key quoted like a value when it
# needs it). Anything else is refused, never guessed at.
_DECL = re.compile(rb"declare -([A-Za-z]{1,16}|-) ([A-Za-z_][A-Za-z0-9_]{0,255})")
_DQ = re.compile(rb'"((?:[^"\\]|\\[\\"$`])*)"', re.S)
_AQ = re.compile(rb"\$'((?:[^'\\]|\\(?:[abfnrtvE\\']|[0-7]{3}))*)'", re.S)
_DQ_ESC = re.compile(rb"\\(.)", re.S)
_AQ_ESC = re.compile(rb"\\([0-7]{3}|.)", re.S)
_AQ_MAP = {
    b"a": b"\a", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v", b"E": b"\x1b"
}
_INDEX = re.compile(rb"\[([0-9]{1,20})\]=")
_BARE_KEY = re.compile(rb"\[([^\]\n]+)\]=")
_FN_LINE = re.compile(r"declare -(f[xt]{0,2}) ([^\n]+)")
_FN_HEAD = re.compile(r"\n([^\n]*) \(\) \n\{ \n")


def _aq_char(m: re.Match[bytes]) -> bytes:
    c = m.group(1)
    if len(c) == 3:
        return bytes([int(c, 8) & 0xFF])
    return _AQ_MAP.get(c, c)


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise BadDump("not UTF-8") from e


def _quoted(s: bytes, pos: int) -> tuple[str, int] | None:
    m = _DQ.match(s, pos)
    if m is not None:
        return _text(_DQ_ESC.sub(rb"\1", m.group(1))), m.end()
    m = _AQ.match(s, pos)
    if m is not None:
        return _text(_AQ_ESC.sub(_aq_char, m.group(1))), m.end()
    return None


def _items(s: bytes, pos: int, assoc: bool) -> tuple[list[tuple[str, str]], int]:
    if s[pos : pos + 1] != b"(":
        raise BadDump("array")
    pos += 1
    items: list[tuple[str, str]] = []
    while s[pos : pos + 1] != b")":
        if items and not assoc:
            if s[pos : pos + 1] != b" ":
                raise BadDump("array")
            pos += 1
        if assoc:
            key = _quoted(s, pos + 1) if s[pos : pos + 1] == b"[" else None
            if key is not None and s[key[1] : key[1] + 2] == b"]=":
                k, pos = key[0], key[1] + 2
            else:
                m = _BARE_KEY.match(s, pos)
                if m is None:
                    raise BadDump("array key")
                k, pos = _text(m.group(1)), m.end()
        else:
            m = _INDEX.match(s, pos)
            if m is None:
                raise BadDump("array index")
            k, pos = m.group(1).decode(), m.end()
        value = _quoted(s, pos)
        if value is None:
            raise BadDump("array value")
        items.append((k, value[0]))
        pos = value[1]
        if assoc:
            if s[pos : pos + 1] != b" ":
                raise BadDump("array")
            pos += 1
        if len(items) > MAX_ELEMENTS:
            raise BadDump("array too large")
    return items, pos + 1


def parse_declare(s: bytes) -> list[tuple[str, str, Value | None]]:
    """(attrs, name, value) of each variable in `declare -p` output; None: no value."""
    out: list[tuple[str, str, Value | None]] = []
    pos, end = 0, len(s)
    while pos < end:
        m = _DECL.match(s, pos)
        if m is None:
            raise BadDump("not declare -p output")
        attrs = "" if m.group(1) == b"-" else m.group(1).decode()
        name = m.group(2).decode()
        pos = m.end()
        value: Value | None = None
        if s[pos : pos + 1] == b"=":
            if "a" in attrs or "A" in attrs:
                value, pos = _items(s, pos + 1, "A" in attrs)
            else:
                v = _quoted(s, pos + 1)
                if v is None:
                    raise BadDump(f"variable {name!r}")
                value, pos = v
        if s[pos : pos + 1] != b"\n":
            raise BadDump(f"variable {name!r}")
        pos += 1
        out.append((attrs, name, value))
    return out


def _variables(st: BashState, decls: list[tuple[str, str, Value | None]]) -> None:
    seen: set[str] = set()
    elements = 0
    for attrs, name, value in decls:
        if "n" in attrs or name in seen:  # a nameref is not carried; a local shadows its global
            continue
        seen.add(name)
        if name == "IFS":
            st.ifs = value if isinstance(value, str) else None
            continue
        if name in _SKIP_VARS or name.startswith("__dsec_"):
            continue
        if not set(attrs) <= _VAR_ATTRS_T or ("a" in attrs and "A" in attrs):
            raise BadDump(f"variable {name!r}")
        array = "a" in attrs or "A" in attrs
        if value is None:
            if not array:
                continue  # declared without a value
            value = []
        if isinstance(value, str):
            if array or ("i" in attrs and not _INT.fullmatch(value)):
                raise BadDump(f"variable {name!r}")
        else:
            elements += len(value)
            if not array or elements > MAX_ELEMENTS:
                raise BadDump(f"array {name!r}")
            if "i" in attrs and not all(_INT.fullmatch(v) for _, v in value):
                raise BadDump(f"array {name!r}")
        st.vars.append((attrs, name, value))
        if len(st.vars) > MAX_VARS:
            raise BadDump("too many variables")


def _aliases(st: BashState, decls: list[tuple[str, str, Value | None]]) -> None:
    if not decls:
        return  # BASH_ALIASES was unset: no aliases
    if len(decls) != 1 or decls[0][1] != "BASH_ALIASES" or "A" not in decls[0][0]:
        raise BadDump("aliases")
    items = decls[0][2]
    for name, value in items if isinstance(items, list) else []:
        if not _FUNC_NAME.fullmatch(name):
            raise BadDump(f"alias {name!r}")
        if name not in _NOT_CARRIED:
            st.aliases.append((name, value))
        if len(st.aliases) > MAX_ALIASES:
            raise BadDump("too many aliases")


def _ends(text: str, pos: int) -> bool:
    """Whether the line before `pos` (a newline), or the one before that when it is an
    attribute line (`declare -fx f`), closes a definition: it starts with `}`."""
    i = text.rfind("\n", 0, pos)
    line = text[i + 1 : pos]
    if line.startswith("declare -f"):
        line = text[text.rfind("\n", 0, i) + 1 : i]
    return line.startswith("}")


def _functions(st: BashState, listing: str, text: str) -> None:
    """Split `declare -f` (every function, in `declare -F`'s order) into definitions. A
    definition starts with `NAME () \\n{ \\n` at the start of a line after the line that ends
    the one before (`}...`); a split that is not the only one possible (a body with such
    lines naming another function, in a here-document) is refused."""
    entries = []
    for line in listing.split("\n")[:-1] if listing else []:
        m = _FN_LINE.fullmatch(line)
        if m is None or not _FUNC_NAME.fullmatch(m.group(2)):
            raise BadDump(f"function {line[:64]!r}")
        entries.append((m.group(1), m.group(2)))
    if (listing and not listing.endswith("\n")) or len(entries) > MAX_FUNCS:
        raise BadDump("functions")
    if not entries:
        if text:
            raise BadDump("functions")
        return
    names = {n for _, n in entries}
    heads = [
        (m.start() + 1, m.group(1))
        for m in _FN_HEAD.finditer(text)
        if m.group(1) in names and _ends(text, m.start())
    ]
    first = f"{entries[0][1]} () \n{{ \n"
    if [n for _, n in heads] != [n for _, n in entries[1:]] or not text.startswith(first):
        raise BadDump("functions")
    starts = [0] + [p for p, _ in heads]
    func_bytes = 0
    for i, (attrs, name) in enumerate(entries):
        piece = text[starts[i] : starts[i + 1] if i + 1 < len(entries) else len(text)]
        head = f"{name} () \n"
        trailer = f"declare -{attrs} {name}\n" if attrs != "f" else ""
        if not piece.startswith(head) or not piece.endswith(trailer or "\n"):
            raise BadDump(f"function {name!r}")
        if name in _NOT_CARRIED or name.startswith("__dsec_"):
            continue
        body = "() " + piece[len(head) : len(piece) - len(trailer)].rstrip("\n")
        func_bytes += len(name) + len(body.encode()) + 16
        st.funcs.append(("".join(a for a in "xt" if a in attrs), name, body))
        if func_bytes > MAX_FUNC_BYTES:
            raise BadDump("functions too large")


def parse_dump(data: bytes) -> BashState | None:
    """The state in a run's dump; None if the dump is incomplete. Raises BadDump for
    anything that is not exactly what the dump writes, within the limits."""
    fields = data.split(b"\0")
    if len(fields) < 14 or fields[-2:] != [b"E", b""]:
        return None
    if len(fields) != 14 or [fields[i] for i in (0, 2, 5, 7, 9)] != [b"C", b"O", b"P", b"L", b"F"]:
        raise BadDump("not a dump")
    cwd = _text(fields[1])
    if not cwd.startswith("/") or len(cwd) > 4096:
        raise BadDump("cwd")
    st = BashState(cwd=cwd)
    st.setopts = {o for o in _text(fields[3]).split(":") if o}
    st.shopts = {o for o in _text(fields[4]).split(":") if o}
    _variables(st, parse_declare(fields[6]))
    _aliases(st, parse_declare(fields[8]))
    _functions(st, _text(fields[10]), _text(fields[11]))
    return st


# --- python: the driver --------------------------------------------------------------------

PY_DRIVER = r"""
def _dsec_driver():
    import ast, builtins, io, os, signal, socket, sys, traceback, types
    compile_, exec_, eval_, isinstance_, len_, repr_, print_ = (
        builtins.compile, builtins.exec, builtins.eval, builtins.isinstance, builtins.len,
        builtins.repr, builtins.print)
    Expr, Expression, ONLY_AST = ast.Expr, ast.Expression, ast.PyCF_ONLY_AST
    read, write, close, dup2 = os.read, os.write, os.close, os.dup2
    format_exc, from_bytes = traceback.format_exc, int.from_bytes
    ctl = socket.socket(fileno=os.dup(0))
    recvmsg = ctl.recvmsg
    CMSG = socket.CMSG_SPACE(3 * 4)
    SOL, RIGHTS, CLOEXEC = socket.SOL_SOCKET, socket.SCM_RIGHTS, socket.MSG_CMSG_CLOEXEC
    nul = os.open(os.devnull, os.O_RDWR)
    dup2(nul, 0); dup2(nul, 1); dup2(nul, 2)
    sys.stdin = open(os.devnull)
    sys.stdout = sys.stderr = os.fdopen(os.dup(1), "w", buffering=1)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    ns = main.__dict__
    del globals()["_dsec_driver"]

    class Capped(io.TextIOBase):
        # keeps the first `cap` characters, counts the rest: a print flood costs no memory
        def __init__(self, cap):
            self.cap, self.parts, self.kept, self.over = cap, [], 0, False
        def writable(self):
            return True
        def write(self, s):
            room = self.cap - self.kept
            if room > 0:
                self.parts.append(s[:room]); self.kept += min(len_(s), room)
            if len_(s) > room:
                self.over = True
            return len_(s)
        def getvalue(self):
            return "".join(self.parts)

    def field(s):
        b = s.encode("utf-8", "replace")
        return len_(b).to_bytes(4, "little") + b

    def run(code, cap):
        out, err = Capped(cap), Capped(cap)
        failed, error = False, ""
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            tree = compile_(code, "<session>", "exec", ONLY_AST)
            last = None
            if tree.body and isinstance_(tree.body[-1], Expr):
                last = Expression(tree.body.pop().value)
            exec_(compile_(tree, "<session>", "exec"), ns)
            if last is not None:
                value = eval_(compile_(last, "<session>", "eval"), ns)
                if value is not None:
                    print_(repr_(value), file=out)
        except BaseException:
            failed = True
            try:
                error = format_exc()[-cap:] or "error"
            except BaseException:
                error = "error (its traceback could not be formatted)"
        sys.stdout, sys.stderr = saved
        flags = (1 if failed else 0) | (2 if out.over or err.over else 0)
        return bytes([flags]) + field(out.getvalue()) + field(err.getvalue()) + field(error)

    while True:
        fds = []
        try:
            msg, anc, _, _ = recvmsg(64, CMSG, CLOEXEC)
            for level, kind, data in anc:
                if level == SOL and kind == RIGHTS:
                    fds += [from_bytes(data[i:i + 4], "little") for i in range(0, len_(data) - 3, 4)]
            if not msg:
                break
            if len_(msg) != 28 or len_(fds) != 3:
                for fd in fds:
                    close(fd)
                continue
            nonce, cap = msg[:16], from_bytes(msg[16:24], "little")
            code_fd, reply_fd, out_fd = fds
            chunks = []
            while True:
                b = read(code_fd, 1 << 20)
                if not b:
                    break
                chunks.append(b)
            close(code_fd)
            dup2(out_fd, 1); dup2(out_fd, 2); close(out_fd)
            try:
                body = run(b"".join(chunks).decode("utf-8", "surrogateescape"), cap)
            except KeyboardInterrupt:
                body = bytes([1]) + field("") + field("") + field("KeyboardInterrupt")
            dup2(nul, 1); dup2(nul, 2)
            reply = b"DSEC" + nonce + len_(body).to_bytes(4, "little") + body
            while reply:
                reply = reply[write(reply_fd, reply):]
            close(reply_fd)
        except KeyboardInterrupt:
            for fd in fds:
                try:
                    close(fd)
                except OSError:
                    pass
        except OSError:
            for fd in fds:
                try:
                    close(fd)
                except OSError:
                    pass
_dsec_driver()
"""


# --- the sessions --------------------------------------------------------------------------


@dataclass
class Runner:
    """What every process of a session is started with."""

    container: Container
    cgroups: CgroupHost
    uid: int
    gid: int

    async def spawn(
        self, name: str, argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int]
    ) -> Spawned:
        return await spawn(
            self.container, self.cgroups, name, argv, env, cwd=cwd, uid=self.uid, gid=self.gid, stdio=stdio
        )


def _script_fd(script: bytes) -> int:
    """A sealed memfd holding a run's script: bash reads it from the descriptor itself (never
    through a path such as /dev/fd/3, which the sandbox's root can replace), and closes it
    before the code runs."""
    fd = os.memfd_create("dsec-session-run", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(script)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _host_pid(group: ExecGroup, ns_pid: int) -> int | None:
    """The host pid of the process of `group` whose innermost pid is `ns_pid`."""
    for pid in group.procs():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    if int(line.split()[-1]) == ns_pid:
                        return pid
                    break
    return None


class Session:
    id: str
    kind: SessionKind

    def __init__(self, sid: str, kind: SessionKind, runner: Runner) -> None:
        self.id = sid
        self.kind = kind
        self.runner = runner
        self.lock = asyncio.Lock()
        self.created_at = time.time()
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    async def run(self, code: str, timeout: float, cap: int) -> SessionResult:
        if not self.alive:
            raise SessionNotFound(f"session {self.id} has ended; open a new one")
        async with self.lock:
            if not self.alive:
                raise SessionNotFound(f"session {self.id} has ended; open a new one")
            return await self._run(code, timeout, cap)

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        raise NotImplementedError

    def close(self, *, kill: bool = True) -> None:
        raise NotImplementedError


class _Dump:
    """A run's dump pipe, read once its shell has exited (one read, instead of a wakeup of
    the edge for each builtin the dump runs) or, in a run still going after DUMP_WATCH
    seconds, as it comes (a dump larger than the pipe holds would block the shell)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.reader: PipeReader | None = None
        self.timer = asyncio.get_running_loop().call_later(DUMP_WATCH, self.watch)

    def watch(self) -> PipeReader:
        if self.reader is None:
            self.reader = PipeReader(self.fd, MAX_DUMP)
        return self.reader

    def take(self) -> bytes | None:
        reader = self.watch()
        reader.drain()
        return None if reader.truncated else bytes(reader.buf)

    def close(self) -> None:
        self.timer.cancel()
        if self.reader is not None:
            self.reader.close()
        elif self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


class BashSession(Session):
    def __init__(self, sid: str, runner: Runner, cwd: str, env: dict[str, str]) -> None:
        super().__init__(sid, SessionKind.BASH, runner)
        self.state = BashState.initial(cwd, env)
        self.home_cwd = cwd
        self.groups: list[ExecGroup] = []  # runs' cgroups that may still hold background jobs
        self.dump: bytes | None = None  # the last run's dump, parsed when the next run starts
        self.dumped = b""  # the dump self.state was parsed from
        self._n = 0

    def _take_dump(self) -> None:
        """Take the previous run's dump as the state (or keep the state if it is bad). The
        shell wrote it before it exited, so it is complete or never will be; a dump that is
        the same as the last one is the same state (parsed once)."""
        data, self.dump = self.dump, None
        if data is None or data == self.dumped:
            return
        try:
            st = parse_dump(data)
        except BadDump:
            return
        if st is not None:
            self.state = st
            self.dumped = data

    def _reap_groups(self) -> None:
        keep = []
        for g in self.groups:
            try:
                g.path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                keep.append(g)
        self.groups = keep[-256:]
        for g in keep[:-256]:  # a session that leaves hundreds of jobs behind loses the oldest
            g.kill()
            release_group(g)

    async def _start(self, code: str) -> tuple[Spawned, PipeReader, _Dump]:
        script = self.state.script(code)
        env = self.state.env()
        argv = [TRUSTED_BASH, "--noprofile", "--norc", "-c", _prelude(self.id), "/bin/bash"]
        for cwd in dict.fromkeys([self.state.cwd, self.home_cwd, "/"]):
            code_r = _script_fd(script)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            dump_r, dump_w = os.pipe2(os.O_CLOEXEC)
            with contextlib.suppress(OSError):  # room for the dump of a large state
                fcntl.fcntl(dump_w, fcntl.F_SETPIPE_SZ, DUMP_PIPE)
            self._n += 1
            try:
                proc = await self.runner.spawn(
                    f"dsec-{self.id}-r{self._n}", argv, {**env, "PWD": cwd}, cwd, (code_r, out_w, dump_w)
                )
            except InvalidRequest as e:
                for fd in (out_r, dump_r):
                    os.close(fd)
                if "working directory" in str(e) and cwd != "/":
                    continue  # the directory is gone: start where the session started, or in /
                raise InvalidRequest(
                    f"cannot start the session's shell: {e.message}"
                    + ("" if os.path.exists(HOST_BASH) else "; the edge needs bash-static (install.sh)")
                ) from e
            except BaseException:
                for fd in (out_r, dump_r):
                    os.close(fd)
                raise
            break
        else:  # pragma: no cover - the loop always ends with "/"
            raise InternalError("no directory to start the session's shell in")
        self.groups.append(proc.group)
        return proc, PipeReader(out_r, 0), _Dump(dump_r)

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        t0 = time.perf_counter()
        if "\0" in code:
            raise InvalidRequest("bash session input must not contain NUL bytes")
        self._take_dump()
        self._reap_groups()
        proc, out, dump = await self._start(code)
        out.cap = cap
        loop = asyncio.get_running_loop()
        timed_out = False
        status: int | None = None
        try:
            try:
                status = await asyncio.wait_for(asyncio.shield(proc.exited), timeout)
            except TimeoutError:
                timed_out = True
                # Kill what the code runs, give the shell a moment to save its state, then all.
                keep = await loop.run_in_executor(None, _host_pid, proc.group, proc.pid)
                await loop.run_in_executor(None, kill_except, proc.group, keep)
                with contextlib.suppress(TimeoutError):
                    status = await asyncio.wait_for(asyncio.shield(proc.exited), 1.0)
                if status is None:
                    await loop.run_in_executor(None, proc.group.kill)
                    with contextlib.suppress(TimeoutError):
                        status = await asyncio.wait_for(asyncio.shield(proc.exited), 5.0)
            if not out.eof.done():
                # What the shell wrote is in the pipe; its background jobs may hold the pipe
                # open, so wait for EOF only briefly. Then the pipe is closed: what they
                # write later goes nowhere, never into a later run.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(out.eof), 0.01)
            out.drain()
            if status is not None:  # the shell wrote its dump before it exited
                self.dump = dump.take()
        finally:
            out.close()
            dump.close()  # what a background job writes into it later goes nowhere
        output = bytes(out.buf)
        rc = exit_code(status) if status is not None else 137
        return SessionResult(
            output=output.decode(errors="replace"),
            exit_code=124 if timed_out else rc,
            duration=time.perf_counter() - t0,
            timed_out=timed_out,
            truncated=out.truncated,
        )

    def close(self, *, kill: bool = True) -> None:
        self.closed = True
        self.dump = None
        if kill:
            for g in self.groups:
                with contextlib.suppress(OSError):
                    g.kill()
                release_group(g)
        self.groups = []


_REPLY_HEAD = 4 + 16 + 4


class PythonSession(Session):
    def __init__(self, sid: str, runner: Runner, proc: Spawned, ctl: socket.socket) -> None:
        super().__init__(sid, SessionKind.PYTHON, runner)
        self.proc = proc
        self.ctl = ctl

    @property
    def alive(self) -> bool:
        return not self.closed and not self.proc.exited.done()

    def _broken(self, why: str) -> SessionNotFound:
        return SessionNotFound(f"session {self.id} {why}; it is closed: open a new one")

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        t0 = time.perf_counter()
        nonce = secrets.token_bytes(16)
        code_r, code_w = os.pipe2(os.O_CLOEXEC)
        reply_r, reply_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        msg = nonce + struct.pack("<QI", max(cap, 0), 0)
        try:
            socket.send_fds(self.ctl, [msg], [code_r, reply_w, out_w])
        except OSError as e:
            for fd in (code_w, reply_r, out_r):
                os.close(fd)
            raise self._broken("has ended") from e
        finally:
            for fd in (code_r, reply_w, out_w):
                os.close(fd)
        feeder = asyncio.ensure_future(feed_pipe(code_w, code.encode(errors="surrogateescape")))
        # The driver caps each field at `cap` characters (at most 4 bytes each in UTF-8).
        limit = _REPLY_HEAD + 1 + 3 * (4 + 4 * max(cap, 1)) + 64
        reply = PipeReader(reply_r, limit)
        stray = PipeReader(out_r, cap)

        def done() -> bool:
            n = length_of(reply.buf)
            return reply.truncated or reply.fd < 0 or (n is not None and len(reply.buf) >= n)

        async def wait(t: float) -> bool:
            end = time.monotonic() + t
            while not done():
                reply.changed.clear()
                left = end - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reply.changed.wait(), left)
            return True

        timed_out = False
        try:
            if not await wait(timeout):
                timed_out = True
                self.runner.container.channel.signal(self.proc.ident, signal.SIGINT)
                if not await wait(2.0):
                    self.closed = True
                    await asyncio.get_running_loop().run_in_executor(None, self.proc.group.kill)
                    raise self._broken("did not answer after its timeout")
            stray.drain()
        finally:
            if not feeder.done():
                feeder.cancel()
            data = bytes(reply.buf)
            reply.close()
            stray.close()
        n = length_of(data)
        if (n is None or len(data) < n) and not data and self.proc.exited.done():
            self.close()
            raise self._broken("ended while running the code")
        if n is None or len(data) != n or data[:4] != b"DSEC" or data[4:20] != nonce:
            self.closed = True
            self.close()
            raise self._broken("broke its protocol (its reply was not the driver's)")
        try:
            failed, truncated, stdout, stderr, error = _parse_reply(data[_REPLY_HEAD:])
        except ValueError as e:
            self.close()
            raise self._broken("broke its protocol (a malformed reply)") from e
        stderr = stray.buf.decode(errors="replace") + stderr
        return SessionResult(
            output=stdout[:cap],
            stderr=stderr[:cap],
            error=error if failed else None,
            exit_code=124 if timed_out else (1 if failed else 0),
            duration=time.perf_counter() - t0,
            timed_out=timed_out,
            truncated=truncated or len(stdout) > cap or len(stderr) > cap or stray.truncated,
        )

    def close(self, *, kill: bool = True) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.ctl.close()
        if kill:
            with contextlib.suppress(OSError):
                self.proc.group.kill()
            release_group(self.proc.group)


def length_of(data: bytes | bytearray) -> int | None:
    if len(data) < _REPLY_HEAD:
        return None
    return _REPLY_HEAD + int.from_bytes(data[20:24], "little")


def _parse_reply(body: bytes) -> tuple[bool, bool, str, str, str]:
    if not body:
        raise ValueError("empty")
    flags, pos, out = body[0], 1, []
    for _ in range(3):
        if pos + 4 > len(body):
            raise ValueError("short")
        n = int.from_bytes(body[pos : pos + 4], "little")
        pos += 4
        if pos + n > len(body):
            raise ValueError("short")
        out.append(body[pos : pos + n].decode(errors="replace"))
        pos += n
    if pos != len(body) or flags & ~3:
        raise ValueError("trailing bytes")
    return bool(flags & 1), bool(flags & 2), out[0], out[1], out[2]


async def open_session(
    sid: str, kind: SessionKind, runner: Runner, env: dict[str, str], cwd: str
) -> Session:
    """Start a session; a bash session runs once (an empty command) to check that its shell
    starts in `cwd` as its user."""
    if kind is SessionKind.BASH:
        s = BashSession(sid, runner, cwd, env)
        try:
            r = await s.run("", 30.0, 4096)
        except InvalidRequest:
            s.close()
            raise
        if r.exit_code != 0:
            s.close()
            raise InvalidRequest(f"the session's shell did not start: {r.output.strip()[:500]}")
        return s
    edge_end, driver_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    nul = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        fd = driver_end.detach()
        proc = await runner.spawn(f"dsec-{sid}", ["python3", "-u", "-c", PY_DRIVER], env, cwd, (fd, nul, nul))
    except BaseException:
        edge_end.close()
        raise
    # The edge only writes to the control socket: whatever the session writes into it is
    # refused (EPIPE) instead of queued.
    with contextlib.suppress(OSError):
        edge_end.shutdown(socket.SHUT_RD)
    edge_end.setblocking(False)
    return PythonSession(sid, runner, proc, edge_end)


def check_kind(kind: str) -> SessionKind:
    try:
        return SessionKind(kind)
    except ValueError as e:
        raise InvalidRequest(f"unknown session kind {kind!r}: use 'bash' or 'python'") from e


__all__ = [
    "BashSession",
    "PythonSession",
    "Runner",
    "Session",
    "ansi_c_quote",
    "check_kind",
    "open_session",
    "prepare_tools",
]
