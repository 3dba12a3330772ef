"""How cost grows with the fleet: N simulated GPU hosts, M users, K readers, one API.

Each simulated host (8 GPUs) speaks the worker protocol exactly as worker/executors/loop.py and
worker/edges/api.py do, without torchrun: it registers (with an identity), heartbeats its
running attempts every ``heartbeat_s`` the API gives it (the pause counted from the end
of the last one, as the worker's loop does), and long-polls ``POST /workers/claim``
(for the ``claim_wait_s`` the API gives it) with its free GPUs and CPU slots, one job
per claim, always (a host whose GPUs are all busy still offers its CPU slots, as the
agent does); a claimed job "runs"
for the duration the simulator drew for it, ships one log line and reports its exit.
M users (each with a user token made through ``POST /users``) submit GPU jobs of 1, 2,
4 or 8 ranks as a Poisson stream that keeps the fleet about ``--load`` busy; K readers
poll as a dashboard or a CLI would (``GET /jobs?limit=50``, ``GET /jobs/{id}``, now and
then a job's metrics), and a Prometheus scrapes ``GET /metrics`` every
``--scrape-every`` s. Everything runs against a real ``ddpq serve`` on a fresh
Postgres (or SQLite) database; ``--api-procs N`` gives ``ddpq serve --workers N`` when
the tree's serve has that option.

All clients are coroutines of one process on a minimal HTTP/1.1 keep-alive client
(httpx's asyncio client costs several times the CPU per request, and the simulator
shares this machine's cores with the API): the simulator's own CPU and its event
loop's lag are reported beside the figures, so a latency that is the simulator's own
is seen as such.

Per N (after a warm-up that first fills the fleet), over the measured window:
  - API CPU (the serve process and its children) per host per second, Postgres
    backends' CPU (their /proc), the simulator's own;
  - heartbeat round trip p50/p99;
  - claim latency p50/p99: for a claim answered with a job, from the latest of the
    request, the job's submission and the host's last finish report (which frees
    room its open poll may take) to the answer (what the long-poll's own waiting for
    a job that was not there yet, or for room, is not);
  - submit-to-running p99 (queue wait included) and p50;
  - GPU idle while jobs wait: GPU-seconds free on hosts where some queued job would
    fit, over all GPU-seconds (the scheduler's efficiency; 0 is perfect);
  - database rows and bytes (pg_total_relation_size of each table) per 1,000 jobs
    submitted in the window;
  - a host killed (kill -9: it stops without a word) as the window opens: when its
    jobs were queued again, after their last sign of life (its last heartbeat, or a
    later claim), against the lease it was given.

    PYTHONPATH=. .venv/bin/python bench/fleet.py [--hosts 10,100,500,1000] [--quick]
        [--backend postgres|sqlite] [--api-procs N] [--profile DIR] [--out docs/img/fleet.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import PG_ADMIN, Api, cpu_of, database, percentile, serve

GPUS = 8  # per host
CPU_SLOTS = 32  # what a GPU host's agent offers besides its GPUs (its cores)
SIZES = [(1, 0.40), (2, 0.25), (4, 0.20), (8, 0.15)]  # ranks (GPUs) of a job: weight
MEAN_SIZE = sum(g * w for g, w in SIZES)
CLAIM_WAIT_S = 5.0  # ddpq.messages.CLAIM_WAIT_S: until the API says (service.pace)
FILL_MAX_S = 600.0  # the longest the fleet may take to fill before the warm-up


# ---- a minimal HTTP/1.1 client ------------------------------------------------------------


class Http:
    """Keep-alive connections to one server, as one process's httpx.Client keeps them:
    a request takes an idle connection or opens one. A connection idle for longer than
    uvicorn keeps one (5 s) is not reused, so a request never races the server's close."""

    IDLE_S = 4.0

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {token}\r\n".encode()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def _conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self.idle:
            reader, writer, used = self.idle.pop()
            if now - used < self.IDLE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        if isinstance(body, bytes):
            payload, kind = body, b"Content-Type: application/octet-stream\r\n"
        elif body is not None:
            payload, kind = orjson.dumps(body), b"Content-Type: application/json\r\n"
        else:
            payload, kind = b"", b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n".encode()
            + self.auth
            + kind
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        )
        reader, writer = await self._conn()
        try:
            writer.write(head + payload)
            status_headers = await reader.readuntil(b"\r\n\r\n")
            lines = status_headers.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            length, close, chunked = 0, False, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and "close" in value.lower():
                    close = True
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
            if chunked:
                data = b""
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    data += chunk[:-2]
            else:
                data = await reader.readexactly(length) if length else b""
        except BaseException:
            writer.close()
            raise
        if close:
            writer.close()
        else:
            self.idle.append((reader, writer, time.monotonic()))
        return status, data

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()


