"""Exec wrapper: ``python -m worker.launch PARENT_PID -- ARGV...``.

Sets PR_SET_PDEATHSIG so the launched program gets SIGTERM when the thread that
started it dies (a killed worker), then execs ARGV. torchrun answers SIGTERM by
stopping its ranks, so a worker's jobs never train on without it. Doing this in
``preexec_fn`` instead would not be safe in the multi-threaded worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent = int(sys.argv[1])
    argv = sys.argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(128 + signal.SIGTERM)
    os.execvp(argv[0], argv)  # noqa: S606 - an argv list, never a shell


if __name__ == "__main__":
    main()
