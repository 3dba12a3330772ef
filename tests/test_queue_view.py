"""The queue in order (GET /queue, `ddpq queue`), on both databases: its order is the
order the claims take jobs in (random users, priorities, recent usage and quotas), and an
estimated start is never later than the start a fleet then sees when every job runs to
its time limit (the claims played in virtual time); through the API, each row's words,
the CLI's table, and `ddpq ls --sort position`."""

from __future__ import annotations

import itertools
import json
from datetime import datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete

from service import jobs, queue, queueview
from service.db import Database
from service.models import Attempt, Job, Quota, UserUsage, Worker, utcnow
from service.queue import plan
from service.schemas import FinishRequest, JobSpec
from tests.conftest import Server, run_ddpq
from tests.helpers import register

_tokens = itertools.count()
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _reset(db: Database) -> None:
    with db.write() as s:
        for table in (Attempt, Job, Worker, Quota, UserUsage):
            s.execute(delete(table))


def _claim(db: Database, worker: str, gpus: int) -> queue.Claim | None:
    return queue.claim_next_job(db, worker, 10**6, list(range(gpus)), f"{next(_tokens):064x}")


def _submit(db: Database, owner: str, device: str, ranks: int, priority: int, limit: int) -> int:
    spec = JobSpec(
        entrypoint="t.py", device=device, world_size=ranks, priority=priority, timeout_s=limit
    )  # type: ignore[arg-type]
    return jobs.submit_job(db, spec, None, owner=owner, admin=True).id


owners = st.sampled_from(["alice", "bob", "carol"])
job_specs = st.tuples(owners, st.integers(0, 2))  # (owner, priority)


@SETTINGS
@given(
    queued=st.lists(job_specs, min_size=1, max_size=10),
    usage=st.tuples(*[st.sampled_from([0.0, 5.0, 50.0])] * 3),
    quota=st.tuples(*[st.sampled_from([None, 1, 2])] * 3),
)
def test_the_queue_is_in_the_order_the_claims_take(
    db: Database,
    queued: list[tuple[str, int]],
    usage: tuple[float, float, float],
    quota: tuple[int | None, int | None, int | None],
) -> None:
    _reset(db)
    names = ("alice", "bob", "carol")
    with db.write() as s:
        for name, used, limit in zip(names, usage, quota, strict=True):
            s.add(UserUsage(owner=name, usage=used, updated_at=utcnow()))
            s.add(Quota(owner=name, max_running=limit))
    queue.register_worker(db, "big", None, "host", 1000, [], "/c")
    for owner, priority in queued:
        _submit(db, owner, "cpu", 1, priority, 60)
    shown = queueview.view(db, 1000, 0, None)
    order = [q.job_id for q in shown.items]
    assert [q.position for q in shown.items] == list(range(1, len(order) + 1))

    # A page, and one user's, are the whole queue's rows: the same places, the same next.
    def rows(view: Any) -> list[dict[str, Any]]:  # less what decays with each call's now
        return [
            q.model_dump(exclude={"estimated_start", "estimate", "usage_gpu_s"}) for q in view.items
        ]

    whole = rows(shown)
    assert rows(queueview.view(db, 2, 1, None)) == whole[1:3]
    # A page is a slice of the plan's head of the queue when the head holds it, else read
    # from the index: the same rows either way.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plan, "MAX_PLANNED", 2)
        assert rows(queueview.view(db, 1000, 0, None)) == whole
        assert rows(queueview.view(db, 2, 1, None)) == whole[1:3]
        assert rows(queueview.view(db, 1, 0, None)) == whole[:1]
    bobs = [q for q in whole if q["user"] == "bob"]
    assert rows(queueview.view(db, 2, 1, "bob")) == bobs[1:3]
    assert queueview.view(db, 1, 0, "bob").total == len(bobs)
    taken = []
    while (c := _claim(db, "big", 0)) is not None:
        taken.append(c.job_id)
    assert taken == [j for j in order if j in taken]  # the claims keep the queue's order
    limits = dict(zip(names, quota, strict=True))
    by_owner = {q.job_id: q.user for q in shown.items}
    for j in set(order) - set(taken):  # left only for a quota its owner reached
        owner = by_owner[j]
        assert limits[owner] is not None
        assert sum(by_owner[t] == owner for t in taken) == limits[owner]
    for a, b in itertools.pairwise(shown.items):
        assert a.placed is not None and a.placed.startswith(f"ahead of job {b.job_id}: ")


hosts = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 3)).filter(lambda h: h[0] + h[1] > 0),
    min_size=1,
    max_size=3,
)
trial_jobs = st.lists(
    st.tuples(
        st.just("alice"),
        st.sampled_from(["cpu", "cuda", "auto"]),
        st.integers(1, 3),
        st.integers(0, 1),
        st.integers(1, 50),
    ),
    min_size=1,
    max_size=8,
)


