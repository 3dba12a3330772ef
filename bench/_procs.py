"""What each process of a run spends while its ranks run, read from /proc by a thread.

On 2 cores every CPU second ddpq spends beside the 2 ranks is taken from them, so a job's
side processes (the API, the worker, the attempt's supervisor, torchrun's agent and its
log tee, the warm process and its rank template) are measured in CPU seconds, which a
noisy machine leaves alone, while the ranks run; and the rest of the machine too (its
load: another benchmark beside this one would make the ranks' times noisy).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.2


@dataclass
class _Proc:
    ppid: int
    sid: int
    cpu: float  # user + system, seconds
    argv: str
    born: int  # start time, in ticks since boot: a pid reused is another process


def _snapshot() -> dict[int, _Proc]:
    procs = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        cpu = (int(f[11]) + int(f[12])) / TICK
        procs[int(d.name)] = _Proc(int(f[1]), int(f[3]), cpu, argv, int(f[19]))
    return procs


def _machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / TICK


def classify(pid: int, procs: dict[int, _Proc], api: set[int], worker: int) -> str:
    """Which part of a run ``pid`` is (its ancestry and command line), or "other": the
    worker's descendants, and a bare torchrun's (the bench's own children)."""
    if pid in api:
        return "API"
    if pid == worker:
        return "worker"
    chain, p = [], pid
    while p in procs and p > 1 and len(chain) < 12:
        chain.append(p)
        p = procs[p].ppid
    bench = os.getpid()
    if worker not in chain and bench not in chain[1:]:
        return "other"
    argv = procs[pid].argv
    if "worker.launch" in argv:
        return "launcher"
    if "worker.tee" in argv or "torch.distributed.run" in argv:
        return "torchrun+tee"  # before the ranks: its command line names worker.entry
    if "worker.entry" in argv or (worker not in chain and bench in chain[2:]):
        return "ranks"  # worker.entry's, or a bare torchrun's (its children)
    if "worker.zygote" in argv:
        depth = chain.index(worker)
        # The zygote is the worker's child; its fork, the agent (torchrun and its tee);
        # the agent's children: the rank template and the ranks (sessions of their own).
        if depth == 1:
            return "zygote"
        if depth == 2:
            return "torchrun+tee"
        return "ranks" if procs[pid].sid == pid else "template"
    return "worker's other children"


@dataclass
class Meter:
    """Samples /proc every SAMPLE_S between start() and stop(): each part's CPU seconds
    over the samples in which 2 ranks ran, and that window's length."""

    api_pids: set[int]
    worker_pid: int
    cpu: dict[str, float] = field(default_factory=dict)
    window_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = os.getpid()
        before, busy0, t0 = _snapshot(), _machine_busy(), time.monotonic()
        ranks_before = 0
        while not self._stop.wait(SAMPLE_S):
            now, busy, t = _snapshot(), _machine_busy(), time.monotonic()
            kinds = {pid: classify(pid, now, self.api_pids, self.worker_pid) for pid in now}
            ranks = sum(k == "ranks" for k in kinds.values())
            if ranks >= 2 and ranks_before >= 2:  # the whole interval with the ranks running
                self.window_s += t - t0
                for pid, proc in now.items():
                    was = before.get(pid)
                    # A process born since the last sample: all of its time is new.
                    d = proc.cpu - (was.cpu if was and was.born == proc.born else 0.0)
                    kind = "bench itself" if pid == me else kinds[pid]
                    self.cpu[kind] = self.cpu.get(kind, 0.0) + d
                self.cpu["machine busy"] = self.cpu.get("machine busy", 0.0) + (busy - busy0)
            before, busy0, t0, ranks_before = now, busy, t, ranks
