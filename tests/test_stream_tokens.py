"""Open answers and the tokens they were opened with. A member's log follow
and event stream re-check who is watching: they end within a few DDPQ_STREAM_RECHECK_S
of their token's revocation, their account's removal (`DELETE /users/NAME`) or their
token's rotation, saying why, whether the admin acts through the API process that
serves the streams or through another one on the same database, and the reconnection
is refused. A worker's claim long-poll is not re-checked, since its token changes only
with its API process: it ends with that process, and the next refuses the old token.
Both databases.

Two API processes per database serve the streams' tests (a server's start is most of
such a test's time); each test has a user and a job of its own. The job runs through
the worker protocol driven by hand (tests/helpers.py): no torchrun.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    REPO,
    Server,
    _child_env,
    free_port,
    module_database,
    start_server,
    stop_process,
    stop_server,
    wait_for,
)
from tests.helpers import finish, register, send_log, settle_all, submit_and_claim

RECHECK_S = 0.5  # DDPQ_STREAM_RECHECK_S of the module's servers
CUT_S = 3 * RECHECK_S  # from the admin's request to a stream's end
WAIT_S = 30.0  # for everything else: a line to arrive, the CLI to exit
# Event streams look for news every 0.2 s (0.5 by default), so that the recheck, not the
# poll, is what a stream's end waits for.
FAST = {"DDPQ_STREAM_RECHECK_S": str(RECHECK_S), "DDPQ_EVENTS_POLL_S": "0.2"}


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """Two API processes on one database: the admin acts on the first."""
    with module_database(request, tmp_path_factory) as (url, where):
        here = start_server(url, where / "api", **FAST)
        try:
            there = start_server(
                url, where / "api2", tokens=(here.api_token, here.worker_token), **FAST
            )
            try:
                here.shared = there.shared = True
                yield here, there
            finally:
                stop_server(there)
        finally:
            stop_server(here)


@pytest.fixture
def servers(pair: tuple[Server, Server]) -> Iterator[tuple[Server, Server]]:
    """The module's pair, with no job of another test's left active after a test."""
    pair[0].registered.clear()
    yield pair
    settle_all(pair[0])


class Stream:
    """A streamed answer read on a thread, line by line, until the server ends it."""

    def __init__(self, server: Server, token: str, path: str) -> None:
        self.text = ""
        self.status: int | None = None
        self.ended = threading.Event()
        self.ended_at = 0.0  # time.monotonic() when the server ended it
        self._thread = threading.Thread(
            target=self._read, args=(server.url + path, token), daemon=True
        )
        self._thread.start()

    def _read(self, url: str, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            with httpx.stream("GET", url, headers=headers, timeout=WAIT_S * 2) as r:
                self.status = r.status_code
                for piece in r.iter_text():
                    self.text += piece
        finally:
            self.ended_at = time.monotonic()
            self.ended.set()

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def shows(self, text: str) -> bool:
        return text in self.text

    def wait_cut(self, since: float, what: str) -> None:
        """Ended by the server within CUT_S of ``since`` (measured, so a slow end fails
        saying how slow)."""
        wait_for(self.ended.is_set, WAIT_S, what)
        took = self.ended_at - since
        assert took <= CUT_S, f"{what} took {took:.2f} s, more than {CUT_S} s"


def _add(server: Server, name: str) -> str:
    r = server.client().post("/users", json={"name": name, "role": "member"})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


class Follower:
    """`ddpq logs -f JOB` as a member runs it, its output collected as it comes."""

    def __init__(self, server: Server, token: str, job_id: int, base: Path) -> None:
        self.out_path, self.err_path = base / "follow.out", base / "follow.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddpq.cli", "logs", "-f", str(job_id)],
                env=_child_env({"DDPQ_URL": server.url, "DDPQ_TOKEN": token}),
                stdout=out,
                stderr=err,
                cwd=REPO,
            )

    def text(self) -> str:
        return self.out_path.read_text(errors="replace")


# How the admin cuts the member off, and the reason the streams end with.
CHANGES = {
    "revoke": ("POST", "/users/{name}/revoke", "token revoked: user {name} was deactivated"),
    "delete": ("DELETE", "/users/{name}", "token revoked: user {name} was deactivated"),
    "rotate": ("POST", "/users/{name}/rotate", "token rotated: user {name} was given a new token"),
}


@pytest.mark.parametrize("where", ["one-process", "two-processes"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_members_open_streams_end_when_their_token_is_revoked_removed_or_rotated(
    change: str, where: str, servers: tuple[Server, Server], tmp_path: Path
) -> None:
    """The member's streams are on one API process; the admin acts on it, or on the
    other. `ddpq logs -f` is among them once (revoked, on two processes: it is a process
    of its own). An admin's stream on the same job goes on."""
    here, other = servers
    there = other if where == "two-processes" else here
    name = f"{change}-{where}"
    follower = None
    try:
        member = _add(here, name)
        claim = submit_and_claim(here, name="hand")
        job = claim["job_id"]
        size = send_log(here, claim, 0, b"[rank0] started\n")
        logs = Stream(there, member, f"/jobs/{job}/logs?follow=true")
        events = Stream(there, member, f"/jobs/{job}/events")
        admins = Stream(there, here.api_token, f"/jobs/{job}/logs?follow=true")
        if (change, where) == ("revoke", "two-processes"):
            follower = Follower(there, member, job, tmp_path)
        wait_for(lambda: logs.shows("started") and admins.shows("started"), WAIT_S, "logs")
        wait_for(lambda: events.shows("event: job"), WAIT_S, "the first event")
        if follower is not None:
            wait_for(lambda: "started" in follower.text(), WAIT_S, "ddpq logs -f")
        # Live: a line mid-way (no newline yet) reaches the member.
        size = send_log(here, claim, size, b"[rank0] step 1")
        wait_for(lambda: logs.shows("step 1"), WAIT_S, "the second chunk")

        method, path, why = (part.format(name=name) for part in CHANGES[change])
        since = time.monotonic()
        r = here.client().request(method, path)
        assert r.status_code == 200, r.text
        logs.wait_cut(since, "the member's log follow to end")
        events.wait_cut(since, "the member's event stream to end")
        # The log's last line, a line of its own after the unfinished one, says why.
        assert logs.lines[-2:] == ["[rank0] step 1", f"[ddpq] stopped following: {why}"]
        at = events.lines.index("event: revoked")
        assert json.loads(events.lines[at + 1].removeprefix("data: ")) == {"reason": why}
        # A reconnection (EventSource's, by itself) is refused, on either process.
        for server in (here, other):
            for path in (f"/jobs/{job}/events", f"/jobs/{job}/logs?follow=true"):
                refused = server.client(member).get(path)
                assert refused.status_code == 401, (path, refused.text)
        if follower is not None:
            # `ddpq logs -f` prints the line, asks again once, and says the token is refused.
            assert follower.proc.wait(WAIT_S) == 1
            assert follower.text().endswith(f"[ddpq] stopped following: {why}\n")
            err = follower.err_path.read_text()
            assert "refused the token" in err and "revoked" in err, err

        # The admin's follow of the same job goes on to the job's end.
        assert not admins.ended.is_set()
        send_log(here, claim, size, b"\n[rank0] done\n")
        wait_for(lambda: admins.shows("done"), WAIT_S, "the admin's follow")
        finish(here, claim)
        wait_for(admins.ended.is_set, WAIT_S, "the admin's follow to end with the job")
        assert not any(line.startswith("[ddpq] stopped") for line in admins.lines)
    finally:
        if follower is not None:
            stop_process(follower.proc)


