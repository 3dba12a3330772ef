"""Shared by the benchmarks: a real `ddpq serve` on a fresh SQLite file or Postgres database."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

PG_ADMIN = os.environ.get("DDPQ_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def child_env(**extra: str) -> dict[str, str]:
    """This environment without its DDPQ_* variables, which a benchmark sets itself."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}, **extra}


def register(api: Api, name: str, cpu_slots: int) -> None:
    """Register a CPU-only worker ``name`` with the API."""
    with api.client("worker") as w:
        w.post(
            "/workers/register",
            json={
                "name": name,
                "hostname": "bench",
                "cpu_slots": cpu_slots,
                "gpus": [],
                "checkpoint_root": "/tmp/c",
            },
        ).raise_for_status()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Api:
    url: str
    api_token: str
    worker_token: str
    data_dir: Path
    pid: int = 0  # the `ddpq serve` process, for what it spends (cpu_seconds)

    def cpu_seconds(self) -> float:
        """The CPU time (user + system) the API has spent so far: the `ddpq serve`
        process and, with --workers N, its API processes (its children)."""
        return sum(cpu_of(pid) for pid in [self.pid, *children(self.pid)])

    def client_with(self, token: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )

    def client(self, kind: str = "user") -> httpx.Client:
        token = self.api_token if kind == "user" else self.worker_token
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )


def cpu_of(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` itself has spent; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the API processes of `serve --workers N`)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


class CpuMeter:
    """CPU seconds spent by the API processes and, on Postgres, by the database server's
    backends serving this API's database, between ``start()`` and ``stop()``: what a
    request costs each side, which load from other processes on the machine leaves
    alone (unlike wall-clock rates). A backend that exits meanwhile takes its time with
    it; the API's pools keep theirs open."""

    def __init__(self, api: Api, db_url: str) -> None:
        self.api = api
        self.db_name = db_url.rsplit("/", 1)[1] if db_url.startswith("postgresql") else None
        self.api_s = self.db_s = 0.0

    def _backends(self) -> dict[int, float]:
        if self.db_name is None:
            return {}
        import psycopg

        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            pids = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (self.db_name,),
            ).fetchall()
        return {pid: cpu_of(pid) for (pid,) in pids}

    def start(self) -> None:
        self._api0 = self.api.cpu_seconds()
        self._db0 = self._backends()

    def stop(self) -> None:
        self.api_s = self.api.cpu_seconds() - self._api0
        now = self._backends()
        self.db_s = sum(t - self._db0.get(pid, 0.0) for pid, t in now.items())

    def per(self, n: int) -> str:
        """Milliseconds of CPU per request (of n), API and database."""
        text = f"API {self.api_s / n * 1000:.2f} ms"
        if self.db_name is not None:
            text += f" + Postgres {self.db_s / n * 1000:.2f} ms"
        return text + " of CPU each"


def postgres_available() -> bool:
    try:
        import psycopg

        psycopg.connect(PG_ADMIN, connect_timeout=3).close()
        return True
    except Exception:
        return False


def backends(choice: str) -> Iterator[str]:
    """The backends a --backend of sqlite, postgres or both names, saying so and
    leaving Postgres out when it cannot be reached."""
    for backend in ["sqlite", "postgres"] if choice == "both" else [choice]:
        if backend == "postgres" and not postgres_available():
            print("postgres: unreachable, skipped")
            continue
        yield backend


@contextlib.contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        tmp = Path(tempfile.mkdtemp(prefix="ddpq-bench-"))
        yield f"sqlite:///{tmp / 'ddpq.db'}"
        return
    import psycopg

    name = f"{os.environ.get('DDPQ_BENCH_DB_PREFIX', 'ddpq_bench_')}{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://{PG_ADMIN.split('://', 1)[1].rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def serve(db_url: str, **env: str) -> Iterator[Api]:
    data_dir = Path(tempfile.mkdtemp(prefix="ddpq-bench-api-"))
    port = free_port()
    api = Api(
        f"http://127.0.0.1:{port}", secrets.token_urlsafe(24), secrets.token_urlsafe(24), data_dir
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpq.cli", "serve", "--port", str(port), "--log-level", "warning"],
        env=child_env(
            DDPQ_DATABASE_URL=db_url,
            DDPQ_DATA_DIR=str(data_dir),
            DDPQ_API_TOKEN=api.api_token,
            DDPQ_WORKER_TOKEN=api.worker_token,
            **env,
        ),
        cwd=data_dir,
    )
    api.pid = proc.pid
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{api.url}/healthz").status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("ddpq serve did not start")
            time.sleep(0.2)
        yield api
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_job(
    client: httpx.Client, spec: dict[str, object], poll_s: float = 0.5
) -> tuple[float, dict]:
    """Submit ``spec`` and wait for its end: the wall time from the POST to the job's own
    finished_at (stamped once its processes are gone, so observing it needs no fast
    polling, which would itself load the API on 2 cores), and the job as it ended."""
    t0 = time.time()
    job = client.post("/jobs", json=spec)
    job.raise_for_status()
    job_id = job.json()["id"]
    while client.get(f"/jobs/{job_id}").json()["status"] not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        time.sleep(poll_s)
    final: dict = client.get(f"/jobs/{job_id}").json()
    return datetime.fromisoformat(final["finished_at"]).timestamp() - t0, final


def phases(job: dict) -> str:
    """Queue wait (submit to claim) and run time (claim to end), from the job's own stamps."""
    created, started, finished = (
        datetime.fromisoformat(job[k]) for k in ("created_at", "started_at", "finished_at")
    )
    waited, ran = (started - created).total_seconds(), (finished - started).total_seconds()
    return f"queued {waited:.2f}s, ran {ran:.2f}s"
