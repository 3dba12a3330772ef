"""Why a queued job is not running, in words a person understands.

Built from the claim's own rules (rules.unit for what a job counts on a worker,
the books for what is free), so the reason a job shows agrees with what the claim
does: tests/test_reasons_property.py checks that on random states. The books are read
as ``books.summary``: workers grouped by all a reason reads of them (slots, GPUs, what
of them is free, live), so a reason costs the kinds of workers, not the workers and
the jobs they run (it is decided for every queued job shown and on every submit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ddpq.rules import UNSCHEDULABLE, checkpoint_words
from service.db import Policy
from service.models import Job, utcnow
from service.queue import deps, forks, quotas, rules
from service.queue.books import Partition, Shape, summary, totals
from service.queue.rules import FORMING, j, jn, policy_of
from service.queue.shares import share_to_gpu_s


def _total(cap: Shape, unit: str) -> int:
    return cap.gpus if unit == "gpu" else cap.cpu_slots


def _free(cap: Shape, unit: str) -> int:
    return cap.free_gpus if unit == "gpu" else cap.free_cpu


def _words(n: int, unit: str) -> str:
    if unit == "gpu":
        return f"{n} GPU" + ("" if n == 1 else "s")
    return f"{n} CPU slot" + ("" if n == 1 else "s")


# ---- bridges: a Slurm partition fits a job, or names why it never can -----------------


def _partition_fits(part: Partition, job: Job) -> bool:
    """Whether a bridge could hand ``job`` to its partition, by the claim's own rule
    (rules.fits_partition)."""
    return bool(
        rules.fits_partition(
            part.gpus_per_node > 0,
            job.nnodes,
            job.device,
            job.nproc_per_node,
            part.nodes,
            part.cpus_per_node,
            part.gpus_per_node,
        )
    )


def _partition_words(cap: Shape, part: Partition) -> str:
    return (
        f"Slurm partition {part.name} (bridge {cap.name}) has {part.nodes} "
        f"node{'' if part.nodes == 1 else 's'} of {part.cpus_per_node} CPUs and "
        f"{part.gpus_per_node} GPUs"
    )


def _bridge_words(cap: Shape, part: Partition, ahead: int) -> str:
    words = (
        f"waiting for the Slurm bridge {cap.name} to hand it to Slurm (it lets at most "
        f"{part.max_pending} of its jobs wait in Slurm)"
    )
    return words + (f"; {ahead} job(s) ahead in the queue" if ahead else "")


def unschedulable_on(caps: list[Shape], job: Job) -> str | None:
    """Why none of the workers ``caps`` could ever run ``job``, or None if one could."""
    bridges = [(c, c.partition) for c in caps if c.partition is not None]
    if any(_partition_fits(part, job) for _, part in bridges):
        return None
    plain = [c for c in caps if c.partition is None]
    found = _unschedulable_on_workers(plain, job)
    if not bridges or (plain and found is None):
        return found
    n, unit = job.nproc_per_node, "gpu" if job.device == "cuda" else "cpu"
    limits = "; ".join(_partition_words(c, part) for c, part in bridges)
    need = f"{UNSCHEDULABLE}: needs {job.nnodes} node(s) of {_words(n, unit)}; {limits}"
    return f"{found}; {limits}" if found else need


def _unschedulable_on_workers(caps: list[Shape], job: Job) -> str | None:
    if job.nnodes > 1:
        return None  # multi-node placement is not decided per worker
    best = {"gpu": 0, "cpu": 0}
    for cap in caps:
        unit = rules.unit(job.device, cap.gpus > 0)
        if unit is None:
            continue
        if _total(cap, unit) >= job.nproc_per_node:
            return None
        best[unit] = max(best[unit], _total(cap, unit))
    if not caps:
        return None  # no worker yet: it waits for one
    n = job.nproc_per_node
    units = {rules.unit(job.device, c.gpus > 0) for c in caps} - {None}
    if units == {"gpu", "cpu"}:  # an auto job, with GPU and CPU-only workers about
        return (
            f"{UNSCHEDULABLE}: needs {_words(n, 'gpu')} on one GPU worker or {_words(n, 'cpu')} "
            f"on one CPU-only worker; the largest have {_words(best['gpu'], 'gpu')} and "
            f"{_words(best['cpu'], 'cpu')}"
        )
    unit = "cpu" if units == {"cpu"} else "gpu"
    return (
        f"{UNSCHEDULABLE}: needs {_words(n, unit)} on one worker; the largest worker has "
        f"{_words(best[unit], unit)}"
    )


def unschedulable(s: Session, job: Job) -> str | None:
    """Why no registered worker could ever run ``job``, or None if one could: decided on
    the workers' totals alone (a strict submit asks it in its write transaction)."""
    return unschedulable_on(totals(s), job)


