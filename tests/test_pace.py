"""The heartbeat interval and the lease the fleet's size sets (service.pace): the rule
itself, and a real API on both databases that, past its heartbeat budget, asks its
workers for slower heartbeats, keeps an attempt heartbeating at that pace alive where
the configured lease alone would have lost it, and still loses a silent one within its
lease."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.pace import Pace
from tests.conftest import NO_JOBS, Server, Worker, start_server, stop_server, wait_for
from tests.helpers import register, submit_and_claim
from worker import health


def test_the_interval_keeps_the_fleet_within_its_budget_and_the_lease_its_slack() -> None:
    pace = Pace(heartbeat_s=2.0, lease_s=30.0, budget=50.0)
    for live, interval in ((0, 2.0), (10, 2.0), (100, 2.0), (1000, 20.0), (5000, 100.0)):
        pace.update(live, now=0.0)
        assert pace.interval == pytest.approx(interval)
        assert live / pace.interval <= 50.0 or interval == 2.0
        # A heartbeat may be 28 s late (the settings' slack) at any size.
        assert pace.lease == pytest.approx(max(30.0, interval + 28.0))
        for _ in range(50):
            assert 0.9 * pace.interval <= pace.handed() <= pace.interval < pace.lease


def test_claim_long_polls_are_held_longer_as_the_fleet_grows_within_the_longest_allowed() -> None:
    """An idle host's open poll costs a request every time it ends: held for the
    interval, a fleet's polls stay within the heartbeat budget too."""
    pace = Pace(heartbeat_s=2.0, lease_s=30.0, budget=50.0)
    for live, wait in ((0, 5.0), (100, 5.0), (250, 5.0), (500, 10.0), (1000, 20.0), (5000, 30.0)):
        pace.update(live, now=0.0)
        assert pace.claim_wait(30.0) == pytest.approx(wait)
        assert pace.claim_wait(3.0) == 3.0  # never past DDPQ_MAX_CLAIM_WAIT_S
    # Their re-checks for a wake-up they were not among the first for, likewise: at most
    # 200 a second (4 per heartbeat of the budget), never more often than configured.
    for live, every in ((0, 1.0), (200, 1.0), (1000, 5.0), (5000, 25.0)):
        pace.update(live, now=0.0)
        assert pace.recheck(1.0) == pytest.approx(every)


def test_a_shrinking_fleet_keeps_the_longer_lease_until_every_worker_has_heard() -> None:
    """Workers learn a shorter interval only at their next heartbeat, one old interval
    later: until then, a worker that heard the old one is within its lease."""
    pace = Pace(heartbeat_s=2.0, lease_s=30.0, budget=50.0)
    pace.update(5000, now=0.0)  # every 100 s, lease 128 s
    pace.update(100, now=10.0)  # 2 s from now on; those told 100 s heartbeat by 110 s
    assert pace.interval == 2.0 and pace.lease == pytest.approx(128.0)
    pace.update(1000, now=50.0)  # a shrink and a growth inside the window: still 128 s
    pace.update(50, now=60.0)
    assert pace.lease == pytest.approx(128.0)
    assert not pace.update(50, now=109.0)
    # Past every told interval (100 s from 10 s; 20 s from 60 s): the settings' lease.
    assert pace.update(50, now=110.5) and pace.lease == pytest.approx(30.0)


# Slack 1 s; 4 workers: every 4 s, lease 5 s. The configured lease is short (the test waits
# out pauses past it, and the grown lease): a pause of 2.25 s is 0.75 s past it (more than
# a sweeper round, 0.5 s) and 2.75 s within the grown one.
HEARTBEAT_S, LEASE_S, BUDGET = "0.5", "1.5", "1"
PAUSE_S = 2.25
OTHERS = ("w1", "w2", "w3")


def _beat(server: Server, name: str, running: list[dict[str, int]]) -> dict[str, Any]:
    r = server.client("worker").post("/workers/heartbeat", json={"name": name, "running": running})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def test_past_its_budget_the_api_asks_for_slower_heartbeats_and_leases_grow(
    db_url: str, tmp_path: Path
) -> None:
    server = start_server(
        db_url, tmp_path / "api", DDPQ_HEARTBEAT_S=HEARTBEAT_S, DDPQ_LEASE_S=LEASE_S,
        DDPQ_MAX_HEARTBEATS_PER_S=BUDGET,
    )  # fmt: skip
    stop = threading.Event()
    beating: threading.Thread | None = None
    try:
        claim = submit_and_claim(server, "w0")
        mine = [{"job_id": claim["job_id"], "attempt": claim["attempt"]}]
        for name in OTHERS:
            register(server, name)

        def others() -> None:  # three more live hosts, at the settings' pace
            while not stop.wait(0.3):
                for name in OTHERS:
                    _beat(server, name, [])

        beating = threading.Thread(target=others, daemon=True)
        beating.start()
        # Four live workers against one heartbeat a second: every 4 s, lost after 5 s.
        reply = wait_for(
            lambda: (r := _beat(server, "w0", mine))["lease_s"] == pytest.approx(5.0) and r,
            30,
            "the lease to grow with the fleet",
        )
        assert 3.6 <= reply["heartbeat_s"] <= 4.0
        assert reply["claim_wait_s"] == 5.0  # the protocol's least, more than the interval
        # Heartbeats slower than the configured lease allows, each PAUSE_S after the last:
        # within the grown lease, the attempt is not lost.
        for _ in range(3):
            stop.wait(PAUSE_S)
            _beat(server, "w0", mine)
        job = server.client().get(f"/jobs/{claim['job_id']}").json()
        assert job["status"] == "running" and job["attempt"] == 1, job["reason"]
        # Silent from now: lost within its lease, and requeued.
        job = wait_for(
            lambda: (
                (j := server.client().get(f"/jobs/{claim['job_id']}").json())["status"] == "queued"
                and j
            ),
            30,
            "the silent attempt to be lost",
        )
        assert "worker w0 lost (no heartbeat for 5 s)" in job["reason"]
    finally:
        stop.set()
        if beating is not None:  # its last heartbeat answered before the API stops
            beating.join(timeout=30)
        stop_server(server)


def test_a_real_worker_heartbeats_at_the_pace_the_api_sets(
    db_url: str, tmp_path: Path, start_worker: Callable[..., Worker]
) -> None:
    """`ddpq worker` takes each heartbeat's interval, and its health check allows for it
    (worker.health reads the interval it records)."""
    # One worker against half a heartbeat a second: every 2 s, not the settings' 0.5 s.
    server = start_server(db_url, tmp_path / "api", DDPQ_MAX_HEARTBEATS_PER_S="0.5")
    try:
        w = start_worker(server, env=NO_JOBS)

        def recorded() -> float | None:
            try:
                rec = json.loads((w.data_dir / health.FILE).read_text())
            except (OSError, ValueError):
                return None
            return float(rec["heartbeat_s"]) if rec["heartbeat_s"] > 1.0 else None

        assert 1.8 <= wait_for(recorded, 60, "the worker to take the fleet's pace") <= 2.0
    finally:
        stop_server(server)
