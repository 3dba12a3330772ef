"""worker.launch, the attempt's supervisor, run from this tree (the worker starts it with
``python -I -m worker.launch``, which in a shared editable venv finds the installed tree's
copy): its child's status passes through, a stop is forwarded once, and a child that
ignores it is killed once the grace period is over. No database, no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = (
    f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); "
    "runpy.run_module('worker.launch', run_name='__main__')"
)


def launch(grace_s: float, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(os.getpid()), str(grace_s), "-", "--", *argv],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_the_childs_exit_status_passes_through() -> None:
    with launch(5, "sh", "-c", "exit 3") as proc:
        assert proc.wait(timeout=30) == 3
    with launch(5, "sh", "-c", "kill -KILL $$") as proc:
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL


@pytest.mark.parametrize(
    ("handler", "status"),
    [("signal.SIG_DFL", 128 + signal.SIGTERM), ("signal.SIG_IGN", 128 + signal.SIGKILL)],
)
def test_a_stop_is_forwarded_and_a_child_that_ignores_it_is_killed_after_the_grace(
    handler: str, status: int
) -> None:
    child = (
        f"import signal, time; signal.signal(signal.SIGTERM, {handler}); "
        "print('up', flush=True); time.sleep(120)"
    )
    with launch(0.5, sys.executable, "-c", child) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == status
