"""A sweep's decisions (service.studies), without a server: the pruner told rung by rung
on a study rebuilt from records decides as Optuna's own study does when a training loop
reports the same values in the same order; a draw depends on the seed and the history
only; a grid is every point once."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import optuna
import pytest

from service import studies
from service.schemas import SweepSpec

STEPS = [100, 300, 900]


def _spec(**over: Any) -> SweepSpec:
    body = {
        "job": {"entrypoint": "t.py", "args": ["--lr", "{lr}"]},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
        "method": "random",
        "metric": "loss",
        "max_trials": 9,
        "max_concurrent": 9,
        "seed": 7,
        **over,
    }
    return SweepSpec.model_validate(body)


def _reference(spec: SweepSpec, pruner: Any, order: list[tuple[int, int, float]]) -> set[int]:
    """The trials Optuna's own study prunes when trial n reports ``value`` at rung k's
    step and asks should_prune, in ``order`` (completing those that report the last)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=spec.direction, pruner=pruner)
    trials = [study.ask() for _ in range(spec.limit)]
    pruned: set[int] = set()
    for n, k, value in order:
        if n in pruned:
            continue
        trials[n].report(value, STEPS[k])
        if trials[n].should_prune():
            pruned.add(n)
            study.tell(trials[n], state=optuna.trial.TrialState.PRUNED)
        elif k == len(STEPS) - 1:
            study.tell(trials[n], value)
    return pruned


def _ddpq(spec: SweepSpec, order: list[tuple[int, int, float]]) -> set[int]:
    """The same, as ddpq decides: one event a round, on records only."""
    records = [studies.Record(n, {"lr": 0.01}, "active") for n in range(spec.limit)]
    t0 = datetime.now(UTC)
    for i, (n, k, value) in enumerate(order):
        r = records[n]
        if r.state != "active":
            continue
        event = studies.Event(n, k, STEPS[k], value, t0 + timedelta(seconds=i))
        rungs, prunes = studies.replay(spec, records, [event])
        for m, kept in rungs.items():
            records[m].rungs = kept
        for p in prunes:
            records[p.number].state, records[p.number].value = "pruned", p.value
            assert p.words.startswith(f"pruned at step {STEPS[k]}: loss "), p.words
        if r.state == "active" and k == len(STEPS) - 1:
            r.state, r.value = "complete", value
    return {r.number for r in records if r.state == "pruned"}


def _order(seed: int) -> list[tuple[int, int, float]]:
    """Each trial's rungs in turn, the trials interleaved at random."""
    rng = random.Random(seed)
    values = {n: [rng.random() for _ in STEPS] for n in range(9)}
    order = []
    for k in range(len(STEPS)):
        ns = list(range(9))
        rng.shuffle(ns)
        order += [(n, k, values[n][k]) for n in ns]
    return order


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_asha_prunes_what_optunas_successive_halving_prunes(seed: int) -> None:
    spec = _spec(early_stopping={"type": "asha", "min_steps": 100, "reduction_factor": 3})
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=100, reduction_factor=3)
    order = _order(seed)
    expected = _reference(spec, pruner, order)
    assert expected and len(expected) < 9
    assert _ddpq(spec, order) == expected


def test_median_stopping_prunes_what_optunas_median_pruner_prunes() -> None:
    stop = {"type": "median", "warmup_steps": 100, "interval_steps": 200, "startup_trials": 2}
    spec = _spec(early_stopping=stop, direction="maximize")
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=100, interval_steps=200)
    # Trials run one after another (the median compares with completed ones).
    rng = random.Random(5)
    order = [(n, k, rng.random()) for n in range(9) for k in range(len(STEPS))]
    expected = _reference(spec, pruner, order)
    assert expected
    assert _ddpq(spec, order) == expected


def test_a_draw_depends_on_the_seed_and_history_only() -> None:
    spec = _spec(
        method="tpe",
        startup_trials=2,
        space={
            "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
            "width": {"type": "int", "low": 16, "high": 256, "step": 16},
            "act": {"type": "categorical", "values": ["relu", "gelu"]},
            "epochs": {"type": "fixed", "value": 3},
        },
    )
    first = studies.ask(spec, 11, [], [0, 1])
    assert first == studies.ask(spec, 11, [], [0, 1])
    assert first != studies.ask(spec, 12, [], [0, 1])
    assert first[0] != first[1] and all(p["epochs"] == 3 for p in first)
    history = [studies.Record(n, p, "complete", value=float(n)) for n, p in enumerate(first)] + [
        studies.Record(2, studies.ask(spec, 11, [], [0])[0], "active")
    ]
    # TPE past its startup trials, with one still running: the same ask twice.
    again = [studies.ask(spec, 11, history, [3, 4]) for _ in range(2)]
    assert again[0] == again[1]
    for p in again[0]:
        assert 1e-4 <= p["lr"] <= 1.0 and p["width"] % 16 == 0 and p["act"] in ("relu", "gelu")


def test_a_grid_is_every_point_once() -> None:
    spec = _spec(
        method="grid",
        max_trials=None,
        space={
            "lr": {"type": "float", "low": 0.1, "high": 0.3, "step": 0.1},
            "act": {"type": "categorical", "values": ["relu", "gelu"]},
            "seed": {"type": "fixed", "value": 1},
        },
    )
    assert spec.limit == 6
    points = studies.ask(spec, 0, [], list(range(6)))
    expected = [
        {"act": a, "lr": lr, "seed": 1}
        for a, lr in itertools.product(["relu", "gelu"], [0.1, 0.2, 0.3])
    ]
    assert points == expected
