"""What idle long-polls need not ask the database again: an API process's memory of the
claims that found nothing (``NothingFits``), and of the jobs its claims took.

With 1,000 hosts each long-polling, every wake-up (a submit, a finish) and every re-check
ran 1,000 claim transactions that found nothing, and the API spent its time on them
(bench/fleet.py). A claim that found nothing for room (cpu, gpus) at wake-up generation G
(``Probe.general``) means nothing would fit a worker of the same kind offering no more:
the pick's predicates are monotone in the room, and the rest (the queue, quotas, a job's
retry backoff running out, another API process's submit) changes only with a new
generation, or with time, which ``valid_s`` bounds. Such a worker waits for the next
wake-up instead. A worker this process has not seen claim (which might not be
registered: 404) always asks the database. While a claim for some room runs, the claims
of no more room at the same generation wait for its answer instead of asking alongside
it (a wake-up wakes every long-poll at once).

The memory moves on with the generations: a room found empty at G still holds at a later
generation when every wake-up between only queued jobs it has no place for, or jobs a
claim here took already (``Wakeup.since``), or whose job went to polls woken for it
(``Wake.woken``: they ask the database whatever the memory says; the others need not
race them for it, and if none of them took it, the memory runs out within ``valid_s``).
At 10 submits a second the generation moves 10 times a second; a memory of one
generation only was empty again before most polls re-checked, and they asked the
database 45 times a second for nothing (bench/fleet.py), as did every re-check while a
new job was being claimed (35 a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from service.queue.rules import room_fits
from service.wakeup import Wake

# Jobs NothingFits remembers as claimed: more than a burst of submits keeps queued.
CLAIMED_KEPT = 4096

Since = Callable[[int], list[Wake] | None]


@dataclass
class Probe:
    """What a claim looked at, filled in as it runs: whether the worker has GPUs, the room
    it offered by the books (free CPU slots and GPUs: the worker's word and the books',
    whichever is less), and whether a claim that found nothing found nothing for every
    worker of its kind with no more room (``general``: no starving job, gang or
    preemption narrowed the pick to this worker)."""

    has_gpus: bool | None = None
    cpu: int = 0
    gpus: int = 0
    general: bool = False
    # When its transaction began (monotonic): what it found holds from then. A claim that
    # waited for a claim thread behind many others (1,000 polls re-checking) would
    # otherwise be stale as it answers, and every poll would go on asking.
    at: float = 0.0


@dataclass
class _Empty:
    """The rooms known to find nothing at ``generation``, per kind of worker (has GPUs):
    (cpu, gpus, since), ``since`` when the claim that found it began (monotonic). Only
    rooms no other covers are kept (one of at least as much room found as late)."""

    generation: int
    rooms: dict[bool, list[tuple[int, int, float]]] = field(default_factory=dict)

    def add(self, kind: bool, cpu: int, gpus: int, since: float, oldest: float) -> None:
        kept = [
            r
            for r in self.rooms.get(kind, ())
            if r[2] >= oldest and not (r[0] <= cpu and r[1] <= gpus and r[2] <= since)
        ]
        if not any(cpu <= c and gpus <= g and since <= t for c, g, t in kept):
            kept.append((cpu, gpus, since))
        self.rooms[kind] = kept


class NothingFits:
    """An API process's memory of claims that found nothing (the module says how)."""

    def __init__(self, valid_s: float) -> None:
        self.valid_s = valid_s
        self._kind: dict[str, bool] = {}  # worker -> has GPUs, from its last claim
        self._empty = _Empty(-1)
        self._asking: list[tuple[int, bool, int, int, asyncio.Event]] = []
        # Single-node jobs this process's claims took lately: a submit's wake-up for one
        # of them changes nothing for anyone else any more.
        self._claimed: dict[int, None] = {}

    def kind(self, worker: str) -> bool | None:
        """Whether ``worker`` has GPUs, as its last claim here found (None: unknown)."""
        return self._kind.get(worker)

    def covers(
        self, worker: str, generation: int, cpu: int, gpus: int, now: float,
        since: Since | None = None,
    ) -> bool:  # fmt: skip
        """Whether a claim of ``worker`` offering this room would find nothing now: a
        claim of as much room found nothing at this generation, or at an earlier one
        whose wake-ups since (``since``: Wakeup.since) only queued jobs this room has no
        place for or that were claimed already."""
        kind = self._kind.get(worker)
        e = self._empty
        if kind is None or e.generation > generation:
            return False
        rooms = e.rooms.get(kind, ())
        if not any(cpu <= c and gpus <= g and now - t <= self.valid_s for c, g, t in rooms):
            return False
        return e.generation == generation or self._holds(e.generation, kind, cpu, gpus, since)

    def _holds(self, generation: int, kind: bool, cpu: int, gpus: int, since: Since | None) -> bool:
        """Whether what a room found at ``generation`` holds at the latest one."""
        changes = since(generation) if since is not None else None
        return changes is not None and all(self._moot(w, kind, cpu, gpus) for w in changes)

    def _moot(self, wake: Wake, kind: bool, cpu: int, gpus: int) -> bool:
        if wake.device is None:  # unshaped: anything may have changed
            return False
        if wake.nnodes == 1 and (wake.woken or wake.job in self._claimed):
            return True
        return not room_fits(wake.device, wake.nproc, kind, cpu, gpus)

    def asked(self, worker: str, generation: int, cpu: int, gpus: int) -> asyncio.Event | None:
        """A claim of at least this room running for this generation, to wait for."""
        kind = self._kind.get(worker)
        if kind is None:
            return None
        for g, k, c, n, done in self._asking:
            if g == generation and k == kind and cpu <= c and gpus <= n:
                return done
        return None

    def asking(self, worker: str, generation: int, cpu: int, gpus: int) -> asyncio.Event:
        """Mark a claim of this room running; set the event it returns once answered."""
        done = asyncio.Event()
        kind = self._kind.get(worker)
        if kind is not None:
            self._asking.append((generation, kind, cpu, gpus, done))
        return done

    def answered(self, done: asyncio.Event) -> None:
        self._asking = [a for a in self._asking if a[4] is not done]
        done.set()

    def found_nothing(
        self, worker: str, generation: int, probe: Probe, began: float, since: Since | None = None
    ) -> None:
        """Record a claim begun at ``began`` (monotonic) at ``generation`` that found
        nothing. The memory is kept at the latest generation: a finding of another one,
        and the rooms of the memory it replaces, are carried to it where the wake-ups
        between leave them standing (``since``), and dropped where they may not."""
        if probe.has_gpus is None:
            return
        kind = self._kind[worker] = probe.has_gpus
        if not probe.general:
            return
        e = self._empty
        oldest = began - self.valid_s
        if generation > e.generation:
            moved = _Empty(generation)
            for k, rooms in e.rooms.items():
                for c, g, t in rooms:
                    if t >= oldest and self._holds(e.generation, k, c, g, since):
                        moved.add(k, c, g, t, oldest)
            self._empty = e = moved
        elif generation < e.generation and not self._holds(
            generation, kind, probe.cpu, probe.gpus, since
        ):
            return
        e.add(kind, probe.cpu, probe.gpus, began, oldest)

    def found(self, worker: str, probe: Probe, job_id: int | None = None) -> None:
        if probe.has_gpus is not None:
            self._kind[worker] = probe.has_gpus
        if job_id is not None:
            self._claimed[job_id] = None
            if len(self._claimed) > CLAIMED_KEPT:
                del self._claimed[next(iter(self._claimed))]

    def forget(self, worker: str) -> None:
        """A worker registered (again): what it has may have changed."""
        self._kind.pop(worker, None)
