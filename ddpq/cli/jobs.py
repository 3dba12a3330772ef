"""Submitting, inspecting, listing and cancelling jobs."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from ddpq.cli.base import (
    EXIT_JOB_FAILED,
    EXIT_USAGE,
    JsonOpt,
    _age,
    _call,
    _client,
    _client_command,
    _fail,
    _fit_table,
    _loss,
    _print_json,
    _print_table,
    _program,
    _say,
    _text,
    _waiting,
    app,
)
from ddpq.cli.spec import _parse_env, _read_spec_file
from ddpq.client import Client


@app.command(context_settings={"allow_interspersed_args": False})
@_client_command
def submit(
    args: Annotated[
        list[str] | None, typer.Argument(help="arguments for the program, after --")
    ] = None,
    file: Annotated[
        str | None,
        typer.Option(
            "--file", "-f", help="a job spec in YAML or JSON (- for stdin); flags override it"
        ),
    ] = None,
    recipe: Annotated[str | None, typer.Option(help="a built-in recipe (ddpq recipes)")] = None,
    entrypoint: Annotated[
        str | None, typer.Option(help="a script in the worker's workspace")
    ] = None,
    world_size: Annotated[int | None, typer.Option(help="total ranks (default 1)")] = None,
    nnodes: Annotated[int | None, typer.Option(help="nodes (default 1)")] = None,
    name: str | None = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda (default auto)")] = None,
    priority: Annotated[int | None, typer.Option(help="higher first (default 0)")] = None,
    max_attempts: Annotated[int | None, typer.Option(help="(default 3)")] = None,
    max_restarts: Annotated[int | None, typer.Option(help="(default 0)")] = None,
    retry_on_error: Annotated[
        bool | None,
        typer.Option(
            "--retry-on-error/--no-retry-on-error",
            help="retry exits 1..127 too (signals are always retried) (default no)",
            show_default=False,
        ),
    ] = None,
    timeout_s: int | None = None,
    env: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE for the ranks (repeatable)")
    ] = None,
    idempotency_key: str | None = None,
    wait: Annotated[
        bool, typer.Option(help="wait for the job to end; exit 4 unless it succeeded")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job: --recipe NAME or --entrypoint PATH [-- ARGS...], or -f job.yaml.

    The spec file (YAML or JSON, - for stdin) holds the fields of POST /jobs.

    Flags given too override its fields; --env adds to its env.
    """
    if recipe is not None and entrypoint is not None:
        _fail("give exactly one of --recipe and --entrypoint", EXIT_USAGE)
    spec: dict[str, Any] = _read_spec_file(file) if file is not None else {}
    # A program given on the command line replaces the file's, whichever kind it is.
    if recipe is not None:
        spec.pop("entrypoint", None)
    if entrypoint is not None:
        spec.pop("recipe", None)
    flags = {
        "recipe": recipe,
        "entrypoint": entrypoint,
        "name": name,
        "world_size": world_size,
        "nnodes": nnodes,
        "device": device,
        "priority": priority,
        "max_attempts": max_attempts,
        "max_restarts": max_restarts,
        "retry_on_error": retry_on_error,
        "timeout_s": timeout_s,
    }
    spec.update({k: v for k, v in flags.items() if v is not None})
    if args:
        spec["args"] = list(args)
    if env:
        file_env = spec.get("env")
        spec["env"] = {**(file_env if isinstance(file_env, dict) else {}), **_parse_env(env)}
    if spec.get("recipe") is None and spec.get("entrypoint") is None:
        _fail(
            "give exactly one of --recipe and --entrypoint (or recipe/entrypoint in -f FILE)",
            EXIT_USAGE,
        )
    with _client() as c:
        job = _call(c.submit, spec, idempotency_key)
        if wait:
            job = _call(c.wait, job["id"])
    if as_json:
        _print_json(job)
    else:
        _say(
            f"job {job['id']} {job['status']} ({_program(job)},"
            f" world size {job['spec']['world_size']})"
        )
        if job.get("reason"):
            _say(f"  {job['reason']}")
    if wait and job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command()
@_client_command
def status(job_id: int, as_json: JsonOpt = False) -> None:
    """Show one job. Exits 0 unless it failed or was cancelled (4)."""
    with _client() as c:
        job = _call(c.job, job_id)
    if as_json:
        _print_json(job)
    else:
        fields = [
            ("id", job["id"]),
            ("name", job["name"] or ""),
            ("status", job["status"]),
            ("program", _program(job)),
            ("world size", job["spec"]["world_size"]),
            ("attempt", job["attempt"]),
            ("worker", job["worker"] or ""),
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
            fields.append(("latest", f"step {m['step']}: {values}"))
        if job.get("latest_checkpoint"):
            fields.append(("checkpoint", job["latest_checkpoint"]["path"]))
        if job.get("metrics_dropped"):
            fields.append(("metrics lost", f"{job['metrics_dropped']} points never stored"))
        for key, value in fields:
            if value != "":
                _say(Text(f"{key:>15}", style="bold"), f"  {value}")
    if job["status"] in ("failed", "cancelled"):
        raise typer.Exit(EXIT_JOB_FAILED)


def _find_jobs(
    c: Client, statuses: list[str], name: str | None, limit: int, cursor: str | None = None
) -> tuple[list[dict[str, Any]], str | None]:
    """Up to ``limit`` jobs, newest first, following next_cursor past the API's page size
    (the API filters by state and name)."""
    found: list[dict[str, Any]] = []
    while True:
        page = c.jobs(statuses, min(500, limit - len(found)), cursor, name)
        found += page["items"]
        cursor = page["next_cursor"]
        if cursor is None or len(found) >= limit:
            return found, cursor


@app.command("ls")
@_client_command
def list_jobs(
    status: Annotated[
        list[str] | None,
        typer.Option("--status", "-s", help="only these states (repeatable, or comma-separated)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="only jobs whose name or program contains this")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many jobs")] = 50,
    cursor: Annotated[
        str | None, typer.Option(help="continue after this (next_cursor of --json)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first (--json: {"items": [Job], "next_cursor"})."""
    statuses = [x.strip() for s in status or [] for x in s.split(",") if x.strip()]
    with _client() as c:
        items, next_cursor = _call(_find_jobs, c, statuses, name, limit, cursor)
    if as_json:
        _print_json({"items": items, "next_cursor": next_cursor})
        return
    rows = []
    for j in items:
        m = j.get("latest_metrics") or {}
        rows.append(
            [
                str(j["id"]),
                j["name"] or "",
                _program(j),
                j["status"],
                f"{j['attempt']}/{j['spec'].get('max_attempts', '?')}",
                j["worker"] or "",
                str(m.get("step", "")),
                _loss(j),
                _age(j["created_at"]),
                _waiting(j),
            ]
        )
    headers = ["ID", "NAME", "PROGRAM", "STATUS", "ATTEMPT", "WORKER", "STEP", "LOSS", "AGE"]
    table = _fit_table([*headers, "REASON"], rows, caps={"NAME": 24, "PROGRAM": 20, "WORKER": 16})
    _print_table(table)
    if next_cursor:
        _say(_text(f"more: --cursor {next_cursor}", style="dim"))


@app.command()
@_client_command
def cancel(job_id: int, as_json: JsonOpt = False) -> None:
    """Cancel a job."""
    with _client() as c:
        job = _call(c.cancel, job_id)
    if as_json:
        _print_json(job)
    else:
        _say(f"job {job['id']} {job['status']}")
