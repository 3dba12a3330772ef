"""Everything that moves a job, in random interleavings, on both databases; the
invariants of the state machine (service/queue/states.py) checked after every step.

A Hypothesis state machine drives a real `ddpq serve` through the worker protocol and
the user API: submit (single- and multi-node), claim, heartbeat, finish (every outcome a
worker reports), cancel, a worker that restarts without some of its attempts (as a
lost bridge does), a lease that runs out, a gang that times out, a stale attempt's
token; and, released together on warm connections, pairs of them at the same instant
(cancel and finish, cancel and claim, two claims, finish and a restart, cancel and a
lost lease, finish and fair share's usage sweep). After every step, one consistent read
of the database must show:

- a job holds slots exactly while an attempt of it is live: running or cancelling with
  one live attempt (its current one), otherwise none and, queued, nothing held; a
  multi-node job's node slots count: while its attempt is live it has all of them, one
  per worker, and one at least not ended; queued, its forming gang holds fewer than it
  needs; and no worker's slots are held beyond what it has;
- no two live attempts of one job, and attempts numbered 1..n with the job's the last;
- an ended job has a finish time and no live attempt; every attempt of a job but its
  last ended by putting the job back in the queue; and an ended job has exactly one
  ending attempt, its last, ended the way the job did, unless it was cancelled while it
  waited (then none);
- counted failures never exceed max_attempts, nor the attempts that failed or were lost;
- a stale attempt's token is refused, and a heartbeat tells a worker to stop what is no
  longer its own;
- (a step of its own, as it claims) a queued job's reason agrees with what the claims
  then do, by tests/test_reasons_property.py's helper.

Leases and gangs are expired by calling the service's own sweep (as a second API
process would), with the rows' heartbeats set back, so no step waits for a clock.

Run against the commit before the races of issue 15 were fixed (e285d27, where
cancel_job read the job's row without a lock and wrote a stale status back), with
DDPQ_STATES_RANDOM=1 and DDPQ_STATES_EXAMPLES=40, this test (as c0c76c4 added it) fails
on Postgres by either race c8d3eef fixed: a cancel racing a claim leaves the job
`cancelled` while its attempt 1 still runs, unended (the run c0c76c4's message records,
job 317); a cancel racing a finish leaves it `cancelling` with its one attempt ended
`succeeded` (shrunk to submit, two_claims, cancel_with_finish). Run so four times
again, three failed, showing both.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import bindparam, create_engine, text

from tests.conftest import Server, start_server, stop_server
from tests.helpers import together
from tests.test_reasons_property import agrees

EXAMPLES = int(os.environ.get("DDPQ_STATES_EXAMPLES", "12"))
STEPS = int(os.environ.get("DDPQ_STATES_STEPS", "30"))
SLOTS = 2
ACTIVE = ("running", "cancelling")
TERMINAL = ("succeeded", "failed", "cancelled")
ENDED_AS = {"succeeded": {"succeeded"}, "failed": {"failed", "lost"}}
# A job cancelled while it waited again (after a retry, a hand-back, a lost worker)
# keeps that attempt's end as its last one.
ENDED_AS["cancelled"] = {"cancelled", "lost", "failed", "requeued"}
# How an attempt ends when its job goes back to the queue (retry, lose, hand back).
REQUEUED_AS = {"failed", "lost", "requeued"}
example_ids = itertools.count()
PICK = st.integers(0, 255)  # which of the jobs or attempts at hand
IDS = bindparam("ids", expanding=True)


def ok(r: Any, *codes: int) -> httpx.Response:
    """An answer, never a server error; one of ``codes`` when given."""
    assert isinstance(r, httpx.Response), r
    assert r.status_code < 500, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    if codes:
        assert r.status_code in codes, f"{r.request.url}: {r.status_code} {r.text}"
    return r


class Sweeps:
    """The service's own lease and gang sweeps, called in this process as a second API
    process would, on a Database of its own."""

    def __init__(self, url: str) -> None:
        from service import queue
        from service.db import Database

        self.queue = queue
        self.db = Database(url)
        if hasattr(self.db, "health"):
            # The sweep acts only once the database has been up for a lease (outages);
            # this process has just opened it.
            self.db.health.up_for = lambda seconds: True  # type: ignore[method-assign]

    def leases(self) -> None:
        self.queue.expire_leases(self.db, 60.0)
        if hasattr(self.queue, "expire_nodes"):
            self.queue.expire_nodes(self.db, 60.0)

    def usage(self) -> None:
        """Fair share's sweep: every running attempt's use counted up to now."""
        if hasattr(self.queue, "count_usage"):
            self.queue.count_usage(self.db)

    def gangs(self) -> None:
        if hasattr(self.queue, "expire_gangs"):
            self.queue.expire_gangs(self.db, 0.0, 0.0)


def machine(server: Server, engine: Any, sweeps: Sweeps) -> type[RuleBasedStateMachine]:
    user_clients = [server.client(), server.client()]
    worker_clients = [server.client("worker"), server.client("worker")]
    for c in (*user_clients, *worker_clients):
        c.get("/healthz")  # connected now: a barrier releases requests, not handshakes

    class Jobs(RuleBasedStateMachine):
        claims = Bundle("claims")

        def __init__(self) -> None:
            super().__init__()
            n = next(example_ids)
            self.workers = [f"p{n}a", f"p{n}b"]
            self.jobs: list[int] = []
            # What each worker believes it runs: (job, attempt) -> claim.
            self.held: dict[str, dict[tuple[int, int], dict[str, Any]]] = {
                w: {} for w in self.workers
            }
            self.tokens: list[tuple[int, int, str]] = []  # every attempt's token seen
            for w in self.workers:
                ok(self.register(w, []), 200)

        # ---- the calls ------------------------------------------------------------------

        def register(self, worker: str, running: list[tuple[int, int]]) -> httpx.Response:
            body = {
                "name": worker,
                "hostname": worker,
                "cpu_slots": SLOTS,
                "gpus": [],
                "checkpoint_root": "/ckpt",
                "running": [{"job_id": j, "attempt": a} for j, a in running],
            }
            return worker_clients[0].post("/workers/register", json=body)

        def claim_call(self, worker: str, client: int = 0) -> Callable[[], httpx.Response]:
            body = {
                "name": worker,
                "free_cpu_slots": SLOTS,
                "free_gpus": [],
                "wait_s": 0,
                "advertise_addr": f"10.0.0.{self.workers.index(worker) + 1}",
                "rdzv_port": 29400,
            }
            return lambda: worker_clients[client].post("/workers/claim", json=body)

        def took(self, worker: str, r: httpx.Response) -> None:
            if r.status_code == 200:
                c = r.json()
                assert c["job_id"] in self.jobs, f"{worker} was handed another test's job {c}"
                self.held[worker][(c["job_id"], c["attempt"])] = c
                self.tokens.append((c["job_id"], c["attempt"], c["token"]))

        def finish_call(
            self, worker: str, key: tuple[int, int], how: str, client: int = 1
        ) -> Callable[[], httpx.Response]:
            outcome, _, code = how.partition(":")
            body: dict[str, Any] = {"worker": worker, "attempt": key[1], "outcome": outcome}
            if code:
                body["exit_code"] = int(code)
            return lambda: worker_clients[client].post(f"/workers/jobs/{key[0]}/finish", json=body)

        def finished(self, worker: str, key: tuple[int, int], r: httpx.Response) -> None:
            ok(r, 200, 409, 422)
            self.held[worker].pop(key, None)

        def cancel_call(self, job_id: int, client: int = 0) -> Callable[[], httpx.Response]:
            return lambda: user_clients[client].post(f"/jobs/{job_id}/cancel")

        def set_back(self, worker: str) -> None:
            """The worker's leases ran out: its heartbeats an hour old."""
            old = datetime.now(UTC) - timedelta(hours=1)
            with engine.begin() as conn:
                for table in ("attempts", "job_nodes"):
                    conn.execute(
                        text(f"UPDATE {table} SET heartbeat_at = :old WHERE worker = :w"),
                        {"old": old, "w": worker},
                    )

        # ---- the rules ------------------------------------------------------------------

        @rule(
            nnodes=st.sampled_from([1, 1, 1, 2]),
            ranks=st.integers(1, SLOTS),
            max_attempts=st.integers(1, 3),
            retry_on_error=st.booleans(),
        )
        def submit(self, nnodes: int, ranks: int, max_attempts: int, retry_on_error: bool) -> None:
            spec = {
                "entrypoint": "train.py",
                "world_size": nnodes if nnodes > 1 else ranks,
                "nnodes": nnodes,
                "max_attempts": max_attempts,
                "retry_on_error": retry_on_error,
            }
            r = ok(user_clients[0].post("/jobs", json=spec), 201)
            self.jobs.append(r.json()["id"])

        @rule(worker=st.integers(0, 1))
        def claim(self, worker: int) -> None:
            if not self.jobs:
                return
            name = self.workers[worker]
            self.took(name, ok(self.claim_call(name)(), 200, 204))

        @rule(worker=st.integers(0, 1))
        def heartbeat(self, worker: int) -> None:
            self.beat(self.workers[worker])

        def beat(self, name: str) -> None:
            """``name``'s heartbeat, with what it believes it runs; it drops what it is
            told is no longer its own."""
            sent = sorted(self.held[name])
            body = {"name": name, "running": [{"job_id": j, "attempt": a} for j, a in sent]}
            reply = ok(worker_clients[0].post("/workers/heartbeat", json=body), 200).json()
            abandon = {(a["job_id"], a["attempt"]) for a in reply["abandon"]}
            cancel = {(a["job_id"], a["attempt"]) for a in reply["cancel"]}
            for key in sent:
                mine = self.runs_here(name, key)
                # What is no longer its own it is told to drop; what is, it keeps.
                assert (key in abandon) == (not mine), (key, mine, reply)
                if key in cancel:
                    assert self.status(key[0]) == "cancelling", (key, reply)
            for key in abandon:
                self.held[name].pop(key, None)

        @rule(
            pick=PICK,
            how=st.sampled_from(
                ["exited:0", "exited:1", "exited:137", "requeue", "cancelled", "timeout", "lost"]
            ),
        )
        def finish(self, pick: int, how: str) -> None:
            if held := self.one_held(pick):
                name, key = held
                self.finished(name, key, self.finish_call(name, key, how)())

        @rule(pick=PICK)
        def cancel(self, pick: int) -> None:
            if self.jobs:
                ok(self.cancel_call(self.jobs[pick % len(self.jobs)])(), 202, 409)

        @rule(worker=st.integers(0, 1), keep=st.lists(st.booleans(), max_size=4))
        def restart(self, worker: int, keep: list[bool]) -> None:
            """The worker comes back knowing only some of its attempts (a lost bridge)."""
            name = self.workers[worker]
            kept = [k for k, b in zip(sorted(self.held[name]), keep, strict=False) if b]
            ok(self.register(name, kept), 200)
            self.held[name] = {k: v for k, v in self.held[name].items() if k in kept}

        @rule(worker=st.integers(0, 1))
        def lease_runs_out(self, worker: int) -> None:
            if not self.held[self.workers[worker]]:
                return
            self.set_back(self.workers[worker])
            sweeps.leases()

        @rule()
        def gangs_time_out(self) -> None:
            sweeps.gangs()

        @rule(pick=PICK)
        def stale_token(self, pick: int) -> None:
            if not self.tokens:
                return
            job_id, number, token = self.tokens[pick % len(self.tokens)]
            if self.attempt_is_live(job_id, number):
                return
            metric = {"items": [{"step": 1, "values": {"loss": 1.0}}]}
            r = httpx.post(
                f"{server.url}/jobs/{job_id}/metrics",
                json=metric,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            ok(r, 401, 403, 409)

        @rule(pick=PICK, first=st.integers(0, 1))
        def claim_as_the_reason_says(self, pick: int, first: int) -> None:
            """A queued job's reason, read first, agrees with what the two workers' claims
            (``first``'s first) then do; the user cancels the others first (the helper
            needs it alone in the queue)."""
            with engine.connect() as conn:
                queued = conn.execute(
                    text("SELECT id, nnodes, reason FROM jobs WHERE status = 'queued' ORDER BY id")
                ).all()
            # A single-node job: a gang's reason counts its slots.
            single = [q for q in queued if q.nnodes == 1]
            if not single:
                return
            job_id, _, stored = single[pick % len(single)]
            for other in queued:
                if other.id != job_id:
                    ok(self.cancel_call(other.id)(), 202, 409)
            for name in self.workers:
                self.beat(name)  # both live, as the reason's view and the claim count them
            shown = ok(user_clients[0].get(f"/jobs/{job_id}"), 200).json()["reason"] or ""
            # A requeued job's reason ends with why it was requeued (jobs._with_history).
            reason = shown.removesuffix(f" ({stored})") if stored else shown

            def claim_by(name: str) -> int | None:
                r = ok(self.claim_call(name)(), 200, 204)
                self.took(name, r)
                return int(r.json()["job_id"]) if r.status_code == 200 else None

            order = [self.workers[first], self.workers[1 - first]]
            claims = [functools.partial(claim_by, name) for name in order]
            agrees(reason, job_id, claims, waiting="waiting")

        # ---- two at once ----------------------------------------------------------------

        @rule(pick=PICK, code=st.sampled_from([0, 1, 137]))
        def cancel_with_finish(self, pick: int, code: int) -> None:
            if not (held := self.one_held(pick)):
                return
            name, key = held
            cancel, fin = together(
                self.cancel_call(key[0]), self.finish_call(name, key, f"exited:{code}")
            )
            ok(cancel, 202, 409)
            self.finished(name, key, fin)

        @rule(pick=PICK, worker=st.integers(0, 1))
        def cancel_with_claim(self, pick: int, worker: int) -> None:
            if not self.jobs:
                return
            job_id = self.jobs[pick % len(self.jobs)]
            name = self.workers[worker]
            cancel, claim = together(self.cancel_call(job_id), self.claim_call(name, 1))
            ok(cancel, 202, 409)
            self.took(name, ok(claim, 200, 204))

        @rule()
        def two_claims(self) -> None:
            if not self.jobs:
                return
            a, b = self.workers
            first, second = together(self.claim_call(a, 0), self.claim_call(b, 1))
            self.took(a, ok(first, 200, 204))
            self.took(b, ok(second, 200, 204))

        @rule(pick=PICK)
        def finish_with_restart(self, pick: int) -> None:
            if not (held := self.one_held(pick)):
                return
            name, key = held
            fin, reg = together(
                self.finish_call(name, key, "exited:0"), lambda: self.register(name, [])
            )
            self.finished(name, key, fin)
            ok(reg, 200)
            self.held[name] = {}

        @rule(pick=PICK)
        def cancel_with_lost_lease(self, pick: int) -> None:
            if not (held := self.one_held(pick)):
                return
            name, key = held
            self.set_back(name)
            cancel, _ = together(self.cancel_call(key[0]), sweeps.leases)
            ok(cancel, 202, 409)

        @rule(pick=PICK, how=st.sampled_from(["exited:0", "exited:137", "requeue"]))
        def finish_with_usage_sweep(self, pick: int, how: str) -> None:
            """An attempt ends while fair share counts what the running ones used: both
            lock the attempt and the usage (a deadlock here once answered 503)."""
            if not (held := self.one_held(pick)):
                return
            name, key = held
            fin, swept = together(self.finish_call(name, key, how), sweeps.usage)
            assert not isinstance(swept, Exception), swept
            self.finished(name, key, fin)
            assert fin.status_code != 503, fin.text

        # ---- what the database says -----------------------------------------------------

        def one_held(self, pick: int) -> tuple[str, tuple[int, int]] | None:
            """One attempt a worker believes it runs, or None. Drawn as a number, not
            from the list: what the list holds depends on the server's answers, and
            Hypothesis replays a case only if its draws do not."""
            held = [(w, k) for w in self.workers for k in sorted(self.held[w])]
            return held[pick % len(held)] if held else None

        def status(self, job_id: int) -> str:
            with engine.connect() as conn:
                return str(
                    conn.execute(
                        text("SELECT status FROM jobs WHERE id = :j"), {"j": job_id}
                    ).scalar_one()
                )

        def attempt_is_live(self, job_id: int, number: int) -> bool:
            with engine.connect() as conn:
                row = conn.execute(
                    text(
                        "SELECT a.ended_at, j.status, j.attempt FROM attempts a JOIN jobs j"
                        " ON j.id = a.job_id WHERE a.job_id = :j AND a.number = :n"
                    ),
                    {"j": job_id, "n": number},
                ).first()
            return row is not None and row[0] is None and row[1] in ACTIVE and row[2] == number

        def runs_here(self, worker: str, key: tuple[int, int]) -> bool:
            """Whether ``worker`` still runs attempt ``key`` (or holds its forming node slot)
            by the books: the attempt is live and the job's current, or the slot is held."""
            job_id, number = key
            with engine.connect() as conn:
                job = conn.execute(
                    text("SELECT status, attempt, worker, nnodes FROM jobs WHERE id = :j"),
                    {"j": job_id},
                ).one()
                if job.nnodes > 1:
                    slot = conn.execute(
                        text(
                            "SELECT 1 FROM job_nodes WHERE job_id = :j AND attempt = :n"
                            " AND worker = :w AND ended_at IS NULL"
                        ),
                        {"j": job_id, "n": number, "w": worker},
                    ).first()
                    forming = job.status == "queued" and job.attempt + 1 == number
                    started = job.status in ACTIVE and job.attempt == number
                    return slot is not None and (forming or started)
            return job.status in ACTIVE and job.attempt == number and job.worker == worker

        @invariant()
        def the_books_agree(self) -> None:
            if not self.jobs:
                return
            with engine.connect() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
                ids = {"ids": tuple(self.jobs)}

                def rows(sql: str) -> list[Any]:
                    return list(conn.execute(text(sql).bindparams(IDS), ids).all())

                jobs = rows(
                    "SELECT id, status, attempt, failures, max_attempts, held_cpu_slots,"
                    " worker, finished_at, nnodes FROM jobs WHERE id IN :ids"
                )
                # ends_job: the attempt whose end ended its job (one write stamps both).
                attempts = rows(
                    "SELECT a.job_id, a.number, a.ended_at, a.outcome,"
                    " CASE WHEN a.ended_at = j.finished_at THEN 1 ELSE 0 END AS ends_job"
                    " FROM attempts a JOIN jobs j ON j.id = a.job_id"
                    " WHERE a.job_id IN :ids ORDER BY a.job_id, a.number"
                )
                slots = rows(
                    "SELECT job_id, attempt, worker, ended_at, held_cpu_slots FROM job_nodes"
                    " WHERE job_id IN :ids ORDER BY job_id, attempt, node_rank"
                )
            # Both read in job order.
            of = {k: list(g) for k, g in itertools.groupby(attempts, lambda a: a.job_id)}
            nodes_of = {k: list(g) for k, g in itertools.groupby(slots, lambda n: n.job_id)}
            held: dict[str, int] = {}  # CPU slots held on each worker
            for job in jobs:
                mine = of.get(job.id, [])
                live = [a for a in mine if a.ended_at is None]
                said = [dict(r._mapping) for r in (job, *mine, *nodes_of.get(job.id, []))]
                assert [a.number for a in mine] == list(range(1, len(mine) + 1)), said
                assert len(live) <= 1, said
                if job.status in ACTIVE:
                    # Holding slots: exactly while its current attempt is live.
                    assert [a.number for a in live] == [job.attempt], said
                    if job.nnodes == 1:
                        held[job.worker] = held.get(job.worker, 0) + job.held_cpu_slots
                else:
                    assert live == [], said
                if job.status == "queued":
                    assert job.held_cpu_slots == 0 and job.worker is None, said
                    assert job.attempt == len(mine), said
                for slot in self.node_slots(job, nodes_of.get(job.id, []), said):
                    held[slot.worker] = held.get(slot.worker, 0) + slot.held_cpu_slots
                # Every attempt but the last put its job back in the queue.
                assert all(a.outcome in REQUEUED_AS for a in mine[:-1]), said
                ending = [a.number for a in mine if a.ends_job]
                if job.status in TERMINAL:
                    assert job.finished_at is not None, said
                    if mine:
                        assert mine[-1].outcome in ENDED_AS[job.status], said
                    # One ending attempt, its last; none if it was cancelled waiting.
                    waited = job.status == "cancelled" and not ending
                    assert ending == ([] if waited else [len(mine)]), said
                    if waited and mine:
                        assert mine[-1].outcome in REQUEUED_AS, said
                else:
                    assert ending == [], said
                assert job.failures <= job.max_attempts, said
                failed = sum(a.outcome in ("failed", "lost") for a in mine)
                assert job.failures <= failed, said
            for worker, cpu in held.items():
                assert cpu <= SLOTS, (worker, held, [dict(j._mapping) for j in jobs])

        def node_slots(self, job: Any, slots: list[Any], said: Any) -> list[Any]:
            """``job``'s node slots that hold their workers' slots (rules.NODE_LIVE), checked
            against its status: while its attempt is live it has all of them, one per
            worker, one not ended at least; queued, its gang is not yet complete."""
            if job.nnodes == 1:
                assert slots == [], said
                return []
            assert job.held_cpu_slots == 0, said  # its slots hold, not its row
            current = [n for n in slots if n.attempt == job.attempt]
            forming = [n for n in slots if n.attempt == job.attempt + 1]
            if job.status in ACTIVE:
                assert len(current) == job.nnodes, said
                assert len({n.worker for n in current}) == job.nnodes, said
                holding = [n for n in current if n.ended_at is None]
                assert holding, said
                return holding
            if job.status == "queued":
                assert len(forming) < job.nnodes, said  # a complete gang starts at once
                assert len({n.worker for n in forming}) == len(forming), said
                assert all(n.ended_at is None for n in forming), said
                return forming
            return []

        def teardown(self) -> None:
            """Leave nothing of this example's that a later one could claim, nor a live
            worker that a later one's reasons would count (it never claims again)."""
            for job_id in self.jobs:
                ok(self.cancel_call(job_id)(), 202, 409)
            for name in self.workers:
                ok(self.register(name, []), 200)  # it lost whatever it ran
            gone = text("UPDATE workers SET last_heartbeat = :old WHERE name IN :w")
            with engine.begin() as conn:
                old = datetime.now(UTC) - timedelta(hours=1)
                conn.execute(
                    gone.bindparams(bindparam("w", expanding=True)), {"old": old, "w": self.workers}
                )

    return Jobs


def test_no_interleaving_breaks_the_state_machine(db_url: str, tmp_path: Any) -> None:
    server = start_server(
        db_url,
        tmp_path / "api",
        DDPQ_RETRY_BACKOFF_S="0",
        DDPQ_PREEMPTION="off",
    )
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        Jobs = machine(server, engine, Sweeps(db_url))
        run_state_machine_as_test(
            Jobs,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                derandomize=os.environ.get("DDPQ_STATES_RANDOM") != "1",
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
        assert "Traceback" not in server.log(), server.log()[-4000:]
    finally:
        engine.dispose()
        stop_server(server)
