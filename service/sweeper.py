"""The background work of every API process, beside the requests it serves: the
sweeper's rounds (expired leases and gangs, fair-share usage, preemption, accounting's
rollup, code collection, history retention, sweeps' decisions), which process takes
them (SweepTurn), and on Postgres the LISTEN that wakes this process's claimers for work
another process queued. The app (service.app) starts both in its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from service import code as code_store
from service import outputs, queue, retention, rollup, sweeps
from service.config import Settings
from service.db import Database, Policy, libpq_conninfo
from service.models import utcnow
from service.pace import Pace
from service.schemas import OutputsLimits
from service.wakeup import Wake, Wakeup

log = logging.getLogger("ddpq.service")


# A retention round works for at most this long (its transactions each delete at most
# service.retention.BATCH_ROWS rows); with nothing due, the next looks this much later,
# or sooner when the retention periods are short (a quarter of the shortest, from 1 s).
RETENTION_BUDGET_S = 1.0
RETENTION_IDLE_S = 60.0
# The sweeps' decisions run this often between the other rounds (by the turn's holder):
# a trial's end is refilled, and a rung it reached is judged, within a second rather
# than a whole round (bench/sweep.py: the 5 s round left slots idle 3.4-4 s per trial).
# With no sweep running a round is one indexed read.
SWEEPS_ROUND_S = 1.0
# The leases' sweep looks this long after the soonest lease's end.
LEASE_PAST_S = 0.01


def _retention_every(policy: Policy) -> float:
    every = (
        policy.metrics_downsample_after_s,
        policy.log_retention_s,
        policy.job_retention_s,
        policy.audit_retention_s,
    )
    periods = [p for p in every if p is not None]
    return min([RETENTION_IDLE_S, *(max(p / 4, 1.0) for p in periods)])


# A round of accounting's rollup (service.rollup) works for at most this long: after an
# upgrade, a year of history is added a few thousand attempts a transaction, round by round.
ROLLUP_BUDGET_S = 0.5


# The advisory lock whose holder sweeps (SweepTurn): "ddsw" in ASCII. Not "ddpq", the
# migrations' (migrations/env.py): a sweeper holds its lock for its whole life, and a
# second `ddpq serve` would wait on it forever to migrate. Advisory locks are per
# database, so two ddpq databases on one server do not share it.
SWEEP_LOCK = 0x64647377
SWEEP_APPLICATION = "ddpq-sweep"  # the holder's connection, as pg_stat_activity names it


class SweepTurn:
    """Whether this process sweeps leases, gangs, usage and code this round.

    Every API process on a database (``ddpq serve --workers N``, or several hosts) runs
    the sweeper loop, but on Postgres only the one holding a session advisory lock does
    the work: the sweeps are safe side by side (each change is a guarded UPDATE), yet N
    of them would do every scan N times for nothing. The lock lives on a connection of
    its own, so it goes with the process: when the holder dies or loses the database,
    the next process to try takes over within a round. SQLite has one process."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._conn: Any = None  # a psycopg connection, autocommit
        self._held = False

    @property
    def held(self) -> bool:
        """As the last round found (mine): read by the leases' sweep."""
        return self._held

    def mine(self) -> bool:
        """Blocking (run it on a thread)."""
        if self.db.dialect != "postgresql":
            self._held = True
            return True
        import psycopg  # here: an API on SQLite never loads the Postgres driver

        try:
            if self._conn is None or self._conn.closed:
                self._held = False
                self._conn = psycopg.connect(
                    libpq_conninfo(self.db.url),
                    autocommit=True,
                    connect_timeout=5,
                    application_name=SWEEP_APPLICATION,
                )
            if self._held:
                self._conn.execute("SELECT 1")  # the connection, and so the lock, lives
            else:
                row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (SWEEP_LOCK,))
                self._held = bool(row.fetchone()[0])
            return self._held
        except psycopg.Error as exc:
            log.warning("sweep lock connection lost (%s); trying again next round", exc)
            self.close()
            return False

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
        self._held = False


