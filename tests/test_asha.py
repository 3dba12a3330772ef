"""ASHA's pause mode (service.asha), pure: a worked example decision by decision, a whole
sweep simulated under a synchronous schedule against successive halving computed by hand,
and random asynchronous schedules against the rule's invariants."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from service import asha
from service.schemas import SweepSpec
from service.studies import Event, Record

T0 = datetime(2026, 11, 29, tzinfo=UTC)


def spec(rf: int = 3, direction: str = "minimize") -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "job": {"entrypoint": "train.py"},
            "space": {"lr": {"type": "float", "low": 0.1, "high": 1.0}},
            "method": "random",
            "metric": "loss",
            "direction": direction,
            "max_trials": 100,
            "max_concurrent": 100,
            "early_stopping": {
                "type": "asha",
                "mode": "pause",
                "min_steps": 10,
                "reduction_factor": rf,
            },
        }
    )


def test_a_worked_example_decision_by_decision() -> None:
    """Nine trials reach rung 0 one by one (reduction factor 3): a trial goes on only if
    it is among the best floor(n/3) of the n there; a paused one becomes promotable when
    it is, and stops being so when better ones arrive."""
    s = spec()
    records: list[Record] = []
    seen = []
    # (trial, loss): each arrival's decision, then who is promotable.
    arrivals = [
        (0, 0.5, "pause", []),  # 1 there: none goes on
        (1, 0.4, "pause", []),  # 2 there: none
        (2, 0.6, "pause", [1]),  # 3 there: the best (1) may go on
        (3, 0.1, "on", []),  # 4 there: the best is 3, which goes on; 1 no longer
        (4, 0.3, "pause", []),  # 5: still one (3)
        (5, 0.2, "on", []),  # 6: two (3, 5)
        (6, 0.9, "pause", []),  # 7: two
        (7, 0.35, "pause", []),  # 8: two
        (8, 0.45, "pause", [4]),  # 9: three (3, 5, 4): 4 is paused, promotable
    ]
    for i, (n, loss, decision, promotable) in enumerate(arrivals):
        records.append(Record(n, {}, "active"))
        event = Event(n, 0, 10, loss, T0 + timedelta(seconds=i))
        changed, pauses = asha.replay(s, records, [event])
        assert changed == {n: [(10, loss)]}
        seen.append([p.number for p in pauses])
        assert (pauses == []) == (decision == "on"), (n, pauses)
        assert asha.promotable(s, records) == promotable, n
    assert records[8].state == asha.PAUSED
    words = asha.replay(s, [Record(9, {}, "active"), *records], [Event(9, 0, 12, 0.7, T0)])[1]
    assert words[0].words == (
        "paused at step 12: loss 0.7, rung cut 0.3 (the best 3 of 10 trials at rung 0 go "
        "on); resumes if later trials make it one of them"
    )
    first = asha.replay(s, [Record(0, {}, "active")], [Event(0, 0, 10, 0.5, T0)])[1][0]
    assert first.words == (
        "paused at step 10: loss 0.5, the first 1 at rung 0 (step 10): none goes on before "
        "3 have reached it; resumes if it is promoted"
    )
    # NaN is the worst; maximising turns the order round.
    up = spec(direction="maximize")
    them = [Record(n, {}, "active") for n in range(3)]
    events = [Event(n, 0, 10, v, T0 + timedelta(seconds=n)) for n, v in enumerate([None, 2.0, 1.0])]
    asha.replay(up, them, events)
    assert asha.promotable(up, them) == [1]
    assert asha.promotable(spec(), them) == [2]


def simulate(
    s: SweepSpec,
    values: dict[int, list[float]],
    concurrency: int,
    pick: Callable[[list[Record]], Record],
) -> tuple[list[Record], list[tuple[int, int]]]:
    """A sweep of len(values) trials, rungs 0..R-1 then the end, run as service.sweeps
    runs it: a running trial picked by ``pick`` reports its next rung (or ends past the
    last), the rule decides, paused trials are promoted (the deepest rung's first) and
    new trials made while fewer than ``concurrency`` run. Returns the records and every
    (trial, rung) it went on from, each checked, when it went on, to be in the rung's
    best floor(n / reduction_factor) (at least 1 once nothing runs or can be made)."""
    rf = s.early_stopping.reduction_factor  # type: ignore[union-attr]
    records: list[Record] = []
    went_on: list[tuple[int, int]] = []
    clock = iter(range(10**6))
    rungs = len(next(iter(values.values()))) - 1  # the last value: at the end

    def best_at(k: int, tail: bool) -> set[int]:
        there = sorted(
            (r for r in records if len(r.rungs) > k), key=lambda r: (r.rungs[k][1], r.number)
        )
        keep = len(there) // rf
        return {r.number for r in there[: max(keep, 1) if tail else keep]}

    def fill() -> None:
        while True:
            running = [r for r in records if r.state == "active"]
            tail = len(records) == len(values) and not running
            ready = asha.promotable(s, records, tail)
            if ready and len(running) < concurrency:
                r = next(x for x in records if x.number == ready[0])
                k = len(r.rungs) - 1
                assert r.number in best_at(k, tail), (r.number, k)
                r.state = "active"
                went_on.append((r.number, k))
                continue
            if len(records) < len(values) and len(running) < concurrency:
                records.append(Record(len(records), {}, "active"))
                continue
            return

    fill()
    while running := [r for r in records if r.state == "active"]:
        r = pick(running)
        k = len(r.rungs)
        if k == rungs:
            r.state, r.value = "complete", values[r.number][-1]
        else:
            v = values[r.number][k]
            ahead = best_at(k, False) | {r.number}
            asha.replay(
                s, records, [Event(r.number, k, 10 * 3**k, v, T0 + timedelta(seconds=next(clock)))]
            )
            if r.state == "active":
                # It went on as it arrived: it was among the best there, itself counted.
                there = sorted(
                    (x for x in records if len(x.rungs) > k),
                    key=lambda x: (x.rungs[k][1], x.number),
                )
                assert r.number in {x.number for x in there[: len(there) // rf]}, (
                    r.number,
                    k,
                    ahead,
                )
                went_on.append((r.number, k))
        fill()
    return records, went_on


def test_a_synchronous_schedule_is_successive_halving_as_computed_by_hand() -> None:
    """Every trial of a rung reports before any goes further, the best first: then ASHA
    promotes exactly the trials synchronous successive halving keeps, rung by rung, and
    runs to the end only its winner. Over random losses, with 27 and 81 trials."""
    rng = random.Random(43)
    for n, rf in [(27, 3), (81, 3), (16, 2), (9, 3)]:
        for _ in range(20):
            rungs = 0
            while rf ** (rungs + 1) <= n:
                rungs += 1
            values = {t: [rng.random() for _ in range(rungs)] + [rng.random()] for t in range(n)}

            def pick(running: list[Record], values: dict[int, list[float]] = values) -> Record:
                lowest = min(len(r.rungs) for r in running)
                at = [r for r in running if len(r.rungs) == lowest]
                if lowest == len(values[0]) - 1:
                    return at[0]
                return min(at, key=lambda r: values[r.number][lowest])

            records, went_on = simulate(spec(rf), values, n, pick)
            # By hand: keep the best n / rf at each rung, of those kept at the one before.
            kept = list(range(n))
            for k in range(rungs):
                kept = sorted(kept, key=lambda t: values[t][k])[: len(kept) // rf]
                assert sorted(t for t, at in went_on if at == k) == sorted(kept), (n, k)
            assert [r.number for r in records if r.state == "complete"] == kept
            assert len(kept) == 1
            assert all(r.state in ("complete", asha.PAUSED) for r in records)


@pytest.mark.parametrize("seed", range(6))
def test_random_asynchronous_schedules_keep_the_rule(seed: int) -> None:
    """Any order of reports, any concurrency: a trial goes on from a rung only while it is
    among the best there (simulate checks each), every rung that n trials reached lets at
    least floor(n / rf) of them go on (at least one), and some trial runs to the end."""
    rng = random.Random(seed)
    for _ in range(25):
        n, rf = rng.randint(2, 40), rng.choice([2, 3, 4])
        values = {t: [rng.random() for _ in range(4)] for t in range(n)}
        concurrency = rng.randint(1, n)
        records, went_on = simulate(
            spec(rf), values, concurrency, lambda running: rng.choice(running)
        )
        for k in range(3):
            reached = sum(1 for r in records if len(r.rungs) > k)
            if reached:
                assert sum(1 for _, at in went_on if at == k) >= max(reached // rf, 1)
        assert any(r.state == "complete" for r in records)
        assert len({(t, k) for t, k in went_on}) == len(went_on), "a trial goes on from a rung once"
