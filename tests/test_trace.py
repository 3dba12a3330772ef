"""worker.executors.trace: an attempt's phases, recorded as one JSON line each (no process runs
here; tests/test_e2e.py reads a real worker's trace of a job run to its end and of one that
fails before it starts)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from worker.executors import trace


def test_a_trace_keeps_its_phases_in_order_as_wall_clock_seconds(tmp_path: Path) -> None:
    t = trace.Trace()
    for phase in ("started", "held", "prepared", "spawned"):
        t.mark(phase)
    path = tmp_path / "trace.jsonl"
    t.record(path, 7, 2)
    [item] = trace.read(path)
    assert item["job_id"] == 7 and item["attempt"] == 2
    at = item["at"]
    assert list(at) == ["claimed", "started", "held", "prepared", "spawned"]
    assert list(at.values()) == sorted(at.values())
    steps = trace.steps(at)
    assert list(steps) == ["started", "held", "prepared", "spawned"]
    assert all(s >= 0 for s in steps.values())
    assert sum(steps.values()) == at["spawned"] - at["claimed"]


def test_steps_follow_the_phases_an_attempt_reached() -> None:
    # An attempt that failed before it started: no prepared, spawned, exited.
    at = {"claimed": 10.0, "started": 10.5, "held": 11.0, "released": 12.0, "reported": 14.0}
    assert trace.steps(at) == {"started": 0.5, "held": 0.5, "released": 1.0, "reported": 2.0}


def test_no_file_no_line_and_lines_of_attempts_ending_at_once_never_mix(tmp_path: Path) -> None:
    trace.Trace().record(None, 1, 1)  # a worker without --trace
    path = tmp_path / "trace.jsonl"
    assert trace.read(path) == []

    def attempt(job_id: int) -> None:
        t = trace.Trace()
        for phase in trace.PHASES[1:]:
            t.mark(phase)
        for _ in range(50):
            t.record(path, job_id, 1)

    threads = [threading.Thread(target=attempt, args=(j,)) for j in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 200
    assert all(list(json.loads(line)["at"]) == list(trace.PHASES) for line in lines)
    assert path.stat().st_mode & 0o777 == 0o600
