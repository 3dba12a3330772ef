"""People's promises where requests race (issue 41), many rounds each, on SQLite, on
Postgres, and on Postgres with two API processes (`serve --workers 2`: the kernel hands
the test's connections to either process, so the requests of one round land on both).

- The queued quota: many submits at once never queue more than the limit (they counted,
  then inserted, each under READ COMMITTED: 4-8 of 24 queued against a limit of 3).
- The last admin: two admins revoking each other at once leave one (both won before).
- Claims under a running limit: two workers claiming at once never fail (a deadlock in
  the quota flags' refresh answered 503 in 1-2 of 4 rounds) and never start more than
  the limit; a claim racing a finish of the same owner leaves no job held for good.

Each round's requests are released together by a barrier, on clients connected before.
30 rounds catch a 10 % race with probability 1 - 0.9**30 > 95 %.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, _sqlite_copy, start_server, stop_server
from tests.helpers import register, together

ROUNDS = 30
SUBMITTERS = 16
JOB = {"entrypoint": "train.py", "world_size": 1, "device": "cpu"}


@pytest.fixture(
    params=[
        ("sqlite", 1),
        ("postgres", 1),
        pytest.param(("postgres", 2), id="postgres-2-processes"),
    ],
    ids=lambda p: f"{p[0]}-{p[1]}" if isinstance(p, tuple) else str(p),
)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    backend, processes = request.param
    if backend == "sqlite":
        url = _sqlite_copy(request, tmp_path / "ddpq.db")
    else:
        url = request.getfixturevalue("pg_url")
    s = start_server(url, tmp_path / "api", DDPQ_API_WORKERS=str(processes))
    yield s
    stop_server(s)


def at_once(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    """Run ``calls`` released at once; their answers in order. None answers 5xx."""
    out = together(*calls)
    for r in out:
        assert isinstance(r, httpx.Response), r
        assert r.status_code < 500, f"{r.status_code}: {r.text}"
    return out


def add(api: Server, name: str, role: str = "member", by: str | None = None) -> str:
    r = api.client(by or "user").post("/users", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def warm(api: Server, token: str, n: int) -> list[httpx.Client]:
    """``n`` clients of ``token``, connected (to whichever process the kernel picks)."""
    clients = [api.client(token) for _ in range(n)]
    for c in clients:
        assert c.get("/healthz").status_code == 200
    return clients


def test_concurrent_submits_never_queue_past_the_queued_quota(api: Server) -> None:
    token = add(api, "mia")
    admin = api.client()
    assert admin.put("/quotas/mia", json={"max_queued": 3}).status_code == 200
    clients = warm(api, token, SUBMITTERS)
    for n in range(ROUNDS):
        answers = at_once([functools.partial(c.post, "/jobs", json=JOB) for c in clients])
        codes = sorted(r.status_code for r in answers)
        assert codes == [201] * 3 + [429] * (SUBMITTERS - 3), f"round {n}: {codes}"
        for r in answers:
            if r.status_code == 429:
                assert "max_queued 3" in r.json()["detail"], r.text
        queued = admin.get("/jobs", params={"user": "mia", "status": "queued"}).json()["items"]
        assert len(queued) == 3, f"round {n}: {len(queued)} queued"
        for job in queued:
            assert clients[0].post(f"/jobs/{job['id']}/cancel").status_code == 202


def test_two_admins_revoking_each_other_at_once_leave_one(api: Server) -> None:
    survivor = api.api_token
    first = "admin"
    for n in range(ROUNDS):
        a, b = f"a{n}", f"b{n}"
        ta, tb = add(api, a, "admin", by=survivor), add(api, b, "admin", by=survivor)
        # Only a and b are live admins when they race.
        assert api.client(ta).post(f"/users/{first}/revoke").status_code == 200
        ca, cb = warm(api, ta, 1)[0], warm(api, tb, 1)[0]
        ra, rb = at_once(
            [lambda: ca.post(f"/users/{b}/revoke"), lambda: cb.post(f"/users/{a}/revoke")]
        )
        won = [r for r in (ra, rb) if r.status_code == 200]
        assert len(won) == 1, f"round {n}: {ra.status_code} {ra.text} / {rb.status_code} {rb.text}"
        lost = rb if won[0] is ra else ra
        # Refused as the last admin (409), or as a revoked token already (401).
        assert lost.status_code in (401, 409), lost.text
        survivor, first = (ta, a) if won[0] is ra else (tb, b)
        admins = [
            u["name"]
            for u in api.client(survivor).get("/users").json()["items"]
            if u["role"] == "admin" and u["revoked_at"] is None
        ]
        assert admins == [first], f"round {n}: live admins {admins}"


def _claim(worker: httpx.Client, name: str, wait_s: float = 0) -> httpx.Response:
    return worker.post(
        "/workers/claim",
        json={"name": name, "free_cpu_slots": 2, "free_gpus": [], "wait_s": wait_s},
    )


def _finish(worker: httpx.Client, name: str, claim: dict[str, Any]) -> None:
    r = worker.post(
        f"/workers/jobs/{claim['job_id']}/finish",
        json={"worker": name, "attempt": claim["attempt"], "exit_code": 0},
    )
    assert r.status_code == 200, r.text


def test_claims_under_a_running_limit_never_fail_nor_pass_it(api: Server) -> None:
    token = add(api, "max")
    assert api.client().put("/quotas/max", json={"max_running": 1}).status_code == 200
    register(api, "w1", cpu_slots=2)
    register(api, "w2", cpu_slots=2)
    w1, w2 = warm(api, api.worker_token, 2)
    user = api.client(token)

    def queued() -> int:
        return len(user.get("/jobs", params={"user": "max", "status": "queued"}).json()["items"])

    for n in range(ROUNDS):
        for _ in range(3 - queued()):
            assert user.post("/jobs", json=JOB).status_code == 201
        r1, r2 = at_once([lambda: _claim(w1, "w1"), lambda: _claim(w2, "w2")])
        got = [(r, name) for r, name in ((r1, "w1"), (r2, "w2")) if r.status_code == 200]
        assert len(got) == 1, f"round {n}: {r1.status_code} {r1.text} / {r2.status_code}"
        assert {r1.status_code, r2.status_code} == {200, 204}, (r1.text, r2.text)
        (r, name) = got[0]
        running = user.get("/jobs", params={"user": "max", "status": "running"}).json()
        assert len(running["items"]) == 1, f"round {n}: {running['items']}"
        # The finish and the next claim race: whichever wins, the next job is not held
        # for good (the flags the finish lifts are not overwritten by the claim's).
        other, other_name = (w2, "w2") if name == "w1" else (w1, "w1")
        f, c = at_once(
            [
                lambda: other.post(
                    f"/workers/jobs/{r.json()['job_id']}/finish",
                    json={"worker": name, "attempt": r.json()["attempt"], "exit_code": 0},
                ),
                lambda: _claim(other, other_name),
            ]
        )
        assert f.status_code == 200, f.text
        taken = c.json() if c.status_code == 200 else None
        if taken is None:
            # A long-poll: another API process hears of the finish through NOTIFY, and
            # until then its memory of "nothing fits" may answer for it (NothingFits).
            again = _claim(other, other_name, wait_s=10)
            assert again.status_code == 200, f"round {n}: the next job stayed held: {again.text}"
            taken = again.json()
        _finish(other, other_name, taken)


def _people(api: Server) -> dict[str, Any]:
    """What an admin route or another member's action could change, as an admin sees it
    (refusals are audited, so the audit trail is compared without them)."""
    admin = api.client()
    audit = admin.get("/audit", params={"limit": 500}).json()["items"]
    return {
        "users": admin.get("/users").json(),
        "quotas": admin.get("/quotas").json(),
        "jobs": admin.get("/jobs", params={"limit": 500}).json()["items"],
        "sweeps": admin.get("/sweeps").json()["items"],
        "secrets": {
            who: admin.get("/secrets", params={"user": who}).json()["items"]
            for who in ("bob", "mallory")
        },
        "audit": [e for e in audit if not e["action"].startswith("refused.")],
    }


SWEEP = {
    "job": {"entrypoint": "train.py"},
    "space": {"n": {"type": "int", "low": 1, "high": 9}},
    "metric": "loss",
    "max_trials": 1,
    "max_concurrent": 1,
}


def test_a_member_and_a_worker_find_nothing_to_break(api: Server) -> None:
    """The red team, on each set-up: every admin route as a member and as a worker;
    everything one member might try on another's things (cancel, hold, release and change
    a job, cancel a sweep, list, set and delete a secret, list and clear caches); a
    priority above the cap; the member's refusals in the audit trail, and nothing changed."""
    mallory, bob = add(api, "mallory"), add(api, "bob")
    his = api.client(bob)
    bobs = his.post("/jobs", json=JOB).json()["id"]
    held = his.post("/jobs", json=JOB).json()["id"]
    assert his.post(f"/jobs/{held}/hold").status_code == 200, "his own hold, his to lift"
    assert his.put("/secrets/BOB_KEY", json={"value": "bob's own"}).status_code == 200
    r = his.post("/sweeps", json=SWEEP)
    assert r.status_code == 201, r.text
    sweep = r.json()["id"]
    member, worker = warm(api, mallory, 1)[0], api.client("worker")
    mine = member.post("/jobs", json=JOB).json()["id"]
    before = _people(api)
    doc = httpx.get(f"{api.url}/openapi.json").json()
    tried = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            schemes = {name for req in op.get("security", []) for name in req}
            if schemes != {"adminToken"}:
                continue
            url = path.replace("{name}", "bob").replace("{job_id}", str(bobs))
            for client, who in ((member, "member"), (worker, "worker")):
                r = client.request(method.upper(), url, json={"role": "admin", "name": "x"})
                assert r.status_code == 403, (method, path, who, r.text)
            tried += 1
    assert tried >= 8, "every admin route the document lists"

    # Another member's things: each refused with 403 naming whose it is (every member
    # sees every job and sweep, so nothing is hidden behind a 404), and audited.
    theirs = [
        ("POST", f"/jobs/{bobs}/cancel", None, "refused.cancel", f"job {bobs}"),
        ("POST", f"/jobs/{bobs}/hold", None, "refused.hold", f"job {bobs}"),
        ("POST", f"/jobs/{held}/release", None, "refused.release", f"job {held}"),
        ("PATCH", f"/jobs/{bobs}", {"priority": -5}, "refused.update", f"job {bobs}"),
        ("PATCH", f"/jobs/{bobs}", {"timeout_s": 1}, "refused.update", f"job {bobs}"),
        ("POST", f"/sweeps/{sweep}/cancel", None, "refused.cancel", f"sweep {sweep}"),
        ("GET", "/secrets?user=bob", None, "refused.secret.list", "secrets of bob"),
        ("GET", "/caches?user=bob", None, "refused.cache.list", "caches of bob"),
        ("POST", "/caches/clear", {"user": "bob"}, "refused.cache.clear", "caches of bob"),
    ]
    for method, url, body, _, _ in theirs:
        r = member.request(method, url, json=body)
        assert r.status_code == 403, (method, url, r.text)
        assert "bob's" in r.json()["detail"] or "their own" in r.json()["detail"], r.text
        # The worker token is no user's: refused at the gate, before any of this.
        r = worker.request(method, url, json=body)
        assert r.status_code == 403, (method, url, "worker", r.text)
    # A secret is always the token's user's: no route takes another user's name to set
    # or delete one, so bob's name is only ever looked up among mallory's (404: hers has
    # no such secret, which says nothing of bob's).
    for url in ("/secrets/BOB_KEY", "/secrets/BOB_KEY?user=bob"):
        r = member.delete(url)
        assert r.status_code == 404 and "mallory has no secret" in r.text, r.text
    # A priority over her cap (0), for a new job or her own queued one.
    r = member.post("/jobs", json={**JOB, "priority": 1_000_000})
    assert r.status_code == 403 and "cap of 0" in r.json()["detail"]
    r = member.patch(f"/jobs/{mine}", json={"priority": 5, "timeout_s": 60})
    assert r.status_code == 403 and "cap of 0" in r.json()["detail"], r.text
    assert _people(api) == before, "a refused request changed something"
    audit = api.client().get("/audit", params={"limit": 500}).json()["items"]
    refused = [e for e in audit if e["action"].startswith("refused.")]
    assert {e["actor"] for e in refused} == {"mallory"}, refused
    assert len(refused) == tried + len(theirs) + 2, [(e["action"], e["target"]) for e in refused]
    seen = [(e["action"], e["target"]) for e in refused]
    for _, url, _, action, target in theirs:
        assert (action, target) in seen, (url, seen)
    assert ("refused.submit", "job") in seen and ("refused.update", f"job {mine}") in seen

    # A set with bob's name in the query sets mallory's own (the query is not read):
    # bob's stays as it was.
    r = member.put("/secrets/BOB_KEY?user=bob", json={"value": "mallory's"})
    assert r.status_code == 200 and r.json()["owner"] == "mallory", r.text
    after = _people(api)["secrets"]
    assert after["bob"] == before["secrets"]["bob"], after
    assert [s["name"] for s in after["mallory"]] == ["BOB_KEY"], after
