"""The box at a glance: `ddpq acct`, what jobs ran and held over a window (Slurm's sacct),
and `ddpq queue`, the queue in order with when each job would start (squeue --start)."""

from __future__ import annotations

import csv
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer

from ddpq.cli.base import (
    EXIT_USAGE,
    JsonOpt,
    _client,
    _fail,
    _fit_table,
    _print_json,
    _print_table,
    _say,
    _text,
    client_command,
)

_RELATIVE = re.compile(r"(\d{1,6})([mhdw])")
_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The columns of a row, as CSV writes them (the table shows a few of them, in words).
CSV_COLUMNS = [
    "job_id", "attempt", "name", "user", "state", "exit_code", "device", "world_size",
    "workers", "sweep", "created_at", "started_at", "finished_at", "queued_s", "elapsed_s",
    "gpu_hours", "cpu_slot_hours", "attempts", "preemptions", "reason",
]  # fmt: skip
MAX_PAGES = 10_000  # of 1000 rows: the whole window, however large, bounded


def when(value: str, option: str) -> str:
    """A time as the API takes it: ISO 8601 (a date, or a date and time, UTC without a
    zone), or how long ago: 30m, 12h, 7d, 2w."""
    m = _RELATIVE.fullmatch(value.strip())
    if m:
        ago = timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])
        return (datetime.now(UTC) - ago).isoformat()
    try:
        return datetime.fromisoformat(value).isoformat()
    except ValueError:
        _fail(
            f"{option} {value!r}: give a date (2026-11-01), a time (2026-11-01T08:00) or how "
            "long ago (30m, 12h, 7d, 2w)",
            code=EXIT_USAGE,
        )


