"""A worker's data directory is its own: an exclusive lock, and the identity it keeps.

Two workers on one data dir would kill each other's ranks at start (leftovers are found
by a launch prefix derived from the data dir) and interleave their log offsets; a
second worker started with a live worker's name would have the service requeue the
first one's jobs. So a worker holds DATA_DIR/worker.lock (flock: released by the
kernel when the process dies, however it dies) for as long as it runs, and sends the
random identity kept in DATA_DIR/worker-id with its registration and heartbeats: the
same identity under the same name is a restart of the same worker (its lost attempts
are requeued at once); another identity under a name whose heartbeats are fresh is a
second process, and the service refuses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

from ddpq.errors import DataDirBusy

LOCK = "worker.lock"
IDENTITY = "worker-id"


# Held open for the life of the process: closing it would release the lock.
_held: list[int] = []


def hold(data_dir: Path) -> str:
    """Lock ``data_dir`` for this process and return the worker's identity."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise DataDirBusy(
            f"--data-dir {data_dir} is in use by another worker{who}; "
            "give each worker on a host its own --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.append(fd)
    return _identity(data_dir / IDENTITY)


def _identity(path: Path) -> str:
    with contextlib.suppress(OSError):
        value = path.read_text().strip()
        if len(value) == 32 and all(c in "0123456789abcdef" for c in value):
            return value
    value = secrets.token_hex(16)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(value + "\n")
    os.replace(tmp, path)
    return value
