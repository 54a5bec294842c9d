"""Sessions, trusted execs, protected paths and verify on every backend (issue #25, tier
parity). On gVisor and in a microVM a trusted command runs in a fresh sandbox of the same
backend, the task's files copied in as data (dsec.edge.gradersandbox); these tests check what
that adds to the attacks test_verify_attacks and test_session_attacks run on every backend:
links and files the agent leaves in the task directories, what is left on the host, and
what the agent's own tools in a microVM can do to the copy. Before, both backends answered
`unsupported_operation` for all of it."""

from __future__ import annotations

import pytest

from dsec.models import ExecRequest, SandboxSpec, SessionCreate, SessionRun

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

CHECK = (
    b"import os, sys\n"
    b"answer, expected = (open(f).read().strip() for f in ('/work/answer', '/grader/data/expected'))\n"
    b"print(answer, os.getuid(), os.readlink('/work/.venv/bin/python'), expected)\n"
    b"sys.exit(0 if answer == expected else 1)\n"
)


def _left(edge, backend: str, sandbox_id: str) -> list[str]:
    """What the edge has of sandboxes other than `sandbox_id` (a trusted command's own
    sandbox, once it ended, must be gone: its directory, cgroups, its record of being made)."""
    others = set(edge.backends[backend].leftover_ids()) - {sandbox_id}
    others |= {c for c in edge.cgroups.listed_sandboxes() if c.startswith(f"{edge.name}-")} - {sandbox_id}
    return sorted(others | set(edge.life.in_progress()))


async def _sh(edge, sid: str, cmd: str, **kw) -> str:
    r = await edge.exec(sid, ExecRequest(cmd=cmd, timeout=120, **kw))
    assert r.exit_code == 0, r
    return r.stdout


