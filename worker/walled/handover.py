"""A directory handed to a job's uid and taken back: every entry of a tree made the
uid's (or the worker's again, with every bit that would let another uid in cleared),
walked by directory fds so that nothing a job put there (a link, a swapped component, a
hard link to someone else's file) turns root's walk elsewhere. worker.walled.walls decides
what is handed to whom and when; this module only changes owners and modes (and, taking
back strictly, removes what another uid must not be given: take_back_strictly)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ddpq.errors import WorkerError

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


# ---- taken back strictly: a tree another attempt is given next (a user's cache) ----------

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_STRIP = stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH


class Untrusted(WorkerError):
    """A tree not to be kept (taken back strictly): why, in words."""


@dataclass
class Walked:
    """What a strict take-back kept: its entries, its regular files' bytes, and each
    regular file as (last used: the later of its atime and mtime, size, its directory
    below the top, its name)."""

    entries: int = 0
    bytes: int = 0
    files: list[tuple[float, int, tuple[str, ...], str]] = field(default_factory=list)


def take_back_strictly(top: Path, owners: range, max_entries: int, max_depth: int) -> Walked:
    """``top`` and everything under it this process's again, as a tree that goes to
    another uid next (a user's cache: worker.files.caches) must be: walked by directory fds,
    following no link; what is neither a regular file, a directory nor a symbolic link
    (a FIFO, a socket) removed; a regular file with a second name removed (it may be
    someone else's, hard-linked: the other name stays); anything owned by neither this
    process nor a uid of ``owners`` removed; set-uid, set-gid and group or other write
    bits cleared. Untrusted past ``max_entries`` entries or ``max_depth`` levels, or if
    an entry is not what it was (the caller discards the tree). Run once nothing of the
    uid runs: nothing changes under the walk, which checks each entry it opens anyway. A
    missing top is an empty tree."""
    try:
        fd = os.open(top, _DIR)
    except FileNotFoundError:
        return Walked()
    except OSError as exc:
        raise Untrusted(f"{top} is not a directory ({exc.strerror})") from None
    walked = Walked()
    me = os.geteuid()
    try:
        st = os.fstat(fd)
        if st.st_uid != me and st.st_uid not in owners:
            raise Untrusted(f"{top} is owned by uid {st.st_uid}")
        os.fchown(fd, me, os.getegid())
        os.fchmod(fd, 0o700)
        _walk(fd, (), 0, walked, owners, (max_entries, max_depth))
    except RecursionError:  # a foreign tree's removal, deeper than rmtree goes
        raise Untrusted("nested deeper than a walk goes") from None
    finally:
        os.close(fd)
    return walked


def _walk(
    dir_fd: int,
    rel: tuple[str, ...],
    depth: int,
    w: Walked,
    owners: range,
    bounds: tuple[int, int],
) -> None:
    me, group = os.geteuid(), os.getegid()
    max_entries, max_depth = bounds
    for name in os.listdir(dir_fd):
        w.entries += 1
        if w.entries > max_entries:
            raise Untrusted(f"more than {max_entries} entries")
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        kind = stat.S_IFMT(st.st_mode)
        foreign = st.st_uid != me and st.st_uid not in owners
        if foreign or kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            if kind == stat.S_IFDIR:
                shutil.rmtree(name, dir_fd=dir_fd)  # by fds, removing links unfollowed
            else:
                os.unlink(name, dir_fd=dir_fd)
            continue
        if kind == stat.S_IFREG and st.st_nlink > 1:
            os.unlink(name, dir_fd=dir_fd)
            continue
        if (st.st_uid, st.st_gid) != (me, group):
            os.chown(name, me, group, dir_fd=dir_fd, follow_symlinks=False)
        if kind == stat.S_IFLNK:
            continue  # kept as it is, never followed
        mode = stat.S_IMODE(st.st_mode)
        if kind == stat.S_IFREG:
            if mode & _STRIP:
                _chmod_at(name, dir_fd, st, mode & ~_STRIP)
            w.files.append((max(st.st_atime, st.st_mtime), st.st_size, rel, name))
            w.bytes += st.st_size
            continue
        if depth + 1 > max_depth:
            raise Untrusted(f"deeper than {max_depth} directories")
        fd = os.open(name, _DIR, dir_fd=dir_fd)
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise Untrusted(f"{'/'.join((*rel, name))} changed under the walk")
            if mode & _STRIP:
                os.fchmod(fd, mode & ~_STRIP)
            _walk(fd, (*rel, name), depth + 1, w, owners, bounds)
        finally:
            os.close(fd)
