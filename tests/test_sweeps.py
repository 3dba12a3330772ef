"""Sweeps (issue 43) through the API, on both databases, with workers driven by hand
through the worker protocol and metrics reported with each trial's job token (no torch):
a grid runs every point once (bad sweeps refused by field); TPE keeps to max_concurrent;
trials take their fair-share place against another user's job, and a cancel cancels
them; a queued limit makes a sweep wait; ASHA prunes exactly what Optuna's own study
decides on the same values; a sweep goes on across an API restart and a lost worker;
rounds decided at once never make a trial twice. Last, one sweep end to end with a real
worker and a tiny program (SQLite only: a worker's launch is most of its time)."""

from __future__ import annotations

import csv
import io
import json
import random
import re
import textwrap
from pathlib import Path
from typing import Any

import optuna
import pytest

from service import jobs, sweeps, sweepviews, users
from service.db import Database
from service.schemas import SweepSpec
from service.users import Principal
from tests.conftest import (
    Server,
    module_server,
    run_ddpq,
    start_server,
    stop_server,
    wait_for,
)
from tests.helpers import register, report, together

# The sweeper's round every 0.5 s (a third of the gang timeout): sweeps decide at once.
FAST = {"DDPQ_GANG_TIMEOUT_S": "1.5"}
SLOT = {"free_gpus": [], "wait_s": 0}


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One API per database for the tests that need nothing else of it (a server start
    is most of a test's time): each uses workers and users of its own."""
    yield from module_server(request, tmp_path_factory, **FAST)


def claim(server: Server, worker: str, slots: int = 8) -> dict[str, Any] | None:
    register(server, worker, cpu_slots=slots)
    r = server.client("worker").post(
        "/workers/claim", json={"name": worker, "free_cpu_slots": slots, **SLOT}
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def finish(server: Server, c: dict[str, Any], worker: str, **how: Any) -> dict[str, Any]:
    body = {"worker": worker, "attempt": c["attempt"], "exit_code": 0, **how}
    r = server.client("worker").post(f"/workers/jobs/{c['job_id']}/finish", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def heartbeat(server: Server, worker: str, running: list[dict[str, Any]]) -> dict[str, Any]:
    held = [{"job_id": c["job_id"], "attempt": c["attempt"]} for c in running]
    r = server.client("worker").post("/workers/heartbeat", json={"name": worker, "running": held})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def sweep_of(client: Any, sweep_id: int) -> dict[str, Any]:
    r = client.get(f"/sweeps/{sweep_id}")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def trial(sweep: dict[str, Any], number: int) -> dict[str, Any]:
    return next(t for t in sweep["trials"] if t["number"] == number)


def ended(client: Any, sweep_id: int) -> dict[str, Any]:
    """The sweep once it has ended."""
    return wait_for(
        lambda: (s := sweep_of(client, sweep_id))["status"] != "running" and s,
        30,
        f"sweep {sweep_id} to end",
    )


def made(client: Any, sweep_id: int, n: int) -> dict[str, Any]:
    """The sweep once it has made ``n`` trials."""
    return wait_for(
        lambda: (s := sweep_of(client, sweep_id))["trials_made"] >= n and s,
        30,
        f"sweep {sweep_id} to make {n} trials",
    )


def run_trial(server: Server, c: dict[str, Any], worker: str, loss: float, step: int = 10) -> None:
    report(server, c, [{"step": step, "values": {"loss": loss}}])
    finish(server, c, worker)


def grid_body(**over: Any) -> dict[str, Any]:
    return {
        "name": "grid",
        "job": {
            "entrypoint": "train.py",
            "args": ["--lr", "{lr}", "--act={act}", "{{literal}}"],
            "env": {"WIDTH": "{width}"},
        },
        "space": {
            "lr": {"type": "float", "low": 0.1, "high": 0.3, "step": 0.1},
            "act": {"type": "categorical", "values": ["relu", "gelu"]},
            "width": {"type": "fixed", "value": 64},
        },
        "method": "grid",
        "metric": "loss",
        "max_concurrent": 2,
        **over,
    }


def test_a_grid_sweep_runs_every_point_once_and_bad_sweeps_are_refused(api: Server) -> None:
    user = api.client()
    r = user.post("/sweeps", json=grid_body())
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert sweep["max_trials"] == 6 and sweep["trials_made"] == 2  # max_concurrent at once
    seen: list[dict[str, Any]] = []
    while len(seen) < 6:
        c = wait_for(lambda: claim(api, "hand"), 30, "a trial to claim")
        spec = c["spec"]
        p = spec["params"]
        # The parameters reach the program three ways: args, env, params (DDPQ_PARAMS).
        assert spec["args"] == ["--lr", str(p["lr"]), f"--act={p['act']}", "{literal}"]
        assert spec["env"] == {"WIDTH": "64"} and p["width"] == 64
        assert spec["name"] == f"grid/{len(seen)}"
        seen.append(p)
        # lr 0.2 with gelu is the best point
        run_trial(api, c, "hand", abs(p["lr"] - 0.2) + (0 if p["act"] == "gelu" else 1))
    done = ended(user, sweep["id"])
    points = {(p["lr"], p["act"]) for p in seen}
    assert points == {(lr, a) for lr in (0.1, 0.2, 0.3) for a in ("relu", "gelu")}
    assert len(seen) == 6 and done["status"] == "done" and done["trials_made"] == 6
    assert done["best"]["params"] == {"lr": 0.2, "act": "gelu", "width": 64}
    assert [t["rank"] for t in done["trials"]] == [1, 2, 3, 4, 5, 6]
    assert "best: trial" in done["reason"] and done["counts"]["complete"] == 6
    table = list(csv.DictReader(io.StringIO(user.get(f"/sweeps/{sweep['id']}/export").text)))
    assert [row["trial"] for row in table] == [str(t["number"]) for t in done["trials"]]
    assert table[0]["param.act"] == "gelu" and float(table[0]["loss"]) == 0
    as_json = user.get(f"/sweeps/{sweep['id']}/export", params={"format": "json"}).json()
    assert as_json["best"] == done["best"]["number"] and len(as_json["items"]) == 6
    listed = user.get("/sweeps", params={"status": "done"}).json()["items"]
    mine = next(s for s in listed if s["id"] == sweep["id"])
    assert mine["best"]["rank"] == 1 and mine["trials"] is None
    before = len(user.get("/sweeps").json()["items"])

    # Bad sweeps: a 4xx naming the field and why, never a 500; nothing made.
    def refused(body: dict[str, Any], field: str, words: str, status: int = 422) -> None:
        r = user.post("/sweeps", json=body)
        assert r.status_code == status, r.text
        detail = r.json()["detail"]
        said = (
            [detail]
            if isinstance(detail, str)
            else [".".join(map(str, d["loc"][1:])) + ": " + d["msg"] for d in detail]
        )
        assert any(field in s and words in s for s in said), said

    refused(grid_body(space={}), "space", "an empty space")
    refused(grid_body(method="bayes"), "method", "'grid', 'random' or 'tpe'")
    refused(grid_body(max_concurrent=0), "max_concurrent", "greater than or equal to 1")
    refused(grid_body(metric="lo\x07ss"), "metric", "printable")
    refused(grid_body(max_trials=7), "max_trials", "more than the grid's 6 points")
    bad = grid_body()
    bad["space"]["lr"] = {"type": "float", "low": 0.1, "high": 0.3, "log": True}
    refused(bad, "space.lr", "a grid needs its points")
    bad["space"]["lr"] = {"type": "float", "low": 0.3, "high": 0.1}
    refused(bad, "space.lr.float", "must be below high")
    bad["space"]["lr"] = {"type": "normal", "mu": 1}
    refused(bad, "space.lr", "'float', 'int', 'categorical', 'fixed'")
    refused(grid_body(method="random"), "max_trials", "needs one")
    refused(grid_body(job={"entrypoint": "t.py", "args": ["{nope}"]}), "job.args[0]", "{nope}")
    refused(grid_body(job={"entrypoint": "t.py", "params": {"a": 1}}), "job.params", "sets")
    refused(grid_body(early_stopping={"type": "hyperband"}), "early_stopping", "'asha'")
    refused(grid_body(job={"entrypoint": "t.py", "secrets": ["NOPE"]}), "secrets", "no secret")
    refused(grid_body(job={"entrypoint": "t.py", "code": "0" * 64}), "code", "no code snapshot")
    long = grid_body(job={"entrypoint": "t.py", "args": ["{act}" * 100]})
    long["space"]["act"] = {"type": "categorical", "values": ["x" * 400]}
    refused(long, "job", "trial 0's job is refused: String should have at most 10000")
    assert user.get("/sweeps/999").status_code == 404
    assert user.get(f"/sweeps/{sweep['id']}/export", params={"format": "xml"}).status_code == 422
    assert len(user.get("/sweeps").json()["items"]) == before


def test_tpe_keeps_to_max_concurrent(api: Server) -> None:
    """Six TPE trials, two at a time (its model past two startup trials): a worker with
    room for eight never holds more than two of them, and the best is the one the loss
    says."""
    user = api.client()
    body = {
        "job": {"entrypoint": "train.py"},
        "space": {
            "x": {"type": "float", "low": -1.0, "high": 1.0},
            "k": {"type": "int", "low": 1, "high": 4},
        },
        "method": "tpe",
        "startup_trials": 2,
        "metric": "loss",
        "max_trials": 6,
        "max_concurrent": 2,
        "seed": 3,
    }
    sweep = user.post("/sweeps", json=body).json()
    running: list[dict[str, Any]] = []
    losses: dict[int, float] = {}
    most = 0
    while len(losses) < 6:
        while (c := claim(api, "big")) is not None:
            running.append(c)
        most = max(most, len(running))
        assert 0 < len(running) <= 2, running
        c = running.pop(0)
        p = c["spec"]["params"]
        assert -1 <= p["x"] <= 1 and p["k"] in (1, 2, 3, 4)
        losses[c["job_id"]] = p["x"] ** 2 + p["k"]
        run_trial(api, c, "big", losses[c["job_id"]])
        if len(losses) < 6:
            made(user, sweep["id"], min(len(losses) + 2, 6))
    done = ended(user, sweep["id"])
    assert most == 2 and done["trials_made"] == 6 and done["counts"]["complete"] == 6
    assert done["best"]["value"] == min(losses.values())
    assert done["best"]["job_id"] == min(losses, key=lambda j: losses[j])


def test_trials_take_their_fair_share_place_and_a_cancel_cancels_them(api: Server) -> None:
    """Alice's random sweep, two trials at a time, and Bob's job against one slot: once a
    trial of hers has run, Bob's job goes before her queued trial (his usage is lower),
    as any two users' jobs. Bob may not cancel her sweep (audited); she may: the queued
    trial is cancelled at once, the running one once its worker stops it."""
    admin = api.client()
    alice = api.client(admin.post("/users", json={"name": "alice"}).json()["token"])
    bob = api.client(admin.post("/users", json={"name": "bob"}).json()["token"])
    body = {
        "name": "fair",
        "job": {"entrypoint": "train.py"},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}},
        "metric": "loss",
        "max_trials": 4,
        "max_concurrent": 2,
    }
    sweep = alice.post("/sweeps", json=body).json()
    first, second = sorted(t["job_id"] for t in sweep["trials"])
    bobs = bob.post("/jobs", json={"entrypoint": "train.py"}).json()["id"]
    assert bobs > second
    c = claim(api, "one", slots=1)
    assert c is not None and c["job_id"] == first  # nobody has used anything: oldest first
    run_trial(api, c, "one", 0.5)
    third = made(alice, sweep["id"], 3)
    assert {t["state"] for t in third["trials"]} == {"complete", "active"}
    c = claim(api, "one", slots=1)
    assert c is not None and c["job_id"] == bobs, "Bob's job goes before Alice's queued trial"
    finish(api, c, "one")
    c = claim(api, "one", slots=1)
    assert c is not None and c["job_id"] == second
    # At most two of hers at once: the running one and the third, queued.
    hers = alice.get("/jobs", params={"user": "alice", "status": "queued,running"}).json()
    assert len(hers["items"]) == 2

    assert bob.post(f"/sweeps/{sweep['id']}/cancel").status_code == 403
    audit = admin.get("/audit").json()["items"]
    assert any(
        e["action"] == "refused.cancel"
        and e["actor"] == "bob"
        and e["target"] == f"sweep {sweep['id']}"
        for e in audit
    ), audit
    r = alice.post(f"/sweeps/{sweep['id']}/cancel")
    assert r.status_code == 202, r.text
    cancelled = r.json()
    assert cancelled["status"] == "cancelled" and cancelled["reason"] == "cancelled by alice"
    states = {t["job_id"]: (t["state"], t["status"]) for t in cancelled["trials"]}
    third_job = max(states)
    assert states[first] == ("complete", "succeeded")
    assert states[second] == ("cancelled", "cancelling")
    assert states[third_job] == ("cancelled", "cancelled")
    assert [x["job_id"] for x in heartbeat(api, "one", [c])["cancel"]] == [second]
    finish(api, c, "one", outcome="cancelled", exit_code=None)
    job = alice.get(f"/jobs/{second}").json()
    assert job["status"] == "cancelled" and f"sweep {sweep['id']} was cancelled" in job["reason"]
    assert alice.post(f"/sweeps/{sweep['id']}/cancel").status_code == 409
    assert sweep_of(alice, sweep["id"])["trials_made"] == 3


def test_a_sweep_waits_for_its_owners_queued_limit_and_keeps_to_the_priority_cap(
    api: Server,
) -> None:
    """Carol may queue one job: her sweep of two at once makes one trial and says why
    it waits, and the next once the first has started. A priority over her cap refuses
    the sweep itself (403, audited), as it would a job."""
    admin = api.client()
    carol = api.client(admin.post("/users", json={"name": "carol"}).json()["token"])
    assert admin.put("/quotas/carol", json={"max_queued": 1}).status_code == 200
    body = {
        "job": {"entrypoint": "train.py"},
        "space": {"n": {"type": "int", "low": 1, "high": 9}},
        "metric": "loss",
        "max_trials": 2,
        "max_concurrent": 2,
    }
    r = carol.post("/sweeps", json={**body, "job": {"entrypoint": "train.py", "priority": 5}})
    assert r.status_code == 403 and "cap" in r.text, r.text
    audit = admin.get("/audit").json()["items"]
    assert any(e["action"] == "refused.submit" and e["actor"] == "carol" for e in audit)
    sweep = carol.post("/sweeps", json=body).json()
    assert sweep["trials_made"] == 1, sweep
    assert sweep["reason"].startswith("waiting to make trial 1: carol has 1 jobs queued")
    c = claim(api, "carols")
    assert c is not None and c["spec"]["params"]["n"] == sweep["trials"][0]["params"]["n"]
    second = made(carol, sweep["id"], 2)
    assert second["reason"] is None
    run_trial(api, c, "carols", 1.0)
    c = wait_for(lambda: claim(api, "carols"), 30, "the second trial to claim")
    run_trial(api, c, "carols", 2.0)
    assert ended(carol, sweep["id"])["best"]["value"] == 1.0


def _rung_values(seed: int) -> dict[int, list[float]]:
    rng = random.Random(seed)
    return {n: [round(rng.uniform(0.1, 1.0), 4) for _ in range(3)] for n in range(9)}


def test_asha_prunes_exactly_what_optuna_decides_and_stops_those_trials(api: Server) -> None:
    """Nine trials at once under ASHA (rungs at steps 100, 300, 900; a third kept). Each
    reports the loss at each rung in turn, the sweep deciding after every report; the
    trials it stops are those Optuna's own SuccessiveHalvingPruner stops on the same
    values in the same order, and each stops as a cancel would, with the cut in words."""
    user = api.client()
    body = {
        "job": {"entrypoint": "train.py"},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
        "metric": "loss",
        "max_trials": 9,
        "max_concurrent": 9,
        "early_stopping": {"type": "asha", "min_steps": 100, "reduction_factor": 3},
    }
    sweep = user.post("/sweeps", json=body).json()
    claims = {}
    while len(claims) < 9:
        c = wait_for(lambda: claim(api, "wide", slots=16), 30, "a trial to claim")
        claims[c["spec"]["name"].rsplit("/", 1)[1]] = c
    by_number = {int(n): c for n, c in claims.items()}
    values = _rung_values(8)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    reference = optuna.create_study(
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=100, reduction_factor=3)
    )
    ref_trials = [reference.ask() for _ in range(9)]
    expected: set[int] = set()
    pruned_words: dict[int, str] = {}
    for k, step in enumerate((100, 300, 900)):
        # This rung's reports one after another, in trial order; the sweep tells its
        # pruner the points in the order they were reported, in one round or several.
        reporting = [n for n in range(9) if n not in expected]
        for n in reporting:
            report(api, by_number[n], [{"step": step, "values": {"loss": values[n][k]}}])
            ref_trials[n].report(values[n][k], step)
            if ref_trials[n].should_prune():
                expected.add(n)
                reference.tell(ref_trials[n], state=optuna.trial.TrialState.PRUNED)

        def decided(k: int = k, reporting: list[int] = reporting) -> dict[str, Any] | None:
            s = sweep_of(user, sweep["id"])
            done = all(len(trial(s, n)["rungs"]) == k + 1 for n in reporting)
            return s if done else None

        s = wait_for(decided, 30, f"the sweep to decide every trial at step {step}")
        pruned_words.update(
            {n: trial(s, n)["reason"] for n in reporting if trial(s, n)["state"] == "pruned"}
        )
    assert set(pruned_words) == expected and 0 < len(expected) < 9
    cut = re.compile(
        r"pruned at step (100|300|900): loss [0-9.]+, rung cut [0-9.]+ \(\d of \d trials kept\)"
    )
    assert all(cut.fullmatch(w) for w in pruned_words.values()), pruned_words
    # The pruned trials stop as a cancel does: their worker is told, they end cancelled.
    alive = [by_number[n] for n in range(9) if n not in expected]
    stopping = [by_number[n] for n in sorted(expected)]
    told = heartbeat(api, "wide", alive + stopping)["cancel"]
    assert sorted(x["job_id"] for x in told) == sorted(c["job_id"] for c in stopping)
    for n in sorted(expected):
        job = finish(api, by_number[n], "wide", outcome="cancelled", exit_code=None)
        assert (
            job["status"] == "cancelled"
            and job["reason"] == f"cancelled by ddpq: {pruned_words[n]}"
        )
    for c in alive:
        finish(api, c, "wide")
    done = ended(user, sweep["id"])
    survivors = {n: values[n][2] for n in range(9) if n not in expected}
    assert done["best"]["number"] == min(survivors, key=lambda n: survivors[n])
    assert done["counts"] == {"active": 0, "paused": 0, "complete": len(survivors),
                              "pruned": len(expected), "failed": 0, "cancelled": 0}  # fmt: skip
    ranked = [t["state"] for t in done["trials"]]
    assert ranked == ["complete"] * len(survivors) + ["pruned"] * len(expected)


