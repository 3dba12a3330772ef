"""What the Slurm bridge decides, as pure functions: no command is run here.

The partition's shape from ``sinfo``, an attempt's ``sbatch`` command line and batch
script, what ``squeue``/``scontrol`` say of a job, and what a Slurm job's end means
for its ddpq attempt. worker.executors.bridge runs the commands; worker.slurmnode is what the
batch script starts on every node.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddpq.errors import SlurmError
from ddpq.messages import ClaimedJob
from worker.starting.outcome import Outcome, stopped

# The Slurm job's name names the ddpq job and attempt; its comment names the bridge (and
# its data dir's identity: another bridge of that name, for another API, is another),
# so a restarted bridge finds what it submitted and nothing of another bridge's.
NAME = re.compile(r"^ddpq-job(\d+)-a(\d+)$")
COMMENT_PREFIX = "ddpq bridge "
# Slurm still waits: these states hold no process yet (or only Slurm's own prolog).
WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD"})
# States a Slurm job ends in (and COMPLETING: its processes are being reaped).
ENDED = frozenset(
    {
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
        "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT",
    }
)  # fmt: skip
# Pending reasons in plain words; others are shown as Slurm says them.
REASON_WORDS = {
    "Resources": "waiting for resources",
    "Priority": "other jobs have priority",
    "Dependency": "waiting for a dependency",
    "ReqNodeNotAvail": "the nodes it needs are unavailable",
    "PartitionDown": "the partition is down",
    "PartitionNodeLimit": "it asks more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit exceeds the partition's",
    "QOSMaxJobsPerUserLimit": "the QOS limit on jobs per user is reached",
    "AssocGrpCpuLimit": "the account's CPU limit is reached",
    "AssocGrpGRES": "the account's GPU limit is reached",
    "BeginTime": "its start time has not come",
    "JobHeldUser": "held by its user",
    "JobHeldAdmin": "held by an administrator",
}


def job_name(job_id: int, attempt: int) -> str:
    return f"ddpq-job{job_id}-a{attempt}"


def comment(bridge: str, identity: str | None) -> str:
    return f"{COMMENT_PREFIX}{bridge} {identity or '-'}"


# ---- the partition ---------------------------------------------------------------------

SINFO_FORMAT = "%N|%c|%G"  # per node (sinfo -N): name, CPUs, generic resources


def gpus_of(gres: str) -> int:
    """GPUs in a Gres string: ``gpu:4``, ``gpu:a100:8(S:0-1)``, ``(null)``."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_shape(partition: str, sinfo: str, max_pending: int) -> dict[str, Any]:
    """The shape a bridge registers (service.schemas.ClusterShape) from ``sinfo -h -N -p
    PARTITION -o SINFO_FORMAT``: its node count and its largest node's CPUs and GPUs."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in sinfo.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[1].strip().isdigit():
            continue
        name, cpus, gres = fields
        nodes[name] = (int(cpus), gpus_of(gres))
    if not nodes:
        raise SlurmError(f"Slurm partition {partition!r} has no nodes (sinfo says nothing of it)")
    return {
        "kind": "slurm",
        "partition": partition,
        "nodes": len(nodes),
        "cpus_per_node": max(c for c, _ in nodes.values()),
        "gpus_per_node": max(g for _, g in nodes.values()),
        "max_pending": max_pending,
    }


# ---- submitting ------------------------------------------------------------------------


@dataclass(frozen=True)
class Submission:
    """Where an attempt goes: the bridge's flags, as the operator gave them."""

    partition: str
    account: str | None
    extra: tuple[str, ...]  # --sbatch-arg, passed through as given
    bridge: str
    identity: str | None
    output_dir: str  # Slurm's own file of the batch script's output, per job


def refused(error: str) -> bool:
    """Whether sbatch refused the job itself (a bad account, partition or limit: sending
    it again changes nothing), rather than failing to reach slurmctld."""
    return "Batch job submission failed" in error and not any(
        passing in error
        for passing in ("Socket timed out", "Unable to contact", "Slurm temporarily unable")
    )


