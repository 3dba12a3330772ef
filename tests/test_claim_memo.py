"""NothingFits: an idle long-poll is answered from a claim that found nothing only when
that answer holds for it (same kind of worker, no more room, the same wake-up, recent),
and never for a worker whose claim this process has not seen."""

from __future__ import annotations

import asyncio

from service.queue import NothingFits, Probe


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
