"""When queued jobs will start, if every job runs to its time limit: the claim's own rules
played forward (Slurm's ``squeue --start``).

The plan is a simulation of what the claims will do, not a reservation: at each moment,
the queued jobs are gone over in the claim's order (rules.ORDER, with each owner's usage
grown by what their jobs ended in the plan held, as fair share counts it) and each one
that fits on a live worker starts there (a later job that fits starts ahead of an earlier one that
does not: backfill), except behind a job that has waited past the starvation limit on
the workers that could ever run it (claim._head's guard). A started job holds its units
until its time limit; one without a limit holds them for good, and so does what the
workers hold now beyond the running jobs the plan knows the limits of. The moments are
now and each time a job's limit frees something (or a retry's backoff runs out).

So an estimate is the time the claims would start the job if nothing else happened: a
job ending early, a new worker, a job submitted ahead of it, make it sooner or later.
What the plan does not play (multi-node jobs, Slurm bridges, quotas, dependencies) gets
no estimate, and says why.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from service.queue import rules

# Queued jobs a plan places at most (the first in order); the rest get no estimate.
MAX_PLANNED = 500
# Moments a plan plays at most: each is a pass over the jobs not placed yet.
MAX_MOMENTS = 2_000


@dataclass
class Host:
    """A live worker as the plan sees it: its totals, and what it holds until when."""

    name: str
    cpu_slots: int
    gpus: int
    free_cpu: int
    free_gpus: int
    # (when it frees them, unit, how many, whose): the running jobs whose limits are known.
    ends: list[tuple[datetime, str, int, str | None]] = field(default_factory=list)


@dataclass(frozen=True)
class Waiting:
    """A queued single-node job."""

    id: int
    owner: str | None
    priority: int
    device: str
    nproc: int
    limit_s: float | None  # its time limit; None: it holds what it takes for good
    not_before: datetime | None
    queued_at: datetime


@dataclass(frozen=True)
class Rules:
    """What orders the queue as time goes on: each owner's recent usage now (GPU-
    equivalent seconds), which grows as their jobs run, the half-life it decays with, a
    CPU slot's weight, and the starvation limit."""

    usage: dict[str, float]
    half_life_s: float
    cpu_slot_weight: float
    starvation_s: float


@dataclass
class Estimate:
    start: datetime | None
    words: str


def _fits(host: Host, job: Waiting) -> str | None:
    """The unit ``job`` counts on ``host`` if it could ever run there, else None."""
    unit = rules.unit(job.device, host.gpus > 0)
    if unit is None:
        return None
    return unit if (host.gpus if unit == "gpu" else host.cpu_slots) >= job.nproc else None


class _Fleet:
    """The hosts' free units as the plan goes, and when what they hold frees."""

    def __init__(self, hosts: list[Host], now: datetime, r: Rules) -> None:
        self.now, self.rules = now, r
        self.usage = dict(r.usage)
        self.free = {h.name: {"cpu": h.free_cpu, "gpu": h.free_gpus} for h in hosts}
        self._frees: list[tuple[datetime, int, str, str, int, str | None, float]] = []
        self._tie = itertools.count()
        for h in hosts:  # held already (not in its free units): freed at their ends
            for when, unit, n, owner in h.ends:
                self._ends(h.name, unit, n, owner, now, max(when, now))

    def hold(self, host: str, unit: str, n: int, owner: str | None, t: datetime,
             until: datetime | None) -> None:  # fmt: skip
        self.free[host][unit] -= n
        self._ends(host, unit, n, owner, t, until)

    def _ends(self, host: str, unit: str, n: int, owner: str | None, t: datetime,
              until: datetime | None) -> None:  # fmt: skip
        if until is not None:
            ran = (until - t).total_seconds()
            heapq.heappush(self._frees, (until, next(self._tie), host, unit, n, owner, ran))

    def next_free(self) -> datetime | None:
        return self._frees[0][0] if self._frees else None

    def release(self, t: datetime) -> None:
        """Free the first thing that ends by ``t``; its owner's usage grows by what it
        held, as its end counts it (queue.shares), decayed to now. One at a time: each
        end is a finish of its own, and the claims it wakes run before the next."""
        if self._frees and self._frees[0][0] <= t:
            when, _, host, unit, n, owner, ran = heapq.heappop(self._frees)
            self.free[host][unit] += n
            if owner is not None:
                weight = 1.0 if unit == "gpu" else self.rules.cpu_slot_weight
                later = (when - self.now).total_seconds() / self.rules.half_life_s
                self.usage[owner] = self.usage.get(owner, 0.0) + n * weight * ran * 2**later

    def order(self, job: Waiting) -> tuple[int, float, int]:
        share = self.usage.get(job.owner, 0.0) if job.owner is not None else 0.0
        return rules.order_key(job.priority, share, job.id)


def plan(hosts: list[Host], queue: list[Waiting], now: datetime, r: Rules) -> dict[int, Estimate]:
    """Each job's estimated start, or why there is none."""
    fleet = _Fleet(hosts, now, r)
    waiting = sorted(queue, key=fleet.order)[:MAX_PLANNED]
    found: dict[int, Estimate] = {}
    t = now
    for _ in range(MAX_MOMENTS):
        fleet.release(t)
        waiting.sort(key=fleet.order)
        guarded: set[str] = set()  # hosts a starving job holds back later jobs on
        left = []
        for job in waiting:
            places = [(h, u) for h in hosts if (u := _fits(h, job)) is not None]
            ready = job.not_before is None or job.not_before <= t
            open_ = [(h, u) for h, u in places if h.name not in guarded]
            spot = next(((h, u) for h, u in open_ if fleet.free[h.name][u] >= job.nproc), None)
            if ready and spot is not None:
                host, unit = spot
                until = None if job.limit_s is None else t + timedelta(seconds=job.limit_s)
                fleet.hold(host.name, unit, job.nproc, job.owner, t, until)
                found[job.id] = Estimate(t, f"on worker {host.name}")
                continue
            left.append(job)
            if ready and (t - job.queued_at).total_seconds() > r.starvation_s:
                guarded.update(h.name for h, _ in places)
        waiting = left
        later = [x for x in (fleet.next_free(),) if x is not None]
        later += [j.not_before for j in waiting if j.not_before is not None and j.not_before > t]
        if not waiting or not later:
            break
        t = min(later)
    for job in waiting:
        found[job.id] = Estimate(None, _why_not(hosts, job))
    return found


def _why_not(hosts: list[Host], job: Waiting) -> str:
    if not any(_fits(h, job) for h in hosts):
        return "no live worker could ever run it"
    return (
        "not before a job without a time limit ends: what runs now, or what starts ahead "
        "of it, may hold its room for good"
    )
