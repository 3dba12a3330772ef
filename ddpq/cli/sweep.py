"""Sweeps: `ddpq sweep submit|ls|status|cancel|export`. A sweep runs one job over a search
space: every trial is an ordinary job of yours, made and judged by the API (a grid,
random draws or TPE, early stopping by ASHA or the median), so nothing has to stay
running on your side (docs/experiments.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ddpq.cli.base import (
    API_HELP,
    EXIT_USAGE,
    JsonOpt,
    _age,
    _client,
    _fail,
    _fit_table,
    _number,
    _print_json,
    _print_table,
    _say,
    _text,
    app,
    client_command,
    err,
)
from ddpq.cli.jobs import _print_fields
from ddpq.cli.spec import _read_spec_file, _scalar_text, secret_like_env
from ddpq.cli.submit import _code_dir, _push, _warn, submit_sweep, sweep_aim

sweep_app = typer.Typer(
    help="Sweeps: one job run over a search space, its trials made, ranked and stopped "
    "early by the API.",
    epilog=API_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(sweep_app, name="sweep")

SweepId = Annotated[int, typer.Argument(metavar="SWEEP", help="the sweep's id")]
PARAMS_SHOWN = 6  # parameter columns in `sweep status`; --json has them all


def _space(space: Any) -> Any:
    """The file's shorthands as the API's parameters: a bare value is fixed, a list is
    categorical; a mapping is given as it is (``type: float``, ...), its bounds read as
    numbers (YAML 1.1 reads ``1e-4``, without a dot, as text)."""
    if not isinstance(space, dict):
        return space
    out: dict[str, Any] = {}
    for name, p in space.items():
        if isinstance(p, list):
            out[name] = {"type": "categorical", "values": p}
        elif isinstance(p, dict):
            out[name] = {k: _bound(p.get("type"), v) if k in BOUNDS else v for k, v in p.items()}
        else:
            out[name] = {"type": "fixed", "value": p}
    return out


BOUNDS = ("low", "high", "step")


def _bound(kind: Any, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        number = float(value)
    except ValueError:
        return value  # for the API to refuse, naming the field
    return int(number) if kind == "int" and number.is_integer() else number


def _job(job: Any) -> Any:
    """The base job's args and env values as text, as a spec file's are (`--lr, 0.1`
    read as a number would be refused); templates such as {lr} stay as they are."""
    if not isinstance(job, dict):
        return job
    for key in ("args", "env"):
        value = job.get(key)
        if isinstance(value, list):
            job[key] = [_scalar_text(v) for v in value]
        elif isinstance(value, dict):
            job[key] = {k: _scalar_text(v) for k, v in value.items()}
    return job


@client_command(sweep_app, name="submit")
def submit(
    file: Annotated[
        str, typer.Argument(metavar="FILE", help="the sweep in YAML or JSON (- for stdin)")
    ],
    workdir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="the directory sent as the trials' code (default: the job's workdir, "
            "relative to the file, else the current one)",
        ),
    ] = None,
    no_code: Annotated[
        bool,
        typer.Option("--no-code", help="send no code: the trials run from the worker's workspace"),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Start a sweep from a file.

    It holds `job` (a job spec as `ddpq submit -f` takes it, `workdir: DIR` relative to
    the file; its args and env values may name parameters: `--lr {lr}`), `space` (each
    parameter `{type: float, low, high, log}`, `{type: int, low, high, step}`, a list of
    values, or a fixed value), `method` (grid, random, tpe), `metric` and `direction`,
    `max_trials`, `max_concurrent`, and optionally `early_stopping` (`{type: asha,
    min_steps: 100}` or `{type: median, interval_steps: 100}`) and `seed`. The job's
    directory is sent once; every trial runs it.
    """
    spec = _read_spec_file(file)
    job = _job(spec.get("job"))
    if "space" in spec:
        spec["space"] = _space(spec["space"])
    pushed = None
    if isinstance(job, dict):
        if not job.get("recipe") and not job.get("entrypoint"):
            _fail("job: give its recipe or its entrypoint", EXIT_USAGE)
        code_dir = _code_dir(job, file, workdir, no_code)
        if code_dir is not None:
            pushed = _push(code_dir, quiet=as_json)
            job["code"] = pushed.id
        shown = secret_like_env(job)
        if shown:
            _warn(shown)
    submit_sweep(spec, as_json, pushed)


def _method(spec: dict[str, Any]) -> str:
    return f"array {spec['array']}" if spec.get("array") is not None else str(spec["method"])


def _best(sweep: dict[str, Any]) -> str:
    b = sweep.get("best")
    if not b:
        return ""
    return f"{_number(b['value'])} (trial {b['number']}, job {b['job_id']})"


