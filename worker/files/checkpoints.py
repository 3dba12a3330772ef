"""Deleting the checkpoints the API lets go (service.checkpoints), on the worker whose
disk holds them, and saying what became of each.

Job code is hostile: a path it registered may lead anywhere (a `..`, a link planted in
its directory, a directory swapped for a link). So a deletion starts from this worker's
own checkpoint root and the job's id (``job-<id>``), never from the path as given; the
registered path only names what lies below that directory, which is walked one
directory at a time without following a link (``O_NOFOLLOW`` on every step); the last
name is deleted only if it is a regular file and, when rank 0 reported them, of the size
and mtime it was registered with (a file written again under that name since is left:
its new registration owns it). Unlinking a name removes that name, never what a link
points to, so a name swapped for a link between the check and the unlink harms nothing
outside. A checkpoint registered as a directory (a framework's) is deleted only as one,
while its stamp (ddpq.wire.tree_stamp, walked by directory fds without following a link)
is the one registered, by ``shutil.rmtree`` from the directory fd above it. An ended
job's directory is removed whole by ``shutil.rmtree``, which on Linux walks by directory
fds and removes links without following them.

Deleting runs on a thread of its own (a slow disk must not hold up heartbeats); what
became of each order is reported with the next heartbeats until one is answered.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any, Literal

from ddpq.errors import WorkerError
from ddpq.messages import PruneOrder
from ddpq.wire import tree_stamp

log = logging.getLogger("ddpq.worker")

Outcome = Literal["deleted", "missing", "refused"]
MAX_REPORTS = 5000  # per heartbeat (the API takes 10,000 of each kind)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def job_dir(root: Path, job_id: int) -> str:
    """A job's checkpoint directory here (as service.queue.rules.checkpoint_dir_of)."""
    return os.path.join(root, f"job-{job_id}")


def _not_followed(exc: OSError, name: str, dir_fd: int | None = None) -> str:
    """Why a directory on the way could not be opened (O_DIRECTORY | O_NOFOLLOW on a
    link fails with ENOTDIR or ELOOP: look at what it is)."""
    try:
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return "is a symbolic link"
    except OSError:
        pass
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        return "is not a directory"
    return exc.strerror or str(exc)


class NotThere(WorkerError):
    """A registered checkpoint's path cannot be walked: missing, or refused (why)."""

    def __init__(self, outcome: Outcome, why: str | None = None) -> None:
        super().__init__(why or outcome)
        self.outcome, self.why = outcome, why


def walk_to(root: Path, job_id: int, path: str) -> tuple[int, str]:
    """The directory fd holding a registered checkpoint's last name, and that name: walked
    from this worker's checkpoint root and ``job-<id>``, never through a link; NotThere
    if it cannot be. The caller closes the fd."""
    top = job_dir(root, job_id)
    norm = os.path.normpath(path)
    rel = os.path.relpath(norm, top) if os.path.isabs(norm) else os.pardir
    parts = rel.split(os.sep)
    if rel == os.curdir or any(p in ("", os.curdir, os.pardir) for p in parts):
        raise NotThere("refused", f"{path[:300]} is not inside {top}")
    try:
        fd = os.open(top, _DIR_FLAGS)
    except FileNotFoundError:
        raise NotThere("missing") from None
    except OSError as exc:
        raise NotThere("refused", f"{top} {_not_followed(exc, top)}") from None
    for i, name in enumerate(parts[:-1]):
        try:
            inner = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            os.close(fd)
            raise NotThere("missing") from None
        except OSError as exc:
            where = os.path.join(top, *parts[: i + 1])
            why = f"{where} {_not_followed(exc, name, fd)}"
            os.close(fd)
            raise NotThere("refused", why) from None
        os.close(fd)
        fd = inner
    return fd, parts[-1]


def delete_checkpoint(root: Path, order: PruneOrder) -> tuple[Outcome, str | None]:
    """Delete one registered checkpoint, a file or a directory, if it is still what was
    registered and lies, without a link on the way, inside the job's checkpoint directory
    here."""
    try:
        fd, name = walk_to(root, order.job_id, order.path)
    except NotThere as exc:
        return exc.outcome, exc.why
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return "missing", None
        if stat.S_ISLNK(st.st_mode):
            return "refused", "a symbolic link, not a file ddpq.train wrote"
        if order.kind == "dir":
            return _delete_directory(fd, name, st, order)
        if not stat.S_ISREG(st.st_mode):
            return "refused", "not a regular file"
        if (order.bytes is not None and st.st_size != order.bytes) or (
            order.mtime_ns is not None and st.st_mtime_ns != order.mtime_ns
        ):
            return "refused", "written again since it was registered (its size or mtime differ)"
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return "missing", None
        return "deleted", None
    finally:
        os.close(fd)


