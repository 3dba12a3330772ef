"""Which status a job may move to, from which, and what each move does: the one owner.

A job moves only by an event (a submit, a claim, a cancel, how its attempt ended), and
``MOVES`` says, for every status the event may leave, the status it enters and what
the move does to the current attempt: whether it ends it and how (its outcome), and
whether that counts against ``max_attempts``. Nothing else in the service writes a
job's status or an attempt's outcome: the claim statements take their values from
``start_values`` (they move many rows in one statement), everything else moves a row
it holds locked with ``enter`` or ``end``. A move the table lacks raises
``IllegalMove``, a Conflict the API answers 409 naming the job's status and the
statuses the event leaves.

The side effects of a move are written here once: a job that goes back to the queue
holds nothing and waits anew; one that ends gets its finish time; an attempt that ends
is counted for fair share as it held, records its end, loses its preemption mark, and
frees its slots (its owner's quota flags are refreshed and claimers are woken). A
started attempt gets its row, and with it its hashed token; an ended attempt's token
is refused from then on by the fencing check (queue.leases.fenced), which reads the
same columns.

An attempt and a node slot of a multi-node attempt have moves of their own, written
here too. An attempt is born running (``new_attempt``, with its job's START) and ends
once, by the job move that ends it, with that move's outcome (``ATTEMPT_MOVES``, drawn
from ``MOVES``). A node slot is born forming when a claim takes it (``new_node``), runs
once its gang's last slot is taken (its job's START: no write of its own), ends when its
worker reports its processes gone (``node_ends``); a forming slot is released, its row
deleted, when its gang times out or its worker leaves (``release``). A slot holds its
worker's slots while forming, and while running until it ends or its attempt does
(rules.NODE_LIVE, books.holdings).

``diagram`` renders each table as a Mermaid state diagram; docs/architecture.md holds
them, and a test checks that they agree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, delete, func, insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.errors import Conflict
from service.models import (
    TERMINAL,
    Attempt,
    AttemptOutcome,
    Job,
    JobNode,
    JobStatus,
    UTCDateTime,
)
from service.queue import deps, quotas, shares
from service.queue.rules import Logic, attempts, j, nodes, notify_claimers
from service.wakeup import Wake

Q, R, C, H = JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLING, JobStatus.HELD
S, F, X = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED


class Event(enum.StrEnum):
    SUBMIT = "submit"  # a new job
    START = "start"  # an attempt starts: a worker's claim, a bridge's, a gang's last slot
    CANCEL = "cancel"  # a user (or an admin) cancels it
    SUCCEED = "succeed"  # its attempt exited 0
    FAIL = "fail"  # its attempt failed for good: a program error, a timeout, attempts spent
    RETRY = "retry"  # its attempt failed and attempts remain: queued after a backoff
    HAND_BACK = "hand back"  # its worker handed it back (shut down, preempted): uncounted
    LOSE = "lose"  # its worker (or scheduler) was lost and attempts remain: queued at once
    LOSE_LAST = "lose last"  # its worker was lost and that was its last attempt
    STOP = "stop"  # its processes stopped after a cancel
    UNMET = "unmet"  # a job it waits for ended so that it never starts (service.queue.deps)
    HOLD = "hold"  # its owner (or an admin) holds it back: no claim takes it
    PAUSE = "pause"  # its sweep paused it at a rung: held, its checkpoint kept, uncounted
    RELEASE = "release"  # the hold is lifted: it waits again, in its place


@dataclass(frozen=True)
class Move:
    """One legal move: ``event`` takes a job from ``source`` to ``target``."""

    source: JobStatus | None  # None: the job did not exist
    event: Event
    target: JobStatus
    ends: AttemptOutcome | None = None  # how the current attempt ends, if it does
    counted: bool = False  # it counts against max_attempts
    says: str = ""

    @property
    def requeues(self) -> bool:
        """It takes a running job back to wait, holding nothing: to the queue, or held (a
        trial its sweep paused, service.sweeps)."""
        return self.target in (JobStatus.QUEUED, JobStatus.HELD) and self.ends is not None


MOVES: tuple[Move, ...] = (
    Move(None, Event.SUBMIT, Q, says="waits for room"),
    Move(Q, Event.START, R, says="an attempt starts, with its token; holds its slots"),
    Move(Q, Event.CANCEL, X, says="cancelled before it started"),
    Move(Q, Event.UNMET, F, says="a job it waits for ended another way: it never starts"),
    Move(Q, Event.HOLD, H, says="held back: no claim takes it"),
    Move(H, Event.RELEASE, Q, says="in its place again (priority, usage, id)"),
    Move(H, Event.CANCEL, X, says="cancelled before it started"),
    Move(H, Event.UNMET, F, says="a job it waits for ended another way: it never starts"),
    Move(R, Event.CANCEL, C, says="its worker stops the processes"),
    Move(C, Event.CANCEL, C, says="asked again: nothing more to do"),
    Move(R, Event.SUCCEED, S, ends="succeeded"),
    Move(R, Event.FAIL, F, ends="failed", counted=True),
    Move(R, Event.RETRY, Q, ends="failed", counted=True, says="after a backoff"),
    Move(R, Event.HAND_BACK, Q, ends="requeued", says="not counted"),
    Move(R, Event.PAUSE, H, ends="requeued", says="until its sweep promotes it; not counted"),
    Move(R, Event.LOSE, Q, ends="lost", counted=True),
    Move(R, Event.LOSE_LAST, F, ends="lost", counted=True),
    Move(C, Event.LOSE, X, ends="lost"),
    Move(C, Event.LOSE_LAST, X, ends="lost"),
    Move(R, Event.STOP, X, ends="cancelled"),
    Move(C, Event.STOP, X, ends="cancelled"),
)
_TABLE: dict[tuple[JobStatus | None, Event], Move] = {(m.source, m.event): m for m in MOVES}


def sources(event: Event) -> list[JobStatus]:
    """The statuses ``event`` may move a job out of, in the table's order."""
    return [m.source for m in MOVES if m.event == event and m.source is not None]


