"""A sweep's decisions as Optuna makes them, on a study rebuilt from what ddpq recorded.

ddpq's database is the one source of truth: no Optuna storage is kept. At each decision
the study is made again, in memory, from the sweep's trials (their parameters, the
metric at each rung they reached, how they ended), so a decision survives an API
restart, a worker's loss and a trial's retries with nothing else to keep alive. Then:

- ``replay``: the rungs trials reached since the last round, told to the pruner
  (SuccessiveHalvingPruner for ``asha``, MedianPruner for ``median``) in the order their
  points were reported, each as ``trial.report`` and ``trial.should_prune`` would in a
  training loop: the rung's value (the first point at or after the rung's step) at the
  rung's step, so trials that report at different steps are compared at the same ones;
- ``ask``: a new trial's parameters, from a sampler seeded by the sweep's seed and the
  trial's number (RandomSampler, TPESampler with the constant liar for the trials still
  running), so the same history asks the same. A grid is enumerated here, by the
  trial's number, rather than by Optuna's GridSampler, which keeps the points it has
  handed out in its own trials' attributes.

Pure: nothing here reads or writes the database (service.sweeps does, and decides when).
Optuna is imported on first use: an API that runs no sweep never loads it.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any

from service.schemas import (
    TPE_STARTUP_TRIALS,
    AshaStopping,
    CategoricalParam,
    FixedParam,
    FloatParam,
    IntParam,
    MedianStopping,
    SweepSpec,
    grid_values,
)

# A median pruner's evaluations per trial: a trial past this many rungs is not stopped by
# it any more (interval_steps sets how often it looks).
MAX_MEDIAN_RUNGS = 200


@cache
def _optuna() -> Any:
    import optuna  # here: the API loads it only once a sweep decides

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per trial told
    return optuna


# ---- rungs ---------------------------------------------------------------------------


def rung_step(spec: SweepSpec, k: int) -> int | None:
    """The step of rung ``k`` of the sweep's early stopping, or None past its last."""
    stop = spec.early_stopping
    if isinstance(stop, AshaStopping):
        step = stop.min_steps * stop.reduction_factor ** (stop.min_early_stopping_rate + k)
        return step if step < 2**63 else None
    if isinstance(stop, MedianStopping):
        if k >= MAX_MEDIAN_RUNGS:
            return None
        step = stop.warmup_steps + k * stop.interval_steps
        return step if step < 2**63 else None
    return None


def rungs_from(
    spec: SweepSpec, k: int, points: list[tuple[int, float | None, datetime]]
) -> Iterator[tuple[int, int, float | None, datetime]]:
    """The rungs from ``k`` on that ``points`` (step, value, when; by step) reach: (rung,
    the step reported, its value, when), the first point at or after each rung's step."""
    i = 0
    while True:
        at = rung_step(spec, k)
        if at is None:
            return
        while i < len(points) and points[i][0] < at:
            i += 1
        if i == len(points):
            return
        step, value, when = points[i]
        yield k, step, value, when
        k += 1


# ---- the study, rebuilt ----------------------------------------------------------------


@dataclass
class Record:
    """A trial as the sweep recorded it (service.sweeps reads it from its row): ``ended``
    says its job has ended, whether or not the sweep has told its end yet."""

    number: int
    params: dict[str, Any]
    state: str  # active, complete, pruned, failed, cancelled
    value: float | None = None
    rungs: list[tuple[int, float | None]] = field(default_factory=list)
    ended: bool = False


@dataclass(frozen=True)
class Event:
    """A rung a trial reached since the last round: its point's step, value and time."""

    number: int
    rung: int
    step: int
    value: float | None  # None: NaN
    at: datetime


@dataclass(frozen=True)
class Prune:
    number: int
    step: int
    value: float | None
    words: str  # why, as the trial's and its job's reason say it


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _intermediate(spec: SweepSpec, rungs: list[tuple[int, float | None]]) -> dict[int, float]:
    out = {}
    for k, (_, value) in enumerate(rungs):
        at = rung_step(spec, k)
        if at is not None:
            out[at] = _nan(value)
    return out


def _completed(spec: SweepSpec, rungs: list[tuple[int, float | None]]) -> dict[str, float]:
    """The attributes SuccessiveHalvingPruner keeps of the rungs a trial completed (it
    records each before it decides; a NaN it never records)."""
    if not isinstance(spec.early_stopping, AshaStopping):
        return {}
    return {f"completed_rung_{k}": v for k, (_, v) in enumerate(rungs) if v is not None}


