"""Jobs: JobSpec (what to run, the body of POST /jobs) and the views of a job, its
attempts and its checkpoints, with the limits a spec is held to. A stored spec's view
(JobSpecPublic) is ddpq.jobspec's, shared with the worker."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from ddpq.catalog import recipe_names

# The stored spec's view is ddpq's: the worker reads a claim's spec through it too.
from ddpq.jobspec import JobSpecPublic, ParamValue
from ddpq.messages import INT64_MAX, MAX_PATH_CHARS, Digest, Label, Strict
from ddpq.rules import (
    MAX_ARRAY_INDEX,
    MAX_JOB_SECRETS,
    entrypoint_problem,
    env_problem,
    params_problem,
    rungs_problem,
    secret_name_problem,
)
from service.models import AttemptOutcome, CheckpointKind, CheckpointState, JobStatus
from service.schemas.code import CodeSummary
from service.schemas.common import MAX_NAME_CHARS
from service.schemas.metrics import (
    MAX_METRIC_NAMES,
    LatestMetrics,
    MetricName,
    MetricValue,
    MetricValueIn,
    Step,
)

MAX_WORLD_SIZE = 4096
MAX_ARGS = 1000
MAX_ARG_CHARS = 10_000
MAX_ENV_VARS = 200
MAX_PIP_REQUIREMENTS = 100
MAX_KEEP_LAST = 1_000_000

# Sent in an Idempotency-Key header: visible ASCII (spaces inside allowed), 1..200.
# An empty key is refused, not taken as no key: a client that sends one (an unset
# variable) means to be protected from a double submit and would not be.
_IDEMPOTENCY_KEY = re.compile(r"[\x20-\x7e]{1,200}")


def _idempotency_key(v: str) -> str:
    if not _IDEMPOTENCY_KEY.fullmatch(v):
        raise ValueError("must be 1 to 200 printable ASCII characters (a UUID, say)")
    return v


IdempotencyKey = Annotated[str, AfterValidator(_idempotency_key)]


def _pip_requirement(v: str) -> str:
    if v.startswith("-"):
        raise ValueError(
            f"{v[:100]!r} is an option, not a requirement: put pip options in the code's "
            "requirements.txt"
        )
    if not v.isprintable():
        raise ValueError("a requirement has printable characters only")
    return v


PipRequirement = Annotated[
    str, Field(min_length=1, max_length=500), AfterValidator(_pip_requirement)
]

MAX_DEPENDENCIES = 16  # jobs one job waits for


class Dependency(Strict):
    """A job this one starts after (``ddpq submit --after 12:ok``): ``ok`` once it
    succeeded, ``any`` once it ended however it ended. A dependency that can never be
    met (``ok`` of a job that failed or was cancelled) fails the job, as Slurm's
    DependencyNeverSatisfied."""

    job: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    when: Literal["ok", "any"] = "ok"


class ForkFrom(Strict):
    """The checkpoint a job starts from: job ``job``'s at ``step`` (its newest kept one
    when not given; the submit fills the step in)."""

    job: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    step: Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)] | None = None


class JobSpec(Strict):
    """What to run: the body of POST /jobs."""

    name: Annotated[Label | None, Field(max_length=MAX_NAME_CHARS)] = None
    recipe: str | None = None
    entrypoint: Annotated[str | None, Field(min_length=1, max_length=MAX_PATH_CHARS)] = None
    args: Annotated[
        list[Annotated[str, Field(max_length=MAX_ARG_CHARS)]], Field(max_length=MAX_ARGS)
    ] = []
    env: dict[str, Annotated[str, Field(max_length=MAX_ARG_CHARS)]] = {}
    world_size: Annotated[int, Field(strict=True, ge=1, le=MAX_WORLD_SIZE)] = 1
    nnodes: Annotated[int, Field(strict=True, ge=1, le=MAX_WORLD_SIZE)] = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_restarts: Annotated[int, Field(strict=True, ge=0, le=100)] = 0
    max_attempts: Annotated[int, Field(strict=True, ge=1, le=100)] = 3
    # Retry attempts that fail with the program's own error (exit code 1..127) too.
    retry_on_error: Annotated[bool, Field(strict=True)] = False
    priority: Annotated[int, Field(strict=True, ge=-1_000_000, le=1_000_000)] = 0
    timeout_s: Annotated[int | None, Field(strict=True, ge=1, le=365 * 24 * 3600)] = None
    # A code snapshot (POST /code/snapshots) the program runs among: each worker that
    # runs the job materialises it as the job's own working directory, and an
    # entrypoint is a path inside it.
    code: Digest | None = None
    # Python requirements for this job, installed (with a requirements.txt at the top
    # of its code snapshot, if any) into a virtualenv layered on the worker's own.
    pip: Annotated[list[PipRequirement], Field(max_length=MAX_PIP_REQUIREMENTS)] = []
    # How many of the job's newest checkpoints stay while it runs (0: all; None: the
    # server's DDPQ_KEEP_LAST); older ones are deleted as new ones register, except those
    # saved with keep=True and the one a resume would use (service.checkpoints).
    keep_last: Annotated[int | None, Field(strict=True, ge=0, le=MAX_KEEP_LAST)] = None
    # How the worker starts the ranks: a cold torchrun, or forked from a warm process with
    # torch imported (what differs is in docs/training.md). None: the worker's
    # default (its DDPQ_LAUNCHER).
    launcher: Literal["torchrun", "warm"] | None = None
    # The names of its owner's secrets (PUT /secrets/{name}) its ranks get as environment
    # variables of those names: the names are part of the spec everyone reads, the values
    # never (service.secrets). Each must be one its owner has when it is submitted.
    secrets: Annotated[list[str], Field(max_length=MAX_JOB_SECRETS)] = []
    # Parameters its ranks read as JSON in DDPQ_PARAMS (ddpq.train.params()): what a
    # sweep chose for its trial (service.sweeps), or any job's own.
    params: dict[str, ParamValue] = {}
    # Jobs it starts after (service.queue.deps): each must exist when it is submitted.
    after: Annotated[list[Dependency], Field(max_length=MAX_DEPENDENCIES)] = []
    # Its index in a job array (a sweep over ``index``: service.sweeps), which its ranks
    # read in DDPQ_ARRAY_INDEX; any job may carry one (a task of an array rerun by hand).
    array_index: Annotated[int | None, Field(strict=True, ge=0, le=MAX_ARRAY_INDEX)] = None
    # The checkpoint its ranks start from, another job's, however that job ended
    # (service.queue.forks: sent through the API from the worker that holds it).
    from_checkpoint: ForkFrom | None = None
    # The steps at which its sweep judges it (ddpq.rules.rungs_problem has the rule): set
    # by the sweep for a trial with early stopping; its reporter asks for each judgment
    # as it reaches the step. On any other job it changes nothing.
    rungs: list[Annotated[int, Field(strict=True)]] = []

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, v: str | None) -> str | None:
        if v is not None and v not in recipe_names():
            raise ValueError(
                f"unknown recipe {v[:100]!r}; GET /recipes lists: {', '.join(recipe_names())}"
            )
        return v

    @field_validator("entrypoint")
    @classmethod
    def _relative_path(cls, v: str | None) -> str | None:
        problem = None if v is None else entrypoint_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("env")
    @classmethod
    def _allowed_env(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_ENV_VARS:
            raise ValueError(f"at most {MAX_ENV_VARS} variables")
        for key, value in v.items():
            problem = env_problem(key, value)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        for name in v:
            problem = secret_name_problem(name)
            if problem:
                raise ValueError(problem)
        if len(set(v)) != len(v):
            raise ValueError("a secret is named twice")
        return v

    @field_validator("rungs")
    @classmethod
    def _rungs(cls, v: list[int]) -> list[int]:
        problem = rungs_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("params")
    @classmethod
    def _params(cls, v: dict[str, ParamValue]) -> dict[str, ParamValue]:
        problem = params_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.recipe is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of 'recipe' and 'entrypoint'")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide world_size ({self.world_size})")
        if len({d.job for d in self.after}) != len(self.after):
            raise ValueError("after: a job is named twice")
        both = sorted(set(self.secrets) & set(self.env))
        if both:
            raise ValueError(
                f"{', '.join(both)[:200]} is both a secret and in env: give it one way "
                "(a secret's value is seen by its ranks only; env by everyone)"
            )
        return self


FileBytes = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]


class CheckpointIn(Strict):
    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    step: Step
    epoch: MetricValueIn | None = None
    metrics: dict[MetricName, MetricValueIn] = Field(default={}, max_length=MAX_METRIC_NAMES)
    # save_checkpoint(keep=True): never pruned by keep_last.
    keep: Annotated[bool, Field(strict=True)] = False
    # The file once written, as rank 0 saw it: its size, and its mtime, which its worker
    # checks before deleting it (a file written again since under the name is left); a
    # directory's stamp (ddpq.wire.tree_stamp), which its worker checks the same way.
    bytes: FileBytes | None = None
    mtime_ns: FileBytes | None = None
    # A directory a framework wrote (ddpq.train.register_checkpoint), or a file.
    kind: CheckpointKind = "file"


class CheckpointPublic(BaseModel):
    id: int
    path: str
    step: int
    epoch: MetricValue | None
    attempt: int
    created_at: datetime
    metrics: dict[str, MetricValue | None]
    # Retention (docs/checkpoints.md): saved with keep=True; its size as rank 0 reported
    # it; kept, pruning (chosen to go, not yet deleted), pruned or refused (its worker
    # would not delete it), why in ``note``; when its worker deleted it (or refused to);
    # when it will go (its job ended: the job's end plus the checkpoint retention; None
    # while the job runs, or with no retention).
    keep: bool = False
    bytes: int | None = None
    state: CheckpointState = "kept"
    note: str | None = None
    pruned_at: datetime | None = None
    expires_at: datetime | None = None
    worker: str | None = None
    kind: CheckpointKind = "file"  # a file, or a directory a framework wrote
    # Sent to the API (a fork or a download asked for it, service.queue.forks): the
    # code snapshot that holds it once sent, or why its worker could not send it; asked
    # and not yet sent while ``sending``.
    snapshot: str | None = None
    sending: bool = False
    send_problem: str | None = None


class CheckpointsPublic(BaseModel):
    items: list[CheckpointPublic]


class JobPublic(BaseModel):
    id: int
    name: str | None
    status: JobStatus
    spec: JobSpecPublic
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    exit_code: int | None
    reason: str | None
    worker: str | None
    gpus: list[int] | None
    latest_metrics: LatestMetrics | None
    latest_checkpoint: CheckpointPublic | None
    queue_position: int | None
    # Metric points reported but never stored (ddpq.train's buffer overflowed during a
    # long outage, or a point was refused): 0 when every point made it.
    metrics_dropped: int = 0
    # History retention (DDPQ_METRICS_DOWNSAMPLE_AFTER, DDPQ_LOG_RETENTION): points its
    # long series lost to downsampling once it had ended (each bucket's lowest and
    # highest point stay), and when; when its log was deleted. 0 and None: all kept.
    metrics_downsampled: int = 0
    metrics_downsampled_at: datetime | None = None
    log_dropped_at: datetime | None = None
    # The code snapshot the program runs among (spec.code), while it is kept.
    code: CodeSummary | None = None
    # How many steps the run takes, as its program last reported it (ddpq.train's
    # report(total_steps=)): the progress bar's end. Kept across attempts.
    total_steps: int | None = None
    # The current attempt's id in the scheduler a bridge handed it to (a Slurm job id).
    external_id: str | None = None
    # Who submitted it (None: from before users existed).
    owner: str | None = None
    # The priority the queue and preemption go by: the spec's, or lower if its owner's
    # cap (quota max_priority) was lowered since.
    priority: int = 0


class JobsPublic(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None


class AttemptPublic(BaseModel):
    number: int
    worker: str
    gpus: list[int]
    started_at: datetime
    finished_at: datetime | None
    exit_code: int | None
    outcome: AttemptOutcome
    reason: str | None
    # The Slurm job id of an attempt a Slurm bridge ran.
    external_id: str | None = None


class AttemptsPublic(BaseModel):
    items: list[AttemptPublic]


class JobChange(Strict):
    """PATCH /jobs/{id}: what to change of a queued or held job (service.holds). A field
    left out stays as it is; ``timeout_s`` 0 lifts the time limit."""

    priority: Annotated[int | None, Field(strict=True, ge=-1_000_000, le=1_000_000)] = None
    timeout_s: Annotated[int | None, Field(strict=True, ge=0, le=365 * 24 * 3600)] = None
    world_size: Annotated[int | None, Field(strict=True, ge=1, le=MAX_WORLD_SIZE)] = None

    @model_validator(mode="after")
    def _something(self) -> JobChange:
        if self.priority is None and self.timeout_s is None and self.world_size is None:
            raise ValueError("give at least one of priority, timeout_s and world_size")
        return self
