"""Output floods against a real `dsec up` through the SDK (issue #25 item 6). Ten concurrent
execs that each print 16 MiB that is not UTF-8 (48 MiB of JSON each) cost the service its
output budget plus the oldest call's share (~160 MiB here), not every call's decoded copies
(~600 MiB before, up to 20 times the output per call); each answer is the exact text. A client that opens more
exec streams than its project may gets 429 quota_exceeded (reason open_streams), and one that
goes away gives its stream's place back."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsec import errors
from dsec.client import Client

from .conftest import Service, dsec_up

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

MiB = 1 << 20
BUDGET, PROJECT_BUDGET = 32 * MiB, 16 * MiB


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, python_image: str) -> Iterator[Service]:
    extra = {
        "DSEC_EDGE_OUTPUT_BUDGET_MB": str(BUDGET // MiB),
        "DSEC_EDGE_PROJECT_OUTPUT_BUDGET_MB": str(PROJECT_BUDGET // MiB),
        "DSEC_EDGE_PROJECT_STREAMS": "2",
        "DSEC_EDGE_FNCALL_IMAGE": "",
        "DSEC_EDGE_NAME": "of" + secrets.token_hex(4),
    }
    with dsec_up(tmp_path_factory.mktemp("dsec-output-flood"), extra) as s:
        yield s


def _hwm(pid: int) -> int:
    """The most memory the process ever had resident (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_concurrent_floods_cost_the_budget_not_every_call(svc: Service) -> None:
    size, n = 16 * MiB, 10
    cmd = f"head -c {size} /dev/zero | tr '\\0' '\\377'"
    pid = svc.procs["up"].pid
    with Client(svc.url, svc.token) as c:
        boxes = [c.create(max_output_bytes=size) for _ in range(n)]
        c.sandbox(boxes[0].id).exec("true")  # (the first exec's one-time costs: not the flood's)
        before = _hwm(pid)
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda sb: sb.exec(cmd, max_output_bytes=size, timeout=600), boxes))
        grown = _hwm(pid) - before
        for sb in boxes:
            sb.stop()
    assert all(r.exit_code == 0 and not r.truncated for r in results)
    assert all(r.stdout == "\ufffd" * size for r in results)
    # the budget, the oldest call's output and JSON (3 bytes per byte here), and slack
    # (allocator, buffers in flight)
    bound = BUDGET + (size + 3 * size) + 128 * MiB
    assert grown < bound, f"grew {grown / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"


def test_streams_past_the_project_limit_are_refused_and_a_gone_client_frees_its_place(svc: Service) -> None:
    with Client(svc.url, svc.token) as c:
        sb = c.create()
        opened = [sb.exec_stream("echo go; exec sleep 600", timeout=600) for _ in range(2)]
        for s in opened:
            assert next(s) == ("stdout", "go\n")
        with pytest.raises(errors.QuotaExceeded) as ei:
            next(sb.exec_stream("echo three"))
        assert ei.value.details == {"reason": "open_streams", "limit": 2}
        opened[0].close()  # the client goes away: the edge's stream ends, its place with it
        for _ in range(500):  # (the edge hears of the disconnect within a few requests)
            try:
                got = list(sb.exec_stream("echo again"))
                break
            except errors.QuotaExceeded:
                continue
        else:
            raise AssertionError("the closed stream's place never came back")
        assert got[-1][0] == "result" and got[-1][1].stdout == "again\n"
        opened[1].close()
        sb.stop()


def test_an_apiserver_passes_answers_and_streams_through(tmp_path: Path, python_image: str) -> None:
    """apiserver and edge as separate processes: a large answer streams through the apiserver
    as the edge writes it, never parsed or copied there (four 16 MiB floods of invalid UTF-8
    at once: ~0.5 GiB in the apiserver before), exact at the client; a stream passes through
    too, and the edge's 429 for one stream too many reaches the client as it is."""
    from dsec.service import free_port

    from .conftest import _env, remove_run_dir, start, stop_all, wait_healthy

    data, run_id = tmp_path / "data", secrets.token_hex(4)
    env = _env(tmp_path, f"dsec-e2e-{run_id}")
    env.update(DSEC_EDGE_FNCALL_IMAGE="", DSEC_EDGE_PROJECT_STREAMS="1")
    api_port, edge_port = free_port(), free_port()
    url, run_dir = f"http://127.0.0.1:{api_port}", f"/run/dsec-e2e-{run_id}-of"
    procs = {
        "api": start(["apiserver", "--port", str(api_port), "--data-dir", str(data)], env, tmp_path / "a.log")
    }
    try:
        tokens = [data / "cluster-token", data / "admin-token"]
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in tokens):  # (the apiserver writes them as it starts)
            assert time.monotonic() < deadline, (tmp_path / "a.log").read_text()
            time.sleep(0.05)
        token, admin = (p.read_text().strip() for p in tokens)
        edge_args = ["edge", "--apiserver", url, "--name", "of" + run_id[:6], "--port", str(edge_port)]
        edge_args += ["--data-dir", str(data), "--run-dir", run_dir, "--token", token, "--no-keep-sandboxes"]
        procs["edge"] = start(edge_args, env, tmp_path / "e.log")
        wait_healthy(url)
        size = 16 * MiB
        cmd = f"head -c {size} /dev/zero | tr '\\0' '\\377'"
        with Client(url, admin) as c:
            boxes = [c.create(max_output_bytes=size) for _ in range(4)]
            boxes[0].exec("true")
            before = _hwm(procs["api"].pid)
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda sb: sb.exec(cmd, max_output_bytes=size, timeout=600), boxes))
            grown = _hwm(procs["api"].pid) - before
            assert all(r.exit_code == 0 and r.stdout == "\ufffd" * size for r in results)
            assert grown < 64 * MiB, f"the apiserver grew {grown / MiB:.0f} MiB"
            events = list(boxes[0].exec_stream("printf 'a\\377b'; echo; echo err >&2"))
            text = "".join(item for kind, item in events if kind == "stdout")
            assert text == "a\ufffdb\n" and events[-1][1].stdout == "a\ufffdb\n"
            opened = boxes[1].exec_stream("echo go; exec sleep 600", timeout=600)
            assert next(opened) == ("stdout", "go\n")
            with pytest.raises(errors.QuotaExceeded) as ei:
                next(boxes[2].exec_stream("echo two"))
            assert ei.value.details == {"reason": "open_streams", "limit": 1}
            opened.close()
            for sb in boxes:
                sb.stop()
    finally:
        stop_all(procs)
        remove_run_dir(run_dir)
