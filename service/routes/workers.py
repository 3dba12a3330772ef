"""The worker protocol, with the worker token: register, claim, heartbeat, logs, finish,
leave."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from ddpq.messages import (
    AttemptRef,
    ClaimedJob,
    GangReply,
    HandBack,
    HeartbeatReply,
    HeldAttempt,
    WorkerLeft,
    WorkerRegistered,
)
from service import caches, checkpoints, jobs, logs, outputs, queue, secrets, sweeps
from service.auth import WorkerAuth, mint_job_token
from service.config import Settings
from service.db import Database
from service.deps import (
    DB,
    LOG_CHUNK_BODY,
    LOG_CHUNK_TOO_BIG,
    JobId,
    SettingsDep,
    WakeupDep,
    gone,
    log_chunk,
)
from service.errors import WorkerHasLeft, responses
from service.models import TERMINAL, JobStatus
from service.schemas import (
    ClaimRequest,
    FinishBody,
    GangRequest,
    Heartbeat,
    JobPublic,
    LogAppended,
    OutputsIn,
    OutputsLimits,
    WorkerLeave,
    WorkerName,
    WorkerRegister,
)

router = APIRouter(prefix="/workers", dependencies=[WorkerAuth], tags=["workers"])
# Claims run on threads of their own, not the request pool. SQLite: one thread, since
# claims serialise on its write lock anyway and the claim holding the lock must not
# wait for the GIL behind a crowd of others. Postgres: several, since SKIP LOCKED lets
# claims proceed side by side and each spends most of its time waiting on the server.
CLAIM_THREADS = {"sqlite": 1, "postgresql": 4}
_claim_pools: dict[str, ThreadPoolExecutor] = {}
# How long a claim waits for another of as much room that runs for the same wake-up
# (NothingFits) before looking again; a claim takes milliseconds.
ASKED_WAIT_S = 10.0
NOT_REGISTERED = {404: "no worker of this name is registered"}
NAME_TAKEN = {409: "another worker process holds this name (another identity heartbeats)"}


def _claim_pool(dialect: str) -> ThreadPoolExecutor:
    pool = _claim_pools.get(dialect)
    if pool is None:
        pool = _claim_pools.setdefault(
            dialect,
            ThreadPoolExecutor(CLAIM_THREADS.get(dialect, 1), thread_name_prefix="claim"),
        )
    return pool


@router.post("/register", response_model=WorkerRegistered, responses=responses(NAME_TAKEN))
def register_worker(
    body: WorkerRegister, request: Request, db: DB, settings: SettingsDep
) -> WorkerRegistered:
    """Announce a worker and what it has (again after a restart)."""
    request.app.state.nothing_fits.forget(body.name)
    cluster = body.cluster.model_dump() if body.cluster is not None else None
    queue.register_worker(
        db,
        body.name,
        body.identity,
        body.hostname,
        body.cpu_slots,
        body.gpus,
        body.checkpoint_root,
        cluster,
        [d.model_dump() for d in body.gpu_devices if d.index in body.gpus],
    )
    held: list[HeldAttempt] = []
    if cluster is not None:
        # A bridge's attempts run in Slurm, not in its process: it re-adopts them.
        held = [
            HeldAttempt(job_id=j, attempt=a, external_id=x, timeout_s=t)
            for j, a, x, t in queue.held_attempts(db, body.name)
        ]
    # Attempts the books give this worker but it does not list died with an earlier
    # process of it (whose leftovers it killed before registering): requeue them now
    # rather than at the end of their lease (each end wakes the claimers it concerns).
    else:
        queue.release_worker(db, body.name, keep=[(r.job_id, r.attempt) for r in body.running])
    return WorkerRegistered(
        name=body.name,
        heartbeat_s=request.app.state.pace.interval,
        lease_s=db.policy.lease_s,
        claim_wait_s=request.app.state.pace.claim_wait(settings.max_claim_wait_s),
        held=held,
        gpu_sample_s=settings.gpu_sample_s,
    )


@router.post(
    "/claim",
    response_model=ClaimedJob,
    responses={
        204: {"description": "no job fitted before wait_s ran out, or the worker left"},
        **responses(NOT_REGISTERED),
    },
)
async def claim_job(
    body: ClaimRequest, request: Request, db: DB, settings: SettingsDep, wakeup: WakeupDep
) -> ClaimedJob | Response:
    """Long-poll for the next job that fits the worker's free slots."""
    deadline = time.monotonic() + min(body.wait_s, settings.max_claim_wait_s)
    memo: queue.NothingFits = request.app.state.nothing_fits
    stopping = request.app.state.stopping
    mark = wakeup.mark()
    chosen = False  # woken by a submit for its job: the memo does not answer for it
    # The count of this worker's leaves heard here that its claims have answered for: one
    # heard since sends the poll to the database, which ends it (service.wakeup).
    asked_leaves = wakeup.back(body.name)
    while True:
        seen, seen_own = wakeup.generation, wakeup.own(body.name)
        leaves = wakeup.leaves(body.name)
        if stopping.is_set():  # uvicorn waits for open answers before it exits
            return Response(status_code=204)
        # The slots of this worker's attempts that ended since the poll was sent are free
        # too: the worker reported their processes gone (service.wakeup).
        cpu, gpus = wakeup.freed_since(body.name, mark)
        if cpu or gpus:
            body = body.model_copy(
                update={
                    "free_cpu_slots": body.free_cpu_slots + cpu,
                    "free_gpus": sorted(set(body.free_gpus) | gpus),
                }
            )
            mark = wakeup.mark()
        room = (body.free_cpu_slots, len(body.free_gpus))
        leaving = leaves != asked_leaves
        asked = None if leaving else memo.asked(body.name, seen, *room)
        if asked is not None:
            # A claim of as much room runs for this wake-up: its answer first, then look
            # again (even past wait_s: every request gets its claim, or the memo's no).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asked.wait(), ASKED_WAIT_S)
            chosen = False  # that claim answered for this wake-up: the memo knows now
            continue
        claimed = None
        if (
            leaving
            or chosen
            or not memo.covers(body.name, seen, *room, time.monotonic(), wakeup.since)
        ):
            if await gone(request)():
                # The worker hung up (it died, or restarted and polls anew): a job claimed
                # now would be held by nobody until its lease ran out. (Asked only before
                # a claim: asking costs more than a claim the memo answers.)
                return Response(status_code=204)
            try:
                claimed = await _claim(body, request, db, memo, seen, room)
            except WorkerHasLeft:  # it said it stops (leave_worker): it is handed nothing
                return Response(status_code=204)
            asked_leaves = leaves
            wakeup.rejoined(body.name, leaves)  # registered again since those leaves
        if claimed is not None:  # a gang's slot taken woke its waiters as it committed
            # Serialised here, once: a returned model would be validated a second time.
            return Response(claimed.model_dump_json(), media_type="application/json")
        left = deadline - time.monotonic()
        if left <= 0 or stopping.is_set():
            return Response(status_code=204)
        # Who a submit wakes first, and whether its job fits here (service.wakeup).
        poll_room = (len(body.free_gpus), body.free_cpu_slots, memo.kind(body.name))
        recheck = request.app.state.pace.recheck(settings.claim_recheck_s)
        woke = await wakeup.wait(seen, min(left, recheck), body.name, seen_own, poll_room)
        chosen = woke is not None and woke.woken


