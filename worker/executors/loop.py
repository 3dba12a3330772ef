"""The worker's one loop, whatever runs its attempts: register, claim, heartbeat, hand a
claimed attempt to the executor, report how each ends, re-adopt after a restart, stop.

An executor is what runs attempts: worker.executors.agent (torchrun on this host) or
worker.executors.bridge (a Slurm partition). It says what it registers with and what room it has for
a claim, starts and stops attempts, and what each attempt's heartbeat carries; the loop does the
talking to the API, once for every executor. An executor whose attempts run outside this
process (``detached``: Slurm runs them) leaves them running when the loop stops, and is
handed them back (``adopt``) when it starts again; the others' stop with it, handed back
to the queue.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ddpq.errors import ApiRefused, ApiUnavailable
from ddpq.messages import CLAIM_WAIT_S, AttemptKey, ClaimedJob, HeartbeatReply, HeldAttempt
from ddpq.wire import Backoff
from worker import health
from worker.edges.api import WorkerAPI, claim_or_wait, retry
from worker.executors.settings import WorkerSettings
from worker.files.caches import Caches
from worker.files.checkpoints import Pruner
from worker.files.code import Workdirs
from worker.files.sending import Sender
from worker.starting.outcome import Outcome
from worker.starting.venvs import Venvs
from worker.walled.walls import Walls

log = logging.getLogger("ddpq.worker")

CLAIM_HANDBACK_WAIT_S = 30.0
# How long a stopping worker waits for the API to take its leave before it waits out its
# claim long-poll instead (the API away or hung).
LEAVE_TIMEOUT_S = 5.0
MAX_KEPT = 10_000  # job directories a heartbeat asks about (the API's limit)


@dataclass(frozen=True)
class Room:
    """What a claim may take: free CPU slots and GPUs (none for a bridge: Slurm holds
    them), and where node 0 of a gang would host its rendezvous."""

    cpu_slots: int = 0
    gpus: tuple[int, ...] = ()
    advertise_addr: str | None = None
    rdzv_port: int | None = None


@dataclass(frozen=True)
class Stop:
    """An attempt a heartbeat's reply asks this worker to stop, why, and the service's
    words for it (a preemption names the job it makes room for)."""

    job_id: int
    attempt: int
    why: str  # cancelled, preempted, abandoned (worker.starting.outcome.STOP_REASONS)
    words: str | None = None


class Executor(Protocol):
    """What runs a worker's attempts."""

    # Its attempts run outside this process: they outlive a stop and are re-adopted.
    detached: bool

    def describe(self) -> str:
        """One line for the log once registered: what this worker offers."""
        ...

    def registration(self) -> dict[str, Any]:
        """What it registers with besides its name: its slots, or its partition's shape."""
        ...

    def attempts(self) -> list[dict[str, Any]]:
        """Its live attempts as a heartbeat carries them (job_id, attempt, and what the
        executor adds: a Slurm job id, why Slurm holds it pending)."""
        ...

    def adopt(self, held: list[HeldAttempt]) -> None:
        """Take back the attempts the books still give it (after a restart)."""
        ...

    def room(self, stop: threading.Event) -> Room | None:
        """What the next claim may take, or None (after waiting a while) for none."""
        ...

    def start(self, claim: ClaimedJob, room: Room) -> None:
        """Run a claimed attempt (in a thread of its own: this returns at once)."""
        ...

    def stop(self, job_id: int, attempt: int, why: str, words: str | None = None) -> None:
        """Stop an attempt (worker.starting.outcome.STOP_REASONS); it reports its end itself."""
        ...

    def rounds(self) -> list[tuple[str, float, Callable[[], None]]]:
        """What else it does every so often: (what, every seconds, one round)."""
        ...

    def gpu_samples(self) -> dict[AttemptKey, list[dict[str, Any]]]:
        """The GPU use of its attempts sampled since the last call, by (job, attempt),
        for the next heartbeat to carry (schemas.GpuSampleIn); none without NVML."""
        ...

    def drain(self) -> None:
        """Once stopped: wait for its attempts in this process to end."""
        ...


def stops(reply: HeartbeatReply) -> list[Stop]:
    """What a heartbeat's reply asks of this worker's attempts, in order: stop the
    cancelled ones, hand back the preempted ones, drop those no longer its own."""
    return [
        *(Stop(r.job_id, r.attempt, "cancelled") for r in reply.cancel),
        *(Stop(r.job_id, r.attempt, "preempted", r.reason) for r in reply.preempt),
        *(Stop(r.job_id, r.attempt, "abandoned") for r in reply.abandon),
    ]


