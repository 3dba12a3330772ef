"""Conventions of the wire that the service, the worker, the client and ddpq.train share.

Each is written once here: how a non-finite number travels in JSON, which answers
mean "try again", how long to wait before trying again, and the line the API puts
where it cut a job's log. Standard library only: ddpq.train imports it in every rank.
The typed messages between service and worker are in ddpq.messages.
"""

from __future__ import annotations

import math
import os
import random
import re
import stat
import threading
import time
from typing import Literal

# ---- numbers ---------------------------------------------------------------------------

# JSON has no literal for these; a diverged loss is information, so they travel as names.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


NonFinite = Literal["NaN", "Infinity", "-Infinity"]


def encode_number(x: float) -> float | NonFinite:
    """A float as JSON carries it: itself, or "NaN", "Infinity", "-Infinity"."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def decode_number(value: float | str) -> float:
    """The inverse of encode_number (a name not in NON_FINITE raises KeyError)."""
    return NON_FINITE[value] if isinstance(value, str) else float(value)


# ---- retrying --------------------------------------------------------------------------


def retryable(status: int) -> bool:
    """Whether an HTTP answer means "not now" (the same request may succeed later):
    a server error or 429. Every other 4xx will not change on a retry."""
    return status >= 500 or status == 429


class Backoff:
    """Exponential backoff with decorrelated jitter, reset by a success: each delay is
    drawn between 0.5 s and three times the last one (AWS, "Exponential Backoff And
    Jitter"), under the 10 s cap rather than clamped to it (clamped, most long waits
    would be exactly the cap, in step again). Workers that failed together (an API
    outage) retry apart instead of all at once. ``delay`` is what the next wait sleeps."""

    START_S = 0.5
    MAX_S = 10.0

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()  # seeded apart per instance
        self.reset()

    def reset(self) -> None:
        self._last = self.START_S
        self.delay = self._draw()

    def _draw(self) -> float:
        return self._rng.uniform(self.START_S, min(self.MAX_S, self._last * 3))

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Sleep for the current delay (True if ``stop`` was set meanwhile); draw the next."""
        delay = self._last = self.delay
        self.delay = self._draw()
        if stop is not None:
            return stop.wait(delay)
        time.sleep(delay)
        return False


# ---- the log's cut marker --------------------------------------------------------------

# The line the API puts where a job's log was cut under its cap: it counts for no
# offset, and the output after it starts at the offset it names.
_MARKER_LINE = (
    rb"\[ddpq\] \d+ bytes of output cut here \(log cap [^)\n]*\); "
    rb"output resumes at offset (\d+)"
)
# A marker is a line of its own (a rank's lines all start "[rankN]:"): it follows a newline.
CUT_MARKER = re.compile(rb"(?<=\n)" + _MARKER_LINE + rb"\n")
_CUT_LINE = re.compile(_MARKER_LINE)


def cut_marker(cut: int, cap: int, resume_at: int) -> bytes:
    """The marker line for ``cut`` bytes cut under the cap ``cap``."""
    return (
        f"[ddpq] {cut} bytes of output cut here (log cap DDPQ_LOG_MAX_BYTES={cap}); "
        f"output resumes at offset {resume_at}\n"
    ).encode()


def marker_resume(line: bytes) -> int | None:
    """The offset the output resumes at, if ``line`` (without its newline) is a cut marker."""
    m = _CUT_LINE.fullmatch(line)
    return int(m.group(1)) if m else None


# ---- a directory checkpoint's stamp ------------------------------------------------------


def tree_stamp(path: str, dir_fd: int | None = None) -> tuple[int, int]:
    """A directory checkpoint's stamp, as rank 0 registers it (ddpq.train) and its worker
    checks it before deleting the directory (worker.files.checkpoints): the bytes of the regular
    files under it and the newest mtime (ns) of it and of everything under it, walked
    without following a link. Anything written, added, removed or renamed inside since
    changes it: a directory written again is not the one registered."""
    size, newest = 0, 0
    for _root, dirs, files, fd in os.fwalk(path, dir_fd=dir_fd):
        newest = max(newest, os.fstat(fd).st_mtime_ns)
        for name in (*dirs, *files):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone meanwhile: the stamp differs by the directory's mtime
            newest = max(newest, st.st_mtime_ns)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
    return size, newest
