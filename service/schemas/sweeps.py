"""Sweeps: SweepSpec (the body of POST /sweeps: a base job, a search space, a method, a
metric and its direction, the limits, early stopping), the templates that give a trial's
parameters to its program, a grid's points, and the views of a sweep and its trials."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

from ddpq.messages import INT64_MAX, Label, Strict
from ddpq.rules import MAX_ARRAY_CHARS, MAX_PARAMS, array_indices, param_name_problem
from service.schemas.common import MAX_NAME_CHARS
from service.schemas.jobs import JobSpec, JobSpecPublic, ParamValue
from service.schemas.metrics import MetricName, MetricValue

MAX_TRIALS = 10_000  # a sweep's trials (a grid's points): each is a job
MAX_CONCURRENT = 256  # trials queued or running at once
MAX_CHOICES = 1000  # a categorical parameter's values
MAX_SEED = 2**32 - 1
TPE_STARTUP_TRIALS = 10  # Optuna's default: random draws before TPE's model takes over

Int64 = Annotated[int, Field(strict=True, ge=-(2**63), le=INT64_MAX)]
# An int parameter's bounds: exact as floats too (the samplers draw in floats).
Int53 = Annotated[int, Field(strict=True, ge=-(2**53), le=2**53)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_TRIALS)]
Steps = Annotated[int, Field(strict=True, ge=0, le=2**62)]


def _param_name(v: str) -> str:
    problem = param_name_problem(v)
    if problem:
        raise ValueError(problem)
    return v


ParamName = Annotated[str, AfterValidator(_param_name)]


class FloatParam(Strict):
    """A float drawn uniformly from [low, high], or log-uniformly (``log``); on a grid,
    low, low + step, ... up to high."""

    type: Literal["float"]
    low: Finite | Int64
    high: Finite | Int64
    log: Annotated[bool, Field(strict=True)] = False
    step: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _range(self) -> FloatParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if not math.isfinite(float(self.high) - float(self.low)):
            raise ValueError("the range is wider than a float holds")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-uniform float needs low > 0, not {self.low}")
        if self.log and self.step is not None:
            raise ValueError("a float is log-uniform or has a step, not both")
        if self.step is not None and self.step > self.high - self.low:
            raise ValueError(f"step {self.step} is wider than the range [{self.low}, {self.high}]")
        return self


class IntParam(Strict):
    """An integer drawn from low, low + step, ... up to high (``log``: log-uniformly,
    step 1)."""

    type: Literal["int"]
    low: Int53
    high: Int53
    log: Annotated[bool, Field(strict=True)] = False
    step: Annotated[int, Field(strict=True, ge=1, le=2**53)] = 1

    @model_validator(mode="after")
    def _range(self) -> IntParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and (self.low < 1 or self.step != 1):
            raise ValueError("a log-uniform int needs low >= 1 and step 1")
        return self


class CategoricalParam(Strict):
    """One of ``values``."""

    type: Literal["categorical"]
    values: Annotated[list[ParamValue], Field(min_length=1, max_length=MAX_CHOICES)]

    @model_validator(mode="after")
    def _distinct(self) -> CategoricalParam:
        # As the samplers compare them: 1, 1.0 and true are one value (and one hash).
        seen: set[ParamValue] = set()
        for v in self.values:
            if v in seen:
                raise ValueError(f"{v!r} is given twice (1, 1.0 and true count as one value)")
            seen.add(v)
        return self


class FixedParam(Strict):
    """The same ``value`` in every trial (the program gets it as it gets the others)."""

    type: Literal["fixed"]
    value: ParamValue


Param = Annotated[
    FloatParam | IntParam | CategoricalParam | FixedParam, Field(discriminator="type")
]


class AshaStopping(Strict):
    """Asynchronous successive halving: rung k at step
    min_steps * reduction_factor ** (min_early_stopping_rate + k).

    ``mode: stop`` (Optuna's SuccessiveHalvingPruner): a trial reaching a rung goes on
    only if its metric there is in the best 1/reduction_factor of the trials that reached
    it so far, and stops for good otherwise. ``mode: pause`` (ASHA as its paper and
    Determined run it): a trial reaching a rung goes on only if it is among the best
    floor(n/reduction_factor) of the n trials there that have not gone on yet; otherwise
    it pauses, held with its checkpoint, and resumes from it when later trials make it one
    of those (promoted before any new trial starts); paused trials never promoted end
    pruned with the sweep. No step runs twice, for a program that saves a checkpoint when
    it is stopped (SIGTERM) and loads it when it starts."""

    type: Literal["asha"]
    min_steps: Annotated[int, Field(strict=True, ge=1, le=2**62)]
    reduction_factor: Annotated[int, Field(strict=True, ge=2, le=100)] = 3
    min_early_stopping_rate: Annotated[int, Field(strict=True, ge=0, le=60)] = 0
    bootstrap_count: Count = 0
    mode: Literal["stop", "pause"] = "stop"


class MedianStopping(Strict):
    """Median stopping (Optuna's MedianPruner): at steps warmup_steps + k * interval_steps,
    a trial whose best value so far is worse than the median of the completed trials' at
    that step stops (once startup_trials have completed, among at least min_trials)."""

    type: Literal["median"]
    warmup_steps: Steps = 0
    interval_steps: Annotated[int, Field(strict=True, ge=1, le=2**62)] = 1
    startup_trials: Count = 5
    min_trials: Annotated[int, Field(strict=True, ge=1, le=MAX_TRIALS)] = 1


EarlyStopping = Annotated[AshaStopping | MedianStopping, Field(discriminator="type")]

# A template in a trial's args and env values: {name} is the parameter's value, {{ and }}
# a brace. Other braces (a JSON argument) stay as they are.
_TEMPLATE = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]{0,63})\}")


def template_names(text: str) -> list[str]:
    """The parameters ``text`` names as {name}."""
    return [m.group(1) for m in _TEMPLATE.finditer(text) if m.group(1)]


def as_text(value: Any) -> str:
    """A parameter's value as a template writes it: text as it is, others as JSON
    (0.001, 128, true, null)."""
    return value if isinstance(value, str) else json.dumps(value)


def fill(text: str, params: dict[str, Any]) -> str:
    """``text`` with each {name} replaced by that parameter's value."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name is None:
            return m.group()[0]  # {{ or }}
        return as_text(params[name]) if name in params else m.group()

    return _TEMPLATE.sub(one, text)


def grid_values(param: FloatParam | IntParam | CategoricalParam | FixedParam) -> list[Any] | None:
    """The points a grid takes of ``param``, or None when it has none to list (a float
    without a step)."""
    if isinstance(param, FixedParam):
        return [param.value]
    if isinstance(param, CategoricalParam):
        return list(param.values)
    if isinstance(param, IntParam):
        count = (param.high - param.low) // param.step + 1
        return None if count > MAX_TRIALS else list(range(param.low, param.high + 1, param.step))
    if param.step is None:
        return None
    count = math.floor((param.high - param.low) / param.step + 1e-9) + 1
    if count > MAX_TRIALS:
        return None
    return [round(param.low + k * param.step, 12) for k in range(count)]


class SweepSpec(Strict):
    """A sweep: the body of POST /sweeps. Each trial is ``job`` with parameters drawn from
    ``space``: in its args and env values as templates ({lr}), and to its program as
    ddpq.train.params()."""

    name: Annotated[Label | None, Field(max_length=MAX_NAME_CHARS)] = None
    job: JobSpec
    space: Annotated[dict[ParamName, Param], Field(max_length=MAX_PARAMS)] = {}
    # A job array (Slurm's syntax: "0-31", "0-15:4", "1,3,5-7"): a grid over one
    # parameter, ``index``, whose task i its ranks see in DDPQ_ARRAY_INDEX. Its space is
    # that parameter (given or not); max_concurrent defaults to every task at once.
    array: Annotated[str, Field(min_length=1, max_length=MAX_ARRAY_CHARS)] | None = None
    method: Literal["grid", "random", "tpe"] = "random"
    # Needed to rank, and to stop early; a grid may run without one (an array, seeds).
    metric: MetricName | None = None
    direction: Literal["minimize", "maximize"] = "minimize"
    # How many trials in all (a grid: its points, by default); each is a job.
    max_trials: Annotated[int, Field(strict=True, ge=1, le=MAX_TRIALS)] | None = None
    max_concurrent: Annotated[int, Field(strict=True, ge=1, le=MAX_CONCURRENT)] = 1
    early_stopping: EarlyStopping | None = None
    # The sampler's seed (drawn at the submit when not given; the sweep shows it).
    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] | None = None
    # TPE: trials drawn at random before its model takes over (Optuna's default, 10).
    startup_trials: Count | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SweepSpec:
        if self.array is not None:
            self._as_array(self.array)
        if not self.space:
            raise ValueError("space: an empty space: name at least one parameter")
        if self.metric is None and (self.method != "grid" or self.early_stopping is not None):
            doing = "stop early" if self.early_stopping is not None else f"draw ({self.method})"
            raise ValueError(f"metric: a sweep needs its metric to {doing}")
        varying = [n for n, p in self.space.items() if not isinstance(p, FixedParam)]
        if self.method != "grid" and not varying:
            raise ValueError(f"space: every parameter is fixed: nothing for {self.method} to draw")
        if self.job.params:
            raise ValueError("job.params: the sweep sets each trial's parameters")
        self._templates()
        if self.method == "grid":
            size = self.grid_size()
            if self.max_trials is not None and self.max_trials > size:
                raise ValueError(
                    f"max_trials: {self.max_trials} is more than the grid's {size} points"
                )
        elif self.max_trials is None:
            raise ValueError(f"max_trials: a {self.method} sweep needs one (how many trials)")
        if self.startup_trials is not None and self.method != "tpe":
            raise ValueError(f"startup_trials: TPE's, not {self.method}'s")
        return self

    def _as_array(self, text: str) -> None:
        try:
            indices = array_indices(text)
        except ValueError as exc:
            raise ValueError(f"array: {exc}") from None
        space = {"index": CategoricalParam(type="categorical", values=list(indices))}
        if self.space and self.space != space:
            raise ValueError("space: an array's space is its indices (give one or the other)")
        if "method" in self.model_fields_set and self.method != "grid":
            raise ValueError(f"method: an array runs each index once (grid), not {self.method}")
        self.space, self.method = dict(space), "grid"
        if "max_concurrent" not in self.model_fields_set:
            self.max_concurrent = min(len(indices), MAX_CONCURRENT)

    def _templates(self) -> None:
        named = [(f"job.args[{i}]", a) for i, a in enumerate(self.job.args)]
        named += [(f"job.env.{k}", v) for k, v in self.job.env.items()]
        for where, text in named:
            for name in template_names(text):
                if name not in self.space:
                    known = ", ".join(sorted(self.space))[:300]
                    raise ValueError(
                        f"{where}: {{{name}}} is no parameter of the space ({known}); "
                        "write {{ and }} for a literal brace"
                    )

    def grid_size(self) -> int:
        size = 1
        for name, param in self.space.items():
            values = grid_values(param)
            if values is None:
                raise ValueError(
                    f"space.{name}: a grid needs its points: a float takes a step (or make "
                    f"it categorical with its values), and at most {MAX_TRIALS} of them"
                )
            size *= len(values)
            if size > MAX_TRIALS:
                raise ValueError(f"space: the grid has more than {MAX_TRIALS} points")
        return size

    @property
    def limit(self) -> int:
        """How many trials the sweep makes in all."""
        if self.max_trials is not None:
            return self.max_trials
        return self.grid_size()


class ParamPublic(BaseModel):
    """A parameter of the space, as submitted."""

    type: Literal["float", "int", "categorical", "fixed"]
    low: float | int | None = None
    high: float | int | None = None
    log: bool | None = None
    step: float | int | None = None
    values: list[ParamValue] | None = None
    value: ParamValue = None


class EarlyStoppingPublic(BaseModel):
    type: Literal["asha", "median"]
    min_steps: int | None = None
    reduction_factor: int | None = None
    min_early_stopping_rate: int | None = None
    bootstrap_count: int | None = None
    mode: Literal["stop", "pause"] | None = None
    warmup_steps: int | None = None
    interval_steps: int | None = None
    startup_trials: int | None = None
    min_trials: int | None = None


class SweepSpecPublic(BaseModel):
    """A sweep's spec as stored (the seed filled in)."""

    name: str | None = None
    job: JobSpecPublic
    space: dict[str, ParamPublic]
    array: str | None = None
    method: Literal["grid", "random", "tpe"]
    metric: str | None = None
    direction: Literal["minimize", "maximize"]
    max_trials: int | None = None
    max_concurrent: int
    early_stopping: EarlyStoppingPublic | None = None
    seed: int | None = None
    startup_trials: int | None = None


class RungPublic(BaseModel):
    """The metric at a rung a trial reached, as the pruner was told it: the first point
    reported at or after the rung's step."""

    step: int
    value: MetricValue


TrialState = Literal["active", "paused", "complete", "pruned", "failed", "cancelled"]


class TrialPublic(BaseModel):
    number: int
    # Its job (None once the job was purged), the job's status and reason.
    job_id: int | None
    status: str | None
    # Where the sweep has it: active (its job waits or runs), paused (at a rung, its job
    # held until promoted: ASHA's pause mode), complete (it ended with a value), pruned
    # (early stopping stopped it), failed (no value), cancelled.
    state: TrialState
    # 1 for the best complete trial, 2 for the next...; None for the others.
    rank: int | None = None
    params: dict[str, ParamValue]
    # The metric's last value (complete), or where it was pruned; its step.
    value: MetricValue | None = None
    step: int | None = None
    # While active: the metric's latest value and step.
    latest: MetricValue | None = None
    latest_step: int | None = None
    rungs: list[RungPublic] = []
    reason: str | None = None
    created_at: datetime
    finished_at: datetime | None = None


SweepStatus = Literal["running", "done", "cancelled"]


class TrialCounts(BaseModel):
    """A sweep's trials by state."""

    active: int = 0
    paused: int = 0
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    cancelled: int = 0


class SweepPublic(BaseModel):
    id: int
    name: str | None
    owner: str
    status: SweepStatus
    reason: str | None
    spec: SweepSpecPublic
    seed: int
    created_at: datetime
    finished_at: datetime | None
    # Trials made so far of max (a grid's points when not given); by state.
    trials_made: int
    max_trials: int
    counts: TrialCounts
    best: TrialPublic | None
    # GET /sweeps/{id}: every trial, ranked (complete by the metric, then pruned by how
    # far they went, then active, then the others); a listing leaves them out.
    trials: list[TrialPublic] | None = None


class SweepsPublic(BaseModel):
    items: list[SweepPublic]
    next_cursor: str | None
