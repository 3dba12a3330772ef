"""What ``ddpq.report`` does under a bare torchrun (no API to send to): rank 0 prints."""

from __future__ import annotations

import atexit
import numbers
import sys
import threading
import time
from typing import Any

# Without ddpq (a bare torchrun), a line per this many seconds: readable, and the steps
# between cost one clock read each.
INTERVAL_S = 5.0


class Plain:
    """Reports under a bare torchrun (no API to send to), on rank 0: a line on stderr
    for the first, then at most one per INTERVAL_S, and the last one not shown
    yet when the program exits. Between lines a report costs a clock read."""

    def __init__(self) -> None:
        self._next = 0.0
        self._unshown: tuple[int, float | None, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def report(self, step: int, epoch: float | None, values: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._unshown = (step, epoch, values)
                return
            if self._next == 0.0:
                atexit.register(self._at_exit)
            self._next = now + INTERVAL_S
            self._unshown = None
        _print_point(step, epoch, values)

    def _at_exit(self) -> None:
        if self._unshown is not None:
            _print_point(*self._unshown)


def _print_point(step: int, epoch: float | None, values: dict[str, Any]) -> None:
    where = f"step {step}" + ("" if epoch is None else f" epoch {to_float(epoch):g}")
    shown = ", ".join(f"{k}={to_float(v):.6g}" for k, v in values.items())
    print(f"ddpq: {where}: {shown}", file=sys.stderr, flush=True)


def to_float(value: Any) -> float:
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # a one-element tensor or numpy scalar
    if item is not None:
        return float(item())
    raise TypeError(f"metric values must be numbers or one-element tensors, not {type(value)!r}")
