"""A job's metrics: storing what ranks report, and reading the history back, whole or
downsampled to a few points that keep its shape.

Downsampling (``max_points=N``), per metric name: the steps from the series' first to
its last are split into B equal-width buckets and each bucket keeps its lowest and its
highest point; the series' first and last points are kept too (so the final value is
always there). B = (N - 2) // 2, so a series answers with at most N points; with N < 4,
B = 1 and only the overall minimum and maximum are kept. A series of at most N points
comes back whole. NaN (stored as NULL) ranks above every number, Infinity included, so a
NaN in a bucket shows up as that bucket's highest point: a divergence is never averaged
away.

It runs in SQL (see _PICK and _PG_PICK), a million points in a fraction of a second;
then the picked points are fetched by primary key.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import BigInteger, any_, literal, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from service.db import Database
from service.errors import NotFound
from service.models import Attempt, AttemptOutcome, Job, MetricPoint
from service.schemas import (
    AttemptPublic,
    metric_out,
)

MAX_POINTS = 100_000

# Bucket i of a series holds steps lo + i*w .. lo + (i+1)*w - 1 (integer arithmetic:
# exact for every int64 step); the last one ends at hi, since its computed end could
# pass 2**63 - 1 (Postgres: bigint out of range). Each returns (step of the lowest,
# step of the highest).
#
# SQLite: per bucket, a range scan of the primary key keeps the top point each way: no
# sort of the series and no temporary table (a series' rows are contiguous: the table
# has no rowid). Postgres runs the same SQL when steps pass 2**53 (see _PG_PICK).
_PICK = """
WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i + 1 < :buckets)
SELECT
    (SELECT m.step FROM metric_points m
     WHERE m.job_id = :job_id AND m.name = :name
       AND m.step >= :lo + k.i * :w
       AND m.step <= CASE WHEN k.i = :buckets - 1 THEN :hi ELSE :lo + k.i * :w + (:w - 1) END
     ORDER BY m.value IS NULL, m.value, m.step LIMIT 1),
    (SELECT m.step FROM metric_points m
     WHERE m.job_id = :job_id AND m.name = :name
       AND m.step >= :lo + k.i * :w
       AND m.step <= CASE WHEN k.i = :buckets - 1 THEN :hi ELSE :lo + k.i * :w + (:w - 1) END
     ORDER BY m.value IS NULL DESC, m.value DESC, m.step LIMIT 1),
    (SELECT count(*) FROM metric_points m
     WHERE m.job_id = :job_id AND m.name = :name
       AND m.step >= :lo + k.i * :w
       AND m.step <= CASE WHEN k.i = :buckets - 1 THEN :hi ELSE :lo + k.i * :w + (:w - 1) END)
FROM k
"""
# Postgres: one aggregate over the series; min/max of (is NaN, value, step) float8 arrays
# carry the step along (exact below 2**53); the first element ranks NaN above Infinity.
# Both queries also count each bucket's points: the series' length, which the answer
# says (SeriesCount), at no further read of it.
# Measured on a million points: 0.2-0.4 s for 500 or
# 50,000 buckets, where the per-bucket subqueries above took 0.5 s and 6 s, and numeric
# arrays (exact for every step) 3.5 s.
_PG_PICK = """
SELECT (min(ARRAY[(value IS NULL)::int::float8, coalesce(value, 0), step::float8]))[3]::bigint,
       (max(ARRAY[(value IS NULL)::int::float8, coalesce(value, 0), step::float8]))[3]::bigint,
       count(*)
FROM metric_points
WHERE job_id = :job_id AND name = :name AND step >= :lo AND step <= :hi
GROUP BY (step - :lo) / :w
"""
EXACT_FLOAT_STEPS = 2**53


# The job's metric names, one index probe each (a skip scan) instead of a scan of every point.
_NAMES = """
WITH RECURSIVE n(name) AS (
    SELECT min(name) FROM metric_points WHERE job_id = :job_id
    UNION ALL
    SELECT (SELECT min(name) FROM metric_points WHERE job_id = :job_id AND name > n.name)
    FROM n WHERE n.name IS NOT NULL
)
SELECT name FROM n WHERE name IS NOT NULL
"""


def buckets_for(max_points: int) -> tuple[int, bool]:
    """(buckets, whether the first and last points are kept besides)."""
    if max_points < 4:
        return 1, False
    return (max_points - 2) // 2, True


def _iso(t: datetime) -> str:
    # What pydantic writes for an aware UTC datetime, so both paths answer alike.
    return t.isoformat().replace("+00:00", "Z")


def items(rows: Any) -> list[dict[str, Any]]:
    """Points ordered by (step, name) as one item per step, in the contract's shape.

    Plain dicts, not MetricItemPublic: a hundred thousand pydantic models cost seconds.
    """
    out: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    for name, step, value, epoch, attempt, time in rows:
        if last is None or last["step"] != step:
            last = {
                "step": step,
                "epoch": metric_out(epoch) if epoch is not None else None,
                "attempt": attempt,
                "time": _iso(time),
                "values": {},
            }
            out.append(last)
        last["values"][name] = metric_out(value)
        if attempt > last["attempt"]:
            last["attempt"] = attempt
    return out


def to_json(points: list[dict[str, Any]], series: dict[str, dict[str, Any]] | None = None) -> bytes:
    """The answer's body: {"items": [...], "series": {...}} (MetricsPublic's shape); the
    events stream's, without series."""
    body: dict[str, Any] = {"items": points}
    if series is not None:
        body["series"] = series
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _counted(points: dict[str, int], shown: dict[str, int]) -> dict[str, dict[str, Any]]:
    """SeriesCount of each name, as plain dicts (to_json)."""
    return {
        name: {"points": n, "shown": shown[name], "downsampled": shown[name] < n}
        for name, n in sorted(points.items())
    }


