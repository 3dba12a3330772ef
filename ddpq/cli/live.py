"""ddpq watch: one job's progress, loss and log, live."""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ddpq.cli.base import (
    EXIT_JOB_FAILED,
    STATUS_STYLE,
    _call,
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

SPARK = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60


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


class _Watched:
    """What ``ddpq watch`` knows of a job: the Job, the last loss points, the total steps."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.job: dict[str, Any] = {}
        self.losses: deque[Any] = deque(maxlen=SPARK_POINTS)
        self.total_steps: int | None = None
        self._attempt: int | None = None
        self._fetched_step = -1  # metric points up to this step are in ``losses``
        self._latest_step: int | None = None

    def poll(self, c: Client) -> None:
        job = c.job(self.job_id)
        if self._attempt is not None and job["attempt"] != self._attempt:
            # A new attempt reports again from its checkpoint's step, over the old points.
            self.losses.clear()
            self._fetched_step = -1
            self._latest_step = None
        self._attempt = job["attempt"]
        latest = job.get("latest_metrics") or {}
        step = latest.get("step")
        if step is not None and step != self._latest_step:
            # since_step includes its step: ask only for the points not seen yet.
            for p in c.metrics(
                self.job_id, name=["loss", "total_steps"], since_step=self._fetched_step + 1
            ):
                self._take(p["values"])
                self._fetched_step = max(self._fetched_step, p["step"])
            self._latest_step = step
        # The latest step's total, should its points not have been fetched (same step).
        self._take({"total_steps": (latest.get("values") or {}).get("total_steps")})
        self.job = job

    def _take(self, values: dict[str, Any]) -> None:
        if "loss" in values:
            self.losses.append(values["loss"])
        total = values.get("total_steps")
        if isinstance(total, int | float) and total > 0:
            self.total_steps = int(total)

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
        return "  ".join(f"{k} {_number(v)}" for k, v in values.items() if k != "total_steps")

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
        if self.losses:
            last = self.losses[-1]
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
        if self.losses:
            finite = _finite(self.losses)
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
        job = _call(follow, c, job_id, interval, as_json)
    if job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)
