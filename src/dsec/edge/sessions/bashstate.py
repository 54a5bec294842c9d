"""A bash session's state between runs: the start of a run (its prelude) and the dump of
its state at the end, parsed by a strict tokenizer into data (never evaluated)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsec.edge.sessions import tools  # tools._defaults is learnt at run time: read it there
from dsec.edge.sessions.tools import ansi_c_quote

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
    '{ builtin printf \'C\\0%s\\0O\\0%s\\0%s\\0P\\0\' "$PWD" "$__dsec_o" "$__dsec_b"; '
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
        # /dev/fd/3: the sandbox's root can replace /dev/fd or /dev/stdin. The code must not
        # inherit the script's memfd (any dumpable child would let another process reopen
        # it): its stdin is /dev/null, which a container's root cannot replace (a bind mount
        # of the host's, root's: EBUSY, EPERM). gVisor's and a microVM guest's root can
        # remove it: then the code reads the script's memfd at its end (EOF, as /dev/null
        # gives), never a failed start that would report the status of no code at all.
        "exec 4>&2 2>&1 3<&0 || builtin exit 125; IFS= builtin read -r -d '' -u 3 __dsec_s; "
        "exec 2>&- 0</dev/null || exec 0<&3; exec 2>&1 3<&-; "
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
        base = (
            tools._defaults
            if tools._defaults is not None and not _OPT_VARS & {n for _, n, _ in self.vars}
            else None
        )
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
    b"a": b"\a",
    b"b": b"\b",
    b"f": b"\f",
    b"n": b"\n",
    b"r": b"\r",
    b"t": b"\t",
    b"v": b"\v",
    b"E": b"\x1b",
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
