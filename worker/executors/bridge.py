"""The Slurm bridge: ``ddpq worker --executor slurm`` on a login node, an executor
under worker.executors.loop's register, claim and heartbeat.

It registers as a worker whose slots are a Slurm partition's nodes, claims whole ddpq
jobs (multi-node ones as one attempt), and hands each attempt to Slurm as one batch
job (worker.executors.slurm decides its command line and script). From then on Slurm runs it:
the bridge polls squeue/scontrol, tells the API the Slurm job id and why Slurm holds
it pending (its heartbeat), stops it with scancel on a cancel or a timeout, and
reports how it ended. Its jobs do not live in its process: a bridge that stops, or is
killed, leaves them running, and re-adopts them when it starts again (the Slurm job
id is on each attempt; a job it submitted but had not yet told the API of is found by
its name). The ranks report to the API themselves, and each node ships its own output
(worker.slurmnode).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddpq.errors import JobError, SlurmError, Stopped
from ddpq.jobspec import ClaimedSpec
from ddpq.messages import AttemptKey, ClaimedJob, HeldAttempt
from ddpq.wire import Backoff
from worker.executors import slurm
from worker.executors.loop import Loop, Room
from worker.executors.settings import WorkerSettings
from worker.starting import warm
from worker.starting.logship import LogShipper
from worker.starting.outcome import Outcome, stopped
from worker.starting.prepare import prepared

log = logging.getLogger("ddpq.worker")

SLURM_TIMEOUT_S = 60.0  # a Slurm command that takes longer is retried at the next poll


@dataclass
class Tracked:
    """An attempt the bridge handed to Slurm (or is handing: no id yet)."""

    claim: ClaimedJob
    slurm_id: str | None = None
    state: str = "PENDING"
    pending: str | None = None
    running_since: float | None = None
    stop_reason: str | None = None  # cancelled, timeout, abandoned: the bridge scancelled it
    stop_words: str | None = None  # the service's, for a hand-back
    scancelled: bool = False
    # What the attempt holds on this host until it ends: its environment, and the
    # stream of the bridge's own lines into the job's log.
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    shipper: LogShipper | None = None

    def say(self, line: str) -> None:
        if self.shipper is not None:
            self.shipper.write(f"[ddpq] {line}\n".encode())

    @property
    def key(self) -> AttemptKey:
        return AttemptKey(self.claim.job_id, self.claim.attempt)


def run_slurm(argv: list[str], stdin: str | None = None) -> str:
    """Run a Slurm command; its output, or SlurmError with what it said."""
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"{argv[0]}: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"{argv[0]}: {said[-1] if said else f'exit code {done.returncode}'}")
    return done.stdout


class Bridge:
    """Hands each claimed attempt to Slurm; its attempts outlive it (``detached``)."""

    detached = True

    def __init__(
        self, settings: WorkerSettings, *, token: str, identity: str | None = None
    ) -> None:
        partition = settings.partition
        assert partition is not None  # WorkerSettings refuses a bridge without one
        self.loop = Loop(
            self,
            settings,
            token=token,
            identity=identity,
            default_name=f"slurm-{partition}@{socket.gethostname()}",
        )
        self.name = self.loop.name
        self.api = self.loop.api
        self.partition = partition
        self.max_pending = settings.max_pending
        self.poll_s = settings.poll_s
        self.scripts = self.loop.data_dir / "slurm"
        self.launcher = settings.launcher  # for jobs whose spec names none (worker.starting.warm)
        self.submission = slurm.Submission(
            partition=partition,
            account=settings.account,
            extra=tuple(settings.sbatch_arg),
            bridge=self.name,
            identity=self.api.identity,
            output_dir=str(self.scripts),
        )
        self._lock = threading.Lock()
        self._tracked: dict[AttemptKey, Tracked] = {}
        self._changed = threading.Event()
        # Set when sbatch could not reach slurmctld: claims wait a while, not to take
        # jobs only to hand them back at once.
        self._slurm_away = Backoff()
        self._slurm_failed = threading.Event()

    # ---- the partition and registration -----------------------------------------------

    def shape(self) -> dict[str, Any]:
        out = run_slurm(["sinfo", "-h", "-N", "-p", self.partition, "-o", slurm.SINFO_FORMAT])
        return slurm.partition_shape(self.partition, out, self.max_pending)

    def describe(self) -> str:
        return (
            f"Slurm bridge {self.name}: partition {self.partition}, at most "
            f"{self.max_pending} job(s) pending in Slurm, API {self.loop.url}"
        )

    def registration(self) -> dict[str, Any]:
        return {"cpu_slots": 0, "gpus": [], "cluster": self.shape()}

    def adopt(self, held: list[HeldAttempt]) -> None:
        """Take back the attempts the books give this bridge: by their Slurm job id, or,
        for one submitted just before the bridge stopped, by its job name. An attempt
        Slurm never got goes back to the queue; a Slurm job of this bridge's that ddpq
        no longer runs is cancelled."""
        ours = self._slurm_jobs_of_mine()
        by_name = {j.name: j for j in ours}
        wanted: set[str] = set()
        for h in held:
            slurm_id = h.external_id
            if slurm_id is None:
                found = by_name.get(slurm.job_name(h.job_id, h.attempt))
                slurm_id = found.id if found is not None else None
            if slurm_id is None:
                log.warning("job %s attempt %s never reached Slurm: requeued", h.job_id, h.attempt)
                self.loop.finish(
                    h.job_id,
                    h.attempt,
                    Outcome(None, "requeue", "the bridge stopped before handing it to Slurm"),
                )
                continue
            wanted.add(slurm_id)
            # Of the claim only the timeout is needed again: Slurm runs the job. It counts
            # from now, the bridge having missed when Slurm started it (--time holds).
            claim = ClaimedJob(
                job_id=h.job_id,
                attempt=h.attempt,
                token="",
                spec=ClaimedSpec.model_validate({"timeout_s": h.timeout_s} if h.timeout_s else {}),
                device="cpu",
                nproc_per_node=1,
                gpus=[],
                checkpoint_dir="",
                resume_from=[],
            )
            with self._lock:
                self._tracked[AttemptKey(h.job_id, h.attempt)] = Tracked(claim, slurm_id)
            log.info("job %s attempt %s: re-adopted Slurm job %s", h.job_id, h.attempt, slurm_id)
        for job in ours:
            if job.id not in wanted and job.state not in slurm.ENDED:
                log.warning(
                    "Slurm job %s (%s) is no longer ddpq's: cancelling it", job.id, job.name
                )
                self._scancel(job.id)

    def _slurm_jobs_of_mine(self) -> list[slurm.SlurmJob]:
        """Every Slurm job this bridge submitted that Slurm still remembers."""
        out = run_slurm(["scontrol", "show", "job", "-o"])
        mine = slurm.comment(self.name, self.api.identity)
        return [
            j
            for j in slurm.parse_show_job(out)
            if slurm.NAME.match(j.name) and (j.comment == mine or j.comment.startswith(mine + ":"))
        ]

    # ---- handing attempts to Slurm -----------------------------------------------------

    def waiting(self) -> int:
        """Attempts not yet running in Slurm: the cap on these keeps ddpq's queue order."""
        with self._lock:
            return sum(1 for t in self._tracked.values() if t.state in slurm.WAITING)

    def _track(self, claim: ClaimedJob) -> Tracked:
        tracked = Tracked(claim)
        tracked.shipper = LogShipper(self.api, claim.job_id, claim.attempt)
        tracked.shipper.start()
        tracked.held.callback(tracked.shipper.close, 60.0)
        with self._lock:
            self._tracked[tracked.key] = tracked
        return tracked

    def _hand_over(self, tracked: Tracked) -> None:
        """Hand one claimed attempt to Slurm (or end it, if it cannot be)."""
        claim = tracked.claim
        try:
            script = self._script(tracked)
            if tracked.stop_reason is not None:  # cancelled while its code or env came
                raise Stopped()
            slurm_id = self._sbatch(claim, script)
        except Exception as exc:  # whatever it was, the attempt ends and says why
            with self._lock:
                self._tracked.pop(tracked.key, None)
            result = self._not_handed(tracked, exc)
            log.warning("job %s attempt %s: %s", claim.job_id, claim.attempt, result.reason)
            tracked.say(str(result.reason))
            tracked.held.close()
            self.loop.finish(claim.job_id, claim.attempt, result, tracked.stop_reason)
            return
        tracked.slurm_id = slurm_id
        self._slurm_away.reset()
        log.info("job %s attempt %s: submitted as Slurm job %s", *tracked.key, slurm_id)
        tracked.say(
            f"attempt {claim.attempt}: handed to Slurm as job {slurm_id} "
            f"(partition {self.partition}, {claim.nnodes} node(s) of "
            f"{claim.nproc_per_node} rank(s)) by the bridge {self.name}"
        )
        self.loop.heartbeat_once()  # the Slurm job id is on the attempt before anything else
        if tracked.stop_reason is not None:  # cancelled while sbatch ran
            self._stop(tracked, tracked.stop_reason)

    def _sbatch(self, claim: ClaimedJob, script: str) -> str:
        """Submit; the Slurm job id. An sbatch that failed may still have submitted it
        (a timeout after slurmctld took it): then the job found by its name is it."""
        try:
            out = run_slurm(slurm.sbatch_argv(claim, self.submission), stdin=script)
        except SlurmError:
            name = slurm.job_name(claim.job_id, claim.attempt)
            with contextlib.suppress(SlurmError):
                found = [j for j in self._slurm_jobs_of_mine() if j.name == name]
                if found:
                    return found[-1].id
            raise
        return out.strip().split(";")[0]

    def _not_handed(self, tracked: Tracked, exc: Exception) -> Outcome:
        """How an attempt that never reached Slurm ends: stopped, as worker.starting.outcome says
        (a cancel as a cancel); a shutdown or a Slurm that did not answer back to the
        queue (not counted), a job that can never start (its code, its entrypoint, a
        refused submission) as a failure."""
        if tracked.stop_reason is not None:
            return stopped(tracked.stop_reason, None, None, tracked.stop_words)
        if isinstance(exc, Stopped):
            return stopped("shutdown", None, None, "the bridge shut down")
        if isinstance(exc, SlurmError) and not slurm.refused(str(exc)):
            self._slurm_failed.set()
            return Outcome(None, "requeue", f"Slurm did not take it: {exc}")
        if isinstance(exc, JobError | SlurmError):
            return Outcome(None, "error", str(exc))
        log.exception("job %s attempt %s: bridge error", *tracked.key)
        return Outcome(None, "error", f"bridge error: {exc}")

    def _script(self, tracked: Tracked) -> str:
        """The attempt's batch script (it holds the job token: it is written to no
        file), once its code and environment are ready: in the bridge's data dir, on the
        filesystem the nodes share with this host (as are the checkpoint files). Never
        the job's secrets: Slurm keeps a batch script (slurmctld's state, and slurmdbd's
        for good with AccountingStoreFlags=job_script), so each node fetches them with
        the job token, which stops working when the attempt ends (worker.slurmnode)."""
        claim = tracked.claim
        shipper = tracked.shipper
        # Built here, run on the nodes: held until the job ends.
        launch = tracked.held.enter_context(
            prepared(
                self.loop,
                claim,
                launch_id=f"slurm-{claim.job_id}/{claim.attempt}",
                say=lambda line: shipper.write(line.encode()) if shipper else None,
                stop=self.loop.stopping,
                where="the bridge's workspace",
                with_secrets=False,
            )
        )
        env = launch.env
        if claim.device == "cuda":  # Slurm assigns each node's GPUs (and sets the variable)
            env.pop("CUDA_VISIBLE_DEVICES", None)
        plan = slurm.plan(
            claim,
            launch.program,
            env,
            slurm.comment(self.name, self.api.identity),
            # Each node starts its own warm process (worker.slurmnode): no process of
            # ddpq's outlives a Slurm job on a node.
            warm.choose(claim.spec, self.launcher)[0],
        )
        self.scripts.mkdir(parents=True, exist_ok=True)  # Slurm's own output files
        return slurm.batch_script(launch.python, str(launch.cwd), plan)

    # ---- following Slurm ---------------------------------------------------------------

    def poll_once(self) -> None:
        with self._lock:
            tracked = [t for t in self._tracked.values() if t.slurm_id]
        if not tracked:
            return
        ids = ",".join(str(t.slurm_id) for t in tracked)
        try:
            states = slurm.parse_squeue(
                run_slurm(["squeue", "-h", "-t", "all", "-j", ids, "-o", slurm.SQUEUE_FORMAT])
            )
        except SlurmError as exc:
            # squeue refuses a list holding an id it no longer knows: look one by one.
            log.debug("squeue: %s", exc)
            states = {}
        for t in tracked:
            assert t.slurm_id is not None
            state, reason = states.get(t.slurm_id, ("", ""))
            if state in slurm.ENDED or not state:
                self._ended(t)
                continue
            t.state = state
            t.pending = slurm.pending_words(t.slurm_id, reason) if state in slurm.WAITING else None
            if state == "RUNNING" and t.running_since is None:
                t.running_since = time.monotonic()
            self._check_timeout(t)

    def _check_timeout(self, t: Tracked) -> None:
        timeout_s = t.claim.spec.timeout_s
        started = t.running_since
        if timeout_s and started is not None and time.monotonic() - started > float(timeout_s):
            self._stop(t, "timeout")

    def _ended(self, t: Tracked) -> None:
        """A job squeue no longer lists as live: report its end, as scontrol tells it."""
        assert t.slurm_id is not None
        try:
            found = slurm.parse_show_job(run_slurm(["scontrol", "show", "job", "-o", t.slurm_id]))
        except SlurmError as exc:
            if "Invalid job id" not in str(exc):
                log.warning("scontrol: %s", exc)
                return
            found = []
        job = next((j for j in found if j.id == t.slurm_id), None)
        if job is None:
            # Gone from Slurm's memory (it ended while the bridge was away long enough):
            # how it ended is not known, so the attempt is lost and retried.
            outcome = Outcome(None, "lost", f"Slurm no longer knows job {t.slurm_id}")
        elif job.state not in slurm.ENDED:
            return  # COMPLETING, or squeue and scontrol disagree for a moment
        else:
            outcome = slurm.ending(job, t.stop_reason, t.claim.spec.timeout_s, t.stop_words)
        with self._lock:
            self._tracked.pop(t.key, None)
        self._changed.set()
        if t.stop_reason != "abandoned" and outcome.reason and outcome.outcome != "exited":
            t.say(outcome.reason)
        t.held.close()
        # Slurm's copy of the batch script's output (torchrun's own lines; the ranks' are
        # in the job's log): kept only while the job runs, for a look on the cluster.
        name = slurm.job_name(t.claim.job_id, t.claim.attempt)
        (self.scripts / f"{name}-{t.slurm_id}.out").unlink(missing_ok=True)
        self.loop.finish(t.claim.job_id, t.claim.attempt, outcome, t.stop_reason)
        log.info(
            "job %s attempt %s: Slurm job %s ended %s",
            t.claim.job_id,
            t.claim.attempt,
            t.slurm_id,
            job.state if job else "(unknown)",
        )

    def _stop(self, t: Tracked, why: str, words: str | None = None) -> None:
        if t.stop_reason is None:
            t.stop_reason, t.stop_words = why, words
        if t.slurm_id and not t.scancelled:
            t.scancelled = self._scancel(t.slurm_id)

    def _scancel(self, slurm_id: str) -> bool:
        try:
            run_slurm(["scancel", slurm_id])
            return True
        except SlurmError as exc:
            log.warning("scancel %s: %s", slurm_id, exc)
            return False

    # ---- the executor (worker.executors.loop)
    # -------------------------------------------------------

    def attempts(self) -> list[dict[str, Any]]:
        with self._lock:
            tracked = list(self._tracked.values())
        running: list[dict[str, Any]] = []
        for t in tracked:
            item: dict[str, Any] = {"job_id": t.claim.job_id, "attempt": t.claim.attempt}
            if t.slurm_id:
                item["external_id"] = t.slurm_id
                item["pending"] = t.pending
            running.append(item)
        return running

    def room(self, stop: threading.Event) -> Room | None:
        if self._slurm_failed.is_set():
            self._slurm_failed.clear()
            self._slurm_away.wait(stop)
            return None
        if self.waiting() >= self.max_pending:
            self._changed.wait(self.poll_s)
            self._changed.clear()
            return None
        return Room()  # Slurm holds the nodes: the claim takes a job whole, if it fits

    def start(self, claim: ClaimedJob, room: Room) -> None:
        # Its own thread: fetching code or building an environment may take minutes,
        # and other jobs go on to Slurm meanwhile (the cap counts it).
        tracked = self._track(claim)  # counted against the cap from now on
        threading.Thread(
            target=self._hand_over, args=(tracked,), name=f"sbatch-{claim.job_id}", daemon=True
        ).start()

    def stop(self, job_id: int, attempt: int, why: str, words: str | None = None) -> None:
        with self._lock:
            tracked = self._tracked.get(AttemptKey(job_id, attempt))
        if tracked is not None:
            self._stop(tracked, why, words)

    def rounds(self) -> list[tuple[str, float, Callable[[], None]]]:
        return [("poll", self.poll_s, self.poll_once)]

    def gpu_samples(self) -> dict[AttemptKey, list[dict[str, Any]]]:
        """None: Slurm's nodes hold the GPUs, out of this process's sight."""
        return {}

    def drain(self) -> None:
        """Nothing: Slurm runs them on; a bridge started again under this name re-adopts
        them."""

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT. Jobs in Slurm go on running: a bridge started
        again under this name re-adopts them."""
        self.loop.run()
