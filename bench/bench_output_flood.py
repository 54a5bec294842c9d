"""Service memory under output floods (issue #25 item 6), against the bound it should hold.
Run as root, on demand:

    .venv/bin/python bench/bench_output_flood.py [--calls 10] [--mib 64] [--readers 20]

Each scenario gets a fresh `dsec up` (its peak resident memory is its own) with the edge's
default output budgets unless given (--budget-mb, --project-budget-mb), and samples the
service's resident memory every 5 ms:

- `--calls` concurrent execs, each in its own sandbox, printing `--mib` MiB of ASCII, then
  of bytes that are not UTF-8 (each one U+FFFD: 3 bytes of JSON), answers read as they come
  and thrown away (the client's own parsing is not what is measured);
- `--readers` exec streams of `--mib` MiB each, read 64 KiB every 100 ms for `--seconds`,
  then closed: a slow reader must slow its command, not fill the service.

The bound (dsec.edge.outputs): the output budget (here the project's: one project floods),
plus the oldest call's output and its JSON (it always goes on), plus `SLACK` (allocator,
buffers in flight); for streams, the budget (a stream holds what it sent, for its `result`
event) plus what each stream may have read and not yet sent (256 KiB, and a pipe's 64 KiB)."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from _service import running_service  # type: ignore[import-not-found]

MiB = 1 << 20
SLACK = 64 * MiB
JSON_PER_BYTE = {"ascii": 1, "invalid": 3}
COMMANDS = {
    "ascii": "head -c {n} /dev/zero | tr '\\0' a",
    "invalid": "head -c {n} /dev/zero | tr '\\0' '\\377'",
}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The most resident memory the process had while the block ran, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss(pid), False
        self.base = self.peak
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop = True
        self._t.join()

    @property
    def grown(self) -> int:
        return self.peak - self.base


@dataclass
class Budgets:
    total: int
    project: int


def _env(b: Budgets) -> dict[str, str]:
    return {
        "DSEC_EDGE_OUTPUT_BUDGET_MB": str(b.total // MiB),
        "DSEC_EDGE_PROJECT_OUTPUT_BUDGET_MB": str(b.project // MiB),
    }


async def _sandboxes(c: httpx.AsyncClient, n: int, cap: int) -> list[str]:
    ids = []
    for _ in range(n):
        r = await c.post("/v1/sandboxes", json={"image": "python", "max_output_bytes": cap})
        r.raise_for_status()
        ids.append(r.json()["id"])
        r = await c.post(f"/v1/sandboxes/{ids[-1]}/exec", json={"cmd": ["true"]})
        r.raise_for_status()  # (a sandbox's first exec costs the service: not the output's)
    return ids


async def floods(url: str, token: str, pid: int, kind: str, calls: int, size: int) -> tuple[int, float]:
    """(peak growth of the service's memory, seconds) for `calls` concurrent floods."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=1800) as c:
        ids = await _sandboxes(c, calls, size)
        body = {"cmd": COMMANDS[kind].format(n=size), "max_output_bytes": size, "timeout": 1800}

        async def one(sid: str) -> int:
            async with c.stream("POST", f"/v1/sandboxes/{sid}/exec", json=body) as r:
                r.raise_for_status()
                return sum([len(chunk) async for chunk in r.aiter_raw()])

        t = time.perf_counter()
        with Peak(pid) as peak:
            got = await asyncio.gather(*(one(sid) for sid in ids))
        took = time.perf_counter() - t
        assert all(n >= size * JSON_PER_BYTE[kind] for n in got), got
        for sid in ids:
            await c.delete(f"/v1/sandboxes/{sid}")
    return peak.grown, took


async def slow_readers(
    url: str, token: str, pid: int, readers: int, size: int, seconds: float
) -> tuple[int, int]:
    """(peak growth, bytes all readers took) for `readers` streams read slowly, then closed."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as c:
        ids = await _sandboxes(c, readers, size)
        body = {"cmd": COMMANDS["ascii"].format(n=size), "max_output_bytes": size, "timeout": 600}
        taken = [0] * readers

        async def one(i: int) -> None:
            end = time.monotonic() + seconds
            async with c.stream("POST", f"/v1/sandboxes/{ids[i]}/exec/stream", json=body) as r:
                r.raise_for_status()
                async for chunk in r.aiter_raw(65536):
                    taken[i] += len(chunk)
                    if time.monotonic() > end:
                        return  # the client goes away
                    await asyncio.sleep(0.1)

        with Peak(pid) as peak:
            await asyncio.gather(*(one(i) for i in range(readers)))
        for sid in ids:
            await c.delete(f"/v1/sandboxes/{sid}")
    return peak.grown, sum(taken)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--readers", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--budget-mb", type=int, default=1024)  # EdgeSettings' defaults
    ap.add_argument("--project-budget-mb", type=int, default=256)
    a = ap.parse_args()
    b = Budgets(a.budget_mb * MiB, a.project_budget_mb * MiB)
    size = a.mib * MiB
    rows = ["| scenario | service peak growth MiB | bound MiB | seconds |", "|---|---|---|---|"]
    for kind in ("ascii", "invalid"):
        with running_service("of", keep_log=False, extra_env=_env(b)) as t:
            grown, took = asyncio.run(floods(t.url, t.token, t.pid, kind, a.calls, size))
        # one project: its budget, and the oldest call past it
        json_size = size * JSON_PER_BYTE[kind]
        bound = min(b.project, b.total) + (size + json_size) + SLACK
        name = f"{a.calls} concurrent execs x {a.mib} MiB {kind} (JSON {a.calls * json_size // MiB} MiB)"
        rows.append(f"| {name} | {grown / MiB:.0f} | {bound / MiB:.0f} | {took:.1f} |")
    with running_service("of", keep_log=False, extra_env=_env(b)) as t:
        grown, taken = asyncio.run(slow_readers(t.url, t.token, t.pid, a.readers, size, a.seconds))
    bound = min(b.project, b.total) + a.readers * (256 + 64) * 1024 + SLACK
    name = f"{a.readers} slow stream readers x {a.mib} MiB ({taken / MiB:.0f} MiB taken in {a.seconds:.0f} s)"
    rows.append(f"| {name} | {grown / MiB:.0f} | {bound / MiB:.0f} | {a.seconds:.1f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