def _delete_directory(
    fd: int, name: str, st: os.stat_result, order: PruneOrder
) -> tuple[Outcome, str | None]:
    """Remove directory ``name`` under directory fd ``fd`` while it is the one registered."""
    if not stat.S_ISDIR(st.st_mode):
        return "refused", "not a directory (it was registered as one)"
    size, mtime_ns = tree_stamp(name, dir_fd=fd)
    if (order.bytes is not None and size != order.bytes) or (
        order.mtime_ns is not None and mtime_ns != order.mtime_ns
    ):
        return "refused", "written again since it was registered (its bytes or mtimes differ)"
    if not shutil.rmtree.avoids_symlink_attacks:
        return "refused", "this platform's rmtree may follow links"
    try:
        shutil.rmtree(name, dir_fd=fd)
    except FileNotFoundError:
        return "missing", None
    except OSError as exc:  # e.g. swapped for a link meanwhile: rmtree refuses one
        return "refused", f"{order.path[:300]}: {exc.strerror or exc}"
    return "deleted", None


def drop_directory(root: Path, job_id: int) -> tuple[Outcome, str | None]:
    """Remove an ended job's checkpoint directory here, whatever the job left in it."""
    top = job_dir(root, job_id)
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return "missing", None
    if stat.S_ISLNK(st.st_mode):
        # The name is this worker's; what it points to is not: only the link goes.
        os.unlink(top)
        return "refused", f"{top} was a symbolic link: the link was removed, not what it named"
    if not stat.S_ISDIR(st.st_mode):
        return "refused", f"{top} is not a directory"
    if not shutil.rmtree.avoids_symlink_attacks:
        return "refused", "this platform's rmtree may follow links"
    try:
        shutil.rmtree(top)
    except OSError as exc:
        return "refused", f"{top}: {exc.strerror or exc}"
    return "deleted", None


class Pruner:
    """The worker's deletions: orders in from heartbeat replies, reports out with the
    next heartbeats. An order is done once: it stays known from the reply that asked
    for it until a heartbeat carrying its report is answered."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cond = threading.Condition()
        self._todo: collections.deque[tuple[str, Any]] = collections.deque()
        self._known: set[tuple[str, int]] = set()  # asked, not yet reported and answered
        self._pruned: list[dict[str, Any]] = []
        self._dropped: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None

    def take(self, prune: list[PruneOrder], drop: list[int], running: set[int]) -> None:
        """Queue what a heartbeat's reply asks (a job with an attempt running here keeps
        its directory whatever the reply says: it is asked again later)."""
        with self._cond:
            for order in prune:
                if ("prune", order.id) not in self._known:
                    self._known.add(("prune", order.id))
                    self._todo.append(("prune", order))
            for job_id in drop:
                if job_id not in running and ("drop", job_id) not in self._known:
                    self._known.add(("drop", job_id))
                    self._todo.append(("drop", job_id))
            if self._todo and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pruner", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def reports(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """What to tell the API with the next heartbeat."""
        with self._cond:
            return self._pruned[:MAX_REPORTS], self._dropped[:MAX_REPORTS]

    def answered(self, pruned: list[dict[str, Any]], dropped: list[dict[str, Any]]) -> None:
        """A heartbeat carrying these reports was answered: forget them."""
        with self._cond:
            for p in pruned:
                self._pruned.remove(p)
                self._known.discard(("prune", p["id"]))
            for d in dropped:
                self._dropped.remove(d)
                self._known.discard(("drop", d["job_id"]))

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is left to delete (for tests and a stopping worker)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._todo, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._todo))
                kind, what = self._todo[0]
            try:
                if kind == "prune":
                    outcome, why = delete_checkpoint(self.root, what)
                    report = {"id": what.id, "outcome": outcome, "why": why}
                else:
                    outcome, why = drop_directory(self.root, what)
                    report = {"job_id": what, "outcome": outcome, "why": why}
            except Exception as exc:  # never let one bad file stop the rest
                log.exception("deleting checkpoints: %s %s failed", kind, what)
                key = {"id": what.id} if kind == "prune" else {"job_id": what}
                report = {**key, "outcome": "refused", "why": f"failed: {exc}"[:500]}
                outcome, why = "refused", report["why"]
            if outcome == "refused":
                log.warning("job checkpoints: not deleted (%s): %s", kind, why)
            elif kind == "drop":
                log.info("job %s: checkpoint retention over, its directory removed", what)
            with self._cond:
                self._todo.popleft()
                (self._pruned if kind == "prune" else self._dropped).append(report)
                self._cond.notify_all()