def _distribution(param: Any) -> Any:
    d = _optuna().distributions
    if isinstance(param, FloatParam):
        return d.FloatDistribution(
            float(param.low), float(param.high), log=param.log, step=param.step
        )
    if isinstance(param, IntParam):
        return d.IntDistribution(param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, CategoricalParam):
        return d.CategoricalDistribution(param.values)
    raise TypeError(f"no distribution for {param!r}")


def _varying(spec: SweepSpec) -> dict[str, Any]:
    """The parameters a sampler draws (the fixed ones are not its)."""
    return {n: p for n, p in spec.space.items() if not isinstance(p, FixedParam)}


def _pruner(spec: SweepSpec) -> Any:
    pruners = _optuna().pruners
    stop = spec.early_stopping
    if isinstance(stop, AshaStopping):
        return pruners.SuccessiveHalvingPruner(
            min_resource=stop.min_steps,
            reduction_factor=stop.reduction_factor,
            min_early_stopping_rate=stop.min_early_stopping_rate,
            bootstrap_count=stop.bootstrap_count,
        )
    if isinstance(stop, MedianStopping):
        return pruners.MedianPruner(
            n_startup_trials=stop.startup_trials,
            n_warmup_steps=stop.warmup_steps,
            interval_steps=stop.interval_steps,
            n_min_trials=stop.min_trials,
        )
    return pruners.NopPruner()


def _frozen(spec: SweepSpec, r: Record, with_params: bool, told: bool) -> Any:
    """``r`` as a trial of the rebuilt study; ``told``: as its state says (else an
    unfinished trial is RUNNING, as in a study its ranks still report to)."""
    o = _optuna()
    states = o.trial.TrialState
    varying = _varying(spec) if with_params else {}
    params = {n: r.params[n] for n in varying}
    state, value = states.RUNNING, None
    if r.state == "complete" and told:
        state, value = states.COMPLETE, r.value
    elif r.state in ("pruned", "paused"):
        # Optuna gives a pruned trial its last reported value (TPE weighs it by it).
        last = r.rungs[-1][1] if r.rungs else None
        state, value = states.PRUNED, last
    elif r.state in ("failed", "cancelled") and told:
        state = states.FAIL
    return o.trial.create_trial(
        state=state,
        value=value,
        params=params,
        distributions={n: _distribution(p) for n, p in varying.items()},
        intermediate_values=_intermediate(spec, r.rungs),
        system_attrs=_completed(spec, r.rungs),
    )


def _study(spec: SweepSpec, records: list[Record], with_params: bool, told: bool) -> Any:
    o = _optuna()
    # Optuna's warnings (a range a step does not divide, which it narrows; experimental
    # options) would be a line in the API's log at every decision.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = o.create_study(
            storage=o.storages.InMemoryStorage(),
            direction=spec.direction,
            pruner=_pruner(spec),
            sampler=o.samplers.RandomSampler(seed=0),  # replaced for each ask
        )
        study.add_trials([_frozen(spec, r, with_params, told) for r in records])
    return study


# ---- pruning -------------------------------------------------------------------------


def replay(
    spec: SweepSpec, records: list[Record], events: list[Event]
) -> tuple[dict[int, list[tuple[int, float | None]]], list[Prune]]:
    """Tell the pruner the rungs ``events`` say trials reached, in the order they were
    reported: each trial's rungs recorded now, and the active trials to stop, with why.
    A trial that ended meanwhile has its rungs recorded as the pruner would have (up to
    one it would have stopped at), and is never stopped."""
    if spec.early_stopping is None or not events:
        return {}, []
    o = _optuna()
    # In trial-number order: the study's number n is the record's n (Record.number).
    records = sorted(records, key=lambda r: r.number)
    study = _study(spec, records, with_params=False, told=True)
    frozen = study.get_trials(deepcopy=False)
    by_number = {r.number: (r, frozen[i]) for i, r in enumerate(records)}
    rungs = {r.number: list(r.rungs) for r in records}
    stopped: set[int] = set()
    prunes: list[Prune] = []
    for e in sorted(events, key=lambda e: (e.at, e.number, e.rung)):
        r, f = by_number[e.number]
        if e.number in stopped or e.rung != len(rungs[e.number]) or r.state != "active":
            continue
        at = rung_step(spec, e.rung)
        assert at is not None
        trial = o.trial.Trial(study, f._trial_id)  # the study's own trial, by its id
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial.report(_nan(e.value), at)
            prune = trial.should_prune()
        rungs[e.number].append((e.step, e.value))
        if prune:
            stopped.add(e.number)
            if not r.ended:
                words = _words(spec, study, e, rungs[e.number])
                prunes.append(Prune(e.number, e.step, e.value, words))
    changed = {n: v for n, v in rungs.items() if len(v) != len(by_number[n][0].rungs)}
    return changed, prunes


