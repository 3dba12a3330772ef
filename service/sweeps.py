"""Sweeps: the one owner of what a sweep decides and when.

A sweep is a base job and a search space. Each trial is an ordinary job of the sweep's
owner (service.jobs.queue_job: the same walls, fair share, quotas, retries and outputs),
with the parameters chosen for it in its args and env (templates) and its spec's
``params`` (DDPQ_PARAMS, ddpq.train.params()). The decisions are Optuna's, on a study
rebuilt from the database at each one (service.studies); this module reads what they
need, and writes what they decided:

- ``advance``, a round of one sweep, run by the sweeper's turn holder (``sweep_round``,
  service.sweeper) and cheap when no sweep runs (one indexed look): it tells the pruner
  the rungs trials reached and stops those it prunes (the service's cancel, with the
  cut in words; their slots free as their workers stop them), tells the sweep how
  ended trials ended, makes new trials up to max_concurrent and max_trials, and ends
  the sweep once every trial has ended (its best recorded).
- ``create`` makes a sweep and its first trials at once; ``cancel`` cancels its trials.

A round reads (and asks Optuna) outside any write, then writes in one bounded
transaction with the sweep's row locked, and only if the sweep's ``version`` is still
the one it read: two API processes (a round and a cancel, or a round of a process that
lost the sweeper's turn) never make a trial twice, and a decision on a stale read is
dropped, to be made again on the next. Lock order in that transaction: the sweep's row,
then job rows (stopping trials, ascending ids), then the owner's lock, which a trial's
submit takes under a queued limit (service.queue.quotas): no job row is locked after it.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from ddpq.rules import MAX_RUNGS
from service import asha, code, holds, jobs, queue, studies, sweepviews, users
from service.db import Database
from service.errors import Conflict, Forbidden, Invalid, NotFound, TooMany
from service.models import Job, MetricPoint, User, utcnow
from service.schemas import JobSpec, SweepPublic, SweepSpec, fill
from service.schemas.sweeps import MAX_SEED
from service.sweepplan import (
    LIVE,
    MAX_NEW_PER_ROUND,
    Plan,
    SweepRead,
    Told,
    TrialRead,
    decide,
    ended_words,
    tell,
)
from service.sweeptables import Sweep, SweepTrial
from service.users import Principal

log = logging.getLogger("ddpq.service")

RUNNING, DONE, CANCELLED = "running", "done", "cancelled"
# Points of a trial's metric one round reads past its next rung (the rest, the next).
MAX_POINTS_READ = 10_000


# ---- a trial's job ---------------------------------------------------------------------


def label(sweep: Sweep) -> str:
    return sweep.name or f"sweep-{sweep.id}"


def trial_spec(spec: SweepSpec, name: str, number: int, params: dict[str, Any]) -> JobSpec:
    """Trial ``number``'s job: the base job with ``params`` in its args and env values
    ({lr}) and its spec's ``params``, named after its sweep."""
    job = spec.job.model_dump(mode="json")
    job["args"] = [fill(a, params) for a in job["args"]]
    job["env"] = {k: fill(v, params) for k, v in job["env"].items()}
    job["params"] = params
    job["rungs"] = rungs_of(spec)
    job["name"] = f"{name}/{number}"[-200:]
    if spec.array is not None:  # a task: named and numbered by its index, as Slurm's are
        job["array_index"] = params["index"]
        job["name"] = f"{name}/{params['index']}"[-200:]
    return JobSpec.model_validate(job)


def rungs_of(spec: SweepSpec) -> list[int]:
    """The first steps (MAX_RUNGS) at which the sweep's early stopping judges a trial."""
    found: list[int] = []  # rung_step ends them before a step past MAX_STEP
    while len(found) < MAX_RUNGS and (at := studies.rung_step(spec, len(found))) is not None:
        found.append(at)
    return found


# ---- what a round reads ------------------------------------------------------------------


