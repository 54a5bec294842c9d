"""What one exec leaves running must not forge a later exec's result (issue #11's rule,
found broken for plain execs by the microVM attack review, issue #13, and for signals and
environments by issue #25): every process the init starts gets a Landlock domain of its own
(native/dsec-child.h), and sibling domains cannot ptrace-access each other, so neither
/proc/<pid>/mem nor /proc/<pid>/fd of a later exec opens; and each exec runs at a level above
everything still running (native/dsec-landlock.h, dsec-levels.h), out of its reach. On every
backend (gVisor's kernel has no Landlock: there a later exec is out of an earlier one's sight,
in a PID namespace of its own)."""

from __future__ import annotations

import pytest

from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def _forgery_target(edge, backend):
    return await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=256))


async def _ok(edge, sid, cmd):
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=30))
    assert r.exit_code == 0, r


async def _sh(edge, sid, cmd, timeout=30):
    return await edge.exec(sid, ExecRequest(cmd=cmd, timeout=timeout))


async def test_a_background_process_cannot_rewrite_a_later_execs_memory(edge, backend):
    """A process left running by one exec tries to rewrite, through /proc/<pid>/mem, the
    memory of a later exec (the grader) of the same uid, to make its output and exit status
    the attacker's. (ptrace and process_vm_writev are denied by seccomp; /proc/<pid>/mem
    needs only ptrace's access check, which each exec's own Landlock domain fails.)"""
    sb = await _forgery_target(edge, backend)
    attack = r"""
import os, re, time
want = b"VERDICT:" + b"FA" + b"IL"
me = os.getpid()
end = time.time() + 20
done = set()
while time.time() < end:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me or p in done:
            continue
        try:
            maps = open(f"/proc/{p}/maps").read().splitlines()
            mem = os.open(f"/proc/{p}/mem", os.O_RDWR)
        except OSError:
            continue
        hit = False
        for m in maps:
            a, perms = m.split()[:2]
            if not perms.startswith("rw"):
                continue
            lo, hi = (int(x, 16) for x in a.split("-"))
            try:
                data = os.pread(mem, hi - lo, lo)
            except OSError:
                continue
            for x in re.finditer(re.escape(want), data):
                os.pwrite(mem, b"VERDICT:PASS", lo + x.start())
                hit = True
        os.close(mem)
        if hit:
            done.add(p)
    time.sleep(0.05)
"""
    await edge.write_file(sb.id, "/tmp/attack.py", attack.encode())
    await _ok(edge, sb.id, "nohup python3 /tmp/attack.py >/dev/null 2>&1 &")
    grader = (
        "python3 -c \"import sys, time; v = bytearray(b'VERDICT:' + b'FAIL'); time.sleep(5); "
        "print(v.decode()); sys.exit(0 if v.endswith(b'PASS') else 1)\""
    )
    r = await _sh(edge, sb.id, grader)
    assert (r.stdout, r.exit_code) == ("VERDICT:FAIL\n", 1), r


async def test_a_background_process_cannot_write_into_a_later_execs_output(edge, backend):
    """A process left running by one exec tries to open /proc/<pid>/fd/1 of a later exec's
    process (same uid, dumpable) and write into that exec's stdout pipe."""
    sb = await _forgery_target(edge, backend)
    attack = (
        "for i in $(seq 400); do for p in /proc/[0-9]*; do "
        '[ "$(cat $p/comm 2>/dev/null)" = sleep ] && echo FORGED > $p/fd/1 2>/dev/null && exit 0; '
        "done; sleep 0.05; done"
    )
    await edge.write_file(sb.id, "/tmp/attack.sh", attack.encode())
    await _ok(edge, sb.id, "nohup sh /tmp/attack.sh >/dev/null 2>&1 &")
    r = await _sh(edge, sb.id, "sleep 4; echo real")
    assert r.stdout == "real\n", r


async def test_the_domain_changes_no_file_semantics(edge, backend):
    """The per-exec domain restricts nothing a program does with files: hard links and
    renames across directories (which a domain not handling REFER would refuse, EXDEV)."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=256))
    r = await _sh(
        edge,
        sb.id,
        "mkdir -p /work/a /work/b && echo x > /work/a/f && ln /work/a/f /work/b/hard && "
        'python3 -c \'import os; os.rename("/work/a/f", "/work/b/moved")\' && '
        "cat /work/b/moved /work/b/hard",
    )
    assert (r.exit_code, r.stdout) == (0, "x\nx\n"), r


# --- signals and environments: a later exec out of an earlier one's reach ------------------
# What an exec leaves running is in a deeper "level" than every later exec (native/dsec-levels.h):
# a Landlock domain with signal scoping on containers, a PID namespace (with its own /proc)
# in gVisor and in a microVM's guest. A deeper level cannot signal, and in a PID namespace
# cannot even see, a shallower one; a later exec still reaches what earlier ones left.

_HUNT = r"""
import os, signal, sys, time
mark, what, out = sys.argv[1][::-1], sys.argv[2], sys.argv[3]  # (not in its own command line)
me, seen, done = os.getpid(), set(), set()
end = time.time() + 25
while time.time() < end:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me or p in done:
            continue
        try:
            if mark.encode() not in open(f"/proc/{p}/cmdline", "rb").read():
                continue
        except OSError:
            continue
        seen.add(p)
        try:
            if what == "environ":
                data = open(f"/proc/{p}/environ", "rb").read()
                open(out, "ab").write(b"STOLE " + data.replace(b"\0", b" ") + b"\n")
            else:  # kill, kill-1
                for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGKILL):
                    os.kill(int(p), sig)
                open(out, "a").write(f"KILLED {p}\n")
            done.add(p)
        except OSError as e:
            open(out, "a").write(f"REFUSED {p} {e.errno}\n")
            done.add(p)
    if what == "kill-1":
        try:
            os.kill(-1, signal.SIGUSR1)  # everything this process may signal (never itself)
        except OSError:
            pass
    time.sleep(0.02)
