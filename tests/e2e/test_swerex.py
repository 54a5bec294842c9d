"""The SWE-ReX remote runtime protocol, driven by the real `swe-rex` client
(`swerex.runtime.remote.RemoteRuntime`) against a real `dsec up`."""

from __future__ import annotations

import asyncio
import zipfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from dsec.client import Client, Sandbox

pytestmark = [pytest.mark.root, pytest.mark.e2e]


@pytest.fixture(scope="module")
def sandbox(service) -> Iterator[Sandbox]:
    with Client(service.url, service.token) as client:
        sb = client.create(image="python", memory_mb=512, ttl_idle_s=600)
        yield sb
        sb.stop()


def runtime(service, sid: str, token: str | None = None) -> RemoteRuntime:
    return RemoteRuntime(host=f"{service.url}/swerex/{sid}", auth_token=token or service.token, timeout=10)


async def test_is_alive_and_session_state(service, sandbox):
    rt = runtime(service, sandbox.id)
    alive = await rt.is_alive()
    assert alive.is_alive, alive.message
    # SWE-agent's RemoteDeployment polls with the client's default 0.15 s timeout
    await RemoteRuntime(host=f"{service.url}/swerex/{sandbox.id}", auth_token=service.token).wait_until_alive(
        timeout=10
    )
    await rt.create_session(CreateBashSessionRequest(session="main"))
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest(session="main"))

    obs = await rt.run_in_session(BashAction(session="main", command="cd /tmp && export FOO=bar", timeout=10))
    assert obs.exit_code == 0
    obs = await rt.run_in_session(BashAction(session="main", command="echo $FOO; pwd", timeout=10))
    assert (obs.output, obs.exit_code) == ("bar\n/tmp\n", 0)
    obs = await rt.run_in_session(BashAction(session="main", command="echo out; echo err >&2", timeout=10))
    assert obs.output == "out\nerr\n"
    # multi-line commands and heredocs
    obs = await rt.run_in_session(
        BashAction(session="main", command="cat <<'EOF'\na b\nEOF\necho done", timeout=10)
    )
    assert obs.output == "a b\ndone\n"

    # a timeout raises, kills the command, and the session keeps its state
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(session="main", command="sleep 30", timeout=1))
    obs = await rt.run_in_session(BashAction(session="main", command="echo $FOO $PWD", timeout=10))
    assert obs.output == "bar /tmp\n"
    # interrupting an idle session is harmless
    obs = await rt.run_in_session(BashInterruptAction(session="main"))
    assert obs.exit_code == 0

    # exit codes and `check`
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await rt.run_in_session(BashAction(session="main", command="(exit 3)", check="raise", timeout=10))
    obs = await rt.run_in_session(BashAction(session="main", command="(exit 3)", check="silent", timeout=10))
    assert obs.exit_code == 3
    obs = await rt.run_in_session(BashAction(session="main", command="false", check="ignore", timeout=10))
    assert obs.exit_code is None
    with pytest.raises(BashIncorrectSyntaxError):
        await rt.run_in_session(BashAction(session="main", command="if then fi (", timeout=10))

    # startup_source, several sessions, closing
    await rt.write_file(
        WriteFileRequest(path="/work/env.sh", content="export STARTED=yes\nalias hi='echo hi'\n")
    )
    await rt.create_session(CreateBashSessionRequest(session="two", startup_source=["/work/env.sh"]))
    obs = await rt.run_in_session(BashAction(session="two", command="echo $STARTED $FOO; hi", timeout=10))
    assert obs.output == "yes\nhi\n"
    await rt.close_session(CloseBashSessionRequest(session="two"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(session="two", command="true"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.close_session(CloseBashSessionRequest(session="nope"))

    # close ends the sessions, not the sandbox
    await rt.close()
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(session="main", command="true"))
    assert (await rt.is_alive()).is_alive
    assert sandbox.exec("echo still here").stdout == "still here\n"


async def test_interrupt_a_running_command(service, sandbox):
    rt = runtime(service, sandbox.id)
    await rt.create_session(CreateBashSessionRequest(session="intr"))
    running = asyncio.create_task(
        rt.run_in_session(BashAction(session="intr", command="sleep 60; echo after", check="silent"))
    )
    await asyncio.sleep(1.0)
    assert not running.done()
    obs = await rt.run_in_session(BashInterruptAction(session="intr"))
    assert obs.exit_code == 0
    first = await asyncio.wait_for(running, 10)
    assert first.exit_code == 0 and first.output == "after\n"  # like bash without job control
    obs = await rt.run_in_session(BashAction(session="intr", command="echo alive", timeout=10))
    assert obs.output == "alive\n"
    await rt.close_session(CloseBashSessionRequest(session="intr"))


async def test_execute(service, sandbox):
    rt = runtime(service, sandbox.id)
    # exactly what mini-swe-agent's SWE-ReX environments send
    r = await rt.execute(
        Command(
            command="echo out; echo err >&2; echo $PWD; exit 4",
            shell=True,
            check=False,
            cwd="/tmp",
            timeout=30,
            merge_output_streams=True,
        )
    )
    assert (r.stdout, r.stderr, r.exit_code) == ("out\nerr\n/tmp\n", "", 4)
    r = await rt.execute(Command(command=["sh", "-c", "echo o; echo e >&2"]))
    assert (r.stdout, r.stderr, r.exit_code) == ("o\n", "e\n", 0)
    r = await rt.execute(Command(command=["printf", "%s|", "a b", "$HOME"], merge_output_streams=True))
    assert r.stdout == "a b|$HOME|"
    r = await rt.execute(Command(command="echo $GREETING", shell=True, env={"GREETING": "hello"}))
    assert r.stdout == "hello\n"
    with pytest.raises(NonZeroExitCodeError, match="custom"):
        await rt.execute(Command(command="exit 2", shell=True, check=True, error_msg="custom"))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command="sleep 30", shell=True, timeout=1))


