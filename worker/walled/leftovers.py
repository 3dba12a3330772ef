"""What a job's uid leaves behind on the host, found and removed (systemd's RemoveIPC=
and more): its processes (worker.edges.procs kills them), its entries in the shared temporary
directories every uid may write to, and the System V IPC objects it owns or made. Run
before a uid is handed to an attempt, after each attempt under it, and at start over the
whole range (worker.walled.walls decides when; this module only finds and removes)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from worker.edges import procs

log = logging.getLogger("ddpq.worker")

# Directories every uid may write to: a job's leftovers there are removed after it (only
# ever read with lstat and removed, never followed or written).
SHARED_TMP = tuple(
    Path(p)
    for p in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")  # noqa: S108
)


def remove(uid: int) -> bool:
    """Nothing of ``uid`` is left on the host: no process, no file in a shared
    temporary directory, no System V IPC object; False if a process survived."""
    gone = procs.kill_uid(uid)
    if not gone:
        log.error("processes of uid %s survived SIGKILL", uid)
    _remove_owned(uid)
    _remove_ipc(uid)
    return gone


def owners(pool: range) -> set[int]:
    """The uids of ``pool`` that left something behind: a process, a file in a shared
    temporary directory, an IPC object. One pass over /proc and the directories finds
    them, not one per uid."""
    return procs.uids_running(pool) | _tmp_owners(pool) | _ipc_owners(pool)


_Found = Iterator[tuple[int, str, os.stat_result]]  # (a directory's fd, a name in it, its lstat)


def _shared_tmp() -> _Found:
    """Every entry of the shared temporary directories, as (its directory's fd, its
    name, its lstat), and of the root-owned world-writable directories under them
    (/tmp/.X11-unix) one level down: outside its own directories a job may write only
    there. By directory fd, never by path: a directory a job owns could be swapped for
    a link between a look and a removal, which root would follow."""
    for top in SHARED_TMP:
        try:
            top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            for name, st in _entries(top_fd):
                yield top_fd, name, st
                if st.st_uid == 0 and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
                    yield from _subdir(top_fd, name, st)
        finally:
            os.close(top_fd)


def _entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    out: list[tuple[str, os.stat_result]] = []
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return out
    for name in names:
        with contextlib.suppress(OSError):
            out.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)))
    return out


def _subdir(
    parent_fd: int, name: str, st: os.stat_result
) -> Iterator[tuple[int, str, os.stat_result]]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        return
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            for sub, sub_st in _entries(fd):
                yield fd, sub, sub_st
    finally:
        os.close(fd)


def _remove_owned(uid: int) -> None:
    """Remove what ``uid`` left in the shared temporary directories."""
    for dir_fd, name, st in _shared_tmp():
        if st.st_uid != uid:
            continue
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dir_fd)
            else:
                os.unlink(name, dir_fd=dir_fd)


def _tmp_owners(pool: range) -> set[int]:
    """The uids of ``pool`` that own something in the shared temporary directories."""
    return {st.st_uid for _, _, st in _shared_tmp() if st.st_uid in pool}


IPC_RMID = 0
_IPC = (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl"))


def _ipc_objects() -> Iterator[tuple[str, str, int, set[int]]]:
    """Every System V IPC object: its kind, the call that removes it, its id, and the
    uids that own or made it."""
    for kind, call in _IPC:
        try:
            header, *lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except (OSError, ValueError):
            continue
        names = header.split()
        for line in lines:
            row = dict(zip(names, line.split(), strict=False))
            ident = int(row.get("shmid") or row.get("semid") or row.get("msqid") or -1)
            if ident >= 0:
                yield kind, call, ident, {int(row.get("uid", -1)), int(row.get("cuid", -1))}


def _ipc_owners(pool: range) -> set[int]:
    return {u for *_, owners in _ipc_objects() for u in owners if u in pool}


def _remove_ipc(uid: int) -> None:
    """Remove the System V shared memory, semaphores and message queues ``uid`` owns or
    created (systemd's RemoveIPC=): another job under the uid could attach to them."""
    libc = None
    for kind, call, ident, owners in _ipc_objects():
        if uid in owners:
            libc = libc or ctypes.CDLL(None, use_errno=True)
            fn = getattr(libc, call)
            if (fn(ident, 0, IPC_RMID, None) if kind == "sem" else fn(ident, IPC_RMID, None)) != 0:
                err = ctypes.get_errno()
                if err not in (errno.EINVAL, errno.EIDRM):
                    log.warning(
                        "could not remove %s %s of uid %s: %s", kind, ident, uid, os.strerror(err)
                    )
