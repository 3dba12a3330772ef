"""The worker's health, for a container health check: `python -m worker.health DATA_DIR`.

The agent records each heartbeat the API accepted in DATA_DIR/heartbeat (a JSON line
with the time and the heartbeat interval); the check passes while that record is fresh.
It reads no token and talks to nothing, so it runs with an empty environment, and a
worker cut off from the API for a while shows as unhealthy (`docker compose ps`) while
its jobs go on running.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

FILE = "heartbeat"
# Missed heartbeats before the worker counts as unhealthy; at least this many seconds.
MISSED = 5
MIN_STALE_S = 30.0


def record(data_dir: Path, heartbeat_s: float) -> None:
    """Replace the record atomically: a health check never reads half of it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".heartbeat-")
    with os.fdopen(fd, "w") as f:
        json.dump({"at": time.time(), "heartbeat_s": heartbeat_s}, f)
    os.replace(tmp, data_dir / FILE)


def problem(data_dir: Path, now: float | None = None) -> str | None:
    """Why the worker is unhealthy, or None."""
    try:
        rec = json.loads((data_dir / FILE).read_text())
        at, heartbeat_s = float(rec["at"]), float(rec["heartbeat_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"no heartbeat recorded in {data_dir / FILE}: {exc}"
    age = (time.time() if now is None else now) - at
    limit = max(MIN_STALE_S, MISSED * heartbeat_s)
    if age > limit:
        return f"last heartbeat the API accepted was {age:.0f} s ago (limit {limit:.0f} s)"
    return None


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m worker.health DATA_DIR")
    why = problem(Path(sys.argv[1]))
    if why:
        sys.exit(f"unhealthy: {why}")
    print("healthy")


if __name__ == "__main__":
    main()
