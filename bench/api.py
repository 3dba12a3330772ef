"""The API under a realistic store, and what reporting costs a training step.

1. Ingest: metric items per second through ``POST /jobs/{id}/metrics``, in batches
   of 1000 items (each item a step with an epoch and two values, loss and
   accuracy), sent one after another by one client as ``ddpq.train``'s sender does.
2. ``GET /jobs/{id}`` with 10,000 jobs and 1,000,000 metric points stored (seeded
   straight into the database, then ``ddpq serve`` started on it): p50/p95 of one
   client's sequential requests for random jobs, then requests/s with 8
   concurrent keep-alive clients. Also the time of one ``GET /metrics`` scrape.
3. ``ddpq.train.report`` on a training step: a small MLP (784-512-512-10, batch
   128, SGD, one intra-op thread as under torchrun with several ranks) times
   steps with and without ``report(step, loss=loss)``, in alternating runs of 10
   (load from other processes changes more slowly than that). Two figures: the
   ratio of the median step times with and without, which shows what a step
   itself pays; and the CPU time spent reporting (inside report() on the training
   thread plus the sender thread's own CPU, read from /proc: materialising values,
   JSON, HTTP) as a share of the reporting steps' wall time, an upper bound of
   what reporting can take from training if it all came out of the training
   thread's core (goal <= 1%). Run once plain and once with
   ``DDPQ_TENSORBOARD_DIR`` set.
4. ``--parts heartbeat``: the CPU (API and Postgres) of one ``POST /workers/heartbeat``
   of an idle 8-GPU host and of one running 8 attempts, what each host of a fleet sends
   every 2 s (bench/fleet.py runs the fleet).

    .venv/bin/python bench/api.py [--backend sqlite|postgres] [--jobs 10000] [--points 1000000]
        [--parts ingest,get,report,heartbeat] [--senders N]
        [--workers N]

Goals on a 2-core machine (SQLite): >= 50,000 items/s; GET p95 <= 10 ms and
>= 1,000 requests/s; report() overhead <= 1%.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from _harness import (
    Api,
    CpuMeter,
    child_env,
    database,
    percentile,
    postgres_available,
    register,
    serve,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BATCH = 1000
POINTS_PER_STEP = 2  # loss and accuracy


# ---- seeding --------------------------------------------------------------------------


def seed(url: str, jobs: int, points: int) -> None:
    """``jobs`` jobs (98% finished, 1% running, 1% queued on no worker's size), one
    checkpoint each, and ``points`` metric points spread evenly over them."""
    from sqlalchemy import create_engine, insert, text

    from service.db import upgrade
    from service.models import Checkpoint, Job, MetricPoint, Worker

    upgrade(url)
    engine = create_engine(url)
    now = datetime.now(UTC)
    steps_per_job = max(1, points // (jobs * POINTS_PER_STEP))
    spec = {
        "recipe": "toy-regression",
        "args": ["--total-epochs", "20"],
        "world_size": 2,
        "device": "cpu",
    }
    job_rows, ckpt_rows = [], []
    for i in range(1, jobs + 1):
        status = "succeeded" if i % 100 > 1 else ("running" if i % 100 == 1 else "queued")
        created = now - timedelta(seconds=(jobs - i) * 10)
        last = steps_per_job * 10
        job_rows.append(
            {
                "id": i,
                "name": f"job {i}",
                "status": status,
                "spec": spec,
                "priority": 0,
                "nnodes": 1,
                # Queued ones need more than any worker has: they stay queued.
                "nproc_per_node": 2 if status != "queued" else 64,
                "device": "cpu",
                "max_attempts": 3,
                "created_at": created,
                "queued_at": created,
                "started_at": created + timedelta(seconds=1) if status != "queued" else None,
                "finished_at": created + timedelta(seconds=9) if status == "succeeded" else None,
                "attempt": 0 if status == "queued" else 1,
                "exit_code": 0 if status == "succeeded" else None,
                "worker": "seeded" if status == "running" else None,
                "held_cpu_slots": 2 if status == "running" else 0,
                "latest_metrics": None
                if status == "queued"
                else {"step": last, "epoch": 19.0, "values": {"loss": 0.1, "accuracy": 0.9}},
                "log_size": 0,
            }
        )
        if status != "queued":
            ckpt_rows.append(
                {
                    "job_id": i,
                    "attempt": 1,
                    "path": f"/ckpt/job-{i}/step-{last:09d}.pt",
                    "step": last,
                    "epoch": 19.0,
                    "metrics": {},
                    "created_at": created + timedelta(seconds=8),
                }
            )
    with engine.begin() as conn:
        conn.execute(
            insert(Worker),
            [
                {
                    "name": "seeded",
                    "hostname": "h",
                    "cpu_slots": 1000,
                    "gpus": [],
                    "checkpoint_root": "/ckpt",
                    "registered_at": now,
                    "last_heartbeat": now,
                }
            ],
        )
        conn.execute(insert(Job), job_rows)
        conn.execute(insert(Checkpoint), ckpt_rows)
        if conn.dialect.name == "postgresql":  # explicit ids: move the sequence past them
            conn.execute(
                text("SELECT setval(pg_get_serial_sequence('jobs', 'id'), :n)"), {"n": jobs}
            )
    point_rows: list[dict[str, Any]] = []
    with engine.begin() as conn:
        for i in range(1, jobs + 1):
            if job_rows[i - 1]["status"] == "queued":
                continue
            for step in range(1, steps_per_job + 1):
                for name in ("loss", "accuracy"):
                    point_rows.append(
                        {
                            "job_id": i,
                            "name": name,
                            "step": step * 10,
                            "value": 1.0 / step,
                            "epoch": step / 10,
                            "attempt": 1,
                            "time": now,
                        }
                    )
            if len(point_rows) >= 100_000:
                conn.execute(insert(MetricPoint), point_rows)
                point_rows = []
        if point_rows:
            conn.execute(insert(MetricPoint), point_rows)
    engine.dispose()


# ---- the API ------------------------------------------------------------------------------


def claim_job(api: Api, worker: str) -> dict[str, Any]:
    """A running job and its token, ahead of every seeded queued job."""
    register(api, worker, cpu_slots=8)
    with api.client("worker") as w, api.client() as c:
        c.post(
            "/jobs", json={"entrypoint": "t.py", "device": "cpu", "priority": 100}
        ).raise_for_status()
        r = w.post(
            "/workers/claim",
            json={"name": worker, "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5},
        )
        r.raise_for_status()
        claim: dict[str, Any] = r.json()
        return claim


class Conn:
    """A lean keep-alive HTTP/1.1 client: the benchmark must not eat the cores it measures."""

    def __init__(self, api: Api, token: str) -> None:
        host, port = api.url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.headers = {"Authorization": f"Bearer {token}"}

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = self.headers
        if body is not None:
            headers = {**headers, "Content-Type": "application/json"}
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        return r.status, r.read()

    def close(self) -> None:
        self.conn.close()


def ingest(api: Api, batches: int, meter: CpuMeter, senders: int = 1) -> float:
    """Items/s stored through POST /jobs/{id}/metrics: ``senders`` jobs (a rank 0 each)
    posting ``batches`` batches each, at once. One sender waits for every answer, so the
    API's and Postgres's CPU run in series; several keep both busy (and, with
    --workers N, several API processes: one sender's connection stays on one)."""
    conns = []
    for n in range(senders):
        claim = claim_job(api, f"ingest-{n}")
        conns.append((Conn(api, claim["token"]), f"/jobs/{claim['job_id']}/metrics"))
    bodies = []
    for b in range(batches):
        items = [
            {
                "step": b * BATCH + i,
                "epoch": (b * BATCH + i) / 5000,
                "values": {"loss": 1.0 / (b * BATCH + i + 1), "accuracy": 0.5 + i / 4000},
            }
            for i in range(BATCH)
        ]
        bodies.append(json.dumps({"items": items}).encode())
    for conn, path in conns:
        for body in bodies[:3]:  # warm-up
            status, text = conn.request("POST", path, body)
            assert status == 202, text
    start = threading.Barrier(senders + 1)

    def send(conn: Conn, path: str) -> None:
        start.wait()
        for body in bodies[3:]:
            status, text = conn.request("POST", path, body)
            assert status == 202, text

    threads = [threading.Thread(target=send, args=c) for c in conns]
    for t in threads:
        t.start()
    meter.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    meter.stop()
    for conn, _ in conns:
        conn.close()
    return senders * (batches - 3) * BATCH / elapsed


def heartbeats(api: Api, url: str, n: int) -> dict[str, CpuMeter]:
    """CPU per ``POST /workers/heartbeat`` of an idle 8-GPU host and of one running 8
    attempts (what every host of a fleet sends every 2 s: bench/fleet.py), one sender."""
    out = {}
    with api.client("worker") as w, api.client() as c:
        running: list[dict[str, int]] = []
        for name in ("hb-busy", "hb-idle"):
            identity = uuid.uuid4().hex
            w.post(
                "/workers/register",
                json={
                    "name": name,
                    "identity": identity,
                    "hostname": name,
                    "cpu_slots": 8,
                    "gpus": list(range(8)),
                    "checkpoint_root": "/tmp/c",
                },
            ).raise_for_status()
            if name == "hb-busy":
                free = list(range(8))
                for _ in range(8):
                    job = {"entrypoint": "t.py", "device": "cuda", "priority": 100}
                    c.post("/jobs", json=job).raise_for_status()
                    body = {"name": name, "free_cpu_slots": 8, "free_gpus": free, "wait_s": 5}
                    r = w.post("/workers/claim", json=body)
                    r.raise_for_status()
                    got = r.json()
                    running.append({"job_id": got["job_id"], "attempt": got["attempt"]})
                    free = [g for g in free if g not in got["gpus"]]
            beat = json.dumps(
                {
                    "name": name,
                    "identity": identity,
                    "running": running if name == "hb-busy" else [],
                }
            ).encode()
            conn = Conn(api, api.worker_token)
            for _ in range(50):  # warm-up
                conn.request("POST", "/workers/heartbeat", beat)
            meter = CpuMeter(api, url)
            meter.start()
            for _ in range(n):
                status, text = conn.request("POST", "/workers/heartbeat", beat)
                assert status == 200, text
            meter.stop()
            conn.close()
            out["a host running 8 attempts" if name == "hb-busy" else "an idle host"] = meter
    return out


def get_latency(api: Api, jobs: int, n: int) -> tuple[float, float]:
    conn = Conn(api, api.api_token)
    rng = random.Random(1)
    for _ in range(50):  # warm-up
        conn.request("GET", f"/jobs/{rng.randint(1, jobs)}")
    samples = []
    for _ in range(n):
        path = f"/jobs/{rng.randint(1, jobs)}"
        t0 = time.perf_counter()
        status, text = conn.request("GET", path)
        samples.append(time.perf_counter() - t0)
        assert status == 200, text
    conn.close()
    return percentile(samples, 0.5), percentile(samples, 0.95)


def get_throughput(
    api: Api, jobs: int, clients: int, seconds: float, meter: CpuMeter
) -> tuple[float, int]:
    counts = [0] * clients
    stop = threading.Event()
    barrier = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        conn = Conn(api, api.api_token)
        rng = random.Random(k)
        barrier.wait()
        while not stop.is_set():
            status, text = conn.request("GET", f"/jobs/{rng.randint(1, jobs)}")
            assert status == 200, text
            counts[k] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    meter.start()
    barrier.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    meter.stop()
    return sum(counts) / elapsed, sum(counts)


def scrape_time(api: Api, n: int = 20) -> float:
    conn = Conn(api, api.api_token)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        status, text = conn.request("GET", "/metrics")
        samples.append(time.perf_counter() - t0)
        assert status == 200, text
    conn.close()
    return statistics.median(samples)


# ---- report() on a training step --------------------------------------------------------

STEPPER = r"""
import json, os, statistics, sys, threading, time
import torch
from ddpq import train

torch.set_num_threads(1)  # as under torchrun with several ranks (OMP_NUM_THREADS=1)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(784, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10),
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
steps, BLOCK = int(sys.argv[1]), int(sys.argv[2])
step = 0
in_report = 0.0

def block(reporting, n):
    global step, in_report
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        if reporting:
            r0 = time.perf_counter()
            train.report(step, loss=loss.detach(), epoch=step / 1000)
            in_report += time.perf_counter() - r0
        times.append(time.perf_counter() - t0)
    return times

def sender_cpu():
    # The sender thread's own CPU time (materialising values, JSON, HTTP, event files).
    t = next(t for t in threading.enumerate() if t.name == "ddpq-train-sender")
    fields = open(f"/proc/self/task/{t.native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

block(True, 200); block(False, 200)  # warm-up (and the sender thread started)
assert train.flush(60)
cpu0, in_report = sender_cpu(), 0.0
# Short blocks, alternating: load from other processes changes slower than 10 steps,
# so both kinds of step meet the same machine.
plain, reported = [], []
for _ in range(steps // BLOCK):
    reported += block(True, BLOCK)
    plain += block(False, BLOCK)
assert train.flush(60)
cpu = (in_report + sender_cpu() - cpu0) / sum(reported)
ratio = statistics.median(reported) / statistics.median(plain)
print(json.dumps({"ratio": ratio, "plain": statistics.median(plain),
                  "reported": statistics.median(reported), "cpu": cpu}))
"""


def report_overhead(api: Api, tensorboard: bool, steps: int, block: int) -> dict[str, Any]:
    claim = claim_job(api, "tb" if tensorboard else "trainer")
    env = child_env(
        DDPQ_URL=api.url,
        DDPQ_JOB_ID=str(claim["job_id"]),
        DDPQ_JOB_TOKEN=claim["token"],
        RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    if tensorboard:
        env["DDPQ_TENSORBOARD_DIR"] = tempfile.mkdtemp(prefix="ddpq-bench-tb-")
    out = subprocess.run(
        [sys.executable, "-c", STEPPER, str(steps), str(block)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=150, help="ingest batches of 1000 items")
    ap.add_argument("--requests", type=int, default=2000, help="sequential GETs for p50/p95")
    ap.add_argument("--steps", type=int, default=2000, help="training steps of each kind")
    ap.add_argument("--block", type=int, default=10, help="steps in a row of one kind")
    ap.add_argument("--parts", default="ingest,get,report", help="what to run (also: heartbeat)")
    ap.add_argument("--workers", type=int, default=1, help="API processes (serve --workers)")
    ap.add_argument("--senders", type=int, default=1, help="jobs posting metrics at once")
    args = ap.parse_args()
    if args.backend == "postgres" and not postgres_available():
        raise SystemExit("postgres: unreachable")
    with database(args.backend) as url:
        t0 = time.perf_counter()
        seed(url, args.jobs, args.points)
        print(
            f"{args.backend}: seeded {args.jobs} jobs and {args.points} metric points "
            f"in {time.perf_counter() - t0:.1f}s"
        )
        # No heartbeats here: a long lease keeps the claimed jobs' tokens valid.
        with serve(url, DDPQ_LEASE_S="3600", DDPQ_API_WORKERS=str(args.workers)) as api:
            parts = set(args.parts.split(","))
            if "ingest" in parts:
                meter = CpuMeter(api, url)
                rate = ingest(api, args.batches, meter, args.senders)
                print(
                    f"{args.backend}: ingest: {rate:,.0f} items/s ({rate * POINTS_PER_STEP:,.0f} "
                    f"points/s) in batches of {BATCH}, {args.senders} sender(s); "
                    f"a batch: {meter.per(args.senders * (args.batches - 3))}"
                )
            if "heartbeat" in parts:
                for what, meter in heartbeats(api, url, args.requests).items():
                    print(f"{args.backend}: heartbeat of {what}: {meter.per(args.requests)}")
            if "get" in parts:
                p50, p95 = get_latency(api, args.jobs, args.requests)
                print(
                    f"{args.backend}: GET /jobs/{{id}}: p50 {p50 * 1000:.2f} ms, "
                    f"p95 {p95 * 1000:.2f} ms (one client, {args.requests} requests)"
                )
                meter = CpuMeter(api, url)
                rps, n = get_throughput(api, args.jobs, clients=8, seconds=5, meter=meter)
                print(
                    f"{args.backend}: GET /jobs/{{id}}: {rps:,.0f} requests/s (8 clients); "
                    f"{meter.per(n)}"
                )
                print(f"{args.backend}: GET /metrics: {scrape_time(api) * 1000:.1f} ms a scrape")
            if "report" in parts:
                for tensorboard in (False, True):
                    r = report_overhead(api, tensorboard, args.steps, args.block)
                    what = "report() + TensorBoard" if tensorboard else "report()"
                    print(
                        f"{what} every step: median step {r['plain'] * 1000:.3f} ms without, "
                        f"{r['reported'] * 1000:.3f} ms with: ratio {r['ratio']:.4f}; "
                        f"CPU spent reporting: {r['cpu'] * 100:.2f}% of the steps' time "
                        f"({r['cpu'] * r['reported'] * 1e6:.0f} us a step)"
                    )


if __name__ == "__main__":
    main()