def _shown(value: float | None) -> str:
    return "NaN" if value is None or math.isnan(value) else f"{value:.4g}"


def _words(spec: SweepSpec, study: Any, e: Event, rungs: list[tuple[int, float | None]]) -> str:
    """Why the pruner stopped the trial, in numbers: the cut it fell below."""
    said = f"pruned at step {e.step}: {spec.metric} {_shown(e.value)}"
    if e.value is None or math.isnan(e.value):
        return said
    stop = spec.early_stopping
    if isinstance(stop, AshaStopping):
        key = f"completed_rung_{e.rung}"
        competing = sorted(
            t.system_attrs[key] for t in study.get_trials(deepcopy=False) if key in t.system_attrs
        )
        if len(competing) <= stop.bootstrap_count:
            return (
                f"{said}, {len(competing)} of {len(competing)} trials at its rung, fewer "
                f"than bootstrap_count {stop.bootstrap_count} needs"
            )
        keep = max(len(competing) // stop.reduction_factor - 1, 0)
        cut = competing[keep] if spec.direction == "minimize" else competing[-(keep + 1)]
        return f"{said}, rung cut {_shown(cut)} ({keep + 1} of {len(competing)} trials kept)"
    at = rung_step(spec, e.rung)
    done = [
        t.intermediate_values[at]
        for t in study.get_trials(deepcopy=False, states=(_optuna().trial.TrialState.COMPLETE,))
        if at in t.intermediate_values and not math.isnan(t.intermediate_values[at])
    ]
    if not done:
        return said
    ordered = sorted(done)
    median = (ordered[(len(done) - 1) // 2] + ordered[len(done) // 2]) / 2
    values = [v for _, v in rungs if v is not None and not math.isnan(v)]
    best = (min if spec.direction == "minimize" else max)(values) if values else math.nan
    return (
        f"{said} (best so far {_shown(best)}), median cut {_shown(median)} "
        f"({len(done)} completed trials at step {at})"
    )


# ---- asking ---------------------------------------------------------------------------


def trial_seed(seed: int, number: int) -> int:
    """The seed of trial ``number``'s draw: from the sweep's, so the same history draws
    the same parameters after a restart, and each trial draws its own."""
    digest = hashlib.sha256(f"ddpq-sweep:{seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _sampler(spec: SweepSpec, seed: int) -> Any:
    samplers = _optuna().samplers
    if spec.method == "tpe":
        startup = spec.startup_trials
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", _optuna().exceptions.ExperimentalWarning)
            return samplers.TPESampler(
                seed=seed,
                n_startup_trials=TPE_STARTUP_TRIALS if startup is None else startup,
                constant_liar=True,  # trials still running count as bad, not as absent
            )
    return samplers.RandomSampler(seed=seed)


def grid_point(spec: SweepSpec, number: int) -> dict[str, Any]:
    """The grid's point ``number`` (the last parameter by name varies fastest)."""
    names = sorted(spec.space)
    axes = [grid_values(spec.space[n]) or [] for n in names]
    point = next(itertools.islice(itertools.product(*axes), number, None))
    return dict(zip(names, point, strict=True))


def fixed(spec: SweepSpec) -> dict[str, Any]:
    return {n: p.value for n, p in spec.space.items() if isinstance(p, FixedParam)}


def ask(
    spec: SweepSpec, seed: int, records: list[Record], numbers: list[int]
) -> list[dict[str, Any]]:
    """The parameters of new trials ``numbers`` (the next ones, in order), every one the
    program gets (the fixed ones too)."""
    if not numbers:
        return []
    if spec.method == "grid":
        return [grid_point(spec, n) for n in numbers]
    records = sorted(records, key=lambda r: r.number)
    study = _study(spec, records, with_params=True, told=True)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as in _study
        space = {n: _distribution(p) for n, p in _varying(spec).items()}
        for number in numbers:
            if len(study.get_trials(deepcopy=False)) != number:
                raise RuntimeError(f"trial {number} asked of a study of other trials")
            study.sampler = _sampler(spec, trial_seed(seed, number))
            trial = study.ask(fixed_distributions=space)
            out.append({**fixed(spec), **trial.params})
    return out


def best(spec: SweepSpec, records: list[Record]) -> Record | None:
    """The complete trial with the best value (the lowest number among equals)."""
    done = [r for r in records if r.state == "complete" and r.value is not None]
    if not done:
        return None
    sign = 1.0 if spec.direction == "minimize" else -1.0
    return min(done, key=lambda r: (sign * (r.value or 0.0), r.number))