async def _claim(
    body: ClaimRequest,
    request: Request,
    db: Database,
    memo: queue.NothingFits,
    seen: int,
    room: tuple[int, int],
) -> ClaimedJob | None:
    """One claim in the database, on the claim threads; what it found goes to ``memo``."""
    token, token_hash = mint_job_token()
    probe = queue.Probe()
    began = time.monotonic()
    started = time.perf_counter()
    done = memo.asking(body.name, seen, *room)
    try:
        claimed = await asyncio.get_running_loop().run_in_executor(
            _claim_pool(db.dialect),
            functools.partial(
                queue.claim_next_job,
                db,
                body.name,
                body.free_cpu_slots,
                body.free_gpus,
                token_hash,
                body.advertise_addr,
                body.rdzv_port,
                probe=probe,
            ),
        )
    finally:
        memo.answered(done)
    request.app.state.telemetry.observe_claim(time.perf_counter() - started, claimed)
    if claimed is None:
        since = request.app.state.wakeup.since  # what it found holds across moot wake-ups
        memo.found_nothing(body.name, seen, probe, probe.at or began, since)
        return None
    memo.found(body.name, probe, claimed.job_id if claimed.nnodes == 1 else None)
    wired = claimed.wire(token)
    if secrets.names_of(wired.spec):
        # The owner's secrets as they are now (a retry gets the current values), or why
        # not, which the worker fails the attempt with (service.secrets).
        keys = request.app.state.keyring
        wired = await run_in_threadpool(secrets.for_claim, db, keys, wired)
    if wired.spec.from_checkpoint is not None:  # a fork: the checkpoint it starts from
        wired = await run_in_threadpool(checkpoints.for_claim, db, wired)
    return wired


