"""torchrun whose ranks' output arrives as whole lines: ``python -m worker.tee ARGS``
takes torchrun's arguments and runs it.

torchrun's ``--tee`` copies each rank's output file to its own stdout, one
``readline()`` at a time, with the rank's prefix before each piece. A program that
writes a line in two pieces (``print(x, end="")`` then the rest, or any unbuffered
print: the text and its newline are two writes) is caught between them, and the
log gets ``...step-000000162.pt[rank0]: `` followed by a line ``[rank0]: sample:``.
The tails of all ranks also write into one file concurrently.

This replaces torchrun's tail with one that passes on complete lines only, each
with its prefix, every write whole and under one lock. A piece without its newline
is held until the newline comes, the rank ends, or PARTIAL_WAIT_S passes (a progress
bar redrawn with ``\\r`` never ends its line: it is shown that often). Torch is pinned
(2.14.1), and tests/test_observe.py fails if a torch upgrade changes what is replaced.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from threading import Event
from typing import TextIO

PARTIAL_WAIT_S = 2.0
READ_BYTES = 1 << 16

_write_lock = threading.Lock()


def _emit(header: str, lines: list[bytes], dst: TextIO, keep: Callable[[str], bool] | None) -> None:
    text = "".join(
        f"{header}{line}"
        for line in (raw.decode("utf-8", errors="replace") + "\n" for raw in lines)
        if keep is None or keep(line)
    )
    if text:
        with _write_lock:
            dst.write(text)
            dst.flush()


def tail_whole_lines(
    header: str,
    file: str,
    dst: TextIO,
    finished: Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """torch.distributed.elastic's tail_logfile, line-whole (same arguments)."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    pending = b""
    waiting_since = 0.0  # when the held piece of a line began waiting for its end
    with open(file, "rb") as fp:
        while True:
            # Set before this read: then the read sees all there is (the rank has ended).
            done = finished.is_set()
            chunk = fp.read(READ_BYTES)
            if chunk:
                had = bool(pending)
                *lines, pending = (pending + chunk).split(b"\n")
                if lines:
                    _emit(header, lines, dst, log_line_filter)
                if pending and (lines or not had):
                    waiting_since = time.monotonic()
                continue
            if pending and (done or time.monotonic() - waiting_since >= PARTIAL_WAIT_S):
                _emit(header, [pending], dst, log_line_filter)
                pending = b""
            if done:
                return
            time.sleep(interval_sec)


def main() -> None:
    from torch.distributed.elastic.multiprocessing import tail_log
    from torch.distributed.run import main as torchrun

    tail_log.tail_logfile = tail_whole_lines  # TailLog.start looks it up at each call
    sys.argv[0] = "torchrun"
    torchrun()


if __name__ == "__main__":
    main()