@SETTINGS
@given(workers=hosts, queued=trial_jobs, head=st.integers(0, 3))
def test_an_estimate_is_never_later_than_the_start_the_fleet_sees(
    db: Database,
    workers: list[tuple[int, int]],
    queued: list[tuple[str, str, int, int, int]],
    head: int,
) -> None:
    """Every job runs exactly to its time limit; the claims are played in virtual time
    (at each moment every worker, in name order, claims until it gets nothing). A job
    the plan places starts then no later than its estimate said (a second of slack for
    the reads between), and one it gives no estimate never starts. One owner: fair
    share counts the attempts' real durations, which a virtual clock cannot give (the
    plan's own usage is tested on its own below)."""
    _reset(db)
    for i, (cpu, gpus) in enumerate(workers):
        queue.register_worker(db, f"w{i}", None, "host", cpu, list(range(gpus)), "/c")
    limits = {}
    started: dict[int, float] = {}
    ends: list[tuple[float, int, str, int]] = []  # (virtual time, job, worker, attempt)

    def claims(t: float) -> None:
        for i, (_, gpus) in enumerate(workers):
            while (c := _claim(db, f"w{i}", gpus)) is not None:
                started[c.job_id] = t
                ends.append((t + limits[c.job_id], c.job_id, f"w{i}", c.attempt))

    for n, (owner, device, ranks, priority, limit) in enumerate(queued):
        limits[_submit(db, owner, device, ranks, priority, limit)] = limit
        if n + 1 == head:  # the first jobs run already when the plan is made
            claims(0.0)
    t0 = utcnow()
    shown = {q.job_id: q for q in queueview.view(db, 1000, 0, None).items}
    t = 0.0
    while True:
        claims(t)
        if not ends:
            break
        ends.sort()
        t, job_id, worker, attempt = ends.pop(0)
        jobs.finish_attempt(db, job_id, worker, FinishRequest(attempt=attempt, exit_code=0))
    for job_id, q in shown.items():
        if q.estimated_start is None:
            assert job_id not in started, (q.estimate, started)
            continue
        planned = (q.estimated_start - t0).total_seconds()
        assert job_id in started, (job_id, q.estimate)
        assert planned <= started[job_id] + 1.0, (
            job_id,
            planned,
            started,
            q.estimate,
            workers,
            queued,
        )


def test_the_queue_through_the_api_and_the_cli(server: Server) -> None:
    admin = server.client()
    register(server, "q1", cpu_slots=2)
    running = admin.post(
        "/jobs", json={"entrypoint": "a.py", "device": "cpu", "world_size": 2, "timeout_s": 600}
    ).json()
    r = server.client("worker").post(
        "/workers/claim", json={"name": "q1", "free_cpu_slots": 2, "free_gpus": [], "wait_s": 0}
    )
    assert r.status_code == 200 and r.json()["job_id"] == running["id"]
    low = admin.post("/jobs", json={"entrypoint": "b.py", "device": "cpu", "timeout_s": 60})
    high = admin.post("/jobs", json={"entrypoint": "c.py", "device": "cpu", "priority": 5})
    never = admin.post("/jobs", json={"entrypoint": "d.py", "device": "cpu", "world_size": 4})
    assert low.status_code == high.status_code == never.status_code == 201
    page = admin.get("/queue").json()
    assert [q["job_id"] for q in page["items"]] == [high.json()["id"], low.json()["id"],
                                                    never.json()["id"]]  # fmt: skip
    first, second, third = page["items"]
    assert first["placed"] == f"ahead of job {low.json()['id']}: priority 5 > 0"
    assert second["placed"] == f"ahead of job {never.json()['id']}: submitted before it"
    assert third["placed"] is None
    assert first["position"] == 1 and page["total"] == 3 and page["offset"] == 0
    # The running job holds both slots for its 600 s; then c.py (no limit) takes one for
    # good and b.py the other, 60 s; d.py needs 4 slots, more than the worker has.
    assert first["estimate"] == second["estimate"] == "on worker q1"
    wait = (
        datetime.fromisoformat(first["estimated_start"])
        - datetime.fromisoformat(running["created_at"])
    ).total_seconds()
    assert 590 <= wait <= 610, first
    assert third["estimated_start"] is None
    assert third["estimate"] == "no live worker could ever run it"
    assert third["reason"].startswith("unschedulable")
    assert page["scheduling"]["preemption"] == "off"
    only = admin.get("/queue", params={"user": "nobody"}).json()
    assert only["items"] == [] and only["total"] == 0
    # Room for b.py on a second worker: it waits for its turn, and says what placed it.
    register(server, "q2", cpu_slots=4)
    turn = admin.get(f"/jobs/{low.json()['id']}").json()["reason"]
    owner = low.json()["owner"]
    assert turn == (
        "waiting for its turn: 1 job(s) ahead in the queue "
        f"(by priority, then fair share: {owner}'s recent usage 0.0 GPU-s)"
    )
    assert admin.get("/queue", params={"limit": 0}).status_code == 422

    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    shown = run_ddpq("queue", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "3 queued; preemption off" in shown.stdout and "priority 5 > 0" in shown.stdout
    listed = run_ddpq("ls", "--sort", "position", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    ids = [j["id"] for j in json.loads(listed.stdout)["items"]][:3]
    assert ids == [high.json()["id"], low.json()["id"], never.json()["id"]]


def test_the_plan_grows_each_owners_usage_as_their_jobs_end() -> None:
    """One slot, alice's and bob's jobs of 10 s: as each one ends its owner's usage
    grows, and the other owner's job goes next, as fair share orders them."""
    now = utcnow()
    host = plan.Host("w", cpu_slots=1, gpus=0, free_cpu=1, free_gpus=0)
    waiting = [
        plan.Waiting(i, owner, 0, "cpu", 1, 10.0, None, now)
        for i, owner in enumerate(["alice", "alice", "bob", "bob"], start=1)
    ]
    rules = plan.Rules({"alice": 0.0, "bob": 0.5}, 86400.0, 0.125, 600.0)
    found = plan.plan([host], waiting, now, rules)
    starts = {i: (e.start - now).total_seconds() for i, e in found.items() if e.start}
    assert starts == {1: 0.0, 3: 10.0, 2: 20.0, 4: 30.0}
