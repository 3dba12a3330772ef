"""Accounting's rollup (service.rollup) gives every window exactly the totals the rows
themselves give, on both databases: random histories over three days (short and
day-long attempts, running ones, preempted ones, jobs queued for hours, jobs of no one),
partly rolled, then rolled whole, against many random windows (inside one hour, on the
hour, across hours and days) and against service.accounting's own sums of the rows."""

from __future__ import annotations

import random
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from service import accounting, rollup
from service.db import Database
from service.models import Attempt, Job, utcnow
from service.queue.shares import held
from service.rolluptables import UsageHour

ROUNDS = 3  # histories per database
WINDOWS = 40  # windows asked of each, at each stage of its rolling


def _history(db: Database, rnd: random.Random, now: datetime, hours: int = 62) -> None:
    """Jobs over the last ``hours``, their attempts back to back, each a few seconds to
    a day long; the last of some still running, some jobs still queued."""
    base = now - timedelta(hours=hours)
    with db.write() as s:
        for n in range(90):
            owner = rnd.choice(["alice", "bob", "carol", None])
            device = rnd.choice(["cpu", "cuda"])
            nproc, nnodes = rnd.randint(1, 4), rnd.choice([1, 1, 2])
            made = base + timedelta(seconds=rnd.uniform(0, (hours - 0.5) * 3600))
            job = Job(
                name=f"j{n}", status="succeeded", spec={}, nproc_per_node=nproc, nnodes=nnodes,
                device=device, max_attempts=3, created_at=made, owner=owner,
            )  # fmt: skip
            s.add(job)
            s.flush()
            at = made + timedelta(seconds=rnd.choice([0, 5, 600, 5000]) * rnd.random())
            ended: datetime | None = None
            for number in range(1, rnd.randint(0, 3) + 1):
                if at >= now:
                    break
                long = rnd.choice([3, 90, 2000, 7200, 30000, 90000])
                end: datetime | None = at + timedelta(seconds=rnd.uniform(0, long))
                assert end is not None
                if end >= now or rnd.random() < 0.05:
                    end = None  # still running
                gpus = list(range(nproc)) if device == "cuda" and rnd.random() < 0.7 else []
                s.add(
                    Attempt(
                        job_id=job.id, number=number, worker=rnd.choice(["w1", "w2"]),
                        token_hash=uuid.uuid4().hex, gpus=gpus, checkpoint_dir="/c",
                        started_at=at, ended_at=end, outcome="exited",
                        reason=rnd.choice([None, "preempted by job 3 (bob, priority 5)"]),
                    )
                )  # fmt: skip
                ended = end
                if end is None:
                    break
                at = end + timedelta(seconds=rnd.uniform(0, 900))
            if ended is None and rnd.random() < 0.5:
                job.status = "running" if rnd.random() < 0.5 else "queued"
            else:
                job.finished_at = max(ended or made, made) + timedelta(seconds=rnd.uniform(0, 60))
                if job.finished_at >= now:
                    job.finished_at = None
                    job.status = "queued"


def _expected(db: Database, since: datetime, until: datetime) -> dict[str, rollup.Figures]:
    """The totals by the definition, from every row, in Python."""
    per: dict[str, rollup.Figures] = defaultdict(rollup.Figures)
    with db.read() as s:
        for job in s.scalars(select(Job)):
            if job.created_at < until and (job.finished_at is None or job.finished_at > since):
                per[job.owner or rollup.NO_ONE].jobs += 1
        rows = s.execute(select(Attempt, Job).join(Job, Job.id == Attempt.job_id)).all()
        for a, job in rows:
            if a.started_at < until and (a.ended_at is None or a.ended_at > since):
                g, c = held(job.device, a.gpus, job.nproc_per_node, job.nnodes)
                preempted = int((a.reason or "").startswith("preempted by"))
                r = rollup.Ran(a.started_at, a.ended_at, job.owner or rollup.NO_ONE, g, c, 0)
                f = per[r.owner]
                f.ran(r, since, until)
                f.attempts += 1
                f.preempted += preempted
    return per