def test_a_trial_reaching_a_rung_is_judged_in_its_own_report(api: Server) -> None:
    """A trial's spec carries its rungs; points sent with ``judge`` that reach one are
    judged in that request: the answer says to stop a trial the cut prunes (and its job
    is being cancelled with the cut in words), and nothing for one that goes on, for
    points short of the rung, or for a job of no sweep."""
    user = api.client()
    body = {
        "name": "judged",
        "job": {"entrypoint": "train.py"},
        "space": {"lr": {"type": "categorical", "values": [0.1, 0.2, 0.3]}},
        "method": "grid",
        "metric": "loss",
        "max_concurrent": 3,
        "early_stopping": {"type": "asha", "min_steps": 100, "reduction_factor": 3},
    }
    r = user.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep = r.json()
    claims: list[dict[str, Any]] = []
    while len(claims) < 3:
        c = wait_for(lambda: claim(api, "judged", slots=16), 30, "a trial")
        assert c["spec"]["name"].startswith("judged/"), c["spec"]  # no other test's job
        claims.append(c)
    first, second = sorted(claims, key=lambda c: c["job_id"])[:2]
    assert first["spec"]["rungs"][:3] == [100, 300, 900]

    def judged(c: dict[str, Any], step: int, loss: float) -> dict[str, Any]:
        r = api.client(c["token"]).post(
            f"/jobs/{c['job_id']}/metrics",
            params={"judge": "true"},
            json={"items": [{"step": step, "values": {"loss": loss}}]},
        )
        assert r.status_code == 202, r.text
        out: dict[str, Any] = r.json()
        return out

    assert judged(second, 99, 5.0) == {"accepted": 1, "stop": None}  # short of the rung
    assert judged(first, 100, 0.5)["stop"] is None  # the first at its rung goes on
    assert len(trial(sweep_of(user, sweep["id"]), 0)["rungs"]) == 1  # recorded at once
    stop = judged(second, 100, 0.9)["stop"]
    assert stop == "pruned at step 100: loss 0.9, rung cut 0.5 (1 of 2 trials kept)"
    job = user.get(f"/jobs/{second['job_id']}").json()
    assert job["status"] == "cancelling"
    assert job["reason"] == f"cancel requested by ddpq: {stop}; stopping its processes"
    assert judged(second, 300, 0.1)["stop"] is None  # judged once: it is no trial now
    plain = user.post("/jobs", json={"entrypoint": "train.py", "rungs": [1]}).json()
    c = wait_for(lambda: claim(api, "judged-plain", slots=16), 30, "the plain job")
    assert c["job_id"] == plain["id"]
    assert judged(c, 5, 1.0)["stop"] is None
    assert user.post(f"/sweeps/{sweep['id']}/cancel").status_code == 202