def test_request_id_replay(service, sandbox):
    """A retried request (same X-Request-ID) gets the first answer and does not run twice."""
    url = f"{service.url}/swerex/{sandbox.id}/execute"
    body = {"command": "echo x >> /work/replay.txt; wc -l < /work/replay.txt", "shell": True}
    hdrs = {"X-API-Key": service.token, "X-Request-ID": "retry-1"}
    first = httpx.post(url, json=body, headers=hdrs, timeout=30)
    again = httpx.post(url, json=body, headers=hdrs, timeout=30)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json() == {"stdout": "1\n", "stderr": "", "exit_code": 0}
    assert sandbox.files.read("/work/replay.txt") == "x\n"
    # SWE-ReX errors travel as HTTP 511
    r = httpx.post(
        url, json={"command": "exit 5", "shell": True, "check": True}, headers=hdrs | {"X-Request-ID": "2"}
    )
    assert r.status_code == 511
    assert r.json()["swerexception"]["class_path"] == "swerex.exceptions.NonZeroExitCodeError"


async def test_files_and_upload(service, sandbox, tmp_path: Path):
    rt = runtime(service, sandbox.id)
    await rt.write_file(WriteFileRequest(path="/work/deep/dir/a.txt", content="héllo\nwörld\n"))
    assert (await rt.read_file(ReadFileRequest(path="/work/deep/dir/a.txt"))).content == "héllo\nwörld\n"
    # relative paths are relative to the sandbox's workdir (/work)
    assert (await rt.read_file(ReadFileRequest(path="deep/dir/a.txt"))).content == "héllo\nwörld\n"
    await rt.execute(Command(command="printf 'caf\\351\\r\\n' > /work/latin1.txt", shell=True, check=True))
    r = await rt.read_file(ReadFileRequest(path="/work/latin1.txt", encoding="latin-1"))
    assert r.content == "café\n"
    r = await rt.read_file(ReadFileRequest(path="/work/latin1.txt", errors="replace"))
    assert r.content == "caf\ufffd\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/work/missing.txt"))

    # a directory is zipped by the client and unpacked here
    src = tmp_path / "bundle"
    (src / "bin").mkdir(parents=True)
    (src / "README").write_text("read me\n")
    tool = src / "bin" / "tool"
    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    await rt.upload(UploadRequest(source_path=str(src), target_path="/opt/bundle"))
    r = await rt.execute(Command(command="cat /opt/bundle/README; /opt/bundle/bin/tool", shell=True))
    assert (r.stdout, r.exit_code) == ("read me\ntool ran\n", 0), r.stderr
    # a single file lands at target_path
    single = tmp_path / "one.txt"
    single.write_text("single\n")
    await rt.upload(UploadRequest(source_path=str(single), target_path="/work/up/renamed.txt"))
    assert sandbox.files.read("/work/up/renamed.txt") == "single\n"

    # the zip the client builds also works through the raw endpoint (unzip=true)
    zpath = tmp_path / "x.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("../../escape.txt", "inside\n")
        zf.writestr("sub/f.txt", "f\n")
    async with aiohttp.ClientSession() as http:
        data = aiohttp.FormData()
        data.add_field("file", zpath.read_bytes(), filename="x.zip")
        data.add_field("target_path", "/work/z")
        data.add_field("unzip", "true")
        async with http.post(
            f"{service.url}/swerex/{sandbox.id}/upload", data=data, headers={"X-API-Key": service.token}
        ) as resp:
            assert resp.status == 200, await resp.text()
    assert sandbox.files.read("/work/z/escape.txt") == "inside\n"
    assert sandbox.files.read("/work/z/sub/f.txt") == "f\n"


