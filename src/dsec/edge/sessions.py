"""Persistent sessions: a bash shell or a Python interpreter that keeps its state.

bash: every run is a process of its own, started through the shim like an exec (own exec
cgroup, own process group, fresh pipes), running the platform's static bash from the
read-only /.dsec-tools mount. Its exit status is the shim's waitpid of that process, so
nothing defined in the shell can change what is reported. The state carries over between
runs as data only: the run's EXIT trap dumps it (in a subshell started in the background,
so it cannot touch the shell's status) to a per-run pipe as NUL-separated records; the edge
parses them with strict limits and builds the next run's start from them: cwd (the spawn's
cwd), functions (env entries `BASH_FUNC_<name>%%`, bash's own one-definition importer),
variables, aliases and options as assignments and builtin calls the edge quotes itself. A
dump that is missing, late or malformed leaves the previous state. The code comes through a
per-run pipe and is run by `eval` after the state is in place; stdout and stderr share one
pipe (the output keeps its order), stdin is /dev/null. What a run's background jobs write
after it ended goes to a closed pipe, never into a later run.

Changed semantics against a long-lived shell: `jobs`, `%1` and `wait` do not reach jobs of
an earlier run (they keep running); `exit N` ends only that run (its status is N); traps do
not carry over; functions or aliases named `builtin` or `exec`, namerefs and variables the
shell maintains itself are not carried over.

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
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec.backends.container import Container, resolve_once
from dsec.edge.process import PipeReader, Spawned, exit_code, release_group, spawn
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
    return tools_dir


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

# Runs in a background subshell of the EXIT trap: whatever happens in it (a failing command
# under set -e, an unbound variable, a user function), the shell's own exit status is the
# one its code left. Only builtins (`builtin` itself is never carried over as a function or
# alias), output to the run's dump pipe (fd 4).
_DUMP = r"""( __dsec_o=$SHELLOPTS __dsec_b=$BASHOPTS __dsec_i=${IFS+x}$IFS __dsec_d=$PWD
builtin set +eEuxvTk +o pipefail -f
exec 1>&4 2>/dev/null 4>&-
IFS=$'\n'
__dsec_v=$(builtin compgen -v; builtin printf '%s\n' --; builtin declare -F)
builtin printf 'C\0%s\0O\0%s\0%s\0I\0%s\0' "$__dsec_d" "$__dsec_o" "$__dsec_b" "$__dsec_i"
__dsec_x=
for __dsec_n in $__dsec_v; do
  if [[ -n $__dsec_x ]]; then
    __dsec_f=${__dsec_n#declare -* }; __dsec_a=${__dsec_n#declare -}; __dsec_a=${__dsec_a%% *}
    builtin printf 'F\0%s\0%s\0' "$__dsec_a" "$__dsec_f"
    builtin declare -f -- "$__dsec_f"; builtin printf '\0'
    continue
  fi
  case $__dsec_n in
  --) __dsec_x=1; continue;;
  __dsec_*|@SKIP@) continue;;
  esac
  __dsec_a=${!__dsec_n@a}
  case $__dsec_a in
  *n*) ;;
  *[aA]*)
    builtin declare -n __dsec_r=$__dsec_n
    builtin printf 'A\0%s\0%s\0%s\0' "$__dsec_a" "$__dsec_n" "${#__dsec_r[@]}"
    for __dsec_k in "${!__dsec_r[@]}"; do builtin printf '%s\0%s\0' "$__dsec_k" "${__dsec_r[$__dsec_k]}"; done
    builtin unset -n __dsec_r;;
  *) [[ -n ${!__dsec_n+x} ]] && builtin printf 'V\0%s\0%s\0%s\0' "$__dsec_a" "$__dsec_n" "${!__dsec_n}";;
  esac
done
for __dsec_k in "${!BASH_ALIASES[@]}"; do
  builtin printf 'L\0%s\0%s\0' "$__dsec_k" "${BASH_ALIASES[$__dsec_k]}"