def test_asha_pause_mode_holds_a_paused_trial_and_resumes_it_from_its_checkpoint(
    api: Server,
) -> None:
    """ASHA's pause mode through the worker protocol: a trial short of its rung's best
    third is told to stop in its own report; its worker is asked to hand it back; however
    it then ends (its own exit 0, a signal) its job is held, uncounted, with the words,
    and the trial paused. When a third trial makes the first one of its rung's best, that
    one is promoted before any other: its job is queued again, and its next attempt is
    offered its checkpoint. Once no trial runs and none can be made, the best of what is
    left goes on and the rest are pruned, their held jobs cancelled."""
    user = api.client()
    body = {
        "name": "paused",
        "job": {"entrypoint": "train.py"},
        "space": {"lr": {"type": "categorical", "values": [0.1, 0.2, 0.3]}},
        "method": "grid",
        "metric": "loss",
        "max_concurrent": 3,
        "early_stopping": {
            "type": "asha", "mode": "pause", "min_steps": 100, "reduction_factor": 3
        },
    }  # fmt: skip
    sweep = user.post("/sweeps", json=body).json()
    assert sweep["spec"]["early_stopping"]["mode"] == "pause"
    claims: dict[int, dict[str, Any]] = {}
    while len(claims) < 3:
        c = wait_for(lambda: claim(api, "pauser", slots=16), 30, "a trial")
        assert c["spec"]["name"].startswith("paused/"), c["spec"]
        claims[int(c["spec"]["name"].rsplit("/", 1)[1])] = c

    def judged(c: dict[str, Any], step: int, loss: float) -> str | None:
        r = api.client(c["token"]).post(
            f"/jobs/{c['job_id']}/metrics",
            params={"judge": "true"},
            json={"items": [{"step": step, "values": {"loss": loss}}]},
        )
        assert r.status_code == 202, r.text
        stop: str | None = r.json()["stop"]
        return stop

    def job(c: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = user.get(f"/jobs/{c['job_id']}").json()
        return out

    first = judged(claims[0], 100, 0.5)
    assert first == (
        "paused at step 100: loss 0.5, the first 1 at rung 0 (step 100): none goes on "
        "before 3 have reached it; resumes if it is promoted"
    )
    assert job(claims[0])["status"] == "running"  # until its processes are gone
    told = heartbeat(api, "pauser", list(claims.values()))
    assert (
        told["preempt"] == [{"job_id": claims[0]["job_id"], "attempt": 1, "reason": first}]
        and told["cancel"] == []
    )
    r = api.client(claims[0]["token"]).post(
        f"/jobs/{claims[0]['job_id']}/checkpoints",
        json={"path": f"{claims[0]['checkpoint_dir']}/step-100.pt", "step": 100},
    )
    assert r.status_code == 201, r.text
    held = finish(api, claims[0], "pauser")  # its SIGTERM handler saved, then exit 0
    assert (held["status"], held["reason"]) == ("held", first)
    # Its attempt handed back, not failed: no attempt of max_attempts spent.
    attempts = user.get(f"/jobs/{claims[0]['job_id']}/attempts").json()["items"]
    assert [(a["outcome"], a["reason"]) for a in attempts] == [("requeued", first)]
    assert judged(claims[1], 100, 0.9) is not None
    held = finish(api, claims[1], "pauser", exit_code=143)  # or killed by the signal
    assert held["status"] == "held"
    s = sweep_of(user, sweep["id"])
    assert [trial(s, n)["state"] for n in range(3)] == ["paused", "paused", "active"]
    assert s["counts"]["paused"] == 2
    # The third makes trial 0 the best of three: 0 is promoted, 2 pauses.
    third = judged(claims[2], 100, 0.7)
    assert third is not None and "rung cut 0.5 (the best 1 of 3 trials at rung 0 go on)" in third
    assert job(claims[0])["status"] == "queued"
    assert trial(sweep_of(user, sweep["id"]), 0)["state"] == "active"
    again = wait_for(lambda: claim(api, "pauser", slots=16), 30, "trial 0 again")
    assert (again["job_id"], again["attempt"]) == (claims[0]["job_id"], 2)
    assert again["resume_from"] == [f"{claims[0]['checkpoint_dir']}/step-100.pt"]
    assert finish(api, claims[2], "pauser")["status"] == "held"
    # Trial 0 runs on past its rung to its end (no rung at step 150).
    assert judged(again, 150, 0.3) is None
    assert finish(api, again, "pauser")["status"] == "succeeded"
    done = ended(user, sweep["id"])
    assert done["status"] == "done" and done["best"]["number"] == 0
    assert done["counts"] | {} == {"active": 0, "paused": 0, "complete": 1, "pruned": 2,
                                   "failed": 0, "cancelled": 0}  # fmt: skip
    for n, loss in ((1, "0.9"), (2, "0.7")):
        words = trial(done, n)["reason"]
        assert words.startswith(f"pruned at step 100: loss {loss}, paused and never among")
        cancelled = job(claims[n])
        assert cancelled["status"] == "cancelled"
        assert cancelled["reason"] == f"cancelled by ddpq while held: {words}"


def test_a_sweep_goes_on_across_an_api_restart_and_a_lost_worker(
    db_url: str, tmp_path: Path
) -> None:
    """Trial 0's worker is lost mid-trial (its lease runs out): the trial is requeued as
    any job is. The API stops and starts again on the same database; another worker runs
    trial 0 again, and the sweep makes the rest. The draws are what the same seed draws in
    a sweep that nothing interrupted."""
    lease = {"DDPQ_LEASE_S": "3", **FAST}
    server = start_server(db_url, tmp_path / "api", **lease)
    body = {
        "job": {"entrypoint": "train.py"},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}},
        "metric": "loss",
        "max_trials": 3,
        "seed": 42,
    }
    try:
        sweep = server.client().post("/sweeps", json=body).json()
        c = claim(server, "lost")
        assert c is not None
        report(server, c, [{"step": 1, "values": {"loss": 9.0}}])
        lost = wait_for(
            lambda: (
                (j := server.client().get(f"/jobs/{c['job_id']}").json())["status"] == "queued"
                and j
            ),
            30,
            "the lost worker's trial to be requeued",
        )
        assert "lost" in lost["reason"], lost["reason"]
    finally:
        stop_server(server)
    tokens = (server.api_token, server.worker_token)
    server = start_server(db_url, tmp_path / "api", tokens=tokens, **lease)
    try:
        user = server.client()
        for n in range(3):
            c = wait_for(lambda: claim(server, "found"), 30, f"trial {n} to claim")
            heartbeat(server, "found", [c])
            assert c["spec"]["name"].endswith(f"/{n}") and c["attempt"] == (2 if n == 0 else 1)
            run_trial(server, c, "found", 1.0 + n)
        done = ended(user, sweep["id"])
        assert done["status"] == "done" and trial(done, 0)["value"] == 1.0  # attempt 2's
        again = user.post("/sweeps", json=body).json()
        for n in range(3):
            c = wait_for(lambda: claim(server, "found"), 30, f"trial {n} to claim")
            run_trial(server, c, "found", 1.0)
        twin = ended(user, again["id"])
        params = [{t["number"]: t["params"] for t in s["trials"]} for s in (done, twin)]
        assert params[0] == params[1] and len({p["lr"] for p in params[0].values()}) == 3
    finally:
        stop_server(server)


