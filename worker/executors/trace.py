"""Where an attempt's time goes on its worker: a monotonic timestamp at each phase of one
attempt, from the claim's reply to the finish the API took, kept as one JSON line per
attempt in the file ``ddpq worker --trace FILE`` names (bench/overhead.py --trace reads it).

Marking a phase is a list append; the line is written once, after the attempt's end is
reported, by a single O_APPEND write (the lines of attempts ending at once never mix). No
file, no line: a worker without --trace only keeps the few marks in memory.

Each line: ``{"job_id", "attempt", "at": {phase: seconds since the epoch}}``, the phases in
the order they happened (PHASES, those the attempt reached). Times are the monotonic clock
anchored once to the wall clock, so they compare with the API's own stamps (created_at,
started_at, finished_at) on the same host.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

# The phases of one attempt, in order (an attempt that fails early reaches only some):
PHASES = (
    "claimed",  # the claim's reply is in: the runner exists
    "started",  # its thread runs
    "held",  # its uid is held and clean (walls), its directories made
    "prepared",  # its code directory, program, environment and interpreter are ready
    "spawned",  # the launcher (worker.launch, then worker.tee and torchrun) is started
    # the first line of a rank's output is read: by the output's reader, beside the
    # supervisor, so a job that ends within the reader's quiet pause
    # (worker.starting.logship.OUTPUT_QUIET_POLL_S) has it read, and marked, after "exited"
    "first_line",
    "exited",  # the launcher has exited (torchrun and its ranks are gone)
    "drained",  # its output is read to the end
    "released",  # its uid is swept and its directories taken back
    "kept",  # no process of it is left, its directory's outputs are sent (a job with code)
    "shipped",  # the log's last bytes are in the API
    "reported",  # the API took the finish report
)


class Trace:
    """The phases one attempt has reached, by the monotonic clock."""

    __slots__ = ("marks",)

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = [("claimed", time.monotonic())]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.monotonic()))

    def line(self, job_id: int, attempt: int) -> str:
        """The attempt's JSON line, its marks as wall-clock seconds."""
        anchor = time.time() - time.monotonic()
        # By time: two threads mark (the reader "first_line"), each stamp taken before its
        # append, so the list's order may differ from the clock's by a thread switch.
        at = {name: round(anchor + t, 6) for name, t in sorted(self.marks, key=lambda m: m[1])}
        return json.dumps({"job_id": job_id, "attempt": attempt, "at": at}) + "\n"

    def record(self, path: Path | None, job_id: int, attempt: int) -> None:
        """Append the attempt's line to ``path`` (nothing without one)."""
        if path is None:
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.line(job_id, attempt).encode())
        finally:
            os.close(fd)


def read(path: Path) -> list[dict]:
    """The attempts a trace file holds, in the order they ended."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps(at: dict[str, float]) -> dict[str, float]:
    """Each phase's duration: from the phase reached just before it to it (the order they
    happened, which for "first_line" need not be PHASES')."""
    seen = sorted(at, key=at.__getitem__)
    return {b: at[b] - at[a] for a, b in itertools.pairwise(seen)}
