"""What a queued job's reason costs the API with a large fleet, in process, old tree
against new.

A database (a SQLite file, a Postgres database) with WORKERS registered workers of 8
GPUs and 8 CPU slots, RUNNING 1-GPU jobs running on them (spread at random, at most 8
a worker) and QUEUED queued jobs of 1, 2, 4 and 8 GPUs, seeded straight into the
database. Two parts, each the CPU time of one call (this process's, plus on Postgres
the CPU of the backend serving it, read from /proc as _harness.CpuMeter does):

- ``reasons``: ``queue.pending_reasons`` for 50 queued jobs (a page of ``GET /jobs``);
- ``strict``: ``queue.unschedulable`` for a new job (a strict submit's check).

Each tree given with ``--trees`` (a checkout whose ``service`` is imported) is
measured in a process of its own, in alternating rounds on the same database; each
figure is the median of the rounds, and the ratio is the first tree's over each
other's.

    .venv/bin/python bench/reasons.py --trees OLD_TREE,NEW_TREE [--backend sqlite|postgres|both]
        [--workers 1000] [--running 6000] [--queued 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _harness import backends, cpu_of, database

PAGE = 50  # queued jobs a page of GET /jobs shows
MIN_CPU_S = 0.5  # each figure: calls repeated until they took this much CPU


def seed(url: str, workers: int, running: int, queued: int) -> None:
    from sqlalchemy import create_engine, insert, text

    from service.db import upgrade
    from service.models import Job, Worker

    upgrade(url)
    engine = create_engine(url)
    now = datetime.now(UTC)
    rng = random.Random(1)
    spec = {"recipe": "toy-regression", "args": [], "world_size": 1, "device": "cuda"}
    names = [f"host-{i:04d}" for i in range(workers)]
    held: dict[str, int] = dict.fromkeys(names, 0)
    rows: list[dict[str, Any]] = []
    waiting: list[dict[str, Any]] = []
    for _ in range(running):
        name = rng.choice([n for n in names if held[n] < 8] or names)
        gpu = held[name] % 8
        held[name] += 1
        rows.append(
            {"name": None, "status": "running", "spec": spec, "nproc_per_node": 1,
             "device": "cuda", "max_attempts": 3, "created_at": now, "queued_at": now,
             "started_at": now, "attempt": 1, "worker": name, "gpus": [gpu]}
        )  # fmt: skip
    for i in range(queued):
        ranks = (1, 2, 4, 8)[i % 4]
        waiting.append(
            {"name": None, "status": "queued", "spec": {**spec, "world_size": ranks},
             "nproc_per_node": ranks, "device": "cuda", "max_attempts": 3,
             "created_at": now, "queued_at": now, "gpus": None}
        )  # fmt: skip
    with engine.begin() as conn:
        conn.execute(
            insert(Worker),
            [
                {"name": n, "hostname": n, "cpu_slots": 8, "gpus": list(range(8)),
                 "checkpoint_root": "/ckpt", "registered_at": now, "last_heartbeat": now}
                for n in names
            ],
        )  # fmt: skip
        conn.execute(insert(Job), rows)
        conn.execute(insert(Job), waiting)
        if conn.dialect.name == "postgresql":
            # As autovacuum would have by then: without statistics the planner takes
            # 6,000 running jobs for a handful.
            conn.execute(text("ANALYZE"))
    engine.dispose()


def measure(url: str) -> dict[str, float]:
    """Milliseconds of CPU per call of each part, in this process and its backend."""
    from sqlalchemy import select, text

    from service import queue
    from service.db import Database
    from service.models import Job

    db = Database(url)
    out: dict[str, float] = {}
    with db.read() as s:
        backend = None
        if url.startswith("postgresql"):
            backend = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
        page = list(
            s.scalars(select(Job).where(Job.status == "queued").order_by(Job.id).limit(PAGE))
        )
        positions = {job.id: i + 1 for i, job in enumerate(page)}
        new = Job(nnodes=1, nproc_per_node=8, device="cuda")
        parts = {
            "reasons": lambda: queue.pending_reasons(s, page, positions),
            "strict": lambda: queue.unschedulable(s, new),
        }
        for part, call in parts.items():
            call()  # warm: statements compiled and cached
            calls = 0
            db0 = cpu_of(backend) if backend else 0.0
            t0 = time.process_time()
            while time.process_time() - t0 < MIN_CPU_S:
                call()
                calls += 1
            api = time.process_time() - t0
            dbs = (cpu_of(backend) - db0) if backend else 0.0
            out[f"{part}_api_ms"] = api / calls * 1000
            out[f"{part}_db_ms"] = dbs / calls * 1000
    db.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", required=True, help="checkouts to compare, comma-separated")
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--running", type=int, default=6000)
    ap.add_argument("--queued", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="alternating runs of each tree")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # a child: one tree, one run
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    for backend in backends(args.backend):
        with database(backend) as url:
            seed(url, args.workers, args.running, args.queued)
            runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
            for _ in range(args.rounds):
                for tree in trees:
                    env = {**os.environ, "PYTHONPATH": tree}
                    child = [sys.executable, __file__, "--trees", tree, "--measure", url]
                    done = subprocess.run(child, env=env, check=True, capture_output=True)
                    runs[tree].append(json.loads(done.stdout))
            medians = {
                t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in runs.items()
            }
            print(
                f"{backend}: {args.workers} workers, {args.running} running, "
                f"{args.queued} queued; CPU ms per call, median of {args.rounds} rounds"
            )
            for tree, m in medians.items():
                print(
                    f"  {tree}: reasons for {PAGE} jobs: API {m['reasons_api_ms']:.2f} + "
                    f"database {m['reasons_db_ms']:.2f}; strict check: API "
                    f"{m['strict_api_ms']:.3f} + database {m['strict_db_ms']:.3f}"
                )
            first = medians[trees[0]]
            for tree in trees[1:]:
                m = medians[tree]
                ratios = ", ".join(
                    f"{part} {_total(first, part) / _total(m, part):.1f}x"
                    f" (API alone {first[f'{part}_api_ms'] / m[f'{part}_api_ms']:.1f}x)"
                    for part in ("reasons", "strict")
                )
                print(f"  {trees[0]} / {tree}: {ratios}")


def _total(m: dict[str, float], part: str) -> float:
    return m[f"{part}_api_ms"] + m[f"{part}_db_ms"]


if __name__ == "__main__":
    main()
