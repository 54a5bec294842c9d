"""fncall benchmarks through HTTP (`/run_code`, as SandboxFusion clients call it), with
baselines measured in the same run: a plain subprocess on the host (the floor) and a
fresh container per call. Run as root:

    .venv/bin/python bench/bench_fncall.py [--n 200] [--seconds 10] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import pct, podman_run_true, row, running_service, timed_cmd  # type: ignore[import-not-found]

from dsec.client import Client

CPP = '#include <cstdio>\nint main(){long s=0; for(int i=0;i<1000;i++) s+=i; printf("%ld\\n", s);}'


def sequential(http: httpx.Client, body: dict[str, object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = http.post("/run_code", json=body).json()
        out.append(time.perf_counter() - t)
        assert r["status"] == "Success", r
    return out


async def sustained(url: str, token: str, seconds: float, concurrency: int) -> float:
    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as http:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                r = await http.post("/run_code", json={"code": "print(1)", "language": "python"})
                assert r.json()["status"] == "Success"
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


def main(n: int, seconds: float, concurrency: int) -> None:
    with running_service("fnb") as (url, token):
        lines = ["| operation | p50 ms | p95 ms |", "|---|---|---|"]
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            py = {"code": "print(1)", "language": "python"}
            sequential(http, py, 20)  # workers warm
            fn_py = sequential(http, py, n)
            fn_cpp = sequential(http, {"code": CPP, "language": "cpp"}, max(10, n // 10))
        rate = asyncio.run(sustained(url, token, seconds, concurrency))
        host_py = timed_cmd([sys.executable, "-S", "-c", "print(1)"], n)
        host_deb = (
            timed_cmd(["/usr/bin/python3", "-c", "print(1)"], n) if Path("/usr/bin/python3").exists() else []
        )
        build = Path(tempfile.mkdtemp(prefix="dsec-bench-cpp-"))
        (build / "main.cpp").write_text(CPP)
        host_cpp = timed_cmd(
            ["sh", "-c", f"cd {build} && g++ -O2 -o main main.cpp && ./main"], max(10, n // 10)
        )
        shutil.rmtree(build)
        fresh = []
        with Client(url, token) as c:
            for _ in range(max(10, n // 10)):
                t = time.perf_counter()
                sb = c.create("code")
                sb.exec(["python3", "-c", "print(1)"])
                sb.stop()
                fresh.append(time.perf_counter() - t)
        rootfs = next(Path("/var/lib/dsec/layers/layers/code").iterdir()) / "tree"
        podman = podman_run_true(rootfs, 5)
        lines += [
            row("**fncall python print(1) via HTTP /run_code**", fn_py),
            row("host: python -S -c 'print(1)' in a subprocess (floor)", host_py),
        ]
        if host_deb:
            lines.append(row("host: /usr/bin/python3 -c 'print(1)' (site imports)", host_deb))
        lines += [
            row("fresh dsec sandbox per call: create + python3 print(1) + stop (SDK)", fresh),
            row("fresh podman container per call (runc, /bin/true only)", podman),
            row("**fncall C++ compile + run via HTTP**", fn_cpp),
            row("host: g++ -O2 + run (floor)", host_cpp),
            "",
            f"Sustained: {rate:.0f} python calls/s through /run_code ({concurrency} concurrent clients, "
            f"{seconds:.0f} s, 2 cores; the clients share the cores).",
            f"fncall python p50 vs host subprocess: {pct(fn_py, 0.5) / pct(host_py, 0.5):.2f}x; "
            f"vs a fresh sandbox per call: {pct(fresh, 0.5) / pct(fn_py, 0.5):.1f}x faster.",
        ]
        print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    main(a.n, a.seconds, a.concurrency)
