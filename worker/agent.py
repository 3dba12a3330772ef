"""The worker's main loop: register, long-poll for jobs that fit, heartbeat, shut down cleanly."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

from ddpq.messages import ClaimedJob
from ddpq.wire import Backoff
from worker import health, procs
from worker import walls as walls_
from worker.api import Refused, Unavailable, WorkerAPI, claim_or_wait, retry
from worker.code import Workdirs
from worker.requirements import Policy
from worker.runner import JobRunner, RunContext
from worker.venvs import Venvs
from worker.walls import Walls

log = logging.getLogger("ddpq.worker")

CLAIM_WAIT_S = 5.0  # also bounds how long shutdown waits for an open claim
DEFAULT_CODE_CACHE_BYTES = 10 * 1000**3
DEFAULT_MAX_ENVS = 8
MAX_KEPT = 10_000  # job directories a heartbeat asks about (the API's limit)


class Agent:
    def __init__(
        self,
        *,
        url: str,
        token: str,
        name: str | None,
        workspace: Path,
        data_dir: Path,
        checkpoint_dir: Path | None,
        cpu_slots: int,
        gpus: list[int],
        kill_grace_s: float = 10.0,
        advertise_addr: str | None = None,
        rdzv_ports: tuple[int, int] | None = None,
        identity: str | None = None,
        code_cache_bytes: int = DEFAULT_CODE_CACHE_BYTES,
        keep_workdirs_s: float = 0.0,
        max_envs: int = DEFAULT_MAX_ENVS,
        walls: Walls | None = None,
        pip_policy: Policy | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name or socket.gethostname()
        self.workspace = workspace.resolve()
        self.data_dir = data_dir.resolve()
        self.checkpoint_root = (checkpoint_dir or self.data_dir / "checkpoints").resolve()
        self.cpu_slots = cpu_slots
        self.gpus = sorted(set(gpus))
        self.kill_grace_s = kill_grace_s
        # Multi-node jobs: where the other nodes reach this host, and the ports its
        # rendezvous stores may use (None: any free port).
        self.advertise_addr = advertise_addr or default_advertise_addr()
        self.rdzv_ports = rdzv_ports
        self.api = WorkerAPI(self.url, token, self.name, identity)
        self.launch_prefix = procs.launch_prefix(self.name, self.data_dir)
        self.heartbeat_s = 2.0
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._runners: dict[tuple[int, int], JobRunner] = {}
        self._slots_changed = threading.Event()
        self.claimer_done = threading.Event()  # the claim loop has returned (shutdown)
        self.walls = walls or Walls(None)
        self.workdirs = Workdirs(self.data_dir, code_cache_bytes, keep_workdirs_s)
        (self.data_dir / "torchrun-logs").mkdir(exist_ok=True)
        self.context = RunContext(
            api=self.api,
            name=self.name,
            url=self.url,
            workspace=self.workspace,
            data_dir=self.data_dir,
            launch_prefix=self.launch_prefix,
            advertise_addr=self.advertise_addr,
            kill_grace_s=kill_grace_s,
            claimer_done=self.claimer_done,
            workdirs=self.workdirs,
            venvs=Venvs(self.data_dir / "venvs", max_envs, self.walls, pip_policy, token),
            walls=self.walls,
        )

    # ---- slots ------------------------------------------------------------------

    def free(self) -> tuple[int, list[int]]:
        with self._lock:
            claims = [r.claim for r in self._runners.values()]
        used_cpu = sum(c.nproc_per_node for c in claims if c.device == "cpu")
        used_gpus = {g for c in claims for g in c.gpus}
        return max(0, self.cpu_slots - used_cpu), [g for g in self.gpus if g not in used_gpus]

    def release(self, runner: JobRunner) -> None:
        """Called by a runner once its processes are gone and its end is reported."""
        with self._lock:
            self._runners.pop((runner.job_id, runner.attempt), None)
        self._slots_changed.set()

    def rdzv_port(self) -> int | None:
        """A port free on this host for a rendezvous store, not already offered to one
        of this worker's node-0 slots; None when the range is used up."""
        taken = {r.rdzv_port for r in self.running()}
        candidates = range(self.rdzv_ports[0], self.rdzv_ports[1] + 1) if self.rdzv_ports else [0]
        for port in candidates:
            if port in taken:
                continue
            with socket.socket() as s:
                try:
                    # All interfaces, as torchrun's TCPStore binds.
                    s.bind(("", port))
                except OSError:
                    continue
                free = int(s.getsockname()[1])
            if free not in taken:
                return free
        return None

    def running(self) -> list[JobRunner]:
        with self._lock:
            return list(self._runners.values())

    # ---- loops ------------------------------------------------------------------

    def register(self) -> None:
        reply = retry(
            lambda: self.api.register(
                {
                    "name": self.name,
                    "hostname": socket.gethostname(),
                    "cpu_slots": self.cpu_slots,
                    "gpus": self.gpus,
                    "checkpoint_root": str(self.checkpoint_root),
                    "running": [{"job_id": r.job_id, "attempt": r.attempt} for r in self.running()],
                }
            ),
            what="register",
            stop=self.stopping,
        )
        self.heartbeat_s = reply.heartbeat_s
        health.record(self.data_dir, self.heartbeat_s)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            self.heartbeat_once()
        # Keep leases alive while running jobs are being stopped during shutdown.
        while self.running() and not self._all_done.wait(self.heartbeat_s):
            self.heartbeat_once()

    def heartbeat_once(self) -> None:
        runners = {(r.job_id, r.attempt): r for r in self.running()}
        kept = self.workdirs.kept()[:MAX_KEPT]
        try:
            reply = self.api.heartbeat([{"job_id": j, "attempt": a} for j, a in runners], kept)
        except Unavailable as exc:
            log.warning("heartbeat: API unavailable (%s)", exc)
            return
        except Refused as exc:
            if exc.status == 404:  # the service forgot us (e.g. a fresh database)
                self.register()
            elif exc.status == 409:
                # Another process registered this name after our heartbeats went stale
                # and took our jobs over: ours are duplicates now, and so are we.
                log.error("stopping: %s", exc)
                for dup in runners.values():
                    dup.request_stop("abandoned")
                self.stopping.set()
            else:
                log.warning("heartbeat refused: %s", exc)
            return
        health.record(self.data_dir, self.heartbeat_s)
        if reply.ended:
            self.workdirs.ended(reply.ended, running={j for j, _ in runners})
        for item in reply.cancel:
            r = runners.get((item.job_id, item.attempt))
            if r is not None:
                r.request_stop("cancelled")
        for back in reply.preempt:
            r = runners.get((back.job_id, back.attempt))
            if r is not None:
                log.info("job %s attempt %s: %s; handing it back", r.job_id, r.attempt, back.reason)
                r.request_stop("preempted", back.reason)
        for item in reply.abandon:
            r = runners.get((item.job_id, item.attempt))
            if r is not None:
                log.warning("job %s attempt %s is no longer ours; stopping it", r.job_id, r.attempt)
                r.request_stop("abandoned")

    def _claim_loop(self) -> None:
        try:
            self._claim_until_stopped()
        finally:
            self.claimer_done.set()

    def _claim_until_stopped(self) -> None:
        backoff = Backoff()
        while not self.stopping.is_set():
            free_cpu, free_gpus = self.free()
            if free_cpu == 0 and not free_gpus:
                self._slots_changed.wait(1.0)
                self._slots_changed.clear()
                continue
            port = self.rdzv_port()
            claim = claim_or_wait(
                functools.partial(
                    self.api.claim, free_cpu, free_gpus, CLAIM_WAIT_S, self.advertise_addr, port
                ),
                stop=self.stopping,
                backoff=backoff,
                register=self.register,
            )
            if claim is not None:
                # Node 0 of a gang hosts the rendezvous on the port offered with the claim.
                hosting = claim.nnodes > 1 and claim.node_rank == 0
                self._start(claim, port if hosting else None)

    def _start(self, claim: ClaimedJob, rdzv_port: int | None) -> None:
        runner = JobRunner(self.context, claim, self.release, rdzv_port=rdzv_port)
        with self._lock:
            self._runners[(runner.job_id, runner.attempt)] = runner
        log.info("job %s attempt %s: starting (%s)", runner.job_id, runner.attempt, claim.device)
        if self.stopping.is_set():
            runner.request_stop("shutdown")
        runner.start()

    def build_walls(self) -> None:
        """Walled: the worker's directories get the modes that keep each job to its own,
        the job's uid is checked able to run what jobs run (WallsError says what is
        wrong and the fix), and whatever a worker killed mid-attempt left goes: its
        processes, its files in the shared temporary directories, the directories it had."""
        ctx, walls = self.context, self.walls
        own = [ctx.workdirs.root, ctx.logs_root]
        walls.open_dirs(
            traverse=[self.data_dir, *own, self.checkpoint_root],
            closed=[self.workdirs.cache.root],
            readable=[ctx.venvs.root],
        )
        walls.check(
            sys.executable,
            reachable=[*own, self.checkpoint_root],
            readable=[self.workspace],
            protected=[*walls_.protected_paths(), self.workspace],
            skip=[self.data_dir, self.checkpoint_root],
        )
        if walls.reap():
            log.warning("killed the processes of an earlier worker's jobs (uids in use)")
        for leftover in ctx.logs_root.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
        walls.take_back_orphans(self.workdirs.root)
        walls.take_back_orphans(self.checkpoint_root)

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then hand running jobs back to the queue."""
        self._all_done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        # A worker that died (kill -9, a crash) and comes back under its name may have
        # left ranks behind (torchrun's SIGTERM on our death is not a guarantee); by
        # now the service has moved their jobs on, so nothing of them may keep running.
        leftovers = procs.find_by_launch_id(self.launch_prefix, prefix=True)
        if leftovers:
            log.warning("killing %d leftover process(es) of earlier attempts", len(leftovers))
            procs.kill_all(self.launch_prefix, prefix=True)
        self.build_walls()
        (log.info if self.walls.walled else log.warning)("%s", self.walls.describe())
        self.register()
        log.info(
            "worker %s: %d CPU slots, GPUs %s, workspace %s, API %s, advertising %s",
            self.name,
            self.cpu_slots,
            self.gpus or "none",
            self.workspace,
            self.url,
            self.advertise_addr,
        )
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        claimer = threading.Thread(target=self._claim_loop, name="claim", daemon=True)
        claimer.start()
        self.stopping.wait()
        log.info("worker %s: shutting down; stopping %d job(s)", self.name, len(self.running()))
        for r in self.running():
            r.request_stop("shutdown")
        # A claim answered during shutdown is handed straight back by _start.
        claimer.join(timeout=CLAIM_WAIT_S + 20)
        for r in self.running():
            if r.thread is not None:
                r.thread.join(timeout=self.kill_grace_s + 90)
        self._all_done.set()
        self.api.close()


def default_advertise_addr() -> str:
    """This host's address as its name resolves, else loopback. On Debian the host
    name often resolves to 127.0.1.1: give --advertise-addr on a multi-host setup."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def default_cpu_slots() -> int:
    return os.cpu_count() or 1


def detect_gpus() -> list[int]:
    """Every GPU torch sees (imports torch: only when --gpus is not given)."""
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:
        return []