# ---- what is measured ---------------------------------------------------------------------


@dataclass
class Stats:
    measuring: bool = False
    heartbeat: list[float] = field(default_factory=list)
    claim: list[float] = field(default_factory=list)
    submit_to_running: list[float] = field(default_factory=list)
    submit: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    loop_lag: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    finished: int = 0
    submitted: int = 0
    idle_fit_gpu_s: float = 0.0  # free GPU-seconds on hosts where a queued job would fit
    busy_gpu_s: float = 0.0
    total_gpu_s: float = 0.0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def add(self, series: list[float], value: float) -> None:
        if self.measuring:
            series.append(value)


class Sim:
    def __init__(self, http_for: Any, stats: Stats, hosts: int, heartbeat_s: float) -> None:
        self.http_for = http_for
        self.stats = stats
        self.stop = asyncio.Event()
        self.heartbeat_s = heartbeat_s
        self.hosts = [Host(self, i) for i in range(hosts)]
        self.pending: dict[int, int] = {}  # queued job id -> GPUs it needs
        self.claimed_early: set[int] = set()  # claimed before its submit was answered
        self.recent: list[int] = []  # job ids the readers look at
        self.burst_left = 0  # of the first burst, submissions not answered yet


class Host:
    def __init__(self, sim: Sim, i: int) -> None:
        self.sim = sim
        self.name = f"fleet-{i:04d}"
        self.identity = uuid.uuid4().hex
        self.running: dict[int, int] = {}  # job id -> attempt
        # As the worker keeps them: a job's GPUs are offered again once its finish is
        # sent (its processes are gone), and the API may hand them out once that
        # finish commits (it adds the slots a finish frees to the host's open poll).
        self.gpus_of: dict[int, set[int]] = {}
        self.finishing: set[int] = set()
        self.finish_sent = 0.0  # when this host last reported a job's end (time.time)
        self.changed = asyncio.Event()
        self.jobs: set[asyncio.Task[None]] = set()
        self.http: Http = sim.http_for("worker")
        self.heartbeat_s = sim.heartbeat_s
        self.claim_wait_s = CLAIM_WAIT_S
        self.lease_s = 0.0  # as the API last said
        # Wall-clock times, to compare with the API's stamps (one host, one clock):
        self.last_beat = 0.0  # when its last heartbeat answered 200 was sent
        self.last_answer = 0.0  # and when that answer came: the API stamped it between
        # When each running job's claim was answered: the API stamps the new attempt's
        # lease as it claims, a sign of life its heartbeats have not renewed yet.
        self.claimed_at: dict[int, float] = {}
        self.tasks: list[asyncio.Task[None]] = []  # its heartbeats and polls

    @property
    def free(self) -> set[int]:
        held = (g for j, g in self.gpus_of.items() if j not in self.finishing)
        return set(range(GPUS)).difference(*held)

    async def register(self) -> None:
        body = {
            "name": self.name,
            "identity": self.identity,
            "hostname": self.name,
            "cpu_slots": CPU_SLOTS,
            "gpus": list(range(GPUS)),
            "checkpoint_root": f"/tmp/{self.name}/checkpoints",
            "running": [],
        }
        status, data = await self.http.request("POST", "/workers/register", body)
        if status != 200:
            raise SystemExit(f"register {self.name}: {status} {data[:200]!r}")
        reply = orjson.loads(data)
        self.heartbeat_s, self.lease_s = reply["heartbeat_s"], reply["lease_s"]
        self.claim_wait_s = reply.get("claim_wait_s") or CLAIM_WAIT_S

    async def heartbeats(self) -> None:
        st = self.sim.stats
        # Hosts start at different moments, so their beats do not fall together.
        await asyncio.sleep(random.uniform(0, self.heartbeat_s))
        while not self.sim.stop.is_set():
            body = {
                "name": self.name,
                "identity": self.identity,
                "running": [{"job_id": j, "attempt": a} for j, a in self.running.items()],
            }
            t0, sent = time.perf_counter(), time.time()
            try:
                status, data = await self.http.request("POST", "/workers/heartbeat", body)
            except (OSError, asyncio.IncompleteReadError):
                status, data = 0, b""
            st.add(st.heartbeat, time.perf_counter() - t0)
            if status != 200:
                st.error(f"heartbeat {status}")
            else:  # the pace the API sets for the fleet's size (service.pace), as a worker
                reply = orjson.loads(data)
                self.heartbeat_s = reply.get("heartbeat_s") or self.heartbeat_s
                self.lease_s = reply.get("lease_s") or self.lease_s
                self.last_beat, self.last_answer = sent, time.time()
                self.claim_wait_s = reply.get("claim_wait_s") or self.claim_wait_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.sim.stop.wait(), self.heartbeat_s)

    async def claims(self) -> None:
        st, sim = self.sim.stats, self.sim
        while not sim.stop.is_set():
            free = sorted(self.free)
            body = {
                "name": self.name,
                "free_cpu_slots": CPU_SLOTS,
                "free_gpus": free,
                "wait_s": self.claim_wait_s,
            }
            sent = time.time()
            try:
                status, data = await self.http.request("POST", "/workers/claim", body)
            except (OSError, asyncio.IncompleteReadError):
                status, data = 0, b""
            if status == 204:
                continue
            if status != 200:
                st.error(f"claim {status}")
                await asyncio.sleep(1.0)
                continue
            now = time.time()
            claim = orjson.loads(data)
            job_id, attempt, gpus = claim["job_id"], claim["attempt"], claim["gpus"]
            duration, submitted = float(claim["spec"]["args"][0]), float(claim["spec"]["args"][1])
            if sim.pending.pop(job_id, None) is None:
                sim.claimed_early.add(job_id)
            # From when it could first have been answered: its request, the job's
            # submission, or this host's finish that freed the room it took.
            st.add(st.claim, now - max(sent, submitted, self.finish_sent))
            st.add(st.submit_to_running, now - submitted)
            if not set(gpus) <= self.free:
                st.error("claim gave busy GPUs")
            self.gpus_of[job_id] = set(gpus)
            self.running[job_id] = attempt
            self.claimed_at[job_id] = time.time()
            self.jobs.add(
                asyncio.get_running_loop().create_task(self.run(job_id, attempt, gpus, duration))
            )

    async def run(self, job_id: int, attempt: int, gpus: list[int], duration: float) -> None:
        st = self.sim.stats
        await asyncio.sleep(duration)
        try:
            await self.http.request(
                "POST",
                f"/workers/jobs/{job_id}/logs?worker={self.name}&attempt={attempt}&offset=0",
                f"[rank0] ran {duration:.1f} s\n".encode(),
            )
        except (OSError, asyncio.IncompleteReadError):
            st.error("log")
        body = {"worker": self.name, "attempt": attempt, "exit_code": 0, "outcome": "exited"}
        self.finishing.add(job_id)
        self.finish_sent = time.time()
        for _ in range(5):  # the worker retries a finish until it is taken
            t0 = time.perf_counter()
            try:
                status, _ = await self.http.request("POST", f"/workers/jobs/{job_id}/finish", body)
            except (OSError, asyncio.IncompleteReadError):
                status = 0
            st.add(st.finish, time.perf_counter() - t0)
            if status == 200:
                break
            st.error(f"finish {status}")
            await asyncio.sleep(1.0)
        self.running.pop(job_id, None)
        self.claimed_at.pop(job_id, None)
        self.gpus_of.pop(job_id, None)
        self.finishing.discard(job_id)
        self.jobs.discard(asyncio.current_task())  # type: ignore[arg-type]
        if st.measuring:
            st.finished += 1
        self.changed.set()