def finish(
    api: WorkerAPI,
    job_id: int,
    attempt: int,
    result: Outcome,
    why: str | None = None,
    handback_after: threading.Event | None = None,
) -> None:
    """Report how an attempt ended, retrying until the API takes it (an exit status is
    never dropped), given why the worker stopped it, if it did: nothing for an attempt no
    longer its own (the service already moved the job on); a shutdown's hand-back only
    once ``handback_after`` is set (the worker's own claim long-poll has ended: answered
    earlier, it would wake that very poll and the stopping worker take the job again)."""
    if why == "abandoned":
        return
    if result.outcome == "requeue" and why == "shutdown" and handback_after is not None:
        handback_after.wait(timeout=CLAIM_HANDBACK_WAIT_S)
    body = {
        "attempt": attempt,
        "exit_code": result.exit_code,
        "outcome": result.outcome,
        "reason": result.reason,
    }
    if result.oom is not None:  # said only when the worker looked (an older API: unknown)
        body["oom"] = result.oom
    try:
        retry(lambda: api.finish(job_id, body), what=f"finish job {job_id}")
    except ApiRefused as exc:
        log.warning("job %s: finish refused: %s", job_id, exc)


class Loop:
    """One worker's conversation with the API, for the executor that runs its attempts.
    Holds what every executor shares: the API client, the data dir, the jobs' code
    directories and environments."""

    def __init__(
        self,
        executor: Executor,
        settings: WorkerSettings,
        *,
        token: str,
        default_name: str,
        identity: str | None = None,
        walls: Walls | None = None,
    ) -> None:
        self.executor = executor
        self.settings = settings
        self.url = settings.url.rstrip("/")
        self.name = settings.name or default_name
        self.workspace = settings.workspace.resolve()
        self.data_dir = settings.data_dir.resolve()
        checkpoint_dir = settings.checkpoint_dir
        self.checkpoint_root = (checkpoint_dir or self.data_dir / "checkpoints").resolve()
        # Deletes the checkpoints the API lets go (keep_last, retention) under that root.
        self.pruner = Pruner(self.checkpoint_root)
        self.api = WorkerAPI(self.url, token, self.name, identity)
        # Sends the checkpoints forks elsewhere want (service.queue.forks) to the API.
        self.sender = Sender(self.checkpoint_root, self.api)
        self.workdirs = Workdirs(self.data_dir, settings.code_cache_bytes, settings.keep_workdirs_s)
        self.venvs = Venvs(self.data_dir / "venvs", settings.max_envs, walls, settings.pip_policy())
        # Each user's caches across their jobs here (started by an executor that uses them).
        self.caches = Caches(self.data_dir / "caches", settings.cache_bytes, walls or Walls(None))
        self.heartbeat_s = 2.0
        self.claim_wait_s = CLAIM_WAIT_S  # the service's, once registered (service.pace)
        self.gpu_sample_s = 5.0  # the service's, once registered
        self.stopping = threading.Event()
        self.claimer_done = threading.Event()  # the claim loop has returned (a stop)
        self._all_done = threading.Event()

    # ---- talking to the API ----------------------------------------------------------

    def register(self) -> list[HeldAttempt]:
        """Register (again), waiting out an API that is away: the attempts the books
        still give this worker (a bridge's, after a restart)."""

        def body() -> dict[str, Any]:
            common = {
                "name": self.name,
                "hostname": socket.gethostname(),
                "checkpoint_root": str(self.checkpoint_root),
            }
            return {**common, **self.executor.registration()}

        reply = retry(lambda: self.api.register(body()), what="register", stop=self.stopping)
        self.caches.registered()  # a fresh database knows none of them: sent again
        self.heartbeat_s = reply.heartbeat_s
        self.claim_wait_s = reply.claim_wait_s or CLAIM_WAIT_S
        self.gpu_sample_s = reply.gpu_sample_s
        health.record(self.data_dir, self.heartbeat_s)
        return list(reply.held)

    def heartbeat_once(self) -> None:
        running = self.executor.attempts()
        # The GPU samples ride on the heartbeat: no request of their own. Lost with a
        # heartbeat that fails (a gap in the job's system metrics, nothing more).
        samples = self.executor.gpu_samples()
        if samples:
            running = [
                {**item, "gpu_samples": samples[key]}
                if (key := (item["job_id"], item["attempt"])) in samples
                else item
                for item in running
            ]
        keys = {(item["job_id"], item["attempt"]) for item in running}
        pruned, dropped = self.pruner.reports()
        sent = self.sender.reports()
        # The caches only when they changed since a heartbeat's answer took them.
        report, cleared = self.caches.report(), self.caches.cleared()
        version, caches = report if report is not None else (None, None)
        try:
            reply = self.api.heartbeat(
                running, self.workdirs.kept()[:MAX_KEPT], pruned, dropped, caches, cleared, sent
            )
        except ApiUnavailable as exc:
            log.warning("heartbeat: API unavailable (%s)", exc)
            return
        except ApiRefused as exc:
            if exc.status == 404:  # the service forgot us (e.g. a fresh database)
                self.register()
            elif exc.status == 409:
                # Another process registered this name after our heartbeats went stale
                # and took our jobs over: ours are duplicates now, and so are we (a
                # detached executor's attempts are that process's to re-adopt).
                log.error("stopping: %s", exc)
                if not self.executor.detached:
                    for job_id, attempt in keys:
                        self.executor.stop(job_id, attempt, "abandoned")
                self.stopping.set()
            else:
                log.warning("heartbeat refused: %s", exc)
            return
        if reply.heartbeat_s is not None:  # the fleet's pace (service.pace): grows with it
            self.heartbeat_s = reply.heartbeat_s
        if reply.claim_wait_s is not None:
            self.claim_wait_s = reply.claim_wait_s
        health.record(self.data_dir, self.heartbeat_s)
        self.pruner.answered(pruned, dropped)
        self.sender.answered(sent)
        self.caches.answered(version, cleared)
        if reply.clear:
            self.caches.clear(reply.clear)
        if reply.prune or reply.drop:
            self.pruner.take(reply.prune, reply.drop, running={job_id for job_id, _ in keys})
        if reply.send:
            self.sender.take(reply.send)
        if reply.ended:
            self.workdirs.ended(reply.ended, running={job_id for job_id, _ in keys})
        for s in stops(reply):
            if (s.job_id, s.attempt) not in keys:
                continue
            if s.why == "abandoned":
                log.warning("job %s attempt %s is no longer ours; stopping it", s.job_id, s.attempt)
            elif s.why == "preempted":
                log.info("job %s attempt %s: %s; handing it back", s.job_id, s.attempt, s.words)
            else:
                log.info("job %s attempt %s: %s; stopping it", s.job_id, s.attempt, s.why)
            self.executor.stop(s.job_id, s.attempt, s.why, s.words)

    def finish(self, job_id: int, attempt: int, result: Outcome, why: str | None = None) -> None:
        finish(self.api, job_id, attempt, result, why, self.claimer_done)

    def leave(self) -> None:
        """Tell the API this worker stops (POST /workers/leave): nothing more is claimed
        for it, and its open claim long-poll is answered now rather than when it runs out.
        Its attempts' heartbeats and finish reports go on while they stop. Asked once,
        briefly: if the API does not take it, the poll is waited out as before."""
        try:
            self.api.leave(LEAVE_TIMEOUT_S)
        except Exception as exc:  # a refusal, no answer, or one unread: the stop goes on
            log.warning("leave: %s; waiting for the open claim long-poll to end", exc)
            return
        log.info("%s: left the queue: no job is claimed for it until it starts again", self.name)

    # ---- the threads ---------------------------------------------------------------------

    def _round(self, step: Callable[[], None], what: str, pause_s: float = 0.0) -> None:
        try:
            step()
        except Exception:  # a loop never dies of one bad round
            log.exception("%s failed; going on", what)
            self.stopping.wait(pause_s)

    def _every(self, every: float, step: Callable[[], None], what: str) -> None:
        while not self.stopping.wait(every):
            self._round(step, what)

    def _heartbeats(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            self._round(self.heartbeat_once, "heartbeat")
        # Keep the leases of attempts that stop with this process while they stop.
        while (
            not self.executor.detached
            and self.executor.attempts()
            and not self._all_done.wait(self.heartbeat_s)
        ):
            self._round(self.heartbeat_once, "heartbeat")

    def _claims(self) -> None:
        backoff = Backoff()

        def claim_one() -> None:
            room = self.executor.room(self.stopping)
            if room is None:
                return
            claim = claim_or_wait(
                functools.partial(
                    self.api.claim,
                    room.cpu_slots,
                    list(room.gpus),
                    self.claim_wait_s,
                    room.advertise_addr,
                    room.rdzv_port,
                ),
                stop=self.stopping,
                backoff=backoff,
                register=self.register,
            )
            if claim is not None:
                self.executor.start(claim, room)

        try:
            while not self.stopping.is_set():
                self._round(claim_one, "claim", pause_s=1.0)
        finally:
            self.claimer_done.set()

    def run(self, first: Callable[[], None] = lambda: None) -> None:
        """Serve until SIGTERM or SIGINT, then stop: leave the queue (``leave``), and an
        executor's attempts in this process are handed back to it, a detached one's go on
        running. ``first`` runs before registering (once a signal already stops the loop)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        first()
        self.executor.adopt(self.register())
        log.info("%s", self.executor.describe())
        claimer = threading.Thread(target=self._claims, name="claim", daemon=True)
        threads = [
            threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True),
            *(
                threading.Thread(target=self._every, args=(every, s, what), name=what, daemon=True)
                for what, every, s in self.executor.rounds()
            ),
            claimer,
        ]
        for t in threads:
            t.start()
        self.stopping.wait()
        self.leave()
        attempts = self.executor.attempts()
        if self.executor.detached:
            log.info(
                "%s: stopping; %d job(s) go on running, re-adopted at its next start",
                self.name,
                len(attempts),
            )
        else:
            log.info("worker %s: shutting down; stopping %d job(s)", self.name, len(attempts))
            for item in attempts:
                self.executor.stop(item["job_id"], item["attempt"], "shutdown")
        # The leave ended the claim's open long-poll: the claimer returns now. A claim the
        # API committed before the leave is answered first, and handed straight back (the
        # executor's start). Without the leave (the API away) the poll runs out; a large
        # fleet's longer one (service.pace) is not waited out past this bound: the
        # process's exit closes it, and the API claims nothing for a poll whose worker
        # hung up (routes.workers).
        claimer.join(timeout=CLAIM_WAIT_S + 20)
        self.executor.drain()
        self._all_done.set()
        self.api.close()
