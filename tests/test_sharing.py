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
    least lately goes next: a, b, c, a, b, c, ... (a one-second half-life: what Alice
    used before Bob and Carol counts less than what they used after her)."""
    server = start_server(db_url, tmp_path / "api", DDPQ_FAIRSHARE_HALF_LIFE_S="1")
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