async def test_auth_and_project_scope(service, sandbox):
    bad = runtime(service, sandbox.id, token="not-a-token")
    alive = await bad.is_alive()
    assert not alive.is_alive and "401" in alive.message
    with pytest.raises(aiohttp.ClientResponseError) as ei:
        await bad.execute(Command(command="touch /work/pwned", shell=True))
    assert ei.value.status == 401
    no_key = httpx.post(f"{service.url}/swerex/{sandbox.id}/execute", json={"command": "true"})
    assert no_key.status_code == 401

    admin = {"Authorization": f"Bearer {service.token}"}
    with httpx.Client(base_url=service.url, headers=admin, timeout=60) as http:
        assert http.post("/v1/projects", json={"name": "swerex-other"}).status_code == 200
        tok = http.post("/v1/principals", json={"name": "swerex-other-user", "projects": ["swerex-other"]})
        token = tok.json()["token"]
    other = runtime(service, sandbox.id, token=token)
    alive = await other.is_alive()
    assert not alive.is_alive and "404" in alive.message
    with pytest.raises(aiohttp.ClientResponseError) as ei:
        await other.execute(Command(command="touch /work/pwned", shell=True))
    assert ei.value.status == 404
    with pytest.raises(aiohttp.ClientResponseError):
        await other.write_file(WriteFileRequest(path="/work/pwned", content="x"))
    with pytest.raises(aiohttp.ClientResponseError):
        await other.create_session(CreateBashSessionRequest(session="evil"))
    # indistinguishable from a sandbox that never existed
    ghost = runtime(service, sandbox.id[:-4] + "zzzz", token=token)
    with pytest.raises(aiohttp.ClientResponseError) as ei2:
        await ghost.execute(Command(command="true", shell=True))
    assert ei2.value.status == 404
    assert sandbox.exec("ls /work/pwned || echo absent").stdout.strip().endswith("absent")


async def test_mini_swe_agent_environment(service, sandbox):
    """mini-swe-agent's SWE-ReX environments only build Docker/Modal deployments, but
    all they use of one is `.runtime.execute(...)`: hand the real class a
    `RemoteDeployment` pointed at dsec (mini-swe-agent is a dev dependency).
    It calls asyncio.run itself, so it runs in a worker thread here."""
    import minisweagent.environments.extra.swerex_docker as swerex_docker
    from swerex.deployment.remote import RemoteDeployment

    env = object.__new__(swerex_docker.SwerexDockerEnvironment)
    env.config = swerex_docker.SwerexDockerEnvironmentConfig(image="unused", cwd="/tmp", timeout=5)
    env.deployment = RemoteDeployment(host=f"{service.url}/swerex/{sandbox.id}", auth_token=service.token)
    await env.deployment.start()
    out = await asyncio.to_thread(env.execute, {"command": "echo $PWD; echo oops >&2; exit 1"})
    assert (out["output"], out["returncode"]) == ("/tmp\noops\n", 1)
    out = await asyncio.to_thread(env.execute, {"command": "sleep 30"}, timeout=1)
    assert out["returncode"] == -1 and out["extra"]["exception_type"] == "CommandTimeoutError"
    await env.deployment.stop()  # POST /close: the sandbox keeps running
    assert sandbox.exec("true").exit_code == 0
