"""The queue in order (GET /queue, ``ddpq queue``): the queued jobs as the claims will try
them (queue.rules.ORDER), each with its priority, its owner's recent usage, why it is
ahead of the next, what it waits for (queue.reasons) and when it would start
(queue.plan). One read of the queue's columns in order; the page's jobs read whole."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from service import queue
from service.db import Database
from service.models import Job, JobStatus, utcnow
from service.queue import plan
from service.schemas.accounting import QueuedPublic, QueuePublic, SchedulingPublic

_QUEUED = (
    Job.id,
    Job.name,
    Job.owner,
    Job.priority,
    Job.share,
    Job.device,
    Job.nproc_per_node,
    Job.nnodes,
    Job.created_at,
    Job.queued_at,
    Job.not_before,
    Job.waits_on,
    Job.quota_running,
    Job.quota_gpus,
)


def _limit_s(spec: dict[str, Any] | None) -> float | None:
    value = (spec or {}).get("timeout_s")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _hosts(s: Any, now: datetime) -> list[plan.Host]:
    """The live workers (not bridges), with the ends of the running jobs whose limits
    are known."""
    hosts = {
        c.name: plan.Host(c.name, c.cpu_slots, len(c.gpus), c.free_cpu, len(c.free_gpus))
        for c in queue.capacities(s, s.info["policy"].lease_s)
        if c.live and c.partition is None
    }
    running = s.execute(
        select(Job.worker, Job.gpus, Job.held_cpu_slots, Job.started_at, Job.spec, Job.owner).where(
            Job.status.in_((JobStatus.RUNNING, JobStatus.CANCELLING)), Job.nnodes == 1
        )
    )
    for worker, gpus, cpu, started, spec, owner in running:
        limit = _limit_s(spec)
        if worker in hosts and started is not None and limit is not None:
            unit, n = ("gpu", len(gpus)) if gpus else ("cpu", int(cpu or 0))
            hosts[worker].ends.append((started + timedelta(seconds=limit), unit, n, owner))
    return sorted(hosts.values(), key=lambda h: h.name)


def _placed(job: Any, after: Any, to_gpu_s: float) -> str:
    """Why ``job`` is ahead of ``after``, the next in the order."""
    if job.priority != after.priority:
        return f"ahead of job {after.id}: priority {job.priority} > {after.priority}"
    if job.share != after.share:
        mine, theirs = job.share * to_gpu_s, after.share * to_gpu_s
        return (
            f"ahead of job {after.id}: {job.owner}'s recent usage {mine:.1f} GPU-s < "
            f"{after.owner}'s {theirs:.1f}"
        )
    return f"ahead of job {after.id}: submitted before it"


def _no_plan(row: Any) -> str | None:
    """Why the plan gives ``row`` no estimate, for what it does not play."""
    if row.nnodes > 1:
        return "a multi-node job: its nodes are gathered as workers free up; no estimate"
    if row.waits_on:
        return "it waits for other jobs to end: no estimate"
    if row.quota_running or row.quota_gpus:
        return "its owner's quota holds it back: no estimate"
    return None


def view(db: Database, limit: int, offset: int, user: str | None) -> QueuePublic:
    now = utcnow()
    with db.read() as s:
        rows = list(
            s.execute(select(*_QUEUED).where(Job.status == JobStatus.QUEUED).order_by(*queue.ORDER))
        )
        to_gpu_s = queue.share_to_gpu_s(s, now)
        planned = [r for r in rows[: plan.MAX_PLANNED] if _no_plan(r) is None]
        specs: dict[int, Any] = dict(
            s.execute(select(Job.id, Job.spec).where(Job.id.in_([r.id for r in planned]))).all()
        ) if planned else {}  # fmt: skip
        waiting = [
            plan.Waiting(
                r.id, r.owner, r.priority, r.device, r.nproc_per_node, _limit_s(specs.get(r.id)),
                r.not_before, r.queued_at or r.created_at,
            )
            for r in planned
        ]  # fmt: skip
        p = db.policy
        usage = {r.owner: r.share * to_gpu_s for r in rows if r.owner is not None}
        usage.update(queue.decayed_usage(s, now))
        rules = plan.Rules(usage, p.fairshare_half_life_s, p.cpu_slot_weight, p.starvation_s)
        estimates = plan.plan(_hosts(s, now), waiting, now, rules)
        positions = {r.id: i + 1 for i, r in enumerate(rows)}
        mine = [r for r in rows if user is None or r.owner == user]
        page = mine[offset : offset + limit]
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_([r.id for r in page])))}
        reasons = queue.pending_reasons(s, list(jobs.values()), positions)
    nxt = {rows[i].id: rows[i + 1] for i in range(len(rows) - 1)}
    items = []
    for r in page:
        est = estimates.get(r.id)
        past = f"only the first {plan.MAX_PLANNED} queued jobs are planned: no estimate"
        words = _no_plan(r) or (est.words if est else past)
        items.append(
            QueuedPublic(
                position=positions[r.id],
                job_id=r.id,
                name=r.name,
                user=r.owner,
                priority=r.priority,
                device=r.device,
                world_size=r.nproc_per_node * r.nnodes,
                nnodes=r.nnodes,
                queued_at=r.queued_at or r.created_at,
                usage_gpu_s=r.share * to_gpu_s,
                placed=_placed(r, nxt[r.id], to_gpu_s) if r.id in nxt else None,
                reason=reasons.get(r.id, ""),
                estimated_start=est.start if est else None,
                estimate=words,
            )
        )
    return QueuePublic(
        items=items,
        total=len(mine),
        offset=offset,
        scheduling=SchedulingPublic(
            preemption=p.preemption,
            fairshare_half_life_s=p.fairshare_half_life_s,
            cpu_slot_weight=p.cpu_slot_weight,
            starvation_s=p.starvation_s,
            preempt_min_run_s=p.preempt_min_run_s,
        ),
    )
