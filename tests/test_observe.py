"""Watching a job: the log (cap, offsets, follow), downsampled metrics, the events stream,
the attempts. The worker protocol is driven by hand (tests.helpers): no torchrun needed.
A test that watches a job of its own runs on the module's server of its database (``api``,
helpers.its_turn); the log cap's and the stopping API's have a server of their own."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, start_server, stop_server, wait_for
from tests.helpers import finish, report, send_log, submit_and_claim

CAP = 4096  # DDPQ_LOG_MAX_BYTES of the capped server: head 1024 bytes, tail 3072


@pytest.fixture
def capped(db_url: str, tmp_path: Path) -> Iterator[Server]:
    s = start_server(db_url, tmp_path / "api", DDPQ_LOG_MAX_BYTES=str(CAP))
    yield s
    stop_server(s)


MARKER = re.compile(
    rb"\[ddpq\] (\d+) bytes of output cut here \(log cap DDPQ_LOG_MAX_BYTES=(\d+)\); "
    rb"output resumes at offset (\d+)\n"
)


def test_log_cap_keeps_head_and_tail_and_marks_the_cut(capped: Server) -> None:
    claim = submit_and_claim(capped)
    jid = claim["job_id"]
    lines = [f"[rank{i % 2}]: step {i:05d} loss {1 / (i + 1):.6f}\n".encode() for i in range(600)]
    sent = b""
    for i in range(0, len(lines), 12):  # chunks of about 400 bytes, as a worker sends them
        chunk = b"".join(lines[i : i + 12])
        assert send_log(capped, claim, len(sent), chunk) == len(sent) + len(chunk)
        sent += chunk
    user = capped.client()

    r = user.get(f"/jobs/{jid}/logs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.headers["X-Job-Status"] == "running"
    assert int(r.headers["X-Next-Offset"]) == len(sent)  # offsets count the cut bytes
    body = r.content
    markers = list(MARKER.finditer(body))
    assert len(markers) == 1, body[:2000]
    m = markers[0]
    cut, cap, resume = (int(g) for g in m.groups())
    assert cap == CAP
    head, tail = body[: m.start()], body[m.end() :]
    # The head is the first quarter, byte for byte (its last line broken by the cut,
    # so the marker starts a line of its own); the tail is the newest bytes.
    assert head.rstrip(b"\n") == sent[: CAP // 4]
    assert tail == sent[resume:]
    assert resume == CAP // 4 + cut
    assert len(head) + len(tail) <= CAP + 500  # the cap holds, to one chunk

    # An offset inside the cut answers the marker, then the tail.
    r = user.get(f"/jobs/{jid}/logs", params={"offset": CAP // 4 + 10})
    got = MARKER.match(r.content)
    assert got is not None and int(got.group(3)) == resume
    assert int(got.group(1)) == resume - (CAP // 4 + 10)
    assert r.content[got.end() :] == sent[resume:]
    # Resuming from a tail offset answers exactly the stored bytes from there.
    r = user.get(f"/jobs/{jid}/logs", params={"offset": len(sent) - 100})
    assert r.content == sent[-100:] and int(r.headers["X-Next-Offset"]) == len(sent)
    r = user.get(f"/jobs/{jid}/logs", params={"offset": len(sent)})
    assert r.content == b"" and int(r.headers["X-Next-Offset"]) == len(sent)
    # Every line the reader sees carries its mark.
    assert all(
        line.startswith((b"[rank0]: ", b"[rank1]: ", b"[ddpq] ")) for line in tail.splitlines()[1:]
    )

    r = user.get(f"/jobs/{jid}/logs", params={"offset": len(sent) + 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "offset"]
    # Output keeps arriving: the cut moves on, the head stays.
    more = b"[rank0]: the end\n"
    send_log(capped, claim, len(sent), more)
    sent += more
    body = user.get(f"/jobs/{jid}/logs").content
    assert body.startswith(sent[: CAP // 4]) and body.endswith(sent[-3000:])


def _follow(
    server: Server,
    jid: int,
    offset: int,
    out: list[bytes],
    done: threading.Event,
    opened: threading.Event | None = None,
) -> None:
    with server.client().stream(
        "GET", f"/jobs/{jid}/logs", params={"offset": offset, "follow": "true"}
    ) as r:
        assert r.status_code == 200
        if opened is not None:
            opened.set()
        for chunk in r.iter_bytes():
            out.append(chunk)
    done.set()


def test_follow_streams_output_as_it_arrives_and_ends_with_the_job(server: Server) -> None:
    claim = submit_and_claim(server)
    jid = claim["job_id"]
    first = b"[rank0]: hello\n[rank1]: hello\n"
    send_log(server, claim, 0, first)
    out: list[bytes] = []
    done = threading.Event()
    threading.Thread(target=_follow, args=(server, jid, 6, out, done), daemon=True).start()
    wait_for(lambda: b"".join(out) == first[6:], 20, "the stored part")
    # A line sent in two pieces arrives as it comes; the stream is still open.
    send_log(server, claim, len(first), b"[rank0]: step 1 lo")
    wait_for(lambda: b"".join(out).endswith(b"step 1 lo"), 20, "new output")
    send_log(server, claim, len(first) + 18, b"ss 0.5\n")
    assert not done.is_set()
    finish(server, claim)
    assert done.wait(20), "the stream did not end with the job"
    assert b"".join(out) == (first + b"[rank0]: step 1 loss 0.5\n")[6:]
    # Following an ended job answers what is stored and ends at once.
    r = server.client().get(f"/jobs/{jid}/logs", params={"follow": "true"})
    assert r.content.endswith(b"loss 0.5\n") and r.headers["X-Job-Status"] == "succeeded"

    # A stopping API process ends its streams (uvicorn waits for open answers), so
    # followers can resume on another process instead of holding this one up.
    other = submit_and_claim(server)
    done.clear()
    opened = threading.Event()
    threading.Thread(
        target=_follow, args=(server, other["job_id"], 0, [], done, opened), daemon=True
    ).start()
    # The stream must be open before the signal: a follower that connects after it
    # would meet a closed port, which is not what this checks.
    assert opened.wait(20), "the follow stream did not open"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) is not None
    assert done.wait(10)


def _points(n: int, name: str, start: int = 0) -> list[dict[str, Any]]:
    return [{"step": s, "values": {name: 10.0 - s / 1000}} for s in range(start, start + n)]


def test_downsampling_ranks_nan_above_infinity(api: Server) -> None:
    # As the README says: NaN ranks above every number, Infinity included, so a bucket
    # holding both shows its NaN (it came back as [1, "Infinity"], losing the NaN).
    claim = submit_and_claim(api)
    values: list[Any] = [1, "Infinity", "NaN", 2, 1.5]
    report(api, claim, [{"step": i + 1, "values": {"x": v}} for i, v in enumerate(values)])
    r = api.client().get(f"/jobs/{claim['job_id']}/metrics", params={"max_points": 2})
    assert [i["values"]["x"] for i in r.json()["items"]] == [1.0, "NaN"]
    r = api.client().get(f"/jobs/{claim['job_id']}/metrics", params={"max_points": 4})
    assert [(i["step"], i["values"]["x"]) for i in r.json()["items"]] == [
        (1, 1.0),
        (3, "NaN"),
        (5, 1.5),
    ]


def test_downsampling_keeps_minima_maxima_and_the_last_point(api: Server) -> None:
    claim = submit_and_claim(api)
    jid = claim["job_id"]
    loss = _points(3000, "loss")
    loss[1234]["values"]["loss"] = 99.0  # a spike
    loss[2222]["values"]["loss"] = -5.0  # the minimum
    loss[500]["values"]["loss"] = "NaN"  # a divergence
    report(api, claim, loss)
    report(api, claim, [{"step": s * 10, "values": {"acc": s / 300}} for s in range(300)])
    user = api.client()

    def series(params: dict[str, Any], name: str) -> dict[int, Any]:
        r = user.get(f"/jobs/{jid}/metrics", params=params)
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        steps = [i["step"] for i in items]
        assert steps == sorted(set(steps))
        return {i["step"]: i["values"][name] for i in items if name in i["values"]}

    def counts(params: dict[str, Any]) -> dict[str, Any]:
        r = user.get(f"/jobs/{jid}/metrics", params=params)
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()["series"]
        return answer

    got = series({"max_points": 50}, "loss")
    assert 40 <= len(got) <= 50
    # Each series says how many points it has, how many the answer shows, and so
    # whether it was downsampled (the dashboard's note under the chart).
    said = counts({"max_points": 50})
    assert said["loss"] == {"points": 3000, "shown": len(got), "downsampled": True}
    assert said["acc"]["points"] == 300 and said["acc"]["downsampled"]
    assert said["acc"]["shown"] == len(series({"max_points": 50}, "acc"))
    assert counts({"max_points": 1000, "name": "acc"}) == {
        "acc": {"points": 300, "shown": 300, "downsampled": False}
    }
    assert counts({"name": "loss"}) == {
        "loss": {"points": 3000, "shown": 3000, "downsampled": False}
    }
    assert counts({"max_points": 20, "since_step": 2500, "name": "loss"})["loss"]["points"] == 500
    assert counts({"max_points": 20, "since_step": 5000, "name": "loss"}) == {}  # none there
    assert got[1234] == 99.0 and got[2222] == -5.0 and got[500] == "NaN"
    assert got[0] == 10.0 and got[2999] == 10.0 - 2999 / 1000  # first and final values
    assert len(series({"max_points": 50}, "acc")) <= 50
    assert len(series({"max_points": 2}, "loss")) == 2
    assert set(series({"max_points": 2}, "loss").values()) == {"NaN", -5.0}
    assert len(series({"max_points": 1000}, "acc")) == 300  # short enough: whole
    # name= filters (repeat it for several); since_step applies before downsampling.
    r = user.get(f"/jobs/{jid}/metrics", params={"max_points": 10, "name": "acc"}).json()
    assert r["items"] and all(set(i["values"]) == {"acc"} for i in r["items"])
    r = user.get(f"/jobs/{jid}/metrics", params=[("name", "acc"), ("name", "loss")]).json()
    assert len(r["items"]) == 3000 and {"acc", "loss"} == set().union(
        *(i["values"] for i in r["items"])
    )
    tail = series({"max_points": 20, "since_step": 2500}, "loss")
    assert min(tail) == 2500 and max(tail) == 2999 and len(tail) <= 20
    # Steps past 2**53 (exact as floats no more) take the per-bucket path on Postgres too.
    big = [{"step": 2**60 + i * 1000, "values": {"big": float(i % 7)}} for i in range(100)]
    big[42]["values"]["big"] = 100.0
    report(api, claim, big)
    got = series({"max_points": 10, "name": "big"}, "big")
    assert len(got) <= 10 and got[2**60 + 42_000] == 100.0 and 2**60 + 99_000 in got
    said = counts({"max_points": 10, "name": "big"})
    assert said == {"big": {"points": 100, "shown": len(got), "downsampled": True}}
    # Up to the largest step: the last bucket's computed end would pass 2**63 - 1.
    top = 2**63 - 1
    edge = [{"step": top - 97 * i, "values": {"edge": float(i)}} for i in range(100)]
    edge.append({"step": 0, "values": {"edge": -1.0}})
    report(api, claim, edge)
    got = series({"max_points": 8, "name": "edge"}, "edge")
    assert len(got) <= 8 and got[top] == 0.0 and got[0] == -1.0 and got[top - 97 * 99] == 99.0
    # The full answer keeps its shape.
    full = user.get(f"/jobs/{jid}/metrics", params={"name": "loss"}).json()["items"]
    assert len(full) == 3000 and set(full[0]) == {"step", "epoch", "attempt", "time", "values"}

    for params, field in (
        ({"max_points": 1}, "max_points"),
        ({"max_points": 100_001}, "max_points"),
        ({"max_points": "x"}, "max_points"),
        ({"name": "x" * 201}, "name"),
    ):
        r = user.get(f"/jobs/{jid}/metrics", params=params)
        assert r.status_code == 422, params
        assert r.json()["detail"][0]["loc"][-1] == field
    assert user.get("/jobs/999999/metrics", params={"max_points": 10}).status_code == 404


def _sse(server: Server, jid: int, events: list[dict[str, Any]], **kw: Any) -> threading.Thread:
    """Collect the job's events (dicts with event, id, data) on a thread."""

    def run() -> None:
        with server.client().stream("GET", f"/jobs/{jid}/events", **kw) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            event: dict[str, Any] = {}
            for line in r.iter_lines():
                if not line:
                    if "event" in event:
                        events.append(event)
                    event = {}
                elif not line.startswith(":"):
                    key, _, value = line.partition(": ")
                    event[key] = json.loads(value) if key == "data" else value

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]