async def test_sessions_trusted_execs_protect_and_verify(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    # sessions keep their state as on every backend
    s = (await edge.session_create(sb.id, SessionCreate(kind="bash"))).id
    await edge.session_run(sb.id, s, SessionRun(code="X=41; cd /work"))
    r = await edge.session_run(sb.id, s, SessionRun(code="echo $((X+1)) $PWD; false"))
    assert (r.output, r.exit_code) == ("42 /work\n", 1), r
    p = (await edge.session_create(sb.id, SessionCreate(kind="python"))).id
    await edge.session_run(sb.id, p, SessionRun(code="x = 41"))
    r = await edge.session_run(sb.id, p, SessionRun(code="print(x + 1)"))
    assert (r.output, r.exit_code) == ("42\n", 0), r
    # the grader and its data protected: gone from the sandbox, kept by the host
    await edge.write_file(sb.id, "/grader/check.py", CHECK)
    await edge.write_file(sb.id, "/grader/data/expected", b"42\n")
    assert await edge.protect(sb.id, ["/grader"]) == ["/grader"]
    assert "gone" in await _sh(edge, sb.id, "ls /grader 2>/dev/null || echo gone")
    # The agent's work: an answer, a virtualenv's absolute links (data in the copy: before
    # they refused the whole archive), and a forged python3 first on PATH.
    await _sh(
        edge,
        sb.id,
        "echo 42 > /work/answer; mkdir -p /work/.venv/bin; ln -s /usr/bin/python3 /work/.venv/bin/python; "
        "printf '#!/bin/sh\\necho forged\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3",
    )
    assert await _sh(edge, sb.id, "python3 -c 1") == "forged\n"  # in the agent's own view
    r = await edge.verify(sb.id, ExecRequest(cmd="python3 /grader/check.py"))
    assert (r.exit_code, r.stdout) == (0, "42 65533 /usr/bin/python3 42\n"), r
    await _sh(edge, sb.id, "echo 41 > /work/answer")
    r = await edge.verify(sb.id, ExecRequest(cmd="python3 /grader/check.py"))
    assert (r.exit_code, r.stdout.split()[0]) == (1, "41"), r
    # a trusted exec: the image's tools, the task directories, never the protected paths
    cmd = "id -u; cat /work/answer; test -e /grader || echo no-grader; python3 -c 'print(1)'"
    r = await edge.exec(sb.id, ExecRequest(cmd=cmd, trusted=True))
    assert (r.exit_code, r.stdout) == (0, "65533\n41\nno-grader\n1\n"), r
    assert _left(edge, backend, sb.id) == []
    await edge.stop(sb.id)


async def test_protected_files_land_in_the_task_directory_whatever_the_agent_linked(edge, backend):
    """Protected paths inside /work: the agent replaces their parent with a link into the
    image's Python library and a file of its own. The grader's files arrive where the task
    put them, in a real directory, and nothing lands in the library (a grader file there,
    say sitecustomize.py, would run in every later Python)."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    await edge.write_file(sb.id, "/work/tests/unit/sitecustomize.py", b"print('planted by the grader')\n")
    await edge.write_file(sb.id, "/work/tests/unit/test_x.py", b"print('tested')\n")
    assert await edge.protect(sb.id, ["/work/tests/unit"]) == ["/work/tests/unit"]
    where = "python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"stdlib\"])'"
    stdlib = (await _sh(edge, sb.id, where)).strip()
    check = (
        "python3 /work/tests/unit/test_x.py; test -d /work/tests -a ! -L /work/tests && echo dir; "
        f"test -e {stdlib}/unit && echo leaked; python3 -c 'print(2)'"
    )
    for plant in (f"ln -s {stdlib} /work/tests", "echo file > /work/tests"):
        await _sh(edge, sb.id, f"rm -rf /work/tests && {plant}")
        r = await edge.verify(sb.id, ExecRequest(cmd=check))
        assert (r.exit_code, r.stdout) == (0, "tested\ndir\n2\n"), (plant, r)
    assert _left(edge, backend, sb.id) == []
    await edge.stop(sb.id)


async def test_a_guests_own_tools_never_touch_the_copy(edge):
    """In a microVM the task directories leave the agent's VM through the agent's own
    archiver (dsec-guest, outside the user's cgroup), never the image's tar or find, which
    the guest's root may replace: a tar that forges a grader and climbs out of the task
    directory, a find that lies, every pid taken, change nothing of the grade."""
    sb = await edge.create(SandboxSpec(image="python", backend="microvm", memory_mb=256, pids=64))
    await edge.write_file(sb.id, "/grader/check.py", b"print(open('/work/answer').read().strip())\n")
    assert await edge.protect(sb.id, ["/grader"]) == ["/grader"]
    await _sh(edge, sb.id, "echo 41 > /work/answer; cp /usr/bin/tar /usr/bin/tar.real")
    forge = (
        "#!/bin/sh\nd=$(mktemp -d); mkdir -p $d/g; echo 'print(42)' > $d/g/check.py; echo 42 > $d/answer; "
        "exec /usr/bin/tar.real -c -P -C $d --transform 's,^\\./g,../grader,' .\n"
    )
    for path, fake in (("/usr/bin/tar", forge), ("/usr/bin/find", "#!/bin/sh\necho lies\n")):
        await edge.write_file(sb.id, f"{path}.new", fake.encode(), 0o755)
        await _sh(edge, sb.id, f"mv -f {path}.new {path}")
    hold = "setsid sh -c 'while :; do sleep 1000 & done' >/dev/null 2>&1 </dev/null; true"
    await edge.exec(sb.id, ExecRequest(cmd=hold))
    for run in (
        edge.exec(sb.id, ExecRequest(cmd="cat /work/answer", trusted=True)),
        edge.verify(sb.id, ExecRequest(cmd="python3 /grader/check.py")),
    ):
        r = await run
        assert (r.exit_code, r.stdout) == (0, "41\n"), r
    assert _left(edge, "microvm", sb.id) == []
    await edge.stop(sb.id)


async def test_protected_paths_at_create(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend, protected_paths=["/etc/os-release"]))
    r = await edge.exec(sb.id, ExecRequest(cmd="cat /etc/os-release"))
    assert r.exit_code != 0
    r = await edge.verify(sb.id, ExecRequest(cmd="grep -c ID= /etc/os-release"))
    assert r.exit_code == 0 and int(r.stdout) >= 1, r
    await edge.stop(sb.id)