@dataclass
class _View:
    """What every reason is decided on: the workers' books, the live ones, the policy,
    and what the owners of held-back jobs may and do hold (quotas)."""

    caps: list[Shape]
    live: list[Shape]
    policy: Policy
    now: datetime
    held: dict[str, tuple[quotas.Limits, int, int]] = field(default_factory=dict)
    # Jobs others hand back slots for (preemption): how many are handing back.
    handing_back: dict[int, int] = field(default_factory=dict)
    # What jobs that wait for others still wait for (service.queue.deps).
    waiting: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    # A fork's checkpoint not yet sent: (its job, its step, the worker asked).
    forking: dict[int, tuple[int, int, str | None]] = field(default_factory=dict)
    # What a queued job's share reads as in GPU-seconds now (shares.share_to_gpu_s),
    # read the first time a reason says it: a submit's own reason mostly never does.
    scale: Callable[[], float] = float  # float() is 0.0: no usage before it is read
    to_gpu_s: float | None = None


def _waiting_words(job: Job, view: _View) -> str | None:
    """The jobs ``job`` waits for, before anything else: no claim takes it till then."""
    if not getattr(job, "waits_on", 0):
        return None
    unmet = view.waiting.get(job.id, [])
    fork = view.forking.get(job.id)
    said = []
    if fork is not None:
        src, step, worker = fork
        said.append(f"{checkpoint_words(src, step)} to be sent by worker {worker}")
    if unmet or fork is None:
        named = (
            ", ".join(
                f"job {on} to {'succeed' if when == 'ok' else 'end'}" for on, when in unmet[:5]
            )
            or "the jobs it depends on"
        )
        more = f" and {len(unmet) - 5} more" if len(unmet) > 5 else ""
        listed = ", ".join(f"{on}:{w}" for on, w in unmet[:5])
        said.append(f"{named}{more}" + (f" (after: {listed})" if listed else ""))
    return "waiting for " + "; and for ".join(said)


def _quota_words(job: Job, view: _View) -> str | None:
    """Why its owner's limits hold ``job`` back (quotas set the flags the claim reads):
    None if they do not, or if it may still start where it takes no GPUs."""
    if not (job.quota_running or job.quota_gpus) or job.owner not in view.held:
        return None
    limits, running, gpus = view.held[job.owner]
    if job.quota_running:
        return (
            f"waiting: {job.owner} runs {running} of their {limits.max_running} jobs at once "
            "(their quota)"
        )
    need = job.nproc_per_node * job.nnodes
    return (
        f"waiting: {job.owner} holds {gpus} of their {limits.max_gpus} GPUs and this job "
        f"needs {need} (their quota)"
    )


def pending_reasons(s: Session, jobs: list[Job], positions: dict[int, int]) -> dict[int, str]:
    """Why each queued job is not running, in words a person understands."""
    if not jobs:
        return {}
    return reasons_on(s, jobs, positions, summary(s, policy_of(s).lease_s))


def reasons_on(
    s: Session,
    jobs: list[Job],
    positions: dict[int, int],
    caps: list[Shape],
    to_gpu_s: float | None = None,
) -> dict[int, str]:
    """``pending_reasons`` decided on the workers ``caps`` (``books.summary``, or the
    per-worker ``books.shapes``: the same words), with what a share reads as in
    GPU-seconds when the caller has it (``shares.share_to_gpu_s``; read when needed)."""
    policy = policy_of(s)
    view = _View(caps, [c for c in caps if c.live], policy, utcnow())
    for owner in {job.owner for job in jobs if job.quota_running or job.quota_gpus}:
        if owner is not None:
            view.held[owner] = (quotas.limits(s, owner), *quotas.holdings(s, owner))
    making = [job.id for job in jobs if job.preempting_on is not None]
    if making:
        asked = select(Job.preempted_by, func.count()).where(Job.preempted_by.in_(making))
        rows = s.execute(asked.group_by(Job.preempted_by))
        view.handing_back = {int(b): int(n) for b, n in rows if b is not None}
    held = _slots_held(s, [job.id for job in jobs if job.nnodes > 1])
    waits = [job.id for job in jobs if getattr(job, "waits_on", 0)]
    view.waiting = deps.unmet_of(s, waits)
    view.forking = forks.waiting(s, waits)
    view.scale = lambda: share_to_gpu_s(s, view.now)
    view.to_gpu_s = to_gpu_s
    return {
        job.id: _gang_reason(job, held.get(job.id, 0), view)
        if job.nnodes > 1
        else _reason(job, positions.get(job.id, 1) - 1, view)
        for job in jobs
    }


def _slots_held(s: Session, gang_ids: list[int]) -> dict[int, int]:
    """Node slots held so far by each forming gang."""
    if not gang_ids:
        return {}
    counts = select(j.id, func.count(jn.id)).where(FORMING, j.id.in_(gang_ids)).group_by(j.id)
    return {job_id: int(n) for job_id, n in s.execute(counts).all()}


