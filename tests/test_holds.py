"""Holding, releasing and changing a queued job (`ddpq hold/release/update`), on both
databases, through a real `ddpq serve`: a held job keeps its id and its place and no claim
takes it; illegal moves are refused (409) naming the state; a member acts only on their own
jobs and releases only their own holds, within their priority cap; a held job counts
against the queued limit; each act and each refusal is audited; a hold racing a claim,
many rounds, leaves one winner.

Each test runs on the module's server of its database (``api``), with users and workers
of its own: what the test before left queued, held or running is ended after it
(helpers.its_turn), so the queue and what a claim may take are the test's own jobs."""

from __future__ import annotations

from typing import Any

from tests.conftest import Server, run_ddpq
from tests.helpers import register, together

CPU = {"entrypoint": "t.py", "device": "cpu"}
SLOT = {"free_cpu_slots": 8, "free_gpus": [], "wait_s": 0}


def _user(server: Server, name: str) -> Any:
    r = server.client().post("/users", json={"name": name})
    assert r.status_code == 201, r.text
    return server.client(r.json()["token"])


def _queue(client: Any) -> list[int]:
    return [q["job_id"] for q in client.get("/queue").json()["items"]]


def test_hold_release_and_update(api: Server) -> None:
    server = api
    admin, alice, bob = server.client(), _user(server, "alice"), _user(server, "bob")
    a, b, c = (alice.post("/jobs", json=CPU).json()["id"] for _ in range(3))
    held = alice.post(f"/jobs/{b}/hold")
    assert held.status_code == 200, held.text
    assert held.json()["status"] == "held"
    assert held.json()["reason"] == f"held by alice: `ddpq release {b}`"
    d = alice.post("/jobs", json=CPU).json()["id"]
    assert _queue(alice) == [a, c, d]
    # Illegal moves name the state and what the move leaves.
    again = alice.post(f"/jobs/{b}/hold")
    assert again.status_code == 409
    assert again.json()["detail"] == f"job {b} is held: hold moves a job only out of queued"
    assert alice.post(f"/jobs/{a}/release").status_code == 409
    # Another member may not; an admin may, and then only an admin releases it.
    refused = bob.post(f"/jobs/{a}/hold")
    assert refused.status_code == 403 and "only its owner or an admin" in refused.text
    assert admin.post(f"/jobs/{a}/hold").json()["reason"] == (
        f"held by admin (admin): `ddpq release {a}`"
    )
    not_hers = alice.post(f"/jobs/{a}/release")
    assert not_hers.status_code == 403 and "held by admin" in not_hers.text
    # Released, each is back in its place, ahead of what was submitted after it.
    assert admin.post(f"/jobs/{a}/release").json()["status"] == "queued"
    assert alice.post(f"/jobs/{b}/release").json()["status"] == "queued"
    assert _queue(alice) == [a, b, c, d]

    # Changes: within the member's cap (0 by default), beyond it by an admin.
    r = alice.patch(f"/jobs/{c}", json={"priority": -5, "timeout_s": 600, "world_size": 3})
    assert r.status_code == 200, r.text
    spec = r.json()["spec"]
    assert (spec["priority"], spec["timeout_s"], spec["world_size"]) == (-5, 600, 3)
    assert _queue(alice) == [a, b, d, c]
    over = alice.patch(f"/jobs/{c}", json={"priority": 5})
    assert over.status_code == 403 and "cap of 0" in over.text
    assert admin.patch(f"/jobs/{c}", json={"priority": 5}).status_code == 200
    assert _queue(alice)[0] == c
    assert alice.patch(f"/jobs/{c}", json={"timeout_s": 0}).json()["spec"]["timeout_s"] is None
    for body, field in (({}, "body"), ({"world_size": 0}, "world_size"), ({"x": 1}, "x")):
        bad = alice.patch(f"/jobs/{c}", json=body)
        assert bad.status_code == 422 and field in bad.text, (body, bad.text)
    assert bob.patch(f"/jobs/{c}", json={"priority": -1}).status_code == 403

    # Held, a job is never claimed; running, it is neither held nor changed.
    assert alice.post(f"/jobs/{a}/hold").status_code == 200
    register(server, "w", cpu_slots=8)
    worker = server.client("worker")
    taken = []
    while (got := worker.post("/workers/claim", json={"name": "w", **SLOT})).status_code == 200:
        taken.append(got.json()["job_id"])
    assert a not in taken and set(taken) == {b, c, d}
    assert alice.post(f"/jobs/{b}/hold").status_code == 409
    running = alice.patch(f"/jobs/{b}", json={"priority": -1})
    assert running.status_code == 409 and "is running" in running.text
    assert alice.post(f"/jobs/{a}/cancel").json()["status"] == "cancelled"

    audit = [(e["actor"], e["action"], e["target"]) for e in admin.get("/audit").json()["items"]]
    assert ("alice", "hold", f"job {b}") in audit and ("admin", "release", f"job {a}") in audit
    assert ("alice", "update", f"job {c}") in audit and ("bob", "refused.hold", f"job {a}") in audit

    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    e = admin.post("/jobs", json=CPU).json()["id"]
    out = run_ddpq("hold", str(e), env=env)
    assert out.returncode == 0 and f"job {e} held" in out.stdout, out.stderr
    out = run_ddpq("update", str(e), "--priority", "3", "--time-limit", "60", env=env)
    assert out.returncode == 0 and "priority 3, time limit 60 s" in out.stdout, out.stderr
    out = run_ddpq("release", str(e), env=env)
    assert out.returncode == 0 and f"job {e} queued" in out.stdout, out.stderr
    assert run_ddpq("update", str(e), env=env).returncode == 2


def test_a_held_job_counts_against_the_queued_limit(api: Server) -> None:
    server = api
    admin, carol = server.client(), _user(server, "carol")
    assert admin.put("/quotas/carol", json={"max_queued": 2}).status_code == 200
    first, _ = (carol.post("/jobs", json=CPU).json()["id"] for _ in range(2))
    assert carol.post(f"/jobs/{first}/hold").status_code == 200
    assert carol.post("/jobs", json=CPU).status_code == 429


def test_a_hold_racing_a_claim_has_one_winner(api: Server) -> None:
    """20 rounds: a hold and a claim of the one queued job at once. Either the hold won
    (the job is held, the claim found nothing) or the claim did (the job runs, the hold
    is refused 409): never both, never neither."""
    server = api
    admin, worker = server.client(), server.client("worker")
    register(server, "racer", cpu_slots=8)
    for _ in range(20):
        job = admin.post("/jobs", json=CPU).json()["id"]
        hold, claim = together(
            lambda job=job: admin.post(f"/jobs/{job}/hold"),
            lambda: worker.post("/workers/claim", json={"name": "racer", **SLOT}),
        )
        status = admin.get(f"/jobs/{job}").json()["status"]
        if hold.status_code == 200:
            assert claim.status_code == 204 and status == "held", (claim.text, status)
            assert admin.post(f"/jobs/{job}/cancel").status_code == 202
        else:
            assert hold.status_code == 409 and claim.status_code == 200, (hold.text, claim.text)
            assert claim.json()["job_id"] == job and status == "running"
            r = worker.post(
                f"/workers/jobs/{job}/finish",
                json={"worker": "racer", "attempt": 1, "exit_code": 0},
            )
            assert r.status_code == 200, r.text
