"""The `kubernetes` node provider: more edges through a cluster autoscaler.

dsec does not make nodes itself here. It creates placeholder pods (pause containers) in a
namespace of its own, each requesting about an edge node's worth of CPU and memory, with a
required anti-affinity to each other per host (one per node) and the node pool's node
selector: pods that fit nowhere stay Pending, and the cluster autoscaler adds a node for
each. The edges run as a DaemonSet on that pool, named after their node (`--name
$(NODE_NAME)`), so a new node brings a new edge that registers by itself. Removing an edge
deletes the placeholder on its node; the autoscaler takes the node away once it is
underused. Size the requests like a node minus the edge's own pod (the daemon must still
fit), and give the placeholders a low priority class so that real pods preempt them.

Spoken over the Kubernetes REST API with httpx (no client library): create, list (by label)
and delete Pods in one namespace. In a pod, the service account's token and CA are used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from dsec.cluster.provider import NodeInfo, NodeProvider
from dsec.errors import Unavailable

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ROLE_LABEL = "dsec.dev/role"
ROLE = "capacity-placeholder"


class KubernetesSettings(BaseSettings):
    """The kubernetes node provider. Environment: DSEC_K8S_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="DSEC_K8S_")

    api_url: str = "https://kubernetes.default.svc"
    #: A bearer token, or a file holding one (default: the pod's service account).
    token: str | None = None
    token_file: Path = SA_DIR / "token"
    #: The API server's CA bundle (default: the service account's, if present).
    ca_file: Path | None = SA_DIR / "ca.crt"
    namespace: str = "dsec"
    #: Selects the edge node pool (e.g. {"cloud.google.com/gke-nodepool": "dsec-edges"}).
    node_selector: dict[str, str] = Field(default_factory=dict)
    #: Requests (= limits) of a placeholder: about a node, less the edge daemon's own pod.
    node_cpu: str = "14"
    node_memory: str = "56Gi"
    image: str = "registry.k8s.io/pause:3.9"
    priority_class: str | None = None
    name_prefix: str = "dsec-capacity"
    timeout_s: float = 10.0


class KubernetesProvider(NodeProvider):
    kind = "kubernetes"

    def __init__(self, settings: KubernetesSettings, *, transport: httpx.AsyncBaseTransport | None = None):
        self.settings = s = settings
        token = s.token
        if token is None and s.token_file.exists():
            token = s.token_file.read_text().strip()
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        verify: Any = str(s.ca_file) if s.ca_file is not None and s.ca_file.exists() else True
        self._http = httpx.AsyncClient(
            base_url=s.api_url, headers=headers, verify=verify, timeout=s.timeout_s, transport=transport
        )
        self._pods = f"/api/v1/namespaces/{s.namespace}/pods"

    def placeholder(self) -> dict[str, Any]:
        """The manifest of one placeholder pod."""
        s = self.settings
        size = {"cpu": s.node_cpu, "memory": s.node_memory}
        labels = {ROLE_LABEL: ROLE, "app.kubernetes.io/managed-by": "dsec"}
        spec: dict[str, Any] = {
            "containers": [
                {"name": "pause", "image": s.image, "resources": {"requests": size, "limits": size}}
            ],
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {ROLE_LABEL: ROLE}},
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "restartPolicy": "Always",
        }
        if s.node_selector:
            spec["nodeSelector"] = dict(s.node_selector)
        if s.priority_class:
            spec["priorityClassName"] = s.priority_class
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"generateName": f"{s.name_prefix}-", "namespace": s.namespace, "labels": labels},
            "spec": spec,
        }

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            r = await self._http.request(method, url, **kw)
        except httpx.HTTPError as e:
            raise Unavailable(f"the Kubernetes API at {self.settings.api_url} cannot be reached: {e}") from e
        if r.status_code >= 400 and not (method == "DELETE" and r.status_code == 404):
            try:
                why = r.json().get("message", r.text)
            except ValueError:
                why = r.text
            raise Unavailable(f"Kubernetes API: {method} {url} answered {r.status_code}: {why}")
        return r

    async def add(self, n: int) -> list[str]:
        names = []
        for _ in range(n):
            r = await self._request("POST", self._pods, json=self.placeholder())
            names.append(str(r.json()["metadata"]["name"]))
        return names

    async def _placeholders(self) -> list[dict[str, Any]]:
        r = await self._request("GET", self._pods, params={"labelSelector": f"{ROLE_LABEL}={ROLE}"})
        items: list[dict[str, Any]] = r.json().get("items", [])
        return items

    async def list(self) -> list[NodeInfo]:
        out = []
        for pod in await self._placeholders():
            node = pod.get("spec", {}).get("nodeName")
            phase = pod.get("status", {}).get("phase", "Pending")
            name = pod["metadata"]["name"]
            if node and phase == "Running":
                out.append(NodeInfo(node, "ready", name))
            else:
                out.append(NodeInfo(name, "pending", phase))
        return out

    async def remove(self, edge: str) -> None:
        """Delete the placeholder on node `edge` (or the placeholder named `edge`)."""
        for pod in await self._placeholders():
            name = pod["metadata"]["name"]
            if edge in (pod.get("spec", {}).get("nodeName"), name):
                await self._request("DELETE", f"{self._pods}/{name}", params={"gracePeriodSeconds": "0"})

    async def aclose(self) -> None:
        await self._http.aclose()