def _same(got: dict[str, rollup.Figures], want: dict[str, rollup.Figures], what: str) -> None:
    for owner in set(got) | set(want):
        g, w = got.get(owner, rollup.Figures()), want.get(owner, rollup.Figures())
        assert (g.jobs, g.attempts, g.preempted) == (w.jobs, w.attempts, w.preempted), (
            what, owner, g, w
        )  # fmt: skip
        for key in ("seconds", "gpu_s", "cpu_s"):
            assert getattr(g, key) == pytest.approx(getattr(w, key), abs=1e-4), (what, owner, key)


def _windows(rnd: random.Random, now: datetime) -> list[tuple[datetime, datetime]]:
    hour = rollup.floor_hour(now)
    day = hour.replace(hour=0)
    out = [(now - timedelta(hours=70), now), (hour - timedelta(hours=5), hour)]
    out += [(day - timedelta(days=1), day), (day - timedelta(days=1, hours=3), now)]
    # A day's hours more than half of it are read as its day's row less its other hours
    # (rollup._spans): inside one day, and at both ends of whole days.
    d, s = day - timedelta(days=1), timedelta(seconds=10)
    out += [(d + timedelta(hours=2) + s, d + timedelta(hours=22) + s)]
    out += [(d - timedelta(hours=20) + s, d + timedelta(hours=19) + s)]
    out += [(d - timedelta(hours=5) + s, d + timedelta(hours=3) + s)]
    for _ in range(WINDOWS):
        since = now - timedelta(seconds=rnd.uniform(0, 63 * 3600))
        if rnd.random() < 0.25:
            since = rollup.floor_hour(since)  # on the hour
        span = rnd.choice([30, 1800, 3500, 3 * 3600, 20 * 3600, 30 * 3600, 60 * 3600])
        until = min(now, since + timedelta(seconds=rnd.uniform(1, span)))
        if rnd.random() < 0.2 and rollup.floor_hour(until) > since:
            until = rollup.floor_hour(until)
        out.append((since, until))
    return out


def _check(
    db: Database, rnd: random.Random, now: datetime, stage: str, windows: list[Any] | None = None
) -> None:
    for since, until in windows or _windows(rnd, now):
        want = _expected(db, since, until)
        with db.read() as s:
            rollup.snapshot(s)
            got = rollup.totals(s, since, until, None)
            bob = rollup.totals(s, since, until, "bob")
            q = accounting.Query(since=since, until=until)
            summed = accounting._counted(s, db.dialect, q, {"since": since, "end": until})
        _same(got, want, f"{stage} {since}..{until}")
        _same(bob, {"bob": want["bob"]} if "bob" in want else {}, f"{stage} bob")
        by_sql = {owner or rollup.NO_ONE: f for owner, f in summed.items()}
        _same(by_sql, want, f"{stage} sql {since}..{until}")


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_window_s_totals_from_the_rollup_equal_the_rows_own(db: Database, round_: int) -> None:
    rnd = random.Random(round_)
    now = utcnow()
    _history(db, rnd, now)
    _check(db, rnd, now, "none rolled")
    assert rollup.roll(db, batch=17) > 0  # a few batches: partly rolled
    _check(db, rnd, now, "partly rolled")
    while rollup.roll(db, budget_s=0.0, batch=500):
        pass
    with db.read() as s:
        left = s.scalar(
            select(func.count()).where(Attempt.rolled.is_(False), Attempt.ended_at.is_not(None))
        )
        assert left == 0
        assert s.scalar(select(func.count()).select_from(UsageHour)) > 20
    _check(db, rnd, now, "all rolled")
    # A roll that finds nothing new changes nothing.
    assert rollup.roll(db) == 0


def test_a_long_window_s_totals_from_months_days_and_hours_equal_the_rows_own(
    db: Database,
) -> None:
    """Over 80 days: windows of days to months, read as months' rows less or plus days
    and hours at each end (rollup._spans), give the rows' own totals."""
    rnd = random.Random(11)
    now = utcnow()
    _history(db, rnd, now, hours=80 * 24)
    while rollup.roll(db, budget_s=0.0, batch=500):
        pass
    windows = [(now - timedelta(days=d), now) for d in (17, 45, 79)]
    for _ in range(12):
        since = now - timedelta(seconds=rnd.uniform(0, 80 * 86400))
        windows.append((since, min(now, since + timedelta(days=rnd.uniform(1, 80)))))
    _check(db, rnd, now, "months", windows)


