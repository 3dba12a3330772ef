"""Storing what ranks report: ``POST /jobs/{id}/metrics``'s points into metric_points,
and the job row's latest values, total steps and dropped count.

A batch of 1000 items (what ddpq.train sends) is thousands of rows, so nothing here
goes through the ORM per row: the body's JSON is read straight into columns
(parse_points; a body it does not fully recognise is validated by MetricsIn, which
gives every 422), and the rows go to the database in one statement (Postgres: arrays
through unnest) or the driver's executemany (SQLite). Reading them back, whole or
downsampled, is service.metrics.
"""

from __future__ import annotations

import math
import operator
from datetime import datetime
from typing import Any, cast

from pydantic_core import from_json
from sqlalchemy import Table
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from service.db import Database
from service.jobs import current_job
from service.models import Attempt, MetricPoint, utcnow
from service.schemas import (
    MAX_METRIC_ITEMS,
    MAX_METRIC_NAMES,
    MAX_NAME_CHARS,
    MetricItemIn,
    MetricsIn,
    MetricValueIn,
    metric_in,
    metric_out,
)

_POINTS = cast(Table, MetricPoint.__table__)
_POINT_COLUMNS = ("job_id", "name", "step", "value", "epoch", "attempt", "time", "seq")
_points_upsert: dict[str, tuple[str, tuple[str, ...]]] = {}


def _points_upsert_sql(dialect: Dialect) -> tuple[str, tuple[str, ...]]:
    """The upsert of metric points as SQLite's driver takes it, compiled once, and the
    order of its positional parameters.

    A batch of 1000 items is thousands of rows: through SQLAlchemy's per-row
    parameter processing they cost several times SQLite's own work, so they go to
    the driver's executemany as plain values (see _upsert_points)."""
    cached = _points_upsert.get(dialect.name)
    if cached is None:
        insert = sqlite_insert(_POINTS)
        stmt = insert.on_conflict_do_update(
            index_elements=["job_id", "name", "step"],
            set_={
                "value": insert.excluded.value,
                "epoch": insert.excluded.epoch,
                "attempt": insert.excluded.attempt,
                "time": insert.excluded.time,
                "seq": insert.excluded.seq,
            },
            where=_POINTS.c.attempt <= insert.excluded.attempt,
        )
        compiled = stmt.compile(dialect=dialect, column_keys=list(_POINT_COLUMNS))
        order = tuple(compiled.positiontup or ())
        if set(order) != set(_POINT_COLUMNS):
            raise RuntimeError(f"unexpected parameters in the points upsert: {compiled.binds}")
        cached = _points_upsert.setdefault(dialect.name, (compiled.string, order))
    return cached


# Postgres: one statement over arrays (executemany would be a round trip per row). The
# arrays go as array literals the server parses (_pg_array): psycopg's list adapter
# dumps element by element in Python, 4.6 ms of a batch of 1000 items against 1.7 ms.
# Two shapes: ON CONFLICT's speculative insertion cost Postgres 3.5-4 of its ~17 ms of
# CPU for 2000 fresh rows (EXPLAIN ANALYZE and per-backend CPU, docs/benchmarks.md), so a
# batch that cannot meet a stored point (_PG_FRESH says so) goes in as a plain INSERT.
_PG_POINTS_INSERT = """
INSERT INTO metric_points (job_id, name, step, value, epoch, attempt, time, seq)
SELECT %(job_id)s, n, s, v, e, %(attempt)s, %(time)s, %(seq)s
FROM unnest(%(names)s::text::varchar[], %(steps)s::text::bigint[],
            %(values)s::text::float8[], %(epochs)s::text::float8[])
    AS t(n, s, v, e)
"""
_PG_POINTS_UPSERT = (
    _PG_POINTS_INSERT
    + """ON CONFLICT (job_id, name, step) DO UPDATE SET
    value = excluded.value, epoch = excluded.epoch, attempt = excluded.attempt,
    time = excluded.time, seq = excluded.seq
WHERE metric_points.attempt <= excluded.attempt
"""
)
# Whether every series of the batch starts past its last stored step (one probe of the
# primary key per name): then no point of the batch is stored yet. The job's row is
# locked (jobs.current_job) and only ingest inserts points, so none can appear before
# the INSERT.
_PG_FRESH = """
SELECT coalesce(bool_and(coalesce(
    (SELECT max(m.step) FROM metric_points m WHERE m.job_id = %(job_id)s AND m.name = u.n),
    -1) < u.s), true)
FROM unnest(%(names)s::text::varchar[], %(steps)s::text::bigint[]) AS u(n, s)
"""