def time_limit(timeout_s: Any) -> str | None:
    """Slurm's --time (minutes, at least 1) for a job's timeout_s: a bound the bridge's
    own, exact timeout never reaches, so a job Slurm ends for time is one the bridge
    could not stop."""
    if not timeout_s:
        return None
    return str(math.ceil(float(timeout_s) / 60) + 1)


def sbatch_argv(claim: ClaimedJob, to: Submission) -> list[str]:
    """The sbatch command line of one attempt: one task per node, each with the CPUs
    (and GPUs) its ranks use; nothing of the bridge's environment goes along. The batch
    script goes on sbatch's standard input: no file holds its job token."""
    argv = [
        "sbatch", "--parsable",
        "--job-name", job_name(claim.job_id, claim.attempt),
        "--comment", comment(to.bridge, to.identity),
        "--partition", to.partition,
        "--nodes", str(claim.nnodes),
        "--ntasks-per-node", "1",
        "--cpus-per-task", str(claim.nproc_per_node),
        # The script exports what the ranks get; the bridge's own environment (its
        # worker token) never reaches a job.
        "--export", "NONE",
        "--output", f"{to.output_dir.rstrip('/')}/%x-%j.out",
        "--no-requeue",  # a requeue is ddpq's to decide: its retry policy applies
    ]  # fmt: skip
    if claim.device == "cuda":
        argv += ["--gpus-per-node", str(claim.nproc_per_node)]
    if to.account:
        argv += ["--account", to.account]
    limit = time_limit(claim.spec.timeout_s)
    if limit:
        argv += ["--time", limit]
    return [*argv, *to.extra]


def plan(
    claim: ClaimedJob, program: list[str], env: Mapping[str, str], comment: str, launcher: str
) -> str:
    """What the batch script hands each node (worker.slurmnode), as JSON: the claim, the
    program, the ranks' environment (the job token with it), the comment a node's failure
    goes into, the launcher. Never the job's secrets, by value or in the environment:
    Slurm keeps the script (slurmctld's state until the job is purged; slurmdbd's for good
    with AccountingStoreFlags=job_script). Each node fetches them with the job token,
    which stops working when the attempt ends."""
    return json.dumps(
        {
            "claim": claim.model_dump(exclude={"token", "secrets"}),
            "program": program,
            "env": {k: v for k, v in env.items() if k not in claim.secrets},
            "comment": comment,
            "launcher": launcher,
        }
    )


def batch_script(python: str, cwd: str, plan: str) -> str:
    """The batch script: one ``worker.slurmnode`` per node (srun), which starts torchrun
    there with the ranks' environment the plan carries, and ships its output to the API.
    The script exports nothing else: what a node's login environment holds (sbatch
    --export=NONE loads it) stays with the launcher, never reaching a rank."""
    return "\n".join(
        [
            "#!/bin/sh",
            "# Written by the ddpq Slurm bridge: one attempt of a ddpq job.",
            f"export DDPQ_SLURM_PLAN={shlex.quote(plan)}",
            # sbatch --export=NONE makes srun default to NONE too, and a task started with
            # no environment at all finds no program: it takes this script's instead.
            "export SLURM_EXPORT_ENV=ALL",
            f"cd {shlex.quote(cwd)} || exit 1",
            f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 {shlex.quote(python)} "
            "-m worker.slurmnode",
            "",
        ]
    )


# What of Slurm's own variables on a node a rank gets besides the plan's environment
# (a program may want to know its allocation), and, on a GPU job, the GPUs Slurm gave.
SLURM_FOR_RANKS = (
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES",
    "SLURM_NODEID", "SLURM_JOB_PARTITION", "SLURM_CPUS_PER_TASK",
)  # fmt: skip


def ranks_environment(
    plan_env: Mapping[str, str], node_env: Mapping[str, str], device: str
) -> dict[str, str]:
    """A rank's environment on a node: the plan's (the bridge's allow-listed one, the
    spec's, ddpq's), with the allocation's Slurm variables, and Slurm's GPUs for a GPU job."""
    env = dict(plan_env)
    env.update({k: node_env[k] for k in SLURM_FOR_RANKS if k in node_env})
    if device == "cuda" and "CUDA_VISIBLE_DEVICES" in node_env:
        env["CUDA_VISIBLE_DEVICES"] = node_env["CUDA_VISIBLE_DEVICES"]
    return env


