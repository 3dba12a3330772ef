"""People (issue 27): users with roles and their own tokens, who owns a job, who may
cancel it, revocation that holds on every API process at once, and the audit trail.
Both databases.

A test that looks at users and jobs of its own (names no other test here uses; what its
requests added to the lists) runs on the module's server of its database (``api``: what
the test before left active is ended after it, helpers.its_turn); one that revokes the
first admin, or reads the whole list of users, has a server of its own (``server``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from tests.conftest import Server, start_server, stop_server

JOB = {"recipe": "toy-regression", "world_size": 1}


def add(server: Server, name: str, role: str = "member") -> str:
    r = server.client().post("/users", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def as_user(server: Server, token: str) -> httpx.Client:
    return server.client(token)


def test_the_api_token_is_the_first_admins_and_users_get_their_own(api: Server) -> None:
    server = api
    admin = server.client()
    assert admin.get("/whoami").json() == {"name": "admin", "role": "admin"}
    token = add(server, "ann")
    assert token.startswith("ddpqu_") and len(token) == len("ddpqu_") + 43, token
    assert as_user(server, token).get("/whoami").json() == {"name": "ann", "role": "member"}
    listed = {u["name"]: u for u in admin.get("/users").json()["items"]}
    assert listed["ann"]["role"] == "member" and listed["ann"]["revoked_at"] is None
    assert listed["ann"]["token_hint"] == token[:10] and "token" not in listed["ann"]
    # Stored as its sha256, never itself (nor the API token).
    engine = create_engine(server.db_url)
    try:
        with engine.connect() as conn:
            rows = [tuple(r) for r in conn.execute(text("SELECT * FROM users"))]
    finally:
        engine.dispose()
    dumped = repr(rows)
    assert token not in dumped and server.api_token not in dumped
    assert hashlib.sha256(token.encode()).hexdigest() in dumped


def test_a_member_cancels_only_its_own_jobs_and_an_admin_any(api: Server) -> None:
    server = api
    # The module's server: the other tests' jobs are there too (every member sees them).
    before = [
        j["owner"] for j in server.client().get("/jobs", params={"limit": 500}).json()["items"]
    ]
    alice, bob = as_user(server, add(server, "alice")), as_user(server, add(server, "bob"))
    a = alice.post("/jobs", json=JOB).json()
    b = bob.post("/jobs", json=JOB).json()
    assert (a["owner"], b["owner"]) == ("alice", "bob")

    refused = bob.post(f"/jobs/{a['id']}/cancel")
    assert refused.status_code == 403, refused.text
    assert "alice's" in refused.json()["detail"] and "bob is a member" in refused.json()["detail"]
    assert alice.get(f"/jobs/{a['id']}").json()["status"] == "queued", "changed nothing"

    assert alice.post(f"/jobs/{a['id']}/cancel").json()["status"] == "cancelled"
    assert server.client().post(f"/jobs/{b['id']}/cancel").json()["status"] == "cancelled"

    def owners(**params: Any) -> list[str]:
        return [j["owner"] for j in bob.get("/jobs", params=params).json()["items"]]

    assert owners(limit=500) == ["bob", "alice", *before], "every member sees every job"
    assert owners(mine="true") == ["bob"] and owners(user="alice") == ["alice"]
    assert owners(user="nobody") == []
    assert bob.get("/jobs", params={"mine": "true", "user": "alice"}).status_code == 422


def test_an_idempotency_key_is_no_replay_of_another_users_job(api: Server) -> None:
    server = api
    alice, bob = as_user(server, add(server, "cleo")), as_user(server, add(server, "dan"))
    key = {"Idempotency-Key": "nightly-sweep-1"}
    first = alice.post("/jobs", json=JOB, headers=key)
    assert first.status_code == 201
    assert alice.post("/jobs", json=JOB, headers=key).json()["id"] == first.json()["id"]
    theirs = bob.post("/jobs", json=JOB, headers=key)
    assert theirs.status_code == 409 and "another user" in theirs.text, theirs.text


def test_revoked_and_rotated_tokens_are_refused_at_once_by_every_api_process(
    api: Server, tmp_path: Path
) -> None:
    """Nothing is cached: what one API process changes, the other refuses on the very
    next request. Ten users, each revoked or rotated on one process and tried at once on
    the other, alternately."""
    server = api  # the module's, and a second process of its own on the same database
    other = start_server(
        server.db_url, tmp_path / "api2", tokens=(server.api_token, server.worker_token)
    )
    try:
        processes = (server, other)
        for i in range(10):
            here, there = processes[i % 2], processes[(i + 1) % 2]
            name = f"user{i}"
            token = add(here, name)
            assert as_user(there, token).get("/whoami").status_code == 200
            if i % 4 < 2:
                assert here.client().post(f"/users/{name}/revoke").status_code == 200
                refused = as_user(there, token).get("/jobs")
                assert refused.status_code == 401 and "revoked" in refused.text, refused.text
                assert as_user(there, token).post("/jobs", json=JOB).status_code == 401
            else:
                new = here.client().post(f"/users/{name}/rotate").json()["token"]
                assert as_user(there, token).get("/whoami").status_code == 401
                assert as_user(there, new).get("/whoami").json()["name"] == name
    finally:
        stop_server(other)


def test_only_admins_manage_users_and_mistakes_change_nothing(server: Server) -> None:
    admin = server.client()
    alice = as_user(server, add(server, "alice"))
    for method, path, body in (
        ("get", "/users", None),
        ("post", "/users", {"name": "eve"}),
        ("post", "/users/alice/rotate", None),
        ("post", "/users/admin/revoke", None),
        ("get", "/audit", None),
    ):
        r = alice.request(method.upper(), path, json=body)
        assert r.status_code == 403 and "for admins" in r.text, (path, r.text)
    assert admin.post("/users", json={"name": "alice"}).status_code == 409
    bad = admin.post("/users", json={"name": "Alice Smith"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "name"], bad.text
    assert admin.post("/users", json={"name": "x", "role": "root"}).status_code == 422
    assert admin.post("/users/nobody/revoke").status_code == 404
    last = admin.post("/users/admin/revoke")
    assert last.status_code == 409 and "last admin" in last.text, last.text
    assert admin.post("/users/alice/revoke").status_code == 200
    assert admin.post("/users/alice/revoke").status_code == 409
    assert admin.post("/users/alice/rotate").status_code == 409
    names = [u["name"] for u in admin.get("/users").json()["items"]]
    assert names == ["admin", "alice"], names
    # A second admin: then the first may go, and its token with it.
    carol = as_user(server, add(server, "carol", role="admin"))
    assert carol.post("/users/admin/revoke").status_code == 200
    assert admin.get("/whoami").status_code == 401


def test_the_audit_trail_says_who_did_what(api: Server) -> None:
    server = api
    admin = server.client()
    dora = as_user(server, add(server, "dora"))
    job = dora.post("/jobs", json=JOB).json()
    dora.post(f"/jobs/{job['id']}/cancel")
    admin.post("/users/dora/rotate")
    admin.post("/users/dora/revoke")
    events = admin.get("/audit").json()["items"]
    said = [(e["actor"], e["action"], e["target"]) for e in events]
    assert said[:5] == [
        ("admin", "user.deactivate", "user dora"),
        ("admin", "user.rotate", "user dora"),
        ("dora", "cancel", f"job {job['id']}"),
        ("dora", "submit", f"job {job['id']}"),
        ("admin", "user.add", "user dora"),
    ], said
    assert events[3]["detail"] == {"program": "toy-regression"}
    page = admin.get("/audit", params={"limit": 2}).json()
    rest = admin.get("/audit", params={"cursor": page["next_cursor"]}).json()["items"]
    # The module's server holds the other tests' events too, older: the pages continue
    # the trail as far as the first read saw it (past its 100, the older ones follow).
    paged = [e["id"] for e in page["items"] + rest]
    assert paged[: len(events)] == [e["id"] for e in events]
    assert admin.get("/audit", params={"cursor": "x"}).status_code == 422