class IllegalMove(Conflict):
    """An event the job's status does not allow: 409, naming the status it is in and
    those the event leaves."""

    def __init__(
        self, job_id: int | None, status: str | None, event: Event, detail: str = ""
    ) -> None:
        allowed = " or ".join(sources(event)) or "nothing"
        what = f"job {job_id}" if job_id is not None else "the job"
        now = f"{what} is {status}" if status is not None else f"{what} does not exist yet"
        super().__init__(detail or f"{now}: {event.value} moves a job only out of {allowed}")
        self.status = status
        self.event = event


def move(job_id: int | None, status: str | None, event: Event) -> Move:
    """The move ``event`` makes from ``status``; IllegalMove if it has none."""
    found = _TABLE.get((JobStatus(status) if status is not None else None, event))
    if found is None:
        if event == Event.CANCEL and status in TERMINAL:
            ended = "was already cancelled" if status == X else f"is already {status}"
            raise IllegalMove(
                job_id,
                status,
                event,
                f"job {job_id} {ended}: there is nothing to cancel "
                f"(cancel moves a job only out of {' or '.join(sources(event))})",
            )
        raise IllegalMove(job_id, status, event)
    return found


def may(event: Event, status: Any, logic: Logic) -> Any:
    """The predicate (SQL or Python, as queue.rules writes its rules) that a job in
    ``status`` may take ``event``: for the statements that move rows in bulk."""
    return logic.any_(*(status == s for s in sources(event)))


# ---- moves made on a row the caller holds locked ---------------------------------------


def submitted() -> dict[str, Any]:
    """A new job's status column (SUBMIT)."""
    return {"status": move(None, None, Event.SUBMIT).target}


def enter(job: Job, event: Event, now: datetime, reason: str | None, **columns: Any) -> Move:
    """Move ``job`` (an ORM row the caller locked) by ``event``, an event that ends no
    attempt (a cancel). Returns the move."""
    m = move(job.id, job.status, event)
    if m.ends is not None:
        raise ValueError(f"{event.value} ends an attempt: use end()")
    _set(job, m, now, reason, columns)
    return m


