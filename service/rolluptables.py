"""Accounting's rollup by hour, day and month (service.rollup owns what is written to it), on
service.models' Base: a module of its own because service/models.py is at the line
limit. Whatever reads Base.metadata whole (the migrations' environment,
tests/test_schema.py) imports this module too."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Float, Index, Integer, String, false
from sqlalchemy.orm import Mapped, mapped_column

from service.models import Attempt, Base, Job


class UsageHour(Base):
    """One owner's ended attempts and jobs, added up per hour of UTC (Slurm's slurmdbd
    keeps such rollups per hour, day and month): what a window of whole hours holds is a
    sum of these rows, however many jobs ran in it. Only rows whose ``rolled`` is set are
    in it; service.rollup says how a window's edges and the rest are added."""

    __tablename__ = "usage_hours"

    hour: Mapped[datetime] = mapped_column(primary_key=True)  # its start, on the hour
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)  # "": no one's
    # Time the attempts ran inside the hour, and as GPU- and CPU-slot-seconds.
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    cpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    # Attempts running as the hour began (started before it, ended after), what they held,
    # and how many of them were handed back for another job: a window's edge inside this
    # hour is counted from these and the few attempts that started or ended in it.
    alive: Mapped[int] = mapped_column(Integer, default=0)
    alive_gpus: Mapped[int] = mapped_column(Integer, default=0)
    alive_cpus: Mapped[int] = mapped_column(Integer, default=0)
    alive_preempted: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts that started in the hour, and how many of them were handed back.
    started: Mapped[int] = mapped_column(Integer, default=0)
    started_preempted: Mapped[int] = mapped_column(Integer, default=0)
    # Jobs in ddpq's hands as the hour began (submitted before it, ended after), and jobs
    # submitted in it.
    jobs_alive: Mapped[int] = mapped_column(Integer, default=0)
    jobs_made: Mapped[int] = mapped_column(Integer, default=0)


class _Sums:
    """What adds up over a day's or a month's hours (what was running as each began does
    not: that is its first hour's row)."""

    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    cpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    started: Mapped[int] = mapped_column(Integer, default=0)
    started_preempted: Mapped[int] = mapped_column(Integer, default=0)
    jobs_made: Mapped[int] = mapped_column(Integer, default=0)


class UsageDay(_Sums, Base):
    """The same sums by day of UTC (what the hours of a day add up to): a month of many
    users is 30 rows each, not 720."""

    __tablename__ = "usage_days"

    day: Mapped[datetime] = mapped_column(primary_key=True)  # its start, at midnight UTC
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)


class UsageMonth(_Sums, Base):
    """The same sums by month of UTC (what the days of a month add up to): a year of many
    users is 12 rows each, not 365."""

    __tablename__ = "usage_months"

    month: Mapped[datetime] = mapped_column(primary_key=True)  # its first day, at midnight
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)


# What the rollup has still to add (its `rolled` unset): running attempts and active jobs,
# and those ended since its last round. Partial: a year of rolled history is not in it.
for _table, _model in (("jobs", Job), ("attempts", Attempt)):
    _due = _model.rolled == false()
    Index(f"ix_{_table}_unrolled", _model.id, postgresql_where=_due, sqlite_where=_due)
# The jobs of those a window's totals count one by one (service.rollup: queued, running,
# ended since the last round), by owner, read from the index alone: 10,000 queued jobs
# were a heap read and a sort of them on every GET /accounting, and one user's a scan
# of every job that ended in the window.
_due = Job.rolled == false()
Index(
    "ix_jobs_unrolled_owner", Job.owner, Job.created_at, Job.finished_at,
    postgresql_where=_due, sqlite_where=_due,
)  # fmt: skip
# The attempts that started in a window's edge hour (service.rollup) and a page of a
# window's attempts, newest first (service.accounting).
Index("ix_attempts_started_at", Attempt.started_at)
