"""The fncall backend on a real edge: languages, limits, isolation between calls."""

from __future__ import annotations

import asyncio
import base64

import pytest

from dsec import errors
from dsec.models import FnCallRequest, JupyterRequest

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


@pytest.fixture
async def fedge(edge, code_image):
    edge.fncall.size = 2
    return edge


async def call(edge, **kw):
    return await edge.fncall_run(FnCallRequest(**kw))


async def test_languages(fedge):
    r = await call(fedge, code="print(6*7)")
    assert (r.run.status, r.run.stdout, r.run.return_code) == ("Finished", "42\n", 0)
    r = await call(fedge, language="bash", code="echo $((6*7)); echo err >&2; exit 3")
    assert (r.run.stdout, r.run.stderr, r.run.return_code, r.run.status) == ("42\n", "err\n", 3, "Error")
    c = '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);return 0;}'
    r = await call(fedge, language="c", code=c, stdin="40 2")
    assert r.compile.status == "Finished" and r.run.stdout == "42\n"
    cpp = '#include <iostream>\nint main(){std::cout<<std::string("hi")<<std::endl;}'
    r = await call(fedge, language="cpp", code=cpp)
    assert r.run.stdout == "hi\n"
    r = await call(fedge, language="cpp", code="int main( {")
    assert r.compile.status == "Error" and r.run is None and "error" in r.compile.stderr
    r = await call(fedge, language="nodejs", code="console.log([1,2,3].map(x => x*2).join(','))")
    assert r.run.stdout == "2,4,6\n"
    test = "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(2, 2) == 4\n"
    r = await call(fedge, language="pytest", code=test)
    assert r.run.return_code == 0 and "1 passed" in r.run.stdout
    r = await call(fedge, language="pytest", code=test.replace("== 4", "== 5"))
    assert r.run.return_code == 1 and "1 failed" in r.run.stdout
    with pytest.raises(errors.InvalidRequest, match="unsupported language 'cobol'"):
        await call(fedge, language="cobol", code="x")


async def test_python_semantics(fedge):
    r = await call(fedge, code="import sys\nprint(sys.stdin.read().upper(), end='')", stdin="abc")
    assert r.run.stdout == "ABC"
    r = await call(fedge, code="raise ValueError('boom')")
    assert r.run.status == "Error" and r.run.return_code == 1 and "ValueError: boom" in r.run.stderr
    r = await call(fedge, code="import sys; sys.exit(7)")
    assert r.run.return_code == 7
    r = await call(fedge, code="import numpy as np; print(int(np.arange(5).sum()))")
    assert r.run.stdout == "10\n"


async def test_files_in_and_out(fedge):
    files = {"data/in.txt": base64.b64encode(b"hello").decode()}
    code = "open('out.txt','w').write(open('data/in.txt').read()[::-1])"
    r = await call(fedge, code=code, files=files, fetch_files=["out.txt", "missing.txt"])
    assert base64.b64decode(r.files["out.txt"]) == b"olleh"
    assert r.files["missing.txt"] is None


async def test_limits(fedge):
    r = await call(
        fedge,
        code="import time, subprocess\nsubprocess.Popen(['sleep','100'])\ntime.sleep(100)",
        run_timeout=0.5,
    )
    assert r.run.status == "TimeLimitExceeded" and r.run.return_code is None
    r = await call(fedge, code="x = bytearray(512 * 1024 * 1024)", memory_limit_mb=128)
    assert r.run.status == "Error" and "MemoryError" in r.run.stderr
    r = await call(fedge, language="bash", code="yes", max_output=10000, run_timeout=5)
    assert r.run.truncated and len(r.run.stdout) <= 10000 and r.run.execution_time < 4


async def test_nothing_left_for_the_next_call(fedge):
    leak = (
        "import os, subprocess\nopen('leak.txt','w').write('x')\n"
        "subprocess.Popen(['setsid','sleep','300'])\n"
        "for p in ('/tmp/x', '/var/tmp/x', '/dev/shm/x', '/fncall/x', '/root/x'):\n"
        "    try: open(p, 'w').write('x'); print('wrote', p)\n"
        "    except OSError: pass\n"
    )
    r = await call(fedge, code=leak)
    assert r.run.stdout == "", r.run.stdout  # nowhere outside its scratch is writable
    for _ in range(4):
        r = await call(
            fedge,
            code="import os, subprocess\nprint(os.listdir('.'))\n"
            "print(subprocess.run(['pgrep','-c','sleep'],capture_output=True).stdout.decode())",
        )
        assert r.run.stdout.startswith("['main.py']\n0"), r.run.stdout


async def test_broken_sandbox_is_replaced(fedge):
    r = await call(fedge, code="print(1)")
    before = set(w.sandbox_id for ws in fedge.fncall.workers.values() for w in ws)
    # As the unprivileged runner user the code cannot break the sandbox; the runner's
    # own health check is what decides: simulate damage from the edge side.
    victim = r.worker
    sb = fedge.sandboxes[victim]
    sb.files.delete("/fncall", recursive=True)
    results = await asyncio.gather(*(call(fedge, code="print(2)") for _ in range(6)))
    assert all(x.run.stdout == "2\n" for x in results)
    await asyncio.sleep(1.0)
    after = set(w.sandbox_id for ws in fedge.fncall.workers.values() for w in ws)
    assert victim not in after and len(after) == len(before)


async def test_jupyter_cells_share_state(fedge):
    r = await fedge.fncall_jupyter(JupyterRequest(cells=["x = 20", "y = x * 2\nprint(y)", "y + 2", "1/0"]))
    assert r.driver.status == "Finished"
    assert [c.stdout for c in r.cells] == ["", "40\n", "", ""]
    assert r.cells[2].display == [{"text/plain": "42"}]
    assert r.cells[3].error[0]["ename"] == "ZeroDivisionError"
    r = await fedge.fncall_jupyter(JupyterRequest(cells=["import time\ntime.sleep(10)"], cell_timeout=0.5))
    assert r.cells[0].error[0]["ename"] == "TimeoutError"