def test_events_stream_status_and_points_resume_without_duplicates(api: Server) -> None:
    claim = submit_and_claim(api)
    jid = claim["job_id"]
    report(api, claim, _points(5, "loss"))  # before the stream: not sent
    first: list[dict[str, Any]] = []
    _sse(api, jid, first)
    wait_for(lambda: first, 20, "the first event")
    assert first[0]["event"] == "job" and first[0]["data"]["status"] == "running"
    report(api, claim, _points(3, "loss", start=5))
    wait_for(lambda: "metrics" in _kinds(first), 20, "a metrics event")
    m = next(e for e in first if e["event"] == "metrics")
    assert [i["step"] for i in m["data"]["items"]] == [5, 6, 7]
    seen = m["id"]

    # Reconnect with Last-Event-ID after more happened: only what is new.
    report(api, claim, _points(2, "loss", start=8))
    again: list[dict[str, Any]] = []
    _sse(api, jid, again, headers={"Last-Event-ID": seen})
    wait_for(lambda: "metrics" in _kinds(again), 20, "the missed points")
    assert _kinds(again)[0] == "metrics"  # the job did not change: not sent again
    assert [i["step"] for i in again[0]["data"]["items"]] == [8, 9]

    # The end: the job's new status, then end, then the stream closes.
    done = _sse(api, jid, replay := [], params={"since": "0"})
    finish(api, claim)
    for events in (first, again, replay):
        wait_for(lambda ev=events: "end" in _kinds(ev), 20, "the end event")  # type: ignore[misc]
    done.join(20)
    assert not done.is_alive(), "the stream did not close after end"
    # Each poll sends the job (if changed), then new points, then the end.
    assert _kinds(first)[-1] == "end" and first[-1]["data"]["status"] == "succeeded"
    jobs = [e["data"]["status"] for e in first if e["event"] == "job"]
    assert jobs == ["running", "succeeded"]
    replayed = [i["step"] for e in replay if e["event"] == "metrics" for i in e["data"]["items"]]
    assert replayed == list(range(10))  # since=0: every point, once
    ids = [e["id"] for e in first]
    assert len(set(ids)) >= 2 and all(re.fullmatch(r"\d+-[0-9a-f]{8}", i) for i in ids)

    user = api.client()
    for params, headers, loc in (
        ({"since": "abc"}, {}, ["query", "since"]),
        ({}, {"Last-Event-ID": "1-xyz"}, ["header", "Last-Event-ID"]),
    ):
        r = user.get(f"/jobs/{jid}/events", params=params, headers=headers)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc
    assert user.get("/jobs/999999/events").status_code == 404


