"""Wakes long-polling claimers when something may have become claimable.

A wake-up is for everyone (a job queued or queued again, a limit lifted, a gang's slot
freed) or for one worker's own claims only: one of its attempts ended and nothing else
changed for anyone else (no job entered the queue, its owner's quota holds nothing back
that it did before), so only that worker has more room. Waking every long-poll for
such a finish cost a claim per kind of room for nothing: at 100 hosts the wake-ups'
claims were a third of the API (bench/fleet.py).

A worker's long-poll carries the slots free when it was sent: the slots of an attempt
of its own that ends meanwhile are not in it (the worker frees them once its finish is
answered). Those are added to the poll's room (``freed_since``), so a queued job
needing them starts now, not when the poll ends.

A wake-up for everyone wakes every gang's wait and the ``WAKE_AT_ONCE`` long-polls of
the most room at once; the others see its generation at their next re-check. A submit's
wake-up is shaped: it carries what a node of its job needs (``device``, ``nproc``), so
only polls with room for it are woken, a poll a node (and ``WAKE_SPARE``) of the least
room that fits, and a poll's memory that nothing fits it
(queue.NothingFits) outlives the new generation when the generations since brought only
jobs it has no room for, or jobs claimed already (``since``). Every other wake-up for
everyone (a requeue, a limit lifted, a gang's slot freed) is unshaped: it wakes and
resets as before.

A worker that leaves (``queue.leave``) wakes its own long-polls with a wake-up that says
so (``left``): whatever the memory of claims that found nothing says, they ask the
database, whose answer (in the claim's transaction) is that this worker is handed
nothing, and end. A process counts the leaves it heard per worker (``leaves``) and how
many of them a claim found undone (``back``: the worker registered again), so a poll
begun after a leave asks the database too, until a claim finds the worker back.

A commit that may make something claimable says so once (``queue.notify_claimers``):
this process's claimers are woken when it commits (``Database.on_commit``), the other
API processes' through Postgres NOTIFY, each ignoring its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import json
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Unique to this API process (``ddpq serve --workers N`` starts several): the LISTEN
# connection hears this process's own NOTIFYs, whose wake-up it has had already.
_BOOT = secrets.token_hex(4)
# How long the slots a finish freed are added to its worker's long-polls: longer than
# any poll is held open (max_claim_wait_s is at most a minute in any sane setting; a
# poll begun before the finish and still open past this gets them at its next poll).
FREED_KEEP_S = 120.0
# Generations whose wake-ups are kept for ``Wakeup.since``: a poll's memory older than
# this is not carried over (10 submits a second keep 25 s of them).
HISTORY = 256


def process_tag() -> str:
    return f"{os.getpid()}.{_BOOT}"


@dataclass(frozen=True)
class Wake:
    """What a commit may have made claimable: for everyone, or (``everyone`` False) for
    ``worker``'s own claims only. ``cpu`` and ``gpus``: the slots of ``worker`` an
    attempt of its held until this commit ended it."""

    everyone: bool = True
    worker: str | None = None
    cpu: int = 0
    gpus: tuple[int, ...] = ()
    # A submit's: what one node of the queued job needs, its nodes, and its id.
    device: str | None = None
    nproc: int = 0
    nnodes: int = 1
    job: int | None = None
    # ``worker`` left (queue.leave): its polls ask the database, which ends them.
    left: bool = False
    # This process woke a poll for each of its job's nodes: those claim it, and other
    # polls' memory that nothing fits need not race them for it (queue.NothingFits).
    # Kept in the history only; never sent.
    woken: bool = False

    def payload(self) -> str:
        """The NOTIFY payload: this, and which process sent it."""
        d = {"p": process_tag(), "e": self.everyone, "w": self.worker, "c": self.cpu,
             "g": list(self.gpus), "d": self.device, "n": self.nproc, "m": self.nnodes,
             "j": self.job}  # fmt: skip
        if self.left:  # only then: an API of an earlier version reads what it knows
            d["l"] = True
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def heard(cls, payload: str) -> Wake | None:
        """The wake-up a NOTIFY carries; None for this process's own. One it cannot read
        (an API of an earlier version sends none) wakes everyone."""
        try:
            d = json.loads(payload)
            if d["p"] == process_tag():
                return None
            gpus = tuple(int(g) for g in d["g"])
            device = d.get("d")  # an API of an earlier version sends no shape
            job = d.get("j")
            return cls(
                bool(d["e"]), d["w"], int(d["c"]), gpus,
                str(device) if device is not None else None, int(d.get("n", 0)),
                int(d.get("m", 1)), int(job) if job is not None else None,
                left=bool(d.get("l", False)) and d["w"] is not None,
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return EVERYONE


EVERYONE = Wake()

# Whether a node of a job (device, ranks per node) fits a poll's room (the worker has
# GPUs, free CPU slots, free GPUs): queue.rules.room_fits, given to Wakeup by the app.
Fits = Callable[[str, int, bool, int, int], bool]
# A poll's room: free GPUs, free CPU slots, and whether its worker has GPUs (None: not
# known yet in this process).
Room = tuple[int, int, bool | None]


class Wakeup:
    """Wake-ups for long-polls: ``generation`` counts those for everyone, ``own(worker)``
    those for one worker, so a wake-up between a claimer's empty claim and its wait is
    never missed. Mutated on the event loop only (``wake`` hops there from any thread)."""

    def __init__(self, fits: Fits | None = None) -> None:
        self.generation = 0
        self.fits = fits
        self._history: deque[tuple[int, Wake]] = deque(maxlen=HISTORY)
        self._own: dict[str, int] = {}
        # Per worker: the leaves heard, and how many of them a claim found undone. Never
        # reset: a poll compares the count it asked the database at with the count now.
        self._left: dict[str, tuple[int, int]] = {}
        self._waiting: dict[str | None, dict[asyncio.Future[Wake], Room]] = {}
        self._seq = 0  # counts recorded frees: a poll adds those after its start
        self._freed: dict[str, list[tuple[int, float, int, tuple[int, ...]]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def own(self, worker: str) -> int:
        return self._own.get(worker, 0)

    def leaves(self, worker: str) -> int:
        """How many leaves of ``worker`` this process has heard: a poll that sees the count
        move asks the database (not the memory of claims that found nothing)."""
        return self._left.get(worker, (0, 0))[0]

    def back(self, worker: str) -> int:
        """How many of those a claim found undone (the worker registered again): a poll
        begins as if it had asked the database at this count."""
        return self._left.get(worker, (0, 0))[1]

    def rejoined(self, worker: str, leaves: int) -> None:
        """A claim of ``worker``, begun when this process had heard ``leaves`` of its
        leaves, found it has not left: those are undone (one heard since is not)."""
        heard, back = self._left.get(worker, (0, 0))
        if leaves > back:
            self._left[worker] = (heard, leaves)

    def since(self, generation: int) -> list[Wake] | None:
        """The wake-ups for everyone after ``generation``, or None if they are no longer
        all kept."""
        if generation == self.generation:
            return []
        if generation > self.generation or not self._history:
            return None
        if self._history[0][0] > generation + 1:
            return None
        return [w for g, w in self._history if g > generation]

    def room_fits(self, wake: Wake, room: Room) -> bool:
        """Whether a poll of ``room`` could take the job a shaped wake-up queued (any
        wake-up for a poll whose worker's kind is not known yet)."""
        gpus, cpu, has_gpus = room
        if wake.device is None or has_gpus is None or self.fits is None:
            return True
        return self.fits(wake.device, wake.nproc, has_gpus, cpu, gpus)

    def mark(self) -> int:
        """Where a long-poll begins: what is freed after it is added to its room."""
        return self._seq

    def freed_since(self, worker: str, mark: int) -> tuple[int, set[int]]:
        """CPU slots and GPUs of ``worker`` that attempts ending after ``mark`` freed."""
        cpu, gpus = 0, set[int]()
        for seq, _, c, g in self._freed.get(worker, ()):
            if seq > mark:
                cpu += c
                gpus.update(g)
        return cpu, gpus

    def committed(self, handed: list[object]) -> None:
        """What a write transaction woke (Database.on_commit, on its thread)."""
        for wake in handed:
            if isinstance(wake, Wake):
                self.wake(wake)

    def notify(self) -> None:
        """Wake everyone; callable from any thread."""
        self.wake(EVERYONE)

    def wake(self, wake: Wake) -> None:
        """Callable from any thread."""
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._apply(wake)
        else:
            self._loop.call_soon_threadsafe(self._apply, wake)

    def _apply(self, wake: Wake) -> None:
        worker = wake.worker
        if worker is not None and (wake.cpu or wake.gpus):
            self._seq += 1
            now = time.monotonic()
            kept = [f for f in self._freed.get(worker, ()) if now - f[1] < FREED_KEEP_S]
            self._freed[worker] = [*kept, (self._seq, now, wake.cpu, wake.gpus)]
        if wake.everyone:
            self.generation += 1
            # Every gang's wait (no worker's: few, each a formed gang's start), and the
            # claims' long-polls that have room for it: a few of those it fits best.
            polls = [
                w
                for name, waiting in self._waiting.items()
                if name
                for w in waiting.items()
                if self.room_fits(wake, w[1])
            ]
            chosen = _chosen(wake, polls)
            if wake.device is not None and len(chosen) >= wake.nnodes:
                wake = dataclasses.replace(wake, woken=True)
            self._history.append((self.generation, wake))
            woken = [*self._waiting.get(None, {}), *chosen]
        elif worker is not None:
            self._own[worker] = self._own.get(worker, 0) + 1
            if wake.left:
                heard, back = self._left.get(worker, (0, 0))
                self._left[worker] = (heard + 1, back)
            woken = list(self._waiting.get(worker, {}))
        else:
            return
        for f in woken:
            if not f.done():
                f.set_result(wake)

    async def wait(
        self,
        seen_generation: int,
        timeout: float,
        worker: str | None = None,
        seen_own: int = 0,
        room: Room = (0, 0, None),
    ) -> Wake | None:
        """Until a wake-up for everyone after ``seen_generation`` or, given ``worker``, one
        for it after ``seen_own``, or ``timeout``. ``room``: the free GPUs and CPU slots
        of the long-poll waiting, which orders who a wake-up for everyone wakes first,
        and its worker's kind, which a shaped one's fit is judged by. The wake-up that
        woke it, if one did (None: it was due, or one came before it waited)."""
        if self.generation != seen_generation:
            return None
        if worker is not None and self.own(worker) != seen_own:
            return None
        f: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(worker, {})
        waiting[f] = room
        try:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(f, timeout)
            return None
        finally:
            waiting.pop(f, None)
            if not waiting:
                self._waiting.pop(worker, None)


# Long-polls a wake-up for everyone wakes at once: those of the most room, when it does
# not say what changed (a requeue, a limit lifted: anything may fit now). With 1,000 hosts
# polling, every submit woke all 1,000 (10 submits a second: 10,000 wake-ups, most of the
# API's time, bench/fleet.py). The rest see the new generation at their next re-check
# (DDPQ_CLAIM_RECHECK_S), so nothing is missed, only later for a job none of these took.
WAKE_AT_ONCE = 16
# A submit's wake-up wakes a poll per node of its job and this many more, in case one of
# them took another job or hung up: the 16 it woke before ran 13 claims that found nothing
# for every submit at 1,000 hosts (each woken poll asked as the first one's claim ran).
WAKE_SPARE = 1


def _chosen(wake: Wake, waiting: list[tuple[asyncio.Future[Wake], Room]]) -> list[Any]:
    """The polls a wake-up for everyone wakes. A submit's (shaped) goes to those with the
    least room that takes its job (best fit, as Slurm's and Kubernetes' GPU bin packing
    do): a 1-GPU job fills a gap rather than splitting a free host that an 8-GPU job
    waits for. Polls of unknown kind (no claim here yet) count as roomiest."""
    if wake.device is None:
        if len(waiting) <= WAKE_AT_ONCE:
            return [f for f, _ in waiting]
        return [f for f, _ in heapq.nlargest(WAKE_AT_ONCE, waiting, key=lambda w: w[1][:2])]
    n = min(WAKE_AT_ONCE, wake.nnodes + WAKE_SPARE)
    return [f for f, _ in heapq.nsmallest(n, waiting, key=_fit_key)]


def _fit_key(w: tuple[asyncio.Future[Wake], Room]) -> tuple[bool, int, int]:
    gpus, cpu, kind = w[1]
    return (kind is None, gpus, cpu)