def _hours(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _span(seconds: float | None) -> str:
    """'3h12m', '4m05s', '12s'."""
    if seconds is None:
        return ""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


@client_command(name="acct")
def acct(
    since: Annotated[
        str | None,
        typer.Option(help="the window's start: a date, a time (UTC) or how long ago (7d)"),
    ] = None,
    until: Annotated[str | None, typer.Option(help="the window's end (default: now)")] = None,
    user: Annotated[str | None, typer.Option(help="only this user's jobs")] = None,
    state: Annotated[
        str | None, typer.Option(help="only jobs in these states (comma-separated)")
    ] = None,
    worker: Annotated[str | None, typer.Option(help="only attempts on this worker")] = None,
    sweep: Annotated[int | None, typer.Option(help="only this sweep's trials")] = None,
    per: Annotated[str, typer.Option(help="a row per job or per attempt")] = "job",
    fmt: Annotated[
        str, typer.Option("--format", help="table, csv (every row) or json (every row)")
    ] = "table",
    limit: Annotated[int, typer.Option(min=1, help="rows the table shows at most")] = 50,
) -> None:
    """What jobs ran and held over a window (default: the last 30 days): a row per job
    (or attempt) with its user, state, time queued and run, GPU- and CPU-slot-hours
    inside the window, attempts and preemptions, exit and reason; then each user's
    totals. `--format csv` writes every row, for a monthly report."""
    if per not in ("job", "attempt"):
        _fail(f"--per {per!r}: job or attempt", code=EXIT_USAGE)
    if fmt not in ("table", "csv", "json"):
        _fail(f"--format {fmt!r}: table, csv or json", code=EXIT_USAGE)
    query: dict[str, Any] = {
        "since": when(since, "--since") if since else None,
        "until": when(until, "--until") if until else None,
        "user": user,
        "status": state,
        "worker": worker,
        "sweep": sweep,
        "per": per,
    }
    with _client() as c:
        page = c.accounting(**query, limit=min(limit, 1000) if fmt == "table" else 1000)
        rows, first = list(page["items"]), page
        while fmt != "table" and page["next_cursor"] and len(rows) < MAX_PAGES * 1000:
            page = c.accounting(**query, limit=1000, cursor=page["next_cursor"])
            rows.extend(page["items"])
    if fmt == "json":
        _print_json({**first, "items": rows, "next_cursor": page["next_cursor"]})
    elif fmt == "csv":
        _write_csv(rows)
    else:
        _show(first, rows[:limit])


def _write_csv(rows: list[dict[str, Any]]) -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(CSV_COLUMNS)
    for r in rows:
        out.writerow(
            [",".join(r[k]) if k == "workers" else ("" if r[k] is None else r[k])
             for k in CSV_COLUMNS]
        )  # fmt: skip


def _show(page: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    _say(_text(f"from {page['since'][:19]} to {page['until'][:19]} UTC", style="dim"))
    table = [
        [
            str(r["job_id"]) + (f".{r['attempt']}" if r["attempt"] is not None else ""),
            r["user"] or "",
            r["name"] or "",
            r["state"],
            _span(r["queued_s"]),
            _span(r["elapsed_s"]),
            _hours(r["gpu_hours"]),
            _hours(r["cpu_slot_hours"]),
            str(r["attempts"]),
            str(r["preemptions"]),
            "" if r["exit_code"] is None else str(r["exit_code"]),
            ",".join(r["workers"]),
            r["reason"] or "",
        ]
        for r in rows
    ]
    header = ["JOB", "USER", "NAME", "STATE", "QUEUED", "RAN", "GPU-H", "CPU-SLOT-H",
              "ATTEMPTS", "PREEMPTED", "EXIT", "WORKERS", "REASON"]  # fmt: skip
    _print_table(_fit_table(header, table, caps={"NAME": 24, "REASON": 40, "WORKERS": 20}))
    if page["next_cursor"]:
        _say(_text("more rows: --format csv or json writes every one", style="dim"))
    totals = [
        [
            t["user"] if t["user"] is not None else "(everyone)",
            str(t["jobs"]),
            str(t["attempts"]),
            _span(t["elapsed_s"]),
            _hours(t["gpu_hours"]),
            _hours(t["cpu_slot_hours"]),
            str(t["preemptions"]),
        ]
        for t in page["totals"]
    ]
    _say("")
    _print_table(
        _fit_table(
            ["USER", "JOBS", "ATTEMPTS", "RAN", "GPU-H", "CPU-SLOT-H", "PREEMPTED"],
            totals,
            caps={"USER": 24},
        )
    )


@client_command(name="queue")
def queue_(
    user: Annotated[str | None, typer.Option(help="only this user's jobs")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="at most this many jobs")] = 50,
    offset: Annotated[int, typer.Option(min=0, help="start at this place in the list")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """The queued jobs in the order the claims try them: each one's place, priority, its
    owner's recent usage (which orders jobs of one priority), why it is ahead of the
    next, when it would start if every job ran to its time limit, and what it waits for.
    """
    with _client() as c:
        page = c.queue(user, limit, offset)
    if as_json:
        _print_json(page)
        return
    s = page["scheduling"]
    _say(
        _text(
            f"{page['total']} queued; preemption {s['preemption']}, fair-share half-life "
            f"{_span(s['fairshare_half_life_s'])}, a CPU slot counts {s['cpu_slot_weight']:g} "
            f"GPU, later jobs wait behind one queued over {_span(s['starvation_s'])}",
            style="dim",
        )
    )
    rows = [
        [
            str(q["position"]),
            str(q["job_id"]),
            q["user"] or "",
            q["name"] or "",
            str(q["priority"]),
            f"{q['usage_gpu_s']:.1f}",
            f"{q['world_size']} {q['device']}",
            _start(q),
            q["placed"] or "",
            q["reason"],
        ]
        for q in page["items"]
    ]
    header = ["POS", "JOB", "USER", "NAME", "PRIO", "USAGE GPU-S", "NEEDS", "STARTS", "PLACED",
              "REASON"]  # fmt: skip
    _print_table(_fit_table(header, rows, caps={"NAME": 20, "PLACED": 48, "REASON": 48}))


def _start(q: dict[str, Any]) -> str:
    """When it would start, in local words: 'now', 'in 4m05s (w1)', or '?'."""
    if q["estimated_start"] is None:
        return "?"
    wait = (datetime.fromisoformat(q["estimated_start"]) - datetime.now(UTC)).total_seconds()
    where = q["estimate"].removeprefix("on worker ")
    return ("now" if wait <= 1 else f"in {_span(wait)}") + f" ({where})"
