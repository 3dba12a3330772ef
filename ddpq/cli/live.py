"""ddpq watch: one job's progress, loss and log, live."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ddpq.cli.base import (
    EXIT_JOB_FAILED,
    STATUS_STYLE,
    _client,
    _number,
    _print_json_line,
    _program,
    _text,
    _waiting,
    client_command,
    out,
)
from ddpq.client import TERMINAL, Client
from ddpq.rules import visible
from ddpq.wire import NON_FINITE, decode_number

SPARK = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60  # blocks in the loss sparkline
# Points of the loss history asked of the API (max_points): each block's lowest and
# highest. Kept here to at most twice this many, however long the job runs.
HISTORY_POINTS = 2 * SPARK_POINTS
# While a new attempt reports again steps an earlier one reached, the job's latest
# step does not move: its history is then fetched again at most this often.
BEHIND_REFRESH_S = 5.0


def _finite(values: Iterable[Any]) -> list[float]:
    """The numbers among ``values``, without NaN and infinities (a diverged loss)."""
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def sparkline(values: Iterable[Any]) -> str:
    """One block per finite value, scaled between the values' min and max."""
    finite = _finite(values)
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    top = len(SPARK) - 1
    if hi == lo:
        return SPARK[top // 2] * len(finite)
    return "".join(SPARK[min(top, int((v - lo) / (hi - lo) * len(SPARK)))] for v in finite)


def columns(points: list[tuple[int, Any]], width: int = SPARK_POINTS) -> list[float]:
    """(step, value) points, oldest first, as ``width`` values over equal spans of
    steps, so the whole run fits the width: each span's mean (a downsampled span
    holds its lowest and highest point); a span with no finite value repeats the one
    before it. With ``width`` finite points or fewer, each is its own."""
    finite = [(step, float(v)) for step, v in points if isinstance(v, int | float)]
    finite = [(step, v) for step, v in finite if math.isfinite(v)]
    if len(finite) <= width:
        return [v for _, v in finite]
    lo, span = finite[0][0], finite[-1][0] - finite[0][0] + 1
    sums = [0.0] * width
    counts = [0] * width
    for step, v in finite:
        col = (step - lo) * width // span
        sums[col] += v
        counts[col] += 1
    out: list[float] = []
    for total, n in zip(sums, counts, strict=True):
        out.append(total / n if n else out[-1])  # the first span holds the first point
    return out


def _rank(value: Any) -> tuple[int, float]:
    """Lowest to highest as the API ranks values: NaN above every number."""
    if isinstance(value, str):
        value = decode_number(value) if value in NON_FINITE else math.nan
    return (1, 0.0) if math.isnan(value) else (0, float(value))


def thin(points: list[tuple[int, Any, int]], max_points: int) -> list[tuple[int, Any, int]]:
    """At most ``max_points`` of ``points`` (oldest first) that keep their shape, as the
    API downsamples (service/metrics.py): equal spans of steps, each keeping its
    lowest and highest point, and the first and the last point."""
    if len(points) <= max_points:
        return points
    buckets = max(1, (max_points - 2) // 2)
    lo, span = points[0][0], points[-1][0] - points[0][0] + 1
    keep = {0, len(points) - 1}
    low: dict[int, int] = {}
    high: dict[int, int] = {}
    for i, (step, value, _) in enumerate(points):
        b = (step - lo) * buckets // span
        if b not in low or _rank(value) < _rank(points[low[b]][1]):
            low[b] = i
        if b not in high or _rank(value) > _rank(points[high[b]][1]):
            high[b] = i
    keep.update(low.values(), high.values())
    return [points[i] for i in sorted(keep)]


class _History:
    """One metric's whole run as the job's current attempt sees it, at a bounded cost.

    It is fetched once downsampled (max_points), then only what is new: from the
    current attempt's newest step on, still with max_points, so an answer stays
    small however far the job got between two fetches; never the whole history
    again until the attempt changes. Points kept here are thinned as the API
    downsamples once they pass twice max_points. A new attempt resumes from a
    checkpoint and reports its steps again: points of earlier attempts from the step
    it started reporting at are left out, so the line ends where the attempt is.
    """

    def __init__(self, name: str, max_points: int = HISTORY_POINTS) -> None:
        self.name = name
        self.max_points = max_points
        self.points: list[tuple[int, Any, int]] = []  # (step, value, attempt), by step
        self.attempt = 0
        self.loaded = False
        # Earlier attempts have points past the current one's newest step: the job's
        # latest step stays put while it catches up, so it is polled on a timer.
        self.behind = False
        self.fetched_at = -math.inf

    def reset(self, attempt: int) -> None:
        self.points, self.attempt, self.loaded, self.behind = [], attempt, False, False

    def since(self, resume_step: int) -> int:
        """Where the next fetch starts (inclusive): the current attempt's newest step;
        before it reported anything, the step it resumes from."""
        own = [step for step, _, attempt in self.points if attempt >= self.attempt]
        return max(own) if own else resume_step

    def fetch(self, c: Client, job_id: int, resume_step: int) -> None:
        if not self.loaded:
            got = c.metrics(job_id, name=self.name, max_points=self.max_points)
            since = 0
            kept: list[tuple[int, Any, int]] = []
        else:
            since = self.since(resume_step)
            got = c.metrics(job_id, name=self.name, since_step=since, max_points=self.max_points)
            kept = [p for p in self.points if p[0] < since]
        self.fetched_at = time.monotonic()
        self.loaded = True
        points = kept + [(p["step"], p["values"][self.name], p["attempt"]) for p in got]
        own = [step for step, _, a in points if a >= self.attempt]
        # Earlier attempts' points past the current one's newest: not reported again yet.
        self.behind = any(a < self.attempt and (not own or s > own[-1]) for s, _, a in points)
        if own:
            first = own[0]
            points = [p for p in points if p[2] >= self.attempt or p[0] < first]
        self.points = thin(points, self.max_points) if len(points) > 2 * self.max_points else points

    def values(self) -> list[tuple[int, Any]]:
        return [(step, value) for step, value, _ in self.points]


class _Watched:
    """What ``ddpq watch`` knows of a job: the Job (its total_steps included) and its
    loss over the whole run, downsampled (_History)."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.job: dict[str, Any] = {}
        self.loss = _History("loss")
        self._latest_step: int | None = None

    def poll(self, c: Client) -> None:
        job = c.job(self.job_id)
        if job["attempt"] != self.loss.attempt:
            # A new attempt reports again from its checkpoint's step, over the old points.
            self.loss.reset(job["attempt"])
            self._latest_step = None
        step = (job.get("latest_metrics") or {}).get("step")
        behind = self.loss.behind and time.monotonic() - self.loss.fetched_at >= BEHIND_REFRESH_S
        if step is not None and (step != self._latest_step or behind):
            checkpoint = job.get("latest_checkpoint") or {}
            self.loss.fetch(c, self.job_id, checkpoint.get("step") or 0)
            self._latest_step = step
        self.job = job

    @property
    def total_steps(self) -> int | None:
        total = self.job.get("total_steps")
        return total if isinstance(total, int) and total > 0 else None

    @property
    def losses(self) -> list[float]:
        """The loss over the whole run, one value per sparkline block."""
        return columns(self.loss.values())

    @property
    def step(self) -> int | None:
        step = (self.job.get("latest_metrics") or {}).get("step")
        return step if isinstance(step, int) else None

    def snapshot(self) -> dict[str, Any]:
        """The --json object: stable keys, one object per change."""
        j = self.job
        latest = j.get("latest_metrics") or {}
        return {
            "id": j["id"],
            "name": j["name"],
            "status": j["status"],
            "attempt": j["attempt"],
            "max_attempts": j["spec"].get("max_attempts"),
            "worker": j["worker"],
            "gpus": j["gpus"],
            "reason": j["reason"],
            "queue_position": j["queue_position"],
            "exit_code": j["exit_code"],
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": latest.get("epoch"),
            "metrics": {k: v for k, v in (latest.get("values") or {}).items()},
        }

    def progress(self) -> str:
        if self.total_steps is None:
            return ""
        done = min(self.step or 0, self.total_steps)
        return f"step {done}/{self.total_steps} ({100 * done / self.total_steps:.0f}%)"

    def metrics_text(self) -> str:
        values = (self.job.get("latest_metrics") or {}).get("values") or {}
        return "  ".join(f"{k} {_number(v)}" for k, v in values.items())

    def line(self) -> str:
        """One plain line (stdout is not a terminal)."""
        j = self.job
        parts = [f"job {j['id']} {j['status']}", f"attempt {j['attempt']}"]
        if j["worker"]:
            parts.append(f"worker {j['worker']}")
        if j["gpus"]:
            parts.append(f"gpus {','.join(map(str, j['gpus']))}")
        if j["status"] in TERMINAL and j["exit_code"] is not None:
            parts.append(f"exit code {j['exit_code']}")
        if progress := self.progress():
            parts.append(progress)
        elif self.step is not None:
            parts.append(f"step {self.step}")
        if self.loss.points:
            last = self.loss.points[-1][1]
            parts.append(f"loss {_number(last)} {sparkline(self.losses)}")
        if waiting := _waiting(j):
            parts.append(waiting)
        return visible(" | ".join(parts))

    def render(self) -> Any:
        from rich.progress_bar import ProgressBar

        j = self.job
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", justify="right")
        grid.add_column()
        title = f"{j['id']}  " + (f"{j['name']}  " if j["name"] else "")
        title += f"{_program(j)}, world size {j['spec']['world_size']}"
        grid.add_row("job", _text(title))
        state = _text(j["status"], style=STATUS_STYLE.get(j["status"], ""))
        state.append(f"   attempt {j['attempt']}/{j['spec'].get('max_attempts', '?')}")
        if j["status"] in TERMINAL and j["exit_code"] is not None:
            state.append(f"   exit code {j['exit_code']}")
        grid.add_row("status", state)
        if j["worker"]:
            gpus = ",".join(map(str, j["gpus"] or [])) or "none"
            grid.add_row("worker", _text(f"{j['worker']}   gpus {gpus}"))
        if waiting := _waiting(j):
            grid.add_row("reason", _text(waiting))
        if self.total_steps is not None:
            done = min(self.step or 0, self.total_steps)
            bar = Table.grid(padding=(0, 2))
            bar.add_row(
                ProgressBar(
                    total=self.total_steps,
                    completed=done,
                    width=40,
                    complete_style="cyan",
                    finished_style="green",
                ),
                Text(self.progress()),
            )
            grid.add_row("progress", bar)
        elif self.step is not None:
            grid.add_row("step", Text(str(self.step)))
        if metrics := self.metrics_text():
            grid.add_row("metrics", _text(metrics))
        if self.loss.points:
            finite = _finite(value for _, value in self.loss.values())
            span = f"  ({_number(min(finite))} .. {_number(max(finite))})" if finite else ""
            grid.add_row(
                "loss", Text(sparkline(self.losses), style="cyan").append(span, style="dim")
            )
        return grid


def follow(
    c: Client,
    job_id: int,
    interval: float = 1.0,
    as_json: bool = False,
    stop: Callable[[dict[str, Any]], bool] | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Show a job live until it ends (or ``stop(job)`` says so) and return the last Job
    seen: the live view on a terminal, else one line (--json: one object) per change;
    nothing if ``quiet``. ``ddpq watch`` and ``ddpq submit --wait`` both follow a job
    through here. Ctrl-C raises Interrupted with the last Job seen."""
    from rich.live import Live

    watched = _Watched(job_id)

    def polls() -> Iterator[None]:
        """Poll until the job ends; yields after each poll."""
        while True:
            watched.poll(c)
            yield
            if watched.job["status"] in TERMINAL or (stop is not None and stop(watched.job)):
                return
            time.sleep(interval)

    try:
        if quiet:
            for _ in polls():
                pass
        elif as_json or not out.is_terminal:
            last: Any = None
            for _ in polls():
                now: Any = watched.snapshot() if as_json else watched.line()
                if now != last:
                    if as_json:
                        _print_json_line(now)
                    else:
                        sys.stdout.write(f"{now}\n")
                        sys.stdout.flush()
                    last = now
        else:
            with Live(console=out, auto_refresh=False, transient=False) as live:
                for _ in polls():
                    live.update(watched.render(), refresh=True)
    except KeyboardInterrupt:
        raise Interrupted(watched.job or None) from None
    return watched.job


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while following a job: carries the last Job seen (None before the first)."""

    def __init__(self, job: dict[str, Any] | None) -> None:
        super().__init__()
        self.job = job


@client_command()
def watch(
    job_id: int,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between polls")] = 1.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="one JSON object per line, at every change")
    ] = False,
) -> None:
    """Follow a job live until it ends.

    Exits 0 if it succeeded, 4 if it failed or was cancelled.

    Status, attempt, worker, GPUs, why it waits, latest metrics, a loss sparkline.

    A progress bar when the program reports total_steps (the recipes do).

    When stdout is not a terminal: one line at each change (--json: one object).
    """
    with _client() as c:
        job = follow(c, job_id, interval, as_json)
    if job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)
