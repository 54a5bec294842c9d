"""What one apiserver process holds: its metrics, its event bus, its state (IAM, edges, settings)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.background import BackgroundTask

from dsec.apiserver.placement import EdgeDirectory
from dsec.iam import IAM, Principal
from dsec.models import (
    ExecResult,
)

log = logging.getLogger("dsec.apiserver")

_PrincipalFn = Callable[[Request], Principal]


LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.015, 0.03, 0.06, 0.125, 0.25, 0.5, 1, 2, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.create_phase = Histogram(
            "dsec_create_phase_seconds",
            "Sandbox creation latency by phase",
            ["phase"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.exec_latency = Histogram(
            "dsec_exec_seconds", "Exec round trip inside the apiserver", registry=r, buckets=LATENCY_BUCKETS
        )
        self.failures = Counter(
            "dsec_failures_total", "Failed operations by reason", ["op", "reason"], registry=r
        )
        self.misbehaviour = Counter(
            "dsec_misbehaviour",
            "Limit hits seen in exec results: oom_kills, pids_limit_hits, disk_full, timeouts, "
            "output_truncated (an environment limit, not the task, may explain a reward)",
            ["kind"],
            registry=r,
        )
        self.live = Gauge("dsec_live_sandboxes", "Live sandboxes", ["edge", "image", "project"], registry=r)
        self.pool_ready = Gauge("dsec_pool_ready", "Ready sandboxes in warm pools", ["edge"], registry=r)
        self.edges = Gauge("dsec_edges_healthy", "Healthy edges", registry=r)

    def observe_exec(self, seconds: float, res: ExecResult) -> None:
        self.exec_latency.observe(seconds)
        for kind, n in res.misbehaviour.items():
            self.misbehaviour.labels(kind).inc(n)
        if res.timed_out:
            self.misbehaviour.labels("timeouts").inc()
        if res.truncated:
            self.misbehaviour.labels("output_truncated").inc()


class EventBus:
    """Lifecycle events for SSE subscribers; slow subscribers lose old events, never block creates.
    Each subscriber sees only events of its projects (None: all); an event without a project
    reaches admins only."""

    def __init__(self) -> None:
        self.subscribers: dict[asyncio.Queue[dict[str, Any]], set[str] | None] = {}

    def publish(self, kind: str, **data: Any) -> None:
        event = {"type": kind, "time": time.time(), **data}
        project = data.get("project")
        for q, scope in list(self.subscribers.items()):
            if scope is not None and project not in scope:
                continue
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(event)


@dataclass
class ApiServerState:
    iam: IAM
    directory: EdgeDirectory
    cluster_token: str
    metrics: Metrics
    events: EventBus


def respond_then(response: Response, after: list[Callable[[], None]]) -> Response:
    """Run `after` once the response is written: on this event loop, before it reads the next
    request (the steps are synchronous; nothing yields in between), so a caller that got the
    response and sends its next call still finds them done. Used for a stop's accounting: an
    IAM write costs ~0.25 ms on a CPU just out of idle, and a stop is usually followed by a
    pause, not by another call. (A create that reaches another apiserver within that window
    can find the quota still held: the conservative side.)"""

    async def run() -> None:
        for step in after:
            try:
                step()
            except Exception:
                log.exception("accounting after a response failed")

    response.background = BackgroundTask(run)
    return response
