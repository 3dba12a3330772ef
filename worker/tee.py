"""torchrun whose ranks' output arrives as whole lines: ``python -m worker.tee ARGS``
takes torchrun's arguments and runs it.

torchrun's ``--tee`` copies each rank's output file to its own stdout, one
``readline()`` at a time, with the rank's prefix before each piece. A program that
writes a line in two pieces (``print(x, end="")`` then the rest, or any unbuffered
print: the text and its newline are two writes) is caught between them, and the
log gets ``...step-000000162.pt[rank0]: `` followed by a line ``[rank0]: sample:``.
The tails of all ranks also write into one file concurrently.

This replaces torchrun's tail with one that passes on complete lines only, each
with its prefix once, every write whole and under one lock. (After init_process_group
PyTorch's excepthook prefixes a traceback's lines with ``[rankN]: `` itself, and its C++
warnings with ``[rankN]:``; a line that already starts with the rank's prefix is not
given a second one.) A piece without its newline is held until the newline comes, the
rank ends, or PARTIAL_WAIT_S passes. A progress bar (tqdm's, a framework's) redraws its
line with ``\\r`` and ends it only when it is done: only its latest state is kept
(never the ``\\r``-joined chunks of every redraw), shown once each PROGRESS_EVERY_S while
it runs, on rank 0 only (frameworks draw the same bar on every rank), and once, as it
ended, on each rank. Torch is pinned (2.14.1), and tests/test_observe.py fails if a
torch upgrade changes what is replaced.

When a rank fails, torchrun raises ChildFailedError, whose traceback (through this
module) and 20-line table are noise in a job's log. This prints instead one line per
failed rank, the first to fail first, with its error: its error file's (under
``@record``), else the error line of its own recent output (``error_line``), which the
runner's tail of the whole output may have lost among the other ranks' tracebacks.
worker.starting.torchrun.root_cause reads these lines. It exits 1 as torchrun would, unless every
failed rank had finished its program before a signal ended it (worker.entry marks that in
the rank's error file; torch 2.14.1 may abort in the interpreter's teardown): then the
attempt did its work, and one line per such rank says what happened
(``[ddpq] rank 0 (local rank 0): the program finished; torch crashed during interpreter
exit (SIGABRT)``, which worker.starting.torchrun.outcome gives as the success's reason); it exits 0.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import string
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from threading import Event
from typing import TextIO

from worker import entry

PARTIAL_WAIT_S = 2.0
PROGRESS_EVERY_S = 10.0  # how often a running progress bar's latest state is shown
# A rank's file read at torchrun's interval while it writes, then less and less often while
# it is quiet, down to once per this: a training loop that prints nothing for minutes costs
# a wake-up a second per file, not ten (on a host whose cores the ranks fill, each wake-up
# is taken from them). The rank's end wakes the wait at once.
QUIET_POLL_S = 1.0
READ_BYTES = 1 << 16
RECENT_LINES = 200  # of each rank's output, kept to name its error when it fails
# torchrun's --log-line-prefix-template as worker.starting.torchrun.argv gives it.
PREFIX_TEMPLATE = "[rank${rank}]: "

_write_lock = threading.Lock()
_recent: dict[str, collections.deque[str]] = {}  # by the rank's prefix

# Lines that name why a program failed: an exception, or argparse's "prog: error: ...".
# Any number of "[rank1]:" prefixes go first (torchrun's, PyTorch's excepthook's).
ERROR_LINE = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)*((?:[\w.]+(?:Error|Exception|Interrupt)\b.*)|(?:\S+: error: .*))$"
)
# Errors that follow from another rank's failure, not its cause: the ranks still in a
# collective see their peer's connection close, and torchrun reports its child failed.
CONSEQUENCE = re.compile(
    r"ChildFailedError|SignalException|torch\.distributed\.elastic|DistBackendError|"
    r"DistNetworkError|DistStoreError|gloo|NCCL|[Cc]onnection (?:closed|reset|refused)|"
    r"[Bb]roken pipe|ProcessGroup"
)
CHILD_FAILED = re.compile(r"\bChildFailedError\b")


def error_line(lines: Iterable[str]) -> str | None:
    """The error line that says why: the last one that is not a consequence of another
    rank's failure (else the last of those); never torchrun's ChildFailedError."""
    errors = [
        m.group(1)
        for line in lines
        for m in [ERROR_LINE.match(line)]
        if m and not CHILD_FAILED.search(m.group(1))
    ]
    causes = [e for e in errors if not CONSEQUENCE.search(e)]
    return (causes or errors or [None])[-1]


def latest(piece: bytes) -> bytes:
    """A line redrawn with ``\\r`` (a progress bar) as its latest state: its last part
    that is not blank (``text\\r`` from a CRLF line is ``text``)."""
    if b"\r" not in piece:
        return piece
    parts = [p for p in piece.split(b"\r") if p.strip()]
    return parts[-1] if parts else b""


def _own(header: str, line: str) -> str:
    """``line`` without the rank's own prefix, if torch put it there already (its
    excepthook's ``[rank1]: ``, its C++ warnings' ``[rank1]:``)."""
    if not header:
        return line
    mark = header.rstrip()
    if line.startswith(mark):
        line = line[len(mark) :]
        return line[1:] if line.startswith(" ") else line
    return line


def _emit(header: str, lines: list[bytes], dst: TextIO, keep: Callable[[str], bool] | None) -> None:
    shown = [
        _own(header, line)
        for line in (latest(raw).decode("utf-8", errors="replace") + "\n" for raw in lines)
        if keep is None or keep(line)
    ]
    _recent.setdefault(header, collections.deque(maxlen=RECENT_LINES)).extend(
        line.rstrip() for line in shown
    )
    text = "".join(f"{header}{line}" for line in shown)
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
    # A progress bar's state last shown, and when: its redraws are shown at most once each
    # PROGRESS_EVERY_S, and only rank 0's while it runs (every rank draws the same bar).
    shown_bar, shown_at = b"", 0.0
    live_bars = _rank(header) == 0
    pause = interval_sec
    with open(file, "rb") as fp:
        while True:
            # Set before this read: then the read sees all there is (the rank has ended).
            done = finished.is_set()
            chunk = fp.read(READ_BYTES)
            if chunk:
                pause = interval_sec
                had = bool(pending)
                *lines, pending = (pending + chunk).split(b"\n")
                if lines:
                    _emit(header, lines, dst, log_line_filter)
                    shown_bar = b""
                if b"\r" in pending:  # a bar: only its latest state is kept
                    pending = b"\r" + latest(pending)
                elif pending and (lines or not had):
                    waiting_since = time.monotonic()
                continue
            now = time.monotonic()
            if pending.startswith(b"\r"):
                state = pending[1:]  # empty: the bar was wiped (tqdm's leave=False)
                if done:
                    if state:
                        _emit(header, [state], dst, log_line_filter)
                    pending = b""
                elif (
                    live_bars
                    and state
                    and state != shown_bar
                    and now - shown_at >= PROGRESS_EVERY_S
                ):
                    _emit(header, [state], dst, log_line_filter)
                    shown_bar, shown_at = state, now
            elif pending and (done or now - waiting_since >= PARTIAL_WAIT_S):
                _emit(header, [pending], dst, log_line_filter)
                pending = b""
            if done:
                return
            finished.wait(pause)
            pause = min(pause * 2, max(interval_sec, QUIET_POLL_S))


def _rank(header: str) -> int:
    """The rank a tail's prefix names (PREFIX_TEMPLATE); 0 without one."""
    m = re.match(r"\[rank(\d+)\]", header)
    return int(m.group(1)) if m else 0