def _backoff(job: Job, now: datetime) -> str | None:
    if job.not_before is not None and job.not_before > now:
        wait = (job.not_before - now).total_seconds()
        return f"waiting out its retry backoff: {wait:.0f} s left"
    return None


def _no_worker(view: _View) -> str | None:
    if not view.caps:
        return "waiting for a worker: none has registered"
    if not view.live:
        lease = view.policy.lease_s
        return f"waiting for a worker: each has left or sent no heartbeat in the last {lease:g} s"
    return None


def _live_bridge(view: _View, job: Job) -> tuple[Shape, Partition] | None:
    """A live bridge whose partition fits ``job``: it waits for that bridge's turn."""
    for c in view.live:
        if c.partition is not None and _partition_fits(c.partition, job):
            return c, c.partition
    return None


def _could_run(cap: Shape, job: Job) -> bool:
    """Whether ``cap`` could run ``job`` were it empty."""
    unit = rules.unit(job.device, cap.gpus > 0)
    return unit is not None and _total(cap, unit) >= job.nproc_per_node


def _order(job: Job, view: _View) -> str:
    """What places a job among those ahead: its priority, then its owner's usage (fair
    share), in words (GET /queue says which factor put each ahead of the next)."""
    if job.owner is None:
        return ""
    if view.to_gpu_s is None:
        view.to_gpu_s = view.scale()
    used = (job.share or 0.0) * view.to_gpu_s
    return f" (by priority, then fair share: {job.owner}'s recent usage {used:.1f} GPU-s)"


def _reason(job: Job, ahead: int, view: _View) -> str:
    """A single-node job's reason: what it waits for, by the claim's own rules."""
    first = (
        unschedulable_on(view.caps, job)
        or _waiting_words(job, view)
        or _backoff(job, view.now)
        or _no_worker(view)
    )
    if first:
        return first
    # Held back by its owner's limits: on no worker, or (GPUs) on those it would take
    # GPUs of; a CPU-only worker may still run an auto job (the claim's rule,
    # rules.quota_lets, which the preemption pass decides by too).
    live = view.live
    quota = _quota_words(job, view)
    if quota is not None:
        live = [
            c
            for c in live
            if rules.quota_lets(c.gpus > 0, job.device, job.quota_running, job.quota_gpus)
        ]
        if not any(_could_run(c, job) for c in live):
            return quota
    bridge = _live_bridge(view, job)
    if bridge is not None:
        return _bridge_words(*bridge, ahead)
    best_free = {"gpu": 0, "cpu": 0}
    fits_now = False
    for cap in live:
        unit = rules.unit(job.device, cap.gpus > 0)
        if unit is None or _total(cap, unit) < job.nproc_per_node:
            continue
        best_free[unit] = max(best_free[unit], _free(cap, unit))
        fits_now = fits_now or _free(cap, unit) >= job.nproc_per_node
    if fits_now:
        if ahead:
            return f"waiting for its turn: {ahead} job(s) ahead in the queue" + _order(job, view)
        return "waiting for a worker to claim it"
    if job.preempting_on is not None and job.id in view.handing_back:
        n = view.handing_back[job.id]
        return (
            f"waiting for room on worker {job.preempting_on}: {n} job(s) there were asked "
            "to hand back their slots for it (preemption)"
        )
    # A cuda job while no live worker has GPUs still waits for GPUs.
    unit = rules.unit(job.device, any(c.gpus for c in live)) or "gpu"
    words = (
        f"waiting for {_words(job.nproc_per_node, unit)}; the most free on one "
        f"worker is {best_free[unit]}"
    )
    waited = (view.now - (job.queued_at or job.created_at)).total_seconds()
    if waited > view.policy.starvation_s:
        words += (
            f"; it has waited over {view.policy.starvation_s:g} s, so later jobs no longer "
            "start ahead of it"
        )
    return words


def _gang_reason(job: Job, held: int, view: _View) -> str:
    """Why a multi-node job waits: its slots so far, and how many workers could be a node."""
    backoff = (
        unschedulable_on(view.caps, job) or _waiting_words(job, view) or _backoff(job, view.now)
    )
    if backoff:
        return backoff
    quota = _quota_words(job, view)
    if quota is not None:
        return quota
    bridge = _live_bridge(view, job)
    if bridge is not None and not held:
        return _bridge_words(*bridge, 0)
    live = [c for c in view.live if c.partition is None]
    n, per_node = job.nnodes, job.nproc_per_node
    fit = 0
    unit = "cpu"
    for cap in live:
        u = rules.unit(job.device, cap.gpus > 0)
        if u is not None and _total(cap, u) >= per_node:
            unit = u if fit == 0 else unit
            fit += cap.count
    words = f"waiting for {n} nodes: {held} of {n} held"
    if fit < n:
        words += (
            f"; {fit} live worker(s) can run a node of {_words(per_node, unit)}, "
            f"each node needs its own worker"
        )
    return words
