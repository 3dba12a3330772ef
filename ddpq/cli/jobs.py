"""Inspecting, listing and cancelling jobs: status, ls, cancel (submitting is
ddpq.cli.submit)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ddpq.cli.base import (
    EXIT_JOB_FAILED,
    EXIT_USAGE,
    JsonOpt,
    _age,
    _client,
    _fail,
    _fit_table,
    _gpu_use,
    _loss,
    _print_json,
    _print_table,
    _program,
    _say,
    _text,
    _waiting,
    client_command,
    out,
)
from ddpq.client import Client
from ddpq.errors import ApiRefused
from ddpq.snapshot import file_count, human_bytes


def _where(job: dict[str, Any]) -> str:
    """The job's worker, and its Slurm job id when a Slurm bridge runs it."""
    worker = job.get("worker") or ""
    external = job.get("external_id")
    return f"{worker} (Slurm job {external})" if worker and external else worker


@client_command()
def status(job_id: int, as_json: JsonOpt = False) -> None:
    """Show one job. Exits 0 unless it failed or was cancelled (4)."""
    with _client() as c:
        job = c.job(job_id)
        # GPU use only where a GPU was held (a CPU job asks nothing more).
        gpus = _job_gpus(c, job_id) if job["gpus"] and not as_json else []
    if as_json:
        _print_json(job)
    else:
        fields = [
            ("id", job["id"]),
            ("name", job["name"] or ""),
            ("owner", _owner(job)),
            ("status", job["status"]),
            ("program", _program(job)),
            ("world size", job["spec"]["world_size"]),
            ("attempt", job["attempt"]),
            ("worker", _where(job)),
            ("gpus", ",".join(map(str, job["gpus"] or [])) or "-"),
            ("created", job["created_at"]),
            ("started", job["started_at"] or ""),
            ("finished", job["finished_at"] or ""),
            ("exit code", "" if job["exit_code"] is None else job["exit_code"]),
            ("reason", job["reason"] or ""),
            ("queue position", job["queue_position"] or ""),
        ]
        m = job.get("latest_metrics")
        if m:
            values = ", ".join(
                f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in m["values"].items()
            )
            of = f" of {job['total_steps']}" if job.get("total_steps") else ""
            fields.append(("latest", f"step {m['step']}{of}: {values}"))
        if job.get("code"):
            snap = job["code"]
            size = f"{file_count(snap['files'])}, {human_bytes(snap['bytes'])}"
            fields.append(("code", f"{snap['id'][:12]} ({size})"))
        if job.get("latest_checkpoint"):
            fields.append(("checkpoint", job["latest_checkpoint"]["path"]))
        if job.get("metrics_dropped"):
            fields.append(("metrics lost", f"{job['metrics_dropped']} points never stored"))
        if job.get("metrics_downsampled"):
            fields.append(
                (
                    "metrics",
                    f"downsampled {job['metrics_downsampled_at'][:10]}: "
                    f"{job['metrics_downsampled']} points of long series removed "
                    "(each bucket's lowest and highest kept)",
                )
            )
        if job.get("log_dropped_at"):
            fields.append(("log", f"deleted {job['log_dropped_at'][:10]} (log retention)"))
        fields += _gpu_lines(job, gpus)
        _print_fields([(key, str(value)) for key, value in fields if value != ""])
    if job["status"] in ("failed", "cancelled"):
        raise typer.Exit(EXIT_JOB_FAILED)


def _job_gpus(c: Client, job_id: int) -> list[dict[str, Any]]:
    """The job's GPU use; none from a service of an earlier version (no such route)."""
    try:
        return c.job_gpus(job_id)
    except ApiRefused as exc:
        if exc.status == 404:
            return []
        raise