# worker.starting.torchrun.FAILURE_LINE reads these; tests/test_torchrun_failures.py holds both
# to each other.
FIRST = "[ddpq] first to fail: "
ALSO = "[ddpq] also failed: "


def failed_words(rank: int, local_rank: int, exitcode: int, pid: int | None = None) -> str:
    """How a rank ended, from torch's exit code (negative: killed by that signal):
    ``rank 1 (local rank 1) exited with code 1``, ``rank 0 (local rank 0) killed by
    SIGKILL (pid 4242)``: the pid of a rank a signal killed, which the worker looks for
    in the kernel's log of OOM kills (worker.edges.oom)."""
    if exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
        if pid:
            how += f" (pid {pid})"
    else:
        how = f"exited with code {exitcode}"
    return f"rank {rank} (local rank {local_rank}) {how}"


def failure_line(
    first: bool,
    rank: int,
    local_rank: int,
    exitcode: int,
    message: str | None = None,
    pid: int | None = None,
) -> str:
    """One failed rank's line: ``[ddpq] first to fail: rank 1 (local rank 1) exited with
    code 1``, then ``: ValueError: bad input`` when the rank's error file says so (as
    under ``@record``)."""
    said = f": {' '.join(message.split())[:500]}" if message else ""
    words = failed_words(rank, local_rank, exitcode, pid)
    return f"{FIRST if first else ALSO}{words}{said}"


def _error_file_message(failure: object) -> str | None:
    """What a rank's error file says (torch's ProcessFailure.message: a string, or
    ``{"message": ...}`` as ``@record`` writes it), when it left one."""
    if getattr(failure, "error_file", "<N/A>") == "<N/A>":  # torch's _NOT_AVAILABLE
        return None
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) and message else None


# A rank that dies by one of these after its program finished crashed on the way out (the
# teardown abort worker.entry avoids); by another (torchrun's SIGTERM once a rank
# failed), it was stopped.
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL})
# worker.starting.torchrun.outcome reads the success's words after this (FINISHED_LINE).
AFTER_FINISH = "the program finished; "


