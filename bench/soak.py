"""Soak: N create -> exec -> stop cycles at concurrency C against a real `dsec up`, through the
async SDK, watching the service's memory and checking that nothing is left on the host.

    .venv/bin/python bench/soak.py [--cycles 10000] [--concurrency 50]

Measured: cycles/s, errors by code, p50/p99 cycle latency, RSS / fds / threads of the `dsec up`
process (apiserver + edge, one process) before, sampled during, and after, with the slope of RSS
over the cycles after a warm-up. Checked at the end, with the service still running (a
long-lived service must not accumulate; the shutdown cleanup would hide leaks) and, for the
bench, again after its shutdown: no mounts, sandbox cgroups (`/sys/fs/cgroup/*/dsec/<edge>-*`),
network namespaces, processes (children of the service, `dsec-shim`s, zombies), loop devices
or sandbox run dirs beyond what existed before the cycles. Exit 1 if anything leaked, a cycle
failed, or RSS grew more than `--max-growth` after the warm-up.

`run_soak(target, ...)` is the same logic for tests (tests/e2e/test_soak.py runs it shortened).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

try:
    from bench._service import Target, running_service
except ImportError:  # run as a script: bench/ is on sys.path
    from _service import Target, running_service  # type: ignore[no-redef]

from dsec import errors
from dsec.client import AsyncClient

# ----------------------------------------------------------------------------- process stats


def proc_stats(pid: int) -> dict[str, int]:
    """RSS (KiB), open fds and threads of one process."""
    out = {"rss_kib": 0, "fds": 0, "threads": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _all_procs() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline) of every process."""
    out: dict[int, tuple[int, str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if not stat:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        cmd = _read(f"/proc/{entry}/cmdline").replace("\0", " ").strip()
        if not cmd:
            cmd = "[" + stat[stat.find("(") + 1 : stat.rfind(")")] + "]"
        out[int(entry)] = (int(rest[1]), rest[0], cmd[:120])
    return out


def _descendants(root: int, procs: dict[int, tuple[int, str, str]]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


# ----------------------------------------------------------------------------- host resources


def host_resources(t: Target, *, alive: bool = True) -> dict[str, set[str]]:
    """Everything on the host that a sandbox of edge `t.edge` could leave behind, as sets of
    descriptions (compared before/after: a leak is what is new)."""
    edge, run_dir, data_dir = t.edge, str(t.run_dir), str(t.data_dir)
    res: dict[str, set[str]] = {
        k: set() for k in ("mounts", "cgroups", "netns", "processes", "zombies", "loops")
    }
    res["run_dirs"] = set()

    def ours(text: str) -> bool:
        return (
            f"dsec-run-{edge}" in text or f"dsec-forks-{edge}" in text or run_dir in text or data_dir in text
        )

    mount_tables = ["/proc/self/mounts"] + ([f"/proc/{t.pid}/mounts"] if alive else [])
    for table in mount_tables:
        for ln in _read(table).splitlines():
            if ours(ln) or (ln.split()[:1] == ["nsfs"] and "dsec" in ln):
                res["mounts"].add(" ".join(ln.split()[:3]))
    for pattern in (f"/sys/fs/cgroup/*/dsec/{edge}-*", f"/sys/fs/cgroup/dsec/{edge}-*"):
        res["cgroups"].update(glob.glob(pattern))
    res["netns"].update(f"/run/netns/{n}" for n in _listdir("/run/netns") if "dsec" in n or edge in n)

    _processes(t, alive, res)

    for bf in glob.glob("/sys/block/loop*/loop/backing_file"):
        backing = _read(bf).strip()
        if "dsec" in backing or ours(backing):
            res["loops"].add(f"{bf.split('/')[3]} {backing}")
    res["run_dirs"].update(
        f"{run_dir}/{edge}/{n}" for n in _listdir(f"{run_dir}/{edge}") if n.startswith(f"{edge}-")
    )
    return res


def _processes(t: Target, alive: bool, res: dict[str, set[str]]) -> None:
    """Processes of this edge's sandboxes (children of the service, wherever they were
    reparented: by cgroup or shim command line), split live / zombie, and their net namespaces."""
    procs = _all_procs()
    host_net = _netns(os.getpid())
    related = _descendants(t.pid, procs) if alive else set()
    for pid, (_, _, cmd) in procs.items():
        if f"/dsec/{t.edge}-" in _read(f"/proc/{pid}/cgroup") or (
            "dsec-shim" in cmd and str(t.run_dir) in cmd
        ):
            related.add(pid)
    for pid in related & procs.keys():
        _, state, cmd = procs[pid]
        desc = f"{pid} {cmd}"
        (res["zombies"] if state == "Z" else res["processes"]).add(desc)
        ns = _netns(pid)
        if ns and ns != host_net:
            res["netns"].add(f"{ns} (pid {desc})")
    if alive:
        for fd in _listdir(f"/proc/{t.pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{t.pid}/fd/{fd}")
                if link.startswith("net:"):
                    res["netns"].add(f"{link} (fd {fd} of the service)")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def new_resources(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, list[str]]:
    """What `after` holds that `before` did not, by kind (processes compared by pid)."""
    out: dict[str, list[str]] = {}
    for kind, items in after.items():
        old = before.get(kind, set())
        if kind in ("processes", "zombies"):
            old_pids = {x.split()[0] for x in before.get("processes", set()) | before.get("zombies", set())}
            extra = sorted(x for x in items if x.split()[0] not in old_pids)
        else:
            extra = sorted(items - old)
        if extra:
            out[kind] = extra
    return out


# ----------------------------------------------------------------------------- the soak


@dataclass
class SoakResult:
    cycles: int
    concurrency: int
    wall_s: float = 0.0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    samples: list[tuple[int, float, dict[str, int]]] = field(default_factory=list)  # (done, t, stats)
    start: dict[str, int] = field(default_factory=dict)
    end: dict[str, int] = field(default_factory=dict)
    warmup_cycles: int = 0
    leaks: dict[str, list[str]] = field(default_factory=dict)
    settle_s: float = 0.0
    api_leftovers: list[str] = field(default_factory=list)
    max_growth: float = 0.2

    # -- memory
    def _after_warmup(self) -> list[tuple[int, float, dict[str, int]]]:
        return [s for s in self.samples if s[0] >= self.warmup_cycles]

    @property
    def rss_warm(self) -> int:
        w = self._after_warmup()
        return w[0][2]["rss_kib"] if w else self.start.get("rss_kib", 0)

    @property
    def rss_mid(self) -> int:
        return self.samples[len(self.samples) // 2][2]["rss_kib"] if self.samples else 0

    @property
    def rss_peak(self) -> int:
        return max([s[2]["rss_kib"] for s in self.samples] + [self.end.get("rss_kib", 0)])

    @property
    def growth(self) -> float:
        """RSS after the cycles relative to RSS right after the warm-up."""
        return (self.end.get("rss_kib", 0) - self.rss_warm) / max(self.rss_warm, 1)

    @property
    def slope_kib_per_1k(self) -> float:
        """Least-squares slope of RSS over completed cycles after the warm-up (KiB / 1000 cycles)."""
        w = self._after_warmup()
        if len(w) < 3:
            return 0.0
        xs = [float(s[0]) for s in w]
        ys = [float(s[2]["rss_kib"]) for s in w]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        den = sum((x - mx) ** 2 for x in xs)
        return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0

    @property
    def failed(self) -> list[str]:
        why = []
        if self.errors:
            why.append(f"{sum(self.errors.values())} failed cycles: {dict(self.errors)}")
        if self.leaks:
            why.append(f"leftovers: {sorted(self.leaks)}")
        if self.api_leftovers:
            why.append(f"the API still lists sandboxes: {self.api_leftovers[:5]}")
        if self.growth > self.max_growth:
            why.append(f"RSS grew {self.growth:.1%} after the warm-up (bound {self.max_growth:.0%})")
        return why

    def pct_ms(self, p: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else 0.0

    def report(self) -> str:
        mib = 1024
        lines = [
            f"soak: {self.cycles} cycles (create -> exec -> stop) at concurrency {self.concurrency}",
            f"  wall {self.wall_s:.1f} s, {self.cycles / max(self.wall_s, 1e-9):.1f} cycles/s, "
            f"ok {self.ok}, errors {sum(self.errors.values())} {dict(self.errors) or ''}",
            f"  cycle latency p50 {self.pct_ms(0.5):.1f} ms, p99 {self.pct_ms(0.99):.1f} ms, "
            f"max {self.pct_ms(1.0):.1f} ms",
            f"  RSS start {self.start.get('rss_kib', 0) / mib:.1f} MiB, "
            f"after warm-up ({self.warmup_cycles} cycles) "
            f"{self.rss_warm / mib:.1f}, mid {self.rss_mid / mib:.1f}, peak {self.rss_peak / mib:.1f}, "
            f"end {self.end.get('rss_kib', 0) / mib:.1f} MiB: growth after warm-up {self.growth:+.1%} "
            f"(bound {self.max_growth:.0%}), slope {self.slope_kib_per_1k:+.1f} KiB / 1000 cycles",
            f"  fds start {self.start.get('fds')} end {self.end.get('fds')}, "
            f"threads start {self.start.get('threads')} end {self.end.get('threads')}",
            f"  host clean {self.settle_s:.1f} s after the last stop" if not self.leaks else "  LEFTOVERS:",
        ]
        for kind, items in sorted(self.leaks.items()):
            lines.append(f"    {kind}: {len(items)}: {items[:5]}")
        if self.api_leftovers:
            lines.append(f"  API still lists {len(self.api_leftovers)} sandboxes: {self.api_leftovers[:5]}")
        for code, msg in self.error_samples.items():
            lines.append(f"  error {code}: {msg}")
        lines.append("  RESULT: " + ("FAIL: " + "; ".join(self.failed) if self.failed else "ok"))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cycles": self.cycles,
            "concurrency": self.concurrency,
            "wall_s": self.wall_s,
            "cycles_per_s": self.cycles / max(self.wall_s, 1e-9),
            "ok": self.ok,
            "errors": dict(self.errors),
            "p50_ms": self.pct_ms(0.5),
            "p99_ms": self.pct_ms(0.99),
            "rss_kib": {
                "start": self.start.get("rss_kib"),
                "warm": self.rss_warm,
                "mid": self.rss_mid,
                "peak": self.rss_peak,
                "end": self.end.get("rss_kib"),
            },
            "rss_growth": self.growth,
            "rss_slope_kib_per_1k_cycles": self.slope_kib_per_1k,
            "fds": [self.start.get("fds"), self.end.get("fds")],
            "leaks": self.leaks,
            "failed": self.failed,
        }


def _code(exc: BaseException) -> str:
    return exc.code if isinstance(exc, errors.DsecError) else type(exc).__name__


async def _cycles(t: Target, res: SoakResult, image: str, memory_mb: int, label: str) -> None:
    sample_every = max(1, res.cycles // 200)
    counter = iter(range(res.cycles))
    done = 0
    t0 = time.perf_counter()

    def fail(code: str, msg: str) -> None:
        res.errors[code] += 1
        res.error_samples.setdefault(code, msg[:300])

    async with AsyncClient(t.url, t.token, timeout=120, retries=3) as client:

        async def worker() -> None:
            nonlocal done
            for i in counter:
                start = time.perf_counter()
                sb = None
                step = "create"
                try:
                    sb = await client.create(image, cpu=0.1, memory_mb=memory_mb, labels={"soak": label})
                    step = "exec"
                    r = await sb.exec(f"echo soak-{i}", timeout=60)
                    if (r.exit_code, r.stdout) != (0, f"soak-{i}\n"):
                        fail(
                            "wrong_output", f"cycle {i}: exit {r.exit_code} stdout {r.stdout!r} {r.stderr!r}"
                        )
                    else:
                        res.ok += 1
                except Exception as e:
                    fail(_code(e), f"cycle {i} {step}: {type(e).__name__}: {e}")
                finally:
                    if sb is not None:
                        try:
                            await sb.stop()
                        except Exception as e:
                            fail("stop_" + _code(e), f"cycle {i} stop {sb.id}: {e}")
                res.latencies.append(time.perf_counter() - start)
                done += 1
                if done % sample_every == 0:
                    with contextlib.suppress(OSError):
                        res.samples.append((done, time.perf_counter() - t0, proc_stats(t.pid)))

        await asyncio.gather(*(worker() for _ in range(res.concurrency)))
    res.wall_s = time.perf_counter() - t0


def _api_sandboxes(t: Target, label: str) -> list[str]:
    h = {"Authorization": f"Bearer {t.token}"}
    r = httpx.get(f"{t.url}/v1/sandboxes", params={"label": f"soak={label}"}, headers=h, timeout=30)
    r.raise_for_status()
    return [s["id"] for s in r.json()["sandboxes"]]


def run_soak(
    t: Target,
    *,
    cycles: int = 10000,
    concurrency: int = 50,
    image: str = "python",
    memory_mb: int = 128,
    max_growth: float = 0.2,
    warmup: int | None = None,
    settle_timeout: float = 60.0,
) -> SoakResult:
    """Run the cycles against a running service `t`; fill in stats, errors and leftovers.

    The baseline of host resources is taken after one warm-up cycle (the edge's run tmpfs, the
    shim build and the first cgroup parents exist from then on); leftovers are what is new
    once every stop's background teardown had `settle_timeout` seconds to finish."""
    res = SoakResult(cycles, concurrency, max_growth=max_growth)
    res.warmup_cycles = warmup if warmup is not None else min(cycles // 2, max(cycles // 10, 3 * concurrency))
    label = f"soak{os.getpid()}x{int(time.time())}"

    async def first() -> None:
        async with AsyncClient(t.url, t.token) as c:
            sb = await c.create(image, cpu=0.1, memory_mb=memory_mb)
            await sb.exec("true")
            await sb.stop()

    asyncio.run(first())
    time.sleep(1.0)
    before = host_resources(t)
    res.start = proc_stats(t.pid)
    asyncio.run(_cycles(t, res, image, memory_mb, label))
    t_end = time.perf_counter()
    deadline = time.monotonic() + settle_timeout
    while True:
        leaks = new_resources(before, host_resources(t))
        if not leaks or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    res.settle_s = time.perf_counter() - t_end
    res.leaks = leaks
    res.api_leftovers = _api_sandboxes(t, label)
    time.sleep(1.0)  # let the server drop the client's closed connections before counting fds
    res.end = proc_stats(t.pid)
    return res


def after_shutdown(t: Target) -> dict[str, list[str]]:
    """Leftovers of edge `t.edge` once its service exited: there should be none at all."""
    left = host_resources(t, alive=False)
    return {k: sorted(v) for k, v in left.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--image", default="python")
    ap.add_argument("--memory-mb", type=int, default=128)
    ap.add_argument("--max-growth", type=float, default=0.2, help="bound on RSS growth after the warm-up")
    ap.add_argument("--warmup", type=int, default=None, help="cycles before the memory baseline")
    ap.add_argument("--settle-timeout", type=float, default=60.0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    a = ap.parse_args()
    with running_service("soak") as t:
        res = run_soak(
            t,
            cycles=a.cycles,
            concurrency=a.concurrency,
            image=a.image,
            memory_mb=a.memory_mb,
            max_growth=a.max_growth,
            warmup=a.warmup,
            settle_timeout=a.settle_timeout,
        )
    print(res.report())
    post = after_shutdown(t)
    if post:
        print(f"  after shutdown, still on the host: {post}")
    if a.json:
        print(json.dumps({**res.as_dict(), "after_shutdown": post}, indent=2))
    return 1 if res.failed or post else 0


if __name__ == "__main__":
    sys.exit(main())
