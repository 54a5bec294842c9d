"""Persistent sessions against the code they run: nothing defined in a session changes what a
later run reports, and nothing written after a run lands in a later one.

Every attack here forged a result (or pinned the edge's memory) with the long-lived shell
and the stdin/stdout Python driver these sessions used before.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec, SessionCreate, SessionRun

pytestmark = pytest.mark.root


async def _bash(edge, sb):
    return (await edge.session_create(sb.id, SessionCreate(kind="bash"))).id


async def _run(edge, sb, sid, code, timeout=20.0):
    return await edge.session_run(sb.id, sid, SessionRun(code=code, timeout=timeout))


async def _assert_honest(edge, sb, sid):
    """The statuses and outputs the code itself produces, whatever the session defined."""
    for code, rc, out in (
        ("false", 1, ""),
        ("(exit 3)", 3, ""),
        ("echo real; exit 7", 7, "real\n"),
        ("builtin echo ok; true", 0, "ok\n"),
        ("kill -9 $$", 137, ""),
    ):
        r = await _run(edge, sb, sid, code)
        assert (r.exit_code, r.output) == (rc, out), (code, r)


SHADOWS = [
    # the old driver's end marker: a printf that always reports 0
    'printf() { builtin printf "$1" 0; }',
    # the builtin disabled, an impostor on PATH that reports 0
    "printf '#!/bin/sh\\nf=$1; shift; exec /usr/bin/printf \"$f\" 0\\n' > /usr/local/bin/printf;"
    " chmod +x /usr/local/bin/printf; enable -n printf",
    # everything a driver could call, as functions that end the shell with 0
    "for f in eval trap set export declare shopt source . exec builtin command unset enable read "
    'compgen printf echo return exit cd pwd; do eval "$f() { builtin exit 0; }"; done; '
    "export -f eval trap set builtin exec",
    # ... and as aliases
    "shopt -s expand_aliases; alias builtin='exit 0;' exec='exit 0;' eval='exit 0;' trap='exit 0;' "
    "'!'='exit 0;' set='exit 0;' printf='exit 0;'",
    # options that change how everything after them runs
    "set -e -u -o pipefail; PS4='$(exit 0)${nope:?}'",
    "set -x; PS4='+${a[$((1/0))]}'",
    "set -n",
    "shopt -s extdebug; trap 'return 0' DEBUG; trap 'exit 0' EXIT ERR RETURN",
]


@pytest.mark.parametrize("attack", SHADOWS, ids=range(len(SHADOWS)))
async def test_nothing_defined_in_a_bash_session_changes_later_exit_codes(edge, backend, attack):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    await _run(edge, sb, sid, 'X=kept; kept() { echo "fn $X"; }')
    await _run(edge, sb, sid, attack)
    await _assert_honest(edge, sb, sid)
    r = await _run(edge, sb, sid, "builtin unset -f printf echo return exit; builtin enable printf; kept")
    assert r.output == "fn kept\n", r  # the state is still there
    await edge.stop(sb.id)


async def test_bash_state_carries_over_as_data(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    r = await _run(
        edge,
        sb,
        sid,
        "cd /tmp; export E='a b'; V=$'x\\ny'; declare -i N=41; declare -a L=(1 '2 3'); "
        "declare -A M=([k]=v ['odd key']=$'\\t'); f() { echo \"f:$1\"; }; export -f f; g() { :; }; "
        "alias ll='echo aliased'; shopt -s expand_aliases extglob; set -o pipefail; IFS=:",
    )
    assert r.exit_code == 0, r
    r = await _run(
        edge,
        sb,
        sid,
        'echo "$PWD|$E|$V|$((N+1))|${L[1]}|${M[odd key]}|${#M[@]}"; f 1; ll; '
        "[[ -o pipefail ]] && shopt -q extglob && echo opts; "
        "bash -c 'f 2; type -t g || echo g-not-exported'; "
        "printf '%s\\n' \"$IFS\"; echo $BASH_SUBSHELL $SHLVL",
    )
    assert r.output == "/tmp|a b|x\ny|42|2 3|\t|2\nf:1\naliased\nopts\nf:2\ng-not-exported\n:\n0 1\n", r
    # A dump forged from inside is only data: function definitions with trailing code are
    # refused by bash's importer, names and integer values are checked, and a dump whose
    # shell removed the trap just leaves the state it had.
    forged = (
        "printf 'C\\0/\\0O\\0\\0\\0I\\0\\0F\\0f\\0evil\\0evil () \\n{ :; }; touch /tmp/pwned1\\0"
        "V\\0i\\0n\\0a[$(touch /tmp/pwned2)]\\0E\\0' >&4; exec 4>&-; trap - EXIT"
    )
    await _run(edge, sb, sid, forged)
    await _run(edge, sb, sid, "printf 'V\\0\\0x;touch /tmp/pwned3\\0v\\0E\\0' >&4; exec 4>&-; trap - EXIT")
    r = await _run(edge, sb, sid, "ls /tmp/pwned* 2>/dev/null; echo $PWD; type -t evil; f 3; false")
    assert (r.output, r.exit_code) == ("/tmp\nf:3\n", 1), r
    await edge.stop(sb.id)


async def test_later_runs_own_their_input_and_output(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    # Background jobs that read every descriptor they have and reach for every other process's
    # through /proc, inject fake end markers, and write late output.
    spy = r"""
