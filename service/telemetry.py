"""Prometheus metrics at ``GET /metrics`` (user token), all named ``ddpq_*``.

Two kinds of figure:

- The state of the queue (jobs by state, running jobs, how long the oldest queued
  job has waited, every worker's slots) is read from the database at scrape time
  by a custom collector. Any API process answers the same, so with several API
  processes behind one address a scrape of any of them is right.
- Latencies (HTTP requests, claims, the queue wait of each claimed job) are this
  process's own histograms: Prometheus scrapes each API process and sums them.

Each app has its own ``CollectorRegistry`` (tests build several apps in one process;
the global default registry would refuse the second one's metrics as duplicates).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import datetime

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import gpus, queue
from service.auth import UserAuth
from service.db import Database
from service.models import ACTIVE, Job, JobStatus, utcnow

log = logging.getLogger("ddpq.service")

HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Jobs wait from seconds (an idle worker) to days (a full cluster).
WAIT_BUCKETS = (0.1, 1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 86400, 7 * 86400)
# Methods outside this set are counted as "other": a client must not be able to
# create label values at will.
# A running job's GPU: the job (id), who submitted it ("" from before users existed), and
# where the GPU is (a multi-node job's workers each have a GPU 0).
GPU_LABELS = ["job", "owner", "worker", "gpu"]
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class _QueueCollector:
    """The queue's state, read from the database at each scrape."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def describe(self) -> Iterable[Metric]:
        # Names only (no query at registration): the registry checks them for clashes.
        return self._families()

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("ddpq_database_up", "1 if the last scrape could read the database"),
            GaugeMetricFamily("ddpq_jobs", "Jobs in each state", labels=["state"]),
            GaugeMetricFamily(
                "ddpq_running_jobs", "Jobs holding slots on a worker (running or cancelling)"
            ),
            GaugeMetricFamily(
                "ddpq_queue_oldest_wait_seconds",
                "How long the longest-waiting queued job has been queued (0 when none is)",
            ),
            GaugeMetricFamily(
                "ddpq_worker_gpu_slots", "A worker's GPUs, used or free", labels=["worker", "state"]
            ),
            GaugeMetricFamily(
                "ddpq_worker_cpu_slots",
                "A worker's CPU slots, used or free",
                labels=["worker", "state"],
            ),
            GaugeMetricFamily(
                "ddpq_worker_running_jobs", "Jobs holding slots on a worker", labels=["worker"]
            ),
            GaugeMetricFamily(
                "ddpq_worker_up",
                "1 if the worker has heartbeaten within the lease and has not left",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "ddpq_worker_last_heartbeat_timestamp_seconds",
                "When the worker last heartbeat (Unix time)",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "ddpq_user_jobs", "A user's jobs, running or queued", labels=["user", "state"]
            ),
            GaugeMetricFamily(
                "ddpq_user_gpu_hours",
                "GPU-hours a user's attempts held over a window (1d, 7d)",
                labels=["user", "window"],
            ),
            GaugeMetricFamily(
                "ddpq_user_cpu_slot_hours",
                "CPU-slot-hours a user's attempts held over a window (1d, 7d)",
                labels=["user", "window"],
            ),
            GaugeMetricFamily(
                "ddpq_user_fairshare_usage_gpu_seconds",
                "The decayed usage fair share orders a user's jobs by",
                labels=["user"],
            ),
            # A running job's GPUs, as its worker last sampled them (NVML). Only GPUs held
            # now: a series per GPU of a running job, gone when it ends, so the label
            # sets stay as many as the GPUs in use.
            GaugeMetricFamily(
                "ddpq_job_gpu_utilization_percent",
                "A running job's GPU: its utilisation over NVML's last sample period",
                labels=GPU_LABELS,
            ),
            GaugeMetricFamily(
                "ddpq_job_gpu_memory_used_bytes",
                "A running job's GPU: its device memory in use (by any process)",
                labels=GPU_LABELS,
            ),
            GaugeMetricFamily(
                "ddpq_job_gpu_memory_total_bytes",
                "A running job's GPU: its device memory",
                labels=GPU_LABELS,
            ),
        ]

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        up, jobs, running, oldest, gpu, cpu, per_worker, worker_up, heartbeat = fams[:9]
        user_jobs, gpu_hours, cpu_hours, usage = fams[9:13]
        gpu_util, gpu_mem, gpu_mem_total = fams[13:]
        try:
            counts, oldest_queued = _job_counts(self.db)
            workers = queue.workers_overview(self.db)
            with self.db.read() as s:
                people = queue.usage_overview(s, utcnow())
            in_use = gpus.current_use(self.db, workers)
        except Exception as exc:  # a scrape must answer even while the database is down
            log.warning("metrics: cannot read the database: %s", exc)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        for state in JobStatus:
            jobs.add_metric([state.value], counts.get(state.value, 0))
        running.add_metric([], sum(counts.get(s.value, 0) for s in ACTIVE))
        wait = 0.0
        if oldest_queued is not None:
            wait = max(0.0, (utcnow() - queue.as_utc(oldest_queued)).total_seconds())
        oldest.add_metric([], wait)
        for w in workers:
            name = w["name"]
            free_gpus = len(w["free_gpus"])
            gpu.add_metric([name, "used"], len(w["gpus"]) - free_gpus)
            gpu.add_metric([name, "free"], free_gpus)
            cpu.add_metric([name, "used"], w["cpu_slots"] - w["free_cpu_slots"])
            cpu.add_metric([name, "free"], w["free_cpu_slots"])
            per_worker.add_metric([name], len(w["running"]))
            worker_up.add_metric([name], 1 if w["alive"] else 0)
            heartbeat.add_metric([name], w["last_heartbeat"].timestamp())
        for p in people:
            user = p["user"]
            user_jobs.add_metric([user, "running"], p["running"])
            user_jobs.add_metric([user, "queued"], p["queued"])
            for window in ("1d", "7d"):
                gpu_hours.add_metric([user, window], p[f"gpu_hours_{window}"])
                cpu_hours.add_metric([user, window], p[f"cpu_slot_hours_{window}"])
            usage.add_metric([user], p["usage_gpu_s"])
        for (worker, index), (holder, now) in sorted(in_use.items()):
            labels = [str(holder["job_id"]), holder["owner"] or "", worker, str(index)]
            gpu_util.add_metric(labels, now.utilization)
            gpu_mem.add_metric(labels, now.memory_used)
            gpu_mem_total.add_metric(labels, now.memory_total)
        return fams