def settle_dependents(s: Session, job_id: int, status: str, now: datetime) -> None:
    """``job_id`` ended ``status`` (in the caller's transaction, its row locked): each job
    that waited for it has that dependency met (the last one wakes the claimers) or
    failed for good (UNMET: the job fails, and what waited for it is settled in turn)."""
    ended = [(job_id, status)]
    woken = False
    while ended:
        done, how = ended.pop()
        for dep, waiting in deps.waiting_for(s, done):
            met = deps.verdict(how, dep.when)
            s.delete(dep)
            if waiting.status not in (JobStatus.QUEUED, JobStatus.HELD):
                continue  # cancelled meanwhile: nothing waits
            if met:
                waiting.waits_on = max(0, waiting.waits_on - 1)
                woken = woken or waiting.waits_on == 0
                continue
            reason = f"{deps.words(done, dep.when)} can never be met: job {done} {how}"
            enter(waiting, Event.UNMET, now, reason)
            ended.append((waiting.id, JobStatus.FAILED))
    s.flush()
    if woken:
        notify_claimers(s)


def end(
    s: Session,
    job: Job,
    attempt: Attempt,
    event: Event,
    now: datetime,
    reason: str | None,
    exit_code: int | None = None,
    reported: bool = False,
    **columns: Any,
) -> Move:
    """End ``job``'s current ``attempt`` (both rows the caller locked, job first) by
    ``event``: the job moves on, the attempt records how it ended, its use is counted
    for fair share as it held, and its slots are free for claimers. ``reported``: its
    worker reported its processes gone (a finish), so its slots are free there too."""
    m = move(job.id, job.status, event)
    if m.ends is None:
        raise ValueError(f"{event.value} ends no attempt: use enter()")
    if attempt.ended_at is not None:
        raise IllegalMove(job.id, job.status, event, f"attempt {attempt.number} already ended")
    ends = attempt_move(attempt.outcome, event)
    if m.target in TERMINAL:  # what waited for it, before any owner's lock is taken
        settle_dependents(s, job.id, m.target, now)
    held_cpu = job.held_cpu_slots  # what it held, before a requeue clears it
    # As it held: before the job moves on; under its owner's lock from there if it
    # counted any (taken after the attempt's row: service.queue.quotas).
    locked = shares.count_end(s, job, attempt, now)
    _set(job, m, now, reason, columns)
    job.exit_code = exit_code
    job.preempted_by = None  # a hand-back asked of it is done, or moot
    job.pausing = None  # and so is a pause
    _end_attempt(attempt, ends, now, exit_code, job.reason)
    s.flush()
    lifted = quotas.refresh(s, job.owner, locked=locked)  # what its owner holds shrank
    # Its slots are free: only its worker's claims could use them, unless the job is
    # queued again, a gang's nodes are free, or its owner's limits now let a job start.
    # (Fair share reorders its owner's queued jobs: what fits anywhere is the same.)
    everyone = m.requeues or job.nnodes > 1 or lifted > 0
    freed = reported and job.nnodes == 1
    wake = Wake(
        everyone,
        attempt.worker,
        held_cpu if freed else 0,
        tuple(attempt.gpus or ()) if freed else (),
    )
    notify_claimers(s, wake)
    return m


def _end_attempt(
    attempt: Attempt, m: AttemptMove, now: datetime, exit_code: int | None, reason: str | None
) -> None:
    """The attempt's own move: it records when and how it ended, and why (kept per
    attempt: its job's reason moves on). Its token is refused from then on."""
    attempt.ended_at = now
    attempt.exit_code = exit_code
    attempt.outcome = m.target
    attempt.reason = reason


def _set(job: Job, m: Move, now: datetime, reason: str | None, columns: dict[str, Any]) -> None:
    job.status = m.target
    job.reason = reason
    if m.requeues:  # it waits anew and holds nothing
        job.queued_at = now
        job.worker = None
        job.gpus = None
        job.held_cpu_slots = 0
    if m.counted:
        job.failures += 1
    if m.target in TERMINAL:
        job.finished_at = now
    for column, value in columns.items():
        setattr(job, column, value)


# ---- START: the claims move rows in one statement ----------------------------------------


