"""The apiserver: the only ingress. Auth, quota admission, placement, forwarding.

Per request: authenticate the bearer token (IAM) -> for a create, reserve quota
atomically under a provisional key, place on an edge (retrying the next
candidate when an edge says it is full), then re-key the reservation to the
sandbox id -> for any other call, route by the edge name inside the sandbox id
and scope it to the caller's projects. No per-sandbox state lives here.
"""

from __future__ import annotations

from dsec.apiserver.app.control import (
    _place,
)
from dsec.apiserver.app.state import (
    LATENCY_BUCKETS,
    ApiServerState,
    EventBus,
    Metrics,
    respond_then,
)
from dsec.apiserver.app.wiring import (
    create_api_app,
)

__all__ = [
    "LATENCY_BUCKETS",
    "ApiServerState",
    "EventBus",
    "Metrics",
    "_place",
    "create_api_app",
    "respond_then",
]
