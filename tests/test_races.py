"""Status transitions that race, on both databases, over many rounds.

Each round fires two requests at a real `ddpq serve` at the same instant (released by a
barrier, on clients already connected) and then checks that exactly one transition won
and that the books agree with it: the job's status, its attempt's outcome, the worker's
free slots, and what a repeated request answers. On Postgres, before transitions read
the job's row under a lock, about half the cancel-versus-finish rounds left the job
`cancelling` for good with its slots leaked; SQLite serialises writers and never did.
30 rounds per race catch a 10 % race with probability 1 - 0.9**30 > 95 %.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Server, module_server
from tests.helpers import register, together

ROUNDS = 30
TERMINAL = {"succeeded", "failed", "cancelled"}


def _both(
    first: Callable[[], httpx.Response], second: Callable[[], httpx.Response]
) -> tuple[httpx.Response, httpx.Response]:
    """Run two requests released together; return their answers in order."""
    out = together(first, second)
    for r in out:
        assert isinstance(r, httpx.Response), r
        assert r.status_code < 500, r.text
    return out[0], out[1]


class Rig:
    """A server, a hand-driven worker `hand` with 2 CPU slots, and warm clients. The
    server is the module's (one per database): `hand` is a name of this test's own."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.hand = f"hand-{uuid.uuid4().hex[:8]}"
        register(server, self.hand, cpu_slots=2)
        self.user = server.client()
        self.user2 = server.client()
        self.worker = server.client("worker")
        self.worker2 = server.client("worker")
        for c in (self.user, self.user2, self.worker, self.worker2):
            c.get("/healthz")  # connect now, so the barrier releases requests, not handshakes

    def submit(self) -> int:
        r = self.user.post("/jobs", json={"entrypoint": "train.py", "world_size": 2})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def claim(self, client: httpx.Client | None = None, name: str | None = None) -> httpx.Response:
        return (client or self.worker).post(
            "/workers/claim",
            json={"name": name or self.hand, "free_cpu_slots": 2, "free_gpus": [], "wait_s": 0},
        )

    def running(self) -> dict[str, Any]:
        job_id = self.submit()
        r = self.claim()
        assert r.status_code == 200, r.text
        claim: dict[str, Any] = r.json()
        assert claim["job_id"] == job_id
        return claim

    def finish(self, claim: dict[str, Any], exit_code: int = 0) -> httpx.Response:
        return self.worker2.post(
            f"/workers/jobs/{claim['job_id']}/finish",
            json={"worker": self.hand, "attempt": claim["attempt"], "exit_code": exit_code},
        )

    def cancel(self, job_id: int, client: httpx.Client | None = None) -> httpx.Response:
        return (client or self.user).post(f"/jobs/{job_id}/cancel")

    def restart_worker(self, running: list[dict[str, Any]]) -> httpx.Response:
        """The worker registers again listing nothing: its attempts died with it."""
        return self.worker2.post(
            "/workers/register",
            json={
                "name": self.hand,
                "hostname": "h",
                "cpu_slots": 2,
                "gpus": [],
                "checkpoint_root": "/ckpt",
                "running": running,
            },
        )

    def job(self, job_id: int) -> dict[str, Any]:
        r = self.user.get(f"/jobs/{job_id}")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def attempts(self, job_id: int) -> list[dict[str, Any]]:
        r = self.user.get(f"/jobs/{job_id}/attempts")
        assert r.status_code == 200, r.text
        out: list[dict[str, Any]] = r.json()["items"]
        return out

    def settle(self, job_id: int) -> dict[str, Any]:
        """End a job the race left active (cancel, confirm on its worker) and check the
        books: nothing active, every slot of `hand` free again."""
        job = self.job(job_id)
        if job["status"] == "queued":
            assert self.cancel(job_id).status_code == 202
        elif job["status"] in ("running", "cancelling"):
            if job["status"] == "running":
                assert self.cancel(job_id).status_code == 202
            r = self.worker.post(
                f"/workers/jobs/{job_id}/finish",
                json={"worker": self.hand, "attempt": job["attempt"], "outcome": "cancelled"},
            )
            assert r.status_code == 200, r.text
        job = self.job(job_id)
        assert job["status"] in TERMINAL, job
        assert job["finished_at"] is not None, job
        for a in self.attempts(job_id):
            assert a["finished_at"] is not None, (job, a)
        [hand] = [w for w in self.user.get("/workers").json()["items"] if w["name"] == self.hand]
        assert hand["free_cpu_slots"] == 2, (job, hand)
        assert hand["running"] == [], hand
        return job


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server per database for the module: every round of every race settles its job
    (Rig.settle), so each test starts on a queue with nothing in it."""
    yield from module_server(request, tmp_path_factory)


@pytest.fixture
def rig(server: Server) -> Rig:
    return Rig(server)


def test_cancel_racing_finish_has_one_winner(rig: Rig) -> None:
    for _ in range(ROUNDS):
        claim = rig.running()
        job_id = claim["job_id"]
        cancel, fin = _both(lambda: rig.cancel(job_id), lambda: rig.finish(claim))
        assert fin.status_code == 200, fin.text
        job = rig.job(job_id)
        [attempt] = rig.attempts(job_id)
        if cancel.status_code == 202:
            # The cancel won: the finish that followed confirmed it.
            assert job["status"] == "cancelled", job
            assert attempt["outcome"] == "cancelled", attempt
        else:
            # The finish won: the cancel was told why not, and changed nothing.
            assert cancel.status_code == 409, cancel.text
            assert "already succeeded" in cancel.json()["detail"]
            assert job["status"] == "succeeded", job
            assert attempt["outcome"] == "succeeded", attempt
        again = rig.cancel(job_id)
        assert again.status_code == 409, again.text
        rig.settle(job_id)


def test_cancel_racing_claim_has_one_winner(rig: Rig) -> None:
    for _ in range(ROUNDS):
        job_id = rig.submit()
        cancel, claim = _both(lambda: rig.cancel(job_id), lambda: rig.claim(rig.worker2))
        assert cancel.status_code == 202, cancel.text
        job = rig.job(job_id)
        if claim.status_code == 200:
            # The claim won: the job runs, and the cancel asked its worker to stop it.
            assert claim.json()["job_id"] == job_id
            assert cancel.json()["status"] == "cancelling", cancel.text
            assert job["status"] == "cancelling", job
            [attempt] = rig.attempts(job_id)
            assert attempt["outcome"] == "running", attempt
        else:
            # The cancel won: no worker was handed the job.
            assert claim.status_code == 204, claim.text
            assert cancel.json()["status"] == "cancelled", cancel.text
            assert job["status"] == "cancelled", job
            assert rig.attempts(job_id) == []
        rig.settle(job_id)


def test_cancel_racing_a_lost_attempt_ends_cancelled(rig: Rig) -> None:
    for _ in range(ROUNDS):
        claim = rig.running()
        job_id = claim["job_id"]
        cancel, reg = _both(lambda: rig.cancel(job_id), lambda: rig.restart_worker([]))
        assert reg.status_code == 200, reg.text
        assert cancel.status_code == 202, cancel.text
        job = rig.job(job_id)
        # Either order ends the job cancelled: lost first, it was queued again and the
        # cancel took it off the queue; cancel first, losing it confirmed the cancel.
        assert job["status"] == "cancelled", job
        [attempt] = rig.attempts(job_id)
        assert attempt["outcome"] == "lost", attempt
        rig.settle(job_id)


def test_finish_racing_a_lost_attempt_has_one_winner(rig: Rig) -> None:
    for _ in range(ROUNDS):
        claim = rig.running()
        job_id = claim["job_id"]
        fin, reg = _both(lambda: rig.finish(claim), lambda: rig.restart_worker([]))
        assert reg.status_code == 200, reg.text
        job = rig.job(job_id)
        [attempt] = rig.attempts(job_id)
        if fin.status_code == 200:
            assert job["status"] == "succeeded", job
            assert attempt["outcome"] == "succeeded", attempt
        else:
            assert fin.status_code == 409, fin.text
            assert job["status"] == "queued", job
            assert attempt["outcome"] == "lost", attempt
        rig.settle(job_id)


def test_two_cancels_of_a_running_job_agree(rig: Rig) -> None:
    for _ in range(ROUNDS):
        claim = rig.running()
        job_id = claim["job_id"]
        a, b = _both(lambda: rig.cancel(job_id), lambda: rig.cancel(job_id, rig.user2))
        assert a.status_code == b.status_code == 202, (a.text, b.text)
        assert rig.job(job_id)["status"] == "cancelling"
        rig.settle(job_id)


def test_two_claims_never_share_a_job(rig: Rig) -> None:
    register(rig.server, "other", cpu_slots=2)
    for _ in range(ROUNDS):
        job_id = rig.submit()
        a, b = _both(lambda: rig.claim(), lambda: rig.claim(rig.worker2, name="other"))
        won = [r for r in (a, b) if r.status_code == 200]
        assert len(won) == 1, (a.text, b.text)
        assert won[0].json()["job_id"] == job_id
        job = rig.job(job_id)
        assert len(rig.attempts(job_id)) == 1
        winner = rig.hand if a.status_code == 200 else "other"
        assert job["worker"] == winner, job
        r = rig.worker.post(
            f"/workers/jobs/{job_id}/finish",
            json={"worker": winner, "attempt": 1, "exit_code": 0},
        )
        assert r.status_code == 200, r.text
        rig.settle(job_id)


def test_metrics_racing_finish_are_kept_when_accepted(rig: Rig) -> None:
    for _ in range(ROUNDS):
        claim = rig.running()
        job_id = claim["job_id"]
        rank0 = rig.server.client(claim["token"])
        rank0.get("/healthz")
        items = [{"step": 1, "values": {"loss": 0.5}}]
        sent, fin = _both(
            lambda: rank0.post(f"/jobs/{job_id}/metrics", json={"items": items}),
            lambda: rig.finish(claim),
        )
        assert fin.status_code == 200, fin.text
        stored = rig.user.get(f"/jobs/{job_id}/metrics").json()
        points = stored["items"]
        if sent.status_code == 202:
            assert len(points) == 1, stored  # acknowledged means kept
        else:
            assert sent.status_code in (403, 409), sent.text
            assert points == [], stored
        rig.settle(job_id)
        rank0.close()
