"""Control-plane simulation (issue #14): the real apiserver over 1,000 fake edges (simulation).

    .venv/bin/python bench/bench_control_plane.py [--edges 1000] [--sandboxes 100000]
        [--concurrency 64] [--watch 15] [--postgres] [--pg-sandboxes N] [--no-http] [--quick]

What is real: the FastAPI app of `dsec apiserver` (dsec.apiserver.app.create_api_app) with
its Gate, Express lanes, IAM (SQLite in a temporary directory; with --postgres also a
throwaway PostgreSQL server, dsec.cluster.postgres), admission, the EdgeDirectory watcher and
placement, the quota reconciler; the requests are the SDK's own (dsec.client.AsyncClient,
idempotency key and all) sent in-process through httpx.ASGITransport, so a create pays auth,
the idempotency record, quota admission, placement and the edge call.

What is fake: the edges. `FakeEdge` is fake edges (simulation): an in-process EdgeAPI that only
keeps books (a create is a dict entry `<edge>-<random>`, status counts them against a shape
like a real edge's: capacity, used, images, backends). It exists for control-plane logic and
scale only; it says nothing about sandboxes. A real HttpEdge also pays HTTP and JSON per
status poll and per create, which is not in these numbers.

Measured, from one run (ratios and counts; the targets are printed, not asserted):
- placement decision per create: the time of `EdgeDirectory.candidates` (filter, order, the
  first is the pick) over all edges (target p99 <= 1 ms);
- creates/s of a burst of N creates (SDK -> apiserver -> fake edge) at `--concurrency`, and the
  process CPU time it took, so creates per CPU-second is per core. In-process, the SDK's side
  runs in the same process and is counted too (the apiserver's lower bound); then (unless
  --no-http) the same burst against the apiserver in a process of its own, served by uvicorn
  as `dsec apiserver` is, the SDK sending real HTTP from this process, and only the apiserver
  process's CPU counted (/proc/<pid>/stat; its fake edges are in it and counted too): creates
  per apiserver core (target >= 2,000/s);
- the watcher at 1,000 edges: CPU per poll of every edge, its share of a core at the default
  1 s interval, and the whole idle process over `--watch` s (watcher, quota reconciler over
  the N sandboxes) (target < 10% of a core);
- the process RSS with the edges registered and N sandboxes reserved (the fakes' own books
  are estimated and shown apart);
- with --postgres, the same burst with the IAM on PostgreSQL (its server's CPU is in other
  processes and not counted).

`run(...)` is the same logic for tests (tests/unit/test_bench_control_plane.py runs --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import gc
import json
import os
import random
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

try:
    from bench._common import pct
except ImportError:  # run as a script: bench/ is on sys.path
    from _common import pct  # type: ignore[no-redef]

from dsec import errors
from dsec.apiserver.app import create_api_app
from dsec.apiserver.placement import EdgeDirectory, EdgeView
from dsec.client import AsyncClient
from dsec.edgeapi import EdgeAPI, Projects, edge_of
from dsec.iam import IAM, Quota
from dsec.models import EdgeStatus, SandboxInfo, SandboxSpec, SandboxState

# Shapes of the fake edges (cpu capacity, memory MiB), mixed like a real fleet's nodes.
SHAPES = [(32.0, 128 * 1024), (48.0, 192 * 1024), (64.0, 256 * 1024), (96.0, 384 * 1024)]
SPEC = {"cpu": 0.25, "memory_mb": 256}  # one RL sandbox
PROJECT = "bench"


class FakeEdge(EdgeAPI):
    """Fake edges (simulation): an EdgeAPI that only keeps books, for control-plane logic and
    scale simulation. A create is a dict entry (id `<edge>-<random>`) counted against the
    edge's capacity, refused with capacity_exhausted when it does not fit (as a real edge's
    admission); status reports capacity, use, images and backends as a real edge does;
    get/list/stop see what was created. Everything else is refused as not simulated."""

    can_be_lost = True  # as a remote edge (HttpEdge) is

    def __init__(self, name: str, cpu: float, memory_mb: int, max_sandboxes: int = 4000) -> None:
        self.name = name
        self.url = f"fake://{name}"  # fake edges (simulation): nothing listens here
        self.capacity = {"sandboxes": float(max_sandboxes), "cpu": cpu, "memory_mb": float(memory_mb)}
        self.images = ["python", "swe"]
        self.backends = ["container", "gvisor"]
        self.layers = [f"sha256:{secrets.token_hex(32)}" for _ in range(4)]
        # id -> (project, image, backend, cpu, memory_mb, labels, created_at): cheap books, of
        # atomic values only (the garbage collector stops tracking such tuples)
        self.sandboxes: dict[str, tuple[str, str, str, float, int, tuple[tuple[str, str], ...], float]] = {}
        self.cpu_used = 0.0
        self.mem_used = 0
        self.by_image: Counter[str] = Counter()
        self.by_project: Counter[str] = Counter()
        self.refused = 0  # creates refused as full (the watcher's view was stale)

    async def status(self) -> EdgeStatus:
        await asyncio.sleep(0)  # a remote edge's answer is awaited: the loop runs meanwhile
        return EdgeStatus(
            name=self.name,
            url=self.url,
            healthy=True,
            backends=self.backends,
            capacity=self.capacity,
            used={
                "sandboxes": len(self.sandboxes),
                "pooled": 0,
                "cpu": self.cpu_used,
                "memory_mb": self.mem_used,
            },
            sandboxes=len(self.sandboxes),
            by_image=dict(self.by_image),
            by_project=dict(self.by_project),
            layers=self.layers,
            images=self.images,
        )

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        await asyncio.sleep(0)  # (as status: without it a burst would never yield to the watcher)
        cap = self.capacity
        if (
            len(self.sandboxes) + 1 > cap["sandboxes"]
            or self.cpu_used + spec.cpu > cap["cpu"] + 1e-9
            or self.mem_used + spec.memory_mb > cap["memory_mb"]
        ):
            self.refused += 1
            raise errors.CapacityExhausted(f"fake edge {self.name} is full; try another edge")
        if spec.image not in self.images or spec.backend not in self.backends:
            raise errors.ImageNotFound(f"fake edge {self.name} has no image {spec.image!r}")
        sid = f"{self.name}-{secrets.token_hex(8)}"
        now = time.time()
        self.sandboxes[sid] = (
            spec.project, spec.image, spec.backend, spec.cpu, spec.memory_mb, tuple(spec.labels.items()), now
        )  # fmt: skip
        self.cpu_used += spec.cpu
        self.mem_used += spec.memory_mb
        self.by_image[spec.image] += 1
        self.by_project[spec.project] += 1
        return self._info(sid)

    def _info(self, sid: str) -> SandboxInfo:
        project, image, backend, cpu, mem, labels, created = self.sandboxes[sid]
        spec = SandboxSpec(
            image=image, backend=backend, cpu=cpu, memory_mb=mem, labels=dict(labels), project=project
        )
        return SandboxInfo(
            id=sid, state=SandboxState.RUNNING, spec=spec, edge=self.name, created_at=created,
            last_active=created,
        )  # fmt: skip

    def _visible(self, sid: str, projects: Projects) -> None:
        books = self.sandboxes.get(sid)
        if books is None or (projects is not None and books[0] not in projects):
            raise errors.SandboxNotFound(f"sandbox {sid} not found on fake edge {self.name}")

    async def get(self, sid: str, projects: Projects) -> SandboxInfo:
        await asyncio.sleep(0)
        self._visible(sid, projects)
        return self._info(sid)

    async def list(
        self, labels: dict[str, str], project: str | None, projects: Projects
    ) -> builtins.list[SandboxInfo]:
        await asyncio.sleep(0)
        out = []
        for sid, (proj, *_, lab, _created) in self.sandboxes.items():
            if (projects is not None and proj not in projects) or (project is not None and proj != project):
                continue
            if labels.items() <= set(lab):
                out.append(self._info(sid))
        return out

    async def stop(self, sid: str, projects: Projects) -> None:
        await asyncio.sleep(0)
        self._visible(sid, projects)
        project, image, _, cpu, mem, _, _ = self.sandboxes.pop(sid)
        self.cpu_used -= cpu
        self.mem_used -= mem
        self.by_image[image] -= 1
        self.by_project[project] -= 1

    async def images(self) -> builtins.list[dict[str, Any]]:  # type: ignore[override]
        return [{"name": i, "layers": self.layers} for i in self.images]

    async def layers(self) -> builtins.list[dict[str, Any]]:  # type: ignore[override]
        return [{"ref": r} for r in self.layers]

    async def snapshots(self, projects: Projects = None) -> builtins.list[dict[str, Any]]:
        return []

    async def pools(self) -> builtins.list[Any]:
        return []

    async def checkpoints(self, projects: Projects) -> builtins.list[Any]:
        return []

    async def _not_simulated(self, *args: Any, **kw: Any) -> Any:
        raise errors.UnsupportedOperation(f"fake edge {self.name} (simulation) does not run sandboxes")

    def _not_simulated_stream(self, *args: Any, **kw: Any) -> Any:
        raise errors.UnsupportedOperation(f"fake edge {self.name} (simulation) does not run sandboxes")

    exec_reply = session_create = session_list = session_run = session_close = _not_simulated
    read_file = write_file = edit_file = stat_file = list_dir = delete_file = _not_simulated
    upload_tar = configure_pool = prewarm = pause = resume = pause_project = _not_simulated
    snapshot = fork = checkpoint = restore = delete_checkpoint = protect = verify = _not_simulated
    set_network = network = delete_snapshot = trajectory = trajectory_export = _not_simulated
    fncall_run = fncall_jupyter = build_image = import_image = pull_image = _not_simulated
    delete_image = image = _not_simulated
    exec_stream = download_tar = build_dockerfile = _not_simulated_stream

    def books_bytes(self) -> int:
        """A rough size of this fake's books (ids, tuples, dict slots): what the simulation
        itself adds to the process's memory, shown apart from the apiserver's."""
        n = len(self.sandboxes)
        if not n:
            return sys.getsizeof(self.sandboxes)
        sid, books = next(iter(self.sandboxes.items()))
        per = sys.getsizeof(sid) + sys.getsizeof(books) + sum(sys.getsizeof(x) for x in books)
        return sys.getsizeof(self.sandboxes) + n * per


def fake_edges(n: int, seed: int = 14) -> builtins.list[FakeEdge]:
    rng = random.Random(seed)
    return [FakeEdge(f"fake{i:04d}", *rng.choice(SHAPES)) for i in range(n)]


def _bench_app(
    iam: IAM, fakes: builtins.list[FakeEdge], n: int, placements: builtins.list[float]
) -> tuple[Any, EdgeDirectory, str]:
    """The apiserver app over `fakes`, its IAM holding the bench's project (room for `n`
    creates) and trainer; placement decisions timed into `placements`. (app, its edge
    directory, the trainer's token)."""
    iam.bootstrap()
    iam.create_project(
        PROJECT,
        quota=Quota(max_sandboxes=n, max_cpu=n * SPEC["cpu"], max_memory_mb=int(n * SPEC["memory_mb"])),
    )
    _, token = iam.create_principal("bench-trainer", [PROJECT])
    app = create_api_app(iam=iam, cluster_token=secrets.token_urlsafe(16), local_edges=list(fakes))
    directory: EdgeDirectory = app.state.dsec.directory
    _timed_candidates(directory, placements)
    return app, directory, token


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class Burst:
    iam: str
    n: int
    concurrency: int
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    messages: dict[str, str] = field(default_factory=dict)  # the last of each code
    placements: builtins.list[float] = field(default_factory=list)  # seconds, per candidates()
    per_edge: dict[str, int] = field(default_factory=dict)
    over_capacity: builtins.list[str] = field(default_factory=list)
    refused: int = 0
    quota_sandboxes: int = 0
    placed_ids: int = 0
    wrong_edge: int = 0
    load_max: float = 0.0
    load_mean: float = 0.0
    poll_cpu: builtins.list[float] = field(default_factory=list)  # seconds per poll_once
    idle_s: float = 0.0
    idle_cpu_s: float = 0.0
    rss_start: int = 0
    rss_edges: int = 0
    rss_end: int = 0
    books: int = 0

    @property
    def per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def per_cpu_s(self) -> float:
        return self.ok / self.cpu_s if self.cpu_s else 0.0


def _timed_candidates(directory: EdgeDirectory, out: builtins.list[float]) -> None:
    """Time every placement decision (candidates(): filter, order; the first is the pick)."""
    original = directory.candidates

    def timed(spec: SandboxSpec) -> Sequence[EdgeView]:
        t = time.perf_counter()
        ordered = original(spec)  # (a refusal, no edge able, is not a decision: not timed)
        ordered[0]  # the pick
        out.append(time.perf_counter() - t)
        return ordered

    directory.candidates = timed  # type: ignore[method-assign]


async def _burst(client: AsyncClient, n: int, concurrency: int, res: Burst) -> builtins.list[tuple[str, str]]:
    made: builtins.list[tuple[str, str]] = []
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            try:
                sb = await client.create("python", project=PROJECT, **SPEC)  # type: ignore[arg-type]
            except errors.DsecError as e:
                res.errors[e.code] += 1
                res.messages[e.code] = str(e)
                continue
            made.append((sb.id, sb.info.edge if sb.info else ""))  # (not the infos: the client's memory)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return made


async def run_one(
    iam_db: str,
    label: str,
    edges: int,
    n: int,
    concurrency: int,
    watch_s: float,
    polls: int = 10,
) -> Burst:
    """One apiserver process (this one) over `edges` fake edges: a burst of `n` creates through
    the SDK, then the watcher measured at rest with the sandboxes still reserved."""
    res = Burst(iam=label, n=n, concurrency=concurrency)
    gc.collect()
    res.rss_start = rss_bytes()
    iam = IAM(iam_db)
    fakes = fake_edges(edges)
    try:
        app, directory, token = _bench_app(iam, fakes, n, res.placements)
        async with app.router.lifespan_context(app):  # the watcher and the reconciler run
            res.rss_edges = rss_bytes()
            transport = httpx.ASGITransport(app=app)
            async with AsyncClient("http://apiserver.bench", token, transport=transport) as client:
                t, c = time.perf_counter(), cpu_s()
                made = await _burst(client, n, concurrency, res)
                res.wall_s, res.cpu_s = time.perf_counter() - t, cpu_s() - c
            res.ok = len(made)
            res.placed_ids = len({sid for sid, _ in made})
            views = directory.views
            res.wrong_edge = sum(1 for sid, edge in made if edge_of(sid) != edge or edge not in views)
            del made
            # At rest, N sandboxes reserved: the watcher's polls, then the whole idle process.
            for _ in range(polls):
                t = time.process_time()
                await directory.poll_once()
                res.poll_cpu.append(time.process_time() - t)
                await asyncio.sleep(0)
            t, c = time.perf_counter(), cpu_s()
            await asyncio.sleep(watch_s)
            res.idle_s, res.idle_cpu_s = time.perf_counter() - t, cpu_s() - c
            gc.collect()
            res.rss_end = rss_bytes()
            res.books = sum(f.books_bytes() for f in fakes)
            res.quota_sandboxes = iam.usage(PROJECT).sandboxes
        res.per_edge = {f.name: len(f.sandboxes) for f in fakes}
        res.refused = sum(f.refused for f in fakes)
        for f in fakes:
            if (
                len(f.sandboxes) > f.capacity["sandboxes"]
                or f.cpu_used > f.capacity["cpu"] + 1e-6
                or f.mem_used > f.capacity["memory_mb"]
            ):
                res.over_capacity.append(f.name)
        loads = [f.cpu_used / f.capacity["cpu"] for f in fakes]
        res.load_max, res.load_mean = max(loads), statistics.fmean(loads)
    finally:
        iam.close()
    return res


# --- the apiserver in a process of its own, over real HTTP ------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    """CPU time (user + system) of process `pid` so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve(iam_db: str, edges: int, n: int, port: int) -> None:
    """The child: the apiserver app under uvicorn (as `dsec apiserver` serves it: httptools,
    uvloop) over `edges` fake edges (simulation). Prints its token once it listens; answers
    a "report" line on stdin with its books as JSON; ends at the end of stdin."""
    import uvicorn

    iam = IAM(iam_db)
    fakes = fake_edges(edges)
    placements: builtins.list[float] = []
    try:
        app, directory, token = _bench_app(iam, fakes, n, placements)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        gc.freeze()  # (as dsec.service.serve)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.02)
        print(json.dumps({"token": token}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "report":
                books = {
                    "placements": placements,
                    "per_edge": {f.name: len(f.sandboxes) for f in fakes},
                    "refused": sum(f.refused for f in fakes),
                    "over_capacity": [
                        f.name
                        for f in fakes
                        if len(f.sandboxes) > f.capacity["sandboxes"]
                        or f.cpu_used > f.capacity["cpu"] + 1e-6
                        or f.mem_used > f.capacity["memory_mb"]
                    ],
                    "quota_sandboxes": iam.usage(PROJECT).sandboxes,
                    "loads": [f.cpu_used / f.capacity["cpu"] for f in fakes],
                    "views": sorted(directory.views),
                }
                print(json.dumps(books), flush=True)
                placements.clear()
        server.should_exit = True
        await serving
    finally:
        iam.close()


async def run_http(iam_db: str, label: str, edges: int, n: int, concurrency: int) -> Burst:
    """The same burst with the apiserver in a child process (real HTTP over uvicorn, the SDK
    here): the CPU counted is the apiserver process's alone."""
    res = Burst(iam=f"{label}, apiserver process alone (HTTP)", n=n, concurrency=concurrency)
    port = _free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--iam-db", iam_db, "--edges", str(edges),
         "--sandboxes", str(n), "--port", str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        first = child.stdout.readline()
        if not first:
            raise RuntimeError(f"the apiserver child ended before listening (exit {child.wait()})")
        token = json.loads(first)["token"]
        await asyncio.sleep(2.5)  # its watcher polls every edge before the burst, as in run_one
        async with AsyncClient(f"http://127.0.0.1:{port}", token) as client:
            t, c = time.perf_counter(), proc_cpu_s(child.pid)
            made = await _burst(client, n, concurrency, res)
            res.wall_s, res.cpu_s = time.perf_counter() - t, proc_cpu_s(child.pid) - c
        child.stdin.write("report\n")
        child.stdin.flush()
        books = json.loads(child.stdout.readline())
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()
    res.ok = len(made)
    res.placed_ids = len({sid for sid, _ in made})
    views = set(books["views"])
    res.wrong_edge = sum(1 for sid, edge in made if edge_of(sid) != edge or edge not in views)
    res.placements = books["placements"]
    res.per_edge = books["per_edge"]
    res.refused = books["refused"]
    res.over_capacity = books["over_capacity"]
    res.quota_sandboxes = books["quota_sandboxes"]
    res.load_max, res.load_mean = max(books["loads"]), statistics.fmean(books["loads"])
    return res


@contextmanager
def throwaway_postgres() -> Iterator[Any]:
    """A PostgreSQL server of its own (as tests/conftest.py starts it); yields its
    `create_database(name)` (a new database's URL), then stops and removes it."""
    from dsec.cluster.postgres import throwaway_server

    with throwaway_server("dsec-bench-pg-") as server:
        yield server.create_database


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report(runs: builtins.list[Burst], edges: int) -> str:
    r = runs[0]
    poll = statistics.median(r.poll_cpu) if r.poll_cpu else 0.0
    share = poll / (1.0 + poll)  # a poll, then the default 1 s sleep
    idle_share = r.idle_cpu_s / r.idle_s if r.idle_s else 0.0
    lines = [
        f"Real apiserver (SDK -> ASGI -> Gate -> IAM -> placement) over {edges} fake edges "
        f"(simulation), {r.n} creates at concurrency {r.concurrency}.",
        "",
        "| measure | value | target |",
        "|---|---|---|",
    ]
    for b in runs:
        if b.placements:
            p50, p99 = pct(b.placements, 0.5), pct(b.placements, 0.99)
            lines.append(
                f"| placement decision (candidates + pick over {edges} edges; IAM on {b.iam}), "
                f"p50 / p99 | {p50:.3f} / {p99:.3f} ms | p99 <= 1 ms: {_met(p99 <= 1.0)} |"
            )
    for b in runs:
        lines.append(
            f"| burst, IAM on {b.iam}: {b.ok} creates in {b.wall_s:.1f} s wall, {b.cpu_s:.1f} s CPU | "
            f"{b.per_s:.0f} creates/s; {b.per_cpu_s:.0f} per CPU-second | "
            f">= 2,000/s per core: {_met(b.per_cpu_s >= 2000)} |"
        )
    lines += [
        f"| watcher: CPU per poll of {edges} edges (median of {len(r.poll_cpu)}) | "
        f"{poll * 1000:.1f} ms = {share:.1%} of a core at the 1 s interval | < 10%: {_met(share < 0.10)} |",
        f"| idle process over {r.idle_s:.0f} s ({r.ok} sandboxes reserved: watcher + quota "
        f"reconciler) | {idle_share:.1%} of a core | |",
        f"| RSS: at start / {edges} edges registered and polled / {r.ok} sandboxes reserved | "
        f"{_mib(r.rss_start)} / {_mib(r.rss_edges)} / {_mib(r.rss_end)} | |",
        f"| of which the fake edges' own books (estimate) | {_mib(r.books)} | |",
        "",
    ]
    for b in runs:
        counts = sorted(b.per_edge.values())
        lines.append(
            f"- {b.iam}: {b.ok} of {b.n} placed ({b.placed_ids} distinct ids, {b.wrong_edge} on a wrong "
            f"edge), errors {dict(b.errors) or 'none'}, the project's quota counts {b.quota_sandboxes}; "
            f"{sum(b.per_edge.values())} on the fakes, {counts[0]}-{counts[-1]} per edge; "
            f"{b.refused} creates refused by a full edge and retried elsewhere; "
            f"{len(b.over_capacity)} edges over capacity; CPU load max {b.load_max:.0%} / "
            f"mean {b.load_mean:.0%} (max/mean {b.load_max / max(b.load_mean, 1e-9):.2f}x)"
        )
    lines.append(
        "- CPU: in-process runs count this process (getrusage), the SDK's side of each call "
        'included; "apiserver process alone" runs count only the apiserver\'s process (/proc), '
        "the SDK driving it over HTTP from this one. PostgreSQL's server runs in processes of its "
        "own and is not counted"
    )
    return "\n".join(lines)


async def run(
    edges: int,
    n: int,
    concurrency: int = 64,
    watch_s: float = 15.0,
    postgres: bool = False,
    pg_n: int | None = None,
    http: bool = False,
) -> tuple[builtins.list[Burst], str]:
    """In-process runs (SQLite, then PostgreSQL with `postgres`), each followed with `http` by
    the same burst against an apiserver process of its own."""
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-cp-"))
    try:
        runs = [await run_one(str(tmp / "iam.db"), "SQLite", edges, n, concurrency, watch_s)]
        if http:
            runs.append(await run_http(str(tmp / "iam-http.db"), "SQLite", edges, n, concurrency))
        if postgres:
            with throwaway_postgres() as new_db:
                pg, url = pg_n or n, new_db("dsec_bench")
                runs.append(await run_one(url, "PostgreSQL", edges, pg, concurrency, 0.0, polls=0))
                if http:
                    url = new_db("dsec_bench_http")
                    runs.append(await run_http(url, "PostgreSQL", edges, pg, concurrency))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return runs, report(runs, edges)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--edges", type=int, default=1000)
    ap.add_argument("--sandboxes", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--watch", type=float, default=15.0, help="seconds of the idle process measured")
    ap.add_argument("--postgres", action="store_true", help="the same burst with the IAM on PostgreSQL")
    ap.add_argument("--pg-sandboxes", type=int, default=None, help="creates of the PostgreSQL burst")
    ap.add_argument("--quick", action="store_true", help="100 edges, 5,000 sandboxes, 3 s watched")
    ap.add_argument(
        "--no-http", action="store_true", help="skip the bursts against an apiserver process of its own"
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # (the apiserver child)
    ap.add_argument("--iam-db", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        import uvloop  # (as uvicorn serves `dsec apiserver`: its loop="auto")

        if prof := os.environ.get("DSEC_BENCH_PROFILE"):  # the apiserver child's cProfile, to a file
            import cProfile

            serve = "uvloop.run(_serve(a.iam_db, a.edges, a.sandboxes, a.port))"
            cProfile.run(serve, f"{prof}.{os.getpid()}")
        else:
            uvloop.run(_serve(a.iam_db, a.edges, a.sandboxes, a.port))
        sys.exit(0)
    if a.quick:
        a.edges, a.sandboxes, a.watch = 100, 5000, 3.0
    _, text = asyncio.run(
        run(a.edges, a.sandboxes, a.concurrency, a.watch, a.postgres, a.pg_sandboxes, http=not a.no_http)
    )
    print(text)
