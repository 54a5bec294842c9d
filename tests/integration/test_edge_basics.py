"""The edge end to end on real crun, overlayfs and cgroups: state, sessions, files."""

from __future__ import annotations

import asyncio
import io
import tarfile

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec, SessionCreate, SessionRun

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


async def run(edge, sid, cmd, **kw):
    return await edge.exec(sid, ExecRequest(cmd=cmd, **kw))


async def test_exec_and_state_persist(edge):
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512))
    r = await run(edge, sb.id, "python3 -c 'print(6*7)'")
    assert (r.stdout, r.exit_code) == ("42\n", 0)
    assert (await run(edge, sb.id, ["sh", "-c", "echo oops >&2; exit 3"])).model_dump(
        include={"stderr", "exit_code"}
    ) == {"stderr": "oops\n", "exit_code": 3}
    await run(edge, sb.id, "echo persisted > /work/f && mkdir -p /opt/pkg && echo 1 > /opt/pkg/x")
    r = await run(edge, sb.id, "cat /work/f /opt/pkg/x; pwd; hostname")
    assert r.stdout == f"persisted\n1\n/work\n{sb.id}\n"
    r = await run(edge, sb.id, "cat", stdin="from stdin")
    assert r.stdout == "from stdin"
    r = await run(edge, sb.id, "echo $FOO; pwd", env={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n"
    with pytest.raises(errors.InvalidRequest):
        await run(edge, sb.id, ["/no/such/program"])
    await edge.stop(sb.id)
    with pytest.raises(errors.SandboxNotFound):
        await run(edge, sb.id, "true")


async def test_installed_packages_persist(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    r = await run(edge, sb.id, "python3 -m venv /work/venv && /work/venv/bin/pip --version", timeout=120)
    assert r.exit_code == 0, r.stderr
    r = await run(edge, sb.id, "/work/venv/bin/python -c 'import sys; print(sys.prefix)'")
    assert r.stdout.strip() == "/work/venv"


async def test_bash_session_keeps_cwd_env_vars(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    s = await edge.session_create(sb.id, SessionCreate(kind="bash"))
    s2 = await edge.session_create(sb.id, SessionCreate(kind="bash"))
    r = await edge.session_run(sb.id, s.id, SessionRun(code="cd /tmp; X=1; export Y=2"))
    assert r.exit_code == 0
    r = await edge.session_run(sb.id, s.id, SessionRun(code="echo $X $Y $PWD; echo err >&2; false"))
    assert (r.output, r.exit_code) == ("1 2 /tmp\nerr\n", 1)
    r = await edge.session_run(sb.id, s2.id, SessionRun(code="echo ${X:-none} $PWD"))
    assert r.output == "none /work\n"
    r = await edge.session_run(sb.id, s2.id, SessionRun(code="printf no-newline"))
    assert r.output == "no-newline"
    # Quoting: nothing in the code is protocol.
    tricky = "printf '%s\\n' \"a'b\" '$HOME' \"$(echo  x)\" \\\\ ; cat <<'EOF'\nhere doc\nEOF"
    r = await edge.session_run(sb.id, s.id, SessionRun(code=tricky))
    assert r.output == "a'b\n$HOME\nx\n\\\nhere doc\n"
    # A command that reads stdin gets EOF, not our protocol.
    r = await edge.session_run(sb.id, s.id, SessionRun(code="cat; echo after"))
    assert r.output == "after\n"
    # A timeout kills the command and its children, the shell (and its state) survive.
    r = await edge.session_run(sb.id, s.id, SessionRun(code="sleep 100 & sleep 100", timeout=0.5))
    assert r.timed_out
    r = await edge.session_run(sb.id, s.id, SessionRun(code="echo $X; pgrep -c sleep || true"))
    assert r.output == "1\n0\n"
    await edge.session_close(sb.id, s.id)
    with pytest.raises(errors.SessionNotFound):
        await edge.session_run(sb.id, s.id, SessionRun(code="true"))


async def test_python_session_keeps_variables(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    s = await edge.session_create(sb.id, SessionCreate(kind="python"))
    r = await edge.session_run(
        sb.id, s.id, SessionRun(code="import numpy as np\nx = np.arange(4)\nprint('hi')")
    )
    assert (r.output, r.error) == ("hi\n", None)
    r = await edge.session_run(sb.id, s.id, SessionRun(code="x.sum()"))
    assert r.output.strip() == "np.int64(6)" or r.output.strip() == "6"
    r = await edge.session_run(sb.id, s.id, SessionRun(code="1/0"))
    assert r.exit_code == 1 and "ZeroDivisionError" in (r.error or "")
    r = await edge.session_run(
        sb.id, s.id, SessionRun(code="import time\nwhile True: time.sleep(0.01)", timeout=0.5)
    )
    assert r.timed_out and "KeyboardInterrupt" in (r.error or "")
    r = await edge.session_run(sb.id, s.id, SessionRun(code="print(len(x))"))
    assert r.output == "4\n"


async def test_files(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    await edge.write_file(sb.id, "/work/deep/a.txt", b"hi there", 0o600)
    assert await edge.read_file(sb.id, "/work/deep/a.txt") == b"hi there"
    st = await edge.stat_file(sb.id, "/work/deep/a.txt")
    assert (st.type, st.size, st.mode, st.uid) == ("file", 8, 0o600, 0)
    r = await run(edge, sb.id, "stat -c '%U %a' /work/deep/a.txt; cat /work/deep/a.txt")
    assert r.stdout == "root 600\nhi there"
    await edge.edit_file(sb.id, "/work/deep/a.txt", "there", "world")
    assert await edge.read_file(sb.id, "/work/deep/a.txt") == b"hi world"
    with pytest.raises(errors.EditMismatch):
        await edge.edit_file(sb.id, "/work/deep/a.txt", "nothere", "x")
    await edge.write_file(sb.id, "/work/b.txt", b"aa aa")
    with pytest.raises(errors.EditMismatch):
        await edge.edit_file(sb.id, "/work/b.txt", "aa", "x")
    assert [e.name for e in await edge.list_dir(sb.id, "/work")] == ["b.txt", "deep"]
    await edge.delete_file(sb.id, "/work/b.txt")
    with pytest.raises(errors.FileNotFound):
        await edge.read_file(sb.id, "/work/b.txt")
    with pytest.raises(errors.Conflict):
        await edge.delete_file(sb.id, "/work/deep")
    # tar round trip
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"print('from tar')\n"
        info = tarfile.TarInfo("pkg/mod.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    await edge.upload_tar(sb.id, "/work/up", buf.getvalue())
    assert (await run(edge, sb.id, "python3 /work/up/pkg/mod.py")).stdout == "from tar\n"
    out = await edge.download_tar(sb.id, "/work/up")
    with tarfile.open(fileobj=io.BytesIO(out)) as tf:
        names = tf.getnames()
    assert "./pkg/mod.py" in names


async def test_many_concurrent_execs(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    results = await asyncio.gather(*(run(edge, sb.id, f"echo {i}") for i in range(50)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(50)]
