"""Request and response bodies: one family per resource, validated at the edge.

Every limit here exists so that nothing a client sends reaches the database or a
worker unchecked: bounded integers (no overflow in Postgres), bounded strings,
no coercion of "2" into 2, and unknown fields refused by name.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from ddpq import rules
from ddpq.catalog import recipe_names
from ddpq.rules import entrypoint_problem, env_problem, unsafe_char
from ddpq.snapshot import MAX_PATH_BYTES, entry_problem
from ddpq.wire import NonFinite, decode_number, encode_number
from service.models import AttemptOutcome, JobStatus

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_WORLD_SIZE = 4096
MAX_ARGS = 1000
MAX_ARG_CHARS = 10_000
MAX_ENV_VARS = 200
# One owner for the metric limits: ddpq.train checks them where report() is called.
MAX_METRIC_ITEMS = rules.MAX_METRIC_ITEMS
MAX_METRIC_NAMES = rules.MAX_METRIC_NAMES
MAX_NAME_CHARS = rules.MAX_NAME_CHARS
MAX_PATH_CHARS = 4096

StrictPosInt = Annotated[int, Field(strict=True, ge=1)]
Step = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
TotalSteps = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]


def _printable_name(v: str) -> str:
    if not v.isprintable():
        raise ValueError("must be printable characters (no control or format characters)")
    return v


def _shows_as_text(v: str) -> str:
    bad = unsafe_char(v)
    if bad is not None:
        raise ValueError(
            f"must not contain control or format characters (found {bad!r} at index"
            f" {v.index(bad)}): they act on the terminals that show it"
        )
    return v


# A label people read in tables and terminals: any length-bounded text without
# characters that act on a terminal (ddpq.rules.unsafe_char).
Label = Annotated[str, AfterValidator(_shows_as_text)]

# Sent in an Idempotency-Key header: visible ASCII (spaces inside allowed), 1..200.
# An empty key is refused, not taken as no key: a client that sends one (an unset
# variable) means to be protected from a double submit and would not be.
_IDEMPOTENCY_KEY = re.compile(r"[\x20-\x7e]{1,200}")


def _idempotency_key(v: str) -> str:
    if not _IDEMPOTENCY_KEY.fullmatch(v):
        raise ValueError("must be 1 to 200 printable ASCII characters (a UUID, say)")
    return v


IdempotencyKey = Annotated[str, AfterValidator(_idempotency_key)]


# Any printable unicode (a loss named "損失" round-trips), 1..200 characters.
MetricName = Annotated[
    str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_printable_name)
]
# A metric value on input: a finite JSON number, or one of the three strings for the
# values JSON has no literal for (a diverged loss is information, so it is kept).
# Python's json module would also read bare NaN/Infinity tokens; they are refused so
# that one spelling exists. Answers carry non-finite values the same way, as strings,
# so every answer is valid JSON.
FiniteNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MetricValueIn = FiniteNumber | NonFinite
MetricValue = float | NonFinite


_NUL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")


def _no_nul_or_surrogate(value: Any, where: str = "") -> None:
    """Refuse NUL (Postgres text cannot hold it; C code truncates at it) and lone
    surrogates (not encodable as UTF-8: a database write or answer would fail) in
    every string of a request body, keys included."""
    if isinstance(value, str):
        bad = _NUL_OR_SURROGATE.search(value)
        if bad:
            what = "a NUL character" if bad.group() == "\x00" else "a lone surrogate (not UTF-8)"
            raise ValueError(f"{where or 'a string'} contains {what}")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul_or_surrogate(k, f"a key in {where or 'the body'}")
            _no_nul_or_surrogate(v, f"{where}.{k}" if where else str(k)[:100])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nul_or_surrogate(v, f"{where}[{i}]")


class Strict(BaseModel):
    """Every request body: unknown fields refused, no NUL or lone surrogate anywhere."""

    model_config = ConfigDict(extra="forbid")
    # True where every string field is already held to printable characters or a
    # literal, which refuses NUL and surrogates too: the metric ingest path skips the
    # walk (and it would otherwise run once per nested item).
    _strings_checked: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _clean_strings(cls, data: Any) -> Any:
        if not cls._strings_checked:
            _no_nul_or_surrogate(data)
        return data


# A sha256, as code snapshots and their contents are named.
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256, lower-case hex")]
MAX_PIP_REQUIREMENTS = 100


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

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.recipe is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of 'recipe' and 'entrypoint'")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide world_size ({self.world_size})")
        return self


class JobSpecPublic(BaseModel):
    """A job's spec as stored (JobSpec at its submission), in answers.

    The fields of JobSpec without its validators: a spec that passed them when it was
    submitted must still be shown after a rule tightens (a recipe removed, a variable
    newly reserved). Unknown keys are kept, as stored (a spec written by a newer API
    process during a rolling upgrade); a key missing from an older spec shows its default.
    """

    # Every field is in every answer: required in the document, so a generated client
    # types them without "unset".
    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)

    name: str | None = None
    recipe: str | None = None
    entrypoint: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    world_size: int = 1
    nnodes: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_restarts: int = 0
    max_attempts: int = 3
    retry_on_error: bool = False
    priority: int = 0
    timeout_s: int | None = None
    code: str | None = None
    pip: list[str] = []


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


class CodeSummary(BaseModel):
    """A code snapshot: its id (the manifest's sha256), how many files, how many bytes."""

    id: str
    files: int
    bytes: int


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
    # The code snapshot the program runs among (spec.code), while it is kept.
    code: CodeSummary | None = None
    # How many steps the run takes, as its program last reported it (ddpq.train's
    # report(total_steps=)): the progress bar's end. Kept across attempts.
    total_steps: int | None = None
    # The current attempt's id in the scheduler a bridge handed it to (a Slurm job id).
    external_id: str | None = None
    # Who submitted it (None: from before users existed).
    owner: str | None = None


class JobsPublic(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None


class MetricItemIn(Strict):
    _strings_checked = True  # names: MetricName; values: numbers or NonFinite
    step: Step
    epoch: MetricValueIn | None = None
    # The job's, not a series: how many steps the run takes (the progress bar's end).
    # The job keeps the latest one sent. An older ddpq.train sends it among the
    # values instead; metrics.ingest_metrics takes it from there too.
    total_steps: TotalSteps | None = None
    values: dict[MetricName, MetricValueIn] = Field(default={}, max_length=MAX_METRIC_NAMES)

    @model_validator(mode="after")
    def _values_or_total(self) -> MetricItemIn:
        if not self.values and self.total_steps is None:
            raise ValueError("values: a point needs at least one metric (or a total_steps)")
        return self


class MetricsIn(Strict):
    _strings_checked = True
    items: list[MetricItemIn] = Field(default=[], max_length=MAX_METRIC_ITEMS)
    # Points the sender could not store (its buffer overflowed, or the API refused one
    # alone): added to the job's metrics_dropped, so a loss shows on the job.
    dropped: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0

    @model_validator(mode="after")
    def _something(self) -> MetricsIn:
        if not self.items and not self.dropped:
            raise ValueError("items: send at least one point (or a dropped count)")
        return self


class MetricItemPublic(BaseModel):
    step: int
    epoch: MetricValue | None
    attempt: int
    time: datetime
    values: dict[str, MetricValue | None]


class MetricsPublic(BaseModel):
    items: list[MetricItemPublic]


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


class CheckpointIn(Strict):
    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    step: Step
    epoch: MetricValueIn | None = None
    metrics: dict[MetricName, MetricValueIn] = Field(default={}, max_length=MAX_METRIC_NAMES)


class CheckpointsPublic(BaseModel):
    items: list[CheckpointPublic]


class RecipeArg(BaseModel):
    name: str
    type: Literal["int", "float", "str"]  # recipes._common parses these three
    default: int | float | str | None
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


class Health(BaseModel):
    """GET /healthz: liveness, and whether the database answers."""

    status: Literal["ok", "degraded"]
    database: Literal["ok", "unreachable"]


class Accepted(BaseModel):
    accepted: int


# ---- worker protocol -------------------------------------------------------------

# A host name or an IPv4/IPv6 address (no scheme, no port).
HOST = r"^[A-Za-z0-9.:_%-]+$"
WorkerName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")]
GpuIndex = Annotated[int, Field(strict=True, ge=0, le=1023)]


JobIdIn = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
AttemptNumber = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
# How long a long-poll may wait for something to happen.
WaitS = Annotated[float, Field(strict=True, ge=0, le=60, allow_inf_nan=False)]


# An id another scheduler gave an attempt (a Slurm job id, "81234" or "81234_7").
ExternalId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:+-]+$")]


class RunningAttempt(Strict):
    job_id: JobIdIn
    attempt: AttemptNumber
    # A bridge's attempt: the id its scheduler gave it (stored on the attempt at once,
    # what a restarted bridge re-adopts), and while that scheduler holds it pending,
    # why, in words (the job's reason until it starts).
    external_id: ExternalId | None = None
    pending: Annotated[str | None, Field(min_length=1, max_length=500)] = None


class ClusterShape(Strict):
    """What a bridge to another scheduler hands jobs to: a Slurm partition's nodes (the
    largest node's CPUs and GPUs, as sinfo reports them). A job fits it when each of
    its nodes fits one node and it asks no more nodes than the partition has; Slurm,
    not ddpq, decides when it starts."""

    kind: Literal["slurm"] = "slurm"
    partition: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")]
    nodes: Annotated[int, Field(strict=True, ge=1, le=1_000_000)]
    cpus_per_node: Annotated[int, Field(strict=True, ge=1, le=100_000)]
    gpus_per_node: Annotated[int, Field(strict=True, ge=0, le=1024)] = 0
    # How many of its jobs the bridge lets wait in Slurm at once: the rest wait in
    # ddpq's queue, in ddpq's order.
    max_pending: Annotated[int, Field(strict=True, ge=1, le=100_000)] = 1


# worker.datadir's identity: 32 hex digits, kept in the worker's data dir.
WorkerIdentity = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class WorkerRegister(Strict):
    name: WorkerName
    # Optional for workers of earlier versions, which get no protection from a twin.
    identity: WorkerIdentity | None = None
    hostname: Annotated[Label, Field(max_length=255)]
    cpu_slots: Annotated[int, Field(strict=True, ge=0, le=100_000)]
    gpus: Annotated[list[GpuIndex], Field(max_length=1024)]
    checkpoint_root: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    # What this worker process still runs (empty when it has just started): any other
    # attempt the service has on its books for this name died with an earlier process.
    running: Annotated[list[RunningAttempt], Field(max_length=10_000)] = []
    # A bridge to a Slurm partition instead of a worker that runs jobs itself. A bridge
    # keeps its attempts across its restarts (they run in Slurm, not in its process):
    # the reply lists them for it to re-adopt, and `running` releases nothing.
    cluster: ClusterShape | None = None


class ClaimRequest(Strict):
    name: WorkerName
    free_cpu_slots: Annotated[int, Field(strict=True, ge=0, le=100_000)]
    free_gpus: Annotated[list[GpuIndex], Field(max_length=1024)]
    wait_s: WaitS = 20.0
    # Where the other nodes of a multi-node job reach this worker, and a port free on
    # it for torchrun's rendezvous store should it be node 0. Without both, the worker
    # is offered single-node jobs only.
    advertise_addr: Annotated[str | None, Field(min_length=1, max_length=255, pattern=HOST)] = None
    rdzv_port: Annotated[int | None, Field(strict=True, ge=1, le=65535)] = None


class GangRequest(Strict):
    name: WorkerName
    job_id: JobIdIn
    attempt: AttemptNumber
    wait_s: WaitS = 20.0
    # Give the slot back instead (a worker shutting down while the gang forms).
    leave: Annotated[bool, Field(strict=True)] = False


class Heartbeat(Strict):
    name: WorkerName
    identity: WorkerIdentity | None = None
    running: Annotated[list[RunningAttempt], Field(max_length=10_000)] = []
    # Jobs whose working directories the worker keeps: the reply says which have ended.
    kept: Annotated[list[JobIdIn], Field(max_length=10_000)] = []


class FinishRequest(Strict):
    attempt: AttemptNumber
    exit_code: Annotated[int | None, Field(strict=True, ge=-255, le=INT32_MAX)] = None
    # exited: the program ended by itself; cancelled: the worker stopped it on request;
    # timeout: it ran past timeout_s; requeue: the worker is shutting down; lost: the
    # scheduler a bridge hands jobs to ended it (node failure, preemption, a cancel from
    # outside ddpq): as when a worker is lost, it is retried at once while attempts remain.
    outcome: Literal["exited", "cancelled", "timeout", "requeue", "error", "lost"] = "exited"
    reason: Annotated[str | None, Field(max_length=4000)] = None


class WorkerJob(BaseModel):
    job_id: int
    name: str | None
    status: JobStatus
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
    # A Slurm bridge: the partition it hands jobs to.
    cluster: ClusterShape | None = None


class WorkersPublic(BaseModel):
    items: list[WorkerPublic]


class LogAppended(BaseModel):
    next_offset: int


# ---- code snapshots ---------------------------------------------------------------------


class ManifestEntry(Strict):
    """A file (digest, size, executable) or a symlink (target) of a code snapshot."""

    # In characters, a bound before the rules (entry_problem) count the bytes.
    path: Annotated[str, Field(max_length=MAX_PATH_BYTES)]
    digest: Digest | None = None
    size: Annotated[int | None, Field(strict=True, ge=0, le=INT64_MAX)] = None
    executable: Annotated[bool, Field(strict=True)] = False
    symlink: Annotated[str | None, Field(max_length=MAX_PATH_BYTES)] = None


class ManifestEntryIn(ManifestEntry):
    """An entry of a manifest being stored: it keeps every rule of ddpq.snapshot. (An
    answer is not checked again: a snapshot stored before a rule was added is served as
    it is, and the worker, which checks every entry before it writes, refuses it.)"""

    @model_validator(mode="after")
    def _file_or_symlink(self) -> ManifestEntryIn:
        problem = entry_problem(self.model_dump(exclude_none=True))
        if problem:
            raise ValueError(problem)
        return self


class SnapshotIn(Strict):
    """POST /code/snapshots: a manifest whose contents are all uploaded."""

    files: Annotated[list[ManifestEntryIn], Field(min_length=1, max_length=1_000_000)]


class SnapshotPublic(CodeSummary):
    manifest: list[ManifestEntry]


class MissingRequest(Strict):
    """POST /code/missing: the contents a snapshot will need."""

    digests: Annotated[list[Digest], Field(max_length=1_000_000)]


class MissingReply(BaseModel):
    missing: list[str]


class CodeLimits(BaseModel):
    """What one snapshot may hold (DDPQ_CODE_MAX_FILES, _BYTES, _FILE_BYTES)."""

    max_files: int
    max_bytes: int
    max_file_bytes: int


# ---- errors -----------------------------------------------------------------------------


class ErrorItem(BaseModel):
    """One invalid field: where (body, query, path or header, then its name), why, and
    pydantic's error type."""

    loc: list[str | int]
    msg: str
    type: str


class Error(BaseModel):
    """An error answer (a 422 has FastAPI's HTTPValidationError instead): what went
    wrong, in words, or, for a code snapshot over a limit (413), the field as a 422
    names it."""

    detail: str | list[ErrorItem]


def metric_out(value: float | None) -> MetricValue:
    """A stored metric value as JSON can carry it (NULL is NaN, see MetricPoint)."""
    return "NaN" if value is None else encode_number(value)


def metric_in(value: float | str) -> float:
    return decode_number(value)


# ---- people ---------------------------------------------------------------------------


UserName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class UserIn(Strict):
    """POST /users: a new user (its name is checked by service.users.name_problem)."""

    name: UserName
    role: Literal["admin", "member"] = "member"


class UserPublic(BaseModel):
    name: str
    role: Literal["admin", "member"]
    # The token's first characters (never the token): to tell tokens apart.
    token_hint: str
    created_at: datetime
    revoked_at: datetime | None


class UserWithToken(UserPublic):
    """A user and its token: the only answer that ever holds it (add, rotate)."""

    token: str


class UsersPublic(BaseModel):
    items: list[UserPublic]


class WhoAmI(BaseModel):
    name: str
    role: Literal["admin", "member"]


class AuditEventPublic(BaseModel):
    id: int
    at: datetime
    actor: str
    # submit, cancel, user.add, user.revoke, user.rotate
    action: str
    target: str
    detail: dict[str, Any]


class AuditPublic(BaseModel):
    items: list[AuditEventPublic]
    next_cursor: str | None


class UserUsagePublic(BaseModel):
    """What one user holds and used (GET /usage)."""

    user: str
    running: int
    queued: int
    # GPU-hours and CPU-slot-hours their attempts held over the last day and week
    gpu_hours_1d: float
    gpu_hours_7d: float
    cpu_slot_hours_1d: float
    cpu_slot_hours_7d: float
    # What fair share orders by: GPU-equivalent seconds (a CPU slot counts
    # DDPQ_CPU_SLOT_WEIGHT of a GPU), decayed with DDPQ_FAIRSHARE_HALF_LIFE_S
    usage_gpu_s: float


class UsagePublic(BaseModel):
    items: list[UserUsagePublic]


QuotaLimit = Annotated[int | None, Field(strict=True, ge=0, le=1_000_000)]


class QuotaIn(Strict):
    """PUT /quotas/{name}: a user's limits (null: no limit)."""

    max_gpus: QuotaLimit = None
    max_running: QuotaLimit = None
    max_queued: QuotaLimit = None


class QuotaPublic(BaseModel):
    # A user's name, or "*": everyone's default (a user's own row wins whole)
    user: str
    max_gpus: int | None
    max_running: int | None
    max_queued: int | None


class QuotasPublic(BaseModel):
    items: list[QuotaPublic]
