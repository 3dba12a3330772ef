"""`ddpq serve --workers N`: several API processes on one port and one Postgres database.

What one process keeps in memory must not be what another needs: a claim long-polling
on one process is woken by a submit that landed on the other (LISTEN/NOTIFY), an event
stream on one sees what the other changed, a token revoked through one is refused by the
other on the next request, and only one process sweeps leases. Each test pins a
keep-alive connection to each API process: the kernel hands a new connection to either,
so the test opens connections until it has one on each (read off /proc: which process
holds the accepted socket). On SQLite, more than one process is refused.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from service.sweeper import SWEEP_APPLICATION, SWEEP_LOCK
from tests.conftest import (
    PG_ADMIN,
    Server,
    _pg_url,
    run_ddpq,
    start_server,
    stop_server,
    wait_for,
)

JOB = {"entrypoint": "noop.py", "device": "cpu"}


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


_OPEN: list[http.client.HTTPConnection] = []  # closed by the fixture


class Pinned:
    """A keep-alive connection to one API process."""

    def __init__(self, server: Server) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        self.server = server
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        _OPEN.append(self.conn)

    def call(self, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        self.conn.request(method, path, body=data, headers=headers)
        r = self.conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else None

    def process(self, children: list[int]) -> int | None:
        """The API process that accepted this connection."""
        assert self.conn.sock is not None
        mine = self.conn.sock.getsockname()[1]
        inodes = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            local, remote = int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16)
            if local == self.conn.port and remote == mine:
                inodes.add(f"socket:[{f[9]}]")
        for pid in children:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    if os.readlink(fd) in inodes:
                        return pid
                except OSError:
                    continue
        return None


def pin_each(server: Server, n: int = 2) -> list[Pinned]:
    """One connection on each of the ``n`` API processes."""
    children = wait_for(
        lambda: (c := _children(server.proc.pid)) and len(c) == n and c, 30, "the API processes"
    )
    pinned: dict[int, Pinned] = {}
    for _ in range(200):
        p = Pinned(server)
        assert p.call("GET", "/healthz", server.api_token)[0] == 200
        pid = p.process(children)
        if pid is not None and pid not in pinned:
            pinned[pid] = p
            if len(pinned) == n:
                break
    assert len(pinned) == n, "the kernel handed every connection to one process"
    return list(pinned.values())


def _start_two(url: str, data_dir: Path) -> Server:
    # A long recheck: only a NOTIFY from the other process can wake a claim in time.
    return start_server(
        url, data_dir, DDPQ_API_WORKERS="2", DDPQ_CLAIM_RECHECK_S="3600", DDPQ_LEASE_S="3"
    )


def _close_pinned() -> None:
    for conn in _OPEN:
        conn.close()
    _OPEN.clear()


@pytest.fixture(scope="module")
def two(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One `serve --workers 2` for the tests that leave it running (a start is most of
    a test's time)."""
    name = f"ddpq_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    s = _start_two(_pg_url(name), tmp_path_factory.mktemp("api"))
    yield s
    _close_pinned()
    stop_server(s)
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pinned(two: Server) -> Iterator[list[Pinned]]:
    yield pin_each(two)
    _close_pinned()


def _register(p: Pinned, name: str) -> None:
    body = {"name": name, "hostname": "h", "cpu_slots": 4, "gpus": [], "checkpoint_root": "/c"}
    assert p.call("POST", "/workers/register", p.server.worker_token, body)[0] == 200


def test_a_claim_waiting_on_one_process_is_woken_by_a_submit_on_the_other(
    two: Server, pinned: list[Pinned]
) -> None:
    a, b = pinned
    _register(a, "w1")
    got: list[tuple[int, Any]] = []
    claim = {"name": "w1", "free_cpu_slots": 4, "free_gpus": [], "wait_s": 60}
    waiting = threading.Thread(
        target=lambda: got.append(a.call("POST", "/workers/claim", two.worker_token, claim)),
        daemon=True,
    )
    waiting.start()
    # The claim is parked (no job yet) once its process has polled the queue: the
    # submit may come before or after that, the claim must get it either way.
    status, job = b.call("POST", "/jobs", two.api_token, JOB)
    assert status == 201
    # Its recheck is an hour away and its wait a minute: only the other process's
    # NOTIFY wakes it before then.
    waiting.join(timeout=20)
    assert got and got[0][0] == 200, got
    assert got[0][1]["job_id"] == job["id"]
    done = {"worker": "w1", "attempt": got[0][1]["attempt"], "exit_code": 0}
    assert b.call("POST", f"/workers/jobs/{job['id']}/finish", two.worker_token, done)[0] == 200


