"""Each user's caches on this worker (docs/jobs.md): what inductor and Triton compiled, what
Hugging Face's and torch hub's downloads fetched, matplotlib's config, kept across that
user's jobs here instead of starting empty in every attempt's fresh HOME.

One directory per user, ``DATA_DIR/caches/USER/cache``, which the ranks' variables point
into (``CACHE_VARS``: ``TORCHINDUCTOR_CACHE_DIR`` is ``.../cache/inductor``, and so on),
behind a gate of the worker's own (``DATA_DIR/caches/USER``):

- Walled (worker.walled.walls), an attempt runs under a uid of its own, and inductor and Triton
  make their directories 0700: a cache shared by path breaks in the next job (another
  uid). So the cache is *lent*: at the attempt's start it is handed to the attempt's uid
  (worker.walled.handover, as its own directories are), and the gate opened to that uid's group
  alone (0710: the job's processes have that gid and no other; a job that opens its cache
  to everyone still opens nothing behind a gate it does not own). At the end, once no
  process of the uid is left (worker.walled.walls runs ``Held.end`` after its sweep, before the
  uid can go to any other job), the gate is closed first (the worker's, 0700), then the
  cache taken back, walked by directory fds without following a link: what the job left
  there that is not a plain file, a directory or a symbolic link (a FIFO, a socket), a
  file with a second name (a hard link could name someone else's file), anything owned
  by a uid neither the worker's nor the pool's, is removed; set-uid and group/other
  write bits are cleared, and everything becomes the worker's. Then least recently used
  files go while it is over the cap. The worker only ever stats, chowns, chmods and
  unlinks in a cache: it never reads what a job wrote there, so nothing planted reaches
  it, and a user's cache is only ever lent to that user's own jobs.
- A cache that cannot be taken back safely is discarded, never trusted: the uid's
  processes survived the sweep (one may hold a file open for writing), the walk met more
  than ``MAX_ENTRIES`` entries or a tree deeper than ``MAX_DEPTH``, or anything failed.
  Discarding renames the gate into ``.discard/`` (the worker's, where no uid reaches)
  and removes it there, on a thread of its own. A marker in ``.lent/`` says a cache is
  out; a worker that died with one out discards it at its next start.
- Two attempts of one user at once on this worker: the first holds the cache, the second
  runs with an empty one in its own scratch (dropped with it) and its log says so. One
  directory cannot belong to two uids, a group shared by two attempts would let each
  write what the other is running (and a uid shared per user would break the sweep by
  uid), and copying a cache for the second costs what the cache saves.
- Unwalled, every job runs as the worker's user: the caches are still per user and
  lent one attempt at a time, but they are no wall (docs/security.md).

What each cache holds (bytes, files, last used) goes to the API with a heartbeat, only
when it changed; the API's replies carry clear orders (``ddpq cache clear``), done here
and reported back (service.caches owns the rule).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import getpass
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpq.messages import AttemptKey, CacheClearOrder
from worker.walled import handover
from worker.walled.handover import Untrusted, Walked
from worker.walled.walls import Held, JobUser, Walls

log = logging.getLogger("ddpq.worker")

# The variables the ranks get, each a directory of the user's cache.
CACHE_VARS: dict[str, str] = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "HF_HOME": "huggingface",
    "TORCH_HOME": "torch",
    "MPLCONFIGDIR": "matplotlib",
}
# inductor keeps its precompiled headers (and a few caches more) in its default directory,
# TMPDIR/torchinductor_USER, whatever TORCHINDUCTOR_CACHE_DIR says (torch 2.14:
# codecache._HEADER_DIR): without them a cached graph still costs a header's compilation
# (about 15 s here). A link there in the attempt's scratch keeps them in the cache too.
INDUCTOR_TMP = "inductor-tmp"
# Bounds on what taking a cache back walks: past either, the cache is discarded (a
# job's hub and compile caches hold thousands of files, a dozen levels deep at most).
MAX_ENTRIES = 200_000
MAX_DEPTH = 64
MAX_REPORTED = 1000  # caches one heartbeat reports (the most recently used)
MAX_IDLE_S = 10 * 366 * 86400  # the API's bound on a report's idle_s
DONE_KEPT = 10_000  # clear orders remembered as done (another API process may ask again)
LENT, DISCARD = ".lent", ".discard"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


@dataclass
class Usage:
    """What one user's cache holds, and when an attempt last gave it back (epoch s)."""

    bytes: int = 0
    files: int = 0
    last_used: float = 0.0


