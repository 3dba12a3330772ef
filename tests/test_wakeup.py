"""Who a commit wakes (service/wakeup.py): a finish that changes nothing for anyone else
wakes only its own worker's long-polls, with the slots it freed; one that queues the
job again, frees a gang's nodes or lets a quota-held job start wakes everyone. A
process ignores its own NOTIFY (its commit woke its claimers already).

Cheap: no server; the service's functions on both databases, Wakeup on an event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from service import jobs, queue
from service import wakeup as wakeup_module
from service.db import Database
from service.schemas import FinishRequest, JobSpec
from service.users import Principal, set_quota
from service.wakeup import EVERYONE, Wake, Wakeup

_tokens = itertools.count(1)


def _woken(db: Database) -> list[Any]:
    handed: list[Any] = []
    db.on_commit = handed.extend
    return handed


def _run(db: Database, owner: str = "alice", **spec: Any) -> queue.Claim:
    """A job of ``owner`` submitted and claimed on worker w (4 GPUs)."""
    job = jobs.submit_job(db, JobSpec(entrypoint="x.py", device="cuda", **spec), None, owner=owner)
    claim = queue.claim_next_job(db, "w", 8, [0, 1, 2, 3], f"{next(_tokens):064x}")
    assert claim is not None and claim.job_id == job.id
    return claim


def _finish(db: Database, claim: queue.Claim, exit_code: int = 0) -> None:
    jobs.finish_attempt(
        db, claim.job_id, "w", FinishRequest(attempt=claim.attempt, exit_code=exit_code)
    )


def test_a_finish_wakes_its_own_worker_with_the_slots_it_freed(db: Database) -> None:
    queue.register_worker(db, "w", None, "host", 8, [0, 1, 2, 3], "/c")
    handed = _woken(db)
    claim = _run(db, world_size=2)
    assert handed and all(w.everyone for w in handed)  # the submit: anyone may take it
    handed.clear()
    _finish(db, claim)
    assert handed == [Wake(False, "w", 0, tuple(claim.gpus))]


def test_a_finish_that_queues_the_job_again_wakes_everyone(db: Database) -> None:
    queue.register_worker(db, "w", None, "host", 8, [0, 1, 2, 3], "/c")
    handed = _woken(db)
    claim = _run(db, world_size=2, max_attempts=2, retry_on_error=True)
    handed.clear()
    _finish(db, claim, exit_code=1)
    assert [w.everyone for w in handed] == [True]
    assert handed[0].worker == "w" and handed[0].gpus == tuple(claim.gpus)


def test_a_finish_that_lets_a_quota_held_job_start_wakes_everyone(db: Database) -> None:
    queue.register_worker(db, "w", None, "host", 8, [0, 1, 2, 3], "/c")
    set_quota(db, Principal("admin", "admin"), "alice", {"max_running": 1})
    handed = _woken(db)
    claim = _run(db, world_size=1)
    jobs.submit_job(db, JobSpec(entrypoint="x.py", device="cuda"), None, owner="alice")
    handed.clear()
    _finish(db, claim)  # alice's second job is let go: any worker may start it
    assert [w.everyone for w in handed] == [True]


def test_a_rolled_back_transaction_wakes_nobody(db: Database) -> None:
    handed = _woken(db)
    with pytest.raises(RuntimeError), db.write() as s:
        queue.notify_claimers(s)
        raise RuntimeError("rolled back")
    assert handed == []


def test_a_targeted_wake_wakes_only_its_worker_and_carries_what_it_freed() -> None:
    async def run() -> None:
        wakeup = Wakeup()
        wakeup.bind(asyncio.get_running_loop())
        mark = wakeup.mark()
        a = asyncio.create_task(wakeup.wait(wakeup.generation, 30, "a", wakeup.own("a")))
        b = asyncio.create_task(wakeup.wait(wakeup.generation, 30, "b", wakeup.own("b")))
        gang = asyncio.create_task(wakeup.wait(wakeup.generation, 30))
        await asyncio.sleep(0)
        wakeup.wake(Wake(False, "a", 2, (1, 3)))
        await asyncio.wait_for(a, 5)
        assert not b.done() and not gang.done()
        assert wakeup.freed_since("a", mark) == (2, {1, 3})
        assert wakeup.freed_since("a", wakeup.mark()) == (0, set())  # nothing since
        assert wakeup.freed_since("b", mark) == (0, set())
        wakeup.notify()
        await asyncio.wait_for(asyncio.gather(b, gang), 5)
        # A wake-up between a look and its wait is not missed.
        seen, own = wakeup.generation, wakeup.own("a")
        wakeup.wake(Wake(False, "a"))
        await asyncio.wait_for(wakeup.wait(seen, 30, "a", own), 5)

    asyncio.run(run())


def test_a_wake_for_everyone_wakes_every_gang_and_the_roomiest_polls_the_rest_at_recheck() -> None:
    """40 long-polls and 2 gangs' waits: a submit wakes both gangs and the 16 polls of the
    most free GPUs (then CPU slots) at once; the others, at their re-check, see that the
    generation moved (a claim then runs for them: nothing is missed)."""

    async def run() -> None:
        wakeup = Wakeup()
        wakeup.bind(asyncio.get_running_loop())
        seen = wakeup.generation
        # (free GPUs, CPU slots, whether the worker has GPUs: not known yet)
        rooms = {f"w{i}": (i % 9, 32 - i, None) for i in range(40)}
        polls = {
            name: asyncio.create_task(wakeup.wait(seen, 30, name, 0, room))
            for name, room in rooms.items()
        }
        gangs = [asyncio.create_task(wakeup.wait(seen, 30)) for _ in range(2)]
        await asyncio.sleep(0)
        wakeup.notify()
        await asyncio.wait_for(asyncio.gather(*gangs), 5)
        await asyncio.sleep(0)
        woken = {name for name, t in polls.items() if t.done()}
        roomiest = sorted(rooms, key=lambda n: rooms[n], reverse=True)[: wakeup_module.WAKE_AT_ONCE]
        assert woken == set(roomiest)
        # A poll not woken, back from its re-check, sees the new generation.
        assert wakeup.generation != seen
        for t in polls.values():
            t.cancel()

    asyncio.run(run())


def test_a_process_ignores_its_own_notify_and_wakes_everyone_for_one_it_cannot_read() -> None:
    mine = Wake(False, "w", 1, (0,))
    assert Wake.heard(mine.payload()) is None
    other = mine.payload().replace('"p":"', '"p":"x')
    assert Wake.heard(other) == mine
    assert Wake.heard("") == EVERYONE  # an API of an earlier version


def test_a_queued_job_s_cancel_wakes_everyone_and_a_running_one_s_no_one(db: Database) -> None:
    """Its transaction says so (every API process hears it), not the route (its own only)."""
    queue.register_worker(db, "w", None, "host", 8, [0, 1, 2, 3], "/c")
    admin = Principal("admin", "admin")
    claim = _run(db, world_size=1)
    queued = jobs.submit_job(db, JobSpec(entrypoint="x.py", device="cuda", world_size=8), None)
    handed = _woken(db)
    jobs.cancel_job(db, queued.id, admin)
    assert [w.everyone for w in handed] == [True]
    handed.clear()
    jobs.cancel_job(db, claim.job_id, admin)  # cancelling: its finish frees its GPUs
    assert handed == []


def test_a_submit_wakes_only_the_polls_with_room_for_its_job() -> None:
    """A submit's wake-up carries its job's shape: a poll whose worker has no room for it
    (too few free GPUs, or no GPUs for a CUDA job) sleeps on; one whose kind this
    process has not learnt yet is woken, as every poll was before."""

    async def run() -> None:
        wakeup = Wakeup(queue.room_fits)
        wakeup.bind(asyncio.get_running_loop())
        seen = wakeup.generation
        rooms = {
            "gpu4": (4, 8, True),
            "gpu1": (1, 8, True),
            "cpu-only": (0, 64, False),
            "new": (0, 0, None),
        }
        polls = {
            name: asyncio.create_task(wakeup.wait(seen, 30, name, 0, room))
            for name, room in rooms.items()
        }
        await asyncio.sleep(0)
        wakeup.wake(Wake(device="cuda", nproc=2, job=7))
        await asyncio.wait_for(asyncio.gather(polls["gpu4"], polls["new"]), 5)
        assert {name for name, t in polls.items() if t.done()} == {"gpu4", "new"}
        for t in polls.values():
            t.cancel()

    asyncio.run(run())


def test_a_submit_wakes_a_poll_per_node_and_a_spare_of_the_least_room_that_fits() -> None:
    """A 2-GPU job's submit wakes the two polls whose free GPUs fit it most tightly, not
    the host with all 8 free (an 8-GPU job waits for that one) nor a poll of unknown kind;
    a 2-node job's wakes one more. The others see the generation at their re-check."""

    async def run() -> None:
        wakeup = Wakeup(queue.room_fits)
        wakeup.bind(asyncio.get_running_loop())
        rooms = {
            "free8": (8, 32, True),
            "three": (3, 32, True),
            "two-a": (2, 32, True),
            "two-b": (2, 16, True),
            "one": (1, 32, True),
            "new": (0, 0, None),
        }

        async def woken_by(wake: Wake) -> set[str]:
            seen = wakeup.generation
            polls = {
                name: asyncio.create_task(wakeup.wait(seen, 30, name, 0, room))
                for name, room in rooms.items()
            }
            await asyncio.sleep(0)
            wakeup.wake(wake)
            # The woken wake in the same turns of the loop: the first, then a few more turns.
            await asyncio.wait(polls.values(), timeout=5, return_when=asyncio.FIRST_COMPLETED)
            for _ in range(3):
                await asyncio.sleep(0)
            woken = {name for name, t in polls.items() if t.done()}
            for t in polls.values():
                t.cancel()
            await asyncio.gather(*polls.values(), return_exceptions=True)
            return woken

        assert wakeup_module.WAKE_SPARE == 1
        assert await woken_by(Wake(device="cuda", nproc=2, job=1)) == {"two-a", "two-b"}
        gang = Wake(device="cuda", nproc=2, nnodes=2, job=2)
        assert await woken_by(gang) == {"two-a", "two-b", "three"}

    asyncio.run(run())
