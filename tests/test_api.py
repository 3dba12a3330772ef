"""The API against a real `ddpq serve` on SQLite and on Postgres: input rules, tokens, reports.

A test that looks at jobs and workers of its own (its claim, its reports, its logs, what
its requests added to the lists) runs on the module's server of its database (``api``:
every job a test leaves active is ended after it, helpers.its_turn); one that looks at a
whole list, a queue position or a reason (which other tests' jobs and workers would
change) has a server of its own (``server``)."""

from __future__ import annotations

import json
import math
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.conftest import Server, wait_for
from tests.helpers import finish, register, submit_and_claim

GOOD = {"recipe": "toy-regression", "world_size": 2}


def _field_named(r: httpx.Response, field: str) -> bool:
    detail = r.json()["detail"]
    text = json.dumps(detail)
    return field in text


def _snapshot(server: Server) -> Any:
    return server.client().get("/jobs", params={"limit": 500}).json()["items"]


BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({**GOOD, "world_size": 0}, "world_size"),
    ({**GOOD, "world_size": -1}, "world_size"),
    ({**GOOD, "world_size": "two"}, "world_size"),
    ({**GOOD, "world_size": "2"}, "world_size"),
    ({**GOOD, "world_size": 10**9}, "world_size"),
    ({**GOOD, "world_size": 4, "nnodes": 3}, "nnodes"),
    ({"world_size": 2}, "recipe"),
    ({**GOOD, "entrypoint": "train.py"}, "recipe"),
    ({**GOOD, "recipe": "no-such-recipe"}, "recipe"),
    ({**GOOD, "args": "--lr 1"}, "args"),
    ({**GOOD, "args": ["--lr", 1]}, "args"),
    ({**GOOD, "env": {"DDPQ_JOB_TOKEN": "x"}}, "DDPQ_JOB_TOKEN"),
    ({**GOOD, "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "CUDA_VISIBLE_DEVICES"),
    ({**GOOD, "env": {"LD_PRELOAD": "/x.so"}}, "LD_PRELOAD"),
    ({**GOOD, "env": {"MASTER_PORT": "1"}}, "MASTER_PORT"),
    ({"entrypoint": "/etc/passwd"}, "entrypoint"),
    ({"entrypoint": "../outside.py"}, "entrypoint"),
    ({**GOOD, "priority": 2**40}, "priority"),
    ({**GOOD, "device": "tpu"}, "device"),
    ({**GOOD, "max_attempts": 0}, "max_attempts"),
    ({**GOOD, "surprise": True}, "surprise"),
    ({**GOOD, "name": "x" * 201}, "name"),
]


def test_bad_job_spec_is_refused_naming_the_field(api: Server) -> None:
    server = api
    c = server.client()
    c.post("/jobs", json=GOOD)
    before = _snapshot(server)
    for body, field in BAD_SPECS:
        r = c.post("/jobs", json=body)
        assert r.status_code == 422, (body, r.text)
        assert _field_named(r, field), (field, r.text)
    assert _snapshot(server) == before


def test_malformed_json_oversized_body_and_bad_ids(api: Server) -> None:
    server = api
    c = server.client()
    before = _snapshot(server)
    r = c.post(
        "/jobs",
        content=b'{"recipe": "toy-regression",',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422 and "json" in r.text.lower()
    r = c.post(
        "/jobs", content=b"x" * (2 * 1024 * 1024), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413
    for bad in ("abc", "0", "-1", str(2**64), "1.5"):
        r = c.get(f"/jobs/{bad}")
        assert r.status_code == 422, (bad, r.text)
    assert c.get("/jobs/999999").status_code == 404
    assert c.post("/jobs/999999/cancel").status_code == 404
    assert c.get("/jobs", params={"status": "sleeping"}).status_code == 422
    assert c.get("/jobs", params={"cursor": "zz"}).status_code == 422
    assert _snapshot(server) == before


def test_submit_list_get_cancel_queued(server: Server) -> None:
    c = server.client()
    a = c.post("/jobs", json={**GOOD, "name": "first"}).json()
    b = c.post("/jobs", json={**GOOD, "priority": 5}).json()
    assert a["status"] == "queued" and a["spec"]["world_size"] == 2 and a["spec"]["args"] == []
    assert c.get(f"/jobs/{a['id']}").json()["queue_position"] == 2  # b outranks it
    assert c.get(f"/jobs/{b['id']}").json()["queue_position"] == 1
    page = c.get("/jobs", params={"limit": 1}).json()
    assert [j["id"] for j in page["items"]] == [b["id"]]
    page2 = c.get("/jobs", params={"limit": 1, "cursor": page["next_cursor"]}).json()
    assert [j["id"] for j in page2["items"]] == [a["id"]] and page2["next_cursor"] is None
    r = c.post(f"/jobs/{a['id']}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert c.post(f"/jobs/{a['id']}/cancel").status_code == 409
    assert [j["id"] for j in c.get("/jobs", params={"status": "queued"}).json()["items"]] == [
        b["id"]
    ]
    recipes = c.get("/recipes").json()["items"]
    assert "toy-regression" in [r["name"] for r in recipes]


def test_list_filters_by_name_or_program_in_any_case(server: Server) -> None:
    c = server.client()
    named = c.post("/jobs", json={**GOOD, "name": "Resnet-50_sweep"}).json()
    by_recipe = c.post("/jobs", json={**GOOD, "name": None}).json()
    c.post("/jobs", json={**GOOD, "name": "other"})

    def ids(name: str) -> list[int]:
        r = c.get("/jobs", params={"name": name})
        assert r.status_code == 200, r.text
        return [j["id"] for j in r.json()["items"]]

    assert ids("RESNET") == [named["id"]]
    # LIKE's wildcards are literal characters here, not patterns.
    assert ids("_sweep") == [named["id"]] and ids("%") == [] and ids("net-50_s") == [named["id"]]
    assert by_recipe["id"] in ids(GOOD["recipe"].upper())
    # Shorter than a trigram (Postgres' index serves 3 characters or more): the same.
    assert ids("T-") == [named["id"]] and ids("5") == [named["id"]]
    r = c.get("/jobs", params={"name": ""})
    assert r.status_code == 422 and "name" in r.text


def test_idempotency_key_returns_the_same_job(api: Server) -> None:
    server = api
    c = server.client()
    before = len(_snapshot(server))
    first = c.post("/jobs", json=GOOD, headers={"Idempotency-Key": "k1"})
    again = c.post("/jobs", json=GOOD, headers={"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 201
    assert first.json()["id"] == again.json()["id"]
    other = c.post("/jobs", json={**GOOD, "world_size": 4}, headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409
    assert len(_snapshot(server)) == before + 1


def test_an_empty_or_malformed_idempotency_key_is_refused_naming_the_header(
    api: Server,
) -> None:
    server = api
    c = server.client()
    before = _snapshot(server)
    # Sent twice each: the second empty key used to hit the first one's row (a 500).
    bad_keys: list[str | bytes] = ["", "x" * 201, "ключ".encode(), b"tab\tinside"]
    for key in bad_keys * 2:
        r = c.post("/jobs", json=GOOD, headers={"Idempotency-Key": key})
        assert r.status_code == 422, (key, r.text)
        assert r.json()["detail"][0]["loc"] == ["header", "idempotency-key"], r.text
        assert "printable ASCII" in r.text
    assert _snapshot(server) == before
    key = "k" * 199 + "~"
    first = c.post("/jobs", json=GOOD, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    again = c.post("/jobs", json=GOOD, headers={"Idempotency-Key": key})
    assert again.json()["id"] == first.json()["id"]


def test_racing_submits_with_one_key_answer_the_first_job_or_409(api: Server) -> None:
    """Many rounds of several submits at once with one key, some with another body:
    one job per key; every request with the winner's body gets it, the others 409."""
    server = api
    n, rounds = 6, 25
    before = len(_snapshot(server))
    clients = [server.client() for _ in range(n)]
    for round_ in range(rounds):
        key = f"race-{round_}"
        bodies = [{**GOOD, "world_size": 1 + (i % 2 if round_ % 2 else 0)} for i in range(n)]
        answers: list[httpx.Response | None] = [None] * n
        start = threading.Barrier(n)

        def submit(i: int) -> None:
            start.wait()
            answers[i] = clients[i].post("/jobs", json=bodies[i], headers={"Idempotency-Key": key})

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        got = [a for a in answers if a is not None]
        assert len(got) == n and all(a.status_code in (201, 409) for a in got), [
            (a.status_code, a.text) for a in got
        ]
        ids = {a.json()["id"] for a in got if a.status_code == 201}
        assert len(ids) == 1, ids
        winner = next(a.json() for a in got if a.status_code == 201)
        for body, a in zip(bodies, got, strict=True):
            same = body["world_size"] == winner["spec"]["world_size"]
            assert a.status_code == (201 if same else 409), (body, a.text)
    assert len(_snapshot(server)) == before + rounds


def test_racing_first_registrations_of_one_worker_name_never_answer_500(
    api: Server,
) -> None:
    server = api
    n, rounds = 6, 15
    clients = [server.client("worker") for _ in range(n)]
    for round_ in range(rounds):
        body = {
            "name": f"racer-{round_}",
            "hostname": "h",
            "cpu_slots": 1,
            "gpus": [],
            "checkpoint_root": "/ckpt",
        }
        codes: list[int] = []
        start = threading.Barrier(n)

        def register_once(c: httpx.Client) -> None:
            start.wait()
            r = c.post("/workers/register", json=body)
            codes.append(r.status_code)

        threads = [threading.Thread(target=register_once, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(codes) == n and all(code < 500 for code in codes), codes
        assert 200 in codes
    names = {w["name"] for w in server.client().get("/workers").json()["items"]}
    # The module's other tests' workers are there too; of this test's names, each once.
    assert {n for n in names if n.startswith("racer-")} == {f"racer-{i}" for i in range(rounds)}


def test_names_with_control_or_format_characters_are_refused_and_change_nothing(
    api: Server,
) -> None:
    server = api
    c, w = server.client(), server.client("worker")
    before, workers_before = _snapshot(server), c.get("/workers").json()["items"]
    hostile = [
        "job\u001b]0;TITLE\u0007\u001b[2JX",  # retitles the window, clears the screen
        "two\nlines",
        "tab\there",
        "del\x7f",
        "c1\x9b31m",  # CSI as one C1 character
        "left\u202eright",  # a bidi override
        "zero\u200bwidth",
        "line\u2028separator",
    ]
    for name in hostile:
        r = c.post("/jobs", json={**GOOD, "name": name})
        assert r.status_code == 422, (name, r.text)
        assert r.json()["detail"][0]["loc"] == ["body", "name"], r.text
        assert "control or format characters" in r.text
        r = w.post(
            "/workers/register",
            json={
                "name": "w",
                "hostname": name,
                "cpu_slots": 1,
                "gpus": [],
                "checkpoint_root": "/ckpt",
            },
        )
        assert r.status_code == 422, (name, r.text)
        assert r.json()["detail"][0]["loc"] == ["body", "hostname"], r.text
    assert _snapshot(server) == before
    assert c.get("/workers").json()["items"] == workers_before
    # Any script, spaces of every kind, brackets and emoji are text.
    fine = "学習\u3000テスト [v2] 🚀 café"
    r = c.post("/jobs", json={**GOOD, "name": fine})
    assert r.status_code == 201 and c.get(f"/jobs/{r.json()['id']}").json()["name"] == fine


def test_env_names_and_ids_must_match_whole_not_up_to_a_final_newline(api: Server) -> None:
    server = api
    c = server.client()
    before = _snapshot(server)
    for name in ("MY_FLAG\n", "PATH\n", "LD_PRELOAD\n", "A\nB", "OK\r\n"):
        r = c.post("/jobs", json={**GOOD, "env": {name: "x"}})
        assert r.status_code == 422, (name, r.text)
        assert r.json()["detail"][0]["loc"] == ["body", "env"] and "variable name" in r.text
    assert _snapshot(server) == before
    claim = submit_and_claim(server)
    jid = claim["job_id"]
    # An event id is ASCII digits: "\d" would take any script's (U+0665, an Arabic five).
    with c.stream("GET", f"/jobs/{jid}/events", params={"since": "\u0665"}) as r:
        assert r.status_code == 422 and "since" in r.read().decode(), r.status_code
    # A job token's job is the path's whole id, not one followed by a newline.
    r = server.client(claim["token"]).post(
        f"/jobs/{jid}%0A/metrics", json={"items": [{"step": 1, "values": {"loss": 1.0}}]}
    )
    assert r.status_code == 403, r.text
    assert c.get(f"/jobs/{jid}/metrics").json()["items"] == []


def test_user_routes_demand_the_user_token(api: Server) -> None:
    server = api
    before = len(_snapshot(server))
    job_token = submit_and_claim(server)["token"]
    job = server.client().post("/jobs", json=GOOD).json()
    routes = [
        ("POST", "/jobs"),
        ("GET", "/jobs"),
        ("GET", f"/jobs/{job['id']}"),
        ("POST", f"/jobs/{job['id']}/cancel"),
        ("GET", f"/jobs/{job['id']}/metrics"),
        ("GET", f"/jobs/{job['id']}/checkpoints"),
        ("GET", f"/jobs/{job['id']}/logs"),
        ("GET", "/recipes"),
    ]
    for token, status in ((None, 401), ("not-a-token", 401), ("worker", 403), (job_token, 403)):
        c = server.client(token)
        for method, path in routes:
            r = c.request(method, path, json=GOOD if method == "POST" else None)
            assert r.status_code == status, (token, method, path, r.text)
    assert server.client().get(f"/jobs/{job['id']}").json()["status"] == "queued"
    assert len(_snapshot(server)) == before + 2
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok", "database": "ok"}


def test_worker_routes_demand_the_worker_token(api: Server) -> None:
    for token in (None, "user", "garbage-token-1234"):
        c = api.client(token)
        r = c.post(
            "/workers/register",
            json={
                "name": "x",
                "hostname": "h",
                "cpu_slots": 1,
                "gpus": [],
                "checkpoint_root": "/c",
            },
        )
        assert r.status_code in (401, 403), r.text
        r = c.post(
            "/workers/claim", json={"name": "x", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 0}
        )
        assert r.status_code in (401, 403), r.text


def test_reports_demand_this_jobs_live_token(api: Server) -> None:
    a = submit_and_claim(api)
    b = submit_and_claim(api)
    points = {"items": [{"step": 1, "values": {"loss": 1.0}}]}
    assert api.client(None).post(f"/jobs/{a['job_id']}/metrics", json=points).status_code == 401
    assert api.client("user").post(f"/jobs/{a['job_id']}/metrics", json=points).status_code == 403
    assert api.client("worker").post(f"/jobs/{a['job_id']}/metrics", json=points).status_code == 403
    r = api.client(b["token"]).post(f"/jobs/{a['job_id']}/metrics", json=points)
    assert r.status_code == 403 and "another job" in r.text
    ck = {"path": f"/ckpt/job-{a['job_id']}/x.pt", "step": 1}
    assert (
        api.client(b["token"]).post(f"/jobs/{a['job_id']}/checkpoints", json=ck).status_code == 403
    )
    user = api.client()
    assert user.get(f"/jobs/{a['job_id']}/metrics").json()["items"] == []
    assert user.get(f"/jobs/{a['job_id']}/checkpoints").json()["items"] == []
    # Once the attempt has ended its token is worthless.
    finish(api, a)
    assert (
        api.client(a["token"]).post(f"/jobs/{a['job_id']}/metrics", json=points).status_code == 403
    )
    assert user.get(f"/jobs/{a['job_id']}/metrics").json()["items"] == []


def test_metrics_keep_one_point_per_step_and_non_finite_values(api: Server) -> None:
    claim = submit_and_claim(api)
    rank0 = api.client(claim["token"])
    jid = claim["job_id"]
    r = rank0.post(
        f"/jobs/{jid}/metrics",
        json={
            "items": [
                {"step": s, "epoch": 0, "values": {"loss": 1.0 / s, "lr": 0.1}} for s in range(1, 6)
            ]
        },
    )
    assert r.status_code == 202, r.text
    # Resent (as after a lost answer) and extended: still one point per step.
    r = rank0.post(
        f"/jobs/{jid}/metrics",
        json={
            "items": [
                {"step": 5, "values": {"loss": 0.2}},
                {"step": 6, "values": {"loss": "NaN", "gnorm": "Infinity"}},
            ]
        },
    )
    assert r.status_code == 202, r.text
    user = api.client()
    items = user.get(f"/jobs/{jid}/metrics").json()["items"]
    assert [i["step"] for i in items] == [1, 2, 3, 4, 5, 6]
    assert items[4]["values"] == {"loss": 0.2, "lr": 0.1}
    assert items[5]["values"] == {"loss": "NaN", "gnorm": "Infinity"}
    job = user.get(f"/jobs/{jid}").json()
    # Each series' latest value: lr was last reported at step 5.
    assert job["latest_metrics"] == {
        "step": 6,
        "epoch": None,
        "values": {"loss": "NaN", "gnorm": "Infinity", "lr": 0.1},
    }
    assert [
        i["step"]
        for i in user.get(f"/jobs/{jid}/metrics", params={"since_step": 5, "name": "lr"}).json()[
            "items"
        ]
    ] == [5]
    # Validation of reports: empty, too many, bad values.
    for bad in (
        {"items": []},
        {"items": [{"step": i, "values": {"loss": 1}} for i in range(1001)]},
        {"items": [{"step": -1, "values": {"loss": 1}}]},
        {"items": [{"step": 1, "values": {}}]},
        {"items": [{"step": 1, "values": {"loss": "high"}}]},
        {"items": [{"step": 1.5, "values": {"loss": 1}}]},
    ):
        r = rank0.post(f"/jobs/{jid}/metrics", json=bad)
        assert r.status_code == 422, (bad if len(json.dumps(bad)) < 200 else "big", r.text[:300])
    assert len(user.get(f"/jobs/{jid}/metrics").json()["items"]) == 6
    assert math.isclose(items[0]["values"]["loss"], 1.0)


def test_total_steps_is_the_jobs_never_a_series(api: Server) -> None:
    claim = submit_and_claim(api)
    rank0 = api.client(claim["token"])
    user = api.client()
    jid = claim["job_id"]

    def post(*items: dict[str, Any]) -> httpx.Response:
        return rank0.post(f"/jobs/{jid}/metrics", json={"items": list(items)})

    def job() -> dict[str, Any]:
        result: dict[str, Any] = user.get(f"/jobs/{jid}").json()
        return result

    assert job()["total_steps"] is None
    r = post(
        {"step": 1, "total_steps": 100, "values": {"loss": 2.0}},
        {"step": 2, "values": {"loss": 1.0}},
    )
    assert r.status_code == 202 and r.json()["accepted"] == 2, r.text
    assert job()["total_steps"] == 100
    # An older ddpq.train sends it among the values: still the job's total, not a series.
    assert post({"step": 3, "values": {"loss": 0.5, "total_steps": 120.0}}).status_code == 202
    assert job()["total_steps"] == 120
    assert job()["latest_metrics"]["values"] == {"loss": 0.5}
    # A point may carry only the total; it leaves the latest metrics alone.
    r = post({"step": 9, "total_steps": 130})
    assert r.status_code == 202 and r.json()["accepted"] == 0, r.text
    assert job()["total_steps"] == 130 and job()["latest_metrics"]["step"] == 3
    # The field wins over an old-style value in the same point; the last point sent wins.
    post({"step": 4, "total_steps": 140, "values": {"loss": 0.4, "total_steps": 150}})
    assert job()["total_steps"] == 140
    post({"step": 5, "total_steps": 145, "values": {"loss": 0.3}}, {"step": 5, "total_steps": 150})
    assert job()["total_steps"] == 150
    # An old-style total that cannot be one is ignored, never stored as a series.
    for useless in (0.5, 0, -3, "NaN", "Infinity"):
        r = post({"step": 6, "values": {"total_steps": useless}})
        assert r.status_code == 202 and r.json()["accepted"] == 0, (useless, r.text)
    assert job()["total_steps"] == 150

    for params in ({}, {"max_points": 4}, {"name": "total_steps"}, {"since_step": 3}):
        items = user.get(f"/jobs/{jid}/metrics", params=params).json()["items"]
        assert all("total_steps" not in i["values"] for i in items), (params, items)
        assert params.get("name") != "total_steps" or items == []
    steps = [i["step"] for i in user.get(f"/jobs/{jid}/metrics").json()["items"]]
    assert steps == [1, 2, 3, 4, 5]

    # Refused with the field named: not a whole number of at least 1 (no coercion).
    for bad in (0, -1, 1.5, "10", True, 2**63, None):
        r = post({"step": 7, "total_steps": bad, "values": {"loss": 1.0}})
        if bad is None:  # null: the same as leaving it out
            assert r.status_code == 202, r.text
            continue
        assert r.status_code == 422 and _field_named(r, "total_steps"), (bad, r.text)
    r = post({"step": 7})
    assert r.status_code == 422 and _field_named(r, "values"), r.text
    assert job()["total_steps"] == 150

    # A new attempt (the job handed back, claimed again) keeps the total until it sends its own.
    r = api.client("worker").post(
        f"/workers/jobs/{jid}/finish", json={"worker": "hand", "attempt": 1, "outcome": "requeue"}
    )
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert r.json()["total_steps"] == 150
    r = api.client("worker").post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert r.status_code == 200 and r.json()["attempt"] == 2, r.text
    assert job()["attempt"] == 2 and job()["total_steps"] == 150
    again = api.client(r.json()["token"])
    r = again.post(f"/jobs/{jid}/metrics", json={"items": [{"step": 5, "total_steps": 200}]})
    assert r.status_code == 202 and job()["total_steps"] == 200
    # The OpenAPI document shows the field on the point and on the Job.
    spec = httpx.get(f"{api.url}/openapi.json").json()
    assert "total_steps" in spec["components"]["schemas"]["JobPublic"]["properties"]
    body = spec["paths"]["/jobs/{job_id}/metrics"]["post"]["requestBody"]
    assert "total_steps" in json.dumps(body)


def test_checkpoint_paths_must_stay_in_the_jobs_directory(api: Server) -> None:
    claim = submit_and_claim(api)
    rank0 = api.client(claim["token"])
    jid = claim["job_id"]
    root = claim["checkpoint_dir"]
    assert root == f"/ckpt/job-{jid}"
    for bad in ("/etc/passwd", f"{root}/../job-999/x.pt", f"{root}-evil/x.pt", "relative.pt", root):
        r = rank0.post(f"/jobs/{jid}/checkpoints", json={"path": bad, "step": 1})
        assert r.status_code == 422 and "path" in r.text, (bad, r.text)
    r = rank0.post(
        f"/jobs/{jid}/checkpoints",
        json={"path": f"{root}/step-1.pt", "step": 1, "epoch": 0, "metrics": {"loss": 0.5}},
    )
    assert r.status_code == 201, r.text
    items = api.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
    assert [(c["path"], c["step"], c["attempt"], c["metrics"]) for c in items] == [
        (f"{root}/step-1.pt", 1, 1, {"loss": 0.5})
    ]
    assert (
        api.client().get(f"/jobs/{jid}").json()["latest_checkpoint"]["path"] == f"{root}/step-1.pt"
    )


def test_worker_log_chunks_are_stored_once_in_order(api: Server) -> None:
    claim = submit_and_claim(api)
    w = api.client("worker")
    jid, n = claim["job_id"], claim["attempt"]

    def send(offset: int, data: bytes) -> httpx.Response:
        return w.post(
            f"/workers/jobs/{jid}/logs",
            params={"worker": "hand", "attempt": n, "offset": offset},
            content=data,
        )

    assert send(0, b"hello\n").json()["next_offset"] == 6
    assert send(0, b"hello\n").json()["next_offset"] == 6  # a resend is stored once
    assert send(6, b"world\n").json()["next_offset"] == 12
    assert send(20, b"gap\n").status_code == 409
    log = api.client().get(f"/jobs/{jid}/logs").text
    assert log == "hello\nworld\n"
    finish(api, claim)
    # After finish the attempt is over; a newer attempt's chunks would be the only ones taken.
    assert api.client().get(f"/jobs/{jid}/logs").text == log


def test_finish_is_idempotent_and_moves_the_job_on(api: Server) -> None:
    claim = submit_and_claim(api)
    job = finish(api, claim, exit_code=3)
    assert job["status"] == "failed" and job["exit_code"] == 3 and "code 3" in job["reason"]
    assert finish(api, claim, exit_code=3)["status"] == "failed"


def test_claim_respects_free_slots_and_priority(server: Server) -> None:
    register(server, "small", cpu_slots=3)
    c = server.client()
    big = c.post("/jobs", json={**GOOD, "world_size": 4}).json()
    low = c.post("/jobs", json={**GOOD, "world_size": 1}).json()
    high = c.post("/jobs", json={**GOOD, "world_size": 2, "priority": 10}).json()
    w = server.client("worker")

    def claim(free: int) -> int | None:
        r = w.post(
            "/workers/claim",
            json={"name": "small", "free_cpu_slots": free, "free_gpus": [], "wait_s": 0},
        )
        return r.json()["job_id"] if r.status_code == 200 else None

    assert claim(3) == high["id"]
    # 1 slot left by the service's books, whatever the worker says: the 4-rank job
    # cannot fit, the 1-rank job behind it can.
    assert claim(3) == low["id"]
    assert claim(3) is None
    assert claim(0) is None  # nor does a worker that reports nothing free get anything
    assert c.get(f"/jobs/{big['id']}").json()["status"] == "queued"
    assert "unschedulable: needs 4 CPU slots" in c.get(f"/jobs/{big['id']}").json()["reason"]


# Bodies the fast reading (ingest.parse_points) leaves to MetricsIn, each refused: the
# field (loc, after "body") and the reason the answer must name.
REFUSED_METRICS: list[tuple[bytes, tuple[Any, ...], str]] = [
    (b'{"items":[{"step":1,"values":{"loss":1}},"x"]}', ("items", 1), "an object"),
    (b'{"items":[{"step":"1","values":{"loss":1}}]}', ("items", 0, "step"), "valid integer"),
    (b'{"items":[{"step":1,"values":{"loss":true}}]}', ("items", 0, "values", "loss"), "number"),
    (b'{"items":[{"step":1,"epoch":"soon","values":{"a":1}}]}', ("items", 0, "epoch"), "number"),
    (b'{"items":[{"step":1,"values":{"loss":1e400}}]}', ("items", 0, "values", "loss"), "finite"),
    (b'{"items":[{"step":1,"values":{"loss":"nan"}}]}', ("items", 0, "values", "loss"), "'NaN'"),
    (b'{"items":[{"step":1,"stepp":2,"values":{"a":1}}]}', ("items", 0, "stepp"), "Extra"),
    (b'{"items":[{"step":1,"values":{"a\\u0007":1}}]}', ("items", 0, "values"), "printable"),
    (
        b'{"items":[{"step":1,"values":{"%s":1}}]}' % (b"x" * 201),
        ("items", 0, "values"),
        "at most 200",
    ),
    (b'{"items":[{"step":1,"values":{"":1}}]}', ("items", 0, "values"), "at least 1"),
    (b'{"items":[{"step":9223372036854775808,"values":{"a":1}}]}', ("items", 0, "step"), "less"),
    (b'{"items":[{"step":1,"values":{"a":1}}],"dropped":true}', ("dropped",), "integer"),
    (b'{"items":[{"step":1,"values":{"a":1}}],"dropped":-1}', ("dropped",), "greater"),
    (b'{"items":[{"step":1,"values":{"a":1}}],"more":1}', ("more",), "Extra"),
    (
        json.dumps({"items": [{"step": i, "values": {"loss": 1}} for i in range(1001)]}).encode(),
        ("items",),
        "at most 1000",
    ),
    # A good batch with one bad item at its end: the whole batch is refused.
    (
        json.dumps(
            {"items": [*({"step": i, "values": {"loss": 1.0}} for i in range(999)), {"step": 999}]}
        ).encode(),
        ("items", 999),
        "at least one metric",
    ),
]


def test_metric_reports_refused_name_the_field_and_store_nothing(api: Server) -> None:
    claim = submit_and_claim(api)
    rank0 = api.client(claim["token"])
    user = api.client()
    jid = claim["job_id"]
    good = {"items": [{"step": 1000, "epoch": 1, "values": {"loss": 0.5}}], "dropped": 2}
    assert rank0.post(f"/jobs/{jid}/metrics", json=good).status_code == 202
    before = user.get(f"/jobs/{jid}").json()
    for raw, loc, reason in [
        *REFUSED_METRICS,
        # A bare NaN token (JSON has none; Python's json module would read it), and bytes
        # that are not UTF-8.
        (b'{"items":[{"step":1,"values":{"loss":NaN}}]}', ("items", 0, "values"), "finite"),
        (b'{"items":[{"step":1,"values":{"l\xff":1}}]}', (), "UTF-8"),
    ]:
        r = rank0.post(
            f"/jobs/{jid}/metrics", content=raw, headers={"Content-Type": "application/json"}
        )
        shown = raw[:80]
        assert r.status_code == 422, (shown, r.text[:300])
        detail = r.json()["detail"]
        assert any(
            tuple(e["loc"][1 : 1 + len(loc)]) == loc and reason in e["msg"] for e in detail
        ), (shown, detail[:3])
    items = user.get(f"/jobs/{jid}/metrics").json()["items"]
    assert [(i["step"], i["values"]) for i in items] == [(1000, {"loss": 0.5})]
    after = user.get(f"/jobs/{jid}").json()
    for key in ("latest_metrics", "metrics_dropped", "total_steps"):
        assert after[key] == before[key], key


def test_a_client_that_hangs_up_mid_body_is_no_server_error(api: Server) -> None:
    """A rank killed mid-report (its job cancelled, or a sweep's trial pruned) hangs up
    while its body is read: nothing is stored, nothing is logged as the server's error,
    and the job takes its next report."""
    server = api
    start = len(server.log())  # the module's server: this test's part of its log
    claim = submit_and_claim(server)
    url = urlsplit(server.url)
    body = b'{"items": [{"step": 1, "values": {"loss": 1.0}}'  # cut short
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80)) as sock:
        sock.sendall(
            f"POST /jobs/{claim['job_id']}/metrics HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {claim['token']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 1000}\r\n\r\n".encode()
            + body
        )
    wait_for(
        lambda: "hung up before its body was read" in server.log()[start:],
        30,
        "the hang-up to be seen",
    )
    assert "Exception in ASGI application" not in server.log()[start:]
    rank0 = server.client(claim["token"])
    items = [{"step": 2, "values": {"loss": 0.5}}]
    assert rank0.post(f"/jobs/{claim['job_id']}/metrics", json={"items": items}).status_code == 202
    points = server.client().get(f"/jobs/{claim['job_id']}/metrics").json()
    assert [p["step"] for p in points["items"]] == [2], points
