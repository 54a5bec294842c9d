"""`dsec cluster up`: a whole cluster on this machine, each edge a host of its own (what `kind`
is to Kubernetes), for users trying the cluster and for tests.

    host network namespace                         one namespace per edge ("a host")
    ---------------------------------------------  --------------------------------------
    PostgreSQL (127.0.0.1:P, postgres user)         dsec edge (nsenter --net only: the
    registry (bridge address :R)                      (images and snapshots between edges)
    apiserver x N  (bridge address :Pi)  <-------->   host's mounts and cgroups, its own
    bridge dsecc<id> 10.231.K.1/24  --- veth --->     network: eth0 10.231.K.(10+j)/24,
                                                      its own data dir and layer store)

The cluster's directory is root's alone (0700, as /var/lib/dsec, where it is by default).
PostgreSQL and the registry run as users of their own (postgres, docker-registry), so their
data is elsewhere: in /var/lib/dsec-servers/<cluster>/ (`servers_dir`), which only root
writes and others may traverse, each server's own directory in it closed to everyone else.

Every process is started here, in a session of its own, logging into <dir>/logs; their pids
(of the processes themselves, so a test can kill one), the namespaces, the bridge, the
addresses and the admin token are written to <dir>/cluster.json, which `dsec cluster down`
reads to remove everything `up` made (processes by pid, after checking they are still ours).
An edge's layer store starts as a hard-link copy of this host's (a node provisioned with its
images); each edge keeps its own from then on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import itertools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dsec.cluster.postgres import PostgresServer
from dsec.cluster.registry import RegistryServer
from dsec.errors import Conflict, InvalidRequest, Unavailable
from dsec.privatefs import private_dir

EDGE_PORT = 8421
STATE = "cluster.json"
SERVERS_HOME = Path("/var/lib/dsec-servers")


@dataclass
class Member:
    name: str
    pid: int
    url: str = ""
    netns: str = ""
    address: str = ""
    veth: str = ""


@dataclass
class ClusterState:
    id: str
    dir: str
    bridge: str
    subnet: str
    database: str
    token: str  # the admin token
    cluster_token: str
    postgres: dict[str, Any]
    run_dir: str
    registry: str | None = None
    registry_pid: int = 0
    apiservers: list[Member] = field(default_factory=list)
    edges: list[Member] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # given to up; edges added later get it too
    next_edge: int = 0  # the index of the next edge's name (never reused: add_edge, remove_edge)
    seed_layers: str = "/var/lib/dsec/layers"  # what every edge's layer store starts as
    servers: str = ""  # PostgreSQL's and the registry's data (servers_dir); "" before it existed

    def save(self) -> None:
        path = Path(self.dir) / STATE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, d: Path) -> ClusterState:
        try:
            raw = json.loads((d / STATE).read_text())
        except (OSError, ValueError) as e:
            raise InvalidRequest(
                f"no cluster in {d} ({e}): start one with `dsec cluster up --dir {d}`"
            ) from e
        raw["apiservers"] = [Member(**m) for m in raw["apiservers"]]
        raw["edges"] = [Member(**m) for m in raw["edges"]]
        return cls(**raw)

    def public(self) -> dict[str, Any]:
        """What `dsec cluster up --json` prints."""
        return {
            "apiservers": [{"url": a.url, "pid": a.pid} for a in self.apiservers],
            "edges": [
                {"name": e.name, "pid": e.pid, "netns": e.netns, "address": e.address} for e in self.edges
            ],
            "token": self.token,
            "database": self.database,
            "registry": self.registry,
        }


PYTHON = [sys.executable, "-m", "dsec.cli"]
PLATFORM_ENV = "DSEC_PLATFORM_ADDRESSES"  # (dsec.isolation.netpolicy: what no sandbox may reach)


def _base_env(state: ClusterState) -> dict[str, str]:
    """Every process's environment: ours, what `up` was given, the cluster's token, database
    and directory (an apiserver whose node provider is `local` adds edges to it)."""
    env = {
        **os.environ,
        **state.env,
        "DSEC_CLUSTER_TOKEN": state.cluster_token,
        "DSEC_DATABASE": state.database,
        "DSEC_APISERVER_CLUSTER_DIR": state.dir,
    }
    if state.registry:  # (placement reads the layers of images no edge holds from it)
        env["DSEC_APISERVER_REGISTRY"] = state.registry
    return env


def _start_edge(state: ClusterState) -> Member:
    """Start one more edge: a namespace joined to the bridge, its own data dir and layer store,
    the process (recorded in cluster.json at once, so `down` finds it whatever happens next)."""
    d = Path(state.dir)
    subnet = ipaddress.IPv4Network(state.subnet)
    hosts = list(subnet.hosts())
    bridge_ip = str(hosts[0])
    taken = {e.address for e in state.edges}
    free = [str(h) for h in hosts[9:] if str(h) not in taken]
    if not free:
        raise Unavailable(f"no free address left in {subnet} for another edge")
    j = state.next_edge
    state.next_edge += 1
    name = f"c{state.id}e{j}"
    ns, veth, addr = f"dsec-{name}", f"dsv{state.id}{j}", free[0]
    _ip("netns", "add", ns)
    member = Member(name, 0, url=f"http://{addr}:{EDGE_PORT}", netns=ns, address=addr, veth=veth)
    state.edges.append(member)
    state.save()  # (the namespace is ours from here: down removes it)
    _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _ip("link", "set", veth, "master", state.bridge, "up")
    _ip("-n", ns, "addr", "add", f"{addr}/{subnet.prefixlen}", "dev", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("-n", ns, "route", "add", "default", "via", bridge_ip)
    home = d / "edges" / name
    home.mkdir(parents=True, exist_ok=True)
    seed = Path(state.seed_layers)
    if seed.is_dir() and not (home / "layers").exists():
        subprocess.run(["cp", "-al", str(seed), str(home / "layers")], check=True)
    edge_env = {**_base_env(state), "DSEC_EDGE_LAYERS_DIR": str(home / "layers")}
    edge_env.pop("DSEC_DATABASE")
    # No sandbox, whatever its policy, may reach the cluster's other members (apiservers,
    # PostgreSQL, the registry, the other edges: all on the bridge's subnet) nor the machine
    # that hosts them (it plays every other host: its own addresses, sshd and all).
    edge_env[PLATFORM_ENV] = " ".join(
        filter(None, [edge_env.get(PLATFORM_ENV, ""), state.subnet, *_host_addresses()])
    )
    if state.registry:
        edge_env["DSEC_EDGE_REGISTRY"] = state.registry
    args = ["edge", *[a for api in state.apiservers for a in ("--apiserver", api.url)],
            "--name", name, "--host", addr, "--port", str(EDGE_PORT),
            "--url", member.url, "--data-dir", str(home),
            "--run-dir", state.run_dir, "--no-keep-sandboxes"]  # fmt: skip
    # only the network namespace: the host's mounts and cgroups, as a node's own
    argv = ["nsenter", f"--net=/run/netns/{ns}", "--", *PYTHON, *args]
    member.pid = _spawn(argv, edge_env, d / "logs" / f"{name}.log").pid
    state.save()
    return member


@contextlib.contextmanager
def _locked(d: Path, timeout: float = 120.0, *, new: bool = False) -> Iterator[None]:
    """One change of a cluster's state at a time (up, add_edge, remove_edge, down)."""
    if not new and not (d / STATE).exists():
        raise InvalidRequest(f"no cluster in {d}: start one with `dsec cluster up --dir {d}`")
    with open(d / "cluster.lock", "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"the cluster in {d} is busy (another add, remove or down)") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def add_edge(d: Path, n: int = 1, *, wait_s: float = 0.0) -> list[Member]:
    """Add `n` edges to the running cluster in `d` (each as `up` makes them); with `wait_s`,
    wait that long for every apiserver to see them healthy."""
    if not 1 <= n <= 64:
        raise InvalidRequest(f"add 1-64 edges at a time, not {n}")
    with _locked(d):
        state = ClusterState.load(d)
        if len(state.edges) + n > 64:
            raise InvalidRequest(f"a local cluster has at most 64 edges ({len(state.edges)} run)")
        added = [_start_edge(state) for _ in range(n)]
    if wait_s > 0:
        _wait_registered(state, [m.name for m in added], wait_s)
    return added


def remove_edge(d: Path, name: str) -> bool:
    """Stop edge `name` of the cluster in `d` (it stops its sandboxes), remove its namespace,
    its link, its mounts and its data; False if the cluster has no such edge."""
    with _locked(d):
        state = ClusterState.load(d)
        member = next((e for e in state.edges if e.name == name), None)
        if member is None:
            return False
        _stop([member], "edge")
        remove_edge_leftovers(name)  # (an edge that had died could not stop its own)
        _ip("netns", "del", member.netns, check=False)
        _ip("link", "del", member.veth, check=False)
        _unmount_under(Path(state.run_dir) / name)
        shutil.rmtree(Path(state.run_dir) / name, ignore_errors=True)
        shutil.rmtree(d / "edges" / name, ignore_errors=True)
        state.edges = [e for e in state.edges if e.name != name]
        state.save()
    return True


def _wait_registered(state: ClusterState, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {state.token}"}
    for api in state.apiservers:
        if not _ours(api.pid, "apiserver"):
            continue  # (an apiserver that died sees no edge: the others still do)
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(api.url + "/v1/edges", headers=headers, timeout=2)
                seen = {e["name"] for e in r.json().get("edges", []) if e.get("healthy")}
                if r.status_code == 200 and set(names) <= seen:
                    break
            if time.monotonic() > deadline:
                raise Unavailable(f"{api.url} did not see edges {names} within {timeout:.0f} s")
            time.sleep(0.2)


def _unmount_under(path: Path) -> None:
    from dsec.isolation.procs import mounts_under, unmount_all

    for m in sorted(mounts_under(path), key=len, reverse=True):
        unmount_all(Path(m))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise Unavailable(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


def _host_addresses() -> list[str]:
    """This machine's IPv4 addresses outside loopback (a sandbox's loopback is its own)."""
    out = _ip("-4", "-o", "addr").stdout.split()
    addrs = {ipaddress.IPv4Interface(w).ip for prev, w in itertools.pairwise(out) if prev == "inet"}
    return sorted(str(a) for a in addrs if not a.is_loopback)


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("-4", "-o", "addr").stdout
    for k in range(1, 255):
        net = ipaddress.IPv4Network(f"10.231.{k}.0/24")
        if f" 10.231.{k}." not in used:
            return net
    raise Unavailable("no free /24 in 10.231.0.0/16 for the cluster's bridge")


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}  # what this process started, until _stop reaps it


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        p = subprocess.Popen(
            argv,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _CHILDREN[p.pid] = p  # (a Popen dropped while its process runs warns)
    return p


def _ours(pid: int, needle: str) -> bool:
    """Whether `pid` still runs a command line holding `needle` (not a reused pid)."""
    try:
        return needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def up(
    d: Path,
    *,
    apiservers: int = 1,
    edges: int = 1,
    seed_layers: Path = Path("/var/lib/dsec/layers"),
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> ClusterState:
    """Start a cluster in `d` (see the module); its state, also in <d>/cluster.json."""
    if os.geteuid() != 0:
        raise InvalidRequest("dsec cluster up needs root (network namespaces, a bridge, cgroups)")
    if not 1 <= apiservers <= 16 or not 1 <= edges <= 64:
        raise InvalidRequest("a local cluster has 1-16 apiservers and 1-64 edges")
    if (d / STATE).exists():
        raise Conflict(f"a cluster already runs from {d}: `dsec cluster down --dir {d}` first")
    private_dir(d)
    private_dir(d / "logs")
    cid = secrets.token_hex(2)
    subnet = _free_subnet()
    with _locked(d, new=True):
        return _up(d, cid, subnet, apiservers, edges, seed_layers, env, timeout)


def _up(
    d: Path,
    cid: str,
    subnet: ipaddress.IPv4Network,
    apiservers: int,
    edges: int,
    seed_layers: Path,
    env: dict[str, str] | None,
    timeout: float,
) -> ClusterState:
    hosts = list(subnet.hosts())
    bridge_ip = str(hosts[0])
    state = ClusterState(
        id=cid, dir=str(d), bridge=f"dsecc{cid}", subnet=str(subnet), database="", token="",
        cluster_token="dsec_" + secrets.token_urlsafe(32), postgres={}, run_dir=f"/run/dsec-c{cid}",
        env=dict(env or {}), seed_layers=str(seed_layers),
    )  # fmt: skip
    servers = servers_dir(d)
    state.servers = str(servers)
    made_servers = not (servers / "pg").exists()  # (else a database kept by a down: reused)
    try:
        _ip("link", "add", state.bridge, "type", "bridge")
        _ip("addr", "add", f"{bridge_ip}/{subnet.prefixlen}", "dev", state.bridge)
        _ip("link", "set", state.bridge, "up")
        state.save()
        pg = PostgresServer(servers / "pg", port=_free_port("127.0.0.1"))
        pg.start()
        state.postgres = {"root": str(pg.root), "port": pg.port, "pid": pg.pid}
        state.database = pg.create_database("dsec")
        state.save()
        # Images and snapshots travel between the edges only through it.
        reg = RegistryServer(servers / "registry", host=bridge_ip, port=_free_port(bridge_ip))
        reg.start()
        state.registry = reg.url
        state.registry_pid = reg.pid
        state.save()
        base = _base_env(state)
        for i in range(apiservers):
            port = _free_port(bridge_ip)
            args = ["apiserver", "--host", bridge_ip, "--port", str(port), "--data-dir", str(d / f"api{i}")]
            p = _spawn([*PYTHON, *args], base, d / "logs" / f"api{i}.log")
            state.apiservers.append(Member(f"api{i}", p.pid, url=f"http://{bridge_ip}:{port}"))
            state.save()
        for _ in range(edges):
            _start_edge(state)
        _wait_healthy(state, edges, timeout)
        admin = None
        deadline = time.monotonic() + 30
        while admin is None and time.monotonic() < deadline:
            for i in range(apiservers):
                f = d / f"api{i}" / "admin-token"
                if f.exists():
                    admin = f.read_text().strip()
            time.sleep(0.05)
        if admin is None:
            raise Unavailable("no apiserver issued the admin token (see the logs in " + str(d / "logs") + ")")
        state.token = admin
        state.save()
    except BaseException:
        with contextlib.suppress(Exception):
            _down(d, purge=False)
        if made_servers:  # (nothing of a failed first start stays outside `d`)
            shutil.rmtree(servers, ignore_errors=True)
        raise
    return state


def servers_dir(d: Path, home: Path = SERVERS_HOME) -> Path:
    """Where the cluster in `d` keeps the data of the servers that run as users of their own
    (PostgreSQL, the registry): not in `d`, which is root's alone, but in `home`/<name>, made
    here root's and 0755 (each server closes its own directory in it). One per cluster
    directory: a cluster brought down without --purge finds its database there again."""
    key = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:12]
    path = home / f"{d.name}-{key}"
    for p in (home, path):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=0o755)
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise InvalidRequest(
                f"{p} is not a directory of root's: remove it, dsec cluster up makes it "
                "(PostgreSQL's and the registry's data)"
            )
        os.chmod(p, 0o755, follow_symlinks=False)
    return path


def _wait_healthy(state: ClusterState, edges: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for api in state.apiservers:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(api.url + "/v1/health", timeout=2)
                if r.status_code == 200 and r.json().get("edges", 0) >= edges:
                    break
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"{api.url} did not see {edges} healthy edges within {timeout:.0f} s "
                    f"(logs: {state.dir}/logs)"
                )
            for m in [*state.apiservers, *state.edges]:
                if not Path(f"/proc/{m.pid}").exists():
                    raise Unavailable(f"{m.name} exited at start: see {state.dir}/logs/{m.name}.log")
            time.sleep(0.1)


def _stop(members: list[Member], needle: str, timeout: float = 60.0) -> None:
    """SIGTERM each member that is still ours, then SIGKILL what lingers; reap our children."""
    live = [m for m in members if _ours(m.pid, needle)]
    for m in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(m.pid, signal.SIGCONT)  # (a stopped process cannot act on SIGTERM)
            os.kill(m.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for m in live:
        while _ours(m.pid, needle) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(m.pid, os.WNOHANG)[0] == m.pid:
                    break
            time.sleep(0.05)
        if _ours(m.pid, needle):
            with contextlib.suppress(ProcessLookupError):
                os.kill(m.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(m.pid, 0)
    for m in members:
        child = _CHILDREN.pop(m.pid, None)
        if child is not None:
            child.poll()  # (reaped above: it records the exit, so nothing warns)


def remove_edge_leftovers(edge: str) -> list[str]:
    """What a dead edge left running on this host: its sandboxes' cgroups and every process
    in them (shims, runsc, QEMU), killed and removed. The ids of the sandboxes."""
    from dsec.isolation.cgroups import PARENT, CgroupHost

    host = CgroupHost.detect()
    ids = {p.name for h in host.hierarchies() for p in (h / PARENT).glob(f"{edge}-*") if p.is_dir()}
    for sid in sorted(ids):
        with contextlib.suppress(OSError):
            host.remove_sandbox(sid)
    host.remove_parent_if_empty()  # (as an edge does when it stops: no other sandbox left)
    return sorted(ids)


def down(d: Path, *, purge: bool = False) -> None:
    """Remove everything `up` made in `d`: edges (they stop their sandboxes; the sandboxes of
    an edge that died are killed here), apiservers, PostgreSQL, the registry, the namespaces,
    the bridge, the run directory; with `purge`, `d` too."""
    with _locked(d):
        _down(d, purge)


def _down(d: Path, purge: bool) -> None:
    state = ClusterState.load(d)
    _stop(state.edges, "edge")
    for e in state.edges:
        remove_edge_leftovers(e.name)
    _stop(state.apiservers, "apiserver")
    if state.postgres:
        pg = PostgresServer(Path(state.postgres["root"]), port=int(state.postgres["port"]))
        with contextlib.suppress(Exception):
            pg_ctl = [str(pg.bin / "pg_ctl"), "-D", str(pg.data), "stop", "-m", "fast"]
            runuser = ["runuser", "-u", "postgres", "--"]
            subprocess.run([*runuser, *pg_ctl], capture_output=True, check=False, timeout=60)
    if state.registry_pid and _ours(state.registry_pid, "registry"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.registry_pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _ours(state.registry_pid, "registry") and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            if _ours(state.registry_pid, "registry"):
                os.kill(state.registry_pid, signal.SIGKILL)
    for e in state.edges:
        _ip("netns", "del", e.netns, check=False)
        _ip("link", "del", e.veth, check=False)
    _ip("link", "del", state.bridge, check=False)
    run = Path(state.run_dir)
    if run.exists():
        _unmount_under(run)
        shutil.rmtree(run, ignore_errors=True)
    (d / STATE).unlink(missing_ok=True)
    (d / "cluster.lock").unlink(missing_ok=True)
    if purge:
        shutil.rmtree(d, ignore_errors=True)
        if state.servers:
            shutil.rmtree(state.servers, ignore_errors=True)
