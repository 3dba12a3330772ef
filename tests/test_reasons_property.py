"""The reason a queued job shows agrees with what the claim does, on random states.

Random workers (CPU slots, GPUs, alive or silent) with random jobs already running on
them, and one queued job of a random device and size: the job's reason says "waiting
for a worker to claim it" exactly when a live worker's claim takes it; otherwise it
names what it waits for (slots, or a worker that could ever run it) and no live
worker's claim takes it. Both the reason (service.queue.reasons) and the claim
(service.queue.claim) read the same rules and books; this checks they stay agreed.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select, update

from service import jobs, queue
from service.db import Database, Policy, upgrade
from service.models import (
    Attempt,
    Checkpoint,
    Job,
    JobNode,
    LogChunk,
    MetricPoint,
    Quota,
    UserUsage,
    Worker,
)
from service.models import utcnow as now
from service.queue import books, reasons
from service.queue.books import capacities
from service.schemas import FinishRequest, JobSpec

CLAIMS_FIT = "waiting for a worker to claim it"
_tokens = itertools.count()


@dataclass(frozen=True)
class WorkerState:
    cpu_slots: int
    gpus: int
    alive: bool
    # (device, ranks) of jobs this worker was given before the one under test.
    running: tuple[tuple[str, int], ...]


devices = st.sampled_from(["cpu", "cuda", "auto"])
worker_states = st.builds(
    WorkerState,
    cpu_slots=st.integers(0, 4),
    gpus=st.integers(0, 3),
    alive=st.booleans(),
    running=st.lists(st.tuples(devices, st.integers(1, 3)), max_size=3).map(tuple),
)


@pytest.fixture
def preempting_db(db_url: str) -> Iterator[Database]:
    """The same, with preemption on (by priority, no minimum run)."""
    if db_url.startswith("sqlite"):
        upgrade(db_url)
    database = Database(db_url, Policy(preemption="priority", preempt_min_run_s=0))
    yield database
    database.dispose()


def _reset(db: Database) -> None:
    with db.write() as s:
        for table in (
            MetricPoint, Checkpoint, LogChunk, JobNode, Attempt, Job, Worker, Quota, UserUsage,
        ):  # fmt: skip
            s.execute(delete(table))


def _submit(
    db: Database, device: str, ranks: int, priority: int = 0, owner: str | None = None
) -> int:
    spec = JobSpec(recipe="toy-regression", world_size=ranks, device=device, priority=priority)  # type: ignore[arg-type]
    return jobs.submit_job(db, spec, None, owner=owner, admin=True).id  # no priority cap


def _claim(db: Database, name: str, state: WorkerState) -> queue.Claim | None:
    # The worker reports everything free: what is held is the service's books' to say.
    token = f"{next(_tokens):064x}"
    return queue.claim_next_job(db, name, 10**6, list(range(state.gpus)), token)


def _run(db: Database, i: int, w: WorkerState, device: str, ranks: int, owner: str | None) -> None:
    """A job worker ``i`` was given before the one under test, if it fits there."""
    filler = _submit(db, device, ranks, owner=owner)
    if _claim(db, f"w{i}", w) is None:
        jobs.cancel_job(db, filler)  # it did not fit: only the job under test waits


def _arrange(
    db: Database,
    workers: list[WorkerState],
    owner: str | None = None,
    owners: Iterator[str] | None = None,
    full: bool = False,
) -> None:
    """Register the workers and give each the jobs it runs (``owner``'s, or each the next
    of ``owners``), and with ``full`` one more of each unit that takes what is left;
    silence the dead ones."""
    for i, w in enumerate(workers):
        queue.register_worker(db, f"w{i}", None, "host", w.cpu_slots, list(range(w.gpus)), "/c")
    for i, w in enumerate(workers):
        for device, ranks in w.running:
            _run(db, i, w, device, ranks, next(owners) if owners else owner)
        if full:
            with db.read() as s:
                [cap] = [c for c in capacities(s, db.policy.lease_s) if c.name == f"w{i}"]
            for device, n in (("cuda", len(cap.free_gpus)), ("cpu", cap.free_cpu)):
                if n:
                    _run(db, i, w, device, n, next(owners) if owners else owner)
    silent = now() - timedelta(seconds=db.policy.lease_s * 3)
    with db.write() as s:
        for i, w in enumerate(workers):
            if not w.alive:
                s.execute(
                    update(Worker).where(Worker.name == f"w{i}").values(last_heartbeat=silent)
                )


def _agrees(
    db: Database, workers: list[WorkerState], job_id: int, order: object, waiting: str
) -> None:
    """The job's reason, read now, agrees with what the live workers' claims (in a random
    order) then do (``agrees``)."""
    reason = jobs.get_job(db, job_id).reason or ""
    live = [i for i, w in enumerate(workers) if w.alive]
    order.shuffle(live)  # type: ignore[attr-defined]

    def claim_by(i: int) -> int | None:
        claim = _claim(db, f"w{i}", workers[i])
        return None if claim is None else claim.job_id

    agrees(reason, job_id, [functools.partial(claim_by, i) for i in live], waiting)


def agrees(reason: str, job_id: int, claims: list[Callable[[], int | None]], waiting: str) -> None:
    """``reason``, a queued job's, read before the live workers' ``claims`` (each makes
    one and returns the id of the job it took, or None; they stop at the first that
    takes one), agrees with what they do: CLAIMS_FIT exactly when one of them takes the
    job; any other reason starts with ``waiting`` (or says it is unschedulable) and no
    claim takes the job. Only that job may be queued. (Also tests/test_states_property.)"""
    taken_by = None
    for i, claim in enumerate(claims):
        took = claim()
        if took is not None:
            assert took == job_id, f"only the job under test is queued, and {took} was taken"
            taken_by = i
            break

    if reason == CLAIMS_FIT:
        assert taken_by is not None, f"the reason says a live worker can take it: {reason!r}"
    else:
        assert taken_by is None, f"claim {taken_by} took a job whose reason is {reason!r}"
        assert reason.startswith((waiting, "unschedulable")), reason


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    workers=st.lists(worker_states, max_size=4),
    device=devices,
    ranks=st.integers(1, 5),
    order=st.randoms(use_true_random=False),
)
def test_the_reason_agrees_with_the_claim(
    db: Database, workers: list[WorkerState], device: str, ranks: int, order: object
) -> None:
    _reset(db)
    _arrange(db, workers)
    job_id = _submit(db, device, ranks, priority=1)
    _agrees(db, workers, job_id, order, waiting="waiting for")


limits = st.one_of(st.none(), st.integers(0, 4))


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    workers=st.lists(worker_states, max_size=3),
    device=devices,
    ranks=st.integers(1, 3),
    max_running=limits,
    max_gpus=limits,
    order=st.randoms(use_true_random=False),
)
def test_the_reason_agrees_with_the_claim_under_quotas(
    db: Database,
    workers: list[WorkerState],
    device: str,
    ranks: int,
    max_running: int | None,
    max_gpus: int | None,
    order: object,
) -> None:
    """The same, where the jobs already running are the owner's and their limits are
    random: a job its owner's limits hold back says so (its reason names the quota), and
    no claim takes it; one they let go agrees with the claim as before."""
    _reset(db)
    _arrange(db, workers, owner="alice")
    with db.write() as s:
        s.add(Quota(owner="alice", max_running=max_running, max_gpus=max_gpus))
        s.flush()
        queue.refresh_quota_flags(s, "alice")
    job_id = _submit(db, device, ranks, priority=1, owner="alice")
    _agrees(db, workers, job_id, order, waiting="waiting")


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    workers=st.lists(worker_states, max_size=3),
    device=devices,
    ranks=st.integers(1, 4),
    order=st.randoms(use_true_random=False),
)
def test_the_reason_agrees_with_the_claim_under_preemption(
    preempting_db: Database, workers: list[WorkerState], device: str, ranks: int, order: object
) -> None:
    """With preemption on, the job under test (priority 1) outranks every running one:
    its submit may ask some to hand back. Its reason still agrees with the claim: while
    room is made it says so, and no claim takes it until the room is free."""
    db = preempting_db
    _reset(db)
    _arrange(db, workers)
    job_id = _submit(db, device, ranks, priority=1)
    _agrees(db, workers, job_id, order, waiting="waiting")


@pytest.fixture(params=["priority", "fair-share"])
def sharing_db(db_url: str, request: pytest.FixtureRequest) -> Iterator[Database]:
    """Preemption on (in either mode, no minimum run), for jobs of owners with limits."""
    if db_url.startswith("sqlite"):
        upgrade(db_url)
    database = Database(db_url, Policy(preemption=request.param, preempt_min_run_s=0))
    yield database
    database.dispose()


def _agree_all(db: Database, workers: list[WorkerState], ids: list[int], order: object) -> None:
    """Several queued jobs' reasons, read now, agree with what one claim of each live
    worker (in a random order) then does: a job whose reason says it does not fit now
    (slots, its quota, a worker) is taken by none; when one says a claim takes it, some
    claim takes a job (the first that could take it would, if no claim before it
    took one: a claim taken first may put the owner at a limit)."""
    reasons = {i: jobs.get_job(db, i).reason or "" for i in ids}
    for i, reason in reasons.items():  # a turn's words name what placed the job: fair share
        if reason.startswith("waiting for its turn"):
            owner = jobs.get_job(db, i).owner
            said = f"by priority, then fair share: {owner}'s recent usage"
            assert (said in reason) == (owner is not None), reason
    live = [i for i, w in enumerate(workers) if w.alive]
    order.shuffle(live)  # type: ignore[attr-defined]
    taken = set()
    for i in live:
        claim = _claim(db, f"w{i}", workers[i])
        if claim is not None:
            assert claim.job_id in reasons, "only the jobs looked at are queued"
            taken.add(claim.job_id)
    for job_id, reason in reasons.items():
        if reason.startswith(CLAIMS_FIT):
            assert taken, f"job {job_id}'s reason says a live worker can take it: {workers}"
        elif not reason.startswith("waiting for its turn"):
            assert job_id not in taken, f"job {job_id} was taken; its reason is {reason!r}"


usages = st.sampled_from([0.0, 1.0, 100.0])
# Busy live workers, mostly: preemption needs running jobs to take slots of.
busy_workers = st.builds(
    WorkerState,
    cpu_slots=st.integers(1, 4),
    gpus=st.integers(0, 3),
    alive=st.sampled_from([True, True, True, False]),
    running=st.lists(st.tuples(devices, st.integers(1, 2)), min_size=1, max_size=3).map(tuple),
)
# Limits that often bind: an owner at their limit is what the preemption pass must see.
tight = st.sampled_from([None, 0, 1, 2, 3])


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    workers=st.lists(busy_workers, min_size=1, max_size=3),
    runners=st.lists(st.sampled_from(["alice", "bob"]), min_size=1, max_size=9),
    full=st.booleans(),
    device=devices,
    ranks=st.integers(1, 3),
    priority=st.sampled_from([0, 1, 1]),
    alice=st.tuples(tight, tight, usages),
    bob=st.tuples(tight, tight, usages),
    order=st.randoms(use_true_random=False),
)
def test_the_reasons_agree_with_the_claims_under_preemption_and_quotas(
    sharing_db: Database,
    workers: list[WorkerState],
    runners: list[str],
    full: bool,
    device: str,
    ranks: int,
    priority: int,
    alice: tuple[int | None, int | None, float],
    bob: tuple[int | None, int | None, float],
    order: object,
) -> None:
    """Preemption (by priority, or by fair share among equals) with random limits and
    recent usage for both the owners of the running jobs (alice, bob) and the owner of
    the job under test (alice, priority 0 or 1). A job is preempted only for one that
    then starts: while the room is made its reason says so (not its quota), and once
    the victims hand back, the claim of that worker takes it. The victims' reasons say
    who took their slots and agree with the claims; with none preempted, the job's
    reason agrees with the claims as before."""
    db = sharing_db
    _reset(db)
    with db.write() as s:  # recent usage, which fair share ranks owners by
        for name, (_, _, usage) in (("alice", alice), ("bob", bob)):
            s.add(UserUsage(owner=name, usage=usage, updated_at=now()))
    _arrange(db, workers, owners=itertools.cycle(runners), full=full)
    with db.write() as s:
        for name, (max_running, max_gpus, _) in (("alice", alice), ("bob", bob)):
            s.add(Quota(owner=name, max_running=max_running, max_gpus=max_gpus))
            s.flush()
            queue.refresh_quota_flags(s, name)
    job_id = _submit(db, device, ranks, priority=priority, owner="alice")
    with db.read() as s:
        victims = s.execute(
            select(Job.id, Job.worker, Job.attempt).where(Job.preempted_by == job_id)
        ).all()
        making = s.scalar(select(Job.preempting_on).where(Job.id == job_id))
    if not victims:
        _agrees(db, workers, job_id, order, waiting="waiting")
        return
    reason = jobs.get_job(db, job_id).reason or ""
    assert making is not None and reason.startswith(f"waiting for room on worker {making}"), (
        f"{len(victims)} job(s) asked to hand back for a job whose reason is {reason!r}"
    )
    for victim in victims:  # their worker hands them back, as at shutdown
        jobs.finish_attempt(
            db, victim.id, victim.worker, FinishRequest(attempt=victim.attempt, outcome="requeue")
        )
    assert (jobs.get_job(db, job_id).reason or "") == CLAIMS_FIT
    claim = _claim(db, making, workers[int(making[1:])])
    assert claim is not None and claim.job_id == job_id, "the room went to another"
    ids = [v.id for v in victims]
    for v in ids:
        assert f"preempted by job {job_id} (alice, priority {priority})" in (
            jobs.get_job(db, v).reason or ""
        )
    _agree_all(db, workers, ids, order)


def _shape_key(c: books.Shape) -> tuple[object, ...]:
    part = c.partition
    return (c.name, part, c.cpu_slots, c.gpus, c.free_cpu, c.free_gpus, c.live)


def test_the_summary_gives_the_reasons_of_the_per_worker_view(db: Database) -> None:
    """On a mixed fleet (GPU workers busy, full, two alike, one idle; CPU-only workers;
    a dead one; a Slurm bridge; a gang forming on the idle one), the summary grouped in
    SQL (books.summary, what the reasons read) is the per-worker books (capacities)
    counted by shape, and every queued job's reason, and a strict submit's verdict
    (books.totals), is the same decided on either."""
    gpu8, cpu4 = list(range(8)), 4
    for name, cpu, gpus in (
        ("busy", 8, gpu8), ("full", 8, gpu8), ("idle1", 8, gpu8), ("alike1", 8, gpu8),
        ("alike2", 8, gpu8), ("cpu-small", cpu4, []),
        ("cpu-big", 16, []), ("dead", 8, gpu8),
    ):  # fmt: skip
        queue.register_worker(db, name, None, "host", cpu, gpus, "/c")
    queue.register_worker(
        db, "bridge", None, "login", 0, [], "/c",
        {"partition": "small", "nodes": 1, "cpus_per_node": 2, "gpus_per_node": 0,
         "max_pending": 2},
    )  # fmt: skip

    def run(worker: str, device: str, ranks: int, gpus: list[int]) -> None:
        job_id = _submit(db, device, ranks)
        claim = queue.claim_next_job(db, worker, 64, gpus, f"{next(_tokens):064x}")
        assert claim is not None and claim.job_id == job_id, (worker, device, ranks)

    for device, ranks in (("cuda", 1), ("cuda", 2), ("auto", 2), ("cpu", 3)):
        run("busy", device, ranks, gpu8)
    run("full", "cuda", 8, gpu8)
    run("alike1", "cuda", 6, gpu8)
    run("alike2", "cuda", 6, gpu8)
    run("cpu-small", "cpu", 2, [])
    run("dead", "cuda", 3, gpu8)
    gang = jobs.submit_job(db, JobSpec(recipe="toy-regression", world_size=8, nnodes=2), None)
    node = queue.claim_next_job(db, "idle1", 8, gpu8, f"{next(_tokens):064x}", "10.0.0.1", 29500)
    assert node is not None and node.job_id == gang.id  # one node slot of two: forming
    silent = now() - timedelta(seconds=db.policy.lease_s * 3)
    with db.write() as s:
        s.execute(update(Worker).where(Worker.name == "dead").values(last_heartbeat=silent))
    queued = [
        _submit(db, device, ranks)
        for device, ranks in (
            ("cuda", 1), ("cuda", 2), ("cuda", 3), ("cuda", 8), ("cuda", 16), ("cpu", 1),
            ("cpu", 8), ("cpu", 32), ("auto", 4), ("auto", 12), ("auto", 24),
        )
    ]  # fmt: skip
    for spec in (
        JobSpec(recipe="toy-regression", world_size=8, nnodes=2),
        JobSpec(recipe="toy-regression", world_size=6, nnodes=3, device="cpu"),
        JobSpec(recipe="toy-regression", world_size=64, nnodes=4, device="auto"),
    ):
        queued.append(jobs.submit_job(db, spec, None).id)
    queued.append(gang.id)

    with db.read() as s:
        caps = capacities(s, db.policy.lease_s)
        per_worker = books.shapes(caps)
        grouped = books.summary(s, db.policy.lease_s)
        counted: dict[tuple[object, ...], int] = {}
        for c in per_worker:
            counted[_shape_key(c)] = counted.get(_shape_key(c), 0) + 1
        assert {_shape_key(c): c.count for c in grouped} == counted
        assert len(grouped) == len(caps) - 1  # the two alike are one row

        rows = list(s.scalars(select(Job).where(Job.id.in_(queued)).order_by(Job.id)))
        positions = {job.id: i + 1 for i, job in enumerate(rows)}
        summarised = queue.pending_reasons(s, rows, positions)
        assert summarised == reasons.reasons_on(s, rows, positions, per_worker)
        assert "waiting for 8 GPUs; the most free on one worker is 4" in summarised.values()
        for job in rows:
            assert reasons.unschedulable(s, job) == reasons.unschedulable_on(per_worker, job)