@router.post(
    "/leave", response_model=WorkerLeft, responses=responses({**NOT_REGISTERED, **NAME_TAKEN})
)
def leave_worker(body: WorkerLeave, db: DB) -> WorkerLeft:
    """Say this worker is stopping: from now on nothing is claimed for it until it
    registers again, and its open claim long-poll answers 204 at once (on whichever API
    process holds it). Its attempts' heartbeats and finish reports go on while they stop."""
    return WorkerLeft(name=body.name, left_at=queue.leave(db, body.name, body.identity))


@router.post("/gang", response_model=GangReply)
async def wait_for_gang(
    body: GangRequest, request: Request, db: DB, settings: SettingsDep, wakeup: WakeupDep
) -> GangReply:
    """Long-poll on a held node slot of a multi-node job until its gang is complete
    (ready: the rendezvous to start torchrun with) or the slot is released."""
    if body.leave:
        # A slot given back wakes the claimers as it commits (queue.states.release).
        if await run_in_threadpool(queue.leave_gang, db, body.name, body.job_id, body.attempt):
            return GangReply(state="released", reason="left by its worker")
        # Nothing to give back: the gang completed first (ready: the worker must hand the
        # attempt back through finish, or the other nodes wait out their lease), or the
        # slot was released already.
        status = await run_in_threadpool(
            queue.gang_status, db, body.name, body.job_id, body.attempt
        )
        return status
    deadline = time.monotonic() + min(body.wait_s, settings.max_claim_wait_s)
    while True:
        seen = wakeup.generation
        status = await run_in_threadpool(
            queue.gang_status, db, body.name, body.job_id, body.attempt
        )
        left = deadline - time.monotonic()
        if status.state != "forming" or left <= 0 or await gone(request)():
            return status
        await wakeup.wait(seen, min(left, settings.claim_recheck_s))


@router.post(
    "/heartbeat",
    response_model=HeartbeatReply,
    responses=responses({**NOT_REGISTERED, **NAME_TAKEN}),
)
async def send_heartbeat(
    body: Heartbeat, request: Request, db: DB, settings: SettingsDep
) -> Response:
    """Extend the leases of the worker's attempts (storing the samples of their GPUs it
    carries: the jobs' system metrics, and its users' caches when they changed); learn
    which to stop."""
    # async, its work in one hop to a thread: a plain def takes two (the handler, then
    # FastAPI validating the model it returns), a tenth of an idle host's heartbeat in
    # the API's CPU, every host every 2 s. Serialised once, here, as claim_job answers.
    orders = request.app.state.cache_orders
    reply = await run_in_threadpool(_heartbeat, body, db, settings, orders)
    pace = request.app.state.pace
    reply.heartbeat_s, reply.lease_s = pace.handed(), db.policy.lease_s
    reply.claim_wait_s = pace.claim_wait(settings.max_claim_wait_s)
    return Response(reply.model_dump_json(), media_type="application/json")