done
builtin printf 'E\0' ) &"""


def _prelude(sid: str) -> str:
    # fd 0: the run's script (state, then the code), 1: output, 2: the dump pipe. The script
    # is read whole by `.` before any of it runs; the code runs through `eval` on line 1, so
    # its line numbers are the caller's.
    return (
        f"builtin : dsec-session-{sid}; builtin trap -- {_DUMP_Q} EXIT; "
        "exec 4>&2 2>&1 3<&0 0</dev/null; builtin . /dev/fd/3 || builtin exit 125; "
        'exec 3<&-; builtin eval "$__dsec_c"'
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
_VAR_ATTRS = frozenset("aAilurx")
_VAR_ATTRS_T = _VAR_ATTRS | {"t"}
_FN_ATTRS = frozenset("fxt")
_DUMP_Q = ansi_c_quote(_DUMP.replace("@SKIP@", "|".join(sorted(_SKIP_VARS))))
MAX_DUMP = 8 << 20
MAX_VARS = 8192
MAX_ELEMENTS = 200_000
MAX_FUNCS = 2048
MAX_FUNC_BYTES = 160 << 10  # functions travel in the spawn's environment (the shim's 256 KiB)
MAX_ALIASES = 4096
DUMP_WAIT = 2.0  # how long a run waits for the previous run's dump


@dataclass
class BashState:
    cwd: str
    vars: list[tuple[str, str, str | list[tuple[str, str]]]] = field(default_factory=list)
    funcs: list[tuple[str, str, str]] = field(default_factory=list)  # (attrs, name, "() {...}")
    aliases: list[tuple[str, str]] = field(default_factory=list)
    setopts: set[str] | None = None  # None: bash's defaults
    shopts: set[str] | None = None
    ifs: str | None = None  # None: bash's default

    @classmethod
    def initial(cls, cwd: str, env: dict[str, str]) -> BashState:
        vars_: list[tuple[str, str, str | list[tuple[str, str]]]] = [
            ("x", k, v) for k, v in env.items() if _NAME.fullmatch(k) and k not in _SKIP_VARS
        ]
        return cls(cwd=cwd, vars=vars_)

    def script(self, code: str) -> bytes:
        """The run's script: the state as assignments and builtin calls, then the code."""
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
        if self.shopts is not None:
            on = sorted(self.shopts & _SHOPTS)
            off = sorted(_SHOPTS - self.shopts)
            if on:
                out.append("builtin shopt -s " + " ".join(on))
            out.append("builtin shopt -u " + " ".join(off))
        late = ""
        if self.setopts is not None:
            opts = [("-o " if o in self.setopts else "+o ") + o for o in sorted(_SET_OPTS)]
            out.append("builtin set " + " ".join(opts))
            late = "".join(f" builtin set -o {o};" for o in _LATE_OPTS if o in self.setopts)
        out.append("__dsec_c=" + q(f"builtin unset -v __dsec_c;{late} {code}"))
        return ("\n".join(out) + "\n").encode(errors="surrogateescape")

    def env(self) -> dict[str, str]:
        env = {"PWD": self.cwd}
        for _, name, text in self.funcs:
            env[f"BASH_FUNC_{name}%%"] = text
        return env


class BadDump(Exception):
    pass


def parse_dump(data: bytes) -> BashState | None:  # noqa: C901 - one branch per record
    """The state in a run's dump; None if the dump is incomplete. Raises BadDump for
    anything that is not exactly what the dump writes, within the limits."""
    fields = data.split(b"\0")
    if fields[-1] != b"":
        return None
    pos = 0

    def take() -> str:
        nonlocal pos
        if pos >= len(fields) - 1:
            raise IndexError
        v = fields[pos]
        pos += 1
        try:
            return v.decode()
        except UnicodeDecodeError as e:
            raise BadDump("not UTF-8") from e

    st = BashState(cwd="/", setopts=set(), shopts=set())
    func_bytes = 0
    elements = 0
    seen: set[str] = set()
    try:
        while True:
            kind = take()
            if kind == "E":
                if pos != len(fields) - 1:
                    raise BadDump("data after the end")
                return st
            if kind == "C":
                st.cwd = take()
                if not st.cwd.startswith("/") or len(st.cwd) > 4096:
                    raise BadDump("cwd")
            elif kind == "O":
                st.setopts = {o for o in take().split(":") if o}
                st.shopts = {o for o in take().split(":") if o}
            elif kind == "I":
                v = take()
                st.ifs = v[1:] if v.startswith("x") else None
            elif kind in ("V", "A"):
                attrs, name = take(), take()
                if not _NAME.fullmatch(name) or name.startswith("__dsec_") or not set(attrs) <= _VAR_ATTRS_T:
                    raise BadDump(f"variable {name!r}")
                if kind == "V":
                    value: str | list[tuple[str, str]] = take()
                    if "a" in attrs or "A" in attrs or ("i" in attrs and not _INT.fullmatch(str(value))):
                        raise BadDump(f"variable {name!r}")
                else:
                    n = int(take())
                    elements += n
                    if n < 0 or elements > MAX_ELEMENTS or ("a" in attrs) == ("A" in attrs):
                        raise BadDump(f"array {name!r}")
                    items = [(take(), take()) for _ in range(n)]
                    if "a" in attrs and not all(k.isdigit() and len(k) <= 20 for k, _ in items):
                        raise BadDump(f"array {name!r}")
                    if "i" in attrs and not all(_INT.fullmatch(v) for _, v in items):
                        raise BadDump(f"array {name!r}")
                    value = items
                if name in _SKIP_VARS or name in seen:
                    continue
                seen.add(name)
                st.vars.append((attrs, name, value))
                if len(st.vars) > MAX_VARS:
                    raise BadDump("too many variables")
            elif kind == "F":
                attrs, name, text = take(), take(), take()
                head = f"{name} () \n"
                if not (_FUNC_NAME.fullmatch(name) and text.startswith(head) and set(attrs) <= _FN_ATTRS):
                    raise BadDump(f"function {name!r}")
                if name in _NOT_CARRIED or name.startswith("__dsec_"):
                    continue
                body = "() " + text[len(head) :].rstrip("\n")
                func_bytes += len(name) + len(body.encode()) + 16
                st.funcs.append(("x" if "x" in attrs else "", name, body))
                if len(st.funcs) > MAX_FUNCS or func_bytes > MAX_FUNC_BYTES:
                    raise BadDump("functions too large")
            elif kind == "L":
                name, value = take(), take()
                if not _FUNC_NAME.fullmatch(name):
                    raise BadDump(f"alias {name!r}")
                if name not in _NOT_CARRIED:
                    st.aliases.append((name, value))
                if len(st.aliases) > MAX_ALIASES:
                    raise BadDump("too many aliases")
            else:
                raise BadDump(f"record {kind!r}")
    except IndexError:
        return None  # not complete (yet)
    except ValueError as e:
        raise BadDump(str(e)) from e


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


