"""Whether the kernel's OOM killer ended a rank: read from the kernel's own log, never
guessed from the signal.

A rank killed by SIGKILL was said to be "out of memory?" whatever killed it (a person's
``kill -9``, a node agent, the OOM killer). The kernel records each OOM kill in its log
("Out of memory: Killed process 4242 (python3) ...", "Memory cgroup out of memory: Killed
process 4242 ..."), which ``/dev/kmsg`` hands out record by record to a reader with
CAP_SYSLOG (a walled worker, root; an unwalled one only where ``kernel.dmesg_restrict`` is
0). worker.tee names the pid of each rank a signal killed; the worker looks for those pids
here, among the records since the attempt began.

Where the log cannot be read (an unprivileged container, ``dmesg_restrict``), the memory
cgroup the ranks inherit from the worker counts the kills the OOM killer made in it,
global or the cgroup's own (``oom_kill`` in cgroup v2's memory.events, v1's
memory.oom_control): read when the ranks start and when one was SIGKILLed, a count
that did not move says it was not the OOM killer; one that moved says it was (the
cgroup may hold other jobs' ranks: the log, where readable, is the surer source).
Neither readable: None, and the reason keeps its question mark.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator

KMSG = "/dev/kmsg"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
# One record: "priority,sequence,microseconds since boot,flags;message".
_RECORD = re.compile(rb"^\d+,\d+,(\d+),[^;]*;(.*)$", re.DOTALL)
_KILLED = re.compile(rb"[Oo]ut of memory.*?: Killed process (\d+) ")
MAX_RECORDS = 100_000  # the kernel's ring holds far fewer: a bound, not a limit
RECORD_BYTES = 8192  # a read of /dev/kmsg returns one record, and fails if it is larger


def killed_for_memory(
    pids: Iterable[int], since_s: float | None = None, kills_before: int | None = None
) -> bool | None:
    """Whether the OOM killer killed any of ``pids`` (in records at or after ``since_s``,
    seconds of CLOCK_MONOTONIC, when given): True or False, or None when neither the
    kernel's log nor the cgroup's count (``kills_before``: cgroup_oom_kills() when the
    ranks started) can be read here."""
    wanted = {int(p) for p in pids}
    if not wanted:
        return None
    killed = _oom_kills(since_s)
    if killed is not None:
        return bool(killed & wanted)
    after = cgroup_oom_kills()
    if kills_before is None or after is None:
        return None
    return after > kills_before


def cgroup_oom_kills(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """How many processes of this process's memory cgroup the OOM killer has killed;
    None where no count can be read. A cgroup namespace or a container's mount may
    show the cgroup itself at the mount's root: that is tried after its own path."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):  # cgroup v1
            mount = os.path.join(root, "memory")
            candidates += [os.path.join(mount, rel, "memory.oom_control")]
            candidates += [os.path.join(mount, "memory.oom_control")]
        elif controllers == "":  # cgroup v2 (alone, or beside v1 as "unified")
            for mount in (root, os.path.join(root, "unified")):
                candidates += [os.path.join(mount, rel, "memory.events")]
                candidates += [os.path.join(mount, "memory.events")]
    for path in candidates:
        count = _oom_kill_count(path)
        if count is not None:
            return count
    return None


def _oom_kill_count(path: str) -> int | None:
    """The ``oom_kill N`` line of a memory.events or memory.oom_control file."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


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
