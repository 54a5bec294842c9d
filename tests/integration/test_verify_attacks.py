"""Forging a grader's verdict (issue #11, "verify and trusted execs use a trusted toolchain").

The agent is root in its sandbox and may rewrite every file of it before verification. A
grader (`python3 /grader/check.py`, which fails) must report its failure whatever the agent
did to the interpreter, the shell, the dynamic loader or the environment; a trojaned tar or
cp must never see the protected files; a trusted exec must not run a program the agent
added outside the task directories, and nothing the agent runs meanwhile can signal, trace
or read it. Before this, verify ran the grader with the sandbox's own binaries and brought
the protected files back with the sandbox's own tar.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec import errors
from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.isolation.cgroups import CgroupHost
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

FAIL_PY = "import sys\nprint('grading')\nsys.exit(1)\n"


async def sh(edge, sid: str, cmd: str, **kw) -> object:
    return await edge.exec(sid, ExecRequest(cmd=cmd, **kw))


async def graded_sandbox(edge, secret: str = "", backend: str = "container") -> str:
    """A sandbox whose protected grader fails (exit 1); /work/fail.py is the same script, for
    checking in the agent's own view that an attack really works there."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    grader = f"# {secret}\n{FAIL_PY}".encode()
    await edge.write_file(sb.id, "/grader/check.py", grader)
    await edge.write_file(sb.id, "/work/fail.py", FAIL_PY.encode())
    assert await edge.protect(sb.id, ["/grader"]) == ["/grader"]
    return sb.id


def evil_library(tmp: Path) -> bytes:
    """A shared library whose constructor ends the process with status 0."""
    src = tmp / "evil.c"
    src.write_text("#include <unistd.h>\n__attribute__((constructor)) static void f(void) { _exit(0); }\n")
    out = tmp / "libevil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out.read_bytes()


async def site_dirs(edge, sid: str) -> list[str]:
    r = await sh(edge, sid, "python3 -c \"import site; print('\\n'.join(site.getsitepackages()))\"")
    return [d for d in r.stdout.split() if d.startswith("/")]


async def attack_path_python(edge, sid: str, tmp: Path) -> str:
    # a python3 earlier on PATH, and the image's own one replaced too
    for p in ("/usr/local/bin/python3", "/usr/local/sbin/python3", "/usr/bin/python3"):
        await edge.write_file(sid, p, b"#!/bin/sh\nexit 0\n", 0o755)
    return "python3 /work/fail.py"


async def attack_pth(edge, sid: str, tmp: Path) -> str:
    dirs = await site_dirs(edge, sid)
    assert dirs
    for d in dirs:
        await edge.write_file(sid, f"{d}/zz-evil.pth", b"import os; os._exit(0)\n")
    return "python3 /work/fail.py"


async def attack_sitecustomize(edge, sid: str, tmp: Path) -> str:
    r = await sh(edge, sid, "python3 -c 'import os, sysconfig; print(sysconfig.get_paths()[\"stdlib\"])'")
    await edge.write_file(sid, f"{r.stdout.strip()}/sitecustomize.py", b"import os\nos._exit(0)\n")
    return "python3 /work/fail.py"


async def replace_programs(edge, sid: str, programs: dict[str, bytes]) -> None:
    """Replace programs as an agent would: each written beside itself, then all renamed over
    (a microVM's file API writes through the guest's sh, which may be one of them, busy)."""
    for path, data in programs.items():
        await edge.write_file(sid, f"{path}.new", data, 0o755)
    for path in programs:
        r = await edge.exec(sid, ExecRequest(cmd=["mv", "-f", f"{path}.new", path]))
        assert r.exit_code == 0, r


async def attack_shell_and_tar(edge, sid: str, tmp: Path) -> str:
    await replace_programs(
        edge,
        sid,
        dict.fromkeys(("/usr/bin/tar", "/usr/bin/dash", "/usr/bin/sh"), b"#!/usr/bin/bash\nexit 0\n"),
    )
    return "exit 1"  # through /bin/sh -c: the replaced shell says 0


