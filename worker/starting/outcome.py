"""How an attempt ends, as its finish report says it: pure, for every executor.

An attempt ends either because the worker stopped it (a cancel, its timeout, the
worker's shutdown, a preemption, or it is no longer the worker's) or on its own; the
first is decided here once, whatever ran it and whether it had started. What an exit
of its own means is the launcher's: ``worker.starting.torchrun.outcome`` (torchrun's exit code),
``worker.executors.slurm.ending`` (a Slurm job's final state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Why the worker stops an attempt: a user cancelled it, its timeout_s ran out, the
# worker shuts down, the service hands it back for a job that outranks it, or the
# service moved it on (no longer this worker's: nothing is reported).
STOP_REASONS = ("cancelled", "timeout", "shutdown", "preempted", "abandoned")


@dataclass
class Outcome:
    exit_code: int | None
    outcome: str  # exited, cancelled, timeout, requeue, error, lost
    reason: str | None = None
    # A rank SIGKILL ended: whether the kernel's log says its OOM killer did (worker.edges.oom);
    # None: not killed so, or the log could not be read.
    oom: bool | None = None


def stopped(why: str, timeout_s: Any, code: int | None = None, words: str | None = None) -> Outcome:
    """How an attempt the worker stopped for ``why`` ends (``code``: its exit code, if it
    had started). A hand-back (shutdown, preempted) goes back to the queue uncounted,
    with ``words`` as its reason when given (a preemption names the job it makes room
    for)."""
    if why == "cancelled":
        return Outcome(code, "cancelled", "cancelled by user")
    if why == "timeout":
        return Outcome(code, "timeout", f"timeout after {timeout_s} s")
    if why == "abandoned":
        return Outcome(code, "error", "abandoned")
    if why == "preempted":
        return Outcome(code, "requeue", words or "preempted")
    return Outcome(code, "requeue", words or "worker shut down")


def stop_words(why: str | None, timeout_s: Any, words: str | None = None) -> str:
    """Why the worker stopped an attempt, as the log's last line says it (``words``: the
    service's, for a hand-back: a sweep pausing its trial says so)."""
    if why == "cancelled":
        return "cancelled by user"
    if why == "timeout":
        return f"timeout after {timeout_s} s"
    if why == "shutdown":
        return "the worker is shutting down; the job goes back to the queue"
    if why == "preempted" and words and words.startswith("paused"):
        return f"{words}: held until its sweep promotes it, then resumes from its checkpoint"
    if why == "preempted":
        return "preempted: the job goes back to the queue and resumes from its last checkpoint"
    return "no longer this worker's to run"