async def run(app: FastAPI) -> None:
    """The sweeper loop of one API process, until it stops (app.begin_shutdown): a
    round every few seconds, done only while this process holds the turn (SweepTurn),
    and beside it the leases' sweep (``_leases``)."""
    settings: Settings = app.state.settings
    db: Database = app.state.db
    interval = max(0.5, min(settings.lease_s / 3, settings.gang_timeout_s / 3, 5.0))
    # Code no job needs is collected every quarter of its retention period (1 s to 10 min).
    code_every = min(max(settings.code_retention_s / 4, 1.0), 600.0)
    code_swept = asyncio.get_running_loop().time()
    turn = SweepTurn(db)
    retention_at = 0.0  # the next retention round (service.retention), by the loop's clock
    # The round's steps and the leases' sweep take turns: each step is short (a budget of
    # a second at most), and the two never decide on the same rows at once, as one loop.
    steps = asyncio.Lock()
    leases = asyncio.create_task(_leases(app, turn, steps, interval))
    try:
        while True:
            waited = 0.0
            while waited < interval:
                step = min(SWEEPS_ROUND_S, interval - waited)
                await asyncio.sleep(step)
                waited += step
                if app.state.stopping.is_set():
                    return
                if turn.held and waited < interval:
                    async with steps:
                        await _sweeps_round(db)
            await _pace_round(app)
            if await run_in_threadpool(turn.mine):
                now = asyncio.get_running_loop().time()
                if now >= retention_at:
                    async with steps:
                        limits = settings.outputs_limits()
                        retention_at = now + await _retention_round(db, limits)
                code_swept = await _sweep_once(app, code_swept, code_every, steps)
                async with steps:
                    await _sweeps_round(db)
    finally:
        leases.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leases
        await run_in_threadpool(turn.close)


async def _leases(app: FastAPI, turn: SweepTurn, steps: asyncio.Lock, interval: float) -> None:
    """The leases' sweep, as the soonest lease runs out (queue.lease_due), by the turn's
    holder: a host that stops is lost at the end of its lease, not up to a round later,
    nor after the round's other steps (at 1,000 hosts it was lost 2-6 s late)."""
    clock = asyncio.get_running_loop().time
    at = clock()
    while not app.state.stopping.is_set():
        await asyncio.sleep(max(0.0, min(SWEEPS_ROUND_S, at - clock())))
        if clock() < at:
            continue
        if not turn.held:
            at = clock() + SWEEPS_ROUND_S
            continue
        async with steps:
            began = clock()
            at = began + await _leases_round(app.state.db, interval)


async def _pace_round(app: FastAPI) -> None:
    """The heartbeat interval and lease for the fleet's size now (service.pace), in every
    API process: each answers heartbeats, and the one holding the turn expires leases."""
    db: Database = app.state.db
    pace: Pace = app.state.pace
    try:
        live = await run_in_threadpool(queue.live_count, db, db.policy.lease_s)
    except Exception:  # a database outage: the pace stays as it was
        log.exception("counting the live workers failed")
        return
    if pace.update(live, asyncio.get_running_loop().time()):
        words = "%d live workers: heartbeat every %.3g s, lease %.3g s"
        log.info(words, live, pace.interval, pace.lease)
        db.policy = dataclasses.replace(db.policy, lease_s=pace.lease)
    # What a claim that found nothing tells the idle polls holds for half a re-check, so
    # a change that wakes nobody (a retry's backoff running out) is seen within 1.5.
    app.state.nothing_fits.valid_s = pace.recheck(app.state.settings.claim_recheck_s) / 2


async def _retention_round(db: Database, outputs: OutputsLimits) -> float:
    """One round of history retention (service.retention); returns how long until the next."""
    try:
        swept = await run_in_threadpool(retention.sweep, db, RETENTION_BUDGET_S, outputs)
        if swept.points or swept.logs or swept.purged or swept.audit:
            log.info(
                "retention: %d metric point(s) of %d job(s) downsampled away, "
                "the logs of %d job(s) deleted, %d job(s) purged, %d audit row(s) deleted",
                swept.points,
                swept.jobs,
                swept.logs,
                swept.purged,
                swept.audit,
            )
        # A backlog (an upgrade, a retention shortened) goes on each round.
        return 0.0 if not swept.done else _retention_every(db.policy)
    except Exception:
        log.exception("retention sweep failed")
        return RETENTION_IDLE_S


