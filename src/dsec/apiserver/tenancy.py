"""Who may call what, and what each caller may see, for the apiserver's cross-tenant endpoints.

The gate (:func:`make_guard`) authenticates every call that needs a token before its body is
read: the native API (`Authorization: Bearer`), the SandboxFusion endpoints (token in the path,
the query or the header), SWE-ReX (`X-API-Key`), edge registration (the cluster token) and
`/metrics` (an admin token or the separate metrics token). Calls only an admin may make are
refused there too, so a tenant's body is never read for them.

The rest filters what the listing endpoints return to a tenant (a principal that is not an
admin): shared base images and their layers for everyone, a project's snapshots (images made
from its sandboxes) and their layers only for that project; edges without other tenants'
projects, snapshot names or sandbox ids; metrics without per-project or per-snapshot series.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dsec import errors
from dsec.http.routes import Guard, bearer
from dsec.iam import IAM
from dsec.layers.distribution import split_url
from dsec.models import EdgeStatus

Scope = set[str] | None  # a principal's visible projects; None: all (an admin)

OPEN_PATHS = frozenset({"/v1/health", "/v1/version", "/v1/ping"})
_ADMIN_ONLY = re.compile(
    r"^(?:POST /v1/(?:projects|principals|pools|pools/prewarm|images/import"
    r"|principals/[^/]+/(?:rotate|revoke)|edges/[^/]+/(?:drain|undrain))"
    r"|GET /v1/principals)$"
)
_SANDBOXFUSION_TOKEN = re.compile(r"^/sandboxfusion/([^/]+)/run_(?:code|jupyter)$")
_SANDBOXFUSION_QUERY = frozenset({"/run_code", "/run_jupyter"})


class ApiServerSettings(BaseSettings):
    """The apiserver. Environment: DSEC_APISERVER_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="DSEC_APISERVER_")

    #: How often reservations of sandboxes no edge reports any more are released.
    reconcile_interval_s: float = 10.0
    #: A reservation younger than this is never taken for a leftover (a sandbox just made may
    #: not be listed yet). A create still in flight is never released, however long it takes.
    reservation_grace_s: float = 30.0
    #: A sandbox an edge reports that no reservation accounts for this long (across reconciler
    #: rounds) is an orphan and is stopped: its create's apiserver died after the edge made it,
    #: or the answer never reached that apiserver. An edge lists a sandbox only once its create
    #: is done, and the apiserver accounts for it right then, so this only has to outlast that.
    orphan_after_s: float = Field(30.0, gt=0)
    #: An edge silent this long is given up: no placements, its sandboxes answer sandbox_lost
    #: and their quota is released (what survives is stopped when it answers again).
    edge_lost_after_s: float = Field(5.0, ge=1.0, le=3600.0)
    #: How long a lost sandbox's id keeps answering sandbox_lost (then: not found).
    lost_memory_s: float = 86400.0
    #: Where more edges come from when announced bursts do not fit, and where idle ones go:
    #: "local" (the `dsec cluster up` cluster in cluster_dir), "kubernetes" (placeholder pods a
    #: cluster autoscaler turns into nodes; DSEC_K8S_*), or none.
    node_provider: Literal["none", "local", "kubernetes"] = "none"
    #: The local provider's cluster (set by `dsec cluster up` for its apiservers).
    cluster_dir: Path | None = None
    #: An edge the node provider holds that has had no sandbox (pooled ones too) this long
    #: drains (no new placements) and is then released through the provider. None: never.
    idle_drain_after_s: float | None = Field(None, gt=0)
    #: Idle release never goes below this many edges (0: down to zero).
    min_edges: int = Field(0, ge=0)
    #: The provider is never asked to go above this many edges.
    max_edges: int = Field(64, ge=1, le=10000)
    #: The largest burst one announcement may ask for (POST /v1/capacity).
    capacity_max_count: int = Field(10000, ge=1, le=100000)
    #: Bursts pending at once (scheduled or being provisioned), in the cluster and in any one
    #: project (its share, so that one tenant cannot take them all); admins are bound by neither.
    capacity_max_bursts: int = Field(100, ge=1)
    capacity_max_bursts_per_project: int = Field(10, ge=1)
    #: A burst's pools are pre-warmed this long before its time (at most 240 s: an edge keeps a
    #: prewarm's boost 300 s).
    capacity_lead_s: float = Field(120.0, ge=0, le=240)
    #: The edges a burst pre-warmed on are never idle-released before this long past its time.
    capacity_hold_s: float = Field(300.0, ge=0)
    #: How long a burst waits for the edges it asked the provider for.
    capacity_edge_wait_s: float = Field(180.0, ge=1)
    #: How often idle edges are looked for.
    capacity_interval_s: float = Field(1.0, gt=0)
    #: The OCI registry the edges pull images from (their DSEC_EDGE_REGISTRY). Placement reads
    #: from it the layers of an image no edge holds, so edges that hold more of them (its base)
    #: come first. None: such an image gets no layer preference.
    registry: str | None = None
    #: A token that may read /metrics (for Prometheus) without being an IAM principal.
    metrics_token: str | None = None
    #: ...or a file holding it (read at start).
    metrics_token_file: Path | None = None

    @field_validator("registry")
    @classmethod
    def _registry_url(cls, v: str | None) -> str | None:
        if v:
            try:
                split_url(v)
            except errors.DsecError as e:
                raise ValueError(e.message) from None
        return v or None

    def metrics_secret(self) -> str | None:
        if self.metrics_token:
            return self.metrics_token
        if self.metrics_token_file is not None and self.metrics_token_file.exists():
            return self.metrics_token_file.read_text().strip() or None
        return None


