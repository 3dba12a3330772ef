"""A worker that stops leaves (POST /workers/leave): from the leave's commit on no job is
claimed for it until it registers again, and its open claim long-poll answers at once (on
whichever API process holds it: tests/test_api_processes.py), so a stop no longer waits
for the poll to run out. A real worker stopped mid-poll leaves, and a job submitted after
its leave runs on another worker; the race between a leave and a claim it meets is driven
by hand, many rounds against one server, on SQLite and Postgres."""

from __future__ import annotations

import signal
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import queue
from service.db import Database
from service.errors import Conflict, UnknownWorker, WorkerHasLeft
from service.wakeup import Wake, Wakeup
from tests.conftest import NO_JOBS, Server, run_ddpq, stop_server, terminal, wait_for
from tests.helpers import claims_asked, together

NOOP = {"entrypoint": "noop.py", "device": "cpu", "world_size": 1}
# Enough rounds to see a race that one round in ten hits.
ROUNDS = 30


def _worker(c: httpx.Client, name: str) -> dict[str, Any] | None:
    return next((w for w in c.get("/workers").json()["items"] if w["name"] == name), None)


def _register(w: httpx.Client, name: str) -> None:
    body = {"name": name, "hostname": "h", "cpu_slots": 1, "gpus": [], "checkpoint_root": "/c"}
    r = w.post("/workers/register", json=body)
    assert r.status_code == 200, r.text


def _poll(
    w: httpx.Client, name: str, wait_s: float, into: list[httpx.Response]
) -> threading.Thread:
    """A claim long-poll of ``name`` on a thread of its own; its answer goes to ``into``."""
    body = {"name": name, "free_cpu_slots": 1, "free_gpus": [], "wait_s": wait_s}
    t = threading.Thread(target=lambda: into.append(w.post("/workers/claim", json=body)))
    t.start()
    return t


def _finish(w: httpx.Client, name: str, claim: dict[str, Any], **body: Any) -> None:
    r = w.post(
        f"/workers/jobs/{claim['job_id']}/finish",
        json={"worker": name, "attempt": claim["attempt"], **body},
    )
    assert r.status_code == 200, r.text


def test_a_worker_stopped_mid_poll_leaves_and_a_later_job_runs_on_another(
    api: Server, start_worker: Any, tmp_path: Path
) -> None:
    user, w = api.client(), api.client("worker")
    before = claims_asked(api)
    a = start_worker(api, cpu_slots=1, env=NO_JOBS)
    # Its long-poll is open once its first claim has asked the database (and found nothing).
    wait_for(lambda: _worker(user, a.name) and claims_asked(api) > before, 90, "a's first poll")
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0
    assert "left the queue" in a.log(), a.log()
    gone = _worker(user, a.name)
    assert gone is not None and gone["left_at"] and not gone["alive"] and not gone["running"]
    # A job that fits it, submitted after its leave: a claim in its name is answered with
    # nothing and the job stays queued ...
    job = user.post("/jobs", json=NOOP).json()
    poll = {"name": a.name, "free_cpu_slots": 1, "free_gpus": [], "wait_s": 0}
    assert w.post("/workers/claim", json=poll).status_code == 204
    assert user.get(f"/jobs/{job['id']}").json()["status"] == "queued"
    # ... `ddpq workers` says it left ...
    shown = run_ddpq("workers", env={"DDPQ_URL": api.url, "DDPQ_TOKEN": api.api_token})
    row = next(line for line in shown.stdout.splitlines() if a.name in line)
    assert " left " in row, shown.stdout
    # ... and the next worker runs it.
    name = f"b-{uuid.uuid4().hex[:8]}"
    workspace = tmp_path / f"worker-{name}" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "noop.py").write_text("print('done')\n")
    start_worker(api, name=name, cpu_slots=1)
    assert terminal(user, job["id"])["status"] == "succeeded"
    attempts = user.get(f"/jobs/{job['id']}/attempts").json()["items"]
    assert [x["worker"] for x in attempts] == [name]


# The worker's side alone: the database under the API is not what is tested.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_worker_whose_leave_finds_no_api_still_stops(server: Server, start_worker: Any) -> None:
    """The API gone before the worker stops: its leave is not taken, and it stops the old
    way (its claim loop, told the API is away, ends with the stop), never hanging."""
    before = claims_asked(server)
    a = start_worker(server, cpu_slots=1, env=NO_JOBS)
    wait_for(lambda: claims_asked(server) > before, 90, "a's first poll")
    stop_server(server)
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0
    assert "leave: " in a.log() and "left the queue" not in a.log(), a.log()