@client_command(sweep_app, name="ls")
def list_sweeps(
    status: Annotated[
        list[str] | None,
        typer.Option("--status", "-s", help="only these states: running, done, cancelled"),
    ] = None,
    mine: Annotated[bool, typer.Option("--mine", help="only your sweeps")] = False,
    user: Annotated[
        str | None, typer.Option("--user", metavar="NAME", help="only this user's")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="at most this many")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List sweeps, newest first. --json prints {"items": [Sweep], "next_cursor"}."""
    if mine and user:
        _fail("give --mine or --user NAME, not both", EXIT_USAGE)
    statuses = [x.strip() for s in status or [] for x in s.split(",") if x.strip()]
    with _client() as c:
        page = c.sweeps(statuses, user, mine, limit)
    if as_json:
        _print_json(page)
        return
    rows = []
    for w in page["items"]:
        n = w["counts"]
        counts = f"{w['trials_made']}/{w['max_trials']}"
        if n["active"]:
            counts += f" ({n['active']} active)"
        rows.append(
            [
                str(w["id"]), w["name"] or "", w["owner"], w["status"], _method(w["spec"]),
                counts, f"{w['spec']['metric'] or ''} {_best(w)}".strip(), _age(w["created_at"]),
                w["reason"] or "",
            ]
        )  # fmt: skip
    headers = ["ID", "NAME", "OWNER", "STATUS", "METHOD", "TRIALS", "BEST", "AGE", "REASON"]
    _print_table(_fit_table(headers, rows, caps={"NAME": 24, "OWNER": 16, "BEST": 40}))


def _stopping(stop: dict[str, Any] | None) -> str:
    """The early stopping's type, and its mode when it pauses trials (ASHA's pause mode)."""
    if not stop:
        return "none"
    return f"{stop['type']} (pause)" if stop.get("mode") == "pause" else str(stop["type"])


def _value(t: dict[str, Any]) -> tuple[str, str]:
    """A trial's metric and its step: its final (or pruned) value, else its latest."""
    if t["value"] is not None:
        return _number(t["value"]), str(t["step"] if t["step"] is not None else "")
    if t.get("latest") is not None:
        return f"{_number(t['latest'])}…", str(t.get("latest_step") or "")
    return "", ""


def _param(v: Any) -> str:
    return _number(v) if isinstance(v, float) else str(v)


@client_command(sweep_app, name="status")
def status(sweep_id: SweepId, as_json: JsonOpt = False) -> None:
    """Show a sweep and its trials, ranked by its metric: parameters, state and reason."""
    with _client() as c:
        sweep = c.sweep(sweep_id)
    if as_json:
        _print_json(sweep)
        return
    s = sweep["spec"]
    stop = s.get("early_stopping")
    fields = [
        ("sweep", f"{sweep['id']} {sweep['name'] or ''}".strip()),
        ("owner", sweep["owner"]),
        ("status", sweep["status"]),
        ("reason", sweep["reason"] or ""),
        ("method", f"{_method(s)} (seed {sweep['seed']})"),
        ("metric", sweep_aim(s)[2:]),
        ("early stopping", _stopping(stop)),
        (
            "trials",
            f"{sweep['trials_made']} of {sweep['max_trials']}, {s['max_concurrent']} at once",
        ),
        ("best", _best(sweep)),
    ]
    _print_fields([(k, str(v)) for k, v in fields if v != ""])
    trials = sweep["trials"] or []
    names = list(s["space"])[:PARAMS_SHOWN]
    rows = []
    for t in trials:
        value, step = _value(t)
        rows.append(
            [
                str(t["rank"] or ""), str(t["number"]), str(t["job_id"] or "-"), t["state"],
                value, step, *(_param(t["params"].get(n)) for n in names), t["reason"] or "",
            ]
        )  # fmt: skip
    if rows:
        headers = ["RANK", "TRIAL", "JOB", "STATE", (s["metric"] or "value").upper(), "STEP"]
        headers += [n.upper() for n in names] + ["REASON"]
        _print_table(_fit_table(headers, rows, caps={h: 16 for h in headers[6:-1]}))


@client_command(sweep_app, name="cancel")
def cancel(sweep_id: SweepId, as_json: JsonOpt = False) -> None:
    """Cancel a sweep and its trials (queued ones at once, running ones as their workers
    stop them)."""
    with _client() as c:
        sweep = c.cancel_sweep(sweep_id)
    if as_json:
        _print_json(sweep)
        return
    _say(f"sweep {sweep['id']} {sweep['status']}: {sweep['reason'] or ''}".rstrip(": "))


@client_command(sweep_app, name="export")
def export(
    sweep_id: SweepId,
    format: Annotated[
        str, typer.Option("--format", metavar="csv|json", help="(default csv)")
    ] = "csv",
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="write it here, not to stdout"),
    ] = None,
) -> None:
    """Export a sweep's table: a row per trial, ranked, with its parameters, metric,
    state and reason."""
    if format not in ("csv", "json"):
        _fail(f"--format is csv or json, not {format!r}", EXIT_USAGE)
    with _client() as c:
        body = c.export_sweep(sweep_id, format)
    if output is None:
        sys.stdout.buffer.write(body)
        sys.stdout.flush()
        return
    output.write_bytes(body)
    err.print(_text(f"wrote {output} ({len(body)} bytes)"), highlight=False)
