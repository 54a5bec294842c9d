"""Shipping the trajectory log to the control plane, so that it survives its edge.

An edge that has apiservers (`dsec edge --apiserver ...`) sends every durable entry of its
trajectory log, in write order, in batches to one of them (`POST /v1/edges/trajectories`,
with the cluster token; the next apiserver when one cannot be reached), together with each
sandbox's counts at that moment. The apiserver stores them in the control-plane database
(idempotently: a batch sent twice is stored once) and answers; only then does the edge
advance its cursor (`TrajectoryLog.mark_shipped`, kept in the log's own database, so a
restarted edge goes on where it stopped). After the edge is lost, `sb.trajectory()` is
answered from what was shipped, with how much may be missing: entries recorded after the
last shipped batch, at most `interval_s` of work plus one batch.

What travels is what the log holds (actions and observations, no file contents), over the
same link the apiservers already use to reach the edge's sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from dsec.trajlog.log import TrajectoryLog

log = logging.getLogger("dsec.edge.shipper")

TARGET = "control-plane"
BATCH = 2000


class TrajectoryShipper:
    def __init__(
        self, trajlog: TrajectoryLog, edge: str, apiservers: list[str], token: str, interval_s: float = 1.0
    ) -> None:
        self.trajlog = trajlog
        self.edge = edge
        self.apiservers = [u.rstrip("/") for u in apiservers]
        self.token = token
        self.interval_s = interval_s
        self._next = 0  # the apiserver to try first

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=10.0) as http:
            while True:
                try:
                    while await self.ship_once(http):
                        pass  # a full batch: more may be waiting
                except Exception as e:  # (the next round retries; nothing is marked shipped)
                    log.debug("shipping the trajectory log failed: %s", e)
                await asyncio.sleep(self.interval_s)

    async def ship_once(self, http: httpx.AsyncClient) -> bool:
        """Ship one batch; whether it was a full one."""
        cursor = self.trajlog.shipped_through(TARGET)
        rows = self.trajlog.rows_after(cursor, BATCH)
        if not rows:
            return False
        sandboxes = sorted({r[1][0] for r in rows})
        body: dict[str, Any] = {
            "edge": self.edge,
            "rows": [list(r) for _, r in rows],
            "stats": {sid: self.trajlog.stats(sid) for sid in sandboxes},
        }
        await self._post(http, body)
        self.trajlog.mark_shipped(TARGET, rows[-1][0])
        return len(rows) == BATCH

    async def _post(self, http: httpx.AsyncClient, body: dict[str, Any]) -> None:
        last: Exception | None = None
        for i in range(len(self.apiservers)):
            url = self.apiservers[(self._next + i) % len(self.apiservers)]
            with contextlib.suppress(httpx.HTTPError):
                r = await http.post(
                    url + "/v1/edges/trajectories",
                    json=body,
                    headers={"Authorization": f"Bearer {self.token}"},
                )
                if r.status_code == 200:
                    self._next = (self._next + i) % len(self.apiservers)
                    return
                last = RuntimeError(f"{url}: HTTP {r.status_code} {r.text[:200]}")
                continue
            last = RuntimeError(f"{url} is unreachable")
        raise last or RuntimeError("no apiserver to ship to")
