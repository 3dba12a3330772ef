"""Sweeps as people read them: a listing, one sweep with its trials ranked by its metric
(with their parameters, state and reason), and its table exported as CSV or JSON. Reads
only: what a sweep decides, and when, is service.sweeps'."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from service.db import Database
from service.errors import NotFound
from service.models import Job
from service.schemas import (
    RungPublic,
    SweepPublic,
    SweepSpec,
    SweepSpecPublic,
    TrialCounts,
    TrialPublic,
    metric_out,
)
from service.sweeptables import Sweep, SweepTrial

_TRIALS = (
    select(SweepTrial, Job.status, Job.reason, Job.latest_metrics)
    .outerjoin(Job, Job.id == SweepTrial.job_id)
    .order_by(SweepTrial.sweep_id, SweepTrial.number)
)


def spec_of(sweep: Sweep) -> SweepSpec:
    """The sweep's spec, validated again (its seed and max_trials filled in at the submit):
    what its decisions go by. A view reads the stored one instead (``_stored``), which a
    rule tightened since cannot make unreadable."""
    return SweepSpec.model_validate(sweep.spec)


def _stored(sweep: Sweep) -> SweepSpecPublic:
    return SweepSpecPublic.model_validate(sweep.spec)


def _value(v: float | None) -> Any:
    return None if v is None else metric_out(v)


def _latest(metric: str | None, latest: dict[str, Any] | None) -> tuple[Any, int | None]:
    if not latest or metric is None or metric not in (latest.get("values") or {}):
        return None, None
    return latest["values"][metric], latest.get("step")


def trial_public(metric: str | None, row: Row[Any]) -> TrialPublic:
    t: SweepTrial = row[0]
    latest, latest_step = (
        _latest(metric, row.latest_metrics) if t.state == "active" else (None, None)
    )
    return TrialPublic(
        number=t.number,
        job_id=t.job_id,
        status=row.status,
        state=t.state,  # type: ignore[arg-type]
        params=t.params,
        value=_value(t.value),
        step=t.step,
        latest=latest,
        latest_step=latest_step,
        rungs=[RungPublic(step=s, value=metric_out(v)) for s, v in t.rungs],
        # The sweep's words when it stopped the trial; else its job's (why it waits,
        # failed, was cancelled).
        reason=t.reason or row.reason,
        created_at=t.created_at,
        finished_at=t.finished_at,
    )


def _number(v: Any) -> float:
    """A value for ordering: NaN and the missing last."""
    if isinstance(v, int | float) and not math.isnan(v):
        return float(v)
    return math.inf


def ranked(spec: SweepSpecPublic, trials: list[TrialPublic]) -> list[TrialPublic]:
    """Complete trials by their value (rank 1 the best), then pruned (and paused) ones by
    how far they went and their value there, then active ones by their latest value, then
    the rest."""
    sign = 1.0 if spec.direction == "minimize" else -1.0

    def key(t: TrialPublic) -> tuple[Any, ...]:
        if t.state == "complete":
            return (0, sign * _number(t.value), t.number)
        if t.state in ("pruned", "paused"):
            return (1, -len(t.rungs), sign * _number(t.value), t.number)
        if t.state == "active":
            return (2, sign * _number(t.latest), t.number)
        return (3, t.number)

    out = sorted(trials, key=key)
    rank = 0
    for t in out:
        if t.state == "complete" and spec.metric is not None:  # no metric: no order
            rank += 1
            t.rank = rank
    return out


_STOPPED = ("complete", "pruned", "paused")  # a value and step of their own


def _counts(states: Iterable[tuple[str, int]]) -> TrialCounts:
    counts = TrialCounts()
    for state, n in states:
        if state in TrialCounts.model_fields:
            setattr(counts, state, getattr(counts, state) + n)
    return counts


def public(
    sweep: Sweep, trials: list[TrialPublic] | None, counts: TrialCounts, best: TrialPublic | None
) -> SweepPublic:
    spec = _stored(sweep)
    return SweepPublic(
        id=sweep.id,
        name=sweep.name,
        owner=sweep.owner,
        status=sweep.status,  # type: ignore[arg-type]
        reason=sweep.reason,
        spec=spec,
        seed=sweep.seed,
        created_at=sweep.created_at,
        finished_at=sweep.finished_at,
        trials_made=sweep.trials_made,
        max_trials=spec.max_trials or sweep.trials_made,
        counts=counts,
        best=best,
        trials=trials,
    )


def read(s: Session, sweep: Sweep) -> SweepPublic:
    """One sweep with every trial, ranked (in the caller's transaction)."""
    spec = _stored(sweep)
    rows = s.execute(_TRIALS.where(SweepTrial.sweep_id == sweep.id)).all()
    trials = ranked(spec, [trial_public(spec.metric, r) for r in rows])
    counts = _counts((t.state, 1) for t in trials)
    best = next((t for t in trials if t.number == sweep.best_trial), None)
    return public(sweep, trials, counts, best)


def get_sweep(db: Database, sweep_id: int) -> SweepPublic:
    with db.read() as s:
        sweep = s.get(Sweep, sweep_id)
        if sweep is None:
            raise NotFound(f"no sweep {sweep_id}")
        return read(s, sweep)


def list_sweeps(
    db: Database, statuses: list[str], owner: str | None, limit: int, cursor: int | None
) -> tuple[list[SweepPublic], str | None]:
    """Newest first, without their trials (their counts and best one); ``cursor`` is the
    id the previous page ended at."""
    q = select(Sweep).order_by(Sweep.id.desc()).limit(limit + 1)
    if statuses:
        q = q.where(Sweep.status.in_(statuses))
    if owner is not None:
        q = q.where(Sweep.owner == owner)
    if cursor is not None:
        q = q.where(Sweep.id < cursor)
    with db.read() as s:
        sweeps = list(s.scalars(q))
        more = len(sweeps) > limit
        sweeps = sweeps[:limit]
        ids = [w.id for w in sweeps]
        counted: dict[int, list[tuple[str, int]]] = {}
        for sweep_id, state, n in s.execute(
            select(SweepTrial.sweep_id, SweepTrial.state, func.count())
            .where(SweepTrial.sweep_id.in_(ids))
            .group_by(SweepTrial.sweep_id, SweepTrial.state)
        ):
            counted.setdefault(sweep_id, []).append((state, n))
        wanted = [(w.id, w.best_trial) for w in sweeps if w.best_trial is not None]
        bests: dict[int, TrialPublic] = {}
        metrics = {w.id: _stored(w).metric for w in sweeps}
        for sweep_id, number in wanted:
            row = s.execute(
                _TRIALS.where(SweepTrial.sweep_id == sweep_id, SweepTrial.number == number)
            ).first()
            if row is not None:
                bests[sweep_id] = trial_public(metrics[sweep_id], row)
                bests[sweep_id].rank = 1
        items = [public(w, None, _counts(counted.get(w.id, [])), bests.get(w.id)) for w in sweeps]
    return items, (str(sweeps[-1].id) if more and sweeps else None)


# ---- export -------------------------------------------------------------------------


def _cell(v: Any) -> Any:
    """A CSV cell: text a spreadsheet would run as a formula (=, +, -, @) is quoted with a
    leading apostrophe; numbers stay numbers."""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return "" if v is None else v


def export(db: Database, sweep_id: int, fmt: str) -> tuple[bytes, str]:
    """The sweep's trials, ranked, one row each: as CSV (a column per parameter) or
    JSON; the body and its media type."""
    sweep = get_sweep(db, sweep_id)
    spec = sweep.spec
    names = sorted({n for t in sweep.trials or [] for n in t.params} | set(spec.space))
    fixed = ("rank", "trial", "job", "state", "status", "step", "reason")
    metric = spec.metric or "value"  # an array has none: the column stays empty
    column = metric if metric not in fixed and "." not in metric else "value"
    rows = [
        {
            "rank": t.rank,
            "trial": t.number,
            "job": t.job_id,
            "state": t.state,
            "status": t.status,
            column: t.value if t.state in _STOPPED else t.latest,
            "step": t.step if t.state in _STOPPED else t.latest_step,
            **{f"param.{n}": t.params.get(n) for n in names},
            "reason": t.reason,
        }
        for t in sweep.trials or []
    ]
    if fmt == "json":
        body = {
            "sweep": sweep.id,
            "metric": spec.metric,
            "direction": spec.direction,
            "best": sweep.best.number if sweep.best else None,
            "items": rows,
        }
        return json.dumps(body, indent=2).encode(), "application/json"
    out = io.StringIO()
    header = ["rank", "trial", "job", "state", "status", column, "step"]
    header += [f"param.{n}" for n in names] + ["reason"]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([_cell(h) for h in header])
    for r in rows:
        writer.writerow([_cell(r[h]) for h in header])
    return out.getvalue().encode(), "text/csv; charset=utf-8"
