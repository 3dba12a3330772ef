"""What one job costs the API, request by request: the CPU of the API process (and of
Postgres' backends) for each request a job's life makes, one client sending them in turn.

A job's life, as a worker and its owner make it: the submit (``POST /jobs``), the claim
that hands it out (``POST /workers/claim``), a log chunk, the finish, then its owner's
``GET /jobs/{id}`` and a ``GET /jobs?limit=50``; beside them what an idle fleet sends: a
claim that finds nothing (answered from the memo or not) and an idle host's heartbeat.
bench/fleet.py shows where a fleet spends; this shows what each of those requests costs, so
a change to one is measured in CPU, which other load on the machine leaves alone (unlike
wall-clock rates).

    .venv/bin/python bench/jobcost.py [--backend sqlite|postgres|both] [--jobs 400]
        [--batch 50] [--rounds 2] [--serve-env K=V ...]

Each phase runs on a batch of jobs at once (submit 50, claim 50, ...), ``--rounds`` times
``--jobs``; the first round warms the process and is not counted.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable

from _harness import Api, CpuMeter, backends, database, serve
from api import Conn

PHASES = ("submit", "claim", "log", "finish", "get", "list 50", "empty claim", "heartbeat")


class Tally:
    """CPU seconds per phase, summed over the batches measured."""

    def __init__(self, api: Api, url: str) -> None:
        self.api, self.url = api, url
        self.cpu = {p: [0.0, 0.0, 0] for p in PHASES}
        self.counting = False

    def run(self, phase: str, n: int, one: Callable[[int], None]) -> None:
        meter = CpuMeter(self.api, self.url)
        meter.start()
        for i in range(n):
            one(i)
        meter.stop()
        if self.counting:
            got = self.cpu[phase]
            got[0] += meter.api_s
            got[1] += meter.db_s
            got[2] += n

    def report(self, backend: str) -> None:
        total = 0.0
        for phase, (api_s, db_s, n) in self.cpu.items():
            if n:
                api_ms, db_ms = api_s / n * 1000, db_s / n * 1000
                if phase not in ("empty claim", "heartbeat"):
                    total += api_ms
                db = f" + Postgres {db_ms:.2f} ms" if self.url.startswith("postgres") else ""
                print(f"{backend}: {phase:<12} API {api_ms:6.2f} ms{db} of CPU ({n} requests)")
        print(f"{backend}: a job's life (submit to list): API {total:.1f} ms of CPU")


def _expect(status: int, body: bytes, *ok: int) -> None:
    if status not in ok:
        raise SystemExit(f"unexpected {status}: {body[:300]!r}")


def life(api: Api, tally: Tally, batch: int) -> None:
    """One batch of jobs through their lives, each phase metered on its own."""
    user, worker = Conn(api, api.api_token), Conn(api, api.worker_token)
    name, identity = f"cost-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    body = (
        f'{{"name": "{name}", "identity": "{identity}", "hostname": "bench", '
        f'"cpu_slots": {batch}, "gpus": [], "checkpoint_root": "/tmp/c"}}'
    )
    _expect(*worker.request("POST", "/workers/register", body.encode()), 200)
    ids: list[int] = []
    claimed: list[int] = []
    spec = b'{"entrypoint": "t.py", "device": "cpu", "world_size": 1}'

    def submit(_: int) -> None:
        status, text = user.request("POST", "/jobs", spec)
        _expect(status, text, 201)
        ids.append(int(text.split(b'"id":', 1)[1].split(b",", 1)[0]))

    def claim(i: int) -> None:
        free = batch - i
        req = f'{{"name": "{name}", "free_cpu_slots": {free}, "free_gpus": [], "wait_s": 0}}'
        status, text = worker.request("POST", "/workers/claim", req.encode())
        _expect(status, text, 200)
        claimed.append(int(text.split(b'"attempt":', 1)[1].split(b",", 1)[0].strip(b" }")))

    def log(i: int) -> None:
        path = f"/workers/jobs/{ids[i]}/logs?worker={name}&attempt={claimed[i]}&offset=0"
        _expect(*worker.request("POST", path, b"[rank0] step 10 loss 0.5\n"), 202)

    def finish(i: int) -> None:
        done = f'{{"worker": "{name}", "attempt": {claimed[i]}, "exit_code": 0, '
        done += '"outcome": "exited"}'
        _expect(*worker.request("POST", f"/workers/jobs/{ids[i]}/finish", done.encode()), 200)

    def empty(_: int) -> None:
        req = f'{{"name": "{name}", "free_cpu_slots": {batch}, "free_gpus": [], "wait_s": 0}}'
        _expect(*worker.request("POST", "/workers/claim", req.encode()), 204)

    beat = f'{{"name": "{name}", "identity": "{identity}", "running": []}}'.encode()
    tally.run("submit", batch, submit)
    tally.run("claim", batch, claim)
    tally.run("log", batch, log)
    tally.run("finish", batch, finish)
    tally.run("get", batch, lambda i: _expect(*user.request("GET", f"/jobs/{ids[i]}"), 200))
    tally.run("list 50", batch, lambda _: _expect(*user.request("GET", "/jobs?limit=50"), 200))
    tally.run("empty claim", batch, empty)
    tally.run(
        "heartbeat",
        batch,
        lambda _: _expect(*worker.request("POST", "/workers/heartbeat", beat), 200),
    )
    user.close()
    worker.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="both", choices=["sqlite", "postgres", "both"])
    ap.add_argument("--jobs", type=int, default=400, help="jobs measured in each round")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="rounds counted (after a warm-up)")
    ap.add_argument("--serve-env", action="append", default=[], metavar="K=V")
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.serve_env)
    for backend in backends(args.backend):
        with database(backend) as url, serve(url, DDPQ_LEASE_S="3600", **env) as api:
            tally = Tally(api, url)
            for r in range(args.rounds + 1):
                tally.counting = r > 0
                for _ in range(max(1, args.jobs // args.batch)):
                    life(api, tally, args.batch)
            tally.report(backend)


if __name__ == "__main__":
    main()