async def _feed(fd: int, data: bytes) -> None:
    """Write `data` to a pipe without blocking the loop, then close it."""
    os.set_blocking(fd, False)
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_writer(fd, resolve_once, ready)
                try:
                    await ready
                finally:
                    loop.remove_writer(fd)
            except BrokenPipeError:
                break
    finally:
        os.close(fd)


def _script_fd(script: bytes) -> int:
    """A sealed memfd holding a run's script: bash reads it with `.` through /dev/fd/3, which
    reopens the file (a pipe made by the edge belongs to the host's root, which a sandbox
    cannot open; a memfd is mode 0777 and reachable only through its descriptor)."""
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


def _kill_others(group: ExecGroup, keep: int | None) -> None:
    """SIGKILL every process of a run's cgroup but its shell."""
    for _ in range(50):
        victims = [p for p in group.procs() if p != keep]
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


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


class BashSession(Session):
    def __init__(self, sid: str, runner: Runner, cwd: str, env: dict[str, str]) -> None:
        super().__init__(sid, SessionKind.BASH, runner)
        self.state = BashState.initial(cwd, env)
        self.home_cwd = cwd
        self.groups: list[ExecGroup] = []  # runs' cgroups that may still hold background jobs
        self.dump: PipeReader | None = None  # the last run's dump, until it is complete
        self.dumped: asyncio.Future[None] | None = None
        self._n = 0

    async def _settle_dump(self) -> None:
        """Take the previous run's dump as the state (or keep the state if it is bad)."""
        reader, self.dump = self.dump, None
        if reader is None:
            return
        try:
            deadline = time.monotonic() + DUMP_WAIT
            while True:
                try:
                    st = parse_dump(bytes(reader.buf)) if not reader.truncated else None
                except BadDump:
                    return
                if st is not None:
                    self.state = st
                    return
                left = deadline - time.monotonic()
                if reader.fd < 0 or reader.truncated or left <= 0:
                    return
                reader.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.changed.wait(), left)
        finally:
            reader.close()

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

    async def _start(self, code: str) -> tuple[Spawned, PipeReader, PipeReader]:
        script = self.state.script(code)
        env = self.state.env()
        argv = [TRUSTED_BASH, "--noprofile", "--norc", "-c", _prelude(self.id), "/bin/bash"]
        for cwd in dict.fromkeys([self.state.cwd, self.home_cwd, "/"]):
            code_r = _script_fd(script)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            dump_r, dump_w = os.pipe2(os.O_CLOEXEC)
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
        return proc, PipeReader(out_r, 0), PipeReader(dump_r, MAX_DUMP)

    async def _run(self, code: str, timeout: float, cap: int) -> SessionResult:
        t0 = time.perf_counter()
        if "\0" in code:
            raise InvalidRequest("bash session input must not contain NUL bytes")
        await self._settle_dump()
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
                await loop.run_in_executor(None, _kill_others, proc.group, keep)
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
        finally:
            out.close()
        self.dump = dump
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
        if self.dump is not None:
            self.dump.close()
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
        feeder = asyncio.ensure_future(_feed(code_w, code.encode(errors="surrogateescape")))
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
