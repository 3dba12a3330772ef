"""What a sweep's round decides, from what it read (service.sweeps reads and writes).

Pure but for its inputs: ``decide`` takes a sweep's trials as read (their jobs' statuses,
the rungs they reached since the last round, how ended ones ended) and returns the plan:
the rungs to record, the trials to tell, to stop, to pause, to promote and to make, and
whether the sweep is done. The decisions themselves are Optuna's (service.studies) or,
for ASHA's pause mode, service.asha's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service import asha, studies
from service.models import TERMINAL, JobStatus
from service.schemas import SweepSpec

# The trials whose jobs the sweep still follows: active, or paused (asha.PAUSED).
LIVE = ("active", asha.PAUSED)
# Trials one round makes at most (the rest the next): a transaction stays short.
MAX_NEW_PER_ROUND = 32


@dataclass
class TrialRead:
    number: int
    job_id: int | None
    params: dict[str, Any]
    state: str
    value: float | None
    rungs: list[tuple[int, float | None]]
    status: str | None  # its job's (None: purged)
    reason: str | None
    latest_step: int | None
    pausing: bool = False  # its job is asked to pause (service.holds.pause_locked)

    @property
    def ended(self) -> bool:
        return self.status is None or self.status in TERMINAL


@dataclass
class SweepRead:
    id: int
    owner: str
    version: int
    seed: int
    made: int
    spec: SweepSpec
    trials: list[TrialRead]
    events: list[studies.Event] = field(default_factory=list)
    # Of each ended trial the sweep has not told yet: its metric's last (step, value).
    finals: dict[int, tuple[int, float | None] | None] = field(default_factory=dict)


@dataclass
class Told:
    state: str
    value: float | None
    step: int | None
    reason: str | None


@dataclass
class Plan:
    rungs: dict[int, list[tuple[int, float | None]]] = field(default_factory=dict)
    told: dict[int, Told] = field(default_factory=dict)
    prunes: list[studies.Prune] = field(default_factory=list)
    # ASHA's pause mode (service.asha): trials to pause, paused ones to promote (their
    # jobs held), paused ones whose jobs run again (released by hand, or lost while
    # pausing), and, as the sweep ends, those never promoted (pruned).
    pauses: list[asha.Pause] = field(default_factory=list)
    promote: list[int] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)
    unpromoted: list[studies.Prune] = field(default_factory=list)
    new: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    done: bool = False
    best: studies.Record | None = None

    @property
    def empty(self) -> bool:
        return not (
            self.rungs or self.told or self.prunes or self.pauses or self.promote
            or self.resumed or self.unpromoted or self.new or self.done
        )  # fmt: skip


def tell(metric: str | None, t: TrialRead, final: tuple[int, float | None] | None) -> Told:
    """How an ended trial ended, for the sweep (and the study: complete, or failed)."""
    if t.status == JobStatus.SUCCEEDED:
        if metric is None:  # a sweep without a metric (an array): its job's success
            return Told("complete", None, None, None)
        if final is None:
            return Told("failed", None, None, f"it succeeded without reporting {metric}")
        step, value = final
        if value is None:
            return Told("failed", None, step, f"its last {metric} (step {step}) was NaN")
        return Told("complete", value, step, None)
    if t.status is None:
        return Told("failed", None, None, "its job was purged before the sweep saw it end")
    state = "cancelled" if t.status == JobStatus.CANCELLED else "failed"
    return Told(state, None, None, None)  # why: its job's reason


def decide(read: SweepRead) -> Plan:
    """What a round of the sweep ``read`` does (service.sweeps writes it)."""
    spec = read.spec
    plan = Plan()
    pause = asha.pausing(spec)
    by_number = {t.number: t for t in read.trials}
    records = {
        t.number: studies.Record(t.number, t.params, t.state, t.value, list(t.rungs), t.ended)
        for t in read.trials
    }
    for t in read.trials:
        # Paused, its job queued or running again but not pausing: released by hand, or
        # lost before it stopped. It runs on.
        if t.state == asha.PAUSED and not (t.ended or t.pausing or t.status == JobStatus.HELD):
            plan.resumed.append(t.number)
            records[t.number].state = "active"
    if pause:
        plan.rungs, plan.pauses = asha.replay(spec, list(records.values()), read.events)
    else:
        plan.rungs, plan.prunes = studies.replay(spec, list(records.values()), read.events)
    for number, rungs in plan.rungs.items():
        records[number].rungs = rungs
    for t in read.trials:
        if t.state in LIVE and t.ended:
            told = tell(spec.metric, t, read.finals.get(t.number))
            plan.told[t.number] = told
            records[t.number].state, records[t.number].value = told.state, told.value
    for p in plan.prunes:
        records[p.number].state, records[p.number].value = "pruned", p.value
    for q in plan.pauses:
        records[q.number].value = q.value
    stopping = {p.number for p in plan.prunes}
    # Queued or running: what max_concurrent bounds (a pruned trial counts until its
    # worker has stopped it, one still queued not at all: its cancel is at once; a paused
    # one until its job is held).
    active = sum(
        1
        for t in read.trials
        if not t.ended
        and t.status != JobStatus.HELD
        and not (t.number in stopping and t.status == JobStatus.QUEUED)
    )
    room = min(spec.max_concurrent - active, MAX_NEW_PER_ROUND)
    if pause:  # promotions first, as ASHA's paper has it: no step is run twice
        tail = read.made >= spec.limit and not any(
            r.state == "active" and not by_number[n].ended for n, r in records.items()
        )
        ready = [
            n for n in asha.promotable(spec, list(records.values()), tail)
            if by_number[n].status == JobStatus.HELD
        ]  # fmt: skip
        plan.promote = ready[: max(room, 0)]
        for n in plan.promote:
            records[n].state = "active"
        room -= len(plan.promote)
    room = min(room, spec.limit - read.made)
    numbers = list(range(read.made, read.made + max(room, 0)))
    plan.new = list(
        zip(numbers, studies.ask(spec, read.seed, list(records.values()), numbers), strict=True)
    )
    # Done once it may make no more, every trial has ended and been told, and no paused
    # trial may be promoted (those left are pruned now, their jobs cancelled).
    running = any(
        (not by_number[n].ended and r.state != asha.PAUSED) or r.state == "active"
        for n, r in records.items()
    )
    if not running and read.made >= spec.limit:
        running = _prune_unpromoted(read, plan, records)
    plan.best = studies.best(spec, list(records.values()))
    plan.done = read.made >= spec.limit and not running
    return plan


def _prune_unpromoted(read: SweepRead, plan: Plan, records: dict[int, studies.Record]) -> bool:
    """Nothing runs and no trial may be made: the paused trials left are pruned, unless
    one still stops (the round once its job is held decides) or one may be promoted as
    room frees. Whether the sweep still runs."""
    stalled = [r for r in records.values() if r.state == asha.PAUSED]
    held = {t.number for t in read.trials if t.status == JobStatus.HELD}
    if any(r.number not in held for r in stalled) or (
        stalled and asha.promotable(read.spec, list(records.values()), tail=True)
    ):
        return True
    for r in stalled:
        step, value = r.rungs[-1]
        words = asha.never_promoted(read.spec, r)
        plan.unpromoted.append(studies.Prune(r.number, step, value, words))
        r.state = "pruned"
    return False


def ended_words(read: SweepRead, plan: Plan) -> str:
    spec = read.spec
    states: dict[str, int] = {}
    unpromoted = {p.number for p in plan.unpromoted}
    for t in read.trials:
        state = plan.told[t.number].state if t.number in plan.told else t.state
        state = "pruned" if t.number in unpromoted else state
        states[state] = states.get(state, 0) + 1
    tally = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    if spec.metric is None:
        return f"every trial ended ({tally})"
    if plan.best is None:
        return f"every trial ended ({tally}); none completed with a value of {spec.metric}"
    job = next((t.job_id for t in read.trials if t.number == plan.best.number), None)
    return (
        f"every trial ended ({tally}); best: trial {plan.best.number} (job {job}), "
        f"{spec.metric} {plan.best.value:.6g}"
    )
