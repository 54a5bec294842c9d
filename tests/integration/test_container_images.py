"""The Kubernetes deployment's images, built and run for real (opt-in: DSEC_TEST_IMAGES=1).

deploy/build-images builds both images (minutes the first time: a Debian base from the mirror
when Docker Hub is out of reach, apt, pip; seconds from its cache after), then:

- the apiserver image runs as its manifest runs it (uid 10001, read-only root, no
  capabilities, the manifest's args, emptyDirs as tmpfs) against a real PostgreSQL: the path
  its probes hit answers, the admin token it issues works for an admin call;
- the edge image's entrypoint names nodes as on the host and carries `dsec edge`;
- the edge image runs as the DaemonSet runs it (privileged, the node's PID namespace, its
  manifest's host paths, its own network namespace on podman's bridge, the manifest's args
  and env), registers with the apiserver container, and runs a sandbox created through the
  apiserver; the sandbox survives an edge container restart (the reason for hostPID and the
  run dir's Bidirectional propagation, emulated with a shared bind mount) and is stopped.

The edge's node directory (/var/lib/dsec, or $DSEC_TEST_IMAGES_DATA_DIR) is set up first by
the DaemonSet's init container, `dsec-k8s-edge setup` (seconds where install.sh or an earlier
run did it; minutes on an empty directory).

Needs root, podman, mmdebstrap or a pullable debian:bookworm-slim, and PostgreSQL. Everything
started is removed: containers, the sandboxes' cgroups, mounts, the edge's records.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BUILD_IMAGES = ROOT / "deploy" / "build-images"
K8S = ROOT / "deploy" / "kubernetes"
ENTRYPOINT = ROOT / "deploy" / "container" / "dsec-k8s-edge"
EDGE_IMAGE = "ghcr.io/dsec/dsec:latest"
APISERVER_IMAGE = "ghcr.io/dsec/dsec-apiserver:latest"
NODE_DATA = Path(os.environ.get("DSEC_TEST_IMAGES_DATA_DIR", "/var/lib/dsec"))  # hostPath var-lib-dsec

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DSEC_TEST_IMAGES") != "1",
        reason="builds and runs the container images (minutes): set DSEC_TEST_IMAGES=1",
    ),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (privileged edge container, mounts)"),
    pytest.mark.timeout(1800),
]


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(file: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((K8S / file).read_text()):
        if doc and doc["kind"] in ("Deployment", "DaemonSet"):
            return dict(doc)
    raise AssertionError(f"no workload in {file}")


def container_of(file: str, name: str) -> dict[str, Any]:
    (c,) = [c for c in workload(file)["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return dict(c)


def replace_arg(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def wait_http(url: str, timeout: float = 120, ok: int = 200) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=3)
            if r.status_code == ok:
                return r
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer {ok} in {timeout} s: {last}")


@pytest.fixture(scope="module")
def run_opts() -> list[str]:
    """Build both images (idempotent); the engine options containers need on this host."""
    t = time.monotonic()
    subprocess.run([str(BUILD_IMAGES)], check=True, timeout=1500)
    print(f"deploy/build-images: {time.monotonic() - t:.0f} s")
    out = subprocess.run(
        [str(BUILD_IMAGES), "--print-run-opts"], capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout.split()


@contextlib.contextmanager
def started(opts: list[str], *args: str) -> Iterator[str]:
    """A detached container, removed afterwards (its logs printed if the test failed)."""
    cid = podman("run", "-d", *opts, *args).stdout.strip()
    try:
        yield cid
    finally:
        print(podman("logs", "--tail", "40", cid, check=False).stderr)
        podman("rm", "-f", "-t", "60", cid, check=False)


@contextlib.contextmanager
def apiserver_container(opts: list[str], database: str, token: str, host: str) -> Iterator[str]:
    """The apiserver image as apiserver.yaml runs it, on the host's network at host:port;
    yields its URL."""
    c = container_of("apiserver.yaml", "apiserver")
    sec = c["securityContext"]
    assert sec["readOnlyRootFilesystem"] and sec["capabilities"]["drop"] == ["ALL"]
    assert not sec["allowPrivilegeEscalation"]
    port = free_port()
    args = replace_arg(replace_arg(c["args"], "--host", host), "--port", str(port))
    tmpfs = [f"--tmpfs={m['mountPath']}:rw,mode=0777" for m in c["volumeMounts"]]  # emptyDirs
    with started(
        opts,
        "--network=host",
        "--read-only",
        *tmpfs,
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        f"--env=DSEC_DATABASE={database}",
        f"--env=DSEC_CLUSTER_TOKEN={token}",
        f"--entrypoint={c['command'][0]}",
        APISERVER_IMAGE,
        *args,
    ) as cid:
        yield cid


def admin_token(cid: str) -> str:
    """The admin token the apiserver issued into its data dir (docs/DEPLOY.md, step 5)."""
    args = container_of("apiserver.yaml", "apiserver")["args"]
    data_dir = args[args.index("--data-dir") + 1]
    return podman("exec", cid, "cat", f"{data_dir}/admin-token").stdout.strip()


def probe_paths(c: dict[str, Any]) -> set[str]:
    return {c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe", "startupProbe") if p in c}


def test_apiserver_image_serves_on_postgres(run_opts: list[str], pg_url: str) -> None:
    image = json.loads(podman("image", "inspect", APISERVER_IMAGE).stdout)[0]
    sec = workload("apiserver.yaml")["spec"]["template"]["spec"]["securityContext"]
    assert image["Config"]["User"] == f"{sec['runAsUser']}:{sec['runAsGroup']}"
    with apiserver_container(run_opts, pg_url, "dsec_" + secrets.token_urlsafe(32), "127.0.0.1") as cid:
        args = json.loads(podman("inspect", cid).stdout)[0]["Args"]
        port = int(args[args.index("--port") + 1])
        url = f"http://127.0.0.1:{port}"
        for path in probe_paths(container_of("apiserver.yaml", "apiserver")):
            assert wait_http(url + path).json()["status"] in ("ok", "degraded")
        assert podman("exec", cid, "id", "-u").stdout.strip() == str(sec["runAsUser"])
        headers = {"Authorization": f"Bearer {admin_token(cid)}"}
        r = httpx.post(f"{url}/v1/projects", json={"name": "imagetest"}, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        names = [
            p["name"] for p in httpx.get(f"{url}/v1/projects", headers=headers, timeout=30).json()["projects"]
        ]
        assert "imagetest" in names
        assert httpx.get(f"{url}/v1/projects", timeout=30).status_code == 401  # no token


def test_edge_image_entrypoint_and_cli(run_opts: list[str]) -> None:
    for node in ("node1", "gke-pool-1-node-abc", "Worker.Example.COM"):
        inside = podman("run", "--rm", *run_opts, EDGE_IMAGE, "--print-name", node).stdout
        assert (
            inside
            == subprocess.run(
                [str(ENTRYPOINT), "--print-name", node], capture_output=True, text=True, check=True
            ).stdout
        )
    out = podman("run", "--rm", *run_opts, "--entrypoint=dsec", EDGE_IMAGE, "edge", "--help").stdout
    assert "--apiserver" in out and "--keep-sandboxes" in out


def bridge() -> tuple[str, ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """podman's default network: its gateway (the node's address as pods see it) and subnet."""
    net = json.loads(podman("network", "inspect", "podman").stdout)[0]
    (sub,) = net["subnets"]
    return str(sub["gateway"]), ipaddress.ip_network(sub["subnet"])


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory that is a shared mount, as a Bidirectional hostPath needs (the edge's
    tmpfs run dir made inside the container must show on the node, for the next container)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-img-run-", dir="/tmp"))
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
    try:
        subprocess.run(["mount", "--make-rshared", str(d)], check=True)
        yield d
    finally:
        subprocess.run(["umount", "-R", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)


def volumes(c: dict[str, Any], run_dir: Path | None) -> list[str]:
    """A container's hostPath mounts of edge.yaml as podman volumes (the node data directory
    NODE_DATA; Bidirectional ones from the shared directory run_dir)."""
    spec = workload("edge.yaml")["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    host_paths["var-lib-dsec"] = str(NODE_DATA)
    out = []
    for m in c["volumeMounts"]:
        if m.get("mountPropagation") == "Bidirectional":
            assert run_dir is not None
            out.append(f"--volume={run_dir}:{m['mountPath']}:rshared")
        else:
            out.append(f"--volume={host_paths[m['name']]}:{m['mountPath']}")
    return out


def node_setup(opts: list[str]) -> None:
    """edge.yaml's init container: install.sh's host parts into the node data directory."""
    spec = workload("edge.yaml")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["securityContext"]["privileged"] and init["image"] == EDGE_IMAGE
    t = time.monotonic()
    out = podman(
        "run", "--rm", *opts, "--privileged", "--pid=host", *volumes(init, None), EDGE_IMAGE, *init["args"],
        timeout=1500,
    )  # fmt: skip
    print(f"dsec-k8s-edge setup: {time.monotonic() - t:.0f} s\n{out.stderr[-2000:]}")


def edge_args(
    opts: list[str], name_node: str, ip: str, token: str, apiserver: str, run_dir: Path
) -> list[str]:
    """`podman run` arguments for the edge image as edge.yaml runs it."""
    ds = workload("edge.yaml")
    spec = ds["spec"]["template"]["spec"]
    c = container_of("edge.yaml", "edge")
    assert spec["hostPID"] and not spec["hostNetwork"] and c["securityContext"]["privileged"]
    mounts = volumes(c, run_dir)
    gateway, _ = bridge()
    env = {"NODE_NAME": name_node, "POD_IP": ip, "NODE_IP": gateway, "DSEC_CLUSTER_TOKEN": token}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = " ".join(e["value"].replace("$(NODE_IP)", gateway).split())
    return [
        *opts,
        "--privileged",
        "--pid=host",
        f"--ip={ip}",
        *mounts,
        *[f"--env={k}={v}" for k, v in env.items()],
        f"--entrypoint={c['command'][0]}",
        EDGE_IMAGE,
        *replace_arg(c["args"], "--apiserver", apiserver),
    ]


def free_ip(subnet: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    used = set()
    for cid in podman("ps", "-aq").stdout.split():
        for net in (
            json.loads(podman("inspect", cid).stdout)[0]["NetworkSettings"].get("Networks", {}).values()
        ):
            used.add(net.get("IPAddress"))
    hosts = list(subnet.hosts())
    while True:
        ip = str(hosts[len(hosts) // 2 + secrets.randbelow(len(hosts) // 4)])
        if ip not in used:
            return ip


def remove_edge_state(name: str) -> None:
    from dsec.cluster.local import remove_edge_leftovers

    remove_edge_leftovers(name)
    for f in ("edge-{}.db", "trajlog-{}.db", "trajlog-{}.db.lock"):
        with contextlib.suppress(FileNotFoundError):
            (NODE_DATA / f.format(name)).unlink()


def test_edge_image_runs_sandboxes_as_the_daemonset_would(run_opts: list[str], pg_url: str) -> None:
    from dsec import Client

    node_setup(run_opts)
    gateway, subnet = bridge()
    token = "dsec_" + secrets.token_urlsafe(32)
    node = "img-test-" + secrets.token_hex(4)
    name = subprocess.run([str(ENTRYPOINT), "--print-name", node], capture_output=True, text=True, check=True)
    edge = name.stdout.strip()
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(apiserver_container(run_opts, pg_url, token, gateway))
        args = json.loads(podman("inspect", api).stdout)[0]["Args"]
        url = f"http://{gateway}:{args[args.index('--port') + 1]}"
        wait_http(url + "/v1/health")
        run_dir = stack.enter_context(shared_dir())
        stack.callback(remove_edge_state, edge)
        ip = free_ip(subnet)
        cid = stack.enter_context(started([], *edge_args(run_opts, node, ip, token, url, run_dir)))
        port = int(
            next(
                e["value"] for e in container_of("edge.yaml", "edge")["env"] if e["name"] == "DSEC_EDGE_PORT"
            )
        )
        health = wait_http(f"http://{ip}:{port}/v1/health", timeout=600).json()
        assert health == {"status": "ok", "edge": edge}
        deadline = time.monotonic() + 60
        while httpx.get(url + "/v1/health", timeout=5).json().get("edges") != 1:
            assert time.monotonic() < deadline, "the edge did not register with the apiserver"
            time.sleep(0.5)

        client = stack.enter_context(Client(url, admin_token(api)))
        sb = client.create(
            image="python", backend="container", cpu=1, memory_mb=512, ttl_idle_s=600, network={"allow": []}
        )
        assert sb.id.startswith(edge + "-")
        r = sb.exec("echo kept > /tmp/k; (sleep 1000 >/dev/null 2>&1 &); python3 -c 'print(6*7)'", timeout=60)
        assert (r.exit_code, r.stdout) == (0, "42\n"), r
        # its cgroups are the node's, not the pod's
        assert any(Path(h, "dsec", sb.id).is_dir() for h in Path("/sys/fs/cgroup").iterdir())

        # An edge container restart (an upgrade): the sandbox stays, the next container adopts it.
        podman("stop", "-t", "120", cid)
        assert any(Path(h, "dsec", sb.id).is_dir() for h in Path("/sys/fs/cgroup").iterdir())
        podman("start", cid)
        wait_http(f"http://{ip}:{port}/v1/health", timeout=600)
        deadline = time.monotonic() + 60
        while True:
            try:
                r = client.get(sb.id).exec("cat /tmp/k; pgrep -c sleep", timeout=30)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert (r.exit_code, r.stdout) == (0, "kept\n1\n"), r

        sb.stop()
        deadline = time.monotonic() + 60  # (an adopted sandbox's cgroups go once its processes have)
        while any(Path(h, "dsec", sb.id).is_dir() for h in Path("/sys/fs/cgroup").iterdir()):
            assert time.monotonic() < deadline, f"the stopped sandbox's cgroups are still there: {sb.id}"
            time.sleep(0.5)
