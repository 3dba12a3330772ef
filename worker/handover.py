"""A directory handed to a job's uid and taken back: every entry of a tree made the
uid's (or the worker's again, with every bit that would let another uid in cleared),
walked by directory fds so that nothing a job put there (a link, a swapped component, a
hard link to someone else's file) turns root's walk elsewhere. worker.walls decides
what is handed to whom and when; this module only changes owners and modes."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("ddpq.worker")


def chown_tree(top: Path, uid: int, gid: int, owners: range, *, strip: bool) -> None:
    """lchown ``top`` and everything under it owned by this process or a job uid
    (``owners``) to uid:gid; with ``strip``, also clear set-uid, set-gid and group and
    other write bits. The top goes first, to 0700: from then on no other uid reaches in,
    whatever the walk meets. The walk goes by directory fds (os.fwalk), never by a path
    a job could swap a component of for a link, and any depth or name length. A file
    with a second name is not handed to a job: a job may have hard-linked a file of
    someone else's (where fs.protected_hardlinks is off)."""
    me = os.geteuid()

    def fix(name: str | Path, st: os.stat_result, dir_fd: int | None) -> None:
        if st.st_uid != me and st.st_uid not in owners:
            return
        linked = st.st_nlink > 1 and not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode))
        if (st.st_uid != uid or st.st_gid != gid) and not (linked and uid != me):
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        if strip and (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            mode = stat.S_IMODE(st.st_mode)
            safe = mode & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH)
            if safe != mode:
                _chmod_at(name, dir_fd, st, safe)

    try:
        st = os.lstat(top)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    os.chown(top, uid, gid, follow_symlinks=False)
    os.chmod(top, 0o700)
    try:
        for _root, dirs, files, root_fd in os.fwalk(top, follow_symlinks=False):
            for name in dirs + files:
                try:
                    fix(name, os.stat(name, dir_fd=root_fd, follow_symlinks=False), root_fd)
                except OSError:
                    continue
    except (OSError, RecursionError) as exc:  # nested deeper than a walk goes
        log.warning("walking %s stopped: %s (its top is closed to jobs)", top, exc)


def _chmod_at(name: str | Path, dir_fd: int | None, st: os.stat_result, mode: int) -> None:
    """chmod what ``name`` is now, if it is still the entry ``st`` describes (Linux has
    no lchmod: open it without following a link, check, fchmod)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