"""


async def _hunter(edge, sid, mark, what, out):
    """Exec: leave a process running that hunts for a later exec whose command line holds
    `mark` (to kill it, or to read its environment), reporting into `out`."""
    await edge.write_file(sid, "/tmp/hunt.py", _HUNT.encode())
    await _ok(edge, sid, f"nohup python3 /tmp/hunt.py {mark[::-1]} {what} {out} >/dev/null 2>&1 &")


async def test_a_background_process_cannot_kill_a_later_exec(edge, backend):
    """The known gap of every backend until now: a process left by one exec killed a later
    exec (the grader) with a signal of its choice, so the platform reported 128+N (here
    SIGUSR1: 138) for a grader that would have exited 3. The grader must run to its end."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=256))
    await _hunter(edge, sb.id, "GRADER-MARK", "kill-1", "/tmp/hunt.log")
    r = await _sh(edge, sb.id, "sleep 4; echo graded; exit 3 # GRADER-MARK")
    log = (await _sh(edge, sb.id, "cat /tmp/hunt.log 2>/dev/null; true")).stdout
    assert (r.exit_code, r.stdout) == (3, "graded\n"), (r, log)
    assert "KILLED" not in log, log


async def test_a_background_process_cannot_read_a_later_execs_environment(edge, backend):
    """Secrets passed to a later exec in `env` are out of reach of what an earlier exec left
    running (gVisor, which has no Landlock, let it read /proc/<pid>/environ)."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=256))
    await _hunter(edge, sb.id, "ENV-MARK", "environ", "/tmp/hunt.log")
    secret = "s3cr3t-" + "x" * 8
    grader = ExecRequest(cmd="sleep 4; echo done # ENV-MARK", env={"TOKEN": secret}, timeout=30)
    r = await edge.exec(sb.id, grader)
    assert r.exit_code == 0, r
    log = (await _sh(edge, sb.id, "cat /tmp/hunt.log 2>/dev/null; true")).stdout
    assert secret not in log, log


async def test_a_later_exec_still_kills_what_earlier_execs_left(edge, backend):
    """What users rely on: a server started in the background by one exec is stopped by a
    later one (`pkill -f`), across several execs that each left a process running."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=256))
    for i in range(3):
        server = f"python3 -c 'import time; time.sleep(600)' srv-{i}-MARK"
        await _ok(edge, sb.id, f"nohup {server} >/dev/null 2>&1 &")
    r = await _sh(edge, sb.id, "pgrep -f 'srv-[0-9]-MARK' | wc -l")
    assert r.stdout.strip() == "3", r
    r = await _sh(edge, sb.id, "pkill -f 'srv-[0-9]-MARK'; echo rc=$?")
    assert r.stdout == "rc=0\n", r
    r = await _sh(edge, sb.id, "sleep 0.2; pgrep -f 'srv-[0-9]-MARK'; echo rc=$?")
    assert r.stdout == "rc=1\n", r
    # and one exec's own background job
    r = await _sh(edge, sb.id, "sleep 600 & p=$!; kill $p; wait $p; echo rc=$?")
    assert r.stdout == "rc=143\n", r


async def test_many_generations_of_background_killers_do_not_reach_the_grader(edge, backend):
    """An agent that leaves a killer behind in exec after exec (more of them than there are
    levels) still cannot reach the grader: past the last level a new, separate set of levels
    begins, out of reach of everything before it."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=512))
    await edge.write_file(sb.id, "/tmp/hunt.py", _HUNT.encode())
    for i in range(10):  # (the first also signals everything it may: kill -1)
        hunter = f"python3 /tmp/hunt.py KRAM-REDARG {'kill-1' if i == 0 else 'kill'} /tmp/hunt{i}.log"
        await _ok(edge, sb.id, f"nohup {hunter} >/dev/null 2>&1 &")
    r = await _sh(edge, sb.id, "sleep 4; echo graded; exit 3 # GRADER-MARK")
    log = (await _sh(edge, sb.id, "cat /tmp/hunt*.log 2>/dev/null; true")).stdout
    assert (r.exit_code, r.stdout) == (3, "graded\n"), (r, log)
