"""ASHA's pause mode: which trials go on from a rung, which pause there, which resume.

Optuna's SuccessiveHalvingPruner (service.studies, ``mode: stop``) decides once, as a
trial reaches a rung: on, or stopped for good. Early trials meet few rivals and go on
(the first at a rung always does), so on a grid of 27 trials ASHA stopped that way runs
a third of the grid's steps or more. ASHA as its paper writes it (Li et al., "A System
for Massively Parallel Hyperparameter Tuning", Algorithm 2), and Determined runs it,
pauses instead: of the n trials that reached rung k, the best floor(n / reduction_factor)
go on; a trial outside them pauses, and resumes (is promoted) if later trials make it
one of them, before any new trial starts. On a grid of 3^m trials that is, by the end,
synchronous successive halving's count at every rung.

The rule, for a rung k: its trials are ranked by their value there (NaN last, then the
lower number); the top floor(n_k / reduction_factor) is the set that may go on. A trial
arriving at rung k goes on if it is in that set, and pauses otherwise. A paused trial in
that set is promotable; the sweep promotes the promotable trials of the highest rung
first, best first, as room allows. The set counts the trials that went on already, so
the trials that go on from a rung never outnumber it but by those that fell out of it
after going on (the paper's asynchronous ASHA does the same).

Pure: nothing here reads or writes the database (service.sweeps does). Whether a trial
still ``ended`` is the caller's: a record's state is the sweep's.
"""

from __future__ import annotations

import math

from service.schemas import AshaStopping, SweepSpec
from service.studies import Event, Prune, Record, rung_step

# A trial paused at a rung: what a prune records (its step, value and words) too.
Pause = Prune

PAUSED = "paused"


def pausing(spec: SweepSpec) -> bool:
    """Whether the sweep's early stopping pauses trials rather than stopping them."""
    stop = spec.early_stopping
    return isinstance(stop, AshaStopping) and stop.mode == "pause"


def _factor(spec: SweepSpec) -> int:
    stop = spec.early_stopping
    assert isinstance(stop, AshaStopping)
    return stop.reduction_factor


def _key(spec: SweepSpec, r: Record, k: int) -> tuple[float, int]:
    value = r.rungs[k][1]
    if value is None or math.isnan(value):
        return (math.inf, r.number)
    return (value if spec.direction == "minimize" else -value, r.number)


def top(
    spec: SweepSpec, records: list[Record], k: int, tail: bool = False
) -> tuple[list[Record], int]:
    """The trials that may go on from rung ``k`` (best first), and how many reached it;
    ``tail``: at least the best one."""
    there = sorted((r for r in records if len(r.rungs) > k), key=lambda r: _key(spec, r, k))
    keep = len(there) // _factor(spec)
    return there[: max(keep, 1) if tail else keep], len(there)


def replay(
    spec: SweepSpec, records: list[Record], events: list[Event]
) -> tuple[dict[int, list[tuple[int, float | None]]], list[Pause]]:
    """The rungs ``events`` say trials reached, in the order they were reported: each
    trial's rungs recorded now, and the active trials that pause, with why. ``records``
    are updated in place (their rungs, and ``paused`` for those that pause), so that
    ``promotable`` sees what this round decided. A trial that ended meanwhile has its
    rungs recorded, and never pauses."""
    by_number = {r.number: r for r in records}
    before = {r.number: len(r.rungs) for r in records}
    pauses: list[Pause] = []
    for e in sorted(events, key=lambda e: (e.at, e.number, e.rung)):
        r = by_number[e.number]
        if r.state != "active" or e.rung != len(r.rungs):
            continue
        r.rungs = [*r.rungs, (e.step, e.value)]
        if r.ended:
            continue
        best, n = top(spec, records, e.rung)
        if any(b.number == r.number for b in best):
            continue  # it goes on
        r.state = PAUSED
        pauses.append(Pause(r.number, e.step, e.value, _words(spec, e, best, n)))
    changed = {r.number: r.rungs for r in records if len(r.rungs) != before[r.number]}
    return changed, pauses


def promotable(spec: SweepSpec, records: list[Record], tail: bool = False) -> list[int]:
    """Paused trials that may go on now: the highest rung's first, best first. ``tail``:
    the sweep makes no more trials and none runs, so no rung fills any further; then the
    best of a rung goes on even where its trials are fewer than reduction_factor (else
    a sweep of any other number of trials than a power of it would end with none run to
    its end)."""
    deepest = max((len(r.rungs) for r in records if r.state == PAUSED), default=0)
    out: list[int] = []
    for k in range(deepest - 1, -1, -1):
        best, _ = top(spec, records, k, tail)
        out += [r.number for r in best if r.state == PAUSED and len(r.rungs) == k + 1]
    return out


def _shown(value: float | None) -> str:
    return "NaN" if value is None or math.isnan(value) else f"{value:.4g}"


def _words(spec: SweepSpec, e: Event, best: list[Record], n: int) -> str:
    said = f"paused at step {e.step}: {spec.metric} {_shown(e.value)}"
    if not best:
        return (
            f"{said}, the first {n} at rung {e.rung} (step {rung_step(spec, e.rung)}): none "
            f"goes on before {_factor(spec)} have reached it; resumes if it is promoted"
        )
    cut = best[-1].rungs[e.rung][1]
    return (
        f"{said}, rung cut {_shown(cut)} (the best {len(best)} of {n} trials at rung "
        f"{e.rung} go on); resumes if later trials make it one of them"
    )


def never_promoted(spec: SweepSpec, r: Record) -> str:
    """Why a trial still paused when its sweep ends is pruned."""
    step, value = r.rungs[-1]
    return (
        f"pruned at step {step}: {spec.metric} {_shown(value)}, paused and never among "
        f"the best 1/{_factor(spec)} of its rung (the sweep made all its trials)"
    )