COLUMNS = (
    MetricPoint.name,
    MetricPoint.step,
    MetricPoint.value,
    MetricPoint.epoch,
    MetricPoint.attempt,
    MetricPoint.time,
)


def history(
    db: Database,
    job_id: int,
    names: list[str],
    since_step: int | None,
    max_points: int | None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The items of the answer, and each series' points held and shown (SeriesCount)."""
    names = list(dict.fromkeys(names))  # a name asked twice is answered once
    with db.read() as s:
        if s.get(Job, job_id) is None:
            raise NotFound(f"no job {job_id}")
        if max_points is None:
            q = select(*COLUMNS).where(MetricPoint.job_id == job_id)
            if names:
                q = q.where(MetricPoint.name.in_(names))
            if since_step is not None:
                q = q.where(MetricPoint.step >= since_step)
            rows = s.execute(q.order_by(MetricPoint.step, MetricPoint.name)).all()
            whole: dict[str, int] = {}
            for row in rows:
                whole[row[0]] = whole.get(row[0], 0) + 1
            return items(rows), _counted(whole, whole)
        return _downsampled(s, job_id, names, since_step or 0, max_points)


def series_names(s: Session, job_id: int) -> list[str]:
    """The job's metric names."""
    return list(s.scalars(text(_NAMES), {"job_id": job_id}))


def _downsampled(
    s: Session, job_id: int, names: list[str], since: int, max_points: int
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    if not names:
        names = series_names(s, job_id)
    pg = s.get_bind().dialect.name == "postgresql"
    rows: list[Any] = []
    held: dict[str, int] = {}
    shown: dict[str, int] = {}
    for name in names:
        picked = pick_steps(s, job_id, name, since, max_points)
        steps = picked.steps
        if steps:
            held[name], shown[name] = picked.total, len(steps)
        series = (MetricPoint.job_id == job_id, MetricPoint.name == name)
        if pg:  # one array parameter: a 5,000-item IN list costs Postgres more to plan
            wanted = literal(steps, ARRAY(BigInteger()))
            rows.extend(
                s.execute(select(*COLUMNS).where(*series, MetricPoint.step == any_(wanted)))
            )
            continue
        for i in range(0, len(steps), _FETCH_BATCH):
            batch = steps[i : i + _FETCH_BATCH]
            rows.extend(s.execute(select(*COLUMNS).where(*series, MetricPoint.step.in_(batch))))
    rows.sort(key=lambda r: (r[1], r[0]))
    return items(rows), _counted(held, shown)


_FETCH_BATCH = 5000


class Picked(NamedTuple):
    steps: list[int]  # the steps kept, ascending
    whole: bool  # every step of the series (from ``since`` on) is kept
    total: int  # the series' points from ``since`` on


def pick_steps(s: Session, job_id: int, name: str, since: int, max_points: int) -> Picked:
    """The steps of one series a downsampling to ``max_points`` keeps, whether that is
    every step (the series is no longer), and how many it has. Retention keeps the same
    (service.retention)."""
    series = (MetricPoint.job_id == job_id, MetricPoint.name == name, MetricPoint.step >= since)
    # Two index probes (min() and max() in one query scan the range on Postgres when
    # its statistics are stale).
    first = select(MetricPoint.step).where(*series).limit(1)
    lo = s.scalar(first.order_by(MetricPoint.step))
    hi = s.scalar(first.order_by(MetricPoint.step.desc()))
    if lo is None or hi is None:
        return Picked([], True, 0)
    few = select(MetricPoint.step).where(*series).order_by(MetricPoint.step).limit(max_points + 1)
    steps = list(s.scalars(few))
    if len(steps) <= max_points:
        return Picked(steps, True, len(steps))  # short enough to send whole
    buckets, ends = buckets_for(max_points)
    width = -(-(hi - lo + 1) // buckets)  # ceil: at most `buckets` buckets cover lo..hi
    params = {
        "job_id": job_id,
        "name": name,
        "lo": lo,
        "w": width,
        "hi": hi,
        "buckets": -(-(hi - lo + 1) // width),
    }
    pg = s.get_bind().dialect.name == "postgresql" and hi < EXACT_FLOAT_STEPS
    picked: set[int] = set()
    total = 0
    for low, high, count in s.execute(text(_PG_PICK if pg else _PICK), params):
        picked.update(step for step in (low, high) if step is not None)
        total += count
    if ends:
        picked |= {lo, hi}
    return Picked(sorted(picked), False, total)


def attempts(db: Database, job_id: int) -> list[AttemptPublic]:
    """Every attempt of a job, oldest first: where it ran, how long, how it ended."""
    with db.read() as s:
        if s.get(Job, job_id) is None:
            raise NotFound(f"no job {job_id}")
        rows = s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number))
        return [
            AttemptPublic(
                number=a.number,
                worker=a.worker,
                gpus=a.gpus or [],
                started_at=a.started_at,
                finished_at=a.ended_at,
                exit_code=a.exit_code,
                outcome=cast(AttemptOutcome, a.outcome),  # the column holds no other
                reason=a.reason,
                external_id=a.external_id,
            )
            for a in rows
        ]
