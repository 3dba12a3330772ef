"""The launcher's command line: what every process the worker starts for a job is wrapped
in (torchrun, a walled pip build, a Slurm node's torchrun, `ddpq up`'s worker), so that it
dies with the thread that started it, runs under the job's uid when walled, and is forked
by a warm process when one is asked for. The launcher itself is worker.launch, an entry
module: this builds the line that runs it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The checkout that holds worker/ (this file is worker/starting/launcher.py).
_CHECKOUT = str(Path(__file__).resolve().parents[2])


def launcher_argv(
    argv: list[str],
    grace_s: float,
    uid: int | None = None,
    gid: int | None = None,
    warm: str | None = None,
) -> list[str]:
    """Wrap ``argv`` so that it dies with the calling thread (see worker.launch), run
    under ``uid``:``gid`` when given (the launcher itself stays the worker's); forked by
    the warm process at the socket ``warm`` when given (worker.starting.warm)."""
    who = "-" if uid is None else f"{uid}:{gid if gid is not None else uid}"
    # -I: started in the job's directory, it must not import the job's files (a
    # worker/launch.py of its code) nor heed PYTHON* variables: walled, it runs as root.
    # The worker's own checkout, named: -I leaves PYTHONPATH out, and an installed copy of
    # ddpq elsewhere must not stand in for the code this worker runs.
    run = f"import sys; sys.path.insert(0, {_CHECKOUT!r}); from worker.launch import main; main()"
    return [
        sys.executable, "-I", "-c", run, str(os.getpid()), str(grace_s), who,
        "--" if warm is None else f"--warm={warm}", *argv,
    ]  # fmt: skip
