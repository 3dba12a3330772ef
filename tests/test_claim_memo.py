"""NothingFits: an idle long-poll is answered from a claim that found nothing only when
that answer holds for it (same kind of worker, no more room, the same wake-up, recent),
and never for a worker whose claim this process has not seen; across the wake-ups of
submits it has no room for, or whose jobs were claimed here."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from service import queue
from service import wakeup as wakeup_module
from service.queue import NothingFits, Probe
from service.wakeup import EVERYONE, Wake, Wakeup
from tests.conftest import Server, start_server, stop_server
from tests.helpers import finish, register


def _nothing(memo: NothingFits, worker: str, generation: int, cpu: int, gpus: int) -> None:
    probe = Probe(has_gpus=True, cpu=cpu, gpus=gpus, general=True)
    memo.found_nothing(worker, generation, probe, began=100.0)


def test_a_claim_that_found_nothing_answers_workers_with_no_more_room() -> None:
    memo = NothingFits(valid_s=0.5)
    _nothing(memo, "a", 7, cpu=32, gpus=4)
    memo.found("b", Probe(has_gpus=True))
    assert memo.covers("b", 7, 32, 4, now=100.2)
    assert memo.covers("b", 7, 8, 0, now=100.2)
    assert not memo.covers("b", 7, 32, 5, now=100.2)  # more GPUs: it asks itself
    assert not memo.covers("b", 7, 33, 4, now=100.2)
    assert not memo.covers("b", 8, 32, 4, now=100.2)  # a wake-up since: anything may fit
    assert not memo.covers("b", 7, 32, 4, now=100.6)  # too old (a retry backoff may end)
    assert not memo.covers("stranger", 7, 0, 0, now=100.2)  # maybe not registered: 404


def test_only_a_general_nothing_of_the_same_kind_is_kept() -> None:
    memo = NothingFits(valid_s=0.5)
    memo.found_nothing("a", 1, Probe(has_gpus=True, cpu=32, gpus=8, general=False), 100.0)
    memo.found("b", Probe(has_gpus=True))
    memo.found("cpu", Probe(has_gpus=False))
    assert not memo.covers("b", 1, 0, 0, now=100.1)  # a starving job narrowed a's pick
    _nothing(memo, "a", 1, cpu=32, gpus=8)
    assert memo.covers("b", 1, 0, 0, now=100.1)
    assert not memo.covers("cpu", 1, 0, 0, now=100.1)  # CPU-only workers fit other jobs
    memo.forget("b")  # registered again: what it has may have changed
    assert not memo.covers("b", 1, 0, 0, now=100.1)


def test_claims_of_no_more_room_wait_for_the_one_that_runs() -> None:
    async def run() -> None:
        memo = NothingFits(valid_s=0.5)
        memo.found("a", Probe(has_gpus=True))
        memo.found("b", Probe(has_gpus=True))
        done = memo.asking("a", 3, 32, 4)
        assert memo.asked("b", 3, 32, 2) is done
        assert memo.asked("b", 3, 32, 8) is None  # more room: it claims alongside
        assert memo.asked("b", 4, 32, 2) is None  # another wake-up
        memo.answered(done)
        assert done.is_set() and memo.asked("b", 3, 32, 2) is None

    asyncio.run(run())


def test_nothing_fits_outlives_submits_that_have_no_room_here_or_were_claimed() -> None:
    """A poll's memory that nothing fits its room carries over the generations of
    submits it has no room for, or whose job a claim here took; any other wake-up (or a
    job that fits and is still queued) sends it to the database again."""
    wakeup = Wakeup(queue.room_fits)
    memo = queue.NothingFits(valid_s=60)
    probe = queue.Probe(has_gpus=True, cpu=8, gpus=2, general=True)
    memo.found_nothing("w", wakeup.generation, probe, began=0.0)

    def covers(now: float = 1.0, cpu: int = 8, gpus: int = 2) -> bool:
        return memo.covers("w", wakeup.generation, cpu, gpus, now, wakeup.since)

    assert covers()
    wakeup._apply(Wake(device="cuda", nproc=4, job=1))  # needs 4 GPUs: no room here
    wakeup._apply(Wake(device="cpu", nproc=16, job=2))  # 16 CPU slots: no room here
    assert covers()
    assert not covers(now=61.0)  # the memory is only so good (a backoff runs out)
    wakeup._apply(Wake(device="cuda", nproc=1, job=3))  # fits, still queued
    assert not covers()
    memo.found("other", probe, job_id=3)  # a claim here took it
    assert covers()
    wakeup._apply(Wake(device="cuda", nproc=1, nnodes=2, job=4))  # a gang: nodes still free
    memo.found("other", probe, job_id=4)
    assert not covers()
    memo.found_nothing("w", wakeup.generation, probe, began=1.0)
    assert covers()
    wakeup._apply(EVERYONE)  # a requeue, a limit lifted: anything may fit now
    assert not covers()
    memo.found_nothing("w", wakeup.generation, probe, began=2.0)
    for i in range(wakeup_module.HISTORY + 1):  # older than what is kept: not known
        wakeup._apply(Wake(device="cuda", nproc=8, job=100 + i))
    assert not covers()


def test_rooms_found_empty_are_carried_to_a_later_generation_where_its_wakes_leave_them() -> None:
    """A claim that finds nothing at a later generation keeps what earlier claims found
    for other rooms, where the wake-ups between change nothing for those rooms; a room a
    wake-up between may fit is dropped. A late answer from an earlier generation joins the
    memory only where the wake-ups since leave it standing."""
    wakeup = Wakeup(queue.room_fits)
    memo = queue.NothingFits(valid_s=60)
    big = queue.Probe(has_gpus=True, cpu=32, gpus=6, general=True)
    small = queue.Probe(has_gpus=True, cpu=32, gpus=1, general=True)
    start = wakeup.generation
    memo.found_nothing("a", start, big, began=0.0, since=wakeup.since)

    def covers(gpus: int, now: float = 1.0) -> bool:
        return memo.covers("w", wakeup.generation, 32, gpus, now, wakeup.since)

    memo.found("w", queue.Probe(has_gpus=True))
    wakeup._apply(Wake(device="cuda", nproc=8, job=1))  # fits nobody offering <= 6 GPUs
    memo.found_nothing("b", wakeup.generation, small, began=0.5, since=wakeup.since)
    assert covers(6)  # a's 6 GPUs, carried over the 8-GPU submit
    wakeup._apply(Wake(device="cuda", nproc=4, job=2))  # fits 6 free GPUs, not 1
    memo.found_nothing("b", wakeup.generation, small, began=0.7, since=wakeup.since)
    assert covers(1) and not covers(6) and not covers(4)
    # A late answer for 6 GPUs from before job 2's submit: job 2 may fit it, so it is not
    # taken; once a claim here took job 2, it is.
    memo.found_nothing("a", start, big, began=0.8, since=wakeup.since)
    assert not covers(6)
    memo.found("c", small, job_id=2)
    memo.found_nothing("a", start + 1, big, began=0.8, since=wakeup.since)
    assert covers(6)
    assert not covers(6, now=61.0)  # each room only as long as its own finding holds
    wakeup._apply(EVERYONE)
    memo.found_nothing("b", wakeup.generation, small, began=1.0, since=wakeup.since)
    assert covers(1) and not covers(6)  # an unshaped wake-up carries nothing over


def _empty_claims(server: Server) -> float:
    text = server.client().get("/metrics").text
    for line in text.splitlines():
        if line.startswith('ddpq_claim_latency_seconds_count{outcome="empty"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_real_api_wakes_no_poll_for_jobs_it_has_no_room_for(db_url: str, tmp_path: Path) -> None:
    """A CPU-only worker's open long-poll sleeps through five CUDA jobs' submits (before:
    each woke it for a claim that found nothing), and wakes for the CPU job it fits."""
    server = start_server(db_url, tmp_path / "api", DDPQ_CLAIM_RECHECK_S="30")
    try:
        register(server, "big", cpu_slots=8, gpus=[0, 1, 2, 3])
        register(server, "cpu", cpu_slots=2)
        w = server.client("worker")

        def claim(name: str, cpu: int, gpus: list[int], wait_s: float) -> Any:
            body = {"name": name, "free_cpu_slots": cpu, "free_gpus": gpus, "wait_s": wait_s}
            return w.post("/workers/claim", json=body, timeout=wait_s + 30)

        assert claim("cpu", 2, [], 0).status_code == 204  # the API learns what it has
        polled: list[Any] = []
        poll = threading.Thread(target=lambda: polled.append(claim("cpu", 2, [], 25)))
        poll.start()
        before = _empty_claims(server)
        for _ in range(5):
            job = server.client().post(
                "/jobs", json={"entrypoint": "t.py", "world_size": 2, "device": "cuda"}
            )
            assert job.status_code == 201, job.text
            r = claim("big", 8, [0, 1, 2, 3], 10)
            assert r.status_code == 200 and r.json()["job_id"] == job.json()["id"], r.text
            finish(server, r.json(), name="big")
        assert _empty_claims(server) == before
        assert poll.is_alive()  # still asleep
        job = server.client().post("/jobs", json={"entrypoint": "t.py", "device": "cpu"})
        poll.join(timeout=20)
        assert polled and polled[0].status_code == 200, polled
        assert polled[0].json()["job_id"] == job.json()["id"]
    finally:
        stop_server(server)


def test_a_job_whose_submit_woke_polls_for_it_is_theirs_the_others_memory_holds() -> None:
    """A submit that woke a poll for its job: that poll learns it was chosen (it asks the
    database whatever the memory says), and the memory of every other poll holds over it
    (they do not race the chosen one for the job). A submit that found no poll to wake
    breaks the memory as before: whoever looks next must ask."""

    async def run() -> None:
        wakeup = Wakeup(queue.room_fits)
        wakeup.bind(asyncio.get_running_loop())
        memo = queue.NothingFits(valid_s=60)
        probe = queue.Probe(has_gpus=True, cpu=8, gpus=2, general=True)
        memo.found_nothing("w", wakeup.generation, probe, began=0.0, since=wakeup.since)

        def covers() -> bool:
            return memo.covers("w", wakeup.generation, 8, 2, 1.0, wakeup.since)

        wakeup._apply(Wake(device="cuda", nproc=1, job=1))  # nobody polls: nobody has it
        assert not covers()
        memo.found_nothing("w", wakeup.generation, probe, began=0.5, since=wakeup.since)
        poll = asyncio.create_task(wakeup.wait(wakeup.generation, 30, "v", 0, (1, 8, True)))
        await asyncio.sleep(0)
        wakeup._apply(Wake(device="cuda", nproc=1, job=2))
        woke = await asyncio.wait_for(poll, 5)
        assert woke is not None and woke.woken and woke.job == 2
        assert covers()

    asyncio.run(run())