def _heartbeat(
    body: Heartbeat, db: Database, settings: Settings, orders: caches.Orders
) -> HeartbeatReply:
    """The heartbeat's database work and its reply, on a worker thread."""
    cancel, abandon, preempt = queue.record_heartbeat(
        db,
        body.name,
        [(r.job_id, r.attempt) for r in body.running],
        body.identity,
        {
            (r.job_id, r.attempt): queue.Elsewhere(r.external_id, r.pending)
            for r in body.running
            if r.external_id is not None or r.pending is not None
        },
        {(r.job_id, r.attempt): r.gpu_samples for r in body.running if r.gpu_samples},
        settings.gpu_sample_s,
    )
    prune, drop, send = checkpoints.worker_round(
        db, body.name, body.pruned, body.dropped, body.sent
    )
    clear = caches.worker_round(db, orders, body.name, body.caches, body.cleared)
    return HeartbeatReply(
        cancel=[AttemptRef(job_id=j, attempt=a) for j, a in cancel],
        abandon=[AttemptRef(job_id=j, attempt=a) for j, a in abandon],
        preempt=[HandBack(job_id=j, attempt=a, reason=why) for j, a, why in preempt],
        ended=outputs.due(db, body.kept, settings.outputs_limits()) if body.kept else [],
        prune=prune,
        drop=drop,
        send=send,
        clear=clear,
    )


@router.post(
    "/jobs/{job_id}/logs",
    status_code=202,
    response_model=LogAppended,
    openapi_extra=LOG_CHUNK_BODY,
    responses=responses(
        {
            **LOG_CHUNK_TOO_BIG,
            404: "no such job",
            409: "the attempt is not this worker's or was replaced, or the chunk starts "
            "past what is stored",
        }
    ),
)
async def append_job_log(
    job_id: JobId,
    request: Request,
    db: DB,
    worker: Annotated[WorkerName, Query()],
    attempt: Annotated[int, Query(ge=1, le=2**31 - 1)],
    offset: Annotated[int, Query(ge=0, le=2**62)],
) -> LogAppended:
    """Append raw output bytes of an attempt, starting at ``offset`` of its own stream."""
    data = await log_chunk(request)
    next_offset = await run_in_threadpool(logs.append, db, job_id, attempt, worker, offset, data)
    return LogAppended(next_offset=next_offset)


@router.post(
    "/jobs/{job_id}/finish",
    response_model=JobPublic,
    responses=responses(
        {
            404: "no such job",
            409: "the attempt is not this worker's, a newer one replaced it, or it was "
            "declared lost",
        }
    ),
)
async def finish_attempt(job_id: JobId, body: FinishBody, db: DB) -> JobPublic:
    """Report how an attempt ended (after its processes are gone)."""
    # Claimers are woken as it commits: its worker's own, or everyone's (states.end).
    job = await run_in_threadpool(jobs.finish_attempt, db, job_id, body.worker, body)
    if job.spec.params and (job.status in TERMINAL or job.status == JobStatus.HELD):
        # A trial's that ended, or paused (held): its sweep goes on now.
        await run_in_threadpool(sweeps.trial_ended, db, job_id)
    return job


@router.get("/outputs/limits", response_model=OutputsLimits)
def get_outputs_limits(settings: SettingsDep) -> OutputsLimits:
    """What a worker may send of a job's directory as it ended, and how long it keeps it."""
    return settings.outputs_limits()


@router.post(
    "/jobs/{job_id}/outputs",
    status_code=204,
    responses=responses(
        {
            404: "no such job, or no such snapshot (send the directory first)",
            409: "the attempt is not this worker's or was replaced",
            413: "what the job wrote is over the outputs limits",
        }
    ),
)
def record_outputs(job_id: JobId, body: OutputsIn, db: DB, settings: SettingsDep) -> Response:
    """Record the job's directory as an attempt ended (a snapshot sent first), before the
    attempt's finish."""
    outputs.record(db, job_id, body, settings.outputs_limits())
    return Response(status_code=204)