def _read(s: Session, sweep: Sweep) -> SweepRead:
    spec = sweepviews.spec_of(sweep)
    rows = s.execute(
        select(SweepTrial, Job.status, Job.reason, Job.latest_metrics, Job.pausing)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id)
        .order_by(SweepTrial.number)
    ).all()
    trials = []
    for t, status, reason, latest, pausing in rows:
        rungs = [(int(step), value) for step, value in t.rungs]
        latest_step = latest.get("step") if latest else None
        trials.append(
            TrialRead(
                t.number, t.job_id, t.params, t.state, t.value, rungs, status, reason,
                latest_step, pausing is not None,
            )
        )  # fmt: skip
    read = SweepRead(
        sweep.id, sweep.owner, sweep.version, sweep.seed, sweep.trials_made, spec, trials
    )
    for t in trials:
        if t.state not in LIVE or t.job_id is None:
            continue
        if t.state == "active":
            _read_rungs(s, read, t)
        if t.ended and spec.metric is not None:
            last = s.execute(
                select(MetricPoint.step, MetricPoint.value)
                .where(MetricPoint.job_id == t.job_id, MetricPoint.name == spec.metric)
                .order_by(MetricPoint.step.desc())
                .limit(1)
            ).first()
            read.finals[t.number] = (int(last[0]), last[1]) if last else None
    return read


def _read_rungs(s: Session, read: SweepRead, t: TrialRead) -> None:
    """The rungs ``t`` reached past those recorded (studies.rungs_from), as events."""
    at = studies.rung_step(read.spec, len(t.rungs))
    if at is None or t.latest_step is None or t.latest_step < at:
        return  # it has reported no step that far (the job's newest step says so)
    points = s.execute(
        select(MetricPoint.step, MetricPoint.value, MetricPoint.time)
        .where(
            MetricPoint.job_id == t.job_id,
            MetricPoint.name == read.spec.metric,
            MetricPoint.step >= at,
        )
        .order_by(MetricPoint.step)
        .limit(MAX_POINTS_READ)
    ).all()
    found = [(int(p.step), p.value, p.time) for p in points]
    for k, step, value, when in studies.rungs_from(read.spec, len(t.rungs), found):
        read.events.append(studies.Event(t.number, k, step, value, when))


# ---- the round -------------------------------------------------------------------------------


_RUNNING = select(Sweep.id).where(Sweep.status == RUNNING).order_by(Sweep.id)


def sweep_round(db: Database) -> int:
    """One round over every running sweep (the sweeper's turn holder runs it); how many
    changed. One indexed read when none runs."""
    ids = [row[0] for row in db.read_all(_RUNNING, {})]
    changed = 0
    for sweep_id in ids:
        try:
            changed += advance(db, sweep_id)
        except Exception:  # one sweep's trouble never holds the others up
            log.exception("sweep %d: its round failed", sweep_id)
    return changed


def advance(db: Database, sweep_id: int) -> bool:
    """One round of one sweep: read, decide (Optuna), then write what was decided if the
    sweep is still as read. Whether it changed anything."""
    with db.read() as s:
        sweep = s.get(Sweep, sweep_id)
        if sweep is None or sweep.status != RUNNING:
            return False
        try:
            read = _read(s, sweep)
        except ValidationError as exc:  # a rule tightened since its submit
            why = str(exc.errors()[0].get("msg", exc))[:300]
            return _stop(db, sweep_id, sweep.version, f"its spec is refused now: {why}")
    plan = decide(read)
    if plan.empty:
        return False
    made = _write(db, read, plan)
    if made and db.policy.preemption != "off":
        queue.preempt_sweep(db)  # room for the new trials, if they outrank and may
    return True


def _trial_of(job_id: int) -> Any:
    return (
        select(SweepTrial.sweep_id, SweepTrial.rungs, SweepTrial.state, Sweep.spec)
        .join(Sweep, Sweep.id == SweepTrial.sweep_id)
        .where(SweepTrial.job_id == job_id, Sweep.status == RUNNING)
    )