# ---- what Slurm says of a job ----------------------------------------------------------


@dataclass(frozen=True)
class SlurmJob:
    id: str
    name: str
    state: str
    reason: str
    exit_code: int | None
    signal: int | None
    comment: str


def parse_show_job(text: str) -> list[SlurmJob]:
    """``scontrol show job -o``: one job per line, ``Key=Value`` pairs (values with no
    spaces except the last keys')."""
    out = []
    for line in text.splitlines():
        fields: dict[str, str] = {}
        for key, value in _pairs(line):
            # The first: a Comment (a failure's text, written by the job) comes after
            # JobState and ExitCode and must not stand in for them.
            fields.setdefault(key, value)
        if "JobId" not in fields:
            continue
        code = sig = None
        m = re.fullmatch(r"(\d+):(\d+)", fields.get("ExitCode", ""))
        if m:
            code, sig = int(m.group(1)), int(m.group(2))
        out.append(
            SlurmJob(
                id=fields["JobId"],
                name=fields.get("JobName", ""),
                state=fields.get("JobState", "").split()[0] if fields.get("JobState") else "",
                reason=fields.get("Reason", "None"),
                exit_code=code,
                signal=sig,
                comment=fields.get("Comment", ""),
            )
        )
    return out


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def _pairs(line: str) -> list[tuple[str, str]]:
    """Key=Value pairs of one scontrol line; a value runs to the next `` Key=`` (a
    Comment or a Command may hold spaces)."""
    marks = list(_KEY.finditer(line))
    pairs = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        pairs.append((m.group(1), line[m.end() : end].strip()))
    return pairs


SQUEUE_FORMAT = "%i|%T|%r"  # id, state, reason
MAX_REASON = 300  # of Slurm's words; the API takes a pending reason of 500 characters


def parse_squeue(text: str) -> dict[str, tuple[str, str]]:
    """``squeue -h -o SQUEUE_FORMAT``: id -> (state, reason)."""
    out = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 3:
            out[fields[0]] = (fields[1], fields[2])
    return out


def pending_words(job_id: str, reason: str) -> str:
    """A job Slurm holds pending, as its ddpq reason says it (a reason may list every
    node it waits for: it is cut to what a heartbeat carries)."""
    reason = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."
    if reason in ("", "None", "(null)"):  # submitted; Slurm's scheduler has not looked yet
        return f"pending in Slurm (job {job_id}): not yet scheduled"
    words = REASON_WORDS.get(reason)
    said = f"{reason} ({words})" if words else reason
    return f"pending in Slurm (job {job_id}): {said}"


def ending(
    job: SlurmJob, stop_reason: str | None, timeout_s: Any, words: str | None = None
) -> Outcome:
    """How an attempt ended, from its Slurm job's final state and why the bridge
    stopped it, if it did (worker.starting.outcome.stopped, with its ``words``)."""
    if stop_reason is not None:
        return stopped(stop_reason, timeout_s, None, words)
    where = f"Slurm job {job.id}"
    state = job.state
    code = job.exit_code
    if job.signal:
        code = 128 + job.signal
    why = job.comment.split(": ", 1)[1] if ": " in job.comment else None
    if state == "COMPLETED":
        return Outcome(code or 0, "exited")
    if state == "FAILED":
        return Outcome(code if code else 1, "exited", why or f"{where} failed")
    if state == "OUT_OF_MEMORY":
        return Outcome(128 + 9, "exited", f"{where} ran out of memory")
    if state in ("TIMEOUT", "DEADLINE"):
        return Outcome(code, "timeout", f"{where} reached its Slurm time limit")
    if state == "CANCELLED":
        return Outcome(code, "lost", f"{where} was cancelled in Slurm, outside ddpq")
    if state == "NODE_FAIL":
        return Outcome(code, "lost", f"{where} lost a node (NODE_FAIL)")
    if state == "PREEMPTED":
        return Outcome(code, "lost", f"{where} was preempted")
    return Outcome(code, "lost", f"{where} ended {state}")
