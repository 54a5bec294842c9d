"""The kubernetes node provider against a fake Kubernetes API server: an in-process FastAPI app
(over httpx's ASGI transport) that speaks the few Pod endpoints the provider uses, checks every
request it gets (token, content type, manifest) and lets the test play the cluster autoscaler
(a placeholder scheduled onto a new node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dsec import errors
from dsec.cluster.kubernetes import ROLE, ROLE_LABEL, KubernetesProvider, KubernetesSettings

TOKEN = "k8s-test-token"
NS = "dsec-edges"


class FakeKubernetesAPIServer:
    """A fake Kubernetes API server: Pods in namespaces, label selectors, bearer auth."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.problems: list[str] = []
        self.app = app = FastAPI()
        self._n = 0

        @app.middleware("http")
        async def check(request: Request, call_next: Any) -> Any:
            self.requests.append((request.method, request.url.path, dict(request.query_params)))
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"kind": "Status", "code": 401, "message": "Unauthorized"}, 401)
            return await call_next(request)

        @app.post("/api/v1/namespaces/{ns}/pods")
        async def create(ns: str, request: Request) -> JSONResponse:
            if request.headers.get("content-type") != "application/json":
                self.problems.append("content type " + str(request.headers.get("content-type")))
            pod = await request.json()
            self._validate(ns, pod)
            self._n += 1
            meta = pod["metadata"]
            name = meta.get("name") or f"{meta['generateName']}{self._n:05d}"
            pod["metadata"] = {**meta, "name": name, "namespace": ns, "uid": f"uid-{self._n}"}
            pod["status"] = {"phase": "Pending"}
            self.pods[name] = pod
            return JSONResponse(pod, 201)

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def list_(ns: str, labelSelector: str = "") -> dict[str, Any]:
            want = dict(kv.split("=", 1) for kv in labelSelector.split(",") if kv)
            items = [
                p
                for p in self.pods.values()
                if p["metadata"]["namespace"] == ns
                and all(p["metadata"].get("labels", {}).get(k) == v for k, v in want.items())
            ]
            return {"kind": "PodList", "apiVersion": "v1", "items": items}

        @app.delete("/api/v1/namespaces/{ns}/pods/{name}")
        async def delete(ns: str, name: str) -> JSONResponse:
            pod = self.pods.pop(name, None)
            if pod is None:
                return JSONResponse(
                    {"kind": "Status", "code": 404, "message": f'pods "{name}" not found'}, 404
                )
            return JSONResponse(pod, 200)

    def _validate(self, ns: str, pod: dict[str, Any]) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                self.problems.append(what)

        need(pod.get("apiVersion") == "v1" and pod.get("kind") == "Pod", "not a v1 Pod")
        need(pod["metadata"].get("namespace") in (None, ns), "namespace differs from the URL's")
        need(pod["metadata"].get("labels", {}).get(ROLE_LABEL) == ROLE, "no placeholder label")
        (c,) = pod["spec"]["containers"]
        need("pause" in c["image"], "not a pause container")
        req = c["resources"]["requests"]
        need(req.get("cpu") == "15" and req.get("memory") == "60Gi", f"requests {req}")
        need(c["resources"].get("limits") == req, "limits differ from requests")
        (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        need(term["topologyKey"] == "kubernetes.io/hostname", "anti-affinity not per host")
        need(term["labelSelector"]["matchLabels"] == {ROLE_LABEL: ROLE}, "anti-affinity selector")
        need(pod["spec"].get("nodeSelector") == {"pool": "edges"}, "node selector")
        need(pod["spec"].get("priorityClassName") == "dsec-placeholder", "priority class")

    def schedule(self, pod: str, node: str) -> None:
        """What the autoscaler and the scheduler do: a new node, the pod running on it."""
        self.pods[pod]["spec"]["nodeName"] = node
        self.pods[pod]["status"] = {"phase": "Running"}


def _provider(fake: FakeKubernetesAPIServer, tmp: Path, token: str = TOKEN) -> KubernetesProvider:
    settings = KubernetesSettings(
        api_url="https://k8s.test",
        token=token,
        ca_file=tmp / "absent.crt",
        namespace=NS,
        node_selector={"pool": "edges"},
        node_cpu="15",
        node_memory="60Gi",
        priority_class="dsec-placeholder",
    )
    return KubernetesProvider(settings, transport=httpx.ASGITransport(app=fake.app))


async def test_kubernetes_provider_scales_through_placeholder_pods(tmp_path: Path) -> None:
    fake = FakeKubernetesAPIServer()
    provider = _provider(fake, tmp_path)
    try:
        names = await provider.add(2)
        assert len(names) == 2 and all(n.startswith("dsec-capacity-") for n in names)
        assert fake.problems == []
        assert set(fake.pods) == set(names)
        # nothing scheduled yet: both wait (the autoscaler is making nodes)
        assert {(i.name, i.state) for i in await provider.list()} == {(n, "pending") for n in names}

        fake.schedule(names[0], "node-a")  # a node came up for the first one
        listed = {i.name: i for i in await provider.list()}
        assert listed["node-a"].state == "ready" and listed["node-a"].detail == names[0]
        assert listed[names[1]].state == "pending"

        # another workload's pods in the namespace are never listed nor touched
        fake.pods["other"] = {
            "metadata": {"name": "other", "namespace": NS, "labels": {"app": "x"}},
            "spec": {"nodeName": "node-a"},
            "status": {"phase": "Running"},
        }
        await provider.remove("node-a")  # the edge named after its node is released
        assert set(fake.pods) == {names[1], "other"}
        await provider.remove(names[1])  # a placeholder still pending, by its own name
        await provider.remove("node-zz")  # unknown: a no-op
        assert set(fake.pods) == {"other"}
        assert await provider.list() == []

        methods = [(m, p) for m, p, _ in fake.requests]
        assert ("POST", f"/api/v1/namespaces/{NS}/pods") in methods
        assert ("DELETE", f"/api/v1/namespaces/{NS}/pods/{names[0]}") in methods
        assert all(p.startswith(f"/api/v1/namespaces/{NS}/pods") for _, p in methods)
        lists = [q for m, _, q in fake.requests if m == "GET"]
        assert lists and all(q["labelSelector"] == f"{ROLE_LABEL}={ROLE}" for q in lists)
        deletes = [q for m, _, q in fake.requests if m == "DELETE"]
        assert all(q == {"gracePeriodSeconds": "0"} for q in deletes)
    finally:
        await provider.aclose()


async def test_kubernetes_provider_reports_api_errors(tmp_path: Path) -> None:
    fake = FakeKubernetesAPIServer()
    provider = _provider(fake, tmp_path, token="wrong")
    try:
        with pytest.raises(errors.Unavailable, match="401"):
            await provider.add(1)
        assert fake.pods == {}
    finally:
        await provider.aclose()
    unreachable = KubernetesProvider(
        KubernetesSettings(api_url="http://127.0.0.1:9", token=TOKEN, ca_file=None, timeout_s=2)
    )
    try:
        with pytest.raises(errors.Unavailable, match="cannot be reached"):
            await unreachable.list()
    finally:
        await unreachable.aclose()