def judge(db: Database, job_id: int, step: int) -> str | None:
    """A trial's reporter says it reached a rung at ``step`` (ddpq.rules.RUNGS_VAR): its
    sweep's round now, not at the sweeper's next. Why the trial is to stop if it is
    pruned (its reporter stops the program), else None. A no-op but for one indexed read
    unless the job is an active trial of a running sweep that ``step`` takes to a rung
    not yet recorded, so a job asking on every batch costs the API no round."""
    with db.read() as s:
        row = s.execute(_trial_of(job_id)).first()
        if row is None or row.state != "active":
            return None
        try:
            spec = SweepSpec.model_validate(row.spec)
        except ValidationError:  # a rule tightened since: the round stops the sweep
            return None
        at = studies.rung_step(spec, len(row.rungs))
        if at is None or step < at:
            return None
    for _ in range(2):  # a round of another process may have moved the sweep on first
        if not _advanced(db, row.sweep_id):
            return None
        with db.read() as s:
            now = s.execute(
                select(SweepTrial.state, SweepTrial.reason, SweepTrial.rungs).where(
                    SweepTrial.job_id == job_id
                )
            ).first()
        if now is None or now.state in _STOPS or len(now.rungs) > len(row.rungs):
            break
    return now.reason if now is not None and now.state in _STOPS else None


_STOPS = ("pruned", asha.PAUSED)  # what a judgment answers with ``stop``


def trial_ended(db: Database, job_id: int) -> None:
    """A job ended: if it is a trial, its sweep's round now (its place refilled, or the
    sweep ended) rather than at the sweeper's next."""
    with db.read() as s:
        row = s.execute(_trial_of(job_id)).first()
    if row is not None:
        _advanced(db, row.sweep_id)


def _advanced(db: Database, sweep_id: int) -> bool:
    """``advance`` for a request that came for something else (its points or its end,
    already committed): its trouble is logged, never its request's; False then."""
    try:
        advance(db, sweep_id)
    except Exception:
        log.exception("sweep %d: its round failed", sweep_id)
        return False
    return True


def _stop(db: Database, sweep_id: int, version: int, why: str) -> bool:
    """End a sweep that cannot go on (its trials, if any, run to their ends)."""
    with db.write() as s:
        sweep = _locked(s, sweep_id)
        if sweep is None or sweep.status != RUNNING or sweep.version != version:
            return False
        sweep.version += 1
        _end(sweep, CANCELLED, f"cancelled by ddpq: {why}", utcnow())
    log.warning("sweep %d stopped: %s", sweep_id, why)
    return True


def _locked(s: Session, sweep_id: int) -> Sweep | None:
    return s.scalars(
        select(Sweep)
        .where(Sweep.id == sweep_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()


def _write(db: Database, read: SweepRead, plan: Plan) -> int:
    """Apply ``plan`` if the sweep is still the one read; how many trials it made."""
    now = utcnow()
    with db.write() as s:
        sweep = _locked(s, read.id)
        if sweep is None or sweep.status != RUNNING or sweep.version != read.version:
            return 0  # changed since the read: the next round decides again
        sweep.version += 1
        rows = {
            t.number: t for t in s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == read.id))
        }
        for number, rungs in plan.rungs.items():
            rows[number].rungs = [[step, value] for step, value in rungs]
        for number, told in plan.told.items():
            _record(rows[number], told, now)
        _stop_and_pause(s, rows, plan, now)
        if plan.best is not None:
            sweep.best_trial, sweep.best_value = plan.best.number, plan.best.value
        made = _make(s, sweep, read.spec, plan.new, _admin(s, sweep.owner))
        if plan.done:
            _end(sweep, DONE, ended_words(read, plan), now)
    return made


