"""deploy/: the Kubernetes manifests, the systemd units, the image recipe (no cluster needed).

Every manifest validates against the Kubernetes schema (kubernetes-validate, strict: unknown
fields fail), and the checks that matter are made against the real code: the probes hit paths
the real apiserver and edge apps answer without a token, the edge mounts the host paths its
settings use, the apiserver runs without privileges, the Secret holds placeholders only.
"""

from __future__ import annotations

import configparser
import copy
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from fastapi import FastAPI
from pydantic import ValidationError

from dsec.apiserver.tenancy import ApiServerSettings
from dsec.config import EdgeSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
SYSTEMD = ROOT / "deploy" / "systemd"
ENTRYPOINT = ROOT / "deploy" / "container" / "dsec-k8s-edge"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
K8S_VERSION = "1.37"  # the newest schema kubernetes-validate 1.37 ships
SECRET_TEMPLATE = "secret-template.yaml"
IMAGES = {"ghcr.io/dsec/dsec:latest", "ghcr.io/dsec/dsec-apiserver:latest"}
TRIAL_IMAGES = {"docker.io/library/postgres:16-bookworm", "docker.io/library/registry:2.8.3"}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def docs() -> list[dict[str, Any]]:
    return [d for p in manifest_files() for d in yaml.safe_load_all(p.read_text()) if d]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (p,) = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    return int(p)


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# --- schema ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schema(path: Path) -> None:
    loaded = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert loaded, f"{path.name} holds no object"
    for doc in loaded:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_is_strict() -> None:
    """The schema check can fail: a misspelt field or a wrong type is refused."""
    bad = copy.deepcopy(one("Deployment", "dsec-apiserver"))
    container(bad, "apiserver")["readinessProbe"]["httpGett"] = {"path": "/v1/health", "port": 8420}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(one("Deployment", "dsec-apiserver"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert listed == {p.name for p in manifest_files()} - {SECRET_TEMPLATE}
    assert {f"{i['newName']}:{i['newTag']}" for i in kust["images"]} == IMAGES


def test_everything_is_in_the_namespace() -> None:
    ns = one("Namespace", "dsec")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for d in docs():
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "dsec", d["metadata"]["name"]


def test_images_are_the_documented_placeholders() -> None:
    for d in docs():
        if d["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        spec = pod_spec(d)
        for c in spec.get("initContainers", []) + spec["containers"]:
            allowed = TRIAL_IMAGES if d["kind"] == "StatefulSet" else IMAGES
            assert c["image"] in allowed, (d["metadata"]["name"], c["image"])
    text = CONTAINERFILE.read_text()
    assert re.search(r"^FROM \S+ AS apiserver$", text, re.M)
    assert re.search(r"^FROM \S+ AS edge$", text, re.M)
    assert text.rstrip().splitlines()[-1].startswith("ENTRYPOINT")  # edge: the default target


def test_the_edge_image_installs_what_install_sh_does() -> None:
    """install.sh's apt packages, but the cluster's own services (PostgreSQL, the registry: an
    edge uses neither itself), in the edge image."""
    script = (ROOT / "install.sh").read_text()
    block = re.search(r"APT_PACKAGES=\((.*?)\)\s*#", script, re.S)
    assert block is not None
    wanted = {w for line in block.group(1).splitlines() for w in line.split("#")[0].split()}
    stage = CONTAINERFILE.read_text().split(" AS edge", 1)[1]
    install = re.search(r"--no-install-recommends \\\n(.*?)\n &&", stage, re.S)
    assert install is not None
    have = set(install.group(1).replace("\\", " ").split())
    assert have == wanted - {"postgresql", "docker-registry"}


# --- probes: the real apps answer them ---------------------------------------------------


async def probe_status(app: FastAPI, path: str) -> int:
    """What a kubelet's httpGet probe gets: no token, no lifespan needed for health."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://probe") as client:
        return (await client.get(path)).status_code


@pytest.fixture
def apiserver_app(tmp_path: Path) -> FastAPI:
    from dsec.service import apiserver_app

    return apiserver_app(tmp_path / "api", {}, None)


@pytest.fixture
def edge_app(tmp_path: Path) -> FastAPI:
    from dsec.edge.server import create_edge_app

    settings = EdgeSettings(
        name="probe", data_dir=tmp_path / "data", run_dir=tmp_path / "run", id_registry=tmp_path / "ids"
    )
    return create_edge_app(settings, token="t" * 32, public_url="http://127.0.0.1:1", apiservers=[])


def probes(c: dict[str, Any]) -> list[dict[str, Any]]:
    found = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
    assert {"readinessProbe", "livenessProbe"} <= set(c), "readiness and liveness probes"
    return found


async def test_the_probe_check_fails_on_a_wrong_path(apiserver_app: FastAPI, edge_app: FastAPI) -> None:
    """The check below can fail: a path nobody serves, or one that needs a token, is not 200."""
    assert await probe_status(apiserver_app, "/healthz") == 404
    assert await probe_status(apiserver_app, "/metrics") == 401
    assert await probe_status(edge_app, "/v1/edge/status") == 401
    assert await probe_status(edge_app, "/healthz") != 200


async def test_apiserver_probes_hit_its_health_route(apiserver_app: FastAPI) -> None:
    c = container(one("Deployment", "dsec-apiserver"), "apiserver")
    listen = int(arg_after(c["args"], "--port"))
    for probe in probes(c):
        get = probe["httpGet"]
        assert port_number(c, get["port"]) == listen
        assert await probe_status(apiserver_app, get["path"]) == 200, get["path"]


async def test_edge_probes_hit_its_health_route(edge_app: FastAPI) -> None:
    ds = one("DaemonSet", "dsec-edge")
    c = container(ds, "edge")
    listen = int(env_of(c)["DSEC_EDGE_PORT"]["value"])
    for probe in probes(c):
        get = probe["httpGet"]
        assert port_number(c, get["port"]) == listen
        assert await probe_status(edge_app, get["path"]) == 200, get["path"]


# --- the apiserver: no privileges ---------------------------------------------------------


def test_apiserver_runs_without_privileges() -> None:
    dep = one("Deployment", "dsec-apiserver")
    spec = pod_spec(dep)
    c = container(dep, "apiserver")
    assert dep["spec"]["replicas"] >= 2
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for host in ("hostPID", "hostNetwork", "hostIPC"):
        assert not spec.get(host)
    sc = c["securityContext"]
    assert sc.get("privileged", False) is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")
    assert all("hostPath" not in v for v in spec["volumes"])
    # Everything it writes is on an emptyDir: its data dir (a directory inside one: it chmods
    # the data dir, which only its owner may) and /tmp.
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    data_dir = Path(arg_after(c["args"], "--data-dir"))
    assert mounts.get(str(data_dir.parent)) in empty
    assert mounts.get("/tmp") in empty
    # The image's user is the one the pod runs as.
    stage = CONTAINERFILE.read_text().split(" AS apiserver", 1)[1].split("\nFROM ", 1)[0]
    assert f"USER {spec['securityContext']['runAsUser']}:" in stage
    assert "resources" in c and {"requests", "limits"} <= set(c["resources"])


def test_apiserver_takes_its_database_and_token_from_the_secret() -> None:
    c = container(one("Deployment", "dsec-apiserver"), "apiserver")
    env = env_of(c)
    for name, key in (("DSEC_DATABASE", "database-url"), ("DSEC_CLUSTER_TOKEN", "cluster-token")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("dsec-secrets", key)
        assert not ref.get("optional")
    assert arg_after(c["args"], "--host") == "0.0.0.0"  # the default, 127.0.0.1, is not reachable


def test_services_and_budget_select_the_apiservers() -> None:
    dep = one("Deployment", "dsec-apiserver")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    c = container(dep, "apiserver")
    for name in ("dsec-apiserver", "dsec-apiserver-peers"):
        svc = one("Service", name)
        assert svc["spec"]["selector"].items() <= labels.items()
        (p,) = svc["spec"]["ports"]
        assert port_number(c, p["targetPort"]) == int(arg_after(c["args"], "--port"))
    assert one("Service", "dsec-apiserver-peers")["spec"]["clusterIP"] == "None"
    pdb = one("PodDisruptionBudget", "dsec-apiserver")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


# --- the edge ------------------------------------------------------------------------------


def test_edge_mounts_the_host_paths_it_uses() -> None:
    ds = one("DaemonSet", "dsec-edge")
    spec = pod_spec(ds)
    c = container(ds, "edge")
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounted = {m["mountPath"]: host[m["name"]] for m in c["volumeMounts"] if m["name"] in host}
    s = EdgeSettings()
    needed = {
        "/sys/fs/cgroup",  # sandboxes' cgroups in the node's tree
        str(s.data_dir),  # layers, records, trajectory logs, checkpoints
        str(s.run_dir),  # bundles, runtime state, fork layers
        str(s.id_registry),  # host-wide uid ranges
        "/run/dsec-edges",  # one edge per name per host (Edge._lock_name)
    }
    for path in (s.criu_dir, s.runsc_dir, s.microvm_dir):  # install.sh's host parts
        assert path.is_relative_to(s.data_dir)
    assert set(mounted) == needed
    assert all(inside == outside for inside, outside in mounted.items())  # same paths as on a node
    run = next(m for m in c["volumeMounts"] if m["mountPath"] == str(s.run_dir))
    assert run["mountPropagation"] == "Bidirectional"
    # and nothing more of the host: no /, no /dev, no /proc
    assert set(host.values()) == needed
    assert spec["hostPID"] is True  # kept sandboxes survive a container restart
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    assert c["securityContext"]["privileged"] is True
    setup = next(i for i in spec["initContainers"] if i["name"] == "host-setup")
    assert {m["mountPath"] for m in setup["volumeMounts"]} == {"/sys/fs/cgroup", str(s.data_dir)}


def test_edge_name_url_token_and_apiservers() -> None:
    ds = one("DaemonSet", "dsec-edge")
    c = container(ds, "edge")
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ref = env["DSEC_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("dsec-secrets", "cluster-token")
    assert c["command"] == ["/usr/local/bin/dsec-k8s-edge"]
    assert "/usr/local/bin/dsec-k8s-edge" in CONTAINERFILE.read_text()
    # --apiserver is the headless Service of the apiservers (every pod's address), at its port
    url = httpx.URL(arg_after(c["args"], "--apiserver"))
    name, namespace, svc_suffix = url.host.split(".", 2)
    assert svc_suffix == "svc"
    svc = one("Service", name)
    assert svc["metadata"]["namespace"] == namespace
    assert svc["spec"]["clusterIP"] == "None"
    assert url.port == svc["spec"]["ports"][0]["port"]
    # the platform addresses expand NODE_IP, defined before them
    names = [e["name"] for e in c["env"]]
    assert "$(NODE_IP)" in env["DSEC_PLATFORM_ADDRESSES"]["value"]
    assert names.index("NODE_IP") < names.index("DSEC_PLATFORM_ADDRESSES")


def edge_name(node: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(ENTRYPOINT), "--print-name", node], capture_output=True, text=True, check=False
    )


def test_edge_names_from_node_names_are_valid_stable_and_distinct() -> None:
    nodes = [
        "worker1",
        "n1",
        "ip-10-0-1-23.ec2.internal",
        "ip-10-0-1-24.ec2.internal",
        "gke-pool-1-abcdef12-x9z7",
        "Worker-Node-01",
        "worker-node-01",  # node names are lowercase; the upper-case one maps to it
        "a" * 63,
    ]
    got = {}
    for node in nodes:
        r = edge_name(node)
        assert r.returncode == 0, r.stderr
        name = r.stdout.strip()
        EdgeSettings(name=name)  # the edge's own validation
        assert edge_name(node).stdout.strip() == name
        got[node] = name
    assert got["worker1"] == "worker1" and got["n1"] == "n1"
    assert len(set(got.values())) == len(nodes) - 1
    assert got["Worker-Node-01"] == got["worker-node-01"]
    assert edge_name("").returncode != 0


# --- secrets ---------------------------------------------------------------------------------

REAL_LOOKING = [
    re.compile(r"dsec_[A-Za-z0-9_-]{20,}"),  # what service._secret_file issues
    re.compile(r"\b[0-9a-f]{24,}\b"),  # openssl rand -hex
    re.compile(r"[A-Za-z0-9+/_-]{32,}={0,2}"),  # long base64-ish runs
]


def placeholder_values() -> list[str]:
    secret = one("Secret", "dsec-secrets")
    values = list(secret.get("stringData", {}).values()) + list(secret.get("data", {}).values())
    for example in SYSTEMD.glob("*.env.example"):
        for line in example.read_text().splitlines():
            key, _, value = line.partition("=")
            if not line.startswith("#") and ("TOKEN" in key or key == "DSEC_DATABASE"):
                values.append(value)
    return values


def test_secret_placeholders_are_not_real_looking_tokens() -> None:
    values = placeholder_values()
    assert len(values) >= 6
    for value in values:
        assert "CHANGE-ME" in value, value
        for pattern in REAL_LOOKING:
            assert not pattern.search(value), (value, pattern.pattern)
    # the check can fail: tokens made as service._secret_file and secret-template.yaml make them
    for real in ("dsec_" + secrets.token_urlsafe(32), secrets.token_hex(24)):
        assert any(p.search(real) for p in REAL_LOOKING)


def test_every_secret_reference_has_a_key_in_the_template() -> None:
    secret = one("Secret", "dsec-secrets")
    keys = set(secret["stringData"])
    for d in docs():
        if d["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        spec = pod_spec(d)
        for c in spec.get("initContainers", []) + spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "dsec-secrets" and ref["key"] in keys, e


def test_trial_postgres_is_labelled_and_takes_its_password_from_the_secret() -> None:
    sts = one("StatefulSet", "dsec-postgres")
    assert sts["metadata"]["labels"]["dsec/trial-only"] == "true"
    assert "TRIAL ONLY" in (K8S / "postgres-trial.yaml").read_text()
    c = container(sts, "postgres")
    ref = env_of(c)["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("dsec-secrets", "postgres-password")
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
        m["name"] for m in c["volumeMounts"]
    }
    assert one("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    # the Secret's example URL points at this Service
    url = httpx.URL(one("Secret", "dsec-secrets")["stringData"]["database-url"])
    assert url.host.split(".")[0] == sts["spec"]["serviceName"]


def test_trial_registry_allows_deletes_and_every_edge_uses_it() -> None:
    """With more than one edge images travel only through a registry (the relay is gone): the
    manifests run a trial one, the edges point at its Service, and snapshot deletes work."""
    sts = one("StatefulSet", "dsec-registry")
    assert sts["metadata"]["labels"]["dsec/trial-only"] == "true"
    assert "TRIAL ONLY" in (K8S / "registry-trial.yaml").read_text()
    c = container(sts, "registry")
    env = env_of(c)
    assert env["REGISTRY_STORAGE_DELETE_ENABLED"]["value"] == "true"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert env["REGISTRY_STORAGE_FILESYSTEM_ROOTDIRECTORY"]["value"] in mounts
    assert pod_spec(sts)["securityContext"]["runAsNonRoot"] is True
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/"
    svc = one("Service", "dsec-registry")
    assert svc["spec"]["type"] == "ClusterIP"  # cluster-internal: it holds tenants' snapshots
    edge = container(one("DaemonSet", "dsec-edge"), "edge")
    url = httpx.URL(env_of(edge)["DSEC_EDGE_REGISTRY"]["value"])
    assert url.host == "dsec-registry.dsec.svc" and url.port == svc["spec"]["ports"][0]["port"]
    assert port_number(c, svc["spec"]["ports"][0]["targetPort"]) == 5000
    # the edges' settings take that URL (the repository is its path)
    assert EdgeSettings(name="e1", registry=str(url)).registry == str(url)
    assert "dsec-registry.dsec.svc" in env_of(edge)["DSEC_PLATFORM_ADDRESSES"]["value"]
    # the apiservers read the layers of images no edge holds from the same registry
    api = container(one("Deployment", "dsec-apiserver"), "apiserver")
    assert env_of(api)["DSEC_APISERVER_REGISTRY"]["value"] == str(url)
    assert ApiServerSettings(registry=str(url)).registry == str(url)
    with pytest.raises(ValidationError, match="registry URL"):
        ApiServerSettings(registry="registry:5000")


# --- systemd ---------------------------------------------------------------------------------

UNITS = ["dsec-apiserver.service", "dsec-edge.service"]


def verify_units(paths: list[Path]) -> str:
    """Problems systemd finds in units ('' if none): `systemd-analyze verify` where it exists
    (it prints unknown keys and bad values but still exits 0, so any output counts), else a
    plain INI parse that knows the sections."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        problems = []
        for p in paths:
            ini = configparser.ConfigParser(strict=False, interpolation=None)
            try:
                ini.read_string(p.read_text())
            except configparser.Error as e:
                problems.append(f"{p.name}: {e}")
                continue
            if not {"Unit", "Service", "Install"} <= set(ini.sections()):
                problems.append(f"{p.name}: sections {ini.sections()}")
            if "ExecStart" not in ini["Service"]:
                problems.append(f"{p.name}: no ExecStart")
        return "\n".join(problems)
    r = subprocess.run([tool, "verify", *map(str, paths)], capture_output=True, text=True, check=False)
    return (r.stdout + r.stderr).strip() or ("" if r.returncode == 0 else f"exit {r.returncode}")


def local_copies(tmp_path: Path, texts: dict[str, str]) -> list[Path]:
    """The units with ExecStart's /usr/local/bin/dsec (install.sh's link) pointed at this venv's
    dsec, so verify's check that the command exists holds on any machine."""
    dsec = Path(sys.executable).parent / "dsec"
    out = []
    for name, text in texts.items():
        p = tmp_path / name
        p.write_text(text.replace("/usr/local/bin/dsec ", f"{dsec} "))
        out.append(p)
    return out


def test_systemd_units_parse(tmp_path: Path) -> None:
    texts = {u: (SYSTEMD / u).read_text() for u in UNITS}
    assert verify_units(local_copies(tmp_path, texts)) == ""


def test_the_unit_check_fails_on_a_broken_unit(tmp_path: Path) -> None:
    text = (SYSTEMD / "dsec-edge.service").read_text()
    broken = {"dsec-edge.service": text.replace("[Service]", "[Service\n", 1)}
    if shutil.which("systemd-analyze"):
        broken = {"dsec-edge.service": text.replace("KillMode=process", "KillMode=sometimes")}
    assert verify_units(local_copies(tmp_path, broken)) != ""


def unit(name: str) -> configparser.ConfigParser:
    ini = configparser.ConfigParser(strict=False, interpolation=None)
    ini.optionxform = str  # type: ignore[assignment,method-assign]
    ini.read_string((SYSTEMD / name).read_text())
    return ini


def test_edge_unit_keeps_sandboxes_and_manages_cgroups() -> None:
    svc = unit("dsec-edge.service")["Service"]
    assert svc["KillMode"] == "process"  # SIGTERM to the edge only: kept sandboxes' helpers stay
    assert svc["Delegate"] == "yes"
    assert svc["Restart"] == "on-failure"
    assert "dsec edge" in svc["ExecStart"]
    for option in ("ProtectSystem", "PrivateTmp", "PrivateDevices", "PrivateMounts", "User", "DynamicUser"):
        assert option not in svc, option  # a runtime: root, and the host's mount namespace


def test_apiserver_unit_is_hardened() -> None:
    svc = unit("dsec-apiserver.service")["Service"]
    assert svc["Restart"] == "on-failure"
    assert svc["DynamicUser"] == "yes" or svc.get("User", "root") not in ("root", "0")
    assert svc["ProtectSystem"] == "strict"
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["CapabilityBoundingSet"] == ""
    assert svc["StateDirectory"] in svc["ExecStart"]
    assert "dsec apiserver" in svc["ExecStart"]


@pytest.mark.parametrize(
    ("unit_name", "example"),
    [("dsec-apiserver.service", "apiserver.env.example"), ("dsec-edge.service", "edge.env.example")],
)
def test_env_examples_define_what_the_units_use(unit_name: str, example: str) -> None:
    svc = unit(unit_name)["Service"]
    assert svc["EnvironmentFile"] == f"/etc/dsec/{example.removesuffix('.example')}"
    used = set(re.findall(r"\$\{?([A-Z_]+)\}?", svc["ExecStart"]))
    text = (SYSTEMD / example).read_text()
    defined = {ln.split("=", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#") and "=" in ln}
    assert used <= defined
    assert "DSEC_CLUSTER_TOKEN" in defined
