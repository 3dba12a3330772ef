"""Accounting (GET /accounting, `ddpq acct`) on both databases, with attempts driven by hand
through the worker protocol: the totals equal the sum of the attempts' own times, what
they held counted as held (GPUs, else CPU slots); windows add up; every filter; a row
per attempt; bad queries refused naming the field; the CLI's table and CSV."""

from __future__ import annotations

import csv
import dataclasses
import io
from datetime import datetime, timedelta
from typing import Any

import pytest

from service import accounting
from service.db import Database
from service.models import Attempt, Job, utcnow
from service.sweeptables import Sweep, SweepTrial
from tests.conftest import Server, run_ddpq
from tests.helpers import register


def _user(server: Server, name: str) -> Any:
    r = server.client().post("/users", json={"name": name})
    assert r.status_code == 201, r.text
    return server.client(r.json()["token"])


def _claim(server: Server, worker: str, cpu: int, gpus: list[int]) -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/claim",
        json={"name": worker, "free_cpu_slots": cpu, "free_gpus": gpus, "wait_s": 0},
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _finish(server: Server, c: dict[str, Any], worker: str, **how: Any) -> None:
    body = {"worker": worker, "attempt": c["attempt"], "exit_code": 0, **how}
    r = server.client("worker").post(f"/workers/jobs/{c['job_id']}/finish", json=body)
    assert r.status_code == 200, r.text


