"""Sharing the hosts (issue 27): fair share orders jobs of one priority by their owners'
recent usage. Through the worker protocol, on both databases."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.conftest import Server, run_ddpq, start_server, stop_server
from tests.helpers import register

JOB = {"recipe": "toy-regression", "world_size": 1, "device": "cpu"}
HOLD_S = 0.3  # how long each claimed job holds the worker's one slot: its use


def claim(server: Server) -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/claim", json={"name": "one", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 5}
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


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
        shown = run_ddpq("usage", env={"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token})
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.split()[:7] == [
            "USER", "RUNNING", "QUEUED", "GPU-H", "1D", "GPU-H", "7D",
        ] and "carol" in shown.stdout, shown.stdout  # fmt: skip
    finally:
        stop_server(server)


def test_priority_comes_before_fair_share_and_old_jobs_keep_their_place(server: Server) -> None:
    """A higher priority still goes first; among equals, a user who has used nothing goes
    before one who has; jobs of no one's (from before users existed) share 0."""
    register(server, "one", cpu_slots=1)
    alice = server.client().post("/users", json={"name": "alice"}).json()["token"]
    bob = server.client().post("/users", json={"name": "bob"}).json()["token"]
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
    done = run_ddpq("quota", "set", "carol", "--running", "3", env=env)
    assert done.stdout.strip() == "quota carol: GPUs -, running 3, queued -", done
    assert run_ddpq("quota", "clear", "carol", env=env).returncode == 0
    assert admin.delete("/quotas/*").status_code == 204
    assert bob.post("/jobs", json=job).status_code == 201
    actions = [e["action"] for e in admin.get("/audit").json()["items"]]
    assert actions.count("quota.set") == 4 and actions.count("quota.clear") == 2, actions