async def submitter(sim: Sim, users: list[Http], rate: float, job_s: float, burst: int) -> None:
    """A Poisson stream of jobs from the users (after a first burst that fills the fleet);
    each submission its own task, so a slow API does not lower the offered load."""
    st = sim.stats
    inflight = asyncio.Semaphore(64)
    sizes, weights = zip(*SIZES, strict=True)

    async def one(user: Http) -> None:
        async with inflight:
            gpus = random.choices(sizes, weights)[0]
            duration = max(1.0, random.expovariate(1.0 / job_s))
            now = time.time()
            spec = {
                "entrypoint": "noop.py",
                "device": "cuda",
                "world_size": gpus,
                "args": [f"{duration:.3f}", f"{now:.6f}"],
            }
            t0 = time.perf_counter()
            try:
                status, data = await user.request("POST", "/jobs", spec)
            except (OSError, asyncio.IncompleteReadError):
                status, data = 0, b""
            st.add(st.submit, time.perf_counter() - t0)
            if status != 201:
                st.error(f"submit {status}")
                return
            job_id = orjson.loads(data)["id"]
            if st.measuring:
                st.submitted += 1
            if job_id in sim.claimed_early:
                sim.claimed_early.discard(job_id)
            else:
                sim.pending[job_id] = gpus
            sim.recent.append(job_id)
            del sim.recent[:-200]

    loop = asyncio.get_running_loop()
    live: set[asyncio.Task[None]] = set()

    def spawn(i: int) -> asyncio.Task[None]:
        task = loop.create_task(one(users[i % len(users)]))
        live.add(task)
        task.add_done_callback(live.discard)
        return task

    def burst_answered(_: object) -> None:
        sim.burst_left -= 1

    for i in range(burst):
        spawn(i).add_done_callback(burst_answered)
    i = 0
    try:
        while not sim.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sim.stop.wait(), random.expovariate(rate) if rate else 60)
            if not rate:
                continue
            spawn(i)
            i += 1
    finally:
        for task in list(live):
            task.cancel()


