"""Open streams re-check who is watching (issue 41): a member's log follow and event
stream end within DDPQ_STREAM_RECHECK_S of their token's revocation or rotation, saying
why, on every API process, and the reconnection is refused. Both databases.

The job runs through the worker protocol driven by hand (tests/helpers.py): no torchrun.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    REPO,
    Server,
    _child_env,
    start_server,
    stop_process,
    stop_server,
    wait_for,
)
from tests.helpers import finish, send_log, submit_and_claim

DEADLINE_S = 30.0  # generous: the recheck is every 2 s (the default)


class Stream:
    """A streamed answer read on a thread, line by line, until the server ends it."""

    def __init__(self, server: Server, token: str, path: str) -> None:
        self.text = ""
        self.status: int | None = None
        self.ended = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(server.url + path, token), daemon=True
        )
        self._thread.start()

    def _read(self, url: str, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            with httpx.stream("GET", url, headers=headers, timeout=DEADLINE_S * 2) as r:
                self.status = r.status_code
                for piece in r.iter_text():
                    self.text += piece
        finally:
            self.ended.set()

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def shows(self, text: str) -> bool:
        return text in self.text

    def wait_ended(self, what: str) -> None:
        wait_for(self.ended.is_set, DEADLINE_S, what)


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


@pytest.mark.parametrize("change", ["revoke", "rotate"])
def test_a_members_open_streams_end_when_their_token_is_revoked_or_rotated(
    change: str, db_url: str, tmp_path: Path
) -> None:
    """Revoked: the streams are on one API process and the admin revokes on another (one
    database), and `ddpq logs -f` is among them. Rotated: one process. An admin's streams
    on the same job go on."""
    here = start_server(db_url, tmp_path / "api")
    there = here
    if change == "revoke":
        there = start_server(db_url, tmp_path / "api2", tokens=(here.api_token, here.worker_token))
    follower = None
    try:
        alice = _add(here, "alice")
        claim = submit_and_claim(here, name="hand")
        job = claim["job_id"]
        size = send_log(here, claim, 0, b"[rank0] started\n")
        logs = Stream(there, alice, f"/jobs/{job}/logs?follow=true")
        events = Stream(there, alice, f"/jobs/{job}/events")
        admins = Stream(there, here.api_token, f"/jobs/{job}/logs?follow=true")
        if change == "revoke":
            follower = Follower(there, alice, job, tmp_path)
        wait_for(lambda: logs.shows("started") and admins.shows("started"), DEADLINE_S, "logs")
        wait_for(lambda: events.shows("event: job"), DEADLINE_S, "the first event")
        if follower is not None:
            wait_for(lambda: "started" in follower.text(), DEADLINE_S, "ddpq logs -f")
        # Live: a line mid-way (no newline yet) reaches the member.
        size = send_log(here, claim, size, b"[rank0] step 1")
        wait_for(lambda: logs.shows("step 1"), DEADLINE_S, "the second chunk")

        if change == "revoke":
            assert here.client().post("/users/alice/revoke").status_code == 200
            why = "token revoked: user alice was deactivated"
        else:
            assert here.client().post("/users/alice/rotate").status_code == 200
            why = "token rotated: user alice was given a new token"

        logs.wait_ended("the member's log follow to end")
        events.wait_ended("the member's event stream to end")
        # The log's last line, a line of its own after the unfinished one, says why.
        assert logs.lines[-2:] == ["[rank0] step 1", f"[ddpq] stopped following: {why}"]
        assert logs.lines[-1].startswith("[ddpq] ")
        at = events.lines.index("event: revoked")
        assert json.loads(events.lines[at + 1].removeprefix("data: ")) == {"reason": why}
        # A reconnection (EventSource's, by itself) is refused.
        member = there.client(alice)
        for path in (f"/jobs/{job}/events", f"/jobs/{job}/logs?follow=true"):
            refused = member.get(path)
            assert refused.status_code == 401, (path, refused.text)
        if follower is not None:
            # `ddpq logs -f` prints the line, asks again once, and says the token is refused.
            assert follower.proc.wait(DEADLINE_S) == 1
            assert follower.text().endswith(f"[ddpq] stopped following: {why}\n")
            err = follower.err_path.read_text()
            assert "refused the token" in err and "revoked" in err, err

        # The admin's follow of the same job goes on to the job's end.
        assert not admins.ended.is_set()
        send_log(here, claim, size, b"\n[rank0] done\n")
        wait_for(lambda: admins.shows("done"), DEADLINE_S, "the admin's follow")
        finish(here, claim)
        admins.wait_ended("the admin's follow to end with the job")
        assert not any(line.startswith("[ddpq] stopped") for line in admins.lines)
    finally:
        if follower is not None:
            stop_process(follower.proc)
        if there is not here:
            stop_server(there)
        stop_server(here)
