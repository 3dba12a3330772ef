"""Jobs that start after others, as Slurm's --dependency=afterok/afterany, on
both databases through the worker protocol driven by hand: a job waits, with its reason,
until what it waits for succeeds (ok) or ends (any); one that can never be met fails the
job, and what waited for it in turn; a submit naming a job that does not exist, or one
that can never be met, is refused; and a dependency recorded while its job ends is never
left waiting for good (many rounds, the two released together).

Each test runs on the module's server of its database (``api``): it claims as `hand`,
which takes the oldest queued job, and what the test before left active is ended after
it (helpers.its_turn), so the only jobs queued are the test's own."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import typer

from ddpq.cli.jobflags import _after
from tests.conftest import Server
from tests.helpers import register, together

JOB = {"entrypoint": "train.py", "world_size": 1, "device": "cpu"}
ROUNDS = 20


def submit(c: httpx.Client, *after: tuple[int, str]) -> dict[str, Any]:
    deps = [{"job": j, "when": w} for j, w in after]
    r = c.post("/jobs", json={**JOB, "after": deps})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def claim(server: Server) -> dict[str, Any] | None:
    r = server.client("worker").post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 4, "free_gpus": [], "wait_s": 0}
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def finish(server: Server, c: dict[str, Any], code: int = 0) -> None:
    r = server.client("worker").post(
        f"/workers/jobs/{c['job_id']}/finish",
        json={"worker": "hand", "attempt": c["attempt"], "exit_code": code},
    )
    assert r.status_code == 200, r.text


def job(server: Server, job_id: int) -> dict[str, Any]:
    out: dict[str, Any] = server.client().get(f"/jobs/{job_id}").json()
    return out


def test_a_job_waits_for_a_success_and_fails_when_it_can_never_come(api: Server) -> None:
    server = api
    register(server, "hand", cpu_slots=4)
    c = server.client()
    a = submit(c)["id"]
    running = claim(server)
    assert running is not None and running["job_id"] == a
    b = submit(c, (a, "ok"))["id"]
    ends = submit(c, (a, "any"))["id"]
    chained = submit(c, (b, "ok"))["id"]
    assert claim(server) is None, "nothing that waits is claimed"
    waiting = job(server, b)
    assert waiting["status"] == "queued" and waiting["spec"]["after"] == [{"job": a, "when": "ok"}]
    assert waiting["reason"].startswith(f"waiting for job {a} to succeed (after: {a}:ok)"), waiting
    assert job(server, ends)["reason"].startswith(f"waiting for job {a} to end")

    finish(server, running, code=1)  # a program error: not retried, failed for good
    failed = job(server, b)
    assert failed["status"] == "failed", failed
    assert failed["reason"] == f"after {a}:ok can never be met: job {a} failed", failed
    assert job(server, chained)["reason"] == f"after {b}:ok can never be met: job {b} failed"
    started = claim(server)
    assert started is not None and started["job_id"] == ends, "any: met by the failure"
    finish(server, started)

    # A success lets what waits for it start; a submit after it starts at once.
    d = submit(c)["id"]
    first = claim(server)
    assert first is not None and first["job_id"] == d
    e = submit(c, (d, "ok"), (ends, "ok"))["id"]
    assert claim(server) is None
    finish(server, first)
    then = claim(server)
    assert then is not None and then["job_id"] == e
    finish(server, then)


def test_a_cancel_settles_what_waits_and_bad_dependencies_are_refused(api: Server) -> None:
    server = api
    register(server, "hand", cpu_slots=4)
    c = server.client()
    a = submit(c)["id"]
    ok, any_ = submit(c, (a, "ok"))["id"], submit(c, (a, "any"))["id"]
    assert c.post(f"/jobs/{a}/cancel").status_code == 202
    assert job(server, ok)["status"] == "failed"
    assert "job " + str(a) + " cancelled" in job(server, ok)["reason"]
    started = claim(server)
    assert started is not None and started["job_id"] == any_

    refused = c.post("/jobs", json={**JOB, "after": [{"job": a, "when": "ok"}]})
    assert refused.status_code == 409 and "can never be met" in refused.text, refused.text
    assert submit(c, (a, "any"))["status"] == "queued"
    for bad, field in (
        ([{"job": 10**9}], "after"),
        ([{"job": a}, {"job": a, "when": "any"}], "after"),
        ([{"job": a, "when": "sometimes"}], "when"),
        ([{"job": 0}], "job"),
    ):
        r = c.post("/jobs", json={**JOB, "after": bad})
        assert r.status_code == 422 and field in r.text, (bad, r.text)
    missing = c.post("/jobs", json={**JOB, "after": [{"job": 10**9}]}).json()["detail"][0]
    assert missing["loc"] == ["body", "after", 0, "job"], missing


def test_a_dependency_recorded_as_its_job_ends_never_waits_for_good(api: Server) -> None:
    server = api
    register(server, "hand", cpu_slots=4)
    c, c2 = server.client(), server.client()
    for client in (c, c2, server.client("worker")):
        client.get("/healthz")
    for n in range(ROUNDS):
        a = submit(c)["id"]
        running = claim(server)
        assert running is not None and running["job_id"] == a

        def later() -> httpx.Response:
            return c2.post("/jobs", json={**JOB, "after": [{"job": a, "when": "ok"}]})

        def done() -> httpx.Response:
            return server.client("worker").post(
                f"/workers/jobs/{a}/finish",
                json={"worker": "hand", "attempt": running["attempt"], "exit_code": 0},
            )

        made, ended = together(later, done)
        assert ended.status_code == 200, ended.text
        assert made.status_code == 201, made.text
        started = claim(server)
        assert started is not None and started["job_id"] == made.json()["id"], f"round {n}"
        finish(server, started)


def test_the_cli_reads_after() -> None:
    assert _after("12") == {"job": 12, "when": "ok"}
    assert _after("12:any") == {"job": 12, "when": "any"}
    for bad in ("x", "12:maybe", "0", "-3", "\uff11\uff12"):  # full-width digits
        with pytest.raises(typer.BadParameter):
            _after(bad)