def test_attempts_auth_and_openapi(api: Server) -> None:
    claim = submit_and_claim(api)
    jid = claim["job_id"]
    finish(api, claim, exit_code=3)
    user = api.client()
    items = user.get(f"/jobs/{jid}/attempts").json()["items"]
    assert len(items) == 1
    a = items[0]
    assert (a["number"], a["worker"], a["exit_code"], a["outcome"]) == (1, "hand", 3, "failed")
    assert a["gpus"] == [] and a["started_at"] and a["finished_at"]
    assert "exited with code 3" in a["reason"]
    assert user.get("/jobs/999999/attempts").status_code == 404

    # A worker hands a job back mid-line; the next attempt's output starts a new line.
    again = submit_and_claim(api)
    send_log(api, again, 0, b"[rank0]: half a li")
    w = api.client("worker")
    r = w.post(
        f"/workers/jobs/{again['job_id']}/finish",
        json={"worker": "hand", "attempt": 1, "outcome": "requeue"},
    )
    assert r.status_code == 200 and r.json()["status"] == "queued"
    r = w.post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert r.status_code == 200 and r.json()["attempt"] == 2
    send_log(api, r.json(), 0, b"[ddpq] attempt 2\n")
    log = user.get(f"/jobs/{again['job_id']}/logs").content
    assert log == b"[rank0]: half a li\n[ddpq] attempt 2\n"
    items = user.get(f"/jobs/{again['job_id']}/attempts").json()["items"]
    assert [(a["number"], a["outcome"]) for a in items] == [(1, "requeued"), (2, "running")]
    assert "shut down" in items[0]["reason"] and items[1]["reason"] is None

    for path in ("attempts", "events", "logs?follow=true", "metrics?max_points=10"):
        for token, status in ((None, 401), ("worker", 403), (claim["token"], 403)):
            r = api.client(token).get(f"/jobs/{jid}/{path}")
            assert r.status_code == status, (path, token)

    spec = httpx.get(f"{api.url}/openapi.json").json()["paths"]
    assert (
        "text/event-stream" in spec["/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    )
    logs = spec["/jobs/{job_id}/logs"]["get"]
    assert "text/plain" in logs["responses"]["200"]["content"]
    assert {p["name"] for p in logs["parameters"]} >= {"offset", "follow"}
    metrics = spec["/jobs/{job_id}/metrics"]["get"]
    assert {p["name"] for p in metrics["parameters"]} >= {"name", "since_step", "max_points"}
    # The answer says per series what it holds and shows (service.schemas.SeriesCount).
    schemas = httpx.get(f"{api.url}/openapi.json").json()["components"]["schemas"]
    assert "MetricsPublic" in json.dumps(metrics["responses"]["200"])
    assert "series" in schemas["MetricsPublic"]["properties"]
    assert "series" not in schemas["MetricsPublic"].get("required", [])  # older answers lack it
    assert set(schemas["SeriesCount"]["properties"]) == {"points", "shown", "downsampled"}
    assert "AttemptsPublic" in json.dumps(spec["/jobs/{job_id}/attempts"])