@dataclass
class Lease:
    """The cache an attempt runs with: its user's (``kept``), or an empty one of its own
    in its scratch, dropped with it."""

    user: str | None
    path: Path
    kept: bool
    job_id: int = 0
    attempt: int = 0
    broken: bool = False  # not handed over whole: discarded at the end

    def env(self) -> dict[str, str]:
        """The ranks' variables (worker.starting.torchrun.Placement.cache_env)."""
        return {var: str(self.path / sub) for var, sub in CACHE_VARS.items()}


def plain_name(name: str | None) -> bool:
    """A user's name as a directory of its own: one plain path component, not hidden
    (the API's names are `[a-z0-9][a-z0-9._-]*`; this only keeps the path safe)."""
    return (
        bool(name)
        and name is not None
        and len(name) <= 64
        and not name.startswith(".")
        and "/" not in name
        and "\x00" not in name
    )


class Caches:
    """This worker's users' caches under ``root`` (DATA_DIR/caches), each capped at
    ``cap_bytes`` (0: none kept, jobs' variables are not set, as before caches)."""

    def __init__(self, root: Path, cap_bytes: int, walls: Walls) -> None:
        self.root = root
        self.cap_bytes = max(0, int(cap_bytes))
        self.walls = walls
        self._lock = threading.Lock()
        self._usage: dict[str, Usage] = {}
        self._lent: dict[str, AttemptKey] = {}  # user -> the attempt holding it
        # One per user: lending, taking back and clearing a cache never overlap.
        self._guards: dict[str, threading.Lock] = {}
        self._clear_at_end: dict[str, list[int]] = {}  # orders that wait for an attempt
        self._cleared: list[dict[str, Any]] = []  # reports for the next heartbeats
        self._done: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._version = 0
        self._answered: int | None = None
        self._started = False
        self._purging = threading.Event()
        self._purged = threading.Condition()
        self._purger: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    # ---- where ---------------------------------------------------------------------

    def gate(self, user: str) -> Path:
        return self.root / user

    def path(self, user: str) -> Path:
        """Where the variables of ``user``'s jobs point (CACHE_VARS below it)."""
        return self.root / user / "cache"

    def _guard(self, user: str) -> threading.Lock:
        with self._lock:
            return self._guards.setdefault(user, threading.Lock())

    def _owners(self) -> range:
        """Who may own what is in a cache: the worker, and walled, the pool's uids."""
        me = os.geteuid()
        if self.walls.uids is None:
            return range(me, me + 1)
        lo, hi = self.walls.uids
        return range(lo, hi + 1)

    # ---- the worker's start -------------------------------------------------------------

    def start(self) -> None:
        """Before the first attempt: the root with its modes, each cache measured (and
        taken back as at an attempt's end), those left lent by a worker that died (or
        that fail the walk) discarded. Caches off: nothing here is touched."""
        if not self.enabled:
            return
        me, group = os.geteuid(), os.getegid()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chown(self.root, me, group)
        os.chmod(self.root, 0o711 if self.walls.walled else 0o700)
        for sub in (LENT, DISCARD):
            self._own_dir(self.root / sub)
        lent = set(os.listdir(self.root / LENT))
        for name in sorted(os.listdir(self.root)):
            if name in (LENT, DISCARD):
                continue
            if not plain_name(name) or name in lent:
                why = "left lent by a worker that stopped" if name in lent else "not a cache"
                self._discard(name, why)
                continue
            try:
                self._own_dir(self.gate(name))
                usage = self._take_back(name, evict=True)
            except (OSError, Untrusted) as exc:
                self._discard(name, str(exc))
                continue
            usage.last_used = os.lstat(self.gate(name)).st_mtime
            self._usage[name] = usage
        for name in lent:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / LENT / name)
        with self._lock:
            self._started = True
            self._version += 1
        self._purge_later()

    def _own_dir(self, path: Path) -> None:
        """A real directory of the worker's at ``path``, 0700 (anything else there goes)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            st = None
        if st is None:
            path.mkdir(mode=0o700)
        os.chown(path, os.geteuid(), os.getegid(), follow_symlinks=False)
        os.chmod(path, 0o700)

    # ---- an attempt --------------------------------------------------------------------

    def lend(
        self, owner: str | None, held: Held, scratch: Path, job_id: int, attempt: int
    ) -> tuple[Lease, str | None]:
        """The cache of ``owner`` for an attempt that holds ``held`` (worker.walled.walls), given
        to its uid until ``held`` ends; or, when another attempt of theirs holds it (or
        it could not be handed over), an empty one in ``scratch``, with the words for
        the job's log."""
        cold = Lease(owner, scratch / "cache", False, job_id, attempt)
        if not self.enabled or not self._started or not plain_name(owner):
            return cold, None
        assert owner is not None
        with self._guard(owner):
            return self._lend(owner, held, cold)

    def _lend(self, owner: str, held: Held, cold: Lease) -> tuple[Lease, str | None]:
        with self._lock:
            holder = self._lent.get(owner)
            if holder is None:
                self._lent[owner] = AttemptKey(cold.job_id, cold.attempt)
        if holder is not None:
            return cold, (
                f"[ddpq] the cache of {owner} on this worker is in use by job {holder.job_id} "
                f"(attempt {holder.attempt}): this attempt starts with an empty cache of its own, "
                "dropped when it ends\n"
            )
        lease = Lease(owner, self.path(owner), True, cold.job_id, cold.attempt)
        try:
            # First: a worker that dies from here on discards this cache at its start.
            (self.root / LENT / owner).touch(mode=0o600)
        except OSError as exc:
            with self._lock:
                self._lent.pop(owner, None)
            log.warning("cache of %s: not lent (%s)", owner, exc)
            return cold, f"[ddpq] the cache of {owner} could not be lent: {exc}; starting empty\n"
        held.at_end.append(functools.partial(self._settle, lease))
        try:
            self._give(owner, held.user)
        except (OSError, Untrusted) as exc:  # discarded at the end, never half given
            lease.broken = True
            log.warning("cache of %s: not handed over (%s)", owner, exc)
            return cold, f"[ddpq] the cache of {owner} could not be handed over; starting empty\n"
        try:
            self._link_inductor_tmp(lease, cold.path.parent, held.user)
        except OSError as exc:  # the headers are compiled again, in the scratch
            log.warning("cache of %s: inductor's headers not linked (%s)", owner, exc)
        return lease, None

    def _link_inductor_tmp(self, lease: Lease, scratch: Path, to: JobUser | None) -> None:
        """TMPDIR/torchinductor_USER (``scratch`` is TMPDIR; USER the attempt's, as
        getpass.getuser() finds it in the ranks' environment) a link into the cache, the
        job's own. A job whose env sets TMPDIR or USER itself only misses the link."""
        who = to.name if to is not None else getpass.getuser()
        link = scratch / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", who))
        target = lease.path / INDUCTOR_TMP
        with contextlib.suppress(FileExistsError):
            target.mkdir(mode=0o700)
        link.symlink_to(target)
        if to is not None:
            os.chown(target, to.uid, to.gid, follow_symlinks=False)
            os.chown(link, to.uid, to.gid, follow_symlinks=False)

    def _give(self, user: str, to: JobUser | None) -> None:
        """The gate open to ``to``'s group alone, the cache its uid's (walled)."""
        gate, cache = self.gate(user), self.path(user)
        self._own_dir(gate)
        with contextlib.suppress(FileExistsError):
            cache.mkdir(mode=0o700)
        if not stat.S_ISDIR(os.lstat(cache).st_mode):
            raise Untrusted(f"{cache} is not a directory")
        if to is None:
            return
        handover.chown_tree(cache, to.uid, to.gid, self._owners(), strip=False)
        os.chown(gate, os.geteuid(), to.gid, follow_symlinks=False)
        os.chmod(gate, 0o710)  # noqa: S103 (its group is the attempt's alone)

    def _settle(self, lease: Lease, clean: bool) -> bool:
        """An attempt's end (worker.walled.walls: its processes swept, its uid not yet free):
        the cache taken back, trimmed to the cap and measured; or discarded when it
        cannot be taken back safely (``clean``: no process of the uid survived), or a
        clear waits for it. False if it could be neither (the uid stays out of use)."""
        user = lease.user
        assert user is not None
        with self._guard(user):
            return self._take_back_lent(lease, user, clean)

    def _take_back_lent(self, lease: Lease, user: str, clean: bool) -> bool:
        with self._lock:
            clears = self._clear_at_end.pop(user, [])
        try:
            self._own_dir(self.gate(user))  # closed first: no uid passes from here on
            if not clean:
                raise Untrusted("a process of its attempt survived the sweep")
            if lease.broken:
                raise Untrusted("it was not handed over whole")
            if clears:
                raise Untrusted("a clear was asked while it was in use")
            usage = self._take_back(user, evict=True)
            os.utime(self.gate(user))  # when it was last used: the worker's own mark
            usage.last_used = time.time()
            kept: Usage | None = usage
        except (OSError, Untrusted) as exc:
            kept = None
            if not clears:
                log.warning("cache of %s discarded: %s", user, exc)
            try:
                self._discard(user, str(exc), quiet=True)
            except OSError:
                log.exception("cache of %s: could not be discarded", user)
                return False  # the marker stays: the next start discards it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / LENT / user)
        with self._lock:
            self._lent.pop(user, None)
            if kept is None:
                self._usage.pop(user, None)
            else:
                self._usage[user] = kept
            for order in clears:
                self._report_cleared(order, "cleared")
            self._version += 1
        return True

    # ---- taking back, trimming, discarding -------------------------------------------

    def _take_back(self, user: str, evict: bool) -> Usage:
        """The cache the worker's again (worker.walled.handover.take_back_strictly; Untrusted:
        not to be kept), trimmed to the cap (least recently used files first) when
        ``evict``."""
        top = self.path(user)
        walked = handover.take_back_strictly(top, self._owners(), MAX_ENTRIES, MAX_DEPTH)
        if evict and walked.bytes > self.cap_bytes:
            _evict(top, walked, self.cap_bytes)
        return Usage(walked.bytes, len(walked.files))

    def _discard(self, user: str, why: str, quiet: bool = False) -> None:
        """Move ``user``'s gate out of every job's reach (into .discard/) and have it
        removed there; what was in it is never used again."""
        src = self.root / user
        if not os.path.lexists(src):
            return
        if not quiet:
            log.warning("cache %s discarded: %s", user, why)
        os.rename(src, self.root / DISCARD / f"{user}-{secrets.token_hex(6)}")
        self._purge_later()

    def _purge_later(self) -> None:
        """Remove what is in .discard/ on a thread of its own (a big cache takes a while)."""
        self._purging.set()
        with self._lock:
            if self._purger is not None:
                return
            self._purger = threading.Thread(target=self._purge, name="caches", daemon=True)
            self._purger.start()

    def _purge(self) -> None:
        where = self.root / DISCARD
        while True:
            self._purging.wait()
            self._purging.clear()
            for name in os.listdir(where) if where.is_dir() else []:
                try:  # by directory fds, removing links without following them
                    shutil.rmtree(where / name)
                except (OSError, RecursionError) as exc:
                    with contextlib.suppress(OSError):  # not a directory
                        os.unlink(where / name)
                    if os.path.lexists(where / name):
                        log.warning("cache %s: not removed yet (%s)", name, exc)
            with self._purged:
                self._purged.notify_all()

    def wait_purged(self, timeout: float) -> bool:
        """True once .discard/ is empty (tests)."""
        where = self.root / DISCARD
        with self._purged:
            self._purging.set()
            return self._purged.wait_for(lambda: not os.listdir(where), timeout)

    # ---- the heartbeat: reports out, clear orders in ---------------------------------

    def report(self) -> tuple[int, list[dict[str, Any]]] | None:
        """Every cache here (the most recently used MAX_REPORTED), when they changed since
        the last report a heartbeat's answer took; None when they did not."""
        with self._lock:
            if not self._started or self._version == self._answered:
                return None
            now = time.time()
            ranked = sorted(self._usage.items(), key=lambda kv: -kv[1].last_used)
            items = [
                {
                    "user": user,
                    "bytes": u.bytes,
                    "files": u.files,
                    "idle_s": round(min(MAX_IDLE_S, max(0.0, now - u.last_used)), 3),
                }
                for user, u in ranked[:MAX_REPORTED]
            ]
            return self._version, items

    def cleared(self) -> list[dict[str, Any]]:
        """What became of the clear orders done since the last answered heartbeat."""
        with self._lock:
            return list(self._cleared)

    def answered(self, version: int | None, cleared: Iterable[dict[str, Any]]) -> None:
        """A heartbeat carrying this report (its ``version``) and ``cleared`` was answered."""
        with self._lock:
            if version is not None:
                self._answered = version
            for c in cleared:
                with contextlib.suppress(ValueError):
                    self._cleared.remove(c)

    def registered(self) -> None:
        """Registered (again): the API may have forgotten this worker's caches."""
        with self._lock:
            self._answered = None

    def clear(self, orders: Iterable[CacheClearOrder]) -> None:
        """Do what a heartbeat's reply asks: a user's cache cleared now, or at the end of
        the attempt that holds it. An order already done or waiting is not done again."""
        for order in orders:
            if not plain_name(order.user):
                with self._lock:
                    self._report_cleared(order.id, "missing")
                continue
            with self._guard(order.user):
                self._clear(order)

    def _clear(self, order: CacheClearOrder) -> None:
        with self._lock:
            waiting = any(order.id in ids for ids in self._clear_at_end.values())
            if order.id in self._done or waiting:
                return
            if order.user in self._lent:
                self._clear_at_end.setdefault(order.user, []).append(order.id)
                return
            known = order.user in self._usage
        outcome = "missing"
        if self._started and os.path.lexists(self.gate(order.user)):
            try:
                self._discard(order.user, "cleared", quiet=True)
            except OSError as exc:
                log.warning("cache of %s: not cleared (%s)", order.user, exc)
                return  # asked again by the next reply
            outcome = "cleared"
            log.info("cache of %s cleared (order %s)", order.user, order.id)
        with self._lock:
            if known:
                self._usage.pop(order.user, None)
                self._version += 1
            self._report_cleared(order.id, outcome)

    def _report_cleared(self, order_id: int, outcome: str) -> None:
        """(Under the lock.)"""
        self._cleared.append({"id": order_id, "outcome": outcome})
        self._done[order_id] = None
        while len(self._done) > DONE_KEPT:
            self._done.popitem(last=False)

    def usage(self) -> dict[str, Usage]:
        with self._lock:
            return dict(self._usage)


# ---- the cap ------------------------------------------------------------------------------


def _evict(top: Path, walked: Walked, cap: int) -> None:
    """Unlink the least recently used files (their atime or mtime, whichever is later)
    until what stays is within ``cap``; ``walked`` counts what stays afterwards."""
    over = walked.bytes - cap
    going: dict[tuple[str, ...], list[str]] = collections.defaultdict(list)
    kept = []
    for item in sorted(walked.files, key=lambda f: (f[0], -f[1])):
        if over > 0:
            going[item[2]].append(item[3])
            over -= item[1]
            walked.bytes -= item[1]
        else:
            kept.append(item)
    walked.files = kept
    for rel, names in going.items():
        fds = [os.open(top, _DIR)]
        try:
            for part in rel:
                fds.append(os.open(part, _DIR, dir_fd=fds[-1]))
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fds[-1])
        finally:
            for fd in fds:
                os.close(fd)