def _pg_quoted(name: str) -> str:
    """A string as an element of a Postgres array literal: quoted, with its quote and
    backslash escaped (names are printable and hold no NUL: MetricName)."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pg_names(names: list[str]) -> str:
    """A Postgres array literal of strings (a batch repeats a few names: each is
    quoted once)."""
    quoted = {n: _pg_quoted(n) for n in set(names)}
    return "{" + ",".join(map(quoted.__getitem__, names)) + "}"


def _pg_numbers(numbers: list[int] | list[float] | list[float | None]) -> str:
    """A Postgres array literal of numbers: repr round-trips a float (str an int), and
    float8 reads its nan, inf and -inf."""
    if None in numbers:
        return "{" + ",".join("NULL" if x is None else repr(x) for x in numbers) + "}"
    return "{" + ",".join(map(repr, numbers)) + "}"


class Points:
    """What one request reports, ready to store: the points as columns (one row per
    (name, step), the batch's last report of it), plus what the job's row keeps.

    Built either straight from the body's JSON (parse_points) or from a validated
    MetricsIn (points_of); both give the same for the same body."""

    __slots__ = ("dropped", "epochs", "firsts", "last", "names", "steps", "total", "values")

    def __init__(self, dropped: int, total: int | None) -> None:
        self.dropped = dropped
        self.total = total  # the last total_steps sent, if any
        self.names: list[str] = []
        self.steps: list[int] = []
        self.values: list[float] = []
        self.epochs: list[float | None] = []
        # Each series' first (lowest) step in the batch.
        self.firsts: dict[str, int] = {}
        # The newest step with values: (step, epoch, {name: value} of that step).
        self.last: tuple[int, float | None, dict[str, float]] | None = None


def points_of(body: MetricsIn) -> Points:
    """A validated body's points."""
    rows: dict[tuple[str, int], tuple[str, int, float, float | None]] = {}
    total: int | None = None
    series: list[tuple[MetricItemIn, dict[str, MetricValueIn]]] = []  # items with values
    for item in body.items:
        item_total, values = total_and_values(item)
        if item_total is not None:
            total = item_total
        if not values:
            continue
        series.append((item, values))
        epoch = metric_in(item.epoch) if item.epoch is not None else None
        for name, value in values.items():
            rows[(name, item.step)] = (name, item.step, metric_in(value), epoch)
    points = Points(body.dropped, total)
    for name, step, value, epoch in rows.values():
        points.names.append(name)
        points.steps.append(step)
        points.values.append(value)
        points.epochs.append(epoch)
        first = points.firsts.get(name)
        if first is None or step < first:
            points.firsts[name] = step
    if series:
        last = max((item for item, _ in series), key=lambda i: i.step)
        latest = {
            name: metric_in(v)
            for item, values in series
            if item.step == last.step
            for name, v in values.items()
        }
        points.last = (last.step, metric_in(last.epoch) if last.epoch is not None else None, latest)
    return points


_BODY_KEYS = frozenset(("items", "dropped"))
_ITEM_KEYS = frozenset(("step", "epoch", "total_steps", "values"))
_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_EXACT_INT = 2**63  # an int value below this in magnitude converts to float as pydantic's does
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(v: Any) -> float | None:
    """A metric value as MetricValueIn takes it, or None where it might not."""
    kind = type(v)
    if kind is float:
        return v if math.isfinite(v) else None
    if kind is int and -_EXACT_INT < v < _EXACT_INT:
        return float(v)
    if kind is str:
        return _NON_FINITE.get(v)
    return None


def parse_points(raw: bytes) -> Points | None:
    """The points of a body in the shape ddpq.train sends, read from its JSON without a
    model per item; None for anything else, which MetricsIn then validates (and refuses
    with its errors). What this accepts MetricsIn accepts too, with the same values:
    the same JSON parser (pydantic_core's: a duplicate key keeps its last value, as
    model_validate_json does), and checks as strict as the models' or stricter (steps
    must rise from item to item, so no point repeats; no total_steps among the values).

    A batch of 1000 items as models cost the API about 4,000 objects for the garbage
    collector, which took more CPU than validating them (docs/benchmarks.md)."""
    try:
        doc = from_json(raw, allow_inf_nan=False)
    except ValueError:
        return None
    if type(doc) is not dict or not doc.keys() <= _BODY_KEYS:
        return None
    items = doc.get("items", [])
    dropped = doc.get("dropped", 0)
    if type(items) is not list or len(items) > MAX_METRIC_ITEMS:
        return None
    if type(dropped) is not int or not 0 <= dropped <= _INT32_MAX or not (items or dropped):
        return None
    points = Points(dropped, None)
    names, steps, values, epochs = points.names, points.steps, points.values, points.epochs
    firsts = points.firsts
    previous = -1
    last: dict[str, float] | None = None
    for item in items:
        if type(item) is not dict or not item.keys() <= _ITEM_KEYS:
            return None
        step = item.get("step")
        if type(step) is not int or not previous < step <= _INT64_MAX:
            return None
        previous = step
        total = item.get("total_steps")
        if total is not None:
            if type(total) is not int or not 1 <= total <= _INT64_MAX:
                return None
            points.total = total
        reported = item.get("values", {})
        if type(reported) is not dict or len(reported) > MAX_METRIC_NAMES:
            return None
        if not reported:
            if total is None:
                return None
            continue
        epoch = item.get("epoch")
        if epoch is not None:
            epoch = _number(epoch)
            if epoch is None:
                return None
        last = {}
        for name, value in reported.items():
            if name not in firsts:
                if (
                    type(name) is not str
                    or not 0 < len(name) <= MAX_NAME_CHARS
                    or not name.isprintable()
                    or name == TOTAL_STEPS
                ):
                    return None
                firsts[name] = step
            number = _number(value)
            if number is None:
                return None
            names.append(name)
            steps.append(step)
            values.append(number)
            epochs.append(epoch)
            last[name] = number
        points.last = (step, epoch, last)
    return points


def _upsert_points(s: Session, attempt: Attempt, now: datetime, seq: int, points: Points) -> None:
    conn = s.connection()
    dialect = conn.dialect
    if dialect.name == "postgresql":
        names = _pg_names(points.names)
        key = {"job_id": attempt.job_id}
        fresh = conn.exec_driver_sql(
            _PG_FRESH,
            {
                **key,
                "names": _pg_names(list(points.firsts)),
                "steps": _pg_numbers(list(points.firsts.values())),
            },
        ).scalar()
        conn.exec_driver_sql(
            _PG_POINTS_INSERT if fresh else _PG_POINTS_UPSERT,
            {
                **key,
                "attempt": attempt.number,
                "time": now,
                "seq": seq,
                "names": names,
                "steps": _pg_numbers(points.steps),
                "values": _pg_numbers(points.values),
                "epochs": _pg_numbers(points.epochs),
            },
        )
        return
    sql, order = _points_upsert_sql(dialect)
    # The one column that needs converting (the timestamp, a string on SQLite) is the
    # same in every row: converted once. The rest are str, int, float and None.
    stamp = _POINTS.c.time.type.dialect_impl(dialect).bind_processor(dialect)
    stamped = stamp(now) if stamp else now
    job_id, number = attempt.job_id, attempt.number
    full = [
        (job_id, name, step, value, epoch, number, stamped, seq)
        for name, step, value, epoch in zip(
            points.names, points.steps, points.values, points.epochs, strict=True
        )
    ]
    params: list[Any] = full
    if order != _POINT_COLUMNS:
        pick = operator.itemgetter(*(_POINT_COLUMNS.index(k) for k in order))
        params = [pick(row) for row in full]
    conn.exec_driver_sql(sql, params)


# What an older ddpq.train sent the total under, among the values.
TOTAL_STEPS = "total_steps"


def total_and_values(item: MetricItemIn) -> tuple[int | None, dict[str, MetricValueIn]]:
    """The job's total_steps an item carries, and its metric values without it.

    The one place that decides what ``total_steps`` among the values means: the
    run's length, sent by an older ddpq.train, never a series. It is taken as the
    job's total when it is a number from 1 up (its whole part: 128.0 is 128);
    anything else is ignored. The item's own total_steps field wins over it.
    (parse_points leaves a body with it to MetricsIn and this.)"""
    values = item.values
    if TOTAL_STEPS not in values:
        return item.total_steps, values
    values = {k: v for k, v in values.items() if k != TOTAL_STEPS}
    total = item.total_steps
    if total is None:
        legacy = metric_in(item.values[TOTAL_STEPS])
        if math.isfinite(legacy) and 1 <= legacy < 2**63:
            total = int(legacy)
    return total, values


def store_points(db: Database, attempt: Attempt, points: Points) -> int:
    """Store metric points; a step reported again keeps the newest attempt's value.
    Points the sender says it dropped are counted on the job; the last total_steps
    sent becomes the job's."""
    now = utcnow()
    with db.write() as s:
        # Locked before the check (jobs.current_job); latest_metrics is read-modify-write.
        job = current_job(s, attempt)
        if points.dropped:
            job.metrics_dropped = (job.metrics_dropped or 0) + points.dropped
        total = points.total
        if total is not None and job.total_steps != total:
            job.total_steps = total
        if not points.names or points.last is None:
            return 0
        # Number the batch on the locked row (read by current_job), so batches commit in
        # seq order: the events stream's cursor never skips one. The job's changes go in
        # one UPDATE when the session flushes at the commit.
        seq = (job.metrics_seq or 0) + 1
        job.metrics_seq = seq
        _upsert_points(s, attempt, now, seq, points)
        step, epoch, values = points.last
        latest_values = {name: metric_out(v) for name, v in values.items()}
        latest = job.latest_metrics
        if latest is None or step > latest["step"]:
            # Each series keeps its latest value: a step that reports only val_* values
            # leaves the job's latest loss in place (else `ddpq ls` showed no LOSS).
            job.latest_metrics = {
                "step": step,
                "epoch": metric_out(epoch) if epoch is not None else None,
                "values": _kept(latest["values"] if latest else {}, latest_values),
            }
        elif step == latest["step"]:
            job.latest_metrics = {**latest, "values": _kept(latest["values"], latest_values)}
    return len(points.names)


def _kept(older: dict[str, Any], newest: dict[str, Any]) -> dict[str, Any]:
    """The latest value of each series, the newest step's first: at most
    MAX_METRIC_NAMES, those reported longest ago dropped first (a program that names
    a new series at every step does not grow the job's row without bound)."""
    kept = {**older, **newest}
    over = max(0, len(kept) - MAX_METRIC_NAMES)
    drop = [name for name in older if name not in newest][:over]
    for name in drop:
        del kept[name]
    return kept