def start_values(**more: Any) -> dict[str, Any]:
    """A job row's new values when an attempt of it starts (a worker's claim, a bridge's,
    a gang's last slot), with what the attempt holds (``more``): it runs on the bound
    ``worker`` from the bound ``now``, and its last attempt's words are gone. The
    statement's WHERE must hold ``may(Event.START, ...)``."""
    return {
        "status": move(None, JobStatus.QUEUED, Event.START).target,
        "worker": bindparam("worker"),
        "started_at": func.coalesce(j.started_at, bindparam("now", type_=UTCDateTime)),
        "reason": None,
        "exit_code": None,
        "not_before": None,
        # It needs no room made any more (service.queue.preempt).
        "preempting_on": None,
        "preempting_since": None,
        **more,
    }


_NEW_ATTEMPT = insert(attempts)


def new_attempt(
    conn: Connection,
    job_id: int,
    number: int,
    worker: str,
    token_hash: str,
    gpus: list[int],
    checkpoint_dir: str,
    now: datetime,
) -> None:
    """Write the row of an attempt that starts now on ``worker``, with its hashed token
    (the statement that moved its job by START runs in the same transaction)."""
    conn.execute(
        _NEW_ATTEMPT,
        {
            "job_id": job_id,
            "number": number,
            "worker": worker,
            "token_hash": token_hash,
            "gpus": gpus,
            "checkpoint_dir": checkpoint_dir,
            "started_at": now,
            "heartbeat_at": now,
            "outcome": attempt_move(None, Event.START).target,
            "log_bytes": 0,
        },
    )


# ---- an attempt's moves ----------------------------------------------------------------


@dataclass(frozen=True)
class AttemptMove:
    """``event`` takes an attempt from ``source`` (None: it did not exist) to ``target``."""

    source: AttemptOutcome | None
    event: Event
    target: AttemptOutcome


# An attempt starts running with its job's START and ends as the job move that ends it
# says (Move.ends): its table is drawn from the job's, so the two cannot disagree.
ATTEMPT_MOVES: tuple[AttemptMove, ...] = (
    AttemptMove(None, Event.START, "running"),
    *dict.fromkeys(AttemptMove("running", m.event, m.ends) for m in MOVES if m.ends),
)
_ATTEMPT_TABLE = {(m.source, m.event): m for m in ATTEMPT_MOVES}
# One outcome per event: a job move that ended its attempt otherwise than another of the
# same event would be lost from the attempt's table here, not refused.
assert len(_ATTEMPT_TABLE) == len(ATTEMPT_MOVES), "an event ends attempts two ways"


def attempt_move(outcome: str | None, event: Event) -> AttemptMove:
    """The move ``event`` makes an attempt in ``outcome`` (None: none yet) make; a
    Conflict if it has none (an attempt ends once)."""
    found = _ATTEMPT_TABLE.get((outcome, event))  # type: ignore[arg-type]
    if found is None:
        now = f"is {outcome}" if outcome is not None else "does not exist yet"
        raise Conflict(f"the attempt {now}: {event.value} moves no attempt out of that")
    return found


# ---- a node slot's moves ---------------------------------------------------------------


class Slot(enum.StrEnum):
    """Where a node slot of a multi-node attempt stands."""

    FORMING = "forming"  # its gang is not complete: the job is queued, one attempt behind
    RUNNING = "running"  # its gang is complete: its attempt started
    ENDED = "ended"  # its worker reported its processes gone


class NodeEvent(enum.StrEnum):
    TAKE = "take"  # a worker's claim takes one slot of a gang (queue.gangs.take_node)
    START = "start"  # the gang's last slot is taken: the attempt starts (the job's START)
    RELEASE = "release"  # its gang timed out, or its worker left or restarted
    REPORT = "report"  # its worker reports its processes gone (a finish)


@dataclass(frozen=True)
class NodeMove:
    """``event`` takes a node slot from ``source`` to ``target`` (None: no row)."""

    source: Slot | None
    event: NodeEvent
    target: Slot | None
    says: str = ""


NODE_MOVES: tuple[NodeMove, ...] = (
    NodeMove(None, NodeEvent.TAKE, Slot.FORMING, says="holds its worker's slots"),
    NodeMove(Slot.FORMING, NodeEvent.START, Slot.RUNNING, says="with every slot of its gang"),
    NodeMove(Slot.FORMING, NodeEvent.RELEASE, None, says="its row goes, holding nothing"),
    NodeMove(Slot.RUNNING, NodeEvent.REPORT, Slot.ENDED, says="its worker's slots are free"),
    NodeMove(Slot.ENDED, NodeEvent.REPORT, Slot.ENDED, says="reported again: nothing more"),
)
_NODE_TABLE = {(m.source, m.event): m for m in NODE_MOVES}