async def reader(sim: Sim, http: Http, period_s: float) -> None:
    """A dashboard or CLI user: the job list, one job, now and then a job's charts (its
    metrics downsampled, as the dashboard asks for them)."""
    await asyncio.sleep(random.uniform(0, period_s))
    n = 0
    while not sim.stop.is_set():
        n += 1
        if n % 5 == 0 and sim.recent:
            path = f"/jobs/{random.choice(sim.recent)}/metrics?max_points=500"
        elif n % 2 and sim.recent:
            path = f"/jobs/{random.choice(sim.recent)}"
        else:
            path = "/jobs?limit=50"
        await _read(sim, http, path)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sim.stop.wait(), period_s)


async def scraper(sim: Sim, http: Http, period_s: float) -> None:
    """A Prometheus server scraping GET /metrics every ``period_s``: the queue's gauges,
    a series per worker. (The readers scraped it every fifth poll until 2026-11-26: two
    scrapes a second, each about 0.1 s of the API's CPU at 1,000 hosts, a quarter of
    all it spent; no dashboard asks for it.)"""
    while not sim.stop.is_set():
        await _read(sim, http, "/metrics")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sim.stop.wait(), period_s)


async def _read(sim: Sim, http: Http, path: str) -> None:
    st = sim.stats
    t0 = time.perf_counter()
    try:
        status, _ = await http.request("GET", path)
    except (OSError, asyncio.IncompleteReadError):
        status = 0
    st.add(st.read, time.perf_counter() - t0)
    if status != 200:
        st.error(f"read {status}")


async def watch(sim: Sim, tick: float = 0.25) -> None:
    """The scheduler's efficiency (GPUs free where a queued job would fit) and the
    simulator's own event-loop lag, sampled every ``tick``."""
    st = sim.stats
    last = time.monotonic()
    while not sim.stop.is_set():
        await asyncio.sleep(tick)
        now = time.monotonic()
        dt = now - last
        last = now
        st.add(st.loop_lag, max(0.0, dt - tick))
        if not st.measuring:
            continue
        need = min(sim.pending.values(), default=None)
        for h in sim.hosts:
            free = len(h.free)
            st.busy_gpu_s += (GPUS - free) * dt
            st.total_gpu_s += GPUS * dt
            if need is not None and free >= need:
                st.idle_fit_gpu_s += free * dt


# ---- the API, the database, and what they spend -------------------------------------------


def pg_backends_cpu(db_url: str) -> dict[int, float]:
    """CPU seconds of the Postgres backends serving this database, by pid."""
    if not db_url.startswith("postgresql"):
        return {}
    import psycopg

    name = db_url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        pids = [
            r[0]
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,)
            ).fetchall()
        ]
    return {pid: cpu_of(pid) for pid in pids}


def db_tables(db_url: str) -> dict[str, tuple[int, int]]:
    """Each table's rows and bytes (with its indexes and TOAST)."""
    if not db_url.startswith("postgresql"):
        return {}
    import psycopg

    conninfo = db_url.replace("postgresql+psycopg", "postgresql")
    out = {}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT relname FROM pg_stat_user_tables WHERE schemaname = 'public'"
            ).fetchall()
        ]
        for t in tables:
            rows = conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()
            size = conn.execute("SELECT pg_total_relation_size(%s)", (f'public."{t}"',)).fetchone()
            assert rows is not None and size is not None
            out[t] = (int(rows[0]), int(size[0]))
    return out


# ---- one run ------------------------------------------------------------------------------


@dataclass
class Plan:
    hosts: int
    users: int
    readers: int
    read_every: float
    scrape_every: float
    warmup_s: float
    measure_s: float
    load: float
    job_s: float  # mean job duration
    rate: float  # jobs submitted a second


def plan_for(hosts: int, args: argparse.Namespace) -> Plan:
    """A job rate that grows with the fleet up to --max-rate; the jobs' mean duration
    then keeps the fleet --load busy (a bigger fleet runs longer jobs, not ever more)."""
    rate = min(args.rate_per_host * hosts, args.max_rate)
    job_s = args.load * GPUS * hosts / (rate * MEAN_SIZE) if rate else 1.0
    return Plan(
        hosts,
        args.users,
        args.readers,
        args.read_every,
        args.scrape_every,
        args.warmup,
        args.measure,
        args.load,
        job_s,
        rate,
    )