EDGE_PATHS = frozenset({"/v1/edges/register", "/v1/edges/trajectories"})


def make_guard(iam: IAM, cluster_token: str, *, compat_auth: bool, metrics_token: str | None) -> Guard:
    """Authentication (and admin-only refusals) of every route that needs a token, from the
    request line and headers alone. The principal goes to `scope["state"]["principal"]`."""
    return _Guard(iam, cluster_token, compat_auth, metrics_token)


class _Guard:
    def __init__(self, iam: IAM, cluster_token: str, compat_auth: bool, metrics_token: str | None) -> None:
        self.iam = iam
        self.cluster_token = cluster_token
        self.compat_auth = compat_auth
        self.metrics_token = metrics_token

    def __call__(self, scope: dict[str, Any]) -> None:
        path: str = scope["path"]
        if path.startswith("/v1/"):
            self.native(scope, path)
        elif path == "/metrics":
            self.metrics(scope)
        elif path.startswith("/swerex/"):
            key = _header(scope, b"x-api-key")
            if not key:
                raise errors.AuthError("missing API key: send 'X-API-Key: <dsec token>'")
            _state(scope)["principal"] = self.iam.authenticate(key)
        elif self.compat_auth:
            self.sandboxfusion(scope, path)

    def native(self, scope: dict[str, Any], path: str) -> None:
        if path in OPEN_PATHS:
            return
        if path in EDGE_PATHS:  # edges registering and shipping their trajectory logs
            given = bearer(scope) or ""
            if not secrets.compare_digest(given.encode(), self.cluster_token.encode()):
                raise errors.AuthError(f"{path} is for edges: it needs the cluster token")
            return
        p = self.iam.authenticate(bearer(scope))
        _state(scope)["principal"] = p
        if not p.admin and _ADMIN_ONLY.match(f"{scope['method']} {path}"):
            raise errors.Forbidden(
                f"{scope['method']} {path} needs an admin token; principal {p.name!r} is not an admin"
            )
        if not p.admin and scope["method"] == "POST" and path == "/v1/images/build":
            # A tenant builds a Dockerfile into a project of its own; anything else (a recipe,
            # a shared image) is an admin's: refused here, before the upload is read.
            project = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("project")
            if not project:
                raise errors.Forbidden(
                    "a recipe build, or a shared image's, needs an admin token; a project's members "
                    "build a Dockerfile into it with ?project=NAME&name=IMAGE"
                )
            self.iam.authorize(p, project[0])

    def metrics(self, scope: dict[str, Any]) -> None:
        presented = bearer(scope)
        wanted = self.metrics_token
        if wanted and presented and secrets.compare_digest(presented.encode(), wanted.encode()):
            _state(scope)["metrics_scope"] = "all"
            return
        p = self.iam.authenticate(presented)
        _state(scope)["principal"] = p
        _state(scope)["metrics_scope"] = "all" if p.admin else "tenant"

    def sandboxfusion(self, scope: dict[str, Any], path: str) -> None:
        m = _SANDBOXFUSION_TOKEN.match(path)
        if m is not None:
            self.iam.authenticate(m.group(1))
        elif path in _SANDBOXFUSION_QUERY:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            token = query["token"][0] if query.get("token") else bearer(scope)
            self.iam.authenticate(token)


