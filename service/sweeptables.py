"""The sweeps' tables (service.sweeps owns what is written to them), on service.models'
Base: a module of their own because service/models.py is near the line limit. Whatever
reads Base.metadata whole (the migrations' environment, tests/test_schema.py) imports
this module too."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.models import Base, BigId, utcnow


class Sweep(Base):
    """A search over one job's parameters (service.sweeps): its spec as submitted (the
    base job, the space, the method, the metric, the limits, early stopping), where it
    stands, and its best trial once it has one. Its trials are sweep_trials rows."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str | None] = mapped_column(String(200))
    owner: Mapped[str] = mapped_column(String(64))
    # running (it makes and decides trials), done (every trial ended), cancelled.
    status: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]]
    # The sampler's seed (the spec's, or one drawn at the submit): each trial's draw is
    # seeded from it and the trial's number, so the same history asks the same.
    seed: Mapped[int] = mapped_column(BigInteger)
    # Trials made so far: the next one's number (its row may be gone with a purged job's).
    trials_made: Mapped[int] = mapped_column(Integer, default=0)
    # Moved on by every change of the sweep or its trials: a round decided on what it
    # read writes only while this is still what it read (service.sweeps).
    version: Mapped[int] = mapped_column(BigInteger, default=0)
    # Why it waits (a quota), how it ended, in words.
    reason: Mapped[str | None] = mapped_column(Text)
    best_trial: Mapped[int | None] = mapped_column(Integer)
    best_value: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    __table_args__ = (
        # The sweeper's look for running sweeps, every round: a range of the index.
        Index("ix_sweeps_status", "status"),
        Index("ix_sweeps_owner_id", "owner", "id"),
    )


class SweepTrial(Base):
    """One trial of a sweep: an ordinary job of the sweep's owner with the parameters
    chosen for it, and what the sweep recorded of it (its rungs, how it ended)."""

    __tablename__ = "sweep_trials"

    sweep_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0, 1, ... as Optuna's
    # Its job; NULL once the job was purged (service.retention): the row keeps the record.
    job_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("jobs.id", ondelete="SET NULL")
    )
    # Every parameter its program gets (the fixed ones too).
    params: Mapped[dict[str, Any]]
    # active (its job waits or runs), complete (it ended with a value of the metric),
    # pruned (early stopping stopped it), failed (it ended without a value), cancelled.
    state: Mapped[str] = mapped_column(String(16))
    # The metric's last value (complete), or at the rung it was pruned at; its step.
    value: Mapped[float | None] = mapped_column(Float)
    step: Mapped[int | None] = mapped_column(BigInteger)
    # [[step, value], ...]: the metric at each rung it reached, as the pruner was told it
    # (the first point at or after the rung's step; null for NaN).
    rungs: Mapped[list[Any]] = mapped_column(JSON, default=list)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_sweep_trials_job_id", "job_id", unique=True),)
