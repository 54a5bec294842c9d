"""A client given several apiservers keeps working for every call after one dies (issue #25,
item 9), on real HTTP servers on loopback (fake_apiserver.py, killed with SIGKILL):

- a call that could not connect is sent to the next apiserver, whatever it is;
- a call the dead apiserver may have taken is sent again only if it is idempotent (or carries
  an idempotency key), and the next call goes to the live apiserver all the same;
- a connection kept alive to the dead apiserver is not used again;
- the CLI (DSEC_URL=a,b) does the same.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.client import AsyncClient, AsyncSession, Client, Session
from dsec.client._async import AsyncFiles, AsyncSandbox
from dsec.client._sync import Files, Sandbox
from dsec.models import Entry, SessionInfo, Trajectory, TrajectoryStats

FAKE = Path(__file__).with_name("fake_apiserver.py")


@dataclass
class Fake:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def requests(self) -> list[dict[str, str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Callable[..., list[Fake]]]:
    """Start `n` fake apiservers (in parallel), each cutting off every request from number
    `cut_from` on if given; all ended afterwards."""
    started: list[Fake] = []

    def start(n: int = 1, cut_from: int = 0) -> list[Fake]:
        batch = []
        for _ in range(n):
            log = tmp_path / f"requests-{len(started)}.jsonl"
            log.touch()
            argv = [sys.executable, str(FAKE), str(log), str(cut_from)]
            started.append(Fake(subprocess.Popen(argv, stdout=subprocess.PIPE), log))
            batch.append(started[-1])
        for f in batch:
            assert f.proc.stdout is not None
            f.url = f"http://127.0.0.1:{int(f.proc.stdout.readline())}"
        return batch

    yield start
    for f in started:
        if f.proc.poll() is None:
            f.kill()
        assert f.proc.stdout is not None
        f.proc.stdout.close()


# Every call of the SDK with whether it may be sent twice: (name, call, idempotent). A call is
# given the client, a sandbox handle, a session handle and a directory.
Op = Callable[[Any, Any, Any, Path], Any]
REPLAYED = Trajectory(
    entries=[
        Entry(
            sandbox_id="old",
            seq=1,
            kind="exec",
            action={"op": "exec", "cmd": "true"},
            observation=None,
            timings={},
            trajectory="t",
            step=1,
            recorded_at=1.0,
        )
    ],
    stats=TrajectoryStats(acknowledged=1, recorded=1, lost=0, pending=0),
)


def _plain(owner: str, names: str, idempotent: bool) -> list[tuple[str, Op, bool]]:
    """The calls `names` that take no argument, of the client or of a sandbox."""

    def call(name: str) -> Op:
        return lambda c, sb, se, d: getattr(c if owner == "Client" else sb, name)()

    return [(f"{owner}.{n}", call(n), idempotent) for n in names.split()]


CALLS: list[tuple[str, Op, bool]] = [
    *_plain(
        "Client", "list images backends edges health version whoami snapshots checkpoints capacity", True
    ),
    *_plain("Client", "rotate_token", False),
    *_plain("Sandbox", "sessions pause resume network trajectory trajectory_export refresh stop", True),
    *_plain("Sandbox", "session snapshot fork checkpoint", False),
    ("Client.create", lambda c, sb, se, d: c.create("python"), True),
    ("Client.create_many", lambda c, sb, se, d: c.create_many(2), False),
    ("Client.get", lambda c, sb, se, d: c.get("sb1"), True),
    ("Client.stop_many", lambda c, sb, se, d: c.stop_many(["sb1"]), True),
    ("Client.revoke_token", lambda c, sb, se, d: c.revoke_token("u2"), False),
    ("Client.pause_project", lambda c, sb, se, d: c.pause_project("p"), True),
    ("Client.delete_snapshot", lambda c, sb, se, d: c.delete_snapshot("snap1"), True),
    ("Client.restore", lambda c, sb, se, d: c.restore("ck1"), False),
    ("Client.delete_checkpoint", lambda c, sb, se, d: c.delete_checkpoint("ck1"), True),
    ("Client.announce_capacity", lambda c, sb, se, d: c.announce_capacity("p", 1), False),
    ("Client.cancel_capacity", lambda c, sb, se, d: c.cancel_capacity("b1"), True),
    ("Client.image", lambda c, sb, se, d: c.image("p/x:1"), True),
    ("Client.delete_image", lambda c, sb, se, d: c.delete_image("p/x:1"), True),
    ("Client.build_image", lambda c, sb, se, d: c.build_image(FAKE.parent, "x:1", project="p"), False),
    ("Client.pull_image", lambda c, sb, se, d: c.pull_image("docker.io/library/x:1", project="p"), True),
    ("Client.set_registry_login", lambda c, sb, se, d: c.set_registry_login("p", "ghcr.io", "u", "pw"), True),
    ("Client.registry_logins", lambda c, sb, se, d: c.registry_logins("p"), True),
    ("Client.delete_registry_login", lambda c, sb, se, d: c.delete_registry_login("p", "ghcr.io"), True),
    ("Client.drain_edge", lambda c, sb, se, d: c.drain_edge("n0"), True),
    ("Client.undrain_edge", lambda c, sb, se, d: c.undrain_edge("n0"), True),
    ("Client.prewarm", lambda c, sb, se, d: c.prewarm(1), False),
    ("Sandbox.exec", lambda c, sb, se, d: sb.exec("echo ok"), False),
    ("Sandbox.exec+step", lambda c, sb, se, d: sb.exec("echo ok", step=("t", 1)), True),
    ("Sandbox.exec_stream", lambda c, sb, se, d: sb.exec_stream("echo ok"), False),
    ("Sandbox.set_network", lambda c, sb, se, d: sb.set_network(None), True),
    ("Sandbox.protect", lambda c, sb, se, d: sb.protect(["/work/g"]), False),
    ("Sandbox.verify", lambda c, sb, se, d: sb.verify("true"), False),
    ("Sandbox.replay", lambda c, sb, se, d: sb.replay(REPLAYED), True),  # its execs carry their step
    ("Session.run", lambda c, sb, se, d: se.run("echo ok"), False),
    ("Session.run+step", lambda c, sb, se, d: se.run("echo ok", step=("t", 2)), True),
    ("Session.close", lambda c, sb, se, d: se.close(), True),
    ("Files.read", lambda c, sb, se, d: sb.files.read("/work/a"), True),
    ("Files.read_bytes", lambda c, sb, se, d: sb.files.read_bytes("/work/a"), True),
    ("Files.write", lambda c, sb, se, d: sb.files.write("/work/a", "ok"), True),
    ("Files.edit", lambda c, sb, se, d: sb.files.edit("/work/a", "o", "k"), False),
    ("Files.edit+step", lambda c, sb, se, d: sb.files.edit("/work/a", "o", "k", step=("t", 3)), True),
    ("Files.list", lambda c, sb, se, d: sb.files.list("/work"), True),
    ("Files.stat", lambda c, sb, se, d: sb.files.stat("/work/a"), True),
    ("Files.delete", lambda c, sb, se, d: sb.files.delete("/work/a"), True),
    ("Files.upload", lambda c, sb, se, d: sb.files.upload(FAKE, "/work"), True),
    ("Files.upload_tar", lambda c, sb, se, d: sb.files.upload_tar(b"\0" * 1024, "/work"), True),
    ("Files.download", lambda c, sb, se, d: sb.files.download("/work/a", d / "down"), True),
    ("Files.download_tar", lambda c, sb, se, d: sb.files.download_tar("/work/a"), True),
]
NO_REQUEST = {"Client.sandbox", "Client.close", "Client.aclose"}  # (a handle; the end of the client)


def test_the_table_holds_every_call_of_both_sdks() -> None:
    named = {name.split("+")[0] for name, _, _ in CALLS}
    for classes in ((Client, Sandbox, Session, Files), (AsyncClient, AsyncSandbox, AsyncSession, AsyncFiles)):
        offered = {
            f"{cls.__name__.removeprefix('Async')}.{n}"
            for cls in classes
            for n, f in vars(cls).items()
            if callable(f) and not n.startswith("_")
        }
        assert offered - NO_REQUEST == named


@pytest.fixture(params=["sync", "async"])
async def connect(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[list[str]], Any]]:
    """Make a sync or async client of these apiservers; closed afterwards."""
    made: list[Any] = []

    def connect(urls: list[str]) -> Any:
        made.append((Client if request.param == "sync" else AsyncClient)(urls, "tok"))
        return made[-1]

    yield connect
    for client in made:
        if isinstance(client, Client):
            client.close()
        else:
            await client.aclose()


async def _run(op: Op, client: Any, tmp: Path) -> Any:
    """One call through the sync or async client: awaited, its stream read to the end."""
    sb = client.sandbox("sb1")
    info = SessionInfo(id="s1", kind="bash")
    se = (Session if isinstance(client, Client) else AsyncSession)(client, "sb1", info)
    result = op(client, sb, se, tmp)
    if inspect.isawaitable(result):
        return await result
    if hasattr(result, "__aiter__"):
        return [item async for item in result]
    if isinstance(result, Iterator):
        return list(result)
    return result


def _back_to_first(client: Any) -> None:
    """Point the client at its first apiserver again: as any client that has not met its
    death (or cut) yet, for the next call under test."""
    client._base.current = 0


async def test_every_call_goes_to_the_live_apiserver_when_the_first_is_dead(
    connect: Callable[[list[str]], Any], fakes: Callable[..., list[Fake]], tmp_path: Path
) -> None:
    """Each call, sent while the client still points at the killed apiserver, finds its port
    closed, is sent to the next one, once, and succeeds; the client stays there."""
    a, b = fakes(2)
    a.kill()
    client = connect([a.url, b.url])
    for name, op, _ in CALLS:
        _back_to_first(client)
        before = len(b.requests())
        await _run(op, client, tmp_path)
        assert len(b.requests()) == before + 1, name
        assert client.url == b.url, name


async def test_a_call_the_first_apiserver_took_is_repeated_only_if_idempotent(
    connect: Callable[[list[str]], Any], fakes: Callable[..., list[Fake]], tmp_path: Path
) -> None:
    """Apiserver a takes the call and its connection closes with no answer (as when a is
    killed then): an idempotent call is sent to b and succeeds; any other fails `unavailable`
    and is not sent again. Either way the next call goes straight to b."""
    a = fakes(1, cut_from=2)[0]  # the first request (a version()) is answered
    b = fakes(1)[0]
    client = connect([a.url, b.url])
    await _run(lambda c, sb, se, d: c.version(), client, tmp_path)
    for name, op, idempotent in CALLS:
        _back_to_first(client)
        before, taken = len(b.requests()), len(a.requests())
        if idempotent:
            await _run(op, client, tmp_path)
        else:
            with pytest.raises(errors.Unavailable, match=f"cannot reach dsec at {a.url}"):
                await _run(op, client, tmp_path)
        (took,) = a.requests()[taken:]
        assert [(r["method"], r["path"]) for r in b.requests()[before:]] == (
            [(took["method"], took["path"])] if idempotent else []
        ), name
        assert client.url == b.url, name
        await _run(lambda c, sb, se, d: c.health(), client, tmp_path)
        assert b.requests()[-1]["path"] == "/v1/health" and len(a.requests()) == taken + 1, name


async def test_a_connection_kept_alive_to_a_killed_apiserver_is_not_used_again(
    connect: Callable[[list[str]], Any], fakes: Callable[..., list[Fake]], tmp_path: Path
) -> None:
    """The client holds idle keep-alive connections to apiserver a when a is killed; the next
    call (an exec: not repeatable) must not be written into one of them, where it would be
    lost with no way to tell it from one a took, but go to b."""
    a, b = fakes(2)
    client = connect([a.url, b.url])
    for _ in range(3):
        await _run(lambda c, sb, se, d: c.version(), client, tmp_path)
    a.kill()  # (an asyncio client's loop has not run since: it has not seen the close)
    result = await _run(lambda c, sb, se, d: sb.exec("echo ok"), client, tmp_path)
    assert result.stdout == "ok\n"
    assert b.requests()[-1]["path"] == "/v1/sandboxes/sb1/exec"
    assert [r["path"] for r in a.requests()] == ["/v1/version"] * 3


def test_the_cli_goes_to_the_next_apiserver_of_dsec_url(fakes: Callable[..., list[Fake]]) -> None:
    a, b = fakes(2)
    a.kill()
    env = {**os.environ, "DSEC_URL": f"{a.url},{b.url}", "DSEC_TOKEN": "tok"}
    run = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "sandbox", "exec", "sb1", "echo ok", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["stdout"] == "ok\n"
    assert [r["path"] for r in b.requests()] == ["/v1/sandboxes/sb1/exec"]
