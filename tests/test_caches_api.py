"""Users' caches as the API keeps them (service.caches), on both databases, with the worker
protocol driven by hand: a heartbeat reports a worker's caches whole (only when they
changed), `GET /caches` lists them (a member their own, an admin anyone's), `POST
/caches/clear` turns into orders the next heartbeat replies carry until the worker
reports them done; bad input is a 4xx naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ddpq.client import Client
from tests.conftest import Server
from tests.helpers import register, submit_and_claim


def _beat(server: Server, name: str, **extra: Any) -> dict[str, Any]:
    r = server.client("worker").post("/workers/heartbeat", json={"name": name, **extra})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def _usage(user: str, size: int, files: int = 3, idle_s: float = 5.0) -> dict[str, Any]:
    return {"user": user, "bytes": size, "files": files, "idle_s": idle_s}


def test_caches_reported_listed_and_cleared(server: Server) -> None:
    register(server, "w1")
    register(server, "w2")
    with Client(server.url, server.api_token) as admin:
        alice = admin.add_user("alice")["token"]
        admin.add_user("bob")
    # Reports replace what the API knew of that worker's caches; none: unchanged.
    _beat(server, "w1", caches=[_usage("alice", 1000), _usage("bob", 50)])
    _beat(server, "w2", caches=[_usage("alice", 7, idle_s=3600)])
    _beat(server, "w1")  # no report: the rows stay
    with Client(server.url, alice) as me, Client(server.url, server.api_token) as admin:
        mine = me.caches()
        assert [(c["worker"], c["bytes"], c["files"]) for c in mine] == [
            ("w1", 1000, 3),
            ("w2", 7, 3),
        ]
        assert mine[1]["last_used"] < mine[0]["last_used"], "dated by the API's clock"
        assert not any(c["clearing"] for c in mine)
        assert {(c["user"], c["worker"]) for c in admin.caches()} == {
            ("alice", "w1"),
            ("alice", "w2"),
            ("bob", "w1"),
        }
        assert [c["user"] for c in admin.caches("bob")] == ["bob"]
        assert [c["worker"] for c in admin.caches(worker="w2")] == ["w2"]
        # A member sees and clears only their own.
        r = server.client(alice).get("/caches", params={"user": "bob"})
        assert r.status_code == 403, r.text
        r = server.client(alice).post("/caches/clear", json={"user": "bob"})
        assert r.status_code == 403, r.text

        # A clear: an order for each worker that has a cache of alice's, once.
        asked = me.clear_caches()
        assert sorted(c["worker"] for c in asked) == ["w1", "w2"]
        assert all(c["clearing"] for c in me.caches())
        me.clear_caches(worker="w1")  # asked again: still one order
        orders = _beat(server, "w1")["clear"]
        assert [o["user"] for o in orders] == ["alice"], orders
        assert _beat(server, "w1")["clear"] == orders, "asked until reported"
        # The worker reports it (and its caches without alice's); the order goes.
        reply = _beat(
            server,
            "w1",
            caches=[_usage("bob", 50)],
            cleared=[{"id": orders[0]["id"], "outcome": "cleared"}],
        )
        assert reply["clear"] == []
        assert [(c["worker"], c["clearing"]) for c in me.caches()] == [("w2", True)]
        # Another worker's report of w2's order changes nothing.
        w2_order = _beat(server, "w2")["clear"][0]
        _beat(server, "w1", cleared=[{"id": w2_order["id"], "outcome": "cleared"}])
        assert _beat(server, "w2")["clear"] == [w2_order]
        _beat(server, "w2", caches=[], cleared=[{"id": w2_order["id"], "outcome": "missing"}])
        assert me.caches() == []

        # An admin clears anyone's; a user or worker that does not exist is a 422.
        assert [c["user"] for c in admin.clear_caches("bob")] == ["bob"]
        assert admin.clear_caches("alice") == []  # nothing reported: nothing asked
        for body in ({"user": "nobody"}, {"worker": "nowhere"}):
            r = server.client().post("/caches/clear", json=body)
            assert r.status_code == 422, r.text
            assert r.json()["detail"][0]["loc"] == ["body", next(iter(body))], r.text
        audit = admin.audit()["items"]
        assert any(e["action"] == "cache.clear" and e["actor"] == "alice" for e in audit)


# The schemas' work, not the database's: one database is enough.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_bad_cache_input_is_a_4xx_naming_the_field(server: Server) -> None:
    # A claim names its job's owner: whose cache the worker lends its ranks.
    assert submit_and_claim(server, "w1")["owner"] == "admin"
    user, worker = server.client(), server.client("worker")

    def field_of(r: httpx.Response) -> list[Any]:
        assert r.status_code == 422, r.text
        return [e["loc"] for e in r.json()["detail"]]

    for bad in (
        {"caches": [_usage("Alice!", 1)]},
        {"caches": [_usage("alice", -1)]},
        {"caches": [{**_usage("alice", 1), "idle_s": 1e12}]},
        {"caches": [{**_usage("alice", 1), "extra": 1}]},
        {"cleared": [{"id": 0, "outcome": "cleared"}]},
        {"cleared": [{"id": 1, "outcome": "burnt"}]},
        {"caches": [_usage(f"u{i}", 1) for i in range(1001)]},
    ):
        r = worker.post("/workers/heartbeat", json={"name": "w1", **bad})
        locs = field_of(r)
        assert all(loc[:2] == ["body", next(iter(bad))] for loc in locs), locs
    assert field_of(user.get("/caches", params={"user": "../etc"}))[0] == ["query", "user"]
    assert field_of(user.get("/caches", params={"worker": "a b"}))[0] == ["query", "worker"]
    assert field_of(user.post("/caches/clear", json={"user": "A"}))[0] == ["body", "user"]
    assert field_of(user.post("/caches/clear", json={"everyone": True}))[0] == [
        "body",
        "everyone",
    ]
    r = user.post("/caches/clear", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    # A report naming a user twice keeps the last one (no 500 from a primary key).
    _beat(server, "w1", caches=[_usage("alice", 1), _usage("alice", 2)])
    assert [c["bytes"] for c in user.get("/caches").json()["items"]] == [2]