def _t(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _ran(server: Server, job_id: int) -> list[tuple[datetime, datetime]]:
    """Each attempt's own start and end, as the job's attempts say."""
    items = server.client().get(f"/jobs/{job_id}/attempts").json()["items"]
    return [(_t(a["started_at"]), _t(a["finished_at"])) for a in items]


def _seconds(spans: list[tuple[datetime, datetime]]) -> float:
    return sum((end - start).total_seconds() for start, end in spans)


def test_accounting_adds_up_the_attempts_and_filters_them(server: Server) -> None:
    alice, bob = _user(server, "alice"), _user(server, "bob")
    register(server, "cpu", cpu_slots=4)
    register(server, "gpu", cpu_slots=4, gpus=[0, 1, 2, 3])
    # alice: 2 ranks on CPU slots, one attempt; bob: 2 GPUs, handed back once, then failed.
    a = alice.post("/jobs", json={"entrypoint": "a.py", "device": "cpu", "world_size": 2})
    b = bob.post("/jobs", json={"entrypoint": "b.py", "device": "cuda", "world_size": 2})
    assert a.status_code == b.status_code == 201
    ca = _claim(server, "cpu", 4, [])
    assert ca["job_id"] == a.json()["id"]
    cb = _claim(server, "gpu", 4, [0, 1, 2, 3])
    assert cb["job_id"] == b.json()["id"]
    _finish(server, cb, "gpu", outcome="requeue", exit_code=None)
    cb2 = _claim(server, "gpu", 4, [0, 1, 2, 3])
    assert (cb2["job_id"], cb2["attempt"]) == (b.json()["id"], 2)
    _finish(server, ca, "cpu")
    _finish(server, cb2, "gpu", exit_code=3)
    queued = alice.post("/jobs", json={"entrypoint": "c.py", "device": "cuda", "world_size": 8})
    assert queued.status_code == 201
    ran_a, ran_b = _ran(server, a.json()["id"]), _ran(server, b.json()["id"])
    start = min(s for s, _ in ran_a + ran_b).isoformat()

    whole = alice.get("/accounting", params={"since": start}).json()
    rows = {r["job_id"]: r for r in whole["items"]}
    assert set(rows) == {a.json()["id"], b.json()["id"], queued.json()["id"]}
    ra, rb, rq = rows[a.json()["id"]], rows[b.json()["id"]], rows[queued.json()["id"]]
    assert ra["elapsed_s"] == pytest.approx(_seconds(ran_a), abs=1e-3)
    assert ra["cpu_slot_hours"] == pytest.approx(2 * _seconds(ran_a) / 3600, abs=1e-6)
    assert ra["gpu_hours"] == 0 and ra["workers"] == ["cpu"] and ra["attempts"] == 1
    assert (ra["user"], ra["state"], ra["exit_code"]) == ("alice", "succeeded", 0)
    assert rb["elapsed_s"] == pytest.approx(_seconds(ran_b), abs=1e-3)
    assert rb["gpu_hours"] == pytest.approx(2 * _seconds(ran_b) / 3600, abs=1e-6)
    assert (rb["attempts"], rb["state"], rb["exit_code"]) == (2, "failed", 3)
    first_b = min(start for start, _ in ran_b)
    # To 10 ms: one run in about 15 saw 1.2 ms between this and the attempts' own stamps.
    assert rb["queued_s"] == pytest.approx(
        (first_b - _t(b.json()["created_at"])).total_seconds(), abs=1e-2
    )
    assert rq["elapsed_s"] == 0 and rq["attempts"] == 0 and rq["started_at"] is None
    totals = {t["user"]: t for t in whole["totals"]}
    assert totals["alice"]["jobs"] == 2 and totals["bob"]["jobs"] == 1
    assert totals["bob"]["attempts"] == 2 and totals["alice"]["attempts"] == 1
    assert totals[None]["elapsed_s"] == pytest.approx(_seconds(ran_a + ran_b), abs=1e-3)
    assert totals[None]["gpu_hours"] == pytest.approx(rb["gpu_hours"], abs=1e-9)
    assert whole["totals"][0]["user"] == "bob"  # most GPU-hours first, everyone's last

    # Windows add up: split at the end of bob's first attempt.
    cut = min(ran_b)[1].isoformat()
    early = alice.get("/accounting", params={"since": start, "until": cut}).json()
    late = alice.get("/accounting", params={"since": cut}).json()
    for key in ("elapsed_s", "gpu_hours", "cpu_slot_hours"):
        parts = early["totals"][-1][key] + late["totals"][-1][key]
        assert parts == pytest.approx(whole["totals"][-1][key], abs=1e-6), key

    # A row per attempt, and each filter.
    attempts = alice.get("/accounting", params={"since": start, "per": "attempt"}).json()
    seen = [(r["job_id"], r["attempt"], r["state"]) for r in attempts["items"]]
    assert seen == [  # newest first, as `ddpq ls`
        (b.json()["id"], 2, "failed"),
        (b.json()["id"], 1, "requeued"),
        (a.json()["id"], 1, "succeeded"),
    ]

    def ids(**query: Any) -> set[int]:
        r = alice.get("/accounting", params={"since": start, **query})
        assert r.status_code == 200, r.text
        return {row["job_id"] for row in r.json()["items"]}

    assert ids(user="bob") == {b.json()["id"]}
    assert ids(status="queued") == {queued.json()["id"]}
    assert ids(worker="gpu") == {b.json()["id"]}
    assert ids(limit=1) == {queued.json()["id"]}  # newest first
    page = alice.get("/accounting", params={"since": start, "limit": 1}).json()
    rest = ids(limit=5, cursor=page["next_cursor"])
    assert rest == {a.json()["id"], b.json()["id"]}
    second = alice.get("/accounting", params={"since": start, "per": "attempt", "limit": 2})
    last = ids(per="attempt", limit=5, cursor=second.json()["next_cursor"])
    assert last == {a.json()["id"]}
    assert page["totals"] == whole["totals"]  # over every row, not the page

    for query, field in (
        ({"since": "2030-01-01T00:00:00", "until": "2029-01-01T00:00:00"}, "since"),
        ({"status": "sleeping"}, "status"),
        ({"per": "node"}, "per"),
        ({"cursor": "x"}, "cursor"),
        ({"since": "yesterday"}, "since"),
    ):
        r = alice.get("/accounting", params=query)
        assert r.status_code == 422, (query, r.text)
        assert any(e["loc"][-1] == field for e in r.json()["detail"]), r.text

    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    table = run_ddpq("acct", "--since", start, env=env)
    assert table.returncode == 0, table.stderr
    assert "GPU-H" in table.stdout and "(everyone)" in table.stdout and "bob" in table.stdout
    written = run_ddpq("acct", "--since", start, "--format", "csv", "--per", "attempt", env=env)
    assert written.returncode == 0, written.stderr
    lines = list(csv.DictReader(io.StringIO(written.stdout)))
    assert len(lines) == 3 and {r["user"] for r in lines} == {"alice", "bob"}
    assert sum(float(r["elapsed_s"]) for r in lines) == pytest.approx(
        _seconds(ran_a + ran_b), abs=1e-2
    )
    bad = run_ddpq("acct", "--since", "last tuesday", env=env)
    assert bad.returncode == 2 and "--since" in bad.stderr
    # Usage with its units, and fair share's turns: alice's CPU slots weigh less than
    # bob's GPUs, so her jobs go first among equals.
    usage = run_ddpq("usage", env=env)
    assert "GPU-HOURS 7D" in usage.stdout and "FAIR-SHARE USAGE (GPU-S)" in usage.stdout
    turns = run_ddpq("share", env=env)
    assert turns.returncode == 0, turns.stderr
    assert "usage decays by half every 24 h" in turns.stdout
    assert turns.stdout.index("alice") < turns.stdout.index("bob"), turns.stdout


def test_a_row_names_its_trial_s_sweep_and_the_sweep_filters(db: Database) -> None:
    """A trial's row (per job and per attempt) names its sweep; a job of no sweep none."""
    now = utcnow()
    t0 = now - timedelta(hours=2)
    with db.write() as s:
        sweep = Sweep(owner="alice", status="running", spec={}, seed=1)
        s.add(sweep)
        jobs = []
        for name in ("trial", "plain"):
            job = Job(
                name=name, status="succeeded", spec={}, nproc_per_node=1, nnodes=1,
                device="cpu", max_attempts=1, created_at=t0, owner="alice",
                finished_at=t0 + timedelta(hours=1),
            )  # fmt: skip
            s.add(job)
            s.flush()
            s.add(
                Attempt(
                    job_id=job.id, number=1, worker="w", token_hash=name, gpus=[],
                    checkpoint_dir="/c", started_at=t0, ended_at=t0 + timedelta(minutes=30),
                    outcome="succeeded",
                )
            )  # fmt: skip
            jobs.append(job.id)
        s.flush()
        s.add(SweepTrial(sweep_id=sweep.id, number=0, job_id=jobs[0], params={}, state="complete"))
        sweep_id = sweep.id
    trial, plain = jobs
    for per in ("job", "attempt"):
        q = accounting.Query(since=now - timedelta(days=1), until=now, per=per)
        rows = {r.job_id: r for r in accounting.report(db, q).items}
        assert (rows[trial].sweep, rows[plain].sweep) == (sweep_id, None), per
        assert rows[trial].elapsed_s == pytest.approx(1800.0, abs=1e-3)
        only = accounting.report(db, dataclasses.replace(q, sweep=sweep_id))
        assert [r.job_id for r in only.items] == [trial], per
