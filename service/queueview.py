"""The queue in order (GET /queue, ``ddpq queue``): the queued jobs as the claims will try
them (queue.rules.ORDER), each with its priority, its owner's recent usage, why it is
ahead of the next, what it waits for (queue.reasons) and when it would start
(queue.plan). The plan's head of the queue is read in order, and the page asked for is a
slice of it or, past it, a range of the queue's index; the reasons are decided on the
page's rows (no job is read whole)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import func, select

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
    Job.preempting_on,
)


def _seconds(value: Any) -> float | None:
    """A spec's timeout_s as a time limit (0 or none: no limit)."""
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _limit_s(spec: dict[str, Any] | None) -> float | None:
    return _seconds((spec or {}).get("timeout_s"))


def _hosts(s: Any, caps: list[queue.Capacity]) -> list[plan.Host]:
    """The live workers (not bridges), with the ends of the running jobs whose limits
    are known."""
    hosts = {
        c.name: plan.Host(c.name, c.cpu_slots, len(c.gpus), c.free_cpu, len(c.free_gpus))
        for c in caps
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


def _after(row: Any) -> Any:
    """The job ``row`` is ahead of, as _page read it."""
    return SimpleNamespace(
        id=row.next_id, priority=row.next_priority, share=row.next_share, owner=row.next_owner
    )


def _no_plan(row: Any) -> str | None:
    """Why the plan gives ``row`` no estimate, for what it does not play."""
    if row.nnodes > 1:
        return "a multi-node job: its nodes are gathered as workers free up; no estimate"
    if row.waits_on:
        return "it waits for other jobs to end: no estimate"
    if row.quota_running or row.quota_gpus:
        return "its owner's quota holds it back: no estimate"
    return None


_NEXT = ("id", "priority", "share", "owner")  # what _placed reads of the job after


def _page(s: Any, limit: int, offset: int, user: str | None, head: list[Any]) -> list[Any]:
    """The page of the queue asked for (``user``'s jobs only, when given), each row with
    its place in the whole queue (``position``) and the next job's columns (``next_id``
    ...: the one it is ahead of). Only a page is read, never the whole queue (10,000
    queued jobs read to show 100 took 130 ms, bench/history.py): the whole queue's page
    is a range of its index, one row more for the last one's next (a slice of the plan's
    ``head``, the queue's first rows in order, when it holds it); one user's, the
    database numbers the queue (a window over the index) and picks theirs."""
    queued = select(*_QUEUED).where(Job.status == JobStatus.QUEUED)
    if user is None:
        if offset + limit < len(head) or len(head) < plan.MAX_PLANNED:  # head: all of it
            rows = head[offset : offset + limit + 1]
        else:
            rows = list(s.execute(queued.order_by(*queue.ORDER).offset(offset).limit(limit + 1)))
        page = []
        for i, row in enumerate(rows[:limit]):
            after = rows[i + 1] if i + 1 < len(rows) else None
            nxt = {f"next_{k}": getattr(after, k, None) for k in _NEXT}
            page.append(SimpleNamespace(**row._asdict(), position=offset + i + 1, **nxt))
        return page
    columns = {k: getattr(Job, k) for k in _NEXT}
    numbered = queued.add_columns(
        func.row_number().over(order_by=queue.ORDER).label("position"),
        *(func.lead(c).over(order_by=queue.ORDER).label(f"next_{k}") for k, c in columns.items()),
    ).subquery()
    q = select(numbered).where(numbered.c.owner == user).order_by(numbered.c.position)
    return list(s.execute(q.offset(offset).limit(limit)))


def view(db: Database, limit: int, offset: int, user: str | None) -> QueuePublic:
    now = utcnow()
    p = db.policy
    with db.read() as s:
        queued = select(*_QUEUED).where(Job.status == JobStatus.QUEUED)
        # The plan's head of the queue, with each job's time limit (not its whole spec:
        # 500 of them parsed, or asked for by id, cost 5-10 ms).
        timed = queued.add_columns(Job.spec["timeout_s"].as_float().label("timeout_s"))
        head = list(s.execute(timed.order_by(*queue.ORDER).limit(plan.MAX_PLANNED)))
        # Every user's usage now (one with none has used nothing: 0), which the plan
        # grows as its jobs run, and what a share is in GPU-seconds: one read of both.
        to_gpu_s, usage = queue.usage_now(s, now)
        waiting = [
            plan.Waiting(
                r.id, r.owner, r.priority, r.device, r.nproc_per_node, _seconds(r.timeout_s),
                r.not_before, r.queued_at or r.created_at,
            )
            for r in head
            if _no_plan(r) is None
        ]  # fmt: skip
        rules = plan.Rules(usage, p.fairshare_half_life_s, p.cpu_slot_weight, p.starvation_s)
        caps = queue.capacities(s, p.lease_s)  # the plan's hosts and the reasons' alike
        estimates = plan.plan(_hosts(s, caps), waiting, now, rules)
        page = _page(s, limit, offset, user, head)
        counted = select(func.count()).where(Job.status == JobStatus.QUEUED)
        total = s.scalar(counted.where(Job.owner == user) if user is not None else counted)
        positions = {r.id: int(r.position) for r in page}
        # The page's rows hold every column the reasons read of a job (_QUEUED).
        jobs = cast(list[Job], page)
        reasons = queue.reasons_on(s, jobs, positions, queue.shapes(caps), to_gpu_s)
    items = [_item(r, estimates.get(r.id), to_gpu_s, reasons) for r in page]
    return QueuePublic(
        items=items,
        total=int(total or 0),
        offset=offset,
        scheduling=SchedulingPublic(
            preemption=p.preemption,
            fairshare_half_life_s=p.fairshare_half_life_s,
            cpu_slot_weight=p.cpu_slot_weight,
            starvation_s=p.starvation_s,
            preempt_min_run_s=p.preempt_min_run_s,
        ),
    )


def _item(
    r: Any, est: plan.Estimate | None, to_gpu_s: float, reasons: dict[int, str]
) -> QueuedPublic:
    """One row of the page, as the API shows it."""
    past = f"only the first {plan.MAX_PLANNED} queued jobs are planned: no estimate"
    return QueuedPublic(
        position=int(r.position),
        job_id=r.id,
        name=r.name,
        user=r.owner,
        priority=r.priority,
        device=r.device,
        world_size=r.nproc_per_node * r.nnodes,
        nnodes=r.nnodes,
        queued_at=r.queued_at or r.created_at,
        usage_gpu_s=r.share * to_gpu_s,
        placed=_placed(r, _after(r), to_gpu_s) if r.next_id is not None else None,
        reason=reasons.get(r.id, ""),
        estimated_start=est.start if est else None,
        estimate=_no_plan(r) or (est.words if est else past),
    )
