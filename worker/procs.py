"""Finding and killing a job's processes.

torchrun starts each rank in its own session, so signalling torchrun's process
group does not reach the ranks, and a SIGKILLed torchrun leaves them running as
orphans. Every process of an attempt therefore carries ``DDPQ_LAUNCH_ID`` in its
environment, and the worker finds them by it in /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

LAUNCH_ID_VAR = "DDPQ_LAUNCH_ID"


def launcher_argv(argv: list[str]) -> list[str]:
    """Wrap ``argv`` so that it dies with the calling thread (see worker.launch)."""
    return [sys.executable, "-m", "worker.launch", str(os.getpid()), "--", *argv]


def find_by_launch_id(launch_id: str) -> list[int]:
    needle = f"{LAUNCH_ID_VAR}={launch_id}".encode() + b"\0"
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ + b"\0":
            found.append(int(entry.name))
    return found


def kill_all(launch_id: str, timeout_s: float = 10.0) -> bool:
    """SIGKILL every process carrying ``launch_id`` until none is left; True if none is."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = find_by_launch_id(launch_id)
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
