"""A user's whole life (issue 41), tried as a team's admin would, on both databases:
an account closed with each choice of what becomes of its jobs (the reasons name who
cancelled and why), its name never reused silently, reopened with a new token; the last
admin never closed; a member's priority within the cap an admin sets (preemption goes
no further); refused actions in the audit trail. The worker protocol is driven by hand.

A test that looks at users and jobs of its own (names no other test here uses) runs on the
module's server of its database (``api``: what the test before left active is ended after
it, helpers.its_turn, so the only jobs queued are the test's own); one that closes or caps
for everyone (the last admin, everyone's default quota) has a server of its own
(``server``).
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Server, wait_for
from tests.helpers import register

JOB = {"entrypoint": "train.py", "world_size": 1, "device": "cpu"}


def add(server: Server, name: str, role: str = "member") -> httpx.Client:
    r = server.client().post("/users", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    return server.client(r.json()["token"])


def claim(server: Server, worker: str = "hand") -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/claim", json={"name": worker, "free_cpu_slots": 1, "free_gpus": [], "wait_s": 0}
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def heartbeat(server: Server, c: dict[str, Any], worker: str = "hand") -> dict[str, Any]:
    running = [{"job_id": c["job_id"], "attempt": c["attempt"]}]
    r = server.client("worker").post(
        "/workers/heartbeat", json={"name": worker, "running": running}
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def finish(
    server: Server, c: dict[str, Any], outcome: str = "exited", worker: str = "hand"
) -> None:
    body = {"worker": worker, "attempt": c["attempt"], "exit_code": 0, "outcome": outcome}
    if outcome == "cancelled":
        body["exit_code"] = None
    r = server.client("worker").post(f"/workers/jobs/{c['job_id']}/finish", json=body)
    assert r.status_code == 200, r.text


def job(server: Server, job_id: int) -> dict[str, Any]:
    out: dict[str, Any] = server.client().get(f"/jobs/{job_id}").json()
    return out


def test_closing_an_account_cancels_its_queued_jobs_and_lets_running_ones_finish(
    api: Server,
) -> None:
    server = api
    register(server, "hand", cpu_slots=1)
    bob = add(server, "bob")
    running = bob.post("/jobs", json=JOB).json()["id"]
    c = claim(server)
    assert c["job_id"] == running
    queued = [bob.post("/jobs", json=JOB).json()["id"] for _ in range(2)]
    admin = server.client()

    r = admin.delete("/users/bob")  # jobs=cancel-queued, the default
    assert r.status_code == 200, r.text
    closed = r.json()
    assert closed["user"]["state"] == "deactivated" and closed["user"]["deactivated_by"] == "admin"
    assert (closed["cancelled"], closed["kept"], closed["jobs"]) == (
        queued,
        [running],
        "cancel-queued",
    )
    assert bob.get("/whoami").status_code == 401
    for job_id in queued:
        got = job(server, job_id)
        assert got["status"] == "cancelled", got
        assert got["reason"] == (
            "cancelled by admin (admin) before it started: bob's account was closed"
        ), got["reason"]
    assert job(server, running)["status"] == "running"
    assert heartbeat(server, c)["cancel"] == [], "a running job finishes"
    finish(server, c)
    assert job(server, running)["status"] == "succeeded"

    # The account stays, and its name is never given to anyone else silently.
    listed = {u["name"]: u for u in admin.get("/users").json()["items"]}
    assert listed["bob"]["state"] == "deactivated" and listed["bob"]["revoked_at"]
    again = admin.post("/users", json={"name": "bob"})
    assert again.status_code == 409 and "ddpq users reactivate bob" in again.json()["detail"]
    assert admin.delete("/users/bob").status_code == 409
    assert admin.post("/users/bob/rotate").status_code == 409
    reopened = admin.post("/users/bob/reactivate")
    assert reopened.status_code == 200, reopened.text
    assert server.client(reopened.json()["token"]).get("/whoami").json()["name"] == "bob"
    assert admin.post("/users/bob/reactivate").status_code == 409
    actions = [(e["action"], e["target"]) for e in admin.get("/audit").json()["items"]]
    assert ("user.reactivate", "user bob") in actions
    assert ("user.deactivate", "user bob") in actions
    assert actions.count(("cancel", f"job {queued[0]}")) == 1


def test_cancel_all_stops_running_jobs_with_who_and_why(api: Server) -> None:
    server = api
    register(server, "hand", cpu_slots=1)
    carol = add(server, "carol")
    alice = add(server, "alice", "admin")
    running = carol.post("/jobs", json=JOB).json()["id"]
    c = claim(server)
    r = alice.delete("/users/carol", params={"jobs": "cancel-all"})
    assert r.status_code == 200, r.text
    assert r.json()["cancelling"] == [running]
    got = job(server, running)
    assert got["status"] == "cancelling"
    assert got["reason"] == (
        "cancel requested by alice (admin): carol's account was closed; stopping its processes"
    ), got["reason"]
    assert heartbeat(server, c)["cancel"] == [{"job_id": running, "attempt": 1}]
    finish(server, c, outcome="cancelled")
    got = job(server, running)
    assert got["status"] == "cancelled"
    assert got["reason"] == "cancelled by alice (admin): carol's account was closed", got


def test_keep_and_transfer_and_the_bad_choices(api: Server) -> None:
    server = api
    register(server, "hand", cpu_slots=1)
    dave, erin = add(server, "dave"), add(server, "erin")
    kept = dave.post("/jobs", json=JOB).json()["id"]
    admin = server.client()
    for params, field in (
        ({"jobs": "transfer"}, "to"),
        ({"jobs": "keep", "to": "erin"}, "to"),
        ({"jobs": "transfer", "to": "nobody"}, "to"),
        ({"jobs": "transfer", "to": "dave"}, "to"),
        ({"jobs": "everything"}, "jobs"),
    ):
        r = admin.delete("/users/dave", params=params)
        assert r.status_code == 422 and field in r.text, (params, r.text)
    assert dave.get("/whoami").status_code == 200, "a refused close changes nothing"
    assert admin.delete("/users/nobody").status_code == 404

    # Transfer: dave's queued job becomes erin's, and counts against erin's quota.
    assert admin.put("/quotas/erin", json={"max_running": 0}).status_code == 200
    r = admin.delete("/users/dave", params={"jobs": "transfer", "to": "erin"})
    assert r.status_code == 200, r.text
    assert r.json()["transferred"] == [kept]
    moved = job(server, kept)
    assert moved["owner"] == "erin" and moved["status"] == "queued"
    assert "erin runs 0 of their 0 jobs at once" in moved["reason"], moved["reason"]
    assert erin.post(f"/jobs/{kept}/cancel").status_code == 202  # erin's own now
    # An account closed to a closed one: refused.
    frank = add(server, "frank")
    assert frank.post("/jobs", json=JOB).status_code == 201
    r = admin.delete("/users/frank", params={"jobs": "transfer", "to": "dave"})
    assert r.status_code == 422 and "closed" in r.text
    r = admin.delete("/users/frank", params={"jobs": "keep"})
    assert r.status_code == 200 and len(r.json()["kept"]) == 1
    kept_job = r.json()["kept"][0]
    assert job(server, kept_job)["status"] == "queued", "keep: nothing changes"


def test_the_last_admin_is_never_closed(server: Server) -> None:
    admin = server.client()
    r = admin.delete("/users/admin")
    assert r.status_code == 409 and "last admin" in r.json()["detail"]
    second = add(server, "second", "admin")
    assert second.delete("/users/admin").status_code == 200
    assert second.delete("/users/second").status_code == 409
    assert second.get("/whoami").json() == {"name": "second", "role": "admin"}


def test_a_member_s_priority_stays_within_the_cap_an_admin_sets(server: Server) -> None:
    gina = add(server, "gina")
    admin = server.client()
    r = gina.post("/jobs", json={**JOB, "priority": 1_000_000})
    assert r.status_code == 403, r.text
    assert "priority 1000000 is above gina's cap of 0" in r.json()["detail"]
    assert gina.get("/jobs", params={"user": "gina"}).json()["items"] == [], "nothing stored"
    low = gina.post("/jobs", json={**JOB, "priority": -5})
    assert low.status_code == 201, "lowering is free"
    assert admin.post("/jobs", json={**JOB, "priority": 1_000_000}).status_code == 201

    # Everyone's default, then gina's own: the own cap wins, field by field.
    assert admin.put("/quotas/*", json={"max_priority": 5}).status_code == 200
    assert gina.post("/jobs", json={**JOB, "priority": 5}).status_code == 201
    assert gina.post("/jobs", json={**JOB, "priority": 6}).status_code == 403
    assert admin.put("/quotas/gina", json={"max_queued": 50, "max_priority": 10}).status_code == 200
    high = gina.post("/jobs", json={**JOB, "priority": 10})
    assert high.status_code == 201, high.text
    quotas = {q["user"]: q for q in gina.get("/quotas").json()["items"]}
    assert quotas["gina"]["max_priority"] == 10 and quotas["*"]["max_priority"] == 5

    # A lower cap lowers her jobs above it, queued or running: preemption goes no further.
    r = admin.put("/quotas/gina", json={"max_queued": 50, "max_priority": 2})
    assert r.status_code == 200
    lowered_job = job(server, high.json()["id"])
    assert (lowered_job["priority"], lowered_job["spec"]["priority"]) == (2, 10), lowered_job
    priorities = {j["id"]: j["priority"] for j in gina.get("/jobs").json()["items"]}
    assert priorities[low.json()["id"]] == -5
    audit = admin.get("/audit").json()["items"]
    lowered = next(e for e in audit if e["action"] == "quota.set")["detail"]["lowered"]
    assert high.json()["id"] in lowered and low.json()["id"] not in lowered
    refused = [e for e in audit if e["action"] == "refused.submit"]
    assert len(refused) == 2 and all(e["actor"] == "gina" for e in refused), refused
    assert "priority" in refused[0]["detail"]["why"]


def test_a_refused_cancel_is_audited_and_changes_nothing(api: Server) -> None:
    server = api
    hana, ivan = add(server, "hana"), add(server, "ivan")
    theirs = hana.post("/jobs", json=JOB).json()["id"]
    r = ivan.post(f"/jobs/{theirs}/cancel")
    assert r.status_code == 403
    assert job(server, theirs)["status"] == "queued"
    audit = server.client().get("/audit").json()["items"]
    # The module's server: of the refused cancels, this test's users' (the others' are
    # other tests').
    tried = [e for e in audit if e["action"] == "refused.cancel" and e["actor"] in ("hana", "ivan")]
    assert [(e["actor"], e["target"]) for e in tried] == [("ivan", f"job {theirs}")]
    assert "hana's" in tried[0]["detail"]["why"]


def test_a_lowered_cap_is_the_priority_the_queue_and_preemption_see(api: Server) -> None:
    server = api  # the only jobs queued are this test's (its_turn)
    jill = add(server, "jill")
    admin = server.client()
    assert admin.put("/quotas/jill", json={"max_priority": 7}).status_code == 200
    hi = jill.post("/jobs", json={**JOB, "priority": 7}).json()["id"]
    mid = admin.post("/jobs", json={**JOB, "priority": 3}).json()["id"]
    assert job(server, hi)["queue_position"] == 1
    assert admin.put("/quotas/jill", json={"max_priority": 1}).status_code == 200
    wait_for(lambda: job(server, mid)["queue_position"] == 1, 10, "the admin's job first")
    assert job(server, hi)["queue_position"] == 2


def test_a_member_on_an_admin_route_is_refused_and_audited(api: Server) -> None:
    server = api
    kim = add(server, "kim")
    quotas = server.client().get("/quotas").json()["items"]  # other tests' of the module
    for method, path in (("GET", "/users"), ("DELETE", "/users/admin"), ("PUT", "/quotas/kim")):
        r = kim.request(method, path, json={"max_priority": 10} if method == "PUT" else None)
        assert r.status_code == 403 and "for admins" in r.text, r.text
    audit = server.client().get("/audit").json()["items"]
    tried = [
        (e["actor"], e["target"])
        for e in audit
        if e["action"] == "refused.route" and e["actor"] == "kim"
    ]
    assert tried == [
        ("kim", "PUT /quotas/kim"),
        ("kim", "DELETE /users/admin"),
        ("kim", "GET /users"),
    ]
    assert server.client().get("/quotas").json()["items"] == quotas, "changed nothing"