async def simulate(api: Api, plan: Plan, db_url: str, profile: Path | None) -> dict[str, Any]:
    port = int(api.url.rsplit(":", 1)[1])
    admin = Http("127.0.0.1", port, api.api_token)
    user_tokens = []
    for i in range(plan.users):
        status, data = await admin.request("POST", "/users", {"name": f"user{i}"})
        if status != 201:
            raise SystemExit(f"POST /users: {status} {data[:200]!r}")
        user_tokens.append(orjson.loads(data)["token"])
    status, data = await admin.request("GET", "/healthz")
    stats = Stats()
    worker_token = api.worker_token

    def http_for(kind: str) -> Http:
        return Http("127.0.0.1", port, worker_token)

    sim = Sim(http_for, stats, plan.hosts, 2.0)
    # Register the fleet a batch at a time, as hosts come up.
    for i in range(0, plan.hosts, 50):
        await asyncio.gather(*(h.register() for h in sim.hosts[i : i + 50]))
    users = [Http("127.0.0.1", port, t) for t in user_tokens]
    readers = [
        Http("127.0.0.1", port, user_tokens[i % len(user_tokens)]) for i in range(plan.readers)
    ]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(watch(sim))]
    for h in sim.hosts:
        h.tasks = [loop.create_task(h.heartbeats()), loop.create_task(h.claims())]
        tasks += h.tasks
    burst = int(plan.load * GPUS * plan.hosts / MEAN_SIZE)
    sim.burst_left = burst
    tasks.append(loop.create_task(submitter(sim, users, plan.rate, plan.job_s, burst)))
    tasks += [loop.create_task(reader(sim, r, plan.read_every)) for r in readers]
    if plan.scrape_every > 0:
        tasks.append(loop.create_task(scraper(sim, admin, plan.scrape_every)))

    # The fleet fills first: the first burst submitted, and the GPUs nearly as busy as
    # the load offered. A big fleet's burst takes the API a while, and a window measured
    # during it measures the filling, not the fleet's steady state.
    began = time.monotonic()

    def filled() -> bool:
        busy = sum(GPUS - len(h.free) for h in sim.hosts) / (GPUS * plan.hosts)
        return sim.burst_left <= 0 and busy >= 0.9 * plan.load

    while not filled() and time.monotonic() - began < FILL_MAX_S:
        await asyncio.sleep(0.5)
    fill_s = time.monotonic() - began
    await asyncio.sleep(plan.warmup_s)
    before_tables = await asyncio.to_thread(db_tables, db_url)
    mix0 = await request_mix(admin)
    api_cpu0, pg0 = api.cpu_seconds(), pg_backends_cpu(db_url)
    sim_cpu0 = _self_cpu()
    t0 = time.monotonic()
    stats.measuring = True
    killing = loop.create_task(kill_one(sim, admin, db_url))
    spy = None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(api.pid),
                "--subprocesses",
                "--duration",
                str(int(plan.measure_s)),
                "--rate",
                "50",
                "--format",
                "raw",
                "--output",
                str(profile / f"fleet-{plan.hosts}.txt"),
                "--nonblocking",
                "--gil",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    await asyncio.sleep(plan.measure_s)
    stats.measuring = False
    elapsed = time.monotonic() - t0
    mix1 = await request_mix(admin)
    mix = {k: round((v - mix0.get(k, 0.0)) / elapsed, 1) for k, v in mix1.items()}
    api_cpu = api.cpu_seconds() - api_cpu0
    pg1 = pg_backends_cpu(db_url)
    pg_cpu = sum(v - pg0.get(pid, 0.0) for pid, v in pg1.items())
    sim_cpu = _self_cpu() - sim_cpu0
    finished, queued = stats.finished, len(sim.pending)
    killed = await killing  # waits out its lease, past the window
    after_tables = await asyncio.to_thread(db_tables, db_url)
    killed["lost_elsewhere"] = await asyncio.to_thread(lost_elsewhere, db_url, killed["host"])
    # The API stops before the hosts do: hosts that stopped first would have their leases
    # run out while it lived on, and its log name their jobs lost (work thrown away is
    # what lost_elsewhere counts, above, while every host still lives).
    os.kill(api.pid, signal.SIGTERM)
    sim.stop.set()
    for h in sim.hosts:
        for job in h.jobs:
            job.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if spy is not None:
        spy.wait(timeout=120)
    for h in sim.hosts:
        h.http.close()

    def ms(series: list[float], q: float) -> float | None:
        return round(percentile(series, q) * 1000, 2) if series else None

    # Per job submitted in the window: its rows are written from its submission on (and
    # while the fleet fills, more are submitted than finish).
    per_k = 1000 / max(stats.submitted, 1)
    growth = {
        t: {
            "rows": round((after_tables[t][0] - before_tables.get(t, (0, 0))[0]) * per_k, 1),
            "bytes": round((after_tables[t][1] - before_tables.get(t, (0, 0))[1]) * per_k),
        }
        for t in after_tables
    }
    return {
        "hosts": plan.hosts,
        "fill_s": round(fill_s, 1),
        "gpus": plan.hosts * GPUS,
        "users": plan.users,
        "readers": plan.readers,
        "jobs_per_s_offered": round(plan.rate, 2),
        "job_s_mean": round(plan.job_s, 1),
        "window_s": round(elapsed, 1),
        "jobs_finished": finished,
        "jobs_submitted": stats.submitted,
        "jobs_queued_at_end": queued,
        "api_cpu_s_per_s": round(api_cpu / elapsed, 3),
        "api_cpu_ms_per_host_s": round(api_cpu / elapsed / plan.hosts * 1000, 3),
        "pg_cpu_s_per_s": round(pg_cpu / elapsed, 3) if pg1 else None,
        "sim_cpu_s_per_s": round(sim_cpu / elapsed, 3),
        "heartbeats": len(stats.heartbeat),
        "heartbeat_p50_ms": ms(stats.heartbeat, 0.5),
        "heartbeat_p99_ms": ms(stats.heartbeat, 0.99),
        "claims": len(stats.claim),
        "claim_p50_ms": ms(stats.claim, 0.5),
        "claim_p99_ms": ms(stats.claim, 0.99),
        "submit_to_running_p50_ms": ms(stats.submit_to_running, 0.5),
        "submit_to_running_p99_ms": ms(stats.submit_to_running, 0.99),
        "submit_p99_ms": ms(stats.submit, 0.99),
        "finish_p99_ms": ms(stats.finish, 0.99),
        "read_p50_ms": ms(stats.read, 0.5),
        "read_p99_ms": ms(stats.read, 0.99),
        "sim_loop_lag_p99_ms": ms(stats.loop_lag, 0.99),
        "gpu_busy": round(stats.busy_gpu_s / stats.total_gpu_s, 3) if stats.total_gpu_s else None,
        "gpu_idle_while_waiting": (
            round(stats.idle_fit_gpu_s / stats.total_gpu_s, 4) if stats.total_gpu_s else None
        ),
        "db_growth_per_1000_jobs": growth,
        "db_bytes_per_1000_jobs": sum(g["bytes"] for g in growth.values()),
        "db_rows_per_1000_jobs": round(sum(g["rows"] for g in growth.values()), 1),
        "errors": stats.errors,
        "killed": killed,
        "per_s": dict(sorted(mix.items(), key=lambda kv: -kv[1])),
    }


