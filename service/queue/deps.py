"""Dependencies: a job that starts after others (``after: [{job: 12, when: ok}]``,
``ddpq submit --after 12:ok``), as Slurm's ``--dependency=afterok:12``/``afterany:12``.

A submit checks each job waited for (``check``): one that does not exist is a 422, one
that can never be met (``ok`` of a job that failed or was cancelled) a 409; one met
already counts for nothing; the rest are recorded (``record``: a job_deps row each, and
the job's ``waits_on`` counts them), and no claim takes the job while any is left
(rules.ready). When a job ends (service.queue.states: every way a job reaches an end),
what waited for it is settled in the same transaction: a met dependency goes, the last
one going wakes the claimers; one never to be met fails the job that waited, which is
settled in turn (a chain fails as far as it reaches), as Slurm's DependencyNeverSatisfied.

Locks, Postgres (SQLite serialises writers): a submit reads the jobs it waits for FOR
SHARE, in id order, before anything else it locks; an end holds its job's row FOR
UPDATE. So a dependency recorded while its job ends is seen by that end, or sees the end.
The jobs that wait are always newer than what they wait for (it exists at their submit):
the end locks them after its own row, in id order, before any owner's lock
(service.queue.quotas).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.deptables import JobDep
from service.errors import Conflict, Invalid
from service.models import TERMINAL, Job, JobStatus


def verdict(status: str, when: str) -> bool | None:
    """Whether a dependency on a job in ``status`` is met (True), never can be (False),
    or not yet (None)."""
    if status not in TERMINAL:
        return None
    return status == JobStatus.SUCCEEDED or when == "any"


def words(job_id: int, when: str) -> str:
    return f"after {job_id}:{when}"


def check(s: Session, after: list[Any]) -> list[tuple[int, str]]:
    """The dependencies of a job being submitted that are not met yet, as (job, when);
    Invalid (422, naming ``after[i].job``) for a job that does not exist, Conflict (409)
    for one that can never be met. Their rows are read FOR SHARE (Postgres)."""
    if not after:
        return []
    wanted = sorted({int(d.job) for d in after})
    rows = s.execute(
        select(Job.id, Job.status)
        .where(Job.id.in_(wanted))
        .order_by(Job.id)
        .with_for_update(read=True)
    ).all()
    status = {job_id: st for job_id, st in rows}
    unmet = []
    for i, d in enumerate(after):
        if d.job not in status:
            raise Invalid(("body", "after", i, "job"), f"no job {d.job} to wait for")
        met = verdict(status[d.job], d.when)
        if met is False:
            raise Conflict(
                f"after[{i}]: job {d.job} is {status[d.job]}: {words(d.job, d.when)} can "
                "never be met (ok waits for a success; any for an end of any kind)"
            )
        if met is None:
            unmet.append((int(d.job), str(d.when)))
    return unmet


def record(s: Session, job: Job, unmet: list[tuple[int, str]]) -> None:
    """What ``job`` (just inserted) waits for: a row each, and its count."""
    for on_job, when in unmet:
        s.add(JobDep(job_id=job.id, on_job=on_job, when=when))
    job.waits_on = len(unmet)


def waiting_for(s: Session, job_id: int) -> list[tuple[JobDep, Job]]:
    """The dependencies on ``job_id`` and the jobs that wait, those rows locked in id
    order (the caller holds ``job_id``'s, an older job's)."""
    deps = list(s.scalars(select(JobDep).where(JobDep.on_job == job_id)))
    if not deps:
        return []
    ids = sorted({d.job_id for d in deps})
    jobs = {
        j.id: j
        for j in s.scalars(
            select(Job)
            .where(Job.id.in_(ids))
            .order_by(Job.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    }
    return [(d, jobs[d.job_id]) for d in sorted(deps, key=lambda d: d.job_id) if d.job_id in jobs]


def unmet_of(s: Session, job_ids: list[int]) -> dict[int, list[tuple[int, str]]]:
    """What each of ``job_ids`` still waits for (its reason says so)."""
    if not job_ids:
        return {}
    out: dict[int, list[tuple[int, str]]] = {}
    rows = s.execute(
        select(JobDep.job_id, JobDep.on_job, JobDep.when)
        .where(JobDep.job_id.in_(job_ids))
        .order_by(JobDep.on_job)
    )
    for job_id, on_job, when in rows:
        out.setdefault(int(job_id), []).append((int(on_job), str(when)))
    return out
