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

from dsec.edge.sessions.bashstate import (
    DUMP_PIPE,
    DUMP_WATCH,
    MAX_ALIASES,
    MAX_DUMP,
    MAX_ELEMENTS,
    MAX_FUNC_BYTES,
    MAX_FUNCS,
    MAX_VARS,
    BadDump,
    BashState,
    Value,
    parse_declare,
    parse_dump,
)
from dsec.edge.sessions.pydriver import (
    PY_DRIVER,
)
from dsec.edge.sessions.session import (
    BashSession,
    PythonSession,
    Runner,
    Session,
    check_kind,
    length_of,
    open_session,
)
from dsec.edge.sessions.tools import (
    HOST_BASH,
    TRUSTED_BASH,
    ansi_c_quote,
    prepare_tools,
)

__all__ = [
    "DUMP_PIPE",
    "DUMP_WATCH",
    "HOST_BASH",
    "MAX_ALIASES",
    "MAX_DUMP",
    "MAX_ELEMENTS",
    "MAX_FUNCS",
    "MAX_FUNC_BYTES",
    "MAX_VARS",
    "PY_DRIVER",
    "TRUSTED_BASH",
    "BadDump",
    "BashSession",
    "BashState",
    "PythonSession",
    "Runner",
    "Session",
    "Value",
    "ansi_c_quote",
    "check_kind",
    "length_of",
    "open_session",
    "parse_declare",
    "parse_dump",
    "prepare_tools",
]