async def _sweep_once(
    app: FastAPI, code_swept: float, code_every: float, steps: asyncio.Lock
) -> float:
    """One round of the sweeper, each step taking its turn with the leases' sweep
    (``steps``); returns when code was last collected."""
    settings: Settings = app.state.settings
    db: Database = app.state.db
    if asyncio.get_running_loop().time() - code_swept >= code_every:
        code_swept = asyncio.get_running_loop().time()
        try:
            # Jobs' directories as they ended, and checkpoints sent for forks.
            keep = outputs.kept(settings.outputs_limits()) | queue.fork_snapshots_kept()
            async with steps:
                gone = await run_in_threadpool(
                    code_store.collect, db, settings.code_retention_s, keep
                )
            if any(gone):
                log.info("collected %d code snapshot(s) and %d content(s)", *gone)
        except Exception:
            log.exception("code collection failed")
    try:
        # Gangs time out by the clock alone, not by heartbeats: no lease wait here.
        async with steps:
            released = await run_in_threadpool(
                queue.expire_gangs, db, settings.gang_timeout_s, settings.retry_backoff_s
            )
        if released:  # their slots' release woke the claimers as it committed
            log.warning("gangs timed out for jobs %s", released)
    except Exception:
        log.exception("gang sweep failed")
    try:  # accounting: what ended since, added to its hours (a backlog, a batch a round)
        async with steps:
            await run_in_threadpool(rollup.roll, db, ROLLUP_BUDGET_S)
    except Exception:
        log.exception("accounting rollup failed")
    try:
        async with steps:
            await run_in_threadpool(queue.count_usage, db)  # fair share: running use
        async with steps:
            await run_in_threadpool(queue.preempt_sweep, db)  # wakes the claimers if it marks
    except Exception:
        log.exception("usage or preemption sweep failed")
    return code_swept


async def _leases_round(db: Database, interval: float) -> float:
    """Lose the attempts and node slots whose lease ran out; how long from its start
    until the next look: just past the soonest lease left (at most ``interval``: a lease
    the pace shortens is seen then)."""
    # Heartbeats could not arrive while this process was down or the database was
    # unreachable, whichever query noticed it: leases expire only once the database
    # has answered for a full lease since it last recovered (service.db.Health).
    lease_s = db.policy.lease_s  # service.pace: as the fleet's size sets it
    if not db.health.up_for(lease_s):
        return SWEEPS_ROUND_S
    now = utcnow()  # one cutoff for the sweep and for what is due after it
    try:
        changed = await run_in_threadpool(queue.expire_leases, db, lease_s, now)
        changed += await run_in_threadpool(queue.expire_nodes, db, lease_s, now)
        if changed:  # states.end woke the claimers as each committed
            log.warning("leases expired for jobs %s", changed)
        due = await run_in_threadpool(queue.lease_due, db, lease_s, now)
    except Exception:  # the sweep must outlive a database outage
        log.exception("lease sweep failed")
        return SWEEPS_ROUND_S
    if due is None:
        return interval
    # A lease that ran out by the sweep's cutoff and is still held is a row the sweep does
    # not act on (or not yet): looked at again a round later, never in a busy loop. Else
    # just past the soonest one's end: a stamp is compared with the cutoff strictly, and a
    # look at its very end would find it still held and wait a round (seen: 1 s late).
    return min(interval, due + LEASE_PAST_S if due > 0 else SWEEPS_ROUND_S)


async def _sweeps_round(db: Database) -> None:
    """The sweeps' decisions (service.sweeps): by one process, the turn's holder, so two
    never decide the same round (the sweep's row lock would keep them right anyway)."""
    try:
        await run_in_threadpool(sweeps.sweep_round, db)
    except Exception:
        log.exception("sweeps round failed")


def listen_for_jobs(url: str, wakeup: Wakeup, stop: threading.Event) -> None:
    """Postgres LISTEN: wake this process's claimers when another API process queues or
    frees something (its own commits woke them already: Database.on_commit)."""
    import psycopg  # here: an API on SQLite never loads the Postgres driver

    conninfo = libpq_conninfo(url)
    while not stop.is_set():
        try:
            with psycopg.connect(
                conninfo, autocommit=True, connect_timeout=5, application_name="ddpq-listen"
            ) as conn:
                conn.execute(f"LISTEN {queue.NOTIFY_CHANNEL}")
                while not stop.is_set():
                    for note in conn.notifies(timeout=1.0, stop_after=1):
                        wake = Wake.heard(note.payload)
                        if wake is not None:  # not this process's own: woken at its commit
                            wakeup.wake(wake)
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost (%s); reconnecting", exc)
            stop.wait(1.0)