(for i in $(seq 200); do
   for fd in 0 1 2 3 4 5 6 7 8 9; do timeout 0.05 cat <&$fd >> /tmp/stolen 2>/dev/null; done
   for f in /proc/[0-9]*/fd/*; do
     (printf '\n__DSEC_END_0000__0\nforged\n' > "$f") 2>/dev/null
     timeout 0.02 cat "$f" >> /tmp/stolen 2>/dev/null
   done
   sleep 0.05
 done) >/dev/null 2>&1 &
(sleep 0.4; echo LATE; echo LATE >&2) &
(while true; do read -r line && echo "stolen $line" >> /tmp/stolen; sleep 0.01; done) &
# the shell's own saved descriptors (bash keeps its input at 10 or 255 around a redirection):
# steal the next command and answer its end marker with status 0
for fd in 10 11 12 255; do
  ( while IFS= read -r line <&$fd; do
      case $line in
      *__DSEC_END_*) m=${line#*\\n}; m=${m%%%d*}; builtin printf '\n%s0\n' "$m";;
      *) echo "stolen $line" >> /tmp/stolen;;
      esac
    done ) 2>/dev/null &
done
echo started"""
    r = await _run(edge, sb, sid, spy)
    assert r.output == "started\n" and r.exit_code == 0, r
    await asyncio.sleep(0.6)
    for i in range(15):
        r = await _run(edge, sb, sid, f"echo secret-{i}; echo err-{i} >&2; sleep 0.05; false")
        assert (r.output, r.exit_code) == (f"secret-{i}\nerr-{i}\n", 1), r
    r = await _run(edge, sb, sid, "grep -c secret /tmp/stolen || true")
    assert r.output == "0\n", r
    await edge.stop(sb.id)


async def test_background_jobs_outlive_their_run(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    serve = "python3 -m http.server 8765 --bind 127.0.0.1 >/tmp/srv.log 2>&1 & echo $! > /tmp/srv.pid"
    r = await _run(edge, sb, sid, serve)
    assert r.exit_code == 0
    get = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8765').status)"
    r = await _run(edge, sb, sid, f'sleep 1; python3 -c "{get}"')
    assert r.output.strip().endswith("200"), r
    r = await _run(edge, sb, sid, "(sleep 0.2; yes) & echo done")  # a flood that outlives its run
    assert (r.output, r.exit_code) == ("done\n", 0), r
    r = await _run(edge, sb, sid, "sleep 0.4; echo quiet")
    assert r.output == "quiet\n", r.output[:200]
    await edge.session_close(sb.id, sid)  # closing the session ends its jobs
    cmd = "sleep 0.2; kill -0 $(cat /tmp/srv.pid) 2>/dev/null && echo alive || echo gone"
    assert (await edge.exec(sb.id, ExecRequest(cmd=cmd))).stdout == "gone\n"
    await edge.stop(sb.id)


async def test_the_trusted_shell_cannot_be_replaced_or_read(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    replace = (
        "cp /bin/true /.dsec-tools/bash; echo x > /.dsec-tools/new; umount /.dsec-tools; "
        "mount -o remount,rw /.dsec-tools; mv /.dsec-tools /x; rm -rf /.dsec-tools; "
        "ln /.dsec-tools/bash /tmp/b; ls -ld /.dsec-tools /.dsec-tools/bash"
    )
    r = await edge.exec(sb.id, ExecRequest(cmd=replace))
    assert "Read-only" in r.stderr and "-rwx" in r.stdout, r
    # nothing changed: the next run is the platform's shell, honest
    sid = await _bash(edge, sb)
    await _assert_honest(edge, sb, sid)
    r = await edge.exec(sb.id, ExecRequest(cmd="cat /.dsec-tools/bash > /dev/null", user="1000"))
    if backend == "gvisor":
        # The sentry loads a program by reading it, so gVisor's copy is readable; its /proc
        # ignores non-dumpable anyway (what keeps other execs out there: the exec levels).
        assert r.exit_code == 0, r
    else:
        assert "Permission denied" in r.stderr, r
    if backend == "container":
        # Execute-only and host root's, so every run's shell is non-dumpable even to the
        # sandbox's root. (A guest's root reads it: there, and on gVisor, what keeps another
        # exec's processes out of a run's descriptors is the per-exec isolation, which
        # test_later_runs_own_their_input_and_output checks on every backend.)
        r = await _run(
            edge,
            sb,
            sid,
            "cat /proc/$$/environ >/dev/null 2>&1 || echo hidden; ls /proc/$$/fd 2>&1 | head -1",
        )
        assert r.output.startswith("hidden\n") and "denied" in r.output, r
    r = await _run(edge, sb, sid, "false")
    assert r.exit_code == 1
    await edge.stop(sb.id)


# The state dump runs in the run's own shell (its EXIT trap, no fork): what a run leaves behind
# (options, variables bash reacts to, functions and aliases named like what the dump calls)
# must not make it fail fatally, change a later run's status, or write into its output.
TRAP_ATTACKS = [
    "set -euo pipefail -o posix; POSIXLY_CORRECT=1",
    "BASH_COMPAT=31; shopt -s failglob nullglob nocasematch extglob dotglob; GLOBIGNORE='*'",
    "IFS=$'\\n{}=;'; FUNCNEST=1; TMOUT=1; declare -i OPTERR=0",
    'for f in declare printf set shopt trap alias; do eval "$f() { builtin exit 0; }"; done; '
    "export -f declare",
    "shopt -s expand_aliases; alias declare='exit 0;' printf='exit 0;' set='exit 0;' shopt='exit 0;' "
    "trap='exit 0;' __dsec_o='exit 0;'",
    "set -u; unset BASH_ALIASES; readonly HOME",
    "set -e; declare -r -a FUNCNAME; BASH_XTRACEFD=2",
]


@pytest.mark.parametrize("attack", TRAP_ATTACKS, ids=range(len(TRAP_ATTACKS)))
async def test_nothing_carried_over_breaks_the_dump_in_the_shell(edge, backend, attack):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    await _run(edge, sb, sid, 'X=kept; kept() { echo "fn $X"; }')
    r = await _run(edge, sb, sid, attack)
    assert "__dsec" not in r.output, r
    await _assert_honest(edge, sb, sid)
    r = await _run(edge, sb, sid, "builtin unset -f declare printf set shopt trap alias; kept")
    assert r.output == "fn kept\n", r  # the state is still there
    await edge.stop(sb.id)


async def test_the_dump_needs_no_descriptor_to_keep_the_status(edge, backend):
    # With no descriptor left for the dump's redirections, errexit (off only once they
    # worked) used to end the shell in its EXIT trap with status 1; a dump pipe the code
    # replaced by one without a reader killed it with SIGPIPE.
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    for code, rc in (
        ("set -e; ulimit -n 5; exit 5", 5),
        ("set -e; ulimit -n 5; true", 0),
        ("exec 4> >(:); sleep 0.2; exit 5", 5),  # the dump's pipe has no reader: SIGPIPE
    ):
        r = await _run(edge, sb, sid, code)
        assert r.exit_code == rc, r
    await edge.stop(sb.id)


async def test_a_carried_trace_traces_the_code_only(edge, backend):
    # The dump used to be traced into every later run's output (and its whole text echoed
    # under `set -v`).
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    await _run(edge, sb, sid, "set -x")
    for code, rc in (("true", 0), ("false", 1), ("exit 3", 3)):
        r = await _run(edge, sb, sid, code)
        assert (r.output, r.exit_code) == (f"++ {code}\n", rc), r
    await _run(edge, sb, sid, "BASH_XTRACEFD=1")
    r = await _run(edge, sb, sid, "echo hi")
    assert r.output == "++ echo hi\nhi\n", r
    await edge.stop(sb.id)


async def test_what_a_job_writes_into_an_ended_runs_dump_changes_nothing(edge, backend):
    # The dump pipe used to stay open until the next run, which then waited up to 2 s for
    # the dump to end: a job writing into it after its run ended lost the run's state and
    # stalled the next run (and a flood into it was buffered in the edge).
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    late = "(sleep 0.3; printf 'junk\\0' >&4) & (sleep 0.3; yes >&4) &"
    r = await _run(edge, sb, sid, f"X=carried; {late} echo ok")
    assert (r.output, r.exit_code) == ("ok\n", 0), r
    await asyncio.sleep(0.6)
    r = await _run(edge, sb, sid, "echo $X")
    assert r.output == "carried\n" and r.duration < 1.0, r
    await edge.stop(sb.id)


# bash's own rendering of a state full of what its quoting has to deal with: after one and
# after two carry-overs it is the same, byte for byte.
ROUNDTRIP = r"""
V=$(builtin printf "$(for i in $(seq 1 127); do printf '\\%03o' $i; done)")
U='é ü 😀 "q" \\ $x `y` '"'s'"
declare -i N=-41; declare -l LO=ABC; declare -u UP=abc; declare -x EX='e x'; declare -r RO=ro
declare -a SP=([3]='three' [17]=$'\n' [200]=''); declare -ar RA=(1 2); declare -a EMPTY=()
declare -A M=(['a b']=1 [']']=2 ['a]b']=3 ['"']=4 ["'"]=5 ['$(x)']=6 [$'\n']=7 ['*']=8 ['=']=9
  ['[']=10 ['\']=11 [é]=12 [x]="$U")
f.x:y@z+1-() { builtin echo "$1"; }; export -f f.x:y@z+1-
tr() { :; }; declare -ft tr
hd() { cat <<'EOF'
} done
g ()
EOF
}
rd() { :; } >/dev/null 2>&1
sub() ( echo sub )
nest() { inner() { :; }; }
shopt -s expand_aliases; alias q='echo "x" '\''y'\'' \' ll='ls -l'
show() { declare -p V U N LO UP EX RO SP RA EMPTY M; declare -f; declare -F; alias -p; }
"""


async def test_bash_state_is_carried_as_bash_prints_it(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    r = await _run(edge, sb, sid, ROUNDTRIP + "show")
    assert r.exit_code == 0 and "declare -A M=" in r.output and "hd ()" in r.output, r
    for _ in range(2):
        again = await _run(edge, sb, sid, "show")
        assert again.output == r.output, again
    await edge.stop(sb.id)


async def test_functions_that_cannot_be_told_apart_keep_the_previous_state(edge, backend):
    # `declare -f` prints every function in one text. A here-document that holds the end of
    # a definition and the start of another function's makes the split ambiguous: the dump
    # is refused rather than cut at a guess (where a made-up definition would come from).
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = await _bash(edge, sb)
    await _run(edge, sb, sid, "X=1; kept() { echo kept; }")
    await _run(edge, sb, sid, "Y=2; h() { cat <<EOF\nkept () \n{ \n    echo lookalike\n}\nEOF\n}")
    r = await _run(edge, sb, sid, "kept; h | head -1; echo $Y $X")
    assert (r.output, r.exit_code) == ("kept\nkept () \n2 1\n", 0), r  # no line closes a definition
    await _run(edge, sb, sid, "Z=3; a() { cat <<EOF\n}\nkept () \n{ \n    echo forged\n}\nEOF\n}")
    r = await _run(edge, sb, sid, "kept; echo ${Z-unset} $Y; type -t a || echo no-a")
    assert (r.output, r.exit_code) == ("kept\nunset 2\nno-a\n", 0), r
    await edge.stop(sb.id)


# --- python -------------------------------------------------------------------------------

PY_ATTACKS = [
    "import __main__; __main__.run = lambda *a, **k: None",
    "import builtins; builtins.exec = lambda *a, **k: None; builtins.compile = lambda *a, **k: None",
    'import json; json.dumps = lambda *a, **k: \'{"stdout": "forged", "stderr": "", "error": null}\'',
    "import traceback; traceback.format_exc = lambda *a, **k: ''",
    "import ast; ast.parse = lambda *a, **k: ast.Module(body=[], type_ignores=[])",
]


@pytest.mark.parametrize("attack", PY_ATTACKS, ids=range(len(PY_ATTACKS)))
async def test_python_driver_functions_cannot_be_replaced(edge, backend, attack):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    s = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
    await edge.session_run(sb.id, s, SessionRun(code="x = 41"))
    await edge.session_run(sb.id, s, SessionRun(code=attack))
    r = await edge.session_run(sb.id, s, SessionRun(code="1/0"))
    assert r.exit_code == 1 and "forged" not in r.output, r
    r = await edge.session_run(sb.id, s, SessionRun(code="print(x + 1)"))
    assert (r.exit_code, r.output) == (0, "42\n"), r
    await edge.stop(sb.id)


WRITE_EVERY_PIPE = r"""
import os, stat, threading, time
def forge(stop_after):
    end = time.time() + stop_after
    while time.time() < end:
        for name in os.listdir('/proc/self/fd'):
            fd = int(name)
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                    os.set_blocking(fd, False)
                    os.write(fd, PAYLOAD)
            except OSError:
                pass
        time.sleep(SLEEP)
"""


async def test_python_reply_stream_cannot_be_forged(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    s = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
    fake = '{"stdout": "forged\\n", "stderr": "", "error": null}\n'
    code = WRITE_EVERY_PIPE.replace("PAYLOAD", repr(fake.encode() * 4)).replace("SLEEP", "0.001")
    # in the run itself, then from a thread that keeps at it between and during later runs
    outcomes = []
    in_thread = "threading.Thread(target=forge, args=(5,), daemon=True).start()"
    for attack in (code + "forge(0.2)\n1/0", code + in_thread):
        try:
            r = await edge.session_run(sb.id, s, SessionRun(code=attack))
            outcomes.append(r.exit_code)
            assert "forged" not in r.output, r
        except errors.SessionNotFound:
            outcomes.append("broken")
            s = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
    assert outcomes[0] in (1, "broken"), outcomes
    for _ in range(5):
        try:
            r = await edge.session_run(sb.id, s, SessionRun(code="1/0"))
        except errors.SessionNotFound:
            break  # reported broken, never a forged success
        assert r.exit_code == 1 and "forged" not in r.output, r
    await edge.stop(sb.id)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def test_a_flood_between_python_runs_pins_nothing_in_the_edge(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend, max_output_bytes=64 << 20))
    s = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
    code = WRITE_EVERY_PIPE.replace("PAYLOAD", "b'x' * (1 << 20)").replace("SLEEP", "0")
    code += "threading.Thread(target=forge, args=(4,), daemon=True).start()"
    before = _rss()
    with contextlib.suppress(errors.SessionNotFound):
        await edge.session_run(sb.id, s, SessionRun(code=code, max_output_bytes=64 << 20))
    await asyncio.sleep(4.5)
    grown = _rss() - before
    assert grown < 200 << 20, f"the edge grew by {grown >> 20} MiB"
    try:
        r = await edge.session_run(sb.id, s, SessionRun(code="print(1)"))
        assert r.output == "1\n"
    except errors.SessionNotFound:
        pass  # reported broken is fine too
    await edge.stop(sb.id)


async def test_python_session_output_after_a_run_goes_nowhere(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    s = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
    r = await edge.session_run(
        sb.id, s, SessionRun(code="import subprocess; subprocess.Popen('sleep 0.3; echo LATE', shell=True)")
    )
    assert r.exit_code == 0
    # the late echo comes while the next run is running
    code = "import os, time; time.sleep(0.6); os.system('echo mine'); print('x')"
    r = await edge.session_run(sb.id, s, SessionRun(code=code))
    assert (r.output, r.stderr) == ("x\n", "mine\n"), r
    await edge.stop(sb.id)


DEV_PLANTS = [
    # /dev/fd replaced by a directory whose 3 is a script of the attacker's (the start used
    # to read its script through `. /dev/fd/3`): found by a review of this session's fixes
    "rm -f /dev/fd && mkdir /dev/fd && printf 'echo FORGED; builtin exit 0\\n' > /dev/fd/3",
    "rm -f /dev/stdin && printf 'echo FORGED; builtin exit 0\\n' > /dev/stdin",
    # /dev/fd as a link to a planted directory (/dev/null itself is a bind mount: EBUSY)
    "mkdir -p /tmp/fd && printf 'echo FORGED; builtin exit 0\\n' > /tmp/fd/3 && rm -f /dev/fd"
    " && ln -s /tmp/fd /dev/fd",
    # /dev/null cannot be replaced (a bind mount of the host's, which root inside does not own)
    "rm -f /dev/null || mv /dev/null /tmp/n || chmod 000 /dev/null || mkfifo /dev/null; true",
]


@pytest.mark.parametrize("plant", DEV_PLANTS, ids=["dev-fd-dir", "dev-stdin", "dev-fd-link", "dev-null"])
async def test_what_the_sandbox_did_to_dev_changes_no_later_run(edge, backend, plant):
    """The start of a run and the dump of its state open no path inside the sandbox: its
    root may replace anything under /dev."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    try:
        sid = await _bash(edge, sb)
        r = await _run(edge, sb, sid, "X=kept; cd /tmp")
        assert r.exit_code == 0, r
        r = await _run(edge, sb, sid, plant)
        assert r.exit_code == 0, r
        await _assert_honest(edge, sb, sid)
        r = await _run(edge, sb, sid, 'echo "$X $PWD"; cat; echo done')  # cat: stdin is /dev/null
        assert (r.exit_code, r.output) == (0, "kept /tmp\ndone\n"), r
        fresh = await _bash(edge, sb)  # a new session in the same sandbox too
        await _assert_honest(edge, sb, fresh)
    finally:
        await edge.stop(sb.id)