def node_move(slot: Slot | None, event: NodeEvent) -> NodeMove:
    """The move ``event`` makes a node slot in ``slot`` make; a Conflict if it has none."""
    found = _NODE_TABLE.get((slot, event))
    if found is None:
        allowed = " or ".join(str(m.source) for m in NODE_MOVES if m.event == event)
        raise Conflict(f"the node slot is {slot}: {event.value} moves one only out of {allowed}")
    return found


_NEW_NODE = insert(nodes)


def new_node(conn: Connection, values: dict[str, Any]) -> None:
    """TAKE: write the row of a node slot a claim takes (``values``, its columns)."""
    node_move(None, NodeEvent.TAKE)
    conn.execute(_NEW_NODE, values)


def release(s: Session, *where: Any) -> None:
    """RELEASE: delete the forming node slots that match ``where`` (the caller holds
    their job's row locked and saw the gang still forming); their workers' slots are
    free for claimers."""
    node_move(Slot.FORMING, NodeEvent.RELEASE)
    s.execute(delete(JobNode).where(*where))
    notify_claimers(s)


def node_ends(
    s: Session, node: JobNode, now: datetime, outcome: str, exit_code: int | None
) -> bool:
    """REPORT: ``node``'s worker reports its processes gone (the node's row, and its
    job's, locked by the caller): the slot records how, and its worker's slots are free
    for claimers. False if it had already ended (a retried report changes nothing)."""
    m = node_move(Slot.ENDED if node.ended_at is not None else Slot.RUNNING, NodeEvent.REPORT)
    if m.source == m.target:
        return False
    node.ended_at = now
    node.exit_code = exit_code
    node.outcome = outcome
    notify_claimers(s)
    return True


# ---- the tables as pictures -------------------------------------------------------------


def diagram() -> str:
    """The job state machine as a Mermaid state diagram (docs/architecture.md)."""
    lines = ["stateDiagram-v2"]
    for m in MOVES:
        if m.source == m.target:
            continue  # an idempotent repeat: no arrow
        source = "[*]" if m.source is None else m.source.value
        label = m.event.value
        if m.ends is not None and m.source != JobStatus.CANCELLING:
            label += f" (attempt {m.ends}{', counted' if m.counted else ''})"
        lines.append(f"    {source} --> {m.target.value}: {label}")
    # A cancelling job ends cancelled whatever its attempt reports: one arrow says it.
    lines = _fold_cancelling(lines)
    for status in sorted(TERMINAL):
        lines.append(f"    {status.value} --> [*]")
    return "\n".join(lines) + "\n"


def _fold_cancelling(lines: list[str]) -> list[str]:
    """The arrows cancelling --> cancelled, one per event, as one arrow naming them."""
    prefix = f"    {C.value} --> {X.value}: "
    events = [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]
    kept = [line for line in lines if not line.startswith(prefix)]
    return [*kept, prefix + ", ".join(events) + " (attempt ends)"] if events else kept


def attempt_diagram() -> str:
    """An attempt's moves as a Mermaid state diagram: one arrow per outcome, naming the
    job events that end it so."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for m in ATTEMPT_MOVES:
        arrows.setdefault((m.source or "[*]", m.target), []).append(m.event.value)
    return _render(arrows, sorted({m.target for m in ATTEMPT_MOVES} - {"running"}))


def node_diagram() -> str:
    """A node slot's moves as a Mermaid state diagram."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for m in NODE_MOVES:
        if m.source != m.target:  # an idempotent repeat: no arrow
            arrow = (m.source or "[*]", m.target or "[*]")
            arrows.setdefault(arrow, []).append(f"{m.event.value} ({m.says})")
    return _render(arrows, [Slot.ENDED])


def _render(arrows: dict[tuple[str, str], list[str]], ends: list[str]) -> str:
    lines = ["stateDiagram-v2"]
    lines += [f"    {a} --> {b}: {', '.join(events)}" for (a, b), events in arrows.items()]
    lines += [f"    {end} --> [*]" for end in ends]
    return "\n".join(lines) + "\n"
