"""A database outage never costs a running job its attempt, on both databases.

The API's own database goes away while a job runs, for half a lease, a lease and two
leases, and comes back. On Postgres a TCP proxy between the API and the server drops
every connection and refuses new ones, or stops forwarding so that queries hang (a
network partition); the shared Postgres is left alone. On SQLite another process holds
the write lock (`BEGIN EXCLUSIVE`), so writes wait and heartbeats cannot be recorded.
Before the sweeper's grace counted from the recovery (service.db.Health), the two-lease
lock and partition declared the attempt lost and the worker killed a healthy program.
A worker that really died is still lost, one lease after the recovery.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import Server, start_server, stop_server, terminal, wait_for
from tests.faultproxy import FaultProxy
from tests.helpers import submit_and_claim

# Minutes of outages on both databases: `make test-long` runs these (CI does too).
pytestmark = pytest.mark.long

LEASE_S = 4.0

# Runs until the test creates its flag file: a job as long as the test needs.
HOLD = """
import pathlib, sys, time
flag = pathlib.Path(sys.argv[1])
print("holding", flush=True)
while not flag.exists():
    time.sleep(0.1)
print("released", flush=True)
"""


@dataclass
class Outage:
    """Cut the API off from its database and bring it back."""

    proxy: FaultProxy | None
    sqlite_path: str | None
    _blocker: sqlite3.Connection | None = None

    @property
    def kinds(self) -> list[tuple[str, float]]:
        """(how, length in leases) of each outage the job must live through."""
        if self.proxy is None:
            return [("lock", 0.5), ("lock", 1.0), ("lock", 2.0)]
        return [("refuse", 0.5), ("refuse", 1.0), ("refuse", 2.0), ("hang", 2.0)]

    def down(self, how: str) -> None:
        if self.proxy is not None:
            self.proxy.hang() if how == "hang" else self.proxy.down()
        else:
            assert self.sqlite_path is not None
            self._blocker = sqlite3.connect(self.sqlite_path, isolation_level=None, timeout=30)
            self._blocker.execute("BEGIN EXCLUSIVE")

    def up(self) -> None:
        if self.proxy is not None:
            self.proxy.up()
        else:
            assert self._blocker is not None
            self._blocker.execute("ROLLBACK")
            self._blocker.close()
            self._blocker = None

    def for_seconds(self, seconds: float, how: str = "refuse") -> datetime:
        """An outage of ``seconds``; returns when it ended."""
        self.down(how)
        try:
            time.sleep(seconds)  # the fault's length, not a wait for a condition
        finally:
            self.up()
        return datetime.now(UTC)


@pytest.fixture
def rig(db_url: str, tmp_path: Path) -> Iterator[tuple[Server, Outage]]:
    url = make_url(db_url)
    proxy = None
    if url.get_backend_name() == "postgresql":
        proxy = FaultProxy((url.host or "127.0.0.1", url.port or 5432))
        db_url = url.set(port=proxy.port).render_as_string(hide_password=False)
        outage = Outage(proxy, None)
    else:
        outage = Outage(None, url.database)
    server = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S=str(LEASE_S))
    yield server, outage
    stop_server(server)
    if proxy is not None:
        proxy.close()


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _heartbeat_after(user: httpx.Client, worker: str, when: datetime) -> bool:
    """Whether ``worker`` heartbeated after ``when`` (the API is answering again)."""
    r = user.get("/workers")
    if r.status_code != 200:
        return False
    [w] = [w for w in r.json()["items"] if w["name"] == worker]
    return _at(w["last_heartbeat"]) > when


@pytest.mark.torchrun
def test_a_running_job_keeps_its_attempt_through_outages(
    rig: tuple[Server, Outage], tmp_path: Path, start_worker: Any
) -> None:
    server, outage = rig
    user = server.client()
    w = start_worker(server)
    (w.workspace / "hold.py").write_text(HOLD)
    flag = tmp_path / "release"
    r = user.post(
        "/jobs",
        json={"entrypoint": "hold.py", "args": [str(flag)], "world_size": 1, "device": "cpu"},
    )
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    wait_for(lambda: "holding" in user.get(f"/jobs/{jid}/logs").text, 90, "the program to run")
    for how, factor in outage.kinds:
        recovered = outage.for_seconds(factor * LEASE_S, how)
        # Long enough after the recovery that a sweep acting on the outage's stale
        # heartbeats would have run: the worker has heartbeated well past a lease.
        since = recovered.timestamp() + 2 * LEASE_S
        wait_for(
            lambda since=since: _heartbeat_after(user, w.name, datetime.fromtimestamp(since, UTC)),
            60,
            f"heartbeats two leases after a {factor:g}x lease outage ({how})",
        )
        job = user.get(f"/jobs/{jid}").json()
        assert job["status"] == "running" and job["attempt"] == 1, (how, factor, job)
    flag.write_text("go")
    final = terminal(user, jid)
    attempts = user.get(f"/jobs/{jid}/attempts").json()["items"]
    assert final["status"] == "succeeded", (final, attempts, w.log())
    assert [(a["number"], a["outcome"]) for a in attempts] == [(1, "succeeded")], attempts
    if outage.proxy is not None:  # the worker felt it (on SQLite, writes wait instead)
        assert "API unavailable" in w.log(), w.log()


def test_a_dead_worker_is_still_lost_a_lease_after_the_recovery(
    rig: tuple[Server, Outage],
) -> None:
    server, outage = rig
    user = server.client()
    claim = submit_and_claim(server, max_attempts=2)  # then silent: a worker that died
    jid = claim["job_id"]
    outage.for_seconds(2 * LEASE_S, outage.kinds[-1][0])
    # Its heartbeat is two leases old, but the database only just came back.
    job = wait_for(lambda: (r := user.get(f"/jobs/{jid}")).status_code == 200 and r.json(), 30, "")
    assert job["status"] == "running", job
    job = wait_for(
        lambda: (j := user.get(f"/jobs/{jid}").json())["status"] == "queued" and j,
        10 * LEASE_S,
        "the dead worker's attempt to be lost",
    )
    assert f"worker hand lost (no heartbeat for {LEASE_S:g} s)" in job["reason"], job