def test_rounds_at_once_never_make_a_trial_twice(db: Database) -> None:
    """Rounds of one sweep decided at once (two API processes; a round and a cancel of a
    trial) make each trial once: a round writes only on the sweep it read."""
    users.bootstrap(db, "0" * 64)
    admin = Principal("admin", "admin")
    body = {
        "job": {"entrypoint": "train.py"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "metric": "loss",
        "max_trials": 8,
        "max_concurrent": 4,
    }
    first = sweeps.create(db, SweepSpec.model_validate(body), admin)
    for t in first.trials or []:
        assert t.job_id is not None
        jobs.cancel_job(db, t.job_id, admin)  # four ended trials: room for four more
    together(*[lambda: sweeps.advance(db, first.id)] * 6)
    sweeps.advance(db, first.id)
    done = sweepviews.get_sweep(db, first.id)
    numbers = sorted(t.number for t in done.trials or [])
    assert numbers == list(range(8)) and done.trials_made == 8
    assert len({t.job_id for t in done.trials or []}) == 8
    assert done.counts.cancelled == 4 and done.counts.active == 4


TRIAL_PROGRAM = """
import os
import sys

import ddpq

p = ddpq.params()
lr = float(sys.argv[sys.argv.index("--lr") + 1])
assert lr == p["lr"] == float(os.environ["LR"]), (lr, p, os.environ.get("LR"))
loss = (lr - 0.3) ** 2 + 0.01 * p["width"]
for step in (0, 10):
    ddpq.report(step, loss=loss + (10 - step))
ddpq.flush()
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_sweep_end_to_end_with_a_real_worker(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    """`ddpq sweep submit` sends the code once; a real worker runs each trial, whose
    program reads ddpq.train.params() (and its args and env) and reports a loss made of
    them; `ddpq sweep status` ranks them, `ddpq sweep export` writes the table."""
    server = start_server(db_url, tmp_path / "api", **FAST)
    try:
        start_worker(server, cpu_slots=2)
        code = tmp_path / "code"
        code.mkdir()
        (code / "trial.py").write_text(TRIAL_PROGRAM)
        (code / "sweep.yaml").write_text(
            textwrap.dedent(
                """
                name: e2e
                job:
                  entrypoint: trial.py
                  workdir: .
                  device: cpu
                  args: [--lr, "{lr}"]
                  env: {LR: "{lr}"}
                space:
                  lr: [0.3, 0.6]
                  width: 2
                method: grid
                metric: loss
                max_concurrent: 2
                """
            )
        )
        env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
        submitted = run_ddpq("sweep", "submit", "sweep.yaml", env=env, cwd=code)
        assert submitted.returncode == 0, submitted.stderr
        assert "sweep 1 running: grid over lr, width, 2 trials, 2 at once" in submitted.stdout
        done = wait_for(
            lambda: (s := sweep_of(server.client(), 1))["status"] != "running" and s,
            120,
            "the sweep to end",
        )
        assert done["status"] == "done", done
        assert done["best"]["params"] == {"lr": 0.3, "width": 2}
        assert done["best"]["value"] == pytest.approx(0.02)
        shown = run_ddpq("sweep", "status", "1", env=env)
        assert shown.returncode == 0, shown.stderr
        assert re.search(r"RANK\s+TRIAL\s+JOB\s+STATE\s+LOSS\s+STEP\s+LR\s+WIDTH", shown.stdout)
        assert "best" in shown.stdout and "0.02 (trial 0" in shown.stdout, shown.stdout
        table = run_ddpq("sweep", "export", "1", env=env)
        assert (
            table.stdout.splitlines()[0]
            == "rank,trial,job,state,status,loss,step,param.lr,param.width,reason"
        )
        listed = run_ddpq("sweep", "ls", env=env)
        assert "e2e" in listed.stdout and "2/2" in listed.stdout, listed.stdout
        _a_pruned_trial_stops_in_its_own_report(server, code, tmp_path / "signals")
        _paused_trials_resume_where_they_stopped(server, code, tmp_path / "signals")
    finally:
        stop_server(server)


# Two trials at once: the good one reaches the rung (step 10) and ends at step 20, then
# lets the bad one report; the bad one would run for hours unless stopped.
PRUNED_PROGRAM = """
import os
import pathlib
import time

import ddpq

lr = ddpq.params()["lr"]
done = pathlib.Path(os.environ["SIGNALS"]) / "good-done"
while lr > 0.5 and not done.exists():
    time.sleep(0.01)
for step in range(10**6):
    ddpq.report(step, loss=lr)
    if lr < 0.5 and step == 20:
        break
    time.sleep(0.01)
ddpq.flush()
done.touch()
"""


def _a_pruned_trial_stops_in_its_own_report(server: Server, code: Path, signals: Path) -> None:
    """Under ASHA, the trial the cut prunes learns it from the answer to the report that
    reached the rung and stops its program there (its log says so, which only its
    reporter writes), not at its worker's next heartbeat; it ends cancelled, pruned."""
    signals.mkdir()
    (code / "pruned.py").write_text(PRUNED_PROGRAM)
    (code / "pruned.yaml").write_text(
        textwrap.dedent(
            f"""
            name: pruned
            job: {{entrypoint: pruned.py, workdir: ., device: cpu, env: {{SIGNALS: {signals}}}}}
            space: {{lr: [0.3, 0.9]}}
            method: grid
            metric: loss
            max_concurrent: 2
            early_stopping: {{type: asha, min_steps: 10, reduction_factor: 3}}
            """
        )
    )
    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    submitted = run_ddpq("sweep", "submit", "pruned.yaml", "--json", env=env, cwd=code)
    assert submitted.returncode == 0, submitted.stderr
    user = server.client()
    done = ended(user, json.loads(submitted.stdout)["id"])
    assert done["status"] == "done", done
    bad = next(t for t in done["trials"] if t["params"] == {"lr": 0.9})
    assert bad["state"] == "pruned", bad
    words = "pruned at step 10: loss 0.9, rung cut 0.3 (1 of 2 trials kept)"
    job = user.get(f"/jobs/{bad['job_id']}").json()
    assert job["status"] == "cancelled" and job["reason"] == f"cancelled by ddpq: {words}", job
    log = user.get(f"/jobs/{bad['job_id']}/logs").text
    assert f"ddpq: {words}: stopping" in log, log[-2000:]


# Stopped (SIGTERM), it saves where it stopped; started, it resumes from it. Each step it
# runs is written down, so the test sees that none ran twice.
PAUSED_PROGRAM = """
import os
import pathlib
import signal

import ddpq

lr = ddpq.params()["lr"]
stopped = []
signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
state = ddpq.load_checkpoint()
ran = pathlib.Path(os.environ["SIGNALS"]) / f"ran-{lr}"
for step in range((state["step"] if state else 0) + 1, 41):
    with ran.open("a") as f:
        f.write(f"{step}\\n")
    ddpq.report(step, loss=lr + 1 / step)
    if stopped:
        ddpq.save_checkpoint({"step": step}, step=step)
        break
ddpq.flush()
"""


def _paused_trials_resume_where_they_stopped(server: Server, code: Path, signals: Path) -> None:
    """ASHA's pause mode with a real worker, one trial at a time: the first two pause at
    the rung (step 10) in the report that reaches it, saving there; the third makes the
    first the best, which resumes from step 10, pauses alone at step 30, and, the sweep
    having made all its trials, goes on to its end. No step runs twice, nothing of a
    paused trial runs past its rung, and the other two end pruned."""
    (code / "paused.py").write_text(PAUSED_PROGRAM)
    (code / "paused.yaml").write_text(
        textwrap.dedent(
            f"""
            name: paused
            job: {{entrypoint: paused.py, workdir: ., device: cpu, env: {{SIGNALS: {signals}}}}}
            space: {{lr: [0.1, 0.2, 0.3]}}
            method: grid
            metric: loss
            max_concurrent: 1
            early_stopping: {{type: asha, mode: pause, min_steps: 10, reduction_factor: 3}}
            """
        )
    )
    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    submitted = run_ddpq("sweep", "submit", "paused.yaml", "--json", env=env, cwd=code)
    assert submitted.returncode == 0, submitted.stderr
    user = server.client()
    done = ended(user, json.loads(submitted.stdout)["id"])
    assert done["status"] == "done" and done["best"]["params"] == {"lr": 0.1}, done
    assert [t["state"] for t in done["trials"]] == ["complete", "pruned", "pruned"]
    ran = {lr: (signals / f"ran-{lr}").read_text().split() for lr in (0.1, 0.2, 0.3)}
    assert ran[0.1] == [str(s) for s in range(1, 41)]
    assert ran[0.2] == ran[0.3] == [str(s) for s in range(1, 11)]
    best = done["best"]["job_id"]
    attempts = user.get(f"/jobs/{best}/attempts").json()["items"]
    assert [a["outcome"] for a in attempts] == ["requeued", "requeued", "succeeded"]
    log = user.get(f"/jobs/{best}/logs").text
    assert "ddpq: paused at step 10: loss 0.2, the first 1 at rung 0" in log, log[-2000:]
    assert "resuming from" in log and "step-000000010.pt" in log, log[-2000:]
    points = user.get(f"/jobs/{best}/metrics", params={"name": "loss"}).json()
    assert [p["step"] for p in points["items"]] == list(range(1, 41))
