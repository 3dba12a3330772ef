"""Whether the kernel's OOM killer ended a rank: read from the kernel's own log, never
guessed from the signal.

A rank killed by SIGKILL was said to be "out of memory?" whatever killed it (a person's
``kill -9``, a node agent, the OOM killer). The kernel records each OOM kill in its log
("Out of memory: Killed process 4242 (python3) ...", "Memory cgroup out of memory: Killed
process 4242 ..."), which ``/dev/kmsg`` hands out record by record to a reader with
CAP_SYSLOG (a walled worker, root; an unwalled one only where ``kernel.dmesg_restrict`` is
0). worker.tee names the pid of each rank a signal killed; the worker looks for those pids
here, among the records since the attempt began. Unreadable: None, and the reason keeps
its question mark.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator

KMSG = "/dev/kmsg"
# One record: "priority,sequence,microseconds since boot,flags;message".
_RECORD = re.compile(rb"^\d+,\d+,(\d+),[^;]*;(.*)$", re.DOTALL)
_KILLED = re.compile(rb"[Oo]ut of memory.*?: Killed process (\d+) ")
MAX_RECORDS = 100_000  # the kernel's ring holds far fewer: a bound, not a limit
RECORD_BYTES = 8192  # a read of /dev/kmsg returns one record, and fails if it is larger


def killed_for_memory(pids: Iterable[int], since_s: float | None = None) -> bool | None:
    """Whether the OOM killer killed any of ``pids`` (in records at or after ``since_s``,
    seconds of CLOCK_MONOTONIC, when given): True or False, or None when the kernel's log
    cannot be read here."""
    wanted = {int(p) for p in pids}
    if not wanted:
        return None
    killed = _oom_kills(since_s)
    return None if killed is None else bool(killed & wanted)


def _oom_kills(since_s: float | None, path: str = KMSG) -> set[int] | None:
    """The pids the kernel's log says the OOM killer killed; None if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    # The kernel's clock for its records is CLOCK_MONOTONIC's; a little slack before the
    # attempt began costs nothing (a pid is not reused that soon).
    floor_us = None if since_s is None else int((since_s - 5.0) * 1_000_000)
    try:
        return killed_in(_records(fd), floor_us)
    except OSError:
        return None
    finally:
        os.close(fd)


def _records(fd: int) -> Iterator[bytes]:
    """Each record of /dev/kmsg, read one read at a time, to the end."""
    for _ in range(MAX_RECORDS):
        try:
            record = os.read(fd, RECORD_BYTES)
        except BlockingIOError:
            return  # read to the end
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                continue
            raise
        if not record:
            return
        yield record


def killed_in(records: Iterable[bytes], floor_us: int | None = None) -> set[int]:
    """The pids OOM kills name among kmsg ``records`` (at or after ``floor_us``)."""
    killed: set[int] = set()
    for record in records:
        m = _RECORD.match(record)
        if m is None or (floor_us is not None and int(m[1]) < floor_us):
            continue
        k = _KILLED.search(m[2])
        if k:
            killed.add(int(k[1]))
    return killed
