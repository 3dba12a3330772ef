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


def _history(db: Database, rnd: random.Random, now: datetime) -> None:
    """Jobs over the last 62 hours, their attempts back to back, each a few seconds to
    a day long; the last of some still running, some jobs still queued."""
    base = now - timedelta(hours=62)
    with db.write() as s:
        for n in range(90):
            owner = rnd.choice(["alice", "bob", "carol", None])
            device = rnd.choice(["cpu", "cuda"])
            nproc, nnodes = rnd.randint(1, 4), rnd.choice([1, 1, 2])
            made = base + timedelta(seconds=rnd.uniform(0, 61.5 * 3600))
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


def _check(db: Database, rnd: random.Random, now: datetime, stage: str) -> None:
    for since, until in _windows(rnd, now):
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


def test_a_window_s_whole_hours_are_read_as_days_and_at_most_half_a_day_an_end() -> None:
    """rollup._spans: its days' hours, plus the hours it adds, less those it takes off,
    are exactly the window's whole hours, for every pair of hours over three days; and
    no range of hours it reads is longer than half a day."""
    base = datetime(2026, 11, 1, tzinfo=UTC)
    hours = [base + timedelta(hours=n) for n in range(72)]
    for i, a in enumerate(hours):
        for b in hours[i + 1 :]:
            days, spans = rollup._spans(a, b)
            count: dict[datetime, int] = defaultdict(int)
            if days is not None:
                assert days[0] == days[0].replace(hour=0) and days[1] == days[1].replace(hour=0)
                h = days[0]
                while h < days[1]:
                    count[h] += 1
                    h += timedelta(hours=1)
            for lo, hi, sign in spans:
                assert lo < hi <= lo + rollup.HALF_DAY, (a, b, lo, hi)
                h = lo
                while h < hi:
                    count[h] += sign
                    h += timedelta(hours=1)
            assert {h for h, n in count.items() if n} == {h for h in hours if a <= h < b}
            assert all(n in (0, 1) for n in count.values()), (a, b)
