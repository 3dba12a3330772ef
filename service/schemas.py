"""Request and response bodies: one family per resource, validated at the edge.

Every limit here exists so that nothing a client sends reaches the database or a
worker unchecked: bounded integers (no overflow in Postgres), bounded strings,
no coercion of "2" into 2, and unknown fields refused by name.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.catalog import recipe_names

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_WORLD_SIZE = 4096
MAX_ARGS = 1000
MAX_ARG_CHARS = 10_000
MAX_ENV_VARS = 200
MAX_METRIC_ITEMS = 1000
MAX_METRIC_NAMES = 100
MAX_NAME_CHARS = 200
MAX_PATH_CHARS = 4096

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Set by ddpq, torchrun or the CUDA runtime for the job, or able to subvert the
# interpreter the ranks run in: a job's env must not override them.
RESERVED_ENV_PREFIXES = ("DDPQ_", "TORCHELASTIC_", "TORCH_ELASTIC_", "LD_", "PYTHON")
RESERVED_ENV_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "PATH",
        "HOME",
    }
)

StrictPosInt = Annotated[int, Field(strict=True, ge=1)]
Step = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
MetricName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
NonFinite = Literal["NaN", "Infinity", "-Infinity"]
# A metric value: a JSON number, or one of the strings JSON lacks literals for.
MetricValue = float | NonFinite


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobSpec(Strict):
    """What to run: the body of POST /jobs."""

    name: Annotated[str | None, Field(max_length=MAX_NAME_CHARS)] = None
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
        if v is None:
            return v
        if "\x00" in v or any(ord(c) < 32 for c in v):
            raise ValueError("must not contain control characters")
        if v.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", v):
            raise ValueError("must be a path relative to the worker's workspace")
        if ".." in re.split(r"[\\/]", v):
            raise ValueError("must not contain '..'")
        return v

    @field_validator("env")
    @classmethod
    def _allowed_env(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_ENV_VARS:
            raise ValueError(f"at most {MAX_ENV_VARS} variables")
        for key, value in v.items():
            if not ENV_NAME.match(key):
                raise ValueError(f"{key[:100]!r} is not a valid variable name")
            upper = key.upper()
            if upper in RESERVED_ENV_NAMES or upper.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"{key} is set by ddpq, torchrun or CUDA and cannot be overridden")
            if "\x00" in value:
                raise ValueError(f"the value of {key} contains a NUL byte")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.recipe is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of 'recipe' and 'entrypoint'")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide world_size ({self.world_size})")
        return self


class CheckpointPublic(BaseModel):
    id: int
    path: str
    step: int
    epoch: MetricValue | None
    attempt: int
    created_at: datetime
    metrics: dict[str, MetricValue | None]


class LatestMetrics(BaseModel):
    step: int
    epoch: MetricValue | None
    values: dict[str, MetricValue | None]


class JobPublic(BaseModel):
    id: int
    name: str | None
    status: str
    spec: dict[str, Any]
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


class JobsPublic(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None


class MetricItemIn(Strict):
    step: Step
    epoch: MetricValue | None = None
    values: dict[MetricName, MetricValue] = Field(min_length=1, max_length=MAX_METRIC_NAMES)


class MetricsIn(Strict):
    items: list[MetricItemIn] = Field(min_length=1, max_length=MAX_METRIC_ITEMS)


class MetricItemPublic(BaseModel):
    step: int
    epoch: MetricValue | None
    attempt: int
    time: datetime
    values: dict[str, MetricValue | None]


class MetricsPublic(BaseModel):
    items: list[MetricItemPublic]


class CheckpointIn(Strict):
    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    step: Step
    epoch: MetricValue | None = None
    metrics: dict[MetricName, MetricValue] = Field(default={}, max_length=MAX_METRIC_NAMES)


class CheckpointsPublic(BaseModel):
    items: list[CheckpointPublic]


class RecipeArg(BaseModel):
    name: str
    type: str
    default: Any
    help: str
    # Bounds and choices the recipe enforces (its arguments fail the job otherwise).
    min: int | float | None = None
    max: int | float | None = None
    choices: list[str] | None = None


class RecipePublic(BaseModel):
    name: str
    description: str
    args: list[RecipeArg]


class RecipesPublic(BaseModel):
    items: list[RecipePublic]


class Accepted(BaseModel):
    accepted: int


# ---- worker protocol -------------------------------------------------------------

WorkerName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")]
GpuIndex = Annotated[int, Field(strict=True, ge=0, le=1023)]


class RunningAttempt(Strict):
    job_id: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    attempt: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]


class WorkerRegister(Strict):
    name: WorkerName
    hostname: Annotated[str, Field(max_length=255)]
    cpu_slots: Annotated[int, Field(strict=True, ge=0, le=100_000)]
    gpus: Annotated[list[GpuIndex], Field(max_length=1024)]
    checkpoint_root: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    # What this worker process still runs (empty when it has just started): any other
    # attempt the service has on its books for this name died with an earlier process.
    running: Annotated[list[RunningAttempt], Field(max_length=10_000)] = []


class WorkerRegistered(BaseModel):
    name: str
    heartbeat_s: float
    lease_s: float


class ClaimRequest(Strict):
    name: WorkerName
    free_cpu_slots: Annotated[int, Field(strict=True, ge=0, le=100_000)]
    free_gpus: Annotated[list[GpuIndex], Field(max_length=1024)]
    wait_s: Annotated[float, Field(ge=0, le=60)] = 20.0


class ClaimedJob(BaseModel):
    job_id: int
    attempt: int
    token: str
    spec: dict[str, Any]
    device: Literal["cpu", "cuda"]
    nproc_per_node: int
    gpus: list[int]
    checkpoint_dir: str
    # Newest first; the worker gives ranks the first one whose file exists.
    resume_from: list[str]


class Heartbeat(Strict):
    name: WorkerName
    running: Annotated[list[RunningAttempt], Field(max_length=10_000)] = []


class HeartbeatReply(BaseModel):
    # Attempts the worker must stop: cancelled by a user, or no longer theirs.
    cancel: list[RunningAttempt]
    abandon: list[RunningAttempt]


class FinishRequest(Strict):
    attempt: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
    exit_code: Annotated[int | None, Field(strict=True, ge=-255, le=INT32_MAX)] = None
    # exited: the program ended by itself; cancelled: the worker stopped it on request;
    # timeout: it ran past timeout_s; requeue: the worker is shutting down.
    outcome: Literal["exited", "cancelled", "timeout", "requeue", "error"] = "exited"
    reason: Annotated[str | None, Field(max_length=4000)] = None


class WorkerJob(BaseModel):
    job_id: int
    name: str | None
    status: str
    attempt: int
    nproc_per_node: int
    gpus: list[int]


class WorkerPublic(BaseModel):
    name: str
    hostname: str
    cpu_slots: int
    gpus: list[int]
    free_cpu_slots: int
    free_gpus: list[int]
    alive: bool  # heart-beaten within the lease
    last_heartbeat: datetime
    registered_at: datetime
    running: list[WorkerJob]


class WorkersPublic(BaseModel):
    items: list[WorkerPublic]


class LogAppended(BaseModel):
    next_offset: int


def metric_out(value: float | None) -> MetricValue:
    """A stored metric value as JSON can carry it (NULL is NaN, see MetricPoint)."""
    if value is None:
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if math.isnan(value):
        return "NaN"
    return value


def metric_in(value: float | str) -> float:
    if isinstance(value, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[value]
    return value