def _stop_and_pause(s: Session, rows: dict[int, SweepTrial], plan: Plan, now: datetime) -> None:
    """The trials ``plan`` stops, pauses, promotes and resumes, their jobs locked in id
    order (a trial whose job moved on meanwhile is decided again next round). A
    promotion releases its job last: a release may take the owner's lock."""
    acts: list[tuple[int, str, Any]] = [
        *((n, "resume", None) for n in plan.resumed),
        *((p.number, "prune", p) for p in (*plan.prunes, *plan.unpromoted)),
        *((q.number, "pause", q) for q in plan.pauses),
        *((n, "promote", None) for n in plan.promote),
    ]
    acts.sort(key=lambda a: rows[a[0]].job_id or 0)
    for number, _, _ in acts:
        if (job_id := rows[number].job_id) is not None:
            jobs.lock(s, job_id)
    for number, act, why in acts:
        row, job_id = rows[number], rows[number].job_id
        if act == "resume":
            _record(row, Told("active", None, None, None), None)
        elif job_id is None:
            continue
        elif act == "prune" and jobs.cancel_locked(s, job_id, why.words):
            _record(row, Told("pruned", why.value, why.step, why.words), now)
        elif act == "pause" and holds.pause_locked(s, job_id, why.words):
            _record(row, Told(asha.PAUSED, why.value, why.step, why.words), None)
    for number in plan.promote:
        job_id = rows[number].job_id
        if job_id is not None and holds.promote_locked(s, job_id):
            _record(rows[number], Told("active", None, None, None), None)


def _record(row: SweepTrial, told: Told, now: datetime | None) -> None:
    row.state, row.value, row.step, row.reason = told.state, told.value, told.step, told.reason
    row.finished_at = now


def _admin(s: Session, owner: str) -> bool | None:
    """Whether the owner is an admin (no priority cap); None if their account is closed."""
    role = s.scalar(select(User.role).where(User.name == owner, User.revoked_at.is_(None)))
    return None if role is None else role == "admin"


def _make(
    s: Session,
    sweep: Sweep,
    spec: SweepSpec,
    new: list[tuple[int, dict[str, Any]]],
    admin: bool | None,
) -> int:
    """Submit the trials ``new`` as the owner's jobs (last in the transaction: a submit may
    take the owner's lock). A trial its owner's quota refuses waits (the sweep's reason
    says why) and is asked again next round; how many were made."""
    if not new:
        return 0
    if admin is None:
        _end(sweep, CANCELLED, f"{sweep.owner}'s account is closed: no more trials", utcnow())
        return 0
    made = 0
    for number, params in new:
        if number != sweep.trials_made:
            break  # another transaction made it (the version check makes this moot)
        try:
            job_spec = trial_spec(spec, label(sweep), number, params)
        except ValidationError as exc:
            why = str(exc.errors()[0].get("msg", exc))[:300]
            _end(sweep, CANCELLED, f"trial {number}'s job is refused: {why}", utcnow())
            return made
        try:
            with s.begin_nested():
                job = jobs.queue_job(s, job_spec, sweep.owner, admin)
        except (TooMany, Forbidden) as exc:
            sweep.reason = f"waiting to make trial {number}: {exc.detail}"
            return made
        s.add(
            SweepTrial(
                sweep_id=sweep.id,
                number=number,
                job_id=job.id,
                params=params,
                state="active",
                rungs=[],
            )
        )
        sweep.trials_made += 1
        made += 1
    sweep.reason = None
    return made


def _end(sweep: Sweep, status: str, reason: str, now: datetime) -> None:
    sweep.status, sweep.reason, sweep.finished_at = status, reason, now


# ---- what people ask -----------------------------------------------------------------------


