"""The in-training API: what a rank calls to report metrics and keep checkpoints.

    import ddpq
    ddpq.report(step, loss=loss, epoch=epoch)          # rank 0 sends, in the background
    ddpq.save_checkpoint(state, step=step, epoch=epoch) # rank 0 writes, then registers
                                                        # (keep=True: outlives keep_last)
    state = ddpq.load_checkpoint()                      # resume point, or None

(``from ddpq import report, save_checkpoint, load_checkpoint`` works too; so does
``from ddpq import train`` where no ``def train`` of the script's own is in the way.)

Only rank 0 (``RANK`` unset or 0) reports and checkpoints; on other ranks these
calls return at once. None of them is collective. ``report`` checks the point
where it is called (a bad step or name raises ValueError there, never taking good
points down with it) and blocks no training step (but a sweep's trial's, at each of its
few rungs: JUDGE_WAIT_S): it appends to a bounded buffer that a daemon thread sends
(the first point at once, so that a progress bar and chart show from the start; then in
batches cut by count, by bytes and by time: a second, growing to STEADY_SEND_INTERVAL_S
while the points keep coming), retrying with backoff while the API is unreachable. A
batch the API refuses is split until the one point it refuses is found; points that
cannot be stored (that one, or the oldest when the buffer overflows during a long
outage) are counted on the job (``metrics_dropped``), never lost in silence. Values may
be tensors: they are turned into floats on the sender thread, so reporting a CUDA loss
does not synchronise the device on every step.

Without ``DDPQ_URL`` (a plain ``torchrun`` run) nothing is sent: rank 0 prints a
compact line to stderr for the first report, then at most one every
ddpq.plain.INTERVAL_S and the last at exit, formatting nothing in between; checkpoints
go to ``DDPQ_CHECKPOINT_DIR`` or ``./checkpoints``, so the same script runs anywhere.

Importing this module, and ``report``/``flush`` of Python numbers, need no torch (a plain
``pip install ddpq``): torch is imported inside ``save_checkpoint`` and
``load_checkpoint`` only, whichever torch >= 2.2 the training environment has. Tensors
reach ``report`` duck-typed (``requires_grad``, ``detach()``, ``item()``).

With ``DDPQ_TENSORBOARD_DIR`` set (a worker passes on its own), the sender thread
also writes the reported scalars as TensorBoard event files into
``$DDPQ_TENSORBOARD_DIR/job-<id>``: one run per job, which every attempt appends to.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import logging
import numbers
import os
import re
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ddpq.errors import ApiRefused, ApiUnavailable
from ddpq.http import Http
from ddpq.plain import Plain, to_float
from ddpq.rules import (
    MAX_METRIC_ITEMS,
    metric_point_problem,
    params,
    rungs,
    total_steps_problem,
)
from ddpq.tensorboard import EventWriter
from ddpq.wire import Backoff, encode_number, tree_stamp

# Also offered as ddpq.report etc. (ddpq/__init__.py reads this list).
__all__ = [
    "flush",
    "is_master",
    "latest_checkpoint",
    "load_checkpoint",
    "params",  # a sweep's trial's parameters (ddpq.rules, where the rule is)
    "register_checkpoint",
    "report",
    "resume_path",
    "save_checkpoint",
]

log = logging.getLogger("ddpq.train")

MAX_BUFFERED_POINTS = 100_000  # oldest points are dropped past this (and counted)
BATCH_ITEMS = MAX_METRIC_ITEMS  # the API's per-request limit
# Bytes of JSON in one request: well under the API's 1 MiB body cap, which 1000 points
# of 35 metrics pass (a 413 then dropped the whole batch).
BATCH_BYTES = 256 * 1024
# Points wait this long to be batched (a POST per step would cost the API a core and rank
# 0 its GIL), doubling while they keep coming up to STEADY_: a steady run costs rank 0 and
# the API a request per 4 s, not one a second, taken from ranks that fill a host.
SEND_INTERVAL_S = 1.0
STEADY_SEND_INTERVAL_S = 4.0
EXIT_FLUSH_TIMEOUT_S = 30.0
# A trial's point that reaches a rung of its sweep waits, in report(), for the judgment
# (a request of milliseconds): a pruned or paused trial runs no step past its rung, and a
# paused one saves its checkpoint at the rung. An API that does not answer holds it this
# long at most; the sweep's own round judges it then.
JUDGE_WAIT_S = 30.0


def is_master() -> bool:
    """True on the rank that reports and checkpoints (global rank 0)."""
    return int(os.environ.get("RANK", "0")) == 0


class _Sender:
    """Ships metric points and checkpoint registrations to the API from one thread."""

    def __init__(
        self, url: str, job_id: str, token: str, tensorboard: EventWriter | None = None
    ) -> None:
        # Made as the thread first sends: not tens of ms (TLS) of the loop's first report().
        self._http: Http | None = None
        self._connect = (url, token)
        self._job_id = job_id
        self._tensorboard = tensorboard
        self._points: collections.deque[dict[str, Any]] = collections.deque()
        self._checkpoints: collections.deque[dict[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._dropped = 0  # points never stored: the buffer overflowed, or refused alone
        self._dropped_sent = 0  # of those, how many the job already counts
        self._flushing = 0  # callers waiting in flush(): send without lingering
        # The first point goes without lingering: the job's progress bar and chart show
        # from its start, not a batch interval (or a batch of 1000) later.
        self._eager = True
        # The steps at which this trial's sweep judges it (ddpq.rules.RUNGS_VAR): a point
        # reaching the next one goes at once and asks for the judgment.
        self._rungs = collections.deque(rungs())
        self._judge_due = False
        self._judged = -1  # the highest step a judgment was answered for
        self._linger = SEND_INTERVAL_S  # grows while the batches are cut by the clock alone
        self._thread = threading.Thread(target=self._run, name="ddpq-train-sender", daemon=True)
        self._thread.start()

    def add_point(self, item: dict[str, Any]) -> bool:
        """Queue ``item``; whether it reaches a rung (its judgment is then awaited)."""
        with self._cond:
            if len(self._points) >= MAX_BUFFERED_POINTS:
                self._points.popleft()
                self._dropped += 1
                if self._dropped in (1, 1000) or self._dropped % 100_000 == 0:
                    log.warning("ddpq: metric buffer full, %d oldest points dropped", self._dropped)
            self._points.append(item)
            judged = bool(self._rungs) and item["step"] >= self._rungs[0] > self._judged
            self._judge_due = self._judge_due or judged
            if len(self._points) >= BATCH_ITEMS or self._eager or self._judge_due:
                self._cond.notify_all()
            return judged

    def await_judgment(self, step: int, timeout: float) -> None:
        """Wait until the judgment of a point at ``step`` is answered (a stop answered
        has signalled this process by then), or ``timeout`` runs out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._judged < step and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, 0.1))

    def add_checkpoint(self, body: dict[str, Any]) -> None:
        with self._cond:
            self._checkpoints.append(body)
            self._cond.notify_all()

    def _unsent_drops(self) -> int:
        return self._dropped - self._dropped_sent

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._points or self._checkpoints or self._in_flight or self._unsent_drops():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.1))
            finally:
                self._flushing -= 1
        return True

    def _take(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with self._cond:
            linger = max(SEND_INTERVAL_S, min(self._linger, STEADY_SEND_INTERVAL_S))
            deadline = time.monotonic() + linger  # or a full batch, a checkpoint, a flush
            while (
                len(self._points) < BATCH_ITEMS
                and not self._checkpoints
                and not (self._flushing and (self._points or self._unsent_drops()))
                and not ((self._eager or self._judge_due) and self._points)
                and (left := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(left)
            late = time.monotonic() >= deadline  # and points still come: linger longer
            self._linger = SEND_INTERVAL_S if not self._points else linger * 2 if late else linger
            n = min(len(self._points), BATCH_ITEMS)
            if n:
                self._eager = False
            points = [self._points.popleft() for _ in range(n)]
            self._judge_due = self._judge_due and bool(self._points)
            checkpoints = list(self._checkpoints)
            self._checkpoints.clear()
            self._in_flight = len(points) + len(checkpoints)
            return points, checkpoints

    def _put_back(self, points: list[dict[str, Any]], checkpoints: list[dict[str, Any]]) -> None:
        with self._cond:
            self._points.extendleft(reversed(points))
            self._checkpoints.extendleft(reversed(checkpoints))
            self._in_flight = 0

    def _run(self) -> None:
        backoff = Backoff()
        while True:
            points, checkpoints = self._take()
            with self._cond:
                drops = self._unsent_drops()
            if not points and not checkpoints and not drops:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()
                continue
            if points and self._tensorboard is not None:
                self._write_tensorboard(self._tensorboard, points)
            try:
                if points or drops:
                    self._send_points([_materialise(p) for p in points], drops)
                    points = []
                while checkpoints:
                    self._post("checkpoints", checkpoints[0])
                    checkpoints.pop(0)
                backoff.reset()
            except ApiUnavailable as exc:
                # Everything goes back, points already stored included: a point sent
                # twice is stored once (a step keeps one value per attempt).
                log.debug("ddpq: report failed (%s); retrying in %.1fs", exc, backoff.delay)
                self._put_back(points, checkpoints)
                backoff.wait()
                continue
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

    def _send_points(self, items: list[dict[str, Any]], drops: int) -> None:
        """Send ``items`` in requests of at most BATCH_BYTES, with the count of points
        dropped so far that the job does not know of yet."""
        sizes = [len(json.dumps(i, separators=(",", ":"))) + 1 for i in items]
        start, total = 0, 0
        for end, size in enumerate(sizes):
            if end > start and total + size > BATCH_BYTES:
                self._send_batch(items[start:end], drops)
                drops, start, total = 0, end, 0
            total += size
        if start < len(items) or drops:
            self._send_batch(items[start:], drops)

    def _send_batch(self, items: list[dict[str, Any]], drops: int) -> None:
        body: dict[str, Any] = {"items": items}
        if drops:
            body["dropped"] = drops
        judge = bool(self._rungs) and any(i["step"] >= self._rungs[0] for i in items)
        status = self._post("metrics", body, judge)
        if judge:  # answered (or refused for good): what waits in report() goes on
            with self._cond:
                self._judged = max(self._judged, *(i["step"] for i in items))
                self._cond.notify_all()
        if status is None:
            while judge and self._rungs and self._rungs[0] <= max(i["step"] for i in items):
                self._rungs.popleft()
            if drops:
                with self._cond:
                    self._dropped_sent += drops
            return
        if status in (400, 413, 422) and len(items) > 1:
            # Refused as a whole: halve it until the point the API refuses is alone.
            half = len(items) // 2
            self._send_batch(items[:half], drops)
            self._send_batch(items[half:], 0)
            return
        if status in (400, 413, 422) and items:
            log.warning("ddpq: the API refused a metric point (HTTP %d): %s", status, items)
            with self._cond:
                self._dropped += len(items)  # counted on the job with the next request
            if drops:
                self._send_batch([], drops)
            return
        # Otherwise (403, 404, 409): this attempt is over and nothing it sends is stored,
        # the count of drops included: give up on them rather than retry forever.
        with self._cond:
            self._dropped_sent += drops

    def _write_tensorboard(self, writer: EventWriter, points: list[dict[str, Any]]) -> None:
        """Write points to the event file once (a point retried for the API is not
        written again), turning their values into floats for both destinations."""
        fresh: list[tuple[int, dict[str, float]]] = []
        for p in points:
            if p.get("tensorboard"):
                continue
            p["values"] = {k: to_float(v) for k, v in p["values"].items()}
            scalars = dict(p["values"])
            if p.get("epoch") is not None:
                p["epoch"] = scalars["epoch"] = to_float(p["epoch"])
            p["tensorboard"] = True
            if scalars:  # a point may carry only the job's total_steps
                fresh.append((p["step"], scalars))
        try:
            writer.write(fresh)
        except OSError as exc:
            # TensorBoard is a convenience: never let it stop the reports to the API.
            log.warning("ddpq: cannot write TensorBoard events (%s); no more are written", exc)
            self._tensorboard = None

    def _post(self, what: str, body: dict[str, Any], judge: bool = False) -> int | None:
        """POST; None when stored, else the refusal's status (4xx, which a retry will
        not change: e.g. 409, a newer attempt took over). Raises ApiUnavailable
        (ddpq.errors) on 5xx, 429 and connection errors. ``judge``: the points reach a
        rung; the sweep's judgment comes back with them, and a pruned run is stopped."""
        path = f"/jobs/{self._job_id}/{what}"
        params = {"judge": "true"} if judge else None
        try:
            if self._http is None:
                self._http = Http(*self._connect, httpx.Timeout(10.0, connect=5.0))
            r = self._http.request("POST", path, json=body, params=params)
        except ApiRefused as refused:
            log.warning("ddpq: the API refused %s: %.600s", what, refused)
            return refused.status
        if judge and (why := r.json().get("stop")):
            _stop_run(str(why))
        return None


def _stop_run(why: str) -> None:
    """The sweep pruned this trial: end the program as the worker's cancel would, by
    SIGTERM (a handler the program has saves what it must), but now, not at the worker's
    next heartbeat; torchrun then stops the other ranks. The job ends cancelled, ``why``."""
    print(f"ddpq: {why}: stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _materialise(point: dict[str, Any]) -> dict[str, Any]:
    values = {k: encode_number(to_float(v)) for k, v in point["values"].items()}
    out: dict[str, Any] = {"step": point["step"], "values": values}
    if point.get("epoch") is not None:
        out["epoch"] = encode_number(to_float(point["epoch"]))
    if point.get("total_steps") is not None:
        out["total_steps"] = point["total_steps"]
    return out


_plain = Plain()
_sender: _Sender | None = None
_sender_lock = threading.Lock()


def _get_sender() -> _Sender | None:
    global _sender
    url = os.environ.get("DDPQ_URL")
    if not url or not is_master():
        return None
    job_id, token = os.environ.get("DDPQ_JOB_ID"), os.environ.get("DDPQ_JOB_TOKEN")
    if not job_id or not token:
        # DDPQ_URL alone is a CLI user's setting (the README has them export it), not a
        # job: a bare torchrun run prints its metrics, as without DDPQ_URL.
        _not_a_job_said_once()
        return None
    with _sender_lock:
        if _sender is None:
            tb_dir = os.environ.get("DDPQ_TENSORBOARD_DIR")
            writer = EventWriter(Path(tb_dir) / f"job-{job_id}") if tb_dir else None
            _sender = _Sender(url, job_id, token, writer)
            atexit.register(flush, EXIT_FLUSH_TIMEOUT_S)
        return _sender


@functools.cache
def _not_a_job_said_once() -> None:
    print(
        "ddpq: DDPQ_URL is set but this run is not a ddpq job (no DDPQ_JOB_ID or"
        " DDPQ_JOB_TOKEN): metrics are printed here, not sent",
        file=sys.stderr,
        flush=True,
    )


def _detach(value: Any) -> Any:
    # Only a tensor that needs a gradient holds on to its graph: others stay as they are
    # (detach() makes a new tensor, a cost on every step).
    return value.detach() if getattr(value, "requires_grad", False) else value


def report(
    step: int, *, epoch: float | None = None, total_steps: int | None = None, **values: Any
) -> None:
    """Record metric values at ``step`` (rank 0 only; returns at once).

    ``total_steps``, the number of steps the run will take, is the job's, not a
    metric: the job keeps the latest one sent (a new attempt keeps it too), and
    ``ddpq watch`` and the dashboard draw their progress bar from it. Sending it
    once is enough; ``report(0, total_steps=N)`` with no values is a valid point.

    Raises ValueError (TypeError for a step or total_steps that is not an int) for a
    point the API would refuse, here, where it is made: a step below 0, a total_steps
    below 1, a name that is empty, too long or not printable, more than 100 values."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if total_steps is not None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral):
            raise TypeError(f"total_steps must be an int, not {type(total_steps).__name__}")
        total_steps = int(total_steps)  # a numpy integer travels as a plain int
        problem = total_steps_problem(total_steps)
        if problem:
            raise ValueError(f"report(): {problem}")
    problem = metric_point_problem(step, values, with_total=total_steps is not None)
    if problem:
        raise ValueError(f"report(): {problem}")
    # Every step comes here: once the sender exists (rank 0 under ddpq), nothing is
    # looked up again; the other ranks stop at the rank check.
    sender = _sender
    if sender is None:
        if not is_master():
            return
        sender = _get_sender()
    if sender is None:
        if values:  # a point of only the total has nothing to show
            _plain.report(step, epoch, values)
        return
    point = {"step": step, "epoch": epoch, "values": {k: _detach(v) for k, v in values.items()}}
    if total_steps is not None:
        point["total_steps"] = total_steps
    if sender.add_point(point):
        sender.await_judgment(step, JUDGE_WAIT_S)


def checkpoint_dir() -> Path:
    return Path(os.environ.get("DDPQ_CHECKPOINT_DIR", "checkpoints"))


def save_checkpoint(
    state: dict[str, Any],
    *,
    step: int,
    epoch: float | None = None,
    metrics: dict[str, float] | None = None,
    keep: bool = False,
) -> Path | None:
    """Write ``state`` on rank 0 under DDPQ_CHECKPOINT_DIR and register it; None elsewhere.

    The file is written to a temporary name, synced, and renamed, so a crash
    never leaves a half-written checkpoint under the final name.

    Under ddpq only the job's newest ``keep_last`` checkpoints stay while it runs (the
    older ones are deleted as new ones register; docs/checkpoints.md); ``keep=True``
    keeps this one too, until the job's checkpoint retention ends.
    """
    if not is_master():
        return None
    import torch  # deferred: importing ddpq.train must stay cheap

    directory = checkpoint_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = (directory / f"step-{step:09d}.pt").resolve()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
        # The file as written: the worker deletes it only while it is still this one
        # (renaming keeps size and mtime).
        written = os.fstat(f.fileno())
    os.replace(tmp, path)
    _send_checkpoint(path, step, epoch, metrics, keep, written.st_size, written.st_mtime_ns)
    return path


def _send_checkpoint(
    path: Path,
    step: int,
    epoch: float | None,
    metrics: dict[str, float] | None,
    keep: bool,
    size: int,
    mtime_ns: int,
    kind: str = "file",
) -> None:
    sender = _get_sender()
    if sender is None:
        return
    body: dict[str, Any] = {"path": str(path), "step": step, "bytes": size, "mtime_ns": mtime_ns}
    if kind != "file":  # an API from before directories (migration 0030) knows no kind
        body["kind"] = kind
    if keep:
        body["keep"] = True
    if epoch is not None:
        body["epoch"] = epoch
    if metrics:
        body["metrics"] = {k: encode_number(to_float(v)) for k, v in metrics.items()}
    sender.add_checkpoint(body)


def register_checkpoint(
    path: str | os.PathLike[str],
    *,
    step: int,
    epoch: float | None = None,
    metrics: dict[str, float] | None = None,
    keep: bool = False,
) -> Path | None:
    """Register, on rank 0 (None elsewhere), a checkpoint already written and complete: a
    framework's file, or a directory once every rank has written its part. It must lie
    inside DDPQ_CHECKPOINT_DIR (``./checkpoints`` under a bare torchrun, where nothing is
    sent), links resolved, for keep_last, the retention and a retry (``resume_path()``)
    to reach it; its stamp (ddpq.wire.tree_stamp for a directory) is what its worker
    checks before deleting it. Returns the path registered. ValueError for a path outside
    or neither a file nor a directory, FileNotFoundError for none, TypeError or
    ValueError for a step that is not an int of at least 0."""
    if not is_master():
        return None
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise ValueError(f"register_checkpoint(): step must be at least 0, not {step}")
    own = checkpoint_dir().resolve()
    target = Path(path).resolve()
    if not target.is_relative_to(own) or target == own:
        raise ValueError(
            f"register_checkpoint(): {path} is not inside the job's checkpoint directory"
            f" {own} (DDPQ_CHECKPOINT_DIR): have the framework write its checkpoints there"
        )
    st = os.lstat(target)  # resolved: no link left to follow
    if stat.S_ISDIR(st.st_mode):
        size, mtime_ns = tree_stamp(str(target))
        _send_checkpoint(target, step, epoch, metrics, keep, size, mtime_ns, "dir")
    elif stat.S_ISREG(st.st_mode):
        _send_checkpoint(target, step, epoch, metrics, keep, st.st_size, st.st_mtime_ns)
    else:
        raise ValueError(f"register_checkpoint(): {path} is neither a file nor a directory")
    return target


def resume_path() -> Path | None:
    """The checkpoint a retry resumes from, a file or a directory as a framework's resume
    takes it (Lightning's ``ckpt_path``, accelerate's ``load_state``...); None on a first
    attempt or a bare torchrun. ``DDPQ_RESUME_FROM``: the job's registered checkpoint of
    the highest step that the worker found inside the job's checkpoint directory."""
    resume = os.environ.get("DDPQ_RESUME_FROM")
    return Path(resume) if resume and os.path.exists(resume) else None


def _step_of(path: Path) -> int:
    match = re.fullmatch(r"step-(\d+)\.pt", path.name)
    return int(match.group(1)) if match else -1


def latest_checkpoint() -> Path | None:
    """The newest checkpoint to resume from, or None.

    Two places hold one: ``DDPQ_RESUME_FROM``, the newest the job registered (set
    by ddpq on a new attempt, perhaps on another host), and this job's own
    checkpoint directory, where an earlier run of this attempt saved before
    torchrun restarted it (``max_restarts``). The higher step wins.
    """
    # A link planted in the directory must not lead the load elsewhere.
    directory = checkpoint_dir()
    own = directory.resolve()
    candidates = [
        p for p in directory.glob("step-*.pt") if p.is_file() and p.resolve().is_relative_to(own)
    ]
    resume = os.environ.get("DDPQ_RESUME_FROM")  # checked by the worker before it is set
    if resume and os.path.isfile(resume):
        candidates.append(Path(resume))
    if not candidates:
        return None
    return max(candidates, key=_step_of)


def load_checkpoint(map_location: Any = "cpu") -> Any | None:
    """Load :func:`latest_checkpoint`, or return None when there is none.

    Loaded with ``weights_only=True`` and no fallback: a checkpoint file never runs
    code (a pickle that would is refused with an UnpicklingError).
    """
    path = latest_checkpoint()
    if path is None:
        return None
    import torch

    return torch.load(path, map_location=map_location, weights_only=True)


def flush(timeout: float = EXIT_FLUSH_TIMEOUT_S) -> bool:
    """Wait until everything reported so far is sent; False if ``timeout`` ran out."""
    if _sender is None:
        return True
    return _sender.flush(timeout)
