"""Sharing the hosts (issue 27): fair share orders jobs of one priority by their owners'
recent usage. Through the worker protocol, on both databases."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server, run_ddpq, start_server, stop_server, terminal, wait_for
from tests.helpers import records, register

JOB = {"recipe": "toy-regression", "world_size": 1, "device": "cpu"}
HOLD_S = 0.3  # how long each claimed job holds the worker's one slot: its use


def claim(server: Server) -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/claim", json={"name": "one", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 5}
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def grant(admin: Any, name: str, cap: int = 10) -> None:
    """Let ``name`` (a member) give jobs a priority up to ``cap``: an admin's grant."""
    r = admin.put(f"/quotas/{name}", json={"max_priority": cap})
    assert r.status_code == 200, r.text


def finish(server: Server, c: dict[str, Any]) -> None:
    r = server.client("worker").post(
        f"/workers/jobs/{c['job_id']}/finish",
        json={"worker": "one", "attempt": c["attempt"], "exit_code": 0},
    )
    assert r.status_code == 200, r.text


def test_three_users_against_one_worker_get_slots_in_fair_share_order(
    db_url: str, tmp_path: Path
) -> None:
    """Alice queues three jobs, then Bob three, then Carol three; one slot. In order of
    submission Alice would run all three first. With fair share, whoever used the slot
    least lately goes next: a, b, c, a, b, c, ... (a short half-life: what Alice
    used before Bob and Carol counts less than what they used after her). A tenth of a
    second: each job's use weighs 2^(0.3 / 0.1) = 8 times the one before it, so a job
    held a little longer on a loaded machine does not turn the order round)."""
    server = start_server(db_url, tmp_path / "api", DDPQ_FAIRSHARE_HALF_LIFE_S="0.1")
    try:
        register(server, "one", cpu_slots=1)
        people = ("alice", "bob", "carol")
        owner: dict[int, str] = {}
        for name in people:
            token = server.client().post("/users", json={"name": name}).json()["token"]
            for _ in range(3):
                job = server.client(token).post("/jobs", json=JOB).json()
                owner[job["id"]] = name
        ran = []
        for _ in range(9):
            c = claim(server)
            ran.append(owner[c["job_id"]])
            time.sleep(HOLD_S)  # the job runs: this is the use that is counted
            finish(server, c)
        assert ran == [*people] * 3, ran
        usage = server.client().get("/usage").json()["items"]
        assert {u["user"] for u in usage} == set(people)
        assert all(u["usage_gpu_s"] > 0 and u["cpu_slot_hours_1d"] > 0 for u in usage), usage
        scrape = server.client().get("/metrics").text
        assert 'ddpq_user_cpu_slot_hours{user="carol",window="1d"}' in scrape, scrape[-2000:]
        assert 'ddpq_user_fairshare_usage_gpu_seconds{user="alice"}' in scrape
        shown = run_ddpq("usage", env={"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token})
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.split()[:7] == [
            "USER", "RUNNING", "QUEUED", "GPU-HOURS", "1D", "GPU-HOURS", "7D",
        ] and "carol" in shown.stdout, shown.stdout  # fmt: skip
    finally:
        stop_server(server)


def test_priority_comes_before_fair_share_and_old_jobs_keep_their_place(server: Server) -> None:
    """A higher priority still goes first; among equals, a user who has used nothing goes
    before one who has; jobs of no one's (from before users existed) share 0."""
    register(server, "one", cpu_slots=1)
    alice = server.client().post("/users", json={"name": "alice"}).json()["token"]
    bob = server.client().post("/users", json={"name": "bob"}).json()["token"]
    grant(server.client(), "alice")
    first = server.client(alice).post("/jobs", json=JOB).json()["id"]
    c = claim(server)
    assert c["job_id"] == first
    time.sleep(HOLD_S)  # Alice's use
    finish(server, c)
    a2 = server.client(alice).post("/jobs", json={**JOB, "priority": 5}).json()["id"]
    a3 = server.client(alice).post("/jobs", json=JOB).json()["id"]
    b1 = server.client(bob).post("/jobs", json=JOB).json()["id"]
    jobs = {j["id"]: j for j in server.client().get("/jobs").json()["items"]}
    assert jobs[a2]["queue_position"] == 1, "priority first"
    assert jobs[b1]["queue_position"] == 2, "then the one who used least"
    assert jobs[a3]["queue_position"] == 3
    taken = []
    for _ in range(3):
        c = claim(server)
        taken.append(c["job_id"])
        finish(server, c)
    assert taken == [a2, b1, a3], taken


def claim_on(server: Server, worker: str, cpu: int = 0, gpus: list[int] | None = None) -> Any:
    r = server.client("worker").post(
        "/workers/claim",
        json={"name": worker, "free_cpu_slots": cpu, "free_gpus": gpus or [], "wait_s": 0},
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def finish_on(server: Server, worker: str, c: dict[str, Any]) -> None:
    r = server.client("worker").post(
        f"/workers/jobs/{c['job_id']}/finish",
        json={"worker": worker, "attempt": c["attempt"], "exit_code": 0},
    )
    assert r.status_code == 200, r.text


def test_quotas_hold_jobs_back_with_the_reason_and_let_them_go(server: Server) -> None:
    """Alice may run one job at once and hold two GPUs: her second job waits, saying
    which limit holds it, while Bob's later job starts; her next starts once the first
    ends, or once an admin lifts her limit. A default ("*") holds everyone without a
    row of their own; a member cannot set quotas."""
    admin = server.client()
    register(server, "gpus", cpu_slots=8, gpus=[0, 1, 2, 3])
    alice = server.client(admin.post("/users", json={"name": "alice"}).json()["token"])
    bob = server.client(admin.post("/users", json={"name": "bob"}).json()["token"])
    assert alice.put("/quotas/alice", json={"max_running": 1}).status_code == 403
    r = admin.put("/quotas/alice", json={"max_running": 1, "max_gpus": 2})
    assert r.status_code == 200 and r.json()["max_running"] == 1, r.text

    gpu_job = {"recipe": "toy-regression", "world_size": 2, "device": "cuda"}
    a1 = alice.post("/jobs", json=gpu_job).json()["id"]
    a2 = alice.post("/jobs", json={**gpu_job, "world_size": 1}).json()["id"]
    b1 = bob.post("/jobs", json=gpu_job).json()["id"]
    first = claim_on(server, "gpus", gpus=[0, 1, 2, 3])
    assert first["job_id"] == a1
    held = alice.get(f"/jobs/{a2}").json()
    assert held["status"] == "queued", held
    assert held["reason"] == "waiting: alice runs 1 of their 1 jobs at once (their quota)", held
    second = claim_on(server, "gpus", gpus=[2, 3])
    assert second["job_id"] == b1, "Bob's later job starts; Alice's waits"
    assert claim_on(server, "gpus", gpus=[]) is None

    # Her running limit lifted: now her GPUs hold the 1-GPU job (2 held + 1 > 2).
    admin.put("/quotas/alice", json={"max_gpus": 2})
    held = alice.get(f"/jobs/{a2}").json()
    assert held["reason"] == (
        "waiting: alice holds 2 of their 2 GPUs and this job needs 1 (their quota)"
    ), held
    finish_on(server, "gpus", second)
    assert claim_on(server, "gpus", gpus=[2, 3]) is None, "Bob's GPUs are free, Alice's are not"
    finish_on(server, "gpus", first)
    third = claim_on(server, "gpus", gpus=[0, 1, 2, 3])
    assert third["job_id"] == a2, "her first job ended: the second starts"
    finish_on(server, "gpus", third)

    # Everyone's default: Bob (no row of his own) may queue two; Alice's own row wins.
    assert admin.put("/quotas/*", json={"max_queued": 2}).status_code == 200
    job = {"recipe": "toy-regression", "world_size": 1, "device": "cpu"}
    assert [bob.post("/jobs", json=job).status_code for _ in range(2)] == [201, 201]
    refused = bob.post("/jobs", json=job)
    assert refused.status_code == 429 and "max_queued 2" in refused.text, refused.text
    before = len(admin.get("/jobs").json()["items"])
    assert bob.post("/jobs", json=job).status_code == 429
    assert len(admin.get("/jobs").json()["items"]) == before, "a refused submit stores nothing"
    assert alice.post("/jobs", json=job).status_code == 201
    listed = {q["user"]: q for q in bob.get("/quotas").json()["items"]}
    assert listed["*"]["max_queued"] == 2 and listed["alice"]["max_gpus"] == 2, listed
    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    shown = run_ddpq("quota", "ls", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split()[:4] == ["USER", "GPUS", "RUNNING", "QUEUED"], shown.stdout
    assert "*" in shown.stdout and "alice" in shown.stdout, shown.stdout
    done = run_ddpq("quota", "set", "carol", "--running", "3", "--max-priority", "5", env=env)
    said = "quota carol: GPUs -, running 3, queued -, max priority 5"
    assert done.stdout.strip() == said, done
    assert run_ddpq("quota", "clear", "carol", env=env).returncode == 0
    assert admin.delete("/quotas/*").status_code == 204
    assert bob.post("/jobs", json=job).status_code == 201
    actions = [e["action"] for e in admin.get("/audit").json()["items"]]
    assert actions.count("quota.set") == 4 and actions.count("quota.clear") == 2, actions


def heartbeat(server: Server, worker: str, running: list[dict[str, Any]]) -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/heartbeat",
        json={"name": worker, "running": [{"job_id": c["job_id"], "attempt": c["attempt"]}
                                          for c in running]},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _preempting(db_url: str, tmp_path: Path) -> Server:
    """A server that preempts by priority, at once."""
    return start_server(
        db_url, tmp_path / "api", DDPQ_PREEMPTION="priority", DDPQ_PREEMPT_MIN_RUN_S="0"
    )


def _bob_and_alice(server: Server, worker: str, slots: int) -> tuple[Any, Any, Any]:
    """A worker of ``slots`` CPU slots, and the admin's, bob's and alice's clients."""
    register(server, worker, cpu_slots=slots)
    admin = server.client()
    bob = server.client(admin.post("/users", json={"name": "bob"}).json()["token"])
    alice = server.client(admin.post("/users", json={"name": "alice"}).json()["token"])
    return admin, bob, alice


def test_a_job_that_outranks_running_ones_takes_only_the_slots_it_needs(
    db_url: str, tmp_path: Path
) -> None:
    """Bob runs three one-rank jobs on a three-slot worker; Alice submits a two-rank job
    at priority 10. Exactly two of Bob's (the lowest ranked: here the newest) are asked
    back through the worker's heartbeat, with the reason; handed back, they are queued
    again without counting a failure, and Alice's job is the next the worker takes."""
    server = _preempting(db_url, tmp_path)
    try:
        admin, bob, alice = _bob_and_alice(server, "three", 3)
        grant(admin, "alice")
        ran = []
        for _ in range(3):
            bob.post("/jobs", json=JOB)
            ran.append(claim_on(server, "three", cpu=3 - len(ran)))
        big = alice.post("/jobs", json={**JOB, "world_size": 2, "priority": 10}).json()["id"]
        waiting = alice.get(f"/jobs/{big}").json()["reason"]
        assert waiting == (
            "waiting for room on worker three: 2 job(s) there were asked to hand back their "
            "slots for it (preemption)"
        ), waiting
        beat = heartbeat(server, "three", ran)
        asked = {p["job_id"]: p["reason"] for p in beat["preempt"]}
        assert sorted(asked) == sorted(c["job_id"] for c in ran[1:]), beat
        assert set(asked.values()) == {f"preempted by job {big} (alice, priority 10)"}
        for c in ran[1:]:  # the worker hands them back, as it does at shutdown
            r = server.client("worker").post(
                f"/workers/jobs/{c['job_id']}/finish",
                json={"worker": "three", "attempt": c["attempt"], "outcome": "requeue"},
            )
            assert r.status_code == 200, r.text
        for c in ran[1:]:
            job = bob.get(f"/jobs/{c['job_id']}").json()
            assert job["status"] == "queued", job
            assert f"(preempted by job {big} (alice, priority 10);" in job["reason"], job
        assert claim_on(server, "three", cpu=2)["job_id"] == big
        assert bob.get(f"/jobs/{ran[0]['job_id']}").json()["status"] == "running", "untouched"
        audit = admin.get("/audit").json()["items"]
        assert sum(e["action"] == "preempt" for e in audit) == 2, audit
        # Handed back, not failed: their next attempt is no retry of a failure.
        attempts = bob.get(f"/jobs/{ran[1]['job_id']}/attempts").json()["items"]
        assert [a["outcome"] for a in attempts] == ["requeued"], attempts
    finally:
        stop_server(server)


def test_preemption_goes_no_further_than_the_priority_cap(db_url: str, tmp_path: Path) -> None:
    """Alice's job at priority 10 (her cap then) waits held while Bob's priority-5 job
    takes the one slot; an admin lowers her cap to 2, which lowers her job. Released, it
    outranks nothing and Bob's job is not asked back; nor may she raise it past the cap.
    Once an admin raises the cap and she raises her job again, it preempts Bob's."""
    server = _preempting(db_url, tmp_path)
    try:
        admin, bob, alice = _bob_and_alice(server, "one", 1)
        grant(admin, "bob", 5)
        grant(admin, "alice", 10)
        hers = alice.post("/jobs", json={**JOB, "priority": 10}).json()["id"]
        assert alice.post(f"/jobs/{hers}/hold").status_code == 200
        his = bob.post("/jobs", json={**JOB, "priority": 5}).json()["id"]
        running = claim_on(server, "one", cpu=1)
        assert running["job_id"] == his

        grant(admin, "alice", 2)
        job = alice.get(f"/jobs/{hers}").json()
        assert (job["priority"], job["spec"]["priority"]) == (2, 10), job
        assert alice.post(f"/jobs/{hers}/release").status_code == 200
        # A submit runs a preemption pass before it answers (the sweeper's waits a
        # lease after the API starts): her job, first in the queue, is looked at and
        # outranks nothing (2 < 5). The nudge itself outranks no one either.
        nudge = {**JOB, "priority": -10}
        assert admin.post("/jobs", json=nudge).status_code == 201
        assert heartbeat(server, "one", [running])["preempt"] == []
        reason = alice.get(f"/jobs/{hers}").json()["reason"] or ""
        assert "preempt" not in reason, reason
        assert _preempts(admin) == []
        over = alice.patch(f"/jobs/{hers}", json={"priority": 10})
        assert over.status_code == 403 and "cap of 2" in over.text, over.text

        grant(admin, "alice", 10)
        assert alice.get(f"/jobs/{hers}").json()["priority"] == 2, "a raised cap raises nothing"
        raised = alice.patch(f"/jobs/{hers}", json={"priority": 10})
        assert raised.status_code == 200, raised.text
        assert admin.post("/jobs", json=nudge).status_code == 201
        asked = heartbeat(server, "one", [running])["preempt"]
        said = f"preempted by job {hers} (alice, priority 10)"
        assert [(p["job_id"], p["reason"]) for p in asked] == [(his, said)], asked
        assert [e["target"] for e in _preempts(admin)] == [f"job {his}"]
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    "env",
    [{"DDPQ_PREEMPTION": "priority", "DDPQ_PREEMPT_MIN_RUN_S": "3600"}, {}],
    ids=["before-its-minimum-run", "off"],
)
def test_no_job_is_preempted_before_its_minimum_run_or_when_off(
    db_url: str, tmp_path: Path, env: dict[str, str]
) -> None:
    server = start_server(db_url, tmp_path / "api", **env)
    try:
        register(server, "one", cpu_slots=1)
        running = server.client().post("/jobs", json=JOB).json()["id"]
        c = claim_on(server, "one", cpu=1)
        assert c["job_id"] == running
        urgent = server.client().post("/jobs", json={**JOB, "priority": 100}).json()["id"]
        assert heartbeat(server, "one", [c])["preempt"] == []
        job = server.client().get(f"/jobs/{urgent}").json()
        assert job["status"] == "queued" and "preempt" not in (job["reason"] or ""), job
    finally:
        stop_server(server)


@pytest.mark.torchrun
def test_a_preempted_job_hands_back_and_resumes_from_its_checkpoint_with_every_step_once(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    """A real 2-rank job on a 2-slot worker is preempted by a priority-10 job: its ranks
    get SIGTERM, it is requeued (no failure counted), the other job runs, and it resumes
    from its last checkpoint, each step stored once. The job that preempts it is a
    2-rank script that imports no torch: what is tested is the preempted one."""
    from tests.test_faults import TRAINER, _checkpointed, _one_series, _submit

    server = start_server(
        db_url, tmp_path / "api", DDPQ_PREEMPTION="priority", DDPQ_PREEMPT_MIN_RUN_S="0"
    )
    try:
        record = tmp_path / "starts.jsonl"
        w = start_worker(server, cpu_slots=2)
        (w.workspace / "trainer.py").write_text(TRAINER)
        (w.workspace / "quick.py").write_text("print('in and out')\n")
        low = _submit(server, record, "--epochs", "6", "--steps", "10")
        wait_for(lambda: _checkpointed(server, low, 20), 120, "the second epoch's checkpoint")
        user = server.client()
        quick = {"entrypoint": "quick.py", "world_size": 2, "device": "cpu", "priority": 10}
        high = user.post("/jobs", json=quick).json()["id"]
        done = terminal(user, high, timeout=180)
        assert done["status"] == "succeeded", user.get(f"/jobs/{high}/logs").text[-3000:]
        final = terminal(user, low, timeout=180)
        log = user.get(f"/jobs/{low}/logs").text
        assert final["status"] == "succeeded", log[-3000:]
        attempts = user.get(f"/jobs/{low}/attempts").json()["items"]
        assert [a["outcome"] for a in attempts] == ["requeued", "succeeded"], attempts
        assert f"preempted by job {high}" in (attempts[0]["reason"] or ""), attempts
        assert "[ddpq] preempted: the job goes back to the queue" in log, log[-3000:]
        assert "[ddpq] resuming from" in log, log[-3000:]
        starts = [s for s in records(record) if s["attempt"] == 2 and s["start_step"] > 0]
        assert starts and starts[0]["start_step"] >= 20, records(record)
        _one_series(server, low, 60)  # every step exactly once
    finally:
        stop_server(server)


# A job that holds its slots until the test releases it (its file), then ends.
HOLD = r"""
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
deadline = time.time() + 180
while not (out / f"release-{os.environ['DDPQ_JOB_ID']}").exists() and time.time() < deadline:
    time.sleep(0.05)
"""


def _running(client: Any, job_id: int) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()
        return job if job["status"] == "running" else None

    found: dict[str, Any] = wait_for(running, 90, f"job {job_id} to run")
    return found


def _preempts(admin: Any) -> list[dict[str, Any]]:
    return [e for e in admin.get("/audit").json()["items"] if e["action"] == "preempt"]


@pytest.mark.torchrun
def test_no_job_is_preempted_for_one_its_owners_gpu_limit_holds_back(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    """Alice holds her 2-GPU limit on one worker, Bob runs a 2-GPU job on the other, and
    Alice submits a 1-GPU job at priority 10. Freeing Bob's GPUs would not start it (her
    limit holds it back), so Bob's job is not asked back: it runs to its end in one
    attempt, and Alice's job says which limit holds it until her first job ends."""
    server = start_server(
        db_url, tmp_path / "api", DDPQ_PREEMPTION="priority", DDPQ_PREEMPT_MIN_RUN_S="0"
    )
    try:
        admin = server.client()
        alice = server.client(admin.post("/users", json={"name": "alice"}).json()["token"])
        bob = server.client(admin.post("/users", json={"name": "bob"}).json()["token"])
        limits = {"max_gpus": 2, "max_priority": 10}
        assert admin.put("/quotas/alice", json=limits).status_code == 200
        out = tmp_path / "out"
        out.mkdir()
        for name in ("A", "B"):
            w = start_worker(server, name=name, gpus="0,1")
            (w.workspace / "hold.py").write_text(HOLD)
        hold = {"entrypoint": "hold.py", "args": [str(out)], "device": "cuda", "world_size": 2}
        a1 = alice.post("/jobs", json=hold).json()["id"]
        on = _running(admin, a1)["worker"]
        b1 = bob.post("/jobs", json=hold).json()["id"]
        assert _running(admin, b1)["worker"] != on
        a2 = alice.post("/jobs", json={**hold, "world_size": 1, "priority": 10}).json()["id"]
        # The pass at that submit ran before it answered: it asked no one back.
        held = admin.get(f"/jobs/{a2}").json()
        assert held["reason"] == (
            "waiting: alice holds 2 of their 2 GPUs and this job needs 1 (their quota)"
        ), held
        assert _preempts(admin) == []
        (out / f"release-{a1}").touch()
        assert terminal(admin, a1)["status"] == "succeeded"
        assert _running(admin, a2)["worker"] == on, "her first job's GPUs are hers again"
        for job in (a2, b1):
            (out / f"release-{job}").touch()
            assert terminal(admin, job)["status"] == "succeeded"
        attempts = admin.get(f"/jobs/{b1}/attempts").json()["items"]
        assert [a["outcome"] for a in attempts] == ["succeeded"], attempts
        assert _preempts(admin) == []
    finally:
        stop_server(server)


def _register_bridge(server: Server) -> None:
    """A Slurm bridge as it registers (tests/test_bridge_protocol.py), with no Slurm."""
    r = server.client("worker").post(
        "/workers/register",
        json={
            "name": "bridge",
            "hostname": "login1",
            "cpu_slots": 0,
            "gpus": [],
            "checkpoint_root": "/shared/ckpt",
            "cluster": {
                "partition": "cpu", "nodes": 1, "cpus_per_node": 2, "gpus_per_node": 0,
                "max_pending": 1,
            },
        },
    )  # fmt: skip
    assert r.status_code == 200, r.text


def test_no_job_on_a_slurm_bridge_is_preempted(db_url: str, tmp_path: Path) -> None:
    """Bob's 2-rank job runs in Slurm through a bridge, his 1-rank job on a 1-slot
    worker; Alice's 2-rank job at priority 10 fits only the bridge's partition. Slurm
    preempts its own: ddpq asks the bridge for nothing, and Alice's job waits for it."""
    server = start_server(
        db_url, tmp_path / "api", DDPQ_PREEMPTION="priority", DDPQ_PREEMPT_MIN_RUN_S="0"
    )
    try:
        _register_bridge(server)
        register(server, "one", cpu_slots=1)
        admin = server.client()
        bob = server.client(admin.post("/users", json={"name": "bob"}).json()["token"])
        alice = server.client(admin.post("/users", json={"name": "alice"}).json()["token"])
        grant(admin, "alice")
        b0 = bob.post("/jobs", json=JOB).json()["id"]
        assert claim_on(server, "one", cpu=1)["job_id"] == b0
        b1 = bob.post("/jobs", json={**JOB, "world_size": 2}).json()["id"]
        c = claim_on(server, "bridge")
        assert c["job_id"] == b1
        ref = {"job_id": b1, "attempt": c["attempt"], "external_id": "81", "pending": None}
        started = server.client("worker").post(
            "/workers/heartbeat", json={"name": "bridge", "running": [ref]}
        )
        assert started.status_code == 200 and started.json()["preempt"] == [], started.text
        a1 = alice.post("/jobs", json={**JOB, "world_size": 2, "priority": 10}).json()["id"]
        beat = server.client("worker").post(
            "/workers/heartbeat", json={"name": "bridge", "running": [ref]}
        )
        assert beat.status_code == 200 and beat.json()["preempt"] == [], beat.text
        assert admin.get(f"/jobs/{b1}").json()["status"] == "running"
        reason = admin.get(f"/jobs/{a1}").json()["reason"]
        assert reason.startswith("waiting for the Slurm bridge bridge"), reason
        assert _preempts(admin) == []
    finally:
        stop_server(server)


def test_no_job_is_preempted_for_one_larger_than_every_worker(db_url: str, tmp_path: Path) -> None:
    """Two 2-slot workers run Bob's jobs; Alice's 3-rank job at priority 10 would need
    more than either has (together they have 4: a job runs on one). Freeing slots would
    not start it: no one is asked back, and it says it is unschedulable."""
    server = start_server(
        db_url, tmp_path / "api", DDPQ_PREEMPTION="priority", DDPQ_PREEMPT_MIN_RUN_S="0"
    )
    try:
        admin = server.client()
        bob = server.client(admin.post("/users", json={"name": "bob"}).json()["token"])
        alice = server.client(admin.post("/users", json={"name": "alice"}).json()["token"])
        grant(admin, "alice")
        ran = {}
        for name in ("x", "y"):
            register(server, name, cpu_slots=2)
            bob.post("/jobs", json={**JOB, "world_size": 2})
            ran[name] = claim_on(server, name, cpu=2)
        big = alice.post("/jobs", json={**JOB, "world_size": 3, "priority": 10}).json()
        assert big["reason"].startswith("unschedulable: needs 3 CPU slots"), big
        for name, c in ran.items():
            assert heartbeat(server, name, [c])["preempt"] == []
        assert _preempts(admin) == []
    finally:
        stop_server(server)


def test_fair_share_preemption_takes_the_slot_of_the_owner_who_used_more(
    db_url: str, tmp_path: Path
) -> None:
    """`fair-share` mode, all at one priority, one 2-slot worker running a job of Bob's
    and one of Alice's; Bob has used the hosts more lately (a job of his ended before).
    Bob's next job outranks no one (Alice used less) and waits; Alice's next one
    outranks Bob's running job, not her own: his is asked back, and hers starts in it."""
    server = start_server(
        db_url,
        tmp_path / "api",
        DDPQ_PREEMPTION="fair-share",
        DDPQ_PREEMPT_MIN_RUN_S="0",
        DDPQ_FAIRSHARE_HALF_LIFE_S="86400",  # no decay within the test
    )
    try:
        register(server, "two", cpu_slots=2)
        admin = server.client()
        bob = server.client(admin.post("/users", json={"name": "bob"}).json()["token"])
        alice = server.client(admin.post("/users", json={"name": "alice"}).json()["token"])
        grant(admin, "alice")
        bob.post("/jobs", json=JOB)
        finish_on(server, "two", claim_on(server, "two", cpu=2))  # Bob's use, counted
        ran = []
        for user in (bob, alice):  # one at a time: Alice's would go first
            job = user.post("/jobs", json=JOB).json()["id"]
            ran.append(claim_on(server, "two", cpu=2 - len(ran)))
            assert ran[-1]["job_id"] == job
        b1 = ran[0]["job_id"]

        b2 = bob.post("/jobs", json=JOB).json()["id"]
        assert heartbeat(server, "two", ran)["preempt"] == [], "Alice used less than Bob"
        assert "preempt" not in admin.get(f"/jobs/{b2}").json()["reason"]
        a2 = alice.post("/jobs", json=JOB).json()["id"]
        asked = heartbeat(server, "two", ran)["preempt"]
        assert [p["job_id"] for p in asked] == [b1], asked
        assert asked[0]["reason"] == f"preempted by job {a2} (alice, priority 0)"
        r = server.client("worker").post(
            f"/workers/jobs/{b1}/finish",
            json={"worker": "two", "attempt": ran[0]["attempt"], "outcome": "requeue"},
        )
        assert r.status_code == 200, r.text
        assert claim_on(server, "two", cpu=1)["job_id"] == a2, "the room went to Alice's job"
        assert [e["target"] for e in _preempts(admin)] == [f"job {b1}"]
    finally:
        stop_server(server)
