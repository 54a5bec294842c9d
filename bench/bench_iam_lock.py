"""How long a create's admission holds the IAM's write lock on PostgreSQL: the ceiling of
creates per second across every apiserver of a cluster (each IAM write takes the one lock).

A keyed create's claim and reservation (`IAM.begin_idempotent(..., reserve=...)`) on a
throwaway PostgreSQL server on this host, the two paths alternating in one process:

* functions (the default): one call of `dsec_begin_create`, which takes the lock and commits
  inside one statement: the lock is held for the function's run on the server;
* python (`has_functions` off, what the code did before): BEGIN with the lock, four
  statements, COMMIT: the lock is held across the round trips between them.

Reported: the call's wall time on the client (p50, p90), and for the function its run on
the server (its call's median minus a `SELECT 1` round trip's). Over a network the python
path's hold grows with every round trip; the function's does not.

    .venv/bin/python bench/bench_iam_lock.py [--n 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg

from dsec.cluster.postgres import throwaway_server
from dsec.iam import IAM


def one_round(url: str, mode: str, n: int) -> str:
    iam = IAM(url)
    try:
        iam.bootstrap()
        if mode == "python":
            iam._db.has_functions = False  # type: ignore[misc]
        walls = []
        for i in range(n):
            t = time.perf_counter()
            iam.begin_idempotent("bench", f"k{i}", reserve=(f"pending-{i}", "default", 0.1, 1))
            walls.append(time.perf_counter() - t)
    finally:
        iam.close()
    walls.sort()
    line = f"| {mode} | {walls[n // 2] * 1e6:.0f} | {walls[int(n * 0.9)] * 1e6:.0f} |"
    if mode != "functions":
        return line + " |"
    with psycopg.connect(url, autocommit=True) as c:
        rt, fn = [], []
        for i in range(n):
            t = time.perf_counter()
            c.execute("SELECT 1")
            rt.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.execute("SELECT dsec_begin_create(NULL, NULL, NULL, 0, %s, 'default', 100, 1)", (f"x{i}",))
            fn.append(time.perf_counter() - t)
    return line + f" {(statistics.median(fn) - statistics.median(rt)) * 1e6:.0f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="admissions per round")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print("| path | client wall p50 us | p90 us | function's run on the server us |")
    print("|---|---|---|---|")
    with throwaway_server("dsec-bench-lock-") as server:
        for r in range(a.rounds):
            for mode in ("functions", "python"):
                print(one_round(server.create_database(f"lock_{mode}_{r}"), mode, a.n), flush=True)


if __name__ == "__main__":
    main()