def test_the_rollup_adds_an_attempt_to_each_hour_it_ran_in(db: Database) -> None:
    h = rollup.floor_hour(utcnow()) - timedelta(hours=10)
    with db.write() as s:
        job = Job(
            name="x", status="succeeded", spec={}, nproc_per_node=2, nnodes=1, device="cpu",
            max_attempts=1, created_at=h + timedelta(minutes=10), owner="alice",
            finished_at=h + timedelta(hours=2, minutes=31),
        )  # fmt: skip
        s.add(job)
        s.flush()
        s.add(
            Attempt(
                job_id=job.id, number=1, worker="w", token_hash="t", gpus=[], checkpoint_dir="/c",
                started_at=h + timedelta(minutes=30), ended_at=h + timedelta(hours=2, minutes=30),
                outcome="exited",
            )
        )  # fmt: skip
    assert rollup.roll(db) == 2
    with db.read() as s:
        rows: dict[Any, UsageHour] = {r.hour: r for r in s.scalars(select(UsageHour))}
    assert sorted(rows) == [h, h + timedelta(hours=1), h + timedelta(hours=2)]
    first, middle, last = (rows[k] for k in sorted(rows))
    assert (first.seconds, first.cpu_s, first.started, first.jobs_made) == (1800, 3600, 1, 1)
    assert (middle.seconds, middle.alive, middle.alive_cpus, middle.jobs_alive) == (3600, 1, 2, 1)
    assert (last.seconds, last.alive, last.jobs_alive, last.started) == (1800, 1, 1, 0)


def _count(spans: list[Any]) -> dict[datetime, int]:
    """How many times each hour is added, less taken off, by ``spans`` (rollup._spans)."""
    count: dict[datetime, int] = defaultdict(int)
    for level, lo, hi, sign in spans:
        assert lo < hi
        if level == 0:
            assert hi <= lo + timedelta(hours=12), ("hours", lo, hi)
        if level == 1:
            assert lo == lo.replace(hour=0) and hi == hi.replace(hour=0)
            assert hi <= lo + timedelta(days=31), ("days", lo, hi)
        if level == 2:
            assert lo.day == 1 and lo.hour == 0 and hi.day == 1 and hi.hour == 0
        h = lo
        while h < hi:
            count[h] += sign
            h += timedelta(hours=1)
    return count


def test_a_window_s_whole_hours_are_read_as_days_and_at_most_half_a_day_an_end() -> None:
    """rollup._spans: its days' hours, plus the hours it adds, less those it takes off,
    are exactly the window's whole hours, for every pair of hours over three days; and
    no range of hours it reads is longer than half a day."""
    base = datetime(2026, 11, 1, tzinfo=UTC)
    hours = [base + timedelta(hours=n) for n in range(72)]
    for i, a in enumerate(hours):
        for b in hours[i + 1 :]:
            count = _count(rollup._spans(a, b))
            assert {h for h, n in count.items() if n} == {h for h in hours if a <= h < b}
            assert all(n in (0, 1) for n in count.values()), (a, b)


def test_a_long_window_is_read_as_months_and_at_most_half_a_month_of_days_an_end() -> None:
    """Likewise over months of 28 to 31 days: random pairs of hours from January to May,
    and the year; a year of whole months reads no day's row."""
    rnd = random.Random(7)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    n = (datetime(2026, 5, 10, tzinfo=UTC) - base) // timedelta(hours=1)
    pairs = [tuple(sorted(rnd.sample(range(n), 2))) for _ in range(300)]
    pairs += [(0, 31 * 24), (24 * 20, 24 * 40), (5, n - 5), (24 * 31 - 1, 24 * 59 + 1)]
    for i, j in pairs:
        a, b = base + timedelta(hours=i), base + timedelta(hours=j)
        count = _count(rollup._spans(a, b))
        assert {h for h, c in count.items() if c} == {
            base + timedelta(hours=k) for k in range(i, j)
        }, (a, b)
        assert all(c in (0, 1) for c in count.values()), (a, b)
    year = rollup._spans(base, datetime(2027, 1, 1, tzinfo=UTC))
    assert year == [(2, base, datetime(2027, 1, 1, tzinfo=UTC), 1)]