def _empty_claims(server: Server) -> float:
    """Claims this API process has looked for and found nothing (its /metrics)."""
    scrape = server.client().get("/metrics").text
    for line in scrape.splitlines():
        if line.startswith('ddpq_claim_latency_seconds_count{outcome="empty"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_workers_open_claim_ends_with_its_api_and_the_old_worker_token_is_refused_after(
    db_url: str, tmp_path: Path
) -> None:
    """A claim long-poll is not re-checked (docs/security.md): the worker token is fixed
    for an API process's life (no route changes it) and changes only by a restart, which
    ends every open answer. Proved: a poll open for 30 s ends within seconds of its API
    process stopping; the process started in its place on the same port, with a new
    DDPQ_WORKER_TOKEN, refuses the old token (401) and takes the new one."""
    port = free_port()
    old = start_server(db_url, tmp_path / "api", port=port)
    new_token = f"ddpqw_{secrets.token_urlsafe(32)}"
    answer: list[httpx.Response | Exception] = []
    ended = threading.Event()
    times: list[float] = []

    def poll() -> None:
        # A client of its own: stop_server closes the server's clients before the process.
        with httpx.Client(base_url=old.url, timeout=60) as c:
            try:
                answer.append(
                    c.post(
                        "/workers/claim",
                        headers={"Authorization": f"Bearer {old.worker_token}"},
                        json={"name": "poller", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 30},
                    )
                )
            except httpx.TransportError as exc:
                answer.append(exc)
            finally:
                times.append(time.monotonic())
                ended.set()

    try:
        register(old, "poller")
        before = _empty_claims(old)
        threading.Thread(target=poll, daemon=True).start()
        # Open: its first look found nothing, and it waits for news.
        wait_for(lambda: _empty_claims(old) > before, WAIT_S, "the claim to be polling")
        assert not ended.is_set(), answer
        since = time.monotonic()
        stop_server(old)
        assert ended.wait(WAIT_S), "the open claim outlived its API process"
        took = times[0] - since
        assert took < 5, f"the open claim ended {took:.2f} s after its API was stopped"
        # Answered as the process begins to stop (service.app.begin_shutdown): no job.
        got = answer[0]
        assert isinstance(got, httpx.Response) and got.status_code == 204, got
    finally:
        stop_server(old)
    new = start_server(db_url, tmp_path / "api2", port=port, tokens=(old.api_token, new_token))
    try:
        body = {"name": "poller", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 0}
        refused = new.client(old.worker_token).post("/workers/claim", json=body)
        assert refused.status_code == 401, refused.text
        assert new.client(new_token).post("/workers/claim", json=body).status_code == 204
    finally:
        stop_server(new)
