"""Walls between jobs on one host: every attempt runs under a uid of its own.

A worker that may change uids (root, or the capabilities in ``NEEDED_CAPS``, as the
compose worker has) runs each attempt's processes (pip for its requirements, torchrun
and the ranks) under a uid and gid taken from a range (``--job-uids``, the way systemd's
DynamicUser takes one from 61184-65519), in directories only that uid may write: its
code directory, its checkpoint directory and a scratch directory (its HOME and TMPDIR).
Everything else the worker keeps (the content cache, the requirement environments, its
own code, its data directory) is owned by the worker and read-only or closed to jobs.
Linux then does the rest: a process may read another's /proc/<pid>/environ, memory or
cwd, or ptrace it, only under the same uid, so no job reads another's token.

Why uids and not namespaces (bubblewrap, ``unshare --user --mount``): a mount namespace
per job would give each a private view without a uid range, but creating one needs
CAP_SYS_ADMIN or an unprivileged user namespace, and Docker's default seccomp profile
refuses both (``unshare``/``clone`` with namespace flags) inside a container: the compose
worker would need ``seccomp=unconfined`` or ``privileged``, which is more than it gives up
with a uid range. Unprivileged, every job would still be the worker's own uid outside its
namespace, so a file it shares (a checkpoint directory on NFS, /dev/shm) is not walled.
Uids need only CAP_SETUID/SETGID (in Docker's default set) and work the same on a bare
host and under compose; GPUs stay usable since the NVIDIA device nodes are 0666.

A uid is handed to one attempt at a time on the host: a lock file per uid under
``LOCK_DIR`` (shared by every worker on the host; the kernel drops the lock when a worker
dies however it dies). Before a uid is used, and after each attempt under it, whatever
still runs under it is killed and what it left in the host's shared temporary
directories and System V IPC is removed, so one job never finds another's leftovers; the
directories it had are taken back by the worker until its next attempt.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import grp
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker import procs

log = logging.getLogger("ddpq.worker")

DEFAULT_UIDS = (70000, 70999)
LOCK_DIR = Path("/run/ddpq/job-uids")
# What the worker does with them: change to a job's uid (SETUID, SETGID), give it its
# directories (CHOWN) and take them back (DAC_OVERRIDE to read what the job wrote,
# FOWNER to change modes on its files), and stop its processes (KILL).
NEEDED_CAPS = {"chown": 0, "dac_override": 1, "fowner": 3, "kill": 5, "setgid": 6, "setuid": 7}
# Directories every uid may write to: a job's leftovers there are removed after it (only
# ever read with lstat and removed, never followed or written).
SHARED_TMP = tuple(
    Path(p)
    for p in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")  # noqa: S108
)
CHECK_TIMEOUT_S = 60.0


class WallsError(Exception):
    """The worker cannot wall its jobs as asked: the message says why and what to do."""


@dataclass(frozen=True)
class JobUser:
    """The identity an attempt runs under (the worker's own when it is None)."""

    uid: int
    gid: int

    @property
    def name(self) -> str:
        """USER and LOGNAME: the uid has no passwd entry, and getpass.getuser() wants one."""
        return f"ddpq-job-{self.uid}"


def missing_caps() -> list[str]:
    """The capabilities of NEEDED_CAPS this process lacks (none for a full root)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return sorted(NEEDED_CAPS)
    eff = next(
        (int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapEff:")), 0
    )
    return sorted(name for name, bit in NEEDED_CAPS.items() if not eff >> bit & 1)


def parse_range(value: str) -> tuple[int, int] | str:
    """``--job-uids``: 'auto', 'off', or FIRST-LAST (returned as a pair)."""
    v = value.strip().lower()
    if v in ("auto", "off"):
        return v
    first, sep, last = v.partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        raise ValueError(f"--job-uids takes auto, off or FIRST-LAST, not {value!r}") from None
    if not 1000 <= lo <= hi < 2**31 - 1:
        raise ValueError(f"--job-uids {value!r}: a range of uids from 1000 up, FIRST <= LAST")
    return lo, hi


class Walls:
    """The host's walls: a pool of job uids, or none (jobs run as the worker's user)."""

    def __init__(
        self, uids: tuple[int, int] | None, lock_dir: Path = LOCK_DIR, chosen: bool = False
    ) -> None:
        self.uids = uids
        self.lock_dir = lock_dir
        self.chosen = chosen  # unwalled by --job-uids off, not for want of the privilege
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # uid -> the fd holding its lock

    @classmethod
    def configure(cls, value: str, lock_dir: Path = LOCK_DIR) -> Walls:
        """The walls ``--job-uids`` asks for: auto walls when this process may, a range
        walls or refuses (WallsError, naming what is missing)."""
        parsed = parse_range(value)
        if parsed == "off":
            return cls(None, lock_dir, chosen=True)
        missing = missing_caps()
        if parsed == "auto":
            if missing:
                return cls(None, lock_dir)
            parsed = DEFAULT_UIDS
        if missing:
            raise WallsError(
                f"--job-uids {value}: running jobs under their own uids needs root or the "
                f"capabilities {', '.join(c.upper() for c in sorted(NEEDED_CAPS))}; "
                f"this process lacks {', '.join(c.upper() for c in missing)}"
            )
        assert isinstance(parsed, tuple)
        taken = taken_ids(*parsed)
        if taken:
            raise WallsError(
                f"--job-uids {parsed[0]}-{parsed[1]} holds {', '.join(taken[:3])}: jobs would "
                "run as them. Give a range no user or group of this host has"
            )
        return cls(parsed, lock_dir)

    @property
    def walled(self) -> bool:
        return self.uids is not None

    def describe(self) -> str:
        """The worker's one line at start about what walls its jobs."""
        if self.uids is None:
            who = pwd_name(os.geteuid())
            how = (
                "--job-uids off"
                if self.chosen
                else "run the worker as root (or with CAP_SETUID and CAP_SETGID, as the "
                "compose worker) to give each job a uid of its own"
            )
            return (
                f"jobs run as this worker's user ({who}) and are NOT walled from each other "
                f"or from the worker: {how} (docs/security.md)"
            )
        return f"jobs run walled, each under a uid of its own from {self.uids[0]}-{self.uids[1]}"

    # ---- the uid pool ------------------------------------------------------------------

    def _lock_dir(self) -> Path:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.lock_dir

    def _try_lock(self, uid: int) -> int | None:
        fd = os.open(self._lock_dir() / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @contextlib.contextmanager
    def attempt(self, job_id: int) -> Iterator[Held]:
        """What one attempt of ``job_id`` holds: a uid of its own (None when not walled),
        clean on the way in; on the way out its processes and leftovers go, the
        directories it was given come back to the worker, and the uid is free again. The
        search starts where the job's id points, so a job usually gets the same uid on
        every attempt and on every host."""
        if self.uids is None:
            yield Held(self, None)
            return
        held = Held(self, self._take(job_id))
        try:
            yield held
        finally:
            assert held.user is not None
            # First: no process of it may change a directory while it is taken back.
            clean = self.sweep(held.user)
            try:
                for path in held.given:
                    self.take_back(path)
            finally:
                if clean:
                    self._give_back(held.user.uid)
                else:  # held by this worker until it exits: never handed to another job
                    log.error("uid %s kept out of use: its processes survived", held.user.uid)

    def _take(self, job_id: int) -> JobUser:
        assert self.uids is not None
        lo, hi = self.uids
        size = hi - lo + 1
        start = job_id % size
        for i in range(size):
            uid = lo + (start + i) % size
            with self._lock:
                if uid in self._held:
                    continue
            fd = self._try_lock(uid)
            if fd is None:
                continue
            with self._lock:
                self._held[uid] = fd
            user = JobUser(uid, uid)
            if self.sweep(user):  # a worker that died under it may have left processes
                return user
            log.error("uid %s kept out of use: its processes survived", uid)
        raise WallsError(f"every job uid of {lo}-{hi} is in use on this host")

    def _give_back(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)

    def reap(self) -> int:
        """At start: sweep every uid of the range that left something behind (processes,
        files in the shared temporary directories, IPC) and that no live worker holds: a
        worker killed mid-attempt left them; how many uids were swept. One pass over
        /proc and the directories finds them, not one per uid."""
        if self.uids is None:
            return 0
        pool = self._range()
        left = procs.uids_running(pool) | _tmp_owners(pool) | _ipc_owners(pool)
        swept = 0
        for uid in sorted(left):
            fd = self._try_lock(uid)
            if fd is None:  # a live worker's attempt
                continue
            try:
                self.sweep(JobUser(uid, uid))
                swept += 1
            finally:
                os.close(fd)
        return swept

    def sweep(self, user: JobUser) -> bool:
        """Nothing of ``user`` is left on the host: no process, no file in a shared
        temporary directory, no System V IPC object; False if a process survived."""
        gone = procs.kill_uid(user.uid)
        if not gone:
            log.error("processes of uid %s survived SIGKILL", user.uid)
        _remove_owned(user.uid)
        _remove_ipc(user.uid)
        return gone

    # ---- directories -------------------------------------------------------------------

    def give(self, path: Path, user: JobUser | None) -> None:
        """Make ``path`` (a directory the worker made, or took back) the attempt's: its
        own, 0700, and everything in it too. Not walled: nothing changes."""
        if user is None or self.uids is None:
            return
        _chown_tree(path, user.uid, user.gid, self._range(), strip=False)

    def take_back(self, path: Path) -> None:
        """The worker's again, once no process of the job's uid runs: owned by it, and
        nothing in it writable by others or set-uid, so no other job can reach into it
        before it is given again (the top is closed first: 0700)."""
        if self.uids is None or not os.path.lexists(path):
            return
        _chown_tree(path, os.geteuid(), os.getegid(), self._range(), strip=True)

    def take_back_orphans(self, root: Path) -> None:
        """At start: take back the directories under ``root`` (the jobs' code, the
        checkpoints) that a uid of the range still owns and no live worker of this host
        holds: a worker killed mid-attempt left them, and the next job given that uid
        would find them. Those of a live attempt (a shared checkpoint mount, another
        worker) are left alone."""
        if self.uids is None:
            return
        pool = self._range()
        try:
            entries = list(os.scandir(root))
        except OSError:
            return
        for entry in entries:
            try:
                owner = entry.stat(follow_symlinks=False).st_uid
            except OSError:
                continue
            if owner not in pool:
                continue
            fd = self._try_lock(owner)
            if fd is None:
                continue
            try:
                self.take_back(Path(entry.path))
            finally:
                os.close(fd)

    def _range(self) -> range:
        assert self.uids is not None
        return range(self.uids[0], self.uids[1] + 1)

    def open_dirs(self, traverse: list[Path], closed: list[Path], readable: list[Path]) -> None:
        """The modes of the worker's own directories when walled: ``traverse`` (the data
        directory, where the jobs' own directories are) may be passed through but not
        listed, ``closed`` (the content cache) is the worker's alone, ``readable`` (the
        shared environments) every job may read."""
        if self.uids is None:
            return
        for paths, mode in ((traverse, 0o711), (closed, 0o700), (readable, 0o755)):
            for p in paths:
                p.mkdir(parents=True, exist_ok=True)
                os.chown(p, os.geteuid(), os.getegid())
                os.chmod(p, mode)

    # ---- the start check ---------------------------------------------------------------

    def check(
        self,
        python: str,
        reachable: list[Path],
        readable: list[Path],
        protected: list[Path],
        skip: Sequence[Path] = (),
    ) -> None:
        """Refuse (WallsError, with the fix) unless a job's uid can run ``python``, import
        torch and ddpq with it, pass through every directory of ``reachable`` (where its
        own directories are), read every one of ``readable``, and change nothing of
        ``protected`` (the worker's code and environment, whole trees: ``exposed``; what
        is under ``skip``, the worker's data, is the worker's to set)."""
        if self.uids is None:
            return
        with self.attempt(-1) as held:
            user = held.user
            assert user is not None
            plan = {
                "modules": ["torch", "worker.tee", "ddpq.train"],
                "reachable": [str(p) for p in reachable],
                "readable": [str(p) for p in readable],
                "protected": [str(p) for p in protected],
            }
            try:
                done = subprocess.run(
                    [python, "-I", "-c", _CHECK, json.dumps(plan)],
                    user=user.uid,
                    group=user.gid,
                    extra_groups=[],
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"},
                    cwd="/",
                    capture_output=True,
                    text=True,
                    timeout=CHECK_TIMEOUT_S,
                )
            except PermissionError:
                raise WallsError(_cannot_run(python, user.uid)) from None
        if done.returncode != 0:
            if "Permission denied" in done.stderr or done.returncode == 126:
                raise WallsError(_cannot_run(python, user.uid))
            raise WallsError(
                f"a job's uid ({user.uid}) cannot start {python}: {done.stderr.strip()[-500:]}"
            )
        try:
            found = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise WallsError(
                f"a job's uid ({user.uid}) ran {python} but it said nothing readable: "
                f"{(done.stdout + done.stderr).strip()[-500:]}"
            ) from None
        problems = []
        if found["missing"]:
            problems.append(f"cannot import {', '.join(found['missing'])}")
        if found["unreadable"]:
            problems.append(f"cannot read {', '.join(found['unreadable'][:5])}")
        if problems:
            raise WallsError(
                f"jobs run under their own uids (from {user.uid}), which {'; '.join(problems)} "
                f"with {python}. Make every directory on the way readable by others "
                "(chmod o+rX), install ddpq where every user can read it, "
                "or run jobs unwalled with --job-uids off"
            )
        writable = found["writable"] or exposed(protected, self._range(), skip)
        if writable:
            raise WallsError(
                f"a job's uid ({user.uid}) could change {', '.join(writable[:5])}: jobs could "
                "change the code every later job runs. Make it writable by its owner only "
                "(chmod -R go-w), or run jobs unwalled with --job-uids off"
            )


@dataclass
class Held:
    """One attempt's share of the walls: its uid, and the directories given to it."""

    walls: Walls
    user: JobUser | None
    given: list[Path] = field(default_factory=list)

    def own(self, path: Path) -> Path:
        """A real directory at ``path`` (a link or a file a job put there goes, then a
        fresh one is made), the attempt's until it ends."""
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                os.unlink(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            self.given.append(path)  # first: taken back even if giving fails halfway
            self.walls.give(path, self.user)
        return path


def _cannot_run(python: str, uid: int) -> str:
    blocked = _blocked_dir(Path(python))
    where = f" ({blocked} is closed to other users)" if blocked else ""
    return (
        f"jobs run under their own uids (from {uid}), which cannot execute {python}{where}. "
        "Make the worker's environment from a Python every user can run (for example "
        "/usr/bin/python3 -m venv /opt/ddpq && /opt/ddpq/bin/pip install ddpq, or `make "
        "venv`, which prefers Debian's python3.11), or run jobs unwalled with --job-uids off"
    )


def _blocked_dir(path: Path) -> Path | None:
    """The first directory on the way to ``path`` (links followed) that others cannot
    enter."""
    real = Path(os.path.realpath(path))
    for parent in reversed(real.parents):
        with contextlib.suppress(OSError):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return parent
    return None


# Run as a job's uid by Walls.check, with -I (no user site, no PYTHON* variables): what
# of the worker's environment that uid can use. Standard library only, and no torch
# import (2 s): finding its files is what decides.
_CHECK = r"""
import importlib.util, json, os, sys
plan = json.loads(sys.argv[1])
out = {"missing": [], "unreadable": [], "writable": []}
for name in plan["modules"]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is None or not spec.origin or not os.access(spec.origin, os.R_OK):
        out["missing"].append(name)
for p in plan["reachable"]:
    if not os.access(p, os.X_OK):
        out["unreadable"].append(p)
for p in plan["readable"]:
    if not os.access(p, os.R_OK | os.X_OK):
        out["unreadable"].append(p)
for p in plan["protected"]:
    if os.path.exists(p) and os.access(p, os.W_OK):
        out["writable"].append(p)
print(json.dumps(out))
"""


def protected_paths() -> list[Path]:
    """What a job must not be able to change: where the Python it runs finds its modules
    (this process's sys.path, site-packages among them) and the packages it and the
    worker import (ddpq, worker, recipes, torch), wherever they are installed."""
    import importlib.util
    import site

    paths = {Path(p) for p in site.getsitepackages()}
    # The first entry is this process's own directory (``python -m``): not the jobs'.
    paths.update(Path(p) for p in sys.path[1:] if p and os.path.isdir(p))
    for name in ("ddpq", "worker", "recipes", "torch"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            paths.add(Path(spec.origin).parent)
    return sorted(paths)


EXPOSED_LIMIT = 500_000  # entries looked at, at most


def exposed(trees: Sequence[Path], pool: range, skip: Sequence[Path] = ()) -> list[str]:
    """What of ``trees`` (whole, links not followed) and of the directories above them a
    job's uid could change: an entry writable by others (a sticky directory such as /tmp
    above a tree aside) or owned by a job uid. Looked at as this process, from the
    modes: one job uid's probe of the top alone would miss a writable module deep in
    site-packages."""
    skipped = {os.path.realpath(p) for p in skip}
    found: list[str] = []
    seen = 0

    def bad(st: os.stat_result, above: bool) -> bool:
        if st.st_uid in pool:
            return True
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & stat.S_IWOTH:
            return False
        return not (above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX)

    roots = sorted({os.path.realpath(t) for t in trees if os.path.isdir(t)})
    for root in roots:
        if any(root == r or root.startswith(r + os.sep) for r in roots if r != root):
            continue  # walked with the tree it is in
        for parent in Path(root).parents:
            with contextlib.suppress(OSError):
                if bad(os.lstat(parent), above=True):
                    found.append(str(parent))
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skipped]
            for name in [".", *dirs, *files]:
                path = os.path.normpath(os.path.join(top, name))
                seen += 1
                with contextlib.suppress(OSError):
                    if bad(os.lstat(path), above=False):
                        found.append(path)
            if seen > EXPOSED_LIMIT or len(found) > 20:
                return sorted(set(found))
    return sorted(set(found))


# ---- helpers -----------------------------------------------------------------------------


def pwd_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def taken_ids(lo: int, hi: int) -> list[str]:
    """Users or groups of the host inside the job range (a job would become them)."""
    taken = [f"user {p.pw_name} ({p.pw_uid})" for p in pwd.getpwall() if lo <= p.pw_uid <= hi]
    taken += [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if lo <= g.gr_gid <= hi]
    return taken


def _chown_tree(top: Path, uid: int, gid: int, owners: range, *, strip: bool) -> None:
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
