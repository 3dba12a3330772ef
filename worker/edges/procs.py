"""Finding and killing a job's processes.

torchrun starts each rank in its own session, so signalling torchrun's process
group does not reach the ranks, and a SIGKILLed torchrun leaves them running as
orphans. Every process of an attempt therefore carries ``DDPQ_LAUNCH_ID`` in its
environment, and the worker finds them by it in /proc. A walled attempt (worker.walled.walls)
is found by its uid instead: every process under it is the attempt's, and a worker
without CAP_SYS_PTRACE (the compose worker) cannot read another uid's environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LAUNCH_ID_VAR = "DDPQ_LAUNCH_ID"
PR_SET_DUMPABLE = 4


def make_undumpable() -> None:
    """Keep processes of this user, a job's ranks among them, out of this one.

    Jobs run as the worker's user, and Linux lets a process read /proc/<pid>/environ and
    /proc/<pid>/mem of, and ptrace, any process of its own user: the worker's token (and
    on a shared host the API's tokens and database URL) would be a `cat` away. A process
    that is not dumpable is exempt: its /proc files belong to root. Children do not
    inherit the flag (execve resets it), so the ranks stay findable and killable.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(err)}")


def launch_prefix(worker_name: str, data_dir: Path) -> str:
    """What every DDPQ_LAUNCH_ID of one worker starts with. The data directory is part
    of it: two workers on one host (or two test sessions) may share a name, and must
    never take each other's processes for their own."""
    instance = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    return f"{worker_name}@{instance}/"


def find_by_launch_id(launch_id: str, *, prefix: bool = False) -> list[int]:
    """Processes whose DDPQ_LAUNCH_ID is ``launch_id`` (or starts with it)."""
    needle = f"{LAUNCH_ID_VAR}={launch_id}".encode() + (b"" if prefix else b"\0")
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


def _uids() -> Iterator[tuple[int, set[int]]]:
    """Every live process but this one, with its real, effective, saved and filesystem
    uids (a job that ran a set-uid program is still the job's). A zombie is not: it runs
    nothing, cannot be killed, and stays until its parent (in a container, possibly the
    worker as PID 1) reaps it."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
            continue
        yield int(entry.name), {int(u) for u in fields.get("Uid", "").split()}


def find_by_uid(uid: int) -> list[int]:
    """Processes running under ``uid``."""
    return [pid for pid, uids in _uids() if uid in uids]


def uids_running(pool: range) -> set[int]:
    """The uids of ``pool`` that some process runs under."""
    return {u for _, uids in _uids() for u in uids if u in pool}


# Run under the job's uid: kill(-1) reaches every process that uid may signal, in one
# pass the kernel makes with new processes held off, so a process that forks and exits
# over and over (never at one pid long enough to be found in /proc) dies too.
_KILL_ALL = """
import os, signal
try:
    os.kill(-1, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def kill_uid(uid: int, timeout_s: float = 10.0) -> bool:
    """SIGKILL every process of ``uid`` until none is left; True if none is (needs the
    privilege to become ``uid``: a walled worker's)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            [sys.executable, "-I", "-S", "-c", _KILL_ALL],
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            cwd="/",
            timeout=timeout_s,
            check=False,
        )
    return _kill_until_none(lambda: find_by_uid(uid), timeout_s)


def kill_all(launch_id: str, timeout_s: float = 10.0, *, prefix: bool = False) -> bool:
    """SIGKILL every process carrying ``launch_id`` until none is left; True if none is."""
    return _kill_until_none(lambda: find_by_launch_id(launch_id, prefix=prefix), timeout_s)


def _kill_until_none(find: Callable[[], list[int]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        pids = find()
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