def test_an_event_stream_on_one_process_sees_changes_made_through_the_other(
    two: Server, pinned: list[Pinned]
) -> None:
    a, b = pinned
    status, job = a.call("POST", "/jobs", two.api_token, JOB)
    assert status == 201
    a.conn.request(
        "GET", f"/jobs/{job['id']}/events", headers={"Authorization": f"Bearer {two.api_token}"}
    )
    stream = a.conn.getresponse()
    assert stream.status == 200
    _register(b, "w2")
    claim = {"name": "w2", "free_cpu_slots": 4, "free_gpus": [], "wait_s": 5}
    status, claimed = b.call("POST", "/workers/claim", two.worker_token, claim)
    assert status == 200 and claimed["job_id"] == job["id"]
    statuses = []
    while "running" not in statuses:
        line = stream.readline().decode()
        assert line, f"the stream ended before the claim showed: {statuses}"
        if line.startswith("data: {") and '"status"' in line:
            statuses.append(json.loads(line[len("data: ") :])["status"])
    assert statuses[0] == "queued"


def _claims_asked(p: Pinned) -> float:
    """Claims p's API process has run against the database so far."""
    p.conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {p.server.api_token}"})
    text = p.conn.getresponse().read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ddpq_claim_latency_seconds_count")
    )


def test_a_finish_on_one_process_frees_its_worker_s_poll_on_the_other(
    two: Server, pinned: list[Pinned]
) -> None:
    """A worker's open long-poll (on one process) offers the slots free when it was sent;
    its finish (on the other) frees more, and the NOTIFY that carries them lets the
    waiting poll take the job that needs them (its recheck is an hour away)."""
    a, b = pinned
    children = _children(two.proc.pid)
    beside_a = next(p for p in pin_each(two) if p.process(children) == a.process(children))
    body = {"name": "w3", "hostname": "h", "cpu_slots": 2, "gpus": [], "checkpoint_root": "/c"}
    assert b.call("POST", "/workers/register", two.worker_token, body)[0] == 200
    status, first = b.call("POST", "/jobs", two.api_token, {**JOB, "world_size": 2})
    assert status == 201
    claim = {"name": "w3", "free_cpu_slots": 2, "free_gpus": [], "wait_s": 0}
    status, held = b.call("POST", "/workers/claim", two.worker_token, claim)
    assert status == 200 and held["job_id"] == first["id"]
    status, second = b.call("POST", "/jobs", two.api_token, {**JOB, "world_size": 2})
    assert status == 201
    before = _claims_asked(beside_a)
    got: list[tuple[int, Any]] = []
    poll = {**claim, "free_cpu_slots": 0, "wait_s": 60}
    waiting = threading.Thread(
        target=lambda: got.append(a.call("POST", "/workers/claim", two.worker_token, poll)),
        daemon=True,
    )
    waiting.start()
    wait_for(lambda: _claims_asked(beside_a) > before, 20, "the poll's first claim")
    done = {"worker": "w3", "attempt": held["attempt"], "exit_code": 0}
    assert b.call("POST", f"/workers/jobs/{first['id']}/finish", two.worker_token, done)[0] == 200
    waiting.join(timeout=20)
    assert got and got[0][0] == 200, got
    assert got[0][1]["job_id"] == second["id"]
    done = {"worker": "w3", "attempt": got[0][1]["attempt"], "exit_code": 0}
    assert b.call("POST", f"/workers/jobs/{second['id']}/finish", two.worker_token, done)[0] == 200


