"""What the API process spends on the moves of a job: CPU per claim + finish, per GET.

Every status change goes through one state machine (service/queue/states.py); this
measures that it costs nothing the API would feel. On a real `ddpq serve` (SQLite or
Postgres), one client submits N no-op jobs, then claims and finishes each as a worker
would (sequentially, so each request is the API's only work), then reads N random jobs
with ``GET /jobs/{id}``. The figure is the API process's own CPU time (user + system,
from /proc) per claim + finish and per GET, in ms; compare two checkouts by running it
with each on PYTHONPATH (the README gives the ratio).

    .venv/bin/python bench/transitions.py [--backend sqlite|postgres|both] [--jobs 1000]
"""

from __future__ import annotations

import argparse
import json
import random

from _harness import backends, database, register, serve


def measure(backend: str, jobs: int) -> dict[str, float]:
    with database(backend) as url, serve(url) as api:
        register(api, "w", cpu_slots=100_000)
        with api.client() as user, api.client("worker") as worker:
            ids = [
                user.post("/jobs", json={"entrypoint": "noop.py", "device": "cpu"}).json()["id"]
                for _ in range(jobs)
            ]
            claim = {"name": "w", "free_cpu_slots": 100_000, "free_gpus": [], "wait_s": 0}
            before = api.cpu_seconds()
            for _ in ids:
                c = worker.post("/workers/claim", json=claim).json()
                done = {"worker": "w", "attempt": c["attempt"], "exit_code": 0}
                worker.post(f"/workers/jobs/{c['job_id']}/finish", json=done).raise_for_status()
            moved = api.cpu_seconds() - before
            before = api.cpu_seconds()
            for job_id in random.choices(ids, k=jobs):
                user.get(f"/jobs/{job_id}").raise_for_status()
            read = api.cpu_seconds() - before
    return {"claim_finish_ms": moved / jobs * 1e3, "get_ms": read / jobs * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--jobs", type=int, default=1000)
    args = ap.parse_args()
    for backend in backends(args.backend):
        print(json.dumps({"backend": backend, **measure(backend, args.jobs)}))


if __name__ == "__main__":
    main()
