"""Runs one attempt of one job: torchrun under supervision, its output shipped live.

What to launch is decided by worker.starting.torchrun and prepared by worker.starting.prepare; this
module waits for a multi-node attempt's gang first, starts torchrun under the attempt's walls,
stops it on request, and reports how it ended (worker.executors.loop.finish).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddpq.errors import ApiRefused, ApiUnavailable, JobError, Stopped
from ddpq.jobspec import ClaimedSpec
from ddpq.messages import ClaimedJob, GangReply
from worker.edges import oom, procs
from worker.edges.api import WorkerAPI
from worker.executors.loop import finish
from worker.executors.settings import WorkerSettings
from worker.executors.trace import Trace
from worker.files import outputs, sending
from worker.files.caches import Caches
from worker.files.code import Workdirs
from worker.starting import launcher, prepare, torchrun, warm
from worker.starting.logship import LogShipper, Tailed
from worker.starting.outcome import Outcome, stop_words, stopped
from worker.starting.venvs import Venvs
from worker.walled.walls import Held, Walls

log = logging.getLogger("ddpq.worker")

GANG_POLL_S = 2.0  # one long-poll on a forming gang; a stop request waits at most this

__all__ = ["JobError", "JobRunner", "RunContext"]


@dataclass
class RunContext:
    """What a runner needs of its worker: the same for every attempt the worker runs.
    Its settings are the worker's (worker.executors.settings); the rest is what the worker made of
    them as it started."""

    api: WorkerAPI
    name: str
    url: str  # the API as ranks reach it
    workspace: Path
    data_dir: Path
    launch_prefix: str
    advertise_addr: str
    settings: WorkerSettings
    # Set once the worker's claim loop has returned (shutdown): a handback waits for it.
    claimer_done: threading.Event
    # Jobs' own directories of their code, and environments for their requirements.
    workdirs: Workdirs
    venvs: Venvs
    # Whether each attempt runs under a uid of its own (worker.walled.walls).
    walls: Walls = field(default_factory=lambda: Walls(None))
    # Each user's caches across their jobs here (worker.files.caches); None: none kept.
    caches: Caches | None = None
    # The warm launcher's processes (worker.starting.warm); None: a worker that keeps none.
    warm_pool: warm.WarmPool | None = None

    @property
    def kill_grace_s(self) -> float:
        return self.settings.kill_grace_s

    @property
    def launcher(self) -> str:
        """The launcher of jobs whose spec names none (worker.starting.warm)."""
        return self.settings.launcher

    @property
    def trace_file(self) -> Path | None:
        """Where each attempt's phases are recorded (worker.executors.trace; ddpq worker
        --trace)."""
        return self.settings.trace_file()

    @property
    def logs_root(self) -> Path:
        return self.data_dir / "torchrun-logs"


@dataclass
class JobRunner:
    ctx: RunContext
    claim: ClaimedJob
    # Called once the attempt's processes are gone and its end is reported.
    release: Callable[[JobRunner], None]
    # The rendezvous port this worker offered, when it holds node 0 of a gang.
    rdzv_port: int | None = None
    # Called once its processes are gone, as its end is about to be reported: its slots
    # may go into the next claim's room (the API hands them out once the report lands).
    ending: Callable[[JobRunner], None] = lambda _: None
    gang: GangReply | None = None
    stop_reason: str | None = None
    stop_requested: threading.Event = field(default_factory=threading.Event)
    # Set by a stop request and by torchrun's exit: what the supervision waits on.
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    # Set once the worker has signalled the attempt to stop: from then on torchrun's own
    # output (its SignalException traceback, 30 lines of it) is not the user's business;
    # the ranks' lines still are, and one [ddpq] line says what happened.
    stopping_since: float | None = None
    # Why, in words, when the service asked (a preemption names the job it makes room for).
    stop_words: str | None = None
    # When it reached each phase, from the claim on (worker.executors.trace).
    trace: Trace = field(default_factory=Trace)

    @property
    def job_id(self) -> int:
        return self.claim.job_id

    @property
    def attempt(self) -> int:
        return self.claim.attempt

    @property
    def launch_id(self) -> str:
        return f"{self.ctx.launch_prefix}{self.job_id}/{self.attempt}"

    def start(self) -> None:
        # This thread starts torchrun and lives until it is gone: the parent-death
        # signal (worker.launch) fires when the starting *thread* ends.
        self.thread = threading.Thread(target=self._main, name=f"job-{self.job_id}", daemon=True)
        self.thread.start()

    def request_stop(self, why: str, words: str | None = None) -> None:
        """why: cancelled (by a user), abandoned (no longer ours), shutdown, timeout,
        preempted (handed back for a job that outranks it: ``words`` say which)."""
        if self.stop_reason is None:
            self.stop_reason = why
            self.stop_words = words
        self.stop_requested.set()
        self.wake.set()

    # ---- the attempt ------------------------------------------------------------------

    def _main(self) -> None:
        self.trace.mark("started")
        if self.claim.nnodes > 1:
            self.gang = self._await_gang()
            if self.gang is None:  # released (gang timeout, cancel) or stopped while forming
                self.release(self)
                return
            # Every node writes where node 0's worker does and resumes from the same files.
            self.claim = self.claim.model_copy(
                update={
                    "checkpoint_dir": self.gang.checkpoint_dir,
                    "resume_from": self.gang.resume_from,
                }
            )
        shipper = LogShipper(self.ctx.api, self.job_id, self.attempt)
        shipper.start()
        shipper.write(self._first_line().encode())
        try:
            result = self._run(shipper)
        except Stopped:  # asked to stop while its code or requirements were being readied
            result = self._never_started()
        except JobError as exc:
            result = Outcome(None, "error", str(exc))
        except Exception as exc:
            log.exception("job %s attempt %s: worker error", self.job_id, self.attempt)
            result = Outcome(None, "error", f"worker error: {exc}")
        finally:
            # Whatever happened, no process of this attempt may outlive it.
            if not procs.kill_all(self.launch_id):
                log.error("job %s: processes survived SIGKILL", self.job_id)
        if result.outcome == "error":
            shipper.write(f"[ddpq] {result.reason}\n".encode())
        self._keep_outputs(shipper)
        # As this attempt left it: a retry here reuses it only if nothing changed it since.
        self.ctx.workdirs.attempt_ended(self.job_id)
        self.trace.mark("kept")
        shipper.close(timeout_s=60.0)
        self.trace.mark("shipped")
        self._report(result)
        self.trace.mark("reported")
        try:
            self.trace.record(self.ctx.trace_file, self.job_id, self.attempt)
        except OSError as exc:  # a trace is never worth an attempt's end
            log.warning("trace: %s", exc)
        self.release(self)

    def _keep_outputs(self, shipper: LogShipper) -> None:
        """Send the job's directory as this attempt leaves it (worker.files.outputs), before its
        finish: node 0's (where rank 0 writes), once no process of it runs. Nothing of
        it fails the attempt: the directory stays here whatever the API took."""
        code = self.claim.spec.code
        workdir = self.ctx.workdirs.path_of(self.job_id)
        node0 = self.gang is None or self.gang.node_rank == 0
        if not code or workdir is None or not node0 or self.stop_reason == "abandoned":
            return
        api = self.ctx.api
        try:
            words = outputs.keep(
                api, self.job_id, self.attempt, workdir, lambda: api.snapshot(code).manifest
            )
        except Exception as exc:
            log.exception("job %s: keeping its outputs failed", self.job_id)
            words = f"[ddpq] its outputs could not be sent ({exc}); its directory {workdir} "
            words += "stays on this worker\n"
        shipper.write(words.encode())

    def _first_line(self) -> str:
        gpus = self.claim.gpus
        where = f"GPUs {','.join(map(str, gpus))}" if gpus else "CPU"
        node = ""
        if self.gang is not None:
            node = (
                f", node {self.gang.node_rank} of {self.gang.nnodes} "
                f"(rendezvous {self.gang.rdzv_endpoint}, id {self.gang.rdzv_id})"
            )
        return (
            f"[ddpq] attempt {self.attempt} on worker {self.ctx.name}: "
            f"{self.claim.nproc_per_node} rank(s) on {where}{node}\n"
        )

    def _await_gang(self) -> GangReply | None:
        """Hold this node slot until every node of the attempt is held: the rendezvous
        to start torchrun with, or None if the slot was released or we were stopped.
        The worker's claim loop goes on meanwhile with its other free slots."""
        api = self.ctx.api
        log.info(
            "job %s attempt %s: holding node slot %s of %s; waiting for the other nodes",
            self.job_id,
            self.attempt,
            self.claim.node_rank,
            self.claim.nnodes,
        )
        while True:
            if self.stop_requested.is_set():
                if self.stop_reason != "abandoned":  # abandoned: already released
                    with contextlib.suppress(ApiUnavailable, ApiRefused):
                        left = api.gang(self.job_id, self.attempt, 0, leave=True)
                        if left.state == "ready":
                            # The gang completed before we left: end the attempt for
                            # every node now instead of leaving them to our lease.
                            self._report(self._never_started())
                return None
            try:
                reply = api.gang(self.job_id, self.attempt, GANG_POLL_S)
            except ApiUnavailable as exc:
                log.warning("gang: API unavailable (%s)", exc)
                self.stop_requested.wait(1.0)
                continue
            except ApiRefused as exc:
                log.warning("job %s: gang refused (%s); standing down", self.job_id, exc)
                return None
            if reply.state == "ready":
                return reply
            if reply.state == "released":
                log.info("job %s: node slot released: %s", self.job_id, reply.reason)
                return None

    def _never_started(self) -> Outcome:
        """How an attempt stopped before its processes started ends."""
        timeout_s = self.claim.spec.timeout_s
        return stopped(self.stop_reason or "shutdown", timeout_s, None, self.stop_words)

    def _report(self, result: Outcome) -> None:
        self.ending(self)
        finish(
            self.ctx.api, self.job_id, self.attempt, result, self.stop_reason, self.ctx.claimer_done
        )

    # ---- what runs (worker.starting.torchrun decides) -------------------------------------------

    def _program(self, spec: ClaimedSpec) -> list[str]:
        return torchrun.program(spec, self.ctx.workspace)

    def _env(self, resume_from: str | None) -> dict[str, str]:
        return prepare.environment(self.ctx, self.claim, self.launch_id, resume_from)

    def _run(self, shipper: LogShipper) -> Outcome:
        # The attempt's own directories, named so no job can guess them: torchrun's log
        # files (the job's: torchrun runs under its uid) beside the output file the
        # worker tails (the worker's: a job that could swap it for a link would have the
        # worker ship whatever it names), and its scratch (TMPDIR; HOME when walled),
        # made in the worker's temporary directory: a short path, since programs put
        # Unix sockets there (multiprocessing's, for DataLoader workers) and a socket's
        # path has at most 107 bytes.
        name = f"job-{self.job_id}-attempt-{self.attempt}-{secrets.token_hex(6)}"
        log_dir = self.ctx.logs_root / name
        scratch = Path(tempfile.mkdtemp(prefix=f"ddpq-job-{self.job_id}-"))
        try:
            with self.ctx.walls.attempt(self.job_id) as held:
                log_dir.mkdir(parents=True)
                log_dir.chmod(0o711)  # not the umask's (`ddpq up` runs with 077)
                owned = held.own(scratch)
                cache_env = self._cache(held, owned, shipper)
                self.trace.mark("held")
                return self._run_held(held, shipper, log_dir, owned, cache_env)
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
            self.trace.mark("released")

    def _cache(self, held: Held, scratch: Path, shipper: LogShipper) -> dict[str, str]:
        """The ranks' cache variables: their owner's cache here, lent to the attempt until
        ``held`` ends (worker.files.caches), or an empty one in ``scratch``; none when caches
        are off."""
        caches = self.ctx.caches
        if caches is None or not caches.enabled:
            return {}
        lease, words = caches.lend(self.claim.owner, held, scratch, self.job_id, self.attempt)
        if words:
            shipper.write(words.encode())
        return lease.env()

    def _run_held(
        self,
        held: Held,
        shipper: LogShipper,
        log_dir: Path,
        scratch: Path,
        cache_env: dict[str, str] | None = None,
    ) -> Outcome:
        checkpoints = Path(self.claim.checkpoint_dir)
        # A fork's checkpoint, fetched into its directory before the attempt is given it.
        forked = sending.write_fork(
            self.ctx.api, self.ctx.workdirs.cache, self.claim, self.stop_requested
        )
        if forked and self.claim.fork_from is not None:
            said = f"[ddpq] {sending.words(self.claim.fork_from)} is at {forked}\n"
            shipper.write(said.encode())
        if self.gang is None or self.gang.node_rank == 0:
            held.own(checkpoints)
        else:
            # Node 0's directory (rank 0 writes there): its worker gives it to its uid,
            # which the nodes share when their hosts do (the search starts at the job's id).
            checkpoints.mkdir(parents=True, exist_ok=True)
        # torchrun's log files: the job's (torchrun runs under its uid). Given with the
        # rest before the launch is prepared, so the attempt's walls are set up in one place.
        ranks_dir = held.own(log_dir / "ranks")
        with prepare.prepared(
            self.ctx,
            self.claim,
            launch_id=self.launch_id,
            say=lambda line: shipper.write(line.encode()),
            stop=self.stop_requested,
            where="the worker's workspace",
            scratch=scratch,
            user=held.user,
            own=held.own,
            lend=held.lend,
            cache_env=cache_env,
        ) as launch:
            self.trace.mark("prepared")
            if self.stop_requested.is_set():
                return self._never_started()
            rdzv = torchrun.rendezvous(self.gang, self.ctx.advertise_addr)
            argv = torchrun.argv(launch.python, self.claim, rdzv, launch.program, ranks_dir)
            forked_by = warm.socket_for_attempt(
                self.ctx.warm_pool, self.ctx.launcher, self.claim.spec, self.claim.nproc_per_node,
                launch.python, launch.env, lambda line: shipper.write(line.encode()),
            )  # fmt: skip
            return self._supervise(argv, log_dir / "output.log", launch, shipper, held, forked_by)

    # ---- supervision -------------------------------------------------------------------

    def _supervise(
        self,
        argv: list[str],
        output: Path,
        launch: prepare.Launch,
        shipper: LogShipper,
        held: Held,
        warm_socket: str | None = None,
    ) -> Outcome:
        uid = held.user.uid if held.user else None
        run = Tailed(
            launcher.launcher_argv(argv, self.ctx.kill_grace_s, uid, uid, warm_socket),
            output,
            self._first_line_marked(shipper.write),
            env=launch.env,
            cwd=launch.cwd,
            skip=self._noise,
            name=f"out-{self.job_id}",
            on_exit=self.wake.set,
        )
        self.trace.mark("spawned")
        spawned = time.monotonic()  # worker.edges.oom reads the kernel's records since then
        oom_kills = oom.cgroup_oom_kills()  # and, where it cannot, the cgroup's count
        timeout_s = self.claim.spec.timeout_s
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        # Woken by the exit or a stop request, at once: a poll here would add its
        # interval's half, on average, to every job's end (worker.executors.trace saw 50 ms).
        while not run.exited.is_set():
            if deadline is not None and time.monotonic() > deadline:
                self.request_stop("timeout")
            if self.stop_requested.is_set():
                self._terminate(run.proc)
                break
            self.wake.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self.wake.clear()
        code = run.exit_code()
        self.trace.mark("exited")
        if uid is None:  # walled, the attempt's uid is swept as it ends (worker.walled.walls)
            procs.kill_all(self.launch_id)
        tail = run.drain()
        self.trace.mark("drained")
        if self.stopping_since is not None:
            took = time.monotonic() - self.stopping_since
            how = "SIGKILL" if code == 128 + signal.SIGKILL else "SIGTERM"
            words = stop_words(self.stop_reason, timeout_s, self.stop_words)
            shipper.write(
                f"[ddpq] {words}: stopped the ranks with {how} in {took:.1f} s\n".encode()
            )
        result = torchrun.outcome(code, tail, self.stop_reason, timeout_s, self.stop_words)
        failed = torchrun.first_failure(tail) if result.outcome == "exited" else None
        if failed is not None and failed.exitcode == -signal.SIGKILL and failed.pid:
            # Was it the OOM killer? The kernel's log says, where the worker may read it.
            result.oom = oom.killed_for_memory([failed.pid], spawned, oom_kills)
        return result

    def _first_line_marked(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """``write``, marking the first line of a rank's output as it passes
        (worker.executors.trace)."""

        seen = False

        def first(line: bytes) -> None:
            nonlocal seen
            if not seen and line.startswith(b"[rank"):
                seen = True
                self.trace.mark("first_line")
            write(line)

        return first

    def _noise(self, line: bytes) -> bool:
        """Once the worker stops the attempt, torchrun's own output is not the user's."""
        return self.stopping_since is not None and not line.startswith(b"[rank")

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the supervisor, which forwards it to torchrun (which stops its ranks);
        SIGKILL the group after the grace period."""
        self.stopping_since = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.ctx.kill_grace_s)
        except subprocess.TimeoutExpired:
            procs.signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