def test_a_leave_racing_a_submit_never_leaves_the_job_with_the_worker_that_left(
    api: Server,
) -> None:
    """Each round the leaver (L) long-polls, and a job is submitted as L leaves: released
    together, or the leave sent right behind the submit (L's claim, woken by the submit,
    then runs as the leave arrives). L's poll ends at once either way: with the job if L's
    claim committed before the leave (the books gave it to L as the leave answered; L hands
    it back, as a stopping worker does), else with nothing; no claim of L's commits after
    its leave. The job then goes to the stayer (K), the worker still there; L holds
    nothing."""
    leaver, stayer = f"leaver-{uuid.uuid4().hex[:8]}", f"stayer-{uuid.uuid4().hex[:8]}"
    user, submitter, leaving = api.client(), api.client(), api.client("worker")
    for_l, for_k = api.client("worker"), api.client("worker")
    seen: Counter[str] = Counter()

    def submit() -> dict[str, Any]:
        r = submitter.post("/jobs", json=NOOP)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def leave() -> tuple[httpx.Response, list[int]]:
        r = leaving.post("/workers/leave", json={"name": leaver})
        # What the books give L as the leave's answer arrives: every claim of L's that
        # committed, committed before the leave did.
        held = _worker(user, leaver)
        return r, [j["job_id"] for j in (held or {}).get("running", [])]

    for n in range(ROUNDS):
        _register(for_l, leaver)  # again each round: it takes jobs again
        asked = claims_asked(api)
        got: list[httpx.Response] = []
        poll = _poll(for_l, leaver, 30, got)
        # Parked once its first claim (its registration made the poll ask) found nothing.
        wait_for(lambda: claims_asked(api) > asked, 20, "the leaver's poll parked", 0.01)
        if n % 2:
            both = together(submit, leave)
            assert not [r for r in both if isinstance(r, Exception)], (n, both)
            job, (left, held) = both
        else:
            job = submit()
            left, held = leave()
        assert left.status_code == 200 and left.json()["left_at"], (n, left.text)
        poll.join(timeout=20)  # its wait is 30 s: only the leave ends it sooner
        assert got, f"round {n}: the leaver's poll outlived its leave"
        if got[0].status_code == 200:
            claim = got[0].json()
            assert claim["job_id"] == job["id"] and job["id"] in held, (n, claim, held)
            _finish(for_l, leaver, claim, outcome="requeue")
            seen["claimed before the leave"] += 1
        else:
            assert got[0].status_code == 204 and job["id"] not in held, (n, got[0].text, held)
            seen["nothing for the leaver"] += 1
        # The job is queued (or queued again): the worker still there takes it (registered
        # again, its poll asks the database at once).
        _register(for_k, stayer)
        taken: list[httpx.Response] = []
        _poll(for_k, stayer, 10, taken).join(timeout=20)
        assert taken and taken[0].status_code == 200, (n, taken and taken[0].text)
        assert taken[0].json()["job_id"] == job["id"], n
        _finish(for_k, stayer, taken[0].json(), exit_code=0)
        attempts = user.get(f"/jobs/{job['id']}/attempts").json()["items"]
        assert attempts[-1]["worker"] == stayer, (n, attempts)
        assert all(a["outcome"] == "requeued" for a in attempts if a["worker"] == leaver)
        holds = _worker(user, leaver)
        assert holds is not None and not holds["running"], (n, holds)
    print(dict(seen))  # how the rounds fell (pytest -s)
    # Left, it is handed nothing though a job fits it; registered again, it takes it.
    job = user.post("/jobs", json=NOOP).json()
    nothing: list[httpx.Response] = []
    _poll(for_l, leaver, 0, nothing).join(timeout=20)
    assert nothing and nothing[0].status_code == 204
    _register(for_l, leaver)
    back: list[httpx.Response] = []
    _poll(for_l, leaver, 0, back).join(timeout=20)
    assert back and back[0].status_code == 200 and back[0].json()["job_id"] == job["id"]
    _finish(for_l, leaver, back[0].json(), exit_code=0)


def test_a_leave_is_its_process_s_own_and_a_registration_undoes_it(db: Database) -> None:
    """Only the process that holds the name leaves it (another that took the name over is
    not made to stop taking jobs), a leave said again keeps its first time, and the worker
    registered again is handed jobs (queue.leave, queue.register_worker)."""
    me, other = "a" * 32, "b" * 32
    queue.register_worker(db, "w", me, "h", 1, [], "/c")
    with pytest.raises(UnknownWorker):
        queue.leave(db, "nobody", me)
    with pytest.raises(Conflict, match="taken over"):
        queue.leave(db, "w", other)
    first = queue.leave(db, "w", me)
    assert queue.leave(db, "w", me) == first
    with pytest.raises(WorkerHasLeft):
        queue.claim_next_job(db, "w", 1, [], "c" * 64)
    queue.register_worker(db, "w", me, "h", 1, [], "/c")
    assert queue.claim_next_job(db, "w", 1, [], "d" * 64) is None  # asked: nothing queued
    [listed] = queue.workers_overview(db)
    assert listed["left_at"] is None and listed["alive"]


def test_a_leave_heard_sends_the_worker_s_polls_to_the_database_until_it_is_back() -> None:
    """The wake-up of a leave (heard here or through NOTIFY) moves its worker's count of
    leaves; a claim that finds the worker back (registered again) sets the count polls
    begin from, but not past a leave heard since it began."""
    wakeup = Wakeup()
    left = Wake(everyone=False, worker="w", left=True)
    heard = Wake.heard(left.payload().replace('"p":"', '"p":"x'))
    assert heard == left
    assert Wake.heard(Wake(everyone=False, worker="w").payload().replace('"p":"', '"p":"x')) == (
        Wake(everyone=False, worker="w")
    )
    wakeup._apply(left)
    assert (wakeup.leaves("w"), wakeup.back("w"), wakeup.own("w")) == (1, 0, 1)
    began = wakeup.leaves("w")
    wakeup._apply(left)  # another leave while the claim ran
    wakeup.rejoined("w", began)
    assert (wakeup.leaves("w"), wakeup.back("w")) == (2, 1)  # the later one still counts
    wakeup.rejoined("w", wakeup.leaves("w"))
    assert wakeup.leaves("w") == wakeup.back("w") == 2
    assert wakeup.leaves("other") == wakeup.back("other") == 0