async def kill_one(sim: Sim, admin: Http, db_url: str) -> dict[str, Any]:
    """A kill -9 of the busiest host as the window opens: its heartbeats, polls and jobs
    stop at once, and it says nothing more. The API is to declare its attempts lost
    once the lease it gave the host has run out since the attempt's last sign of life
    (the host's last heartbeat, or the claim that started it if that came later), and
    queue their jobs again (a job's attempt moves on, or it waits queued): how long
    after that sign each was, by the attempts' end stamps (on Postgres; else as seen
    here, within a poll)."""
    victim = max(sim.hosts, key=lambda h: len(h.running))
    held, lease = dict(victim.running), victim.lease_s
    for task in [*victim.tasks, *victim.jobs]:
        task.cancel()
    victim.http.close()
    killed = time.time()
    # The API stamped the last heartbeat between its sending and its answer: the lease
    # ran from then, so the time lost is given from both ends.
    sent = {j: max(victim.last_beat, victim.claimed_at.get(j, 0.0)) for j in held}
    answered = {j: max(victim.last_answer, victim.claimed_at.get(j, 0.0)) for j in held}
    seen: dict[int, float] = {}
    while len(seen) < len(held) and time.time() - killed < 2 * lease + 30:
        for job_id, attempt in held.items():
            if job_id in seen or time.time() - sent[job_id] < lease - 1:
                continue  # not due yet: no reads spent on it
            status, data = await admin.request("GET", f"/jobs/{job_id}")
            job = orjson.loads(data) if status == 200 else {}
            if job.get("attempt", 0) > attempt or job.get("status") == "queued":
                seen[job_id] = time.time()
        await asyncio.sleep(0.2)  # past the window too: the lease may outlast it
    ended = {**seen, **await asyncio.to_thread(lost_at, db_url, victim.name)}
    lost = {j: (ended[j] - answered[j], ended[j] - sent[j]) for j in seen}
    return {
        "host": victim.name,
        "jobs": len(held),
        "lease_s": lease,
        "requeued": len(lost),
        "lost_after_max_s": round(max(a for a, _ in lost.values()), 1) if lost else None,
        "lost_after_max_sent_s": round(max(b for _, b in lost.values()), 1) if lost else None,
    }


def lost_at(db_url: str, host: str) -> dict[int, float]:
    """When the API declared each of ``host``'s attempts lost (its end stamp)."""
    if not db_url.startswith("postgresql"):
        return {}
    import psycopg

    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        rows = conn.execute(
            "SELECT job_id, ended_at FROM attempts WHERE outcome = 'lost' AND worker = %s",
            (host,),
        ).fetchall()
    return {int(job_id): ended.timestamp() for job_id, ended in rows}


