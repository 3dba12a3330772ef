"""The local executor: torchrun on this host, an attempt per runner (worker.executors.runner), under
worker.executors.loop's register, claim and heartbeat. What it offers a claim (its free slots, a
rendezvous port), walls, and its clean shutdown (its jobs go back to the queue)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from ddpq.messages import AttemptKey, ClaimedJob, HeldAttempt
from worker.edges import procs
from worker.edges.gpuuse import GpuUseLog
from worker.executors.loop import Loop, Room
from worker.executors.runner import JobRunner, RunContext
from worker.executors.settings import WorkerSettings
from worker.starting import warm
from worker.walled import startcheck
from worker.walled import walls as walls_
from worker.walled.walls import Walls

log = logging.getLogger("ddpq.worker")


class Agent:
    """Runs each claimed attempt in this process's care: its processes stop with it."""

    detached = False

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        token: str,
        identity: str | None = None,
        walls: Walls | None = None,
    ) -> None:
        self.walls = walls or Walls(None)
        self.loop = Loop(
            self,
            settings,
            token=token,
            identity=identity,
            default_name=socket.gethostname(),
            walls=self.walls,
        )
        self.name = self.loop.name
        self.workspace = self.loop.workspace
        self.data_dir = self.loop.data_dir
        self.checkpoint_root = self.loop.checkpoint_root
        self.workdirs = self.loop.workdirs
        # Unset: what this host has (its cores, the GPUs NVML sees).
        cpu_slots, gpus = settings.cpu_slots, settings.gpus
        self.cpu_slots = default_cpu_slots() if cpu_slots is None else cpu_slots
        self.gpus = sorted(set(detect_gpus() if gpus is None else gpus))
        self.kill_grace_s = settings.kill_grace_s
        # Multi-node jobs: where the other nodes reach this host, and the ports its
        # rendezvous stores may use.
        self.advertise_addr = settings.advertise_addr or default_advertise_addr()
        self.rdzv_ports = settings.rdzv_ports
        self.launch_prefix = procs.launch_prefix(self.name, self.data_dir)
        self._lock = threading.Lock()
        self._runners: dict[AttemptKey, JobRunner] = {}
        # Runners whose processes are gone and whose end is being reported: their slots
        # are offered to the next claim, which the API fills once the report commits
        # (waiting for the report's answer would leave them out of a poll sent meanwhile).
        self._ending: set[AttemptKey] = set()
        self._slots_changed = threading.Event()
        self.gpu_use = GpuUseLog()
        (self.data_dir / "torchrun-logs").mkdir(exist_ok=True)
        # A warm process per environment it keeps (--max-envs), and its own interpreter's.
        pool = warm.WarmPool(keep=self.loop.venvs.max_envs + 1)
        self.context = RunContext(
            api=self.loop.api,
            name=self.name,
            url=self.loop.url,
            workspace=self.workspace,
            data_dir=self.data_dir,
            launch_prefix=self.launch_prefix,
            advertise_addr=self.advertise_addr,
            settings=settings,
            claimer_done=self.loop.claimer_done,
            workdirs=self.workdirs,
            venvs=self.loop.venvs,
            walls=self.walls,
            caches=self.loop.caches,
            warm_pool=pool,
        )
        if settings.launcher == "warm":  # the default environment's, ready before the first job
            pool.prestart(sys.executable, warm.default_zygote_env())

    # ---- slots ------------------------------------------------------------------

    def free(self) -> tuple[int, list[int]]:
        with self._lock:
            claims = [r.claim for k, r in self._runners.items() if k not in self._ending]
        used_cpu = sum(c.nproc_per_node for c in claims if c.device == "cpu")
        used_gpus = {g for c in claims for g in c.gpus}
        return max(0, self.cpu_slots - used_cpu), [g for g in self.gpus if g not in used_gpus]

    def ending(self, runner: JobRunner) -> None:
        """Called by a runner once its processes are gone, before its end is reported."""
        with self._lock:
            self._ending.add(AttemptKey(runner.job_id, runner.attempt))
        self._slots_changed.set()

    def release(self, runner: JobRunner) -> None:
        """Called by a runner once its processes are gone and its end is reported."""
        key = AttemptKey(runner.job_id, runner.attempt)
        with self._lock:
            self._runners.pop(key, None)
            self._ending.discard(key)
        self._slots_changed.set()

    def rdzv_port(self) -> int | None:
        """A port free on this host for a rendezvous store, not already offered to one
        of this worker's node-0 slots; None when the range is used up."""
        taken = {r.rdzv_port for r in self.running()}
        for port in range(self.rdzv_ports[0], self.rdzv_ports[1] + 1):
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

    # ---- the executor (worker.executors.loop) ---------------------------------------------------

    def describe(self) -> str:
        return (
            f"worker {self.name}: {self.cpu_slots} CPU slots, GPUs {self.gpus or 'none'}, "
            f"workspace {self.workspace}, API {self.loop.url}, "
            f"advertising {self.advertise_addr}"
        )

    def registration(self) -> dict[str, Any]:
        body = {"cpu_slots": self.cpu_slots, "gpus": self.gpus, "running": self.attempts()}
        devices = self.gpu_devices()
        if devices:
            body["gpu_devices"] = devices
        return body

    def gpu_devices(self) -> list[dict[str, Any]]:
        """This worker's GPUs as NVML names them (none without NVML, or without GPUs)."""
        if not self.gpus:
            return []
        from worker.edges import nvml

        return [
            {"index": g.index, "uuid": g.uuid, "name": g.name, "memory_total": g.memory_total}
            for g in nvml.inventory()
            if g.index in self.gpus
        ]

    def attempts(self) -> list[dict[str, Any]]:
        return [{"job_id": r.job_id, "attempt": r.attempt} for r in self.running()]

    def adopt(self, held: list[HeldAttempt]) -> None:
        """Nothing to take back: a worker's attempts end with it (the books give it none)."""

    def room(self, stop: threading.Event) -> Room | None:
        free_cpu, free_gpus = self.free()
        if free_cpu == 0 and not free_gpus:
            self._slots_changed.wait(1.0)
            self._slots_changed.clear()
            return None
        return Room(free_cpu, tuple(free_gpus), self.advertise_addr, self.rdzv_port())

    def start(self, claim: ClaimedJob, room: Room) -> None:
        # Node 0 of a gang hosts the rendezvous on the port offered with the claim.
        hosting = claim.nnodes > 1 and claim.node_rank == 0
        runner = JobRunner(
            self.context,
            claim,
            self.release,
            rdzv_port=room.rdzv_port if hosting else None,
            ending=self.ending,
        )
        with self._lock:
            self._runners[AttemptKey(runner.job_id, runner.attempt)] = runner
        log.info("job %s attempt %s: starting (%s)", runner.job_id, runner.attempt, claim.device)
        if self.loop.stopping.is_set():  # claimed as the worker stops: handed straight back
            runner.request_stop("shutdown")
        runner.start()

    def stop(self, job_id: int, attempt: int, why: str, words: str | None = None) -> None:
        with self._lock:
            runner = self._runners.get(AttemptKey(job_id, attempt))
        if runner is not None:
            runner.request_stop(why, words)

    def rounds(self) -> list[tuple[str, float, Callable[[], None]]]:
        # GPU use is sampled only where NVML names this worker's GPUs: on a host
        # without it there is nothing to sample, and nothing is sent.
        if not self.gpu_devices():
            return []
        return [("gpu use", self.loop.gpu_sample_s, self.sample_gpus)]

    def sample_gpus(self) -> None:
        self.gpu_use.sample([(r.job_id, r.attempt, list(r.claim.gpus)) for r in self.running()])

    def gpu_samples(self) -> dict[AttemptKey, list[dict[str, Any]]]:
        return self.gpu_use.take()

    def drain(self) -> None:
        for r in self.running():
            if r.thread is not None:
                r.thread.join(timeout=self.kill_grace_s + 90)

    def build_walls(self) -> None:
        """Walled: the worker's directories get the modes that keep each job to its own,
        the job's uid is checked able to run what jobs run and to open its GPUs' device
        nodes (WallsError says what is wrong and the fix), and whatever a worker killed
        mid-attempt left goes: its processes, its files in the shared temporary
        directories, the directories it had."""
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
            devices=startcheck.gpu_devices(self.gpus),
        )
        if walls.reap():
            log.warning("killed the processes of an earlier worker's jobs (uids in use)")
        for leftover in ctx.logs_root.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
        walls.take_back_orphans(self.workdirs.root)
        walls.take_back_orphans(self.checkpoint_root)
        # Users' caches: measured, and those left lent by a worker that died discarded.
        self.loop.caches.start()

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then hand running jobs back to the queue."""
        try:
            self.loop.run(first=self._clear_the_way)
        finally:  # its warm processes and their sockets (they die with it anyway)
            if self.context.warm_pool is not None:
                self.context.warm_pool.stop()

    def _clear_the_way(self) -> None:
        # A worker that died (kill -9, a crash) and comes back under its name may have
        # left ranks behind (torchrun's SIGTERM on our death is not a guarantee); by
        # now the service has moved their jobs on, so nothing of them may keep running.
        leftovers = procs.find_by_launch_id(self.launch_prefix, prefix=True)
        if leftovers:
            log.warning("killing %d leftover process(es) of earlier attempts", len(leftovers))
            procs.kill_all(self.launch_prefix, prefix=True)
        self.build_walls()
        (log.info if self.walls.walled else log.warning)("%s", self.walls.describe())


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
    """Every GPU NVML sees, by its index (only when --gpus is not given); none without
    NVML. The agent never imports torch for this (worker/edges/nvml.py says why)."""
    from worker.edges import nvml

    return [g.index for g in nvml.inventory()]
