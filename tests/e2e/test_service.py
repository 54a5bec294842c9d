"""The service end to end through the SDK, against a real `dsec up`."""

from __future__ import annotations

import asyncio
import glob
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dsec import errors
from dsec.client import AsyncClient, Client

from ..conftest import LAYERS

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def test_quickstart(service):
    client = Client()
    sb = client.create(image="python", cpu=1, memory_mb=1024, ttl_idle_s=300)
    r = sb.exec("python3 -c 'print(6*7)'", timeout=10)
    assert (r.stdout, r.exit_code) == ("42\n", 0)
    sb.files.write("/work/a.txt", "hi")
    assert sb.files.read("/work/a.txt") == "hi"
    sb.files.edit("/work/a.txt", "hi", "ho")
    assert sb.exec("cat /work/a.txt").stdout == "ho"
    sh = sb.session("bash")
    sh.run("cd /tmp; X=1")
    assert sh.run("echo $X $PWD").output == "1 /tmp\n"
    py = sb.session("python")
    py.run("import math; r = 2")
    assert py.run("print(math.pi * r)").output.startswith("6.28")
    events = list(sb.exec_stream("echo a; echo b >&2; echo c"))
    assert events[-1][0] == "result" and events[-1][1].stdout == "a\nc\n"
    assert "".join(str(x) for k, x in events if k == "stdout") == "a\nc\n"
    sb.stop()
    with pytest.raises(errors.SandboxNotFound):
        sb.exec("true")
    sb.stop()  # idempotent
    client.close()


def test_context_manager_and_batch(service):
    with Client() as client:
        with client.create() as sb:
            assert sb.exec("echo ok").stdout == "ok\n"
        assert sb.id not in {i.id for i in client.list()}
        sbs = client.create_many(64, image="python", memory_mb=256, labels={"batch": "b64"})
        assert len({s.id for s in sbs}) == 64
        listed = client.list(labels={"batch": "b64"})
        assert len(listed) == 64
        outs = [s.exec("hostname").stdout.strip() for s in sbs[:8]]
        assert outs == [s.id for s in sbs[:8]]
        client.stop_many([s.id for s in sbs])
        assert client.list(labels={"batch": "b64"}) == []


def _admin(service) -> httpx.Client:
    return httpx.Client(
        base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}, timeout=60
    )


def test_quota_is_never_over_admitted(service):
    with _admin(service) as http:
        r = http.post("/v1/projects", json={"name": "q20", "quota": {"max_sandboxes": 20, "max_cpu": 100}})
        assert r.status_code == 200, r.text
        tok = http.post("/v1/principals", json={"name": "q20-user", "projects": ["q20"]}).json()["token"]

    async def burst() -> list[object]:
        async with AsyncClient(service.url, tok) as c:
            return await asyncio.gather(
                *(c.create("python", memory_mb=128, project="q20") for _ in range(200)),
                return_exceptions=True,
            )

    results = asyncio.run(burst())
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(ok) == 20
    assert all(isinstance(e, errors.QuotaExceeded) for e in refused), {type(e) for e in refused}
    assert "max_sandboxes" in refused[0].message
    with Client(service.url, tok) as c:
        assert len(c.list(project="q20")) == 20
        with pytest.raises(errors.QuotaExceeded) as exc:
            c.create("python", project="q20")
        assert exc.value.status == 429
        c.stop_many([s.id for s in ok])  # type: ignore[attr-defined]
        # released: room again
        c.create("python", project="q20").stop()
        # A stop's release runs after its response is written, yet before the next request
        # is read: at the limit, stop -> create back to back is always admitted.
        keep = [c.create("python", memory_mb=128, project="q20") for _ in range(19)]
        for _ in range(20):
            c.create("python", memory_mb=128, project="q20").stop()
        c.stop_many([s.id for s in keep])


