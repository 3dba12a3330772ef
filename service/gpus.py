"""GPU use per job: the samples a worker's heartbeats carry of its running jobs' GPUs
(NVML: utilisation, memory), stored as the job's system metrics, and read back as a
job's history, as each worker's GPUs with their holders, and for Prometheus.

Bounded by age, not by count: a GPU's samples go into time slots as wide as the
sampling interval (Settings.gpu_sample_s) for the attempt's first FULL_SLOTS slots, then
twice as wide each time the attempt's age doubles. Each doubling adds FULL_SLOTS / 2
slots, so an attempt keeps FULL_SLOTS * (1 + log2(age / (interval * FULL_SLOTS)) / 2)
rows per GPU: 720 for its first hour at 5 s, about 4,100 after 30 days; one upsert per
sample and nothing to delete. A slot keeps its newest sample. Slots are aligned to the
attempt's start, so a wider slot always begins where the narrower ones ended (the age
at which the width doubles is a multiple of both widths): the slots of a series are in
time order and the last one holds its latest sample.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Table, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.db import Database
from service.errors import NotFound
from service.models import Attempt, GpuSample, Job, Worker, utcnow
from service.schemas import GpuSampleIn, GpuUse, JobGpu, WorkerGpu

# Slots at the finest width before they widen (an hour at 5 s).
FULL_SLOTS = 720
_TABLE: Table = GpuSample.__table__  # type: ignore[assignment]


def slot_of(start: datetime, at: datetime, base_s: float) -> int:
    """The slot (its start, Unix milliseconds) a sample taken at ``at`` goes into, for an
    attempt started at ``start``: FULL_SLOTS slots of base_s, then each doubling of the
    attempt's age in slots twice as wide."""
    start_ms = int(start.timestamp() * 1000)
    age = max(0, int(at.timestamp() * 1000) - start_ms)
    width = max(1, int(base_s * 1000))
    while age >= width * FULL_SLOTS:
        width *= 2
    return start_ms + age // width * width


def store(
    s: Session,
    worker: str,
    now: datetime,
    base_s: float,
    samples: dict[tuple[int, int], list[GpuSampleIn]],
) -> None:
    """Store the samples of a worker's live attempts (job, attempt) in the heartbeat's
    transaction; each dated by the service's clock (GpuSampleIn.ago_s)."""
    samples = {k: v for k, v in samples.items() if v}
    if not samples:
        return
    starts = {
        (r.job_id, r.number): r.started_at
        for r in s.execute(
            select(Attempt.job_id, Attempt.number, Attempt.started_at).where(
                tuple_(Attempt.job_id, Attempt.number).in_(list(samples))
            )
        )
    }
    rows: dict[tuple[int, int, int], dict[str, Any]] = {}
    for (job_id, number), items in samples.items():
        start = starts.get((job_id, number))
        if start is None:
            continue
        for item in items:
            at = now - timedelta(seconds=item.ago_s)
            key = (job_id, item.gpu, slot_of(start, at, base_s))
            if key in rows and rows[key]["at"] >= at:
                continue  # a slot keeps its newest sample
            rows[key] = {
                "job_id": job_id,
                "worker": worker,
                "gpu": item.gpu,
                "slot": key[2],
                "attempt": number,
                "at": at,
                "utilization": item.utilization,
                "memory_used": item.memory_used,
                "memory_total": item.memory_total,
            }
    if not rows:
        return
    insert = (pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert)(_TABLE)
    stmt = insert.on_conflict_do_update(
        index_elements=["job_id", "worker", "gpu", "slot"],
        set_={
            c: insert.excluded[c]
            for c in ("attempt", "at", "utilization", "memory_used", "memory_total")
        },
        where=_TABLE.c.at <= insert.excluded.at,
    )
    s.execute(stmt, list(rows.values()))


def _use(r: Any) -> GpuUse:
    return GpuUse(
        time=r.at,
        utilization=r.utilization,
        memory_used=r.memory_used,
        memory_total=r.memory_total,
    )


