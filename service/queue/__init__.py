"""The claim and lease SQL: the one package that moves jobs between workers.

- ``rules``: what the claim, the books, the leases and the reasons share (device fit,
  node slot states, the claim order), each written once for SQL and Python.
- ``books``: what each worker has and what of it is held.
- ``claim``: hand a worker the best queued job that fits; nothing once it left.
- ``memo``: what idle long-polls need not ask the database again (NothingFits).
- ``gangs``: multi-node jobs, claimed as gangs of node slots.
- ``states``: the job state machine: every move a status may make, and what it does.
- ``leases``: workers, heartbeats, how attempts end, and the fencing check.
- ``reasons``: why a queued job waits, in words.
- ``shares``: fair share: each user's recent usage, the share a queued job is ordered by.
- ``quotas``: each user's limits, and the flags that hold their queued jobs back.
- ``preempt``: a job that outranks running ones, with no room, takes theirs.
- ``deps``, ``forks``: what a queued job waits for: other jobs' ends, a checkpoint sent.

Other modules import this package and call what it re-exports below.
"""

from service.queue import plan
from service.queue.books import Capacity, capacities, live_count, shapes
from service.queue.books import overview as workers_overview
from service.queue.claim import Claim, claim_next_job, leave
from service.queue.deps import check as dependencies_unmet
from service.queue.deps import record as record_dependencies
from service.queue.deps import unmet_of as dependencies_of
from service.queue.forks import ask as ask_checkpoint
from service.queue.forks import check as fork_source_of
from service.queue.forks import kept as fork_snapshots_kept
from service.queue.forks import record as record_fork
from service.queue.forks import sent as checkpoints_sent
from service.queue.forks import source as fork_source
from service.queue.gangs import expire_gangs, gang_status, leave_gang, node_of, nodes_of
from service.queue.leases import (
    Elsewhere,
    NameTaken,
    end_attempt,
    fenced,
    held_attempts,
    record_heartbeat,
    register_worker,
    workers_attempt,
)
from service.queue.lost import expire_leases, expire_nodes, lease_due, release_worker
from service.queue.memo import NothingFits, Probe
from service.queue.preempt import sweep as preempt_sweep
from service.queue.quotas import DEFAULT as DEFAULT_QUOTA
from service.queue.quotas import Limits, usage_and_limits
from service.queue.quotas import queued as queued_count
from service.queue.quotas import refresh as refresh_quota_flags
from service.queue.quotas import refresh_all as refresh_all_quota_flags
from service.queue.reasons import pending_reasons, reasons_on, unschedulable
from service.queue.rules import (
    NOTIFY_CHANNEL,
    ORDER,
    as_utc,
    at_or_ahead,
    lock_owner,
    notify_claimers,
    room_fits,
)
from service.queue.shares import count_running, share_to_gpu_s, usage_now
from service.queue.shares import overview as usage_overview
from service.queue.shares import sweep as count_usage
from service.queue.shares import usage_of as share_of

__all__ = [
    "DEFAULT_QUOTA",
    "NOTIFY_CHANNEL",
    "ORDER",
    "Capacity",
    "Claim",
    "Elsewhere",
    "Limits",
    "NameTaken",
    "NothingFits",
    "Probe",
    "as_utc",
    "ask_checkpoint",
    "at_or_ahead",
    "capacities",
    "checkpoints_sent",
    "claim_next_job",
    "count_running",
    "count_usage",
    "dependencies_of",
    "dependencies_unmet",
    "end_attempt",
    "expire_gangs",
    "expire_leases",
    "expire_nodes",
    "fenced",
    "fork_snapshots_kept",
    "fork_source",
    "fork_source_of",
    "gang_status",
    "held_attempts",
    "lease_due",
    "leave",
    "leave_gang",
    "live_count",
    "lock_owner",
    "node_of",
    "nodes_of",
    "notify_claimers",
    "pending_reasons",
    "plan",
    "preempt_sweep",
    "queued_count",
    "reasons_on",
    "record_dependencies",
    "record_fork",
    "record_heartbeat",
    "refresh_all_quota_flags",
    "refresh_quota_flags",
    "register_worker",
    "release_worker",
    "requeued",
    "room_fits",
    "shapes",
    "share_of",
    "share_to_gpu_s",
    "unschedulable",
    "usage_and_limits",
    "usage_now",
    "usage_overview",
    "workers_attempt",
    "workers_overview",
]