def _job_counts(db: Database) -> tuple[dict[str, int], datetime | None]:
    """Jobs per state, and when the longest-waiting queued job entered the queue.
    Both read from indexes (status leads ix_jobs_status_priority_share_id and
    ix_jobs_status_queued_at)."""
    with db.read() as s:
        counts = {
            status: int(n)
            for status, n in s.execute(select(Job.status, func.count()).group_by(Job.status))
        }
        oldest = s.scalar(select(func.min(Job.queued_at)).where(Job.status == JobStatus.QUEUED))
    return counts, oldest


class Telemetry:
    """One app's metrics: its registry, histograms, and the DB-backed collector."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_QueueCollector(db))
        self.requests = Histogram(
            "ddpq_http_request_duration_seconds",
            "HTTP requests by method, route template and status, until the answer is sent",
            ["method", "route", "status"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        self.claims = Histogram(
            "ddpq_claim_latency_seconds",
            "One claim attempt: the claim transaction and its wait for the claim thread "
            "(outcome claimed or empty; a long-poll's waits between attempts not included)",
            ["outcome"],
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "ddpq_queue_wait_seconds",
            "How long each claimed job waited in the queue (since it was queued or requeued)",
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )

    def observe_claim(self, seconds: float, claim: queue.Claim | None) -> None:
        self.claims.labels("claimed" if claim else "empty").observe(seconds)
        if claim is not None and claim.queued_at is not None:
            waited = (utcnow() - queue.as_utc(claim.queued_at)).total_seconds()
            self.queue_wait.observe(max(0.0, waited))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """Times every HTTP request into ``ddpq_http_request_duration_seconds``.

    A plain ASGI middleware, not Starlette's BaseHTTPMiddleware, which buffers
    through a memory stream and breaks streaming answers (followed logs). The route
    label is the matched route's template (``/jobs/{job_id}``), never the raw path,
    so label values stay bounded; requests that reach no route (unknown paths, and
    those the token gate refuses before routing) count as ``unmatched``.
    """

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.histogram = telemetry.requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def tracked_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.histogram.labels(
                method if method in METHODS else "other", template, str(status)
            ).observe(time.perf_counter() - start)


router = APIRouter(tags=["meta"])


@router.get(
    "/metrics",
    dependencies=[UserAuth],
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        }
    },
)
async def get_prometheus_metrics(request: Request) -> Response:
    """Prometheus metrics of the queue, the workers and this API process."""
    telemetry: Telemetry = request.app.state.telemetry
    body = await run_in_threadpool(telemetry.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