def _thinned(rows: list[Any], max_points: int) -> list[Any]:
    """At most max_points of a series, evenly spread, its last (latest) one kept."""
    if len(rows) <= max_points:
        return rows
    if max_points <= 0:
        return []
    stride = len(rows) / max_points
    picked = [rows[int(i * stride)] for i in range(max_points - 1)]
    return [*picked, rows[-1]]


def history(db: Database, job_id: int, max_points: int) -> list[JobGpu]:
    """Each GPU the job's attempts held, with its latest sample and at most ``max_points``
    of its history, oldest first (none: the latest only)."""
    with db.read() as s:
        if s.get(Job, job_id) is None:
            raise NotFound(f"no job {job_id}")
        rows = s.execute(
            select(GpuSample)
            .where(GpuSample.job_id == job_id)
            .order_by(GpuSample.worker, GpuSample.gpu, GpuSample.slot)
        ).scalars()
        series: dict[tuple[str, int], list[GpuSample]] = {}
        for r in rows:
            series.setdefault((r.worker, r.gpu), []).append(r)
        names = _devices(s, sorted({w for w, _ in series}))
    out = []
    for (worker, gpu), points in series.items():
        last = points[-1]
        device = names.get((worker, gpu), {})
        out.append(
            JobGpu(
                worker=worker,
                gpu=gpu,
                uuid=device.get("uuid"),
                name=device.get("name"),
                attempt=last.attempt,
                latest=_use(last),
                samples=[_use(p) for p in _thinned(points, max_points)],
            )
        )
    return out


def _devices(s: Session, workers: list[str]) -> dict[tuple[str, int], dict[str, Any]]:
    """The GPUs of these workers as they registered them, by (worker, index)."""
    if not workers:
        return {}
    found = s.execute(select(Worker.name, Worker.gpu_devices).where(Worker.name.in_(workers)))
    return {(name, d["index"]): d for name, devices in found for d in devices or []}


def current_use(
    db: Database, overview: list[dict[str, Any]]
) -> dict[tuple[str, int], tuple[dict[str, Any], GpuUse]]:
    """The latest sample of each GPU an attempt holds now (the workers' overview, their
    running attempts), with that attempt, by (worker, GPU index). A GPU with no sample
    of that attempt within the lease has no current use."""
    held = [
        (w["name"], gpu, r)
        for w in overview
        if w.get("gpu_devices")
        for r in w["running"]
        for gpu in r["gpus"]
    ]
    if not held:
        return {}
    fresh = utcnow() - timedelta(seconds=db.policy.lease_s)
    out: dict[tuple[str, int], tuple[dict[str, Any], GpuUse]] = {}
    with db.read() as s:
        for worker, gpu, r in held:
            # One probe of the primary key's end per GPU: the series' last slot.
            last = s.execute(
                select(GpuSample)
                .where(
                    GpuSample.job_id == r["job_id"],
                    GpuSample.worker == worker,
                    GpuSample.gpu == gpu,
                )
                .order_by(GpuSample.slot.desc())
                .limit(1)
            ).scalar_one_or_none()
            if last is not None and last.attempt == r["attempt"] and last.at >= fresh:
                out[(worker, gpu)] = (r, _use(last))
    return out


def worker_gpus(db: Database, overview: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers' overview with each worker's GPUs as NVML named them, each with the
    job holding it (and its owner) and its latest use while that job runs."""
    use = current_use(db, overview)
    for w in overview:
        holders = {gpu: r for r in w["running"] for gpu in r["gpus"]}
        views = []
        for d in w.get("gpu_devices") or []:
            holder = holders.get(d["index"])
            now = use.get((w["name"], d["index"]))
            views.append(
                WorkerGpu(
                    index=d["index"],
                    uuid=d["uuid"],
                    name=d["name"],
                    memory_total=d["memory_total"],
                    job_id=holder["job_id"] if holder else None,
                    owner=holder["owner"] if holder else None,
                    use=now[1] if now else None,
                )
            )
        w["gpu_devices"] = views
    return overview