def _gpu_lines(job: dict[str, Any], gpus: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A line per GPU of the job's current attempt, as its worker last sampled it:
    'gpu 0  87% util, 12.3/80.0 GiB (NVIDIA A100, on w0, 3s ago)'."""
    lines = []
    mine = [g for g in gpus if g["attempt"] == job["attempt"]]
    several = len({g["worker"] for g in mine}) > 1
    for g in mine:
        where = [g["name"]] if g.get("name") else []
        where += [f"on {g['worker']}", f"{_age(g['latest']['time'])} ago"]
        key = f"gpu {g['worker']}:{g['gpu']}" if several else f"gpu {g['gpu']}"
        lines.append((key, f"{_gpu_use(g['latest'])} ({', '.join(where)})"))
    return lines


def _owner(job: dict[str, Any]) -> str:
    """Who submitted the job; "-" for one from before users existed."""
    return str(job.get("owner") or "-")


def _print_fields(fields: list[tuple[str, str]]) -> None:
    """Key and value per line; on a terminal a long value wraps under its own column
    (the "latest" metrics) instead of under the keys."""
    if not out.is_terminal:
        for key, value in fields:
            _say(Text(f"{key:>15}", style="bold"), f"  {value}")
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(justify="right", style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for key, value in fields:
        grid.add_row(key, _text(value))
    out.print(grid)


def _find_jobs(
    c: Client,
    statuses: list[str],
    name: str | None,
    limit: int,
    cursor: str | None = None,
    user: str | None = None,
    mine: bool = False,
) -> tuple[list[dict[str, Any]], str | None]:
    """Up to ``limit`` jobs, newest first, following next_cursor past the API's page size
    (the API filters by state, name and owner)."""
    found: list[dict[str, Any]] = []
    while True:
        page = c.jobs(statuses, min(500, limit - len(found)), cursor, name, user, mine)
        found += page["items"]
        cursor = page["next_cursor"]
        if cursor is None or len(found) >= limit:
            return found, cursor


@client_command(name="ls")
def list_jobs(
    status: Annotated[
        list[str] | None,
        typer.Option("--status", "-s", help="only these states (repeatable, or comma-separated)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="only jobs whose name or program contains this")
    ] = None,
    mine: Annotated[bool, typer.Option("--mine", help="only your jobs")] = False,
    user: Annotated[
        str | None, typer.Option("--user", metavar="NAME", help="only this user's jobs")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many jobs")] = 50,
    cursor: Annotated[
        str | None, typer.Option(help="continue after this (next_cursor of --json)")
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            help="newest (first) or position: the queued ones listed in the order the claims "
            "try them, then the rest newest first (`ddpq queue` shows the whole queue)"
        ),
    ] = "newest",
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first.

    --json prints {"items": [Job], "next_cursor"}.
    """
    if mine and user:
        _fail("give --mine or --user NAME, not both", EXIT_USAGE)
    if sort not in ("newest", "position"):
        _fail(f"--sort {sort!r}: newest or position", EXIT_USAGE)
    statuses = [x.strip() for s in status or [] for x in s.split(",") if x.strip()]
    with _client() as c:
        items, next_cursor = _find_jobs(c, statuses, name, limit, cursor, user, mine)
        if sort == "position":  # stable: the rest stay newest first
            items.sort(key=lambda j: j.get("queue_position") or float("inf"))
        if as_json:
            _print_json({"items": items, "next_cursor": next_cursor})
            return
        handed_back = {j["id"]: _handed_back(c, j) for j in items}
    rows = []
    for j in items:
        m = j.get("latest_metrics") or {}
        rows.append(
            [
                str(j["id"]),
                j["name"] or "",
                _owner(j),
                _program(j),
                j["status"],
                _attempt(j, handed_back[j["id"]]),
                _where(j),
                str(m.get("step", "")),
                _loss(j),
                _age(j["created_at"]),
                _waiting(j),
            ]
        )
    headers = [
        "ID", "NAME", "OWNER", "PROGRAM", "STATUS", "ATTEMPT", "WORKER", "STEP", "LOSS", "AGE"
    ]  # fmt: skip
    table = _fit_table(
        [*headers, "REASON"],
        rows,
        caps={"NAME": 24, "OWNER": 16, "PROGRAM": 20, "WORKER": 32},
    )
    _print_table(table)
    if next_cursor:
        _say(_text(f"more: --cursor {next_cursor}", style="dim"))


def _handed_back(c: Client, job: dict[str, Any]) -> int:
    """How many of a job's attempts were handed back (a worker's shutdown, preemption):
    asked only of a job that may have one, an attempt before its current one, or its
    last when it is back in the queue."""
    if job["attempt"] < 2 and not (job["status"] == "queued" and job["attempt"] == 1):
        return 0
    return sum(a["outcome"] == "requeued" for a in c.attempts(job["id"]))


def _attempt(job: dict[str, Any], handed_back: int) -> str:
    """ATTEMPT: the attempt's number (as `ddpq status` and the log number it) over
    max_attempts. max_attempts counts failures, and an attempt handed back is none: a
    bare `2/3` after a hand-back would read as one failure counted, so the hand-backs
    are named, `2 (1 handed back)/3`."""
    back = f" ({handed_back} handed back)" if handed_back else ""
    return f"{job['attempt']}{back}/{job['spec'].get('max_attempts', '?')}"


def _moved(job: dict[str, Any], as_json: bool) -> None:
    """What cancel, hold and release print: the job, or its id and new status."""
    if as_json:
        _print_json(job)
    else:
        _say(f"job {job['id']} {job['status']}")


@client_command()
def cancel(job_id: int, as_json: JsonOpt = False) -> None:
    """Cancel a job."""
    with _client() as c:
        job = c.cancel(job_id)
    _moved(job, as_json)


@client_command()
def hold(job_id: int, as_json: JsonOpt = False) -> None:
    """Hold a queued job back: no worker takes it until `ddpq release`. It keeps its id
    and its place in the queue (and counts against your queued limit)."""
    with _client() as c:
        job = c.hold(job_id)
    _moved(job, as_json)


@client_command()
def release(job_id: int, as_json: JsonOpt = False) -> None:
    """Release a held job: it waits again, in its place."""
    with _client() as c:
        job = c.release(job_id)
    _moved(job, as_json)


@client_command()
def update(
    job_id: int,
    priority: Annotated[
        int | None, typer.Option(help="its new priority (a member: up to their cap)")
    ] = None,
    time_limit: Annotated[
        int | None, typer.Option("--time-limit", help="seconds it may run (0: no limit)")
    ] = None,
    world_size: Annotated[int | None, typer.Option(help="its new number of ranks")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a queued or held job: its priority, time limit or world size. It keeps
    its id; a new priority moves it in the queue (`ddpq queue`)."""
    if priority is None and time_limit is None and world_size is None:
        _fail("give --priority, --time-limit or --world-size", EXIT_USAGE)
    with _client() as c:
        job = c.change(job_id, priority=priority, timeout_s=time_limit, world_size=world_size)
    if as_json:
        _print_json(job)
        return
    spec = job["spec"]
    limit = spec.get("timeout_s")
    _say(
        f"job {job['id']} {job['status']}: priority {spec.get('priority', 0)}, time limit "
        f"{f'{limit} s' if limit else 'none'}, world size {spec.get('world_size')}"
    )
