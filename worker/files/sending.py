"""Sending a checkpoint this worker holds to the API, for a job that forks from it on
another worker, or a download (service.queue.forks).

The checkpoint's content is the job's, so hostile. It is reached as a deletion reaches
one (worker.files.checkpoints.walk_to: from this worker's checkpoint root and the job's id,
one directory at a time, no link followed) and sent only if it is still what rank 0
registered (a file's size and mtime, a directory's stamp). It goes as a code snapshot,
the way a job's outputs do (worker.files.outputs: every file read by directory fds with
O_NOFOLLOW, within the outputs limits the API gives); a checkpoint that does not fit
them whole, or has a file the snapshot rules refuse, is not sent at all, and the words
say why: a partial checkpoint would resume wrong.

Sending runs on a thread of its own (a large file must not hold up heartbeats); what
became of each order is reported with the next heartbeats until one is answered.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from ddpq.errors import ApiRefused, ApiUnavailable, JobError, WorkerError
from ddpq.messages import ClaimedJob, ForkSource, SendOrder
from ddpq.rules import checkpoint_words
from ddpq.snapshot import Entry, human_bytes
from ddpq.wire import tree_stamp
from worker.edges.api import WorkerAPI, retry
from worker.files.checkpoints import MAX_REPORTS, NotThere, walk_to
from worker.files.code import BlobCache, fetched, write_tree
from worker.files.outputs import DIR_FLAGS, Captured, Limits, capture, digest_under, send

log = logging.getLogger("ddpq.worker")


class Refused(WorkerError):
    """Why a checkpoint is not sent, in words for the fork's reason."""


def send_checkpoint(root: Path, api: WorkerAPI, order: SendOrder) -> str:
    """Send one registered checkpoint as a code snapshot: its id; Refused (why) if it
    is gone, changed, or does not fit the API's limits whole."""
    lim = Limits(**retry(api.outputs_limits, what="checkpoints: ask the limits"))
    try:
        fd, name = walk_to(root, order.job_id, order.path)
    except NotThere as exc:
        raise Refused(exc.why or "it is no longer on its worker's disk") from None
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise Refused("it is no longer on its worker's disk") from None
        if stat.S_ISLNK(st.st_mode):
            raise Refused("a symbolic link, not a checkpoint ddpq.train wrote")
        if order.kind == "dir":
            # Its files under its name, as a file's is: whoever writes it out (a fork's
            # worker, a download) gets NAME either way.
            captured, top, under = (*_directory(fd, name, st, order, lim), name)
        else:
            captured, top, under = (*_file(fd, name, st, order, lim), "")
        try:
            sid, captured = send(api, top, captured, lim.max_file_bytes, under)
        finally:
            os.close(top)
    finally:
        os.close(fd)
    if captured.left or sid is None:
        raise Refused(_left_words(captured) or "it holds nothing to send")
    return sid


def _directory(
    fd: int, name: str, st: os.stat_result, order: SendOrder, lim: Limits
) -> tuple[Captured, int]:
    if not stat.S_ISDIR(st.st_mode):
        raise Refused("not a directory (it was registered as one)")
    size, mtime_ns = tree_stamp(name, dir_fd=fd)
    if (order.bytes is not None and size != order.bytes) or (
        order.mtime_ns is not None and mtime_ns != order.mtime_ns
    ):
        raise Refused("written again since it was registered (its bytes or mtimes differ)")
    top = os.open(name, DIR_FLAGS, dir_fd=fd)
    captured = capture(top, {}, lim)
    if captured.left or captured.left_more:
        os.close(top)
        raise Refused(_left_words(captured))
    return captured, top