async def attack_ld_preload(edge, sid: str, tmp: Path) -> str:
    await edge.write_file(sid, "/usr/local/lib/libevil.so", evil_library(tmp), 0o755)
    await edge.write_file(sid, "/etc/ld.so.preload", b"/usr/local/lib/libevil.so\n")
    return "python3 /work/fail.py"


async def attack_login_environment(edge, sid: str, tmp: Path) -> str:
    await edge.write_file(sid, "/opt/evil/sitecustomize.py", b"import os\nos._exit(0)\n")
    env = b"export PYTHONPATH=/opt/evil\n"
    for p in ("/etc/profile.d/evil.sh", "/root/.profile", "/root/.bashrc", "/etc/bash.bashrc"):
        await edge.write_file(sid, p, env)
    await edge.write_file(sid, "/etc/environment", b"PYTHONPATH=/opt/evil\n")
    return "bash -lc 'python3 /work/fail.py'"


ATTACKS = {
    "python3-on-path": (attack_path_python, "python3 /grader/check.py"),
    "pth-in-site-packages": (attack_pth, "python3 /grader/check.py"),
    "sitecustomize-in-stdlib": (attack_sitecustomize, "python3 /grader/check.py"),
    "replaced-sh-and-tar": (attack_shell_and_tar, "python3 /grader/check.py"),
    "ld-so-preload": (attack_ld_preload, "python3 /grader/check.py"),
    "profile-and-environment": (attack_login_environment, "bash -lc 'python3 /grader/check.py'"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_a_failing_grader_fails_whatever_the_agent_changed(edge, backend, tmp_path, name):
    attack, grader_cmd = ATTACKS[name]
    sid = await graded_sandbox(edge, backend=backend)
    probe = await attack(edge, sid, tmp_path)
    # The attack is real: in the agent's own view, the failing script now "passes".
    assert (await sh(edge, sid, probe)).exit_code == 0
    r = await edge.verify(sid, ExecRequest(cmd=grader_cmd))
    assert r.exit_code == 1, r
    assert r.stdout == "grading\n"
    # the same for a trusted exec of the agent's copy of the script, without verify
    r = await edge.exec(sid, ExecRequest(cmd=probe, trusted=True))
    assert r.exit_code == 1 and r.stdout == ("grading\n" if "fail.py" in probe else "")
    await edge.stop(sid)


async def _holds(edge, sid: str, needle: bytes) -> list[str]:
    """Files the agent wrote whose content holds `needle`: its writable layer read on the host
    (a container's), or found by its own grep where it writes (gVisor's, a microVM's)."""
    if edge.sandboxes[sid].backend.name == "container":
        return _upper_holds(edge, sid, needle)
    skip = [f"--exclude-dir={d}" for d in ("proc", "sys", "dev", "usr", "etc")]
    r = await edge.exec(sid, ExecRequest(cmd=["grep", "-rlsF", needle.decode(), "/", *skip], timeout=300))
    assert r.exit_code in (0, 1), r
    return r.stdout.split()


def _upper_holds(edge, sid: str, needle: bytes) -> list[str]:
    """Files of the sandbox's writable layer (read on the host) whose content holds `needle`."""
    hits = []
    upper = edge.sandboxes[sid].handle.upper
    for dirpath, _, files in os.walk(upper):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                if os.path.isfile(p) and not os.path.islink(p):
                    with open(p, "rb") as f:
                        if needle in f.read():
                            hits.append(p)
            except OSError:
                continue
    return hits


TROJAN = """#!/usr/bin/bash
# Copy out whatever passes through: stdin (an archive), every file argument, the grader.
/usr/bin/cat > /tmp/.loot-{name} 2>/dev/null
/usr/bin/cp.real /tmp/.loot-{name} /work/leak-{name} 2>/dev/null
for a in "$@"; do /usr/bin/cat "$a" >> /work/leak-{name} 2>/dev/null; done
/usr/bin/cat /grader/* >> /work/leak-{name} 2>/dev/null
setsid nohup bash -c 'for i in $(seq 100); do cat /grader/* >> /work/late-{name} 2>/dev/null; \\
  sleep 0.05; done' >/dev/null 2>&1 &
exec /usr/bin/{name}.real "$@" < /tmp/.loot-{name}
"""


async def test_trojaned_tar_and_cp_never_see_the_protected_files(edge, backend):
    secret = f"SECRET-{secrets.token_hex(8)}"
    sid = await graded_sandbox(edge, secret, backend)
    assert not await _holds(edge, sid, secret.encode())  # protected: gone from the sandbox
    tools = ("tar", "cp", "sh", "dash")
    await sh(edge, sid, " && ".join(f"cp -a /usr/bin/{t} /usr/bin/{t}.real" for t in tools))
    await replace_programs(edge, sid, {f"/usr/bin/{t}": TROJAN.format(name=t).encode() for t in tools})
    # and a lurker started before verification, waiting for the grader to appear
    await sh(
        edge,
        sid,
        "setsid nohup bash -c 'while :; do cat /grader/check.py >> /work/stolen 2>/dev/null; "
        "sleep 0.01; done' >/dev/null 2>&1 &",
    )
    await asyncio.sleep(0.2)
    r = await edge.verify(sid, ExecRequest(cmd="cat /grader/check.py; python3 /grader/check.py"))
    assert r.exit_code == 1 and secret in r.stdout  # the grader had its files
    await asyncio.sleep(0.5)  # a background copy, had one started, would be writing by now
    assert not await _holds(edge, sid, secret.encode())
    for leftover in ["stolen", *(f"{kind}-{tool}" for tool in tools for kind in ("leak", "late"))]:
        with contextlib.suppress(errors.FileNotFound):
            assert secret.encode() not in await edge.read_file(sid, f"/work/{leftover}")
    if backend == "container":  # nothing of the agent (or of the verifier) lives on: only its init
        assert edge.cgroups.procs(sid) == [edge.sandboxes[sid].handle.pid]
    assert _others(edge, backend, sid) == []
    await edge.stop(sid)


async def test_the_grader_grades_the_agents_work_and_only_that(edge, backend):
    sid = await graded_sandbox(edge, backend=backend)
    await edge.write_file(
        sid,
        "/grader2/check.py",
        b"import os, sys\n"
        b"print(open('/work/answer.txt').read().strip())\n"
        b"print(os.path.exists('/srv/planted'), os.path.exists('/data/input.txt'))\n"
        b"sys.exit(0 if open('/work/answer.txt').read().strip() == '42' else 1)\n",
    )
    assert await edge.protect(sid, ["/grader2"]) == ["/grader2"]
    await sh(edge, sid, "mkdir -p /data /srv && echo 42 > /work/answer.txt && echo x > /data/input.txt")
    await sh(edge, sid, "echo planted > /srv/planted")
    r = await edge.verify(sid, ExecRequest(cmd="python3 /grader2/check.py"))
    assert (r.exit_code, r.stdout) == (0, "42\nFalse False\n")  # /srv, /data: not task dirs
    r = await edge.verify(sid, ExecRequest(cmd="python3 /grader2/check.py", task_dirs=["/work", "/data"]))
    assert (r.exit_code, r.stdout) == (0, "42\nFalse True\n")
    await sh(edge, sid, "echo 41 > /work/answer.txt")
    r = await edge.verify(sid, ExecRequest(cmd="python3 /grader2/check.py"))
    assert (r.exit_code, r.stdout) == (1, "41\nFalse False\n")
    # the grader runs as the platform's uid, in a fresh /tmp, with a clean environment
    r = await edge.verify(sid, ExecRequest(cmd="id -u; ls -A /tmp; env | sort", env={"GRADE": "1"}))
    lines = r.stdout.split()
    assert lines[0] == "65533" and "GRADE=1" in lines and "HOME=/tmp" in lines
    assert not any(x.startswith(("HOSTNAME=", "PYTHON")) for x in lines)
    await edge.stop(sid)


async def test_a_program_only_the_agent_wrote_does_not_run_trusted(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    await edge.write_file(sb.id, "/usr/local/bin/mytool", b"#!/bin/sh\necho agent tool\nexit 0\n", 0o755)
    await edge.write_file(sb.id, "/work/tool.sh", b"#!/bin/sh\necho from work\nexit 5\n", 0o755)
    assert (await sh(edge, sb.id, "mytool")).exit_code == 0  # there for the agent
    r = await edge.exec(sb.id, ExecRequest(cmd=["mytool"], trusted=True))
    assert r.exit_code == 127 and "agent tool" not in r.stdout
    r = await edge.exec(sb.id, ExecRequest(cmd="mytool", trusted=True))
    assert r.exit_code == 127
    r = await edge.exec(sb.id, ExecRequest(cmd="/usr/local/bin/mytool", trusted=True))
    assert r.exit_code == 127
    # the task directory is the agent's: what the caller runs from there runs (the image's sh)
    r = await edge.exec(sb.id, ExecRequest(cmd="/work/tool.sh", trusted=True))
    assert (r.exit_code, r.stdout) == (5, "from work\n")
    await edge.stop(sb.id)


async def test_an_agent_sees_nothing_of_a_trusted_exec_and_cannot_touch_it(edge, backend):
    """The agent's processes are frozen while a trusted exec runs (issue #25): before, a
    background process read the grader's command line (and the helper's: every host path)
    from /proc while it ran. (On gVisor and in a microVM the command runs in a sandbox of
    its own: the agent runs on and sees nothing of it either.)"""
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    marker, secret = f"mark{secrets.token_hex(4)}", f"s3cr3t{secrets.token_hex(4)}"
    # The agent (root, CAP_KILL, CAP_SETUID) logs every command line and environment it can
    # read, and kills whatever carries the marker.
    hunter = (
        "while :; do for d in /proc/[0-9]*; do p=${d#/proc/}; [ $p = $$ ] && continue; "
        "tr '\\0' ' ' < $d/cmdline >> /work/seen 2>/dev/null; echo >> /work/seen; "
        "cat $d/environ >> /work/seen 2>/dev/null; "
        f"grep -q {marker} $d/cmdline 2>/dev/null || continue; "
        "echo $p >> /work/found; kill -9 $p 2>> /work/found; done; sleep 0.02; done"
    )
    await edge.write_file(sb.id, "/work/hunter.sh", hunter.encode(), 0o755)
    await sh(edge, sb.id, "setsid nohup sh /work/hunter.sh >/dev/null 2>&1 &")
    await sh(edge, sb.id, "for i in $(seq 1000); do [ -s /work/seen ] && break; sleep 0.01; done")
    r = await edge.exec(
        sb.id,
        ExecRequest(
            cmd=["sh", "-c", "sleep 1; echo survived; exit 3", marker],
            env={"TRUSTED_SECRET": secret},
            trusted=True,
        ),
    )
    assert (r.exit_code, r.stdout) == (3, "survived\n"), r
    # the hunter lives on (frozen, not killed) and saw nothing of it
    r = await sh(
        edge,
        sb.id,
        "n=$(wc -c < /work/seen); for i in $(seq 1000); do "
        "[ $(wc -c < /work/seen) -gt $n ] && echo on && break; sleep 0.01; done",
    )
    assert r.stdout == "on\n"
    seen = await edge.read_file(sb.id, "/work/seen")
    for leak in (marker, secret, "TRUSTED_SECRET", "dsec-trusted", "--lower", str(edge.settings.data_dir)):
        assert leak.encode() not in seen, leak
    with pytest.raises(errors.FileNotFound):
        await edge.read_file(sb.id, "/work/found")
    await edge.stop(sb.id)


def _others(edge, backend: str, sandbox_id: str) -> list[str]:
    """Sandboxes the edge still has besides `sandbox_id`: where a trusted command runs in a
    sandbox of its own (gVisor, a microVM), it must be gone once the command ended."""
    others = set(edge.backends[backend].leftover_ids()) - {sandbox_id}
    others |= {c for c in edge.cgroups.listed_sandboxes() if c.startswith(f"{edge.name}-")} - {sandbox_id}
    return sorted(others | set(edge.life.in_progress()))


def _helpers_of(pid: int) -> list[Path]:
    """/proc of the dsec-trusted helpers this process started."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (d / "stat").read_text()
                if (
                    stat.split("(", 1)[1].startswith("dsec-trusted")
                    and int(stat.rsplit(")", 1)[1].split()[1]) == pid
                ):
                    out.append(d)
    return out


async def test_a_trusted_command_travels_in_a_descriptor_and_new_execs_wait_for_it(edge):
    """The helper's argv and environ (which its child shares in the sandbox's pid namespace
    until it execs) hold none of the command, its env or the host's paths; an exec started
    while a trusted one runs waits for it (it would see it otherwise)."""
    sb = await edge.create(SandboxSpec(image="python"))
    marker, secret = f"mark{secrets.token_hex(4)}", f"s3cr3t{secrets.token_hex(4)}"
    req = ExecRequest(
        cmd=["sh", "-c", "echo ready; sleep 1; echo done", marker],
        env={"TRUSTED_SECRET": secret},
        trusted=True,
    )
    look = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
    other = None
    out = b""
    async for kind, item in edge.exec_stream(sb.id, req):
        if kind == "stdout" and isinstance(item, bytes):
            out += item
            if other is None:  # the command runs: its helper is alive
                helpers = _helpers_of(os.getpid())
                assert helpers
                for h in helpers:
                    shown = (h / "cmdline").read_bytes() + (h / "environ").read_bytes()
                    for leak in (marker, secret, "--lower", "--protect", str(edge.settings.edge_run_dir)):
                        assert leak.encode() not in shown, (leak, shown)
                    assert (h / "environ").read_bytes() == b""
                other = asyncio.ensure_future(sh(edge, sb.id, look))
    assert out == b"ready\ndone\n"
    assert other is not None
    r = await other
    assert r.exit_code == 0 and marker not in r.stdout, r.stdout
    await edge.stop(sb.id)


FILL = (
    "mkdir -m 777 /work/w; head -c 100000000 /dev/zero > /work/fill; "
    "head -c 16000000 /dev/zero > /dev/shm/fill; "
    "cd /work && i=0; while : > n$i; do i=$((i+1)); done; true"
)
GRADER = (
    "import subprocess\n"
    "b = bytearray(32 << 20)\n"
    "print(subprocess.run(['echo', 'forked'], capture_output=True, text=True).stdout.strip())\n"
    "for f in ('/tmp/out', '/work/w/out'):\n"
    "    open(f, 'w').write('x' * 100000)\n"
    "    print(len(open(f).read()))\n"
)


async def test_an_agent_that_used_up_its_sandbox_cannot_keep_a_grader_from_running(edge, backend):
    """Disk, inodes, pids and memory (its tmpfs pages stay charged when it dies) all used up
    by the agent: the grader still runs, with room of its own (issue #25). Before, verify made
    the protected paths' mount points in the agent's full layer and failed, and a trusted
    exec ran out of pids and memory in the sandbox's cgroup. (On gVisor and in a microVM
    the grader's sandbox is its own; a microVM's task files leave through the agent's own
    archiver, outside the user's cgroup: the pids the agent holds do not stop it.)"""
    # (gVisor's memory limit is its sentry's: an agent that fills it ends its own sandbox)
    memory = 256 if backend == "gvisor" else 64
    sb = await edge.create(
        SandboxSpec(
            image="python", backend=backend, disk_mb=32, disk_inodes=1024, memory_mb=memory, pids=32,
            storage="memory",  # (the tmpfs upper: its pages charged to the agent's memory)
        )
    )
    await edge.write_file(sb.id, "/work/tests/check.py", FAIL_PY.encode())
    assert await edge.protect(sb.id, ["/work/tests"]) == ["/work/tests"]
    r = await sh(edge, sb.id, FILL)
    assert "No space left on device" in r.stderr, r
    # every pid the agent may have, held by processes of another session (they outlive the call)
    await sh(edge, sb.id, "setsid sh -c 'while :; do sleep 1000 & done' >/dev/null 2>&1 </dev/null; true")
    if backend != "microvm":  # (its ext4 needs a block for the directory's entries: full first)
        assert edge.get(sb.id).telemetry["disk_used_inodes"] >= 1000
    r = await edge.exec(sb.id, ExecRequest(cmd=["python3", "-c", GRADER], trusted=True))
    assert (r.exit_code, r.stdout) == (0, "forked\n100000\n100000\n"), r
    with pytest.raises(errors.FileNotFound):  # its writes were its own
        await edge.read_file(sb.id, "/work/w/out")
    r = await edge.verify(
        sb.id, ExecRequest(cmd="python3 -c 'b = bytearray(32 << 20)' && python3 /work/tests/check.py")
    )
    assert (r.exit_code, r.stdout) == (1, "grading\n"), r
    with pytest.raises(errors.FileNotFound):  # and the agent's tree was never touched
        await edge.read_file(sb.id, "/work/tests/check.py")
    await edge.stop(sb.id)


async def test_a_grader_that_cannot_run_is_an_environment_fault(edge, backend):
    """When the platform cannot run the grader (here: its vault copy is gone from the host),
    the call fails with `grader_unavailable`, never an exit code a trainer would score."""
    sid = await graded_sandbox(edge, backend=backend)
    shutil.rmtree(edge._vault(sid) / "t0")
    with pytest.raises(errors.GraderUnavailable) as e:
        await edge.verify(sid, ExecRequest(cmd="python3 /grader/check.py"))
    assert (e.value.code, e.value.status) == ("grader_unavailable", 503)
    assert "could not be set up" in e.value.message
    # nothing stays frozen or behind
    assert (await sh(edge, sid, "echo alive")).stdout == "alive\n"
    trusted_dirs = [h / "dsec-trusted" / sid for h in edge.cgroups.hierarchies()]
    assert not [g for d in trusted_dirs if d.exists() for g in d.iterdir() if g.is_dir()]
    assert _others(edge, backend, sid) == []
    await edge.stop(sid)
    await edge.close()  # (the teardown runs in the background)
    assert not any(d.exists() for d in trusted_dirs)


async def test_protected_tests_inside_work_beat_a_planted_symlink(edge, backend):
    secret = f"SECRET-{secrets.token_hex(8)}"
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    await edge.write_file(sb.id, "/work/tests/check.py", f"# {secret}\n{FAIL_PY}".encode())
    await edge.write_file(sb.id, "/work/tests/data/expected", b"42\n")
    assert await edge.protect(sb.id, ["/work/tests"]) == ["/work/tests"]
    assert (await sh(edge, sb.id, "ls /work/tests")).exit_code != 0
    await edge.write_file(sb.id, "/tmp/fake/check.py", b"print('fake')\n")
    for attack in (
        "ln -s /tmp/fake /work/tests",
        "mkdir -p /work/tests && cp /tmp/fake/check.py /work/tests/",
    ):
        await sh(edge, sb.id, f"rm -rf /work/tests; {attack}")
        r = await edge.verify(
            sb.id, ExecRequest(cmd="python3 /work/tests/check.py; echo rc=$?; cat /work/tests/data/expected")
        )
        assert r.stdout == "grading\nrc=1\n42\n", r
        # the agent's tree is left as the agent made it: the grader's mount points are its own
        assert (await sh(edge, sb.id, "cat /work/tests/check.py")).stdout == "print('fake')\n"
        assert not await _holds(edge, sb.id, secret.encode())
    await edge.stop(sb.id)


async def test_timeouts_and_caps_kill_the_whole_trusted_tree_and_nothing_is_left(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    sid = sb.id
    r = await edge.exec(
        sid, ExecRequest(cmd="(sleep 300 &) ; setsid sleep 301 & sleep 302", timeout=1, trusted=True)
    )
    assert r.timed_out and r.exit_code == 137 and r.duration < 8
    r = await edge.exec(sid, ExecRequest(cmd="yes", max_output_bytes=1000, timeout=30, trusted=True))
    assert r.truncated and not r.timed_out and len(r.stdout) <= 1000
    r = await edge.exec(sid, ExecRequest(cmd="setsid sleep 303 & echo started", trusted=True))
    assert r.stdout == "started\n"  # what it left in the background went with it
    await edge.verify(sid, ExecRequest(cmd="true"))
    assert _others(edge, backend, sid) == []  # (a trusted command's own sandbox: gone with it)
    if backend != "container":
        await edge.stop(sid)
        return
    container = edge.sandboxes[sid].handle
    assert edge.cgroups.procs(sid) == [container.pid]
    assert [p for p in edge.cgroups.user_dir(sid).iterdir() if p.is_dir()] == []  # no exec cgroup left
    with open("/proc/self/mounts") as f:
        assert "dsec-trusted" not in f.read()
    helpers = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().startswith("dsec-trusted"):
                    helpers.append(d.name)
            except OSError:
                pass
    assert not helpers
    await edge.stop(sid)


async def test_bad_trusted_requests_are_refused_with_a_reason(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    for dirs in (["/usr/local"], ["relative"], ["/"], ["/etc"], ["/tmp/x"]):
        with pytest.raises(errors.InvalidRequest) as e:
            await edge.exec(sb.id, ExecRequest(cmd="true", trusted=True, task_dirs=dirs))
        assert "task_dirs" in e.value.message
    with pytest.raises(errors.InvalidRequest, match="trusted"):
        await edge.exec(sb.id, ExecRequest(cmd="true", task_dirs=["/work"]))
    with pytest.raises(errors.InvalidRequest, match="user"):
        await edge.exec(sb.id, ExecRequest(cmd="true", trusted=True, user="root"))
    with pytest.raises(errors.InvalidRequest, match="user"):
        await edge.verify(sb.id, ExecRequest(cmd="true", user="1000"))
    # a trusted exec is another step than the same command untrusted
    await edge.exec(sb.id, ExecRequest(cmd="echo a", step={"trajectory": "t", "index": 0}))
    with pytest.raises(errors.TrajectoryDivergence):
        await edge.exec(sb.id, ExecRequest(cmd="echo a", trusted=True, step={"trajectory": "t", "index": 0}))
    await edge.stop(sb.id)


async def test_nested_and_symlinked_protected_paths_streams_and_stdin(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    await edge.write_file(sb.id, "/opt/task/ref/answer", b"42\n")
    await edge.write_file(sb.id, "/opt/task/run.sh", b"echo run $(cat /opt/task/ref/answer)\n")
    await sh(edge, sb.id, "ln -s /opt/task/run.sh /usr/local/bin/grade")
    # inner first, then its parent, then a symlink: each comes back where it was
    assert await edge.protect(sb.id, ["/opt/task/ref"]) == ["/opt/task/ref"]
    assert await edge.protect(sb.id, ["/opt/task", "/usr/local/bin/grade"]) == [
        "/opt/task",
        "/usr/local/bin/grade",
    ]
    assert (await sh(edge, sb.id, "ls /opt/task /usr/local/bin/grade")).exit_code != 0
    r = await edge.verify(sb.id, ExecRequest(cmd="sh grade; cat /opt/task/ref/answer", cwd="/usr/local/bin"))
    assert (r.exit_code, r.stdout) == (0, "run 42\n42\n"), r
    with pytest.raises(errors.InvalidRequest, match="at most"):
        await edge.protect(sb.id, [f"/p{i}" for i in range(70)])
    # trusted execs stream and take stdin like any other
    chunks = [
        item
        async for kind, item in edge.exec_stream(
            sb.id, ExecRequest(cmd="cat; id -u", stdin="from stdin\n", trusted=True)
        )
        if kind == "stdout"
    ]
    assert b"".join(c for c in chunks if isinstance(c, bytes)) == b"from stdin\n65533\n"
    await edge.stop(sb.id)


async def test_a_vault_of_an_older_edge_is_converted(edge, backend):
    """Older edges kept protected paths as tars (built on the host from the sandbox's files)."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    await edge.write_file(sb.id, "/grader/check.py", FAIL_PY.encode())
    await edge.write_file(sb.id, "/etc/answer", b"42\n")
    vault = edge._vault(sb.id)
    vault.mkdir(parents=True, mode=0o700)
    index = []
    for n, (path, is_dir) in enumerate((("/grader", True), ("/etc/answer", False))):
        (vault / f"{n}.tar").write_bytes(await edge.download_tar(sb.id, path))
        index.append({"path": path, "dir": is_dir, "blob": f"{n}.tar"})
        await edge.delete_file(sb.id, path, recursive=True)
    (vault / "index.json").write_text(json.dumps(index))
    r = await edge.verify(sb.id, ExecRequest(cmd="cat /etc/answer; python3 /grader/check.py"))
    assert (r.exit_code, r.stdout) == (1, "42\ngrading\n"), r
    await edge.stop(sb.id)


async def test_a_grader_run_as_a_module_does_not_import_the_agents_files(edge, backend) -> None:
    """`python3 -m unittest` puts its cwd first on sys.path: with the agent's /work as the
    trusted exec's cwd, a /work/unittest/__main__.py (or a unittest.py) replaced the standard
    library's unittest and the failing tests passed. Found by a review of this session's fixes."""
    sb = await edge.create(SandboxSpec(image="python", workdir="/work", backend=backend))
    try:
        test = "import unittest\nclass T(unittest.TestCase):\n    def test_x(self):\n        self.fail('n')\n"
        await edge.write_file(sb.id, "/grader/test_g.py", test.encode())
        assert await edge.protect(sb.id, ["/grader"]) == ["/grader"]
        forged = b"import sys\nprint('OK (forged)')\nsys.exit(0)\n"
        await edge.write_file(sb.id, "/work/unittest/__main__.py", forged)
        await edge.write_file(sb.id, "/work/unittest/__init__.py", b"")
        await edge.write_file(sb.id, "/work/pytest.py", forged)
        cmd = "python3 -m unittest discover -s /grader -p 'test_*.py'"
        mine = await sh(edge, sb.id, cmd)  # the agent's own view: the forgery works there
        assert mine.exit_code == 0 and "forged" in mine.stdout
        await edge.write_file(sb.id, "/work/tests/test_w.py", test.encode())
        work_cmd = "python3 -m unittest discover -s /work/tests -p 'test_*.py'"
        for run in (
            edge.verify(sb.id, ExecRequest(cmd=cmd)),
            edge.exec(sb.id, ExecRequest(cmd=work_cmd, trusted=True)),  # no /grader outside verify
        ):
            r = await run
            assert r.exit_code == 1, (r.stdout, r.stderr)
            assert "forged" not in r.stdout + r.stderr
            assert "FAILED" in r.stderr
        r = await sh(edge, sb.id, "pwd", trusted=True)
        assert r.stdout == "/\n"
    finally:
        await edge.stop(sb.id)


KILLED_DURING_A_GRADER = textwrap.dedent(
    """
    import asyncio, json, sys
    from dsec.config import EdgeSettings
    from dsec.edge import Edge
    from dsec.models import ExecRequest, SandboxSpec

    async def main():
        edge = Edge(EdgeSettings.model_validate_json(sys.argv[1]))
        await edge.start()
        sb = await edge.create(SandboxSpec(image="python"))
        tick = "while :; do date +%s%N > /work/tick; sleep 0.01; done"
        await edge.exec(sb.id, ExecRequest(cmd=f"setsid sh -c '{tick}' >/dev/null 2>&1 &"))
        req = ExecRequest(cmd=f"echo ready; exec sleep {sys.argv[2]}", trusted=True, timeout=3000)
        async for _ in edge.exec_stream(sb.id, req):
            print(json.dumps(sb.id), flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def _running(cmdline: bytes) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if d.name.isdigit() and (d / "cmdline").read_bytes() == cmdline:
                out.append(int(d.name))
    return out


async def test_an_edge_killed_during_a_trusted_exec_leaves_nothing_frozen(edge_dirs, python_image):
    """The next edge process kills the grader the dead one left and thaws the agent."""
    settings = EdgeSettings(
        name="t" + secrets.token_hex(4), reconcile_interval_s=3600, fncall_image="", **edge_dirs
    )
    seconds = f"1000.{secrets.randbelow(10**6)}"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_DURING_A_GRADER, settings.model_dump_json(), seconds],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sid = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    grader = f"sleep\0{seconds}\0".encode()
    edge = Edge(settings)
    started = False
    try:
        assert _running(grader)
        assert CgroupHost.detect().user_frozen(sid)
        await edge.start()
        started = True
        assert not _running(grader) and not edge.cgroups.user_frozen(sid)
        r = await sh(
            edge,
            sid,
            "t=$(cat /work/tick); for i in $(seq 1000); do "
            "[ $(cat /work/tick) != $t ] && break; sleep 0.01; done; echo $i",
        )
        assert int(r.stdout) < 1000  # the agent runs again
        assert (await sh(edge, sid, "echo ok", trusted=True)).stdout == "ok\n"
    finally:
        if not started:  # (stops what the killed edge left)
            await edge.start()
        await edge.close()