def finished(failure: object) -> bool:
    """Whether a failed rank's program had finished well before the rank died: worker.entry
    marks that point in the rank's error file."""
    message = _error_file_message(failure)
    return message == entry.FINISHED or bool(message and message.startswith(entry.ALONE))


ALONE_WORDS = re.compile(re.escape(entry.ALONE) + r": rank (\d+) of a world of (\d+)$")


def alone_words(log_dir: str) -> str | None:
    """``rank 0 (local rank 0): the program finished; it never joined a process group:
    ...``, when worker.entry marked that in a rank's error file (under torchrun's
    ``--log-dir``: ``.../attempt_N/LOCAL_RANK/error.json``); None when every rank did."""
    import glob
    import json

    found = []
    for path in glob.glob(os.path.join(log_dir, "**", "error.json"), recursive=True):
        try:
            with open(path) as f:
                message = json.load(f)["message"]["message"]
            local_rank = int(os.path.basename(os.path.dirname(path)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        m = ALONE_WORDS.match(message) if isinstance(message, str) else None
        if m:
            found.append((int(m[1]), local_rank, int(m[2])))
    if not found:
        return None
    rank, local_rank, world = min(found)
    return (
        f"rank {rank} (local rank {local_rank}): {AFTER_FINISH}it never joined a process "
        f"group (torch.distributed.init_process_group): the world of {world} ranks ran "
        "apart, each training alone"
    )


def finished_words(rank: int, local_rank: int, exitcode: int) -> str:
    """``rank 0 (local rank 0): the program finished; torch crashed during interpreter
    exit (SIGABRT)``: a rank that did its work and died after, by signal ``-exitcode``."""
    try:
        sig = signal.Signals(-exitcode)
    except ValueError:
        how, name = "killed", f"signal {-exitcode}"
    else:
        how = "torch crashed" if sig in CRASH_SIGNALS else "stopped"
        name = sig.name
    who = f"rank {rank} (local rank {local_rank})"
    return f"{who}: {AFTER_FINISH}{how} during interpreter exit ({name})"


def failure_lines(
    failures: dict[int, object],
    first_rank: int,
    recent: Mapping[str, Iterable[str]] | None = None,
) -> list[str]:
    """Each failed rank's line (torch's ChildFailedError.failures), the first to fail
    first, with its error file's message; the first's, without one, is the error line
    of its ``recent`` output (by the prefix of its lines, PREFIX_TEMPLATE)."""
    recent = _recent if recent is None else recent
    order = [first_rank, *sorted(r for r in failures if r != first_rank)]
    lines = []
    for rank in order:
        failure = failures[rank]
        message = _error_file_message(failure)
        if message == entry.FINISHED:
            message = "its program had finished"
        elif message is None and rank == first_rank:
            header = string.Template(PREFIX_TEMPLATE).safe_substitute(rank=rank)
            message = error_line(recent.get(header, ()))
        local_rank = int(getattr(failure, "local_rank", rank))
        exitcode = int(getattr(failure, "exitcode", 1))
        pid = getattr(failure, "pid", None)
        pid = pid if isinstance(pid, int) and pid > 0 else None
        lines.append(failure_line(rank == first_rank, rank, local_rank, exitcode, message, pid))
    return lines


def main() -> None:
    from torch.distributed.elastic.multiprocessing import tail_log
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    tail_log.tail_logfile = tail_whole_lines  # TailLog.start looks it up at each call
    sys.argv[0] = "torchrun"
    try:
        torchrun()
    except ChildFailedError as exc:
        failures: dict[int, object] = dict(exc.failures)
        exitcodes = {r: int(getattr(f, "exitcode", 1)) for r, f in failures.items()}
        if failures and all(finished(f) and exitcodes[r] < 0 for r, f in failures.items()):
            # Every failed rank had done its work: the attempt succeeded, and says how.
            with _write_lock:
                sys.stdout.flush()
                for rank, f in sorted(failures.items()):
                    local_rank = int(getattr(f, "local_rank", rank))
                    words = finished_words(rank, local_rank, exitcodes[rank])
                    sys.stderr.write(f"[ddpq] {words}\n")
                sys.stderr.flush()
            sys.exit(0)
        first_rank, _ = exc.get_first_failure()
        lines = failure_lines(failures, first_rank)
        with _write_lock:
            sys.stdout.flush()
            sys.stderr.write("".join(f"{line}\n" for line in lines))
            sys.stderr.flush()
        sys.exit(1)
    log_dir = _option("--log-dir") or _option("--log_dir")
    alone = alone_words(log_dir) if log_dir else None
    if alone:  # worker.starting.torchrun.outcome gives it as the success's reason
        with _write_lock:
            sys.stdout.flush()
            sys.stderr.write(f"[ddpq] {alone}\n")
            sys.stderr.flush()


def _option(flag: str) -> str | None:
    """A torchrun option's value in this process's arguments (``--flag V``, ``--flag=V``)."""
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    main()
