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
Uids need only the capabilities of ``NEEDED_CAPS``, all in Docker's default set, and work
the same on a bare host and under compose; GPUs stay usable where the NVIDIA device nodes
are 0666 (the driver's default), which the start check makes sure of.

A uid is handed to one attempt at a time on the host: a lock file per uid under
``LOCK_DIR`` (shared by every worker on the host; the kernel drops the lock when a worker
dies however it dies). Before a uid is used, and after each attempt under it, whatever
still runs under it is killed and what it left in the host's shared temporary
directories and System V IPC is removed, so one job never finds another's leftovers; the
directories it had are taken back by the worker until its next attempt.

This module is the pool: which uids, their locks, what an attempt holds and when it is
given and taken back. What a uid leaves behind and its removal is worker.walled.leftovers; the
owners and modes of a directory handed over and taken back, worker.walled.handover; the check
at start that a job's uid can run jobs and change nothing of the worker's,
worker.walled.startcheck.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import pwd
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddpq.errors import WallsError
from worker.edges import procs
from worker.walled import handover, leftovers, startcheck

# What the agent checks a job's uid cannot change (worker.walled.startcheck), named here too.
from worker.walled.startcheck import protected_paths as protected_paths

log = logging.getLogger("ddpq.worker")

DEFAULT_UIDS = (70000, 70999)
LOCK_DIR = Path("/run/ddpq/job-uids")
# What the worker does with them: change to a job's uid (SETUID, SETGID), give it its
# directories (CHOWN) and take them back (DAC_OVERRIDE to read what the job wrote,
# FOWNER to change modes on its files), and stop its processes (KILL).
NEEDED_CAPS = {"chown": 0, "dac_override": 1, "fowner": 3, "kill": 5, "setgid": 6, "setuid": 7}


def caps_text(caps: Sequence[str] = tuple(NEEDED_CAPS)) -> str:
    """``caps`` as the worker names them to people: CHOWN, DAC_OVERRIDE, ... and SETUID."""
    names = [c.upper() for c in sorted(caps)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


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
                f"capabilities {caps_text()}; this process lacks {caps_text(missing)}"
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
                else f"run the worker as root (or with the capabilities {caps_text()}, as "
                "the compose worker) to give each job a uid of its own"
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
            held = Held(self, None)
            try:
                yield held
            finally:
                held.end(True)
            return
        held = Held(self, self._take(job_id))
        try:
            yield held
        finally:
            assert held.user is not None
            # First: no process of it may change a directory while it is taken back.
            clean = leftovers.remove(held.user.uid)
            try:
                for path in held.given:
                    self.take_back(path)
            finally:
                # What it was lent comes back before the uid can go to another attempt.
                safe = held.end(clean)
                if clean and safe:
                    self._give_back(held.user.uid)
                else:  # held by this worker until it exits: never handed to another job
                    why = "its processes survived" if not clean else "what it was lent stayed"
                    log.error("uid %s kept out of use: %s", held.user.uid, why)

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
            if leftovers.remove(uid):  # a worker that died under it may have left processes
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
        left = leftovers.owners(pool)
        swept = 0
        for uid in sorted(left):
            fd = self._try_lock(uid)
            if fd is None:  # a live worker's attempt
                continue
            try:
                leftovers.remove(uid)
                swept += 1
            finally:
                os.close(fd)
        return swept

    # ---- directories -------------------------------------------------------------------

    def give(self, path: Path, user: JobUser | None) -> None:
        """Make ``path`` (a directory the worker made, or took back) the attempt's: its
        own, 0700, and everything in it too. Not walled: nothing changes."""
        if user is None or self.uids is None:
            return
        handover.chown_tree(path, user.uid, user.gid, self._range(), strip=False)

    def take_back(self, path: Path) -> None:
        """The worker's again, once no process of the job's uid runs: owned by it, and
        nothing in it writable by others or set-uid, so no other job can reach into it
        before it is given again (the top is closed first: 0700)."""
        if self.uids is None or not os.path.lexists(path):
            return
        handover.chown_tree(path, os.geteuid(), os.getegid(), self._range(), strip=True)

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
        devices: Sequence[Path] = (),
    ) -> None:
        """The start check (worker.walled.startcheck): refuse (WallsError, with the fix) unless
        a job's uid can run ``python``, import torch and ddpq with it, pass through every
        directory of ``reachable`` (where its own directories are), read every one of
        ``readable``, open every one of ``devices`` (its GPUs' nodes:
        startcheck.gpu_devices), and change nothing of ``protected`` (the worker's code
        and environment, whole trees; what is under ``skip``, the worker's data, is the
        worker's to set)."""
        if self.uids is None:
            return
        with self.attempt(-1) as held:
            user = held.user
            assert user is not None
            done = startcheck.probe(
                python, user.uid, user.gid, reachable, readable, protected, devices
            )
        problem = startcheck.verdict(python, user.uid, done, protected, self._range(), skip)
        if problem:
            raise WallsError(problem)


@dataclass
class Held:
    """One attempt's share of the walls: its uid, and the directories given to it."""

    walls: Walls
    user: JobUser | None
    given: list[Path] = field(default_factory=list)
    # What runs as the attempt ends, once its processes are swept and its directories
    # taken back, before its uid is free (worker.files.caches takes a user's cache back): each
    # gets whether no process survived, and answers whether the uid may go on.
    at_end: list[Callable[[bool], bool]] = field(default_factory=list)

    def end(self, clean: bool) -> bool:
        """Run ``at_end``, each once; False if one left the uid unsafe to hand on."""
        safe = True
        while self.at_end:
            step = self.at_end.pop(0)
            try:
                safe = step(clean) and safe
            except Exception:
                log.exception("an attempt's end failed")
                safe = False
        return safe

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

    @contextlib.contextmanager
    def lend(self, path: Path) -> Iterator[int | None]:
        """``path`` (a directory the worker made) the attempt's uid's while the block runs,
        which gets that uid (None, unwalled: nothing changes); then nothing the uid started
        stays behind to change it later, and it is the worker's again (a requirements
        build's environment: worker.starting.venvs)."""
        if self.user is None:
            yield None
            return
        self.walls.give(path, self.user)
        try:
            yield self.user.uid
        finally:
            procs.kill_uid(self.user.uid)
            self.walls.take_back(path)


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