def test_bad_input_is_refused_and_changes_nothing(service, tmp_path):
    c = Client()
    before = {i.id for i in c.list()}
    with pytest.raises(errors.ImageNotFound) as e1:
        c.create("no-such-image")
    assert "no-such-image" in e1.value.message
    with pytest.raises(errors.InvalidRequest) as e2:
        c.create("python", memory_mb=-5)
    assert "memory_mb" in e2.value.message
    assert {i.id for i in c.list()} == before
    sb = c.create("python")
    with pytest.raises(errors.InvalidRequest):
        sb.files.read("relative/path")
    sb.exec("ln -s /../../../../etc/shadow /work/esc; ln -s /proc/self/root/etc/hostname /work/esc2")
    with pytest.raises(errors.DsecError) as e3:
        sb.files.read("/work/esc2")
    assert e3.value.status in (403, 404)
    # /work/esc resolves inside the sandbox: the sandbox's own shadow file, not the host's
    host_shadow = Path("/etc/shadow").read_bytes()
    assert sb.files.read_bytes("/work/esc") != host_shadow or host_shadow == b""
    with pytest.raises(errors.InvalidRequest):  # the SDK refuses before sending
        sb.files.write("/work/big", b"x" * (200 * 1024 * 1024))
    big = b'{"path": "/work/big", "content": "' + b"x" * (170 * 1024 * 1024) + b'"}'
    r = httpx.put(
        f"{service.url}/v1/sandboxes/{sb.id}/files",
        content=big,
        headers={"Authorization": f"Bearer {service.token}", "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    with pytest.raises(errors.FileNotFound):
        sb.files.read("/work/big")
    for token in (None, "dsec_wrong"):
        r = httpx.post(
            service.url + "/v1/sandboxes",
            json={"image": "python"},
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    # another project's sandbox is invisible
    with _admin(service) as http:
        http.post("/v1/projects", json={"name": "other"})
        tok = http.post("/v1/principals", json={"name": "other-user", "projects": ["other"]}).json()["token"]
    with Client(service.url, tok) as other:
        with pytest.raises(errors.SandboxNotFound):
            other.sandbox(sb.id).exec("touch /work/pwned")
        with pytest.raises(errors.Forbidden):
            other.create("python", project="default")
        assert sb.id not in {i.id for i in other.list()}
        r = httpx.delete(f"{service.url}/v1/sandboxes/{sb.id}", headers={"Authorization": f"Bearer {tok}"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    assert sb.exec("ls /work/pwned || echo absent").stdout.strip().endswith("absent")
    sb.stop()
    c.close()


def test_async_and_sync_agree(service):
    script = "import sys; print(sum(range(10))); print('e', file=sys.stderr); sys.exit(3)"
    with Client() as c:
        sb = c.create("python")
        sync = sb.exec(["python3", "-c", script])
        sync_files = (
            sb.files.write("/work/x", "1"),
            sb.files.read("/work/x"),
            [f.name for f in sb.files.list("/work")],
        )

    async def go():
        async with AsyncClient() as ac:
            asb = ac.sandbox(sb.id)
            r = await asb.exec(["python3", "-c", script])
            files = (
                await asb.files.write("/work/x", "1"),
                await asb.files.read("/work/x"),
                [f.name for f in await asb.files.list("/work")],
            )
            await asb.stop()
            return r, files

    async_r, async_files = asyncio.run(go())
    assert (sync.stdout, sync.stderr, sync.exit_code) == (async_r.stdout, async_r.stderr, async_r.exit_code)
    assert sync_files == async_files


def test_cli_against_the_service(service):
    """`dsec sandbox create|ls|exec|rm`, `dsec status`, `dsec image ls` with --json, reading the
    client config `dsec up` wrote (DSEC_CONFIG), as a script would drive them."""

    def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [sys.executable, "-m", "dsec.cli", *args],
            env=service.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert not check or r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
        return r

    ids = json.loads(
        cli("sandbox", "create", "--count", "3", "--memory-mb", "256", "--label", "cli=1", "--json").stdout
    )
    assert len(ids) == 3
    listed = json.loads(cli("sandbox", "ls", "--json").stdout)
    assert set(ids) <= {s["id"] for s in listed}
    assert all(s["spec"]["labels"] == {"cli": "1"} for s in listed if s["id"] in ids)
    r = json.loads(cli("sandbox", "exec", ids[0], "echo $((6*7)); exit 3", "--json").stdout)
    assert r["stdout"] == "42\n" and r["exit_code"] == 3
    plain = cli("sandbox", "exec", ids[0], "--", "sh", "-c", "echo out; echo err >&2; exit 5", check=False)
    assert (plain.returncode, plain.stdout, plain.stderr) == (5, "out\n", "err\n")  # exit code passed on
    status = json.loads(cli("status", "--json").stdout)
    assert status["health"]["status"] == "ok" and status["edges"][0]["sandboxes"] >= 3
    images = json.loads(cli("image", "ls", "--json", "--data-dir", str(LAYERS.parent)).stdout)
    assert "python" in {i["name"] for i in images}
    cli("sandbox", "rm", *ids)
    assert not set(ids) & {s["id"] for s in json.loads(cli("sandbox", "ls", "--json").stdout)}
    gone = cli("sandbox", "exec", ids[0], "true", check=False)
    assert gone.returncode != 0 and "sandbox_not_found" in gone.stderr + gone.stdout


def test_metrics_and_events(service):
    with Client() as c:
        c.create("python").stop()
    assert httpx.get(service.url + "/metrics").status_code == 401  # no token, no metrics
    text = httpx.get(service.url + "/metrics", headers={"Authorization": f"Bearer {service.token}"}).text
    assert 'dsec_create_phase_seconds_count{phase="runtime_start"}' in text
    assert "dsec_exec_seconds" in text


def test_backends_listed_and_one_parameter_picks_the_tier(service):
    """`client.backends()` (GET /v1/backends) and `create(backend=...)` through `dsec up`."""
    with Client() as client:
        tiers = {b.name: b for b in client.backends()}
        assert tiers["container"].available and "checkpoint" in tiers["container"].capabilities
        gv = tiers["gvisor"]
        assert gv.available and gv.accelerated and gv.edges and gv.detail["platform"] in ("systrap", "ptrace")
        assert "sessions" in gv.capabilities and "checkpoint" not in gv.capabilities
        with client.create(backend="gvisor", memory_mb=256) as sb:
            assert "4.4.0" in sb.exec("cat /proc/version").stdout  # gVisor's kernel, not the host's
            sb.files.write("/work/a", "x")
            assert sb.exec("cat /work/a").stdout == "x"
            assert sb.refresh().spec.backend == "gvisor"
            assert sb.session("bash").run("echo $((6 * 7))").output.strip() == "42"  # (since #25 item 11)
            with pytest.raises(errors.UnsupportedOperation, match="gvisor"):
                sb.checkpoint()
        with pytest.raises(errors.InvalidRequest) as ei:
            client.create(backend="microvm-nope")
        assert "container" in ei.value.message and "gvisor" in ei.value.message
        # batch creates and prewarmed pools keep the backend in their key
        sbs = client.create_many(3, backend="gvisor", memory_mb=256)
        assert {s.refresh().spec.backend for s in sbs} == {"gvisor"}
        client.stop_many([s.id for s in sbs])


def test_no_leaks_after_shutdown(service):
    """Stops the module's service: SIGTERM stops sandboxes and leaves nothing behind."""
    with Client() as c:
        c.create("python")
    run_dir = service.env["DSEC_EDGE_RUN_DIR"]
    service.stop("up")
    assert not [m for m in Path("/proc/mounts").read_text().splitlines() if run_dir in m]
    name = service.env["DSEC_EDGE_NAME"]
    assert not glob.glob(f"/sys/fs/cgroup/*/dsec/{name}-*")
    sandboxes = Path(run_dir, name, "sandboxes")  # gone with the run tmpfs, or empty
    assert not sandboxes.exists() or not list(sandboxes.iterdir())