def _file(
    fd: int, name: str, st: os.stat_result, order: SendOrder, lim: Limits
) -> tuple[Captured, int]:
    if not stat.S_ISREG(st.st_mode):
        raise Refused("not a regular file")
    if (order.bytes is not None and st.st_size != order.bytes) or (
        order.mtime_ns is not None and st.st_mtime_ns != order.mtime_ns
    ):
        raise Refused("written again since it was registered (its size or mtime differ)")
    if st.st_size > min(lim.max_file_bytes, lim.max_bytes):
        most = human_bytes(min(lim.max_file_bytes, lim.max_bytes))
        raise Refused(
            f"its {human_bytes(st.st_size)} are over the {most} the API takes of a file "
            "(DDPQ_CODE_MAX_FILE_BYTES, DDPQ_OUTPUTS_MAX_BYTES)"
        )
    digest = digest_under(name, fd, st)  # read again as it is sent, and checked
    if digest is None:
        raise Refused("not readable, or changed while it was read")
    e = Entry(path=name, digest=digest, size=st.st_size)
    captured = Captured()
    captured.entries.append(e)
    captured.written.append(e)
    return captured, os.dup(fd)


def _left_words(captured: Captured) -> str:
    named = ", ".join(f"{x['path']} ({x['why']})" for x in captured.left[:3])
    more = len(captured.left) - 3 + captured.left_more
    return f"not sent whole: {named}" + (f" and {more} more" if more > 0 else "")


class Sender:
    """The worker's sends: orders in from heartbeat replies, reports out with the next
    heartbeats. An order is done once: it stays known from the reply that asked for it
    until a heartbeat carrying its report is answered."""

    def __init__(self, root: Path, api: WorkerAPI) -> None:
        self.root, self.api = root, api
        self._cond = threading.Condition()
        self._todo: collections.deque[SendOrder] = collections.deque()
        self._known: set[int] = set()
        self._sent: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None

    def take(self, orders: list[SendOrder]) -> None:
        with self._cond:
            for order in orders:
                if order.id not in self._known:
                    self._known.add(order.id)
                    self._todo.append(order)
            if self._todo and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sender", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def reports(self) -> list[dict[str, Any]]:
        with self._cond:
            return self._sent[:MAX_REPORTS]

    def answered(self, sent: list[dict[str, Any]]) -> None:
        with self._cond:
            for r in sent:
                self._sent.remove(r)
                self._known.discard(r["id"])

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._todo))
                order = self._todo[0]
            report: dict[str, Any] = {"id": order.id}
            try:
                report["snapshot"] = send_checkpoint(self.root, self.api, order)
                log.info("job %s: checkpoint %s sent to the API", order.job_id, order.path)
            except Refused as exc:
                report["why"] = str(exc)[:500]
                log.warning("job %s: checkpoint %s not sent: %s", order.job_id, order.path, exc)
            except (ApiRefused, ApiUnavailable) as exc:  # asked again by a later reply
                log.warning("job %s: checkpoint not sent (the API: %s)", order.job_id, exc)
                with self._cond:
                    self._todo.popleft()
                    self._known.discard(order.id)
                continue
            except Exception as exc:  # never let one bad checkpoint stop the rest
                log.exception("sending checkpoint %s failed", order.path)
                report["why"] = f"failed: {exc}"[:500]
            with self._cond:
                self._todo.popleft()
                self._sent.append(report)
                self._cond.notify_all()


# ---- the other end: a fork's worker ---------------------------------------------------------


def write_fork(
    api: WorkerAPI, cache: BlobCache, claim: ClaimedJob, stop: threading.Event
) -> str | None:
    """The checkpoint a fork starts from (``claim.fork_from``), written into the job's
    checkpoint directory here once (a later attempt on this worker finds it whole: it
    is written under a temporary name first); its path, which the ranks resume from
    until they have one of their own. None for any other job; JobError if it cannot be
    had."""
    src = claim.fork_from
    if src is None:
        if claim.spec.from_checkpoint:
            raise JobError("the checkpoint it starts from was not given with its claim")
        return None
    base = Path(claim.checkpoint_dir) / src.dirname
    path = base / src.name
    if os.path.lexists(base):
        return str(path)
    base.parent.mkdir(parents=True, exist_ok=True)

    fetched(
        lambda: write_tree(api.snapshot(src.snapshot).manifest, cache, base, api.blob),
        f"fetch {words(src)}",
        stop,
        f"{words(src)} could not be fetched",
    )
    return str(path)


def words(src: ForkSource) -> str:
    return checkpoint_words(src.job_id, src.step)