def create(db: Database, spec: SweepSpec, who: Principal) -> SweepPublic:
    """Make a sweep as ``who``'s and its first trials at once. Forbidden (audited) for a
    priority over a member's cap; the code snapshot must hold the entrypoint (422). A
    queued limit that leaves no room makes the sweep wait, with the reason."""
    seed = spec.seed if spec.seed is not None else secrets.randbelow(MAX_SEED + 1)
    # As stored, the seed and the number of trials filled in (a grid's size by default).
    stored = {**spec.model_dump(mode="json"), "seed": seed, "max_trials": spec.limit}
    first = list(range(min(spec.max_concurrent, spec.limit, MAX_NEW_PER_ROUND)))
    try:
        asked = studies.ask(spec, seed, [], first)  # Optuna's work, before the write
    except (ValueError, OverflowError) as exc:  # a space its samplers refuse
        raise Invalid(("body", "space"), f"the space cannot be drawn from: {exc}"[:400]) from None
    for number, params in zip(first, asked, strict=True):
        try:  # a trial's job must pass as any job does (its args filled in: their length)
            trial_spec(spec, spec.name or "sweep", number, params)
        except ValidationError as exc:
            why = str(exc.errors()[0].get("msg", exc))[:300]
            raise Invalid(("body", "job"), f"trial {number}'s job is refused: {why}") from None
    try:
        with db.write() as s:
            sweep = Sweep(
                name=spec.name, owner=who.name, status=RUNNING, spec=stored, seed=seed,
                trials_made=0, version=0, created_at=utcnow(),
            )  # fmt: skip
            s.add(sweep)
            s.flush()
            if spec.job.code is not None:
                code.use(s, spec.job.code, spec.job.entrypoint)
            users.audit(
                s, who.name, "submit", f"sweep {sweep.id}",
                {"method": spec.method, "max_trials": spec.limit, "metric": spec.metric},
            )  # fmt: skip
            if not who.admin:
                # The cap refuses the sweep itself, not just its trials one by one.
                limits = queue.usage_and_limits(s, who.name, utcnow())[1]
                jobs.within_priority_cap(spec.job.priority, who.name, limits)
            _make(s, sweep, spec, list(zip(first, asked, strict=True)), who.admin)
            public = sweepviews.read(s, sweep)
    except Forbidden as refused:
        users.audit_refused(db, who.name, "submit", "sweep", str(refused))
        raise
    if db.policy.preemption != "off":
        queue.preempt_sweep(db)
    return public


def cancel(db: Database, sweep_id: int, by: Principal) -> SweepPublic:
    """Cancel a sweep and its trials (queued ones at once; running ones once their workers
    stop them). Its owner or an admin; another member is refused (audited)."""
    now = utcnow()
    refused: Forbidden | None = None
    with db.write() as s:
        sweep = _locked(s, sweep_id)
        if sweep is None:
            raise NotFound(f"no sweep {sweep_id}")
        if not by.admin and sweep.owner != by.name:
            refused = Forbidden(
                f"sweep {sweep_id} is {sweep.owner}'s: only its owner or an admin may cancel "
                f"it ({by.name} is a member)"
            )
        elif sweep.status != RUNNING:
            raise Conflict(f"sweep {sweep_id} is {sweep.status} already: nothing to cancel")
        else:
            who = jobs.canceller(by, sweep.owner)
            read = _read(s, sweep)
            spec = read.spec
            rows = {
                t.number: t
                for t in s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id))
            }
            for t in sorted(read.trials, key=lambda t: t.job_id or 0):
                if t.state not in LIVE:
                    continue
                if t.ended:  # told now: the sweep has no more rounds
                    _record(rows[t.number], tell(spec.metric, t, read.finals.get(t.number)), now)
                elif t.job_id is not None:
                    jobs.cancel_locked(s, t.job_id, f"its sweep {sweep_id} was cancelled", by)
                    _record(
                        rows[t.number],
                        Told("cancelled", None, None, f"cancelled with its sweep by {who}"),
                        now,
                    )
            records = [studies.Record(r.number, r.params, r.state, r.value) for r in rows.values()]
            best = studies.best(spec, records)
            if best is not None:
                sweep.best_trial, sweep.best_value = best.number, best.value
            users.audit(s, by.name, "cancel", f"sweep {sweep_id}", {"trials": sweep.trials_made})
            _end(sweep, CANCELLED, f"cancelled by {who}", now)
            sweep.version += 1
            s.flush()
            return sweepviews.read(s, sweep)
    users.audit_refused(db, by.name, "cancel", f"sweep {sweep_id}", str(refused))
    raise refused