def lost_elsewhere(db_url: str, victim: str) -> list[str]:
    """The reasons of attempts lost on hosts that were never killed: a live host's job
    declared lost is work thrown away (none is the goal)."""
    if not db_url.startswith("postgresql"):
        return []
    import psycopg

    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        rows = conn.execute(
            "SELECT reason FROM attempts WHERE outcome = 'lost' AND worker <> %s", (victim,)
        ).fetchall()
    return [str(r[0]) for r in rows]


async def request_mix(http: Http) -> dict[str, float]:
    """The API's requests by route and claim transactions by outcome so far, from its
    Prometheus counters (one process's: with several, whichever answered the scrape)."""
    status, data = await http.request("GET", "/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in data.decode().splitlines():
        if line.startswith("ddpq_http_request_duration_seconds_count{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = f"{labels['method']} {labels['route']}"
        elif line.startswith("ddpq_claim_latency_seconds_count{"):
            key = "claim transaction " + line.split('"')[1]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _self_cpu() -> float:
    return cpu_of(os.getpid())


def run_one(
    backend: str, api_procs: int, plan: Plan, profile: Path | None, env: dict[str, str]
) -> dict[str, Any]:
    with database(backend) as db_url, serve(db_url, DDPQ_API_WORKERS=str(api_procs), **env) as api:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        where = profile / f"procs-{api_procs}" if profile is not None else None
        result: dict[str, Any] = runner(simulate(api, plan, db_url, where))
    result.update(backend=backend, api_procs=api_procs)
    return result


# ---- the report -----------------------------------------------------------------------------

COLUMNS = [
    ("hosts", "hosts", "{}"),
    ("procs", "api_procs", "{}"),
    ("jobs/s", "jobs_per_s_offered", "{:g}"),
    ("API ms/host/s", "api_cpu_ms_per_host_s", "{:.2f}"),
    ("API cpu", "api_cpu_s_per_s", "{:.2f}"),
    ("PG cpu", "pg_cpu_s_per_s", "{:.2f}"),
    ("sim cpu", "sim_cpu_s_per_s", "{:.2f}"),
    ("hb p50", "heartbeat_p50_ms", "{:.1f}"),
    ("hb p99", "heartbeat_p99_ms", "{:.1f}"),
    ("claim p50", "claim_p50_ms", "{:.1f}"),
    ("claim p99", "claim_p99_ms", "{:.1f}"),
    ("s2r p99", "submit_to_running_p99_ms", "{:.0f}"),
    ("idle/wait", "gpu_idle_while_waiting", "{:.3f}"),
    ("busy", "gpu_busy", "{:.2f}"),
    ("KB/1k jobs", "db_bytes_per_1000_jobs", "{:.0f}"),
    ("rows/1k", "db_rows_per_1000_jobs", "{:.0f}"),
    ("lag p99", "sim_loop_lag_p99_ms", "{:.1f}"),
]


def table(results: list[dict[str, Any]]) -> str:
    head = [c for c, _, _ in COLUMNS]
    rows = []
    for r in results:
        row = []
        for _, key, fmt in COLUMNS:
            v = r.get(key)
            if key == "db_bytes_per_1000_jobs" and isinstance(v, (int, float)):
                v = v / 1024
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: Path) -> None:
    """The sweep's figures against the fleet's size, a line per API process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = sorted({r["api_procs"] for r in results})
    groups = [(p, [r for r in results if r["api_procs"] == p]) for p in procs]
    xscale = "log" if len({r["hosts"] for r in results}) > 1 else "linear"
    fig, ax = plt.subplots(2, 3, figsize=(13, 7.5))
    first = results[0]
    counts = " and ".join(str(p) for p in procs)
    fig.suptitle(f"ddpq fleet ({first['backend']}, {counts} API process(es), 2 cores)")
    styles = ["-", "--", ":"]

    def label(text: str, p: int) -> str:
        return f"{text}, {p} proc" if len(procs) > 1 else text

    def axes(a: Any, ylabel: str) -> None:
        a.set_xscale(xscale)
        a.set_xlabel("hosts (8 GPUs each)")
        a.set_ylabel(ylabel)
        a.grid(True, alpha=0.3)

    def series(
        a: Any,
        keys: list[tuple[str, str]],
        ylabel: str,
        goal: float | None = None,
        log: bool = False,
    ) -> None:
        for i, (p, rs) in enumerate(groups):
            n = [r["hosts"] for r in rs]
            for c, (key, text) in enumerate(keys):
                values = [r.get(key) or math.nan for r in rs]
                style = styles[i % len(styles)]
                a.plot(n, values, marker="o", linestyle=style, color=f"C{c}", label=label(text, p))
        if goal is not None:
            a.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"goal {goal:g}")
        axes(a, ylabel)
        a.legend(fontsize=7)
        if log and any((r.get(k) or 0) > 0 for r in results for k, _ in keys):
            a.set_yscale("log")

    pair = [("heartbeat_p50_ms", "p50"), ("heartbeat_p99_ms", "p99")]
    series(ax[0][0], pair, "heartbeat ms", 100, log=True)
    pair = [("claim_p50_ms", "p50"), ("claim_p99_ms", "p99")]
    series(ax[0][1], pair, "claim ms", 100, log=True)
    pair = [("submit_to_running_p50_ms", "p50"), ("submit_to_running_p99_ms", "p99")]
    series(ax[0][2], pair, "submit to running ms", log=True)
    cpu = [("api_cpu_s_per_s", "API"), ("pg_cpu_s_per_s", "Postgres"), ("sim_cpu_s_per_s", "sim")]
    series(ax[1][0], cpu, "CPU cores busy")
    series(ax[1][1], [("api_cpu_ms_per_host_s", "API CPU ms / host / s")], "ms / host / s")
    a = ax[1][2]
    a2 = a.twinx()
    for i, (p, rs) in enumerate(groups):
        n = [r["hosts"] for r in rs]
        style = styles[i % len(styles)]
        idle = [r.get("gpu_idle_while_waiting") or 0 for r in rs]
        a.plot(
            n, idle, marker="o", linestyle=style, color="C0", label=label("GPU idle, a job fits", p)
        )
        busy = [r.get("gpu_busy") or 0 for r in rs]
        a.plot(n, busy, marker="o", linestyle=style, color="C1", label=label("GPU busy", p))
        kb = [r["db_bytes_per_1000_jobs"] / 1024 for r in rs]
        a2.plot(n, kb, marker="s", linestyle=style, color="C3", label=label("DB KB / 1k jobs", p))
    a2.set_ylabel("KB per 1,000 jobs")
    axes(a, "fraction of GPU time")
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = a2.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="10,100,500,1000", help="fleet sizes to sweep")
    ap.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    ap.add_argument("--api-procs", default="1", help="ddpq serve --workers N; a list sweeps each")
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--readers", type=int, default=50)
    ap.add_argument("--read-every", type=float, default=5.0, help="each reader's pause, s")
    ap.add_argument(
        "--scrape-every", type=float, default=15.0, help="Prometheus' scrape interval, s (0: none)"
    )
    ap.add_argument("--load", type=float, default=0.8, help="GPU load the jobs offer")
    ap.add_argument("--rate-per-host", type=float, default=0.05, help="jobs/s per host")
    ap.add_argument("--max-rate", type=float, default=10.0, help="at most this many jobs/s")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--measure", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="short windows, for development")
    ap.add_argument("--profile", type=Path, help="py-spy the API into DIR (raw stacks)")
    ap.add_argument("--out", type=Path, default=Path("docs/img/fleet.png"))
    ap.add_argument(
        "--serve-env",
        action="append",
        default=[],
        type=lambda kv: tuple(kv.split("=", 1)),
        metavar="NAME=VALUE",
        help="a DDPQ_* setting of the API (repeatable), e.g. DDPQ_MAX_HEARTBEATS_PER_S=1e9",
    )
    args = ap.parse_args()
    if args.quick:
        args.warmup, args.measure = 8.0, 15.0
    results = []
    for api_procs in [int(p) for p in args.api_procs.split(",")]:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            plan = plan_for(hosts, args)
            print(
                f"{hosts} hosts, {api_procs} API process(es): {plan.rate:g} jobs/s of "
                f"{plan.job_s:.0f} s on average, {plan.users} users, {plan.readers} readers, "
                f"{plan.warmup_s:g}+{plan.measure_s:g} s",
                flush=True,
            )
            r = run_one(args.backend, api_procs, plan, args.profile, dict(args.serve_env))
            results.append(r)
            print(table([r]), flush=True)
            if r["errors"]:
                print("errors:", r["errors"], flush=True)
            kill = r["killed"]
            print(
                f"a host killed as the window opened, holding {kill['jobs']} jobs: "
                f"{kill['requeued']} queued again, the last {kill['lost_after_max_s']} s after "
                f"its last sign of life ({kill['lost_after_max_sent_s']} s after it was sent; "
                f"its lease: {kill['lease_s']:g} s)",
                flush=True,
            )
            elsewhere = kill["lost_elsewhere"]
            print(f"attempts lost on live hosts: {len(elsewhere)}", *elsewhere[:5], sep="\n  ")
            mix = ", ".join(f"{k} {v:g}" for k, v in r["per_s"].items() if v)
            print(f"filled in {r['fill_s']:g} s; per second: {mix}")
    print()
    print(table(results))
    out = args.out
    plot(results, out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