def _state(scope: dict[str, Any]) -> dict[str, Any]:
    st: dict[str, Any] = scope.setdefault("state", {})
    return st


def _header(scope: dict[str, Any], wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


# --- images and layers ------------------------------------------------------------------------


class Visibility:
    """Which images and layers a scope may see, from every edge's images and snapshots."""

    def __init__(self, scope: Scope, images: Iterable[dict[str, Any]], snapshots: Iterable[dict[str, Any]]):
        self.scope = scope
        owner = {s["name"]: s.get("source", {}).get("project") for s in snapshots}
        self.images: set[str] = set()
        self.layers: set[str] = set()
        for img in images:
            name = img["name"]
            if name in owner or name.startswith("snap-") or "/" in name:
                project = owner.get(name, name.split("/")[0] if "/" in name else None)
                if scope is not None and project not in scope:
                    continue
            self.images.add(name)
            self.layers.update(img.get("layers", ()))

    def image(self, name: str) -> bool:
        return self.scope is None or name in self.images

    def layer(self, ref: str) -> bool:
        return self.scope is None or ref in self.layers


def tenant_layer(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer as a tenant sees it: its own snapshot layers whole, others without their source
    (host paths of imports, other sandboxes' ids and scrubbed paths)."""
    source = layer.get("source") or {}
    if source.get("type") == "snapshot":
        return layer
    return {**layer, "source": {"type": source.get("type")}}


def tenant_edge(status: EdgeStatus, vis: Visibility) -> dict[str, Any]:
    """An edge's status without other tenants' projects, snapshots or sandbox ids, and without
    the platform's internal address."""
    return {
        **status.model_dump(mode="json"),
        "url": None,
        "by_project": {k: v for k, v in status.by_project.items() if vis.scope is None or k in vis.scope},
        "by_image": {k: v for k, v in status.by_image.items() if vis.image(k)},
        "layers": [r for r in status.layers if vis.layer(r)],
        "images": [i for i in status.images if vis.image(i)],
        "fork_layers": [],  # named after their source sandboxes, any project's
    }


# --- metrics ------------------------------------------------------------------------------------


class TenantMetrics:
    """A registry view for tenants: every series except per-project ones and those naming an
    image the tenant may not see (another project's snapshot)."""

    def __init__(self, registry: CollectorRegistry, vis: Visibility) -> None:
        self.registry = registry
        self.vis = vis

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            kept = [s for s in family.samples if self._keep(s.labels)]
            if len(kept) != len(family.samples):
                family = Metric(family.name, family.documentation, family.type, family.unit)
                family.samples = kept
            yield family

    def _keep(self, labels: dict[str, str]) -> bool:
        image = labels.get("image", "*")
        return labels.get("project", "*") == "*" and (image == "*" or self.vis.image(image))


def metrics_scope(scope: MutableMapping[str, Any]) -> str:
    value = scope.get("state", {}).get("metrics_scope")
    if value not in ("all", "tenant"):
        raise errors.AuthError("missing API token: send 'Authorization: Bearer <token>'")
    return str(value)