def test_a_token_revoked_through_one_process_is_refused_by_the_other(
    two: Server, pinned: list[Pinned]
) -> None:
    a, b = pinned
    status, user = a.call("POST", "/users", two.api_token, {"name": "alice"})
    assert status == 201
    assert b.call("GET", "/whoami", user["token"])[0] == 200
    assert a.call("POST", "/users/alice/revoke", two.api_token)[0] == 200
    status, refused = b.call("GET", "/jobs", user["token"])
    assert status == 401 and "revoked" in refused["detail"], refused


def test_one_process_sweeps_and_one_that_dies_stops_the_rest(pg_url: str, tmp_path: Path) -> None:
    """Both processes run the sweeper loop; only the holder of the advisory lock sweeps.
    A process killed under the supervisor takes the others down with an exit of 1."""
    two = _start_two(pg_url, tmp_path / "api")
    name = pg_url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:

        def sweepers() -> list[int]:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                (name, SWEEP_APPLICATION),
            ).fetchall()
            return [pid for (pid,) in rows]

        # Both processes have tried for the lock (each opens its connection to try) ...
        pids = wait_for(lambda: len(s := sweepers()) == 2 and s, 30, "both sweep connections")
        holders = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = 0 AND objid = %s "
            "AND database = (SELECT oid FROM pg_database WHERE datname = %s)",
            (SWEEP_LOCK, name),
        ).fetchall()
        # ... and one of them holds it.
        assert len(holders) == 1 and holders[0][0] in pids, (holders, pids)
    os.kill(_children(two.proc.pid)[0], signal.SIGKILL)
    assert two.proc.wait(timeout=30) == 1
    assert "stopping the others" in two.log()
    stop_server(two)


def test_sqlite_refuses_several_api_processes(tmp_path: Path) -> None:
    r = run_ddpq(
        "serve",
        "--port",
        "1",
        "--workers",
        "2",
        env={"DDPQ_DATA_DIR": str(tmp_path), "DDPQ_DATABASE_URL": f"sqlite:///{tmp_path}/d.db"},
    )
    assert r.returncode != 0
    assert "--workers 2 needs Postgres" in r.stderr + r.stdout, r.stderr


def test_a_leave_on_one_process_ends_the_worker_s_poll_on_the_other(
    two: Server, pinned: list[Pinned]
) -> None:
    """A worker's open long-poll (on one process) ends as its leave lands on the other:
    the NOTIFY carries the leave (the poll's recheck is an hour away, its wait a minute,
    and the memory of claims that found nothing covers it). From then on nothing is
    claimed for it through either process, though a job fits it; registered again, it
    takes one."""
    a, b = pinned
    children = _children(two.proc.pid)
    beside_a = next(p for p in pin_each(two) if p.process(children) == a.process(children))
    _register(a, "w4")
    before = _claims_asked(beside_a)
    got: list[tuple[int, Any]] = []
    # No free slot: nothing fits it, whatever other tests left queued.
    poll = {"name": "w4", "free_cpu_slots": 0, "free_gpus": [], "wait_s": 60}
    waiting = threading.Thread(
        target=lambda: got.append(a.call("POST", "/workers/claim", two.worker_token, poll)),
        daemon=True,
    )
    waiting.start()
    wait_for(lambda: _claims_asked(beside_a) > before, 20, "the poll's first claim")
    status, left = b.call("POST", "/workers/leave", two.worker_token, {"name": "w4"})
    assert status == 200 and left["left_at"], left
    waiting.join(timeout=20)
    assert got and got[0][0] == 204, got
    status, job = b.call("POST", "/jobs", two.api_token, JOB)
    assert status == 201
    room = {**poll, "free_cpu_slots": 4, "wait_s": 0}
    for p in (a, b):
        assert p.call("POST", "/workers/claim", two.worker_token, room)[0] == 204
    assert b.call("GET", f"/jobs/{job['id']}", two.api_token)[1]["status"] == "queued"
    _register(b, "w4")
    status, claimed = a.call("POST", "/workers/claim", two.worker_token, room)
    assert status == 200, claimed
    done = {"worker": "w4", "attempt": claimed["attempt"], "exit_code": 0}
    path = f"/workers/jobs/{claimed['job_id']}/finish"
    assert b.call("POST", path, two.worker_token, done)[0] == 200
