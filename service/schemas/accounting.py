"""Accounting (GET /accounting): what each job or attempt held, and for how long, over a
window (service.accounting decides what is counted)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel


class AccountingRow(BaseModel):
    """One job (``per=job``) or one attempt (``per=attempt``). Times held are counted
    inside the window only, so the rows of consecutive windows add up."""

    job_id: int
    # per=attempt: the attempt's number; per=job: None.
    attempt: int | None
    name: str | None
    user: str | None
    # per=job: the job's status; per=attempt: how the attempt stands or ended (outcome).
    state: str
    reason: str | None
    exit_code: int | None
    device: str
    world_size: int
    # The workers its attempts ran on in the window (per=attempt: that attempt's one).
    workers: list[str]
    sweep: int | None
    created_at: datetime
    # per=job: its first attempt's start, and when it ended; per=attempt: the attempt's.
    started_at: datetime | None
    finished_at: datetime | None
    # per=job: seconds from its submit to its first start (to the window's end, or its
    # end, if it never started); per=attempt: None.
    queued_s: float | None
    # Seconds its attempts ran inside the window, and what they held for that time.
    elapsed_s: float
    gpu_hours: float
    cpu_slot_hours: float
    # per=job: its attempts (all of them), and how many of them were preempted.
    attempts: int
    preemptions: int


class AccountingTotal(BaseModel):
    """A user's totals over every row the query matched (not only this page); ``user``
    null: everyone's."""

    user: str | None
    jobs: int
    attempts: int
    elapsed_s: float
    gpu_hours: float
    cpu_slot_hours: float
    preemptions: int


class AccountingPublic(BaseModel):
    since: datetime
    until: datetime
    per: Literal["job", "attempt"]
    items: list[AccountingRow]
    next_cursor: str | None
    # Per user, most GPU-hours first, then everyone's last.
    totals: list[AccountingTotal]


# ---- the queue in order (GET /queue) ---------------------------------------------------


class QueuedPublic(BaseModel):
    """A queued job at its place in the order the claims try them."""

    position: int
    job_id: int
    name: str | None
    user: str | None
    priority: int
    device: str
    world_size: int
    nnodes: int
    queued_at: datetime
    # Its owner's recent usage (GPU-equivalent seconds, decayed), which orders jobs of
    # one priority: the least used owner's first.
    usage_gpu_s: float
    # Why it is ahead of the next job in the order (its priority, its owner's usage, or
    # its submission); None for the last.
    placed: str | None
    # What it waits for, as its job's reason says.
    reason: str
    # When the claims would start it if every job ran to its time limit (service.queue.
    # plan), or None; ``estimate`` says where, or why there is no estimate.
    estimated_start: datetime | None
    estimate: str


class SchedulingPublic(BaseModel):
    """The settings that shape the order, shown as they are (the server's settings)."""

    preemption: str
    fairshare_half_life_s: float
    cpu_slot_weight: float
    starvation_s: float
    preempt_min_run_s: float


class QueuePublic(BaseModel):
    items: list[QueuedPublic]
    # Queued jobs in all (of the user asked for); the page starts at ``offset``.
    total: int
    offset: int
    scheduling: SchedulingPublic
