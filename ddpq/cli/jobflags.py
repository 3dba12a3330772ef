"""The flags submit and resubmit share (each overrides the spec's field of its name, or
adds to its list) and how they are read into a spec."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ddpq.cli.spec import _parse_env

# Flags submit and resubmit share: each overrides the spec's field of its name.
Name = Annotated[str | None, typer.Option(help="a name to find the job by")]
WorldSize = Annotated[int | None, typer.Option(help="total ranks (default 1)")]
Nnodes = Annotated[int | None, typer.Option(help="nodes (default 1)")]
Device = Annotated[
    str | None, typer.Option(metavar="auto|cpu|cuda", help="where the ranks run (default auto)")
]
Priority = Annotated[int | None, typer.Option(help="higher first (default 0)")]
MaxAttempts = Annotated[int | None, typer.Option(help="(default 3)")]
MaxRestarts = Annotated[int | None, typer.Option(help="(default 0)")]
RetryOnError = Annotated[
    bool | None,
    typer.Option(
        "--retry-on-error/--no-retry-on-error",
        help="retry exits 1..127 too (signals are always retried) (default no)",
        show_default=False,
    ),
]
TimeoutS = Annotated[int | None, typer.Option(help="stop the job after this many seconds")]
KeepLast = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="keep the newest N checkpoints while it runs, deleting older ones (0: all;"
        " default: the server's, DDPQ_KEEP_LAST); see `ddpq checkpoints`",
    ),
]
Launcher = Annotated[
    str | None,
    typer.Option(
        help="torchrun (a cold torchrun) or warm (forked from a process with torch imported: "
        "seconds faster to start; docs/jobs.md) (default: the worker's)",
    ),
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option(metavar="KEY=VALUE", help="an environment variable for the ranks (repeatable)"),
]
PipOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--pip", metavar="REQUIREMENT", help="a Python requirement for the job (repeatable)"
    ),
]
SecretOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--secret",
        metavar="NAME",
        help="one of your secrets (`ddpq secrets set NAME`) for the ranks, as the variable "
        "NAME; its value is shown to no one (repeatable)",
    ),
]
AfterOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--after",
        metavar="JOB[:ok|:any]",
        help="start once job JOB succeeded (ok, the default) or ended however (any); one "
        "that can never be met fails the job (repeatable)",
    ),
]
ForkOpt = Annotated[
    str | None,
    typer.Option(
        "--from-checkpoint",
        metavar="JOB[:STEP]",
        help="start from job JOB's checkpoint (at STEP; its newest kept one by default), "
        "however it ended, on any worker: its ranks resume from it",
    ),
]
ArrayOpt = Annotated[
    str | None,
    typer.Option(
        "--array",
        metavar="INDICES[%N]",
        help="a job array, as Slurm's: a task per index (0-31, 0-15:4, 1,3,5-7), each "
        "seeing its own in DDPQ_ARRAY_INDEX and as {index} in its args; %N runs at most N "
        "at once",
    ),
]
Wait = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="follow the job until it ends (the live view on a terminal, a line per change"
        " otherwise); exit 4 unless it succeeded, 5 at once if no worker can ever run it",
    ),
]
Strict = Annotated[
    bool,
    typer.Option(
        "--strict", help="refuse, rather than queue, a job no registered worker could ever run"
    ),
]
Args = Annotated[list[str] | None, typer.Argument(help="arguments for the program, after --")]


# The flags submit and resubmit share that override the spec field of their name.
SPEC_FLAGS = (
    "name", "world_size", "nnodes", "device", "priority", "max_attempts", "max_restarts",
    "retry_on_error", "timeout_s", "keep_last", "launcher",
)  # fmt: skip


def _after(given: str) -> dict[str, Any]:
    """``12``, ``12:ok`` or ``12:any`` as the spec's dependency."""
    job, _, when = given.partition(":")
    if not job.isascii() or not job.isdigit() or int(job) < 1 or when not in ("", "ok", "any"):
        raise typer.BadParameter(f"{given!r}: give JOB, JOB:ok or JOB:any", param_hint="--after")
    return {"job": int(job), "when": when or "ok"}


def _fork(given: str) -> dict[str, Any]:
    """``12`` or ``12:400`` as the spec's from_checkpoint."""
    job, colon, step = given.partition(":")
    if not (job.isascii() and job.isdigit() and int(job) >= 1) or (
        colon and not (step.isascii() and step.isdigit())
    ):
        raise typer.BadParameter(f"{given!r}: give JOB or JOB:STEP", param_hint="--from-checkpoint")
    return {"job": int(job), **({"step": int(step)} if colon else {})}


def _override(
    spec: dict[str, Any],
    flags: dict[str, Any],
    args: Any,
    env: Any,
    pip: Any,
    secret: Any = None,
    after: Any = None,
) -> None:
    """Flags given on the command line override the spec's fields; --env, --pip,
    --secret and --after add to its lists."""
    spec.update({k: v for k, v in flags.items() if v is not None})
    if args:
        spec["args"] = list(args)
    if env:
        old = spec.get("env")
        spec["env"] = {**(old if isinstance(old, dict) else {}), **_parse_env(env)}
    if pip:
        old = spec.get("pip")
        spec["pip"] = [*(old if isinstance(old, list) else []), *pip]
    if secret:
        old = spec.get("secrets")
        had = old if isinstance(old, list) else []
        spec["secrets"] = [*had, *(n for n in dict.fromkeys(secret) if n not in had)]
    if after:
        old = spec.get("after")
        deps = {d["job"]: d for d in (old if isinstance(old, list) else []) if isinstance(d, dict)}
        deps.update({d["job"]: d for d in map(_after, after)})
        spec["after"] = list(deps.values())
