"""What the worker decides about a torchrun launch, as pure functions of the claim.

The program to run, torchrun's command line and rendezvous flags, the ranks'
environment, and what an exit means: no process is started here, so each is
decided (and tested) without running anything. worker.executors.runner supervises the launch;
why the worker stopped one, whatever ran it, is worker.starting.outcome's.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpq.catalog import catalog
from ddpq.errors import JobError
from ddpq.jobspec import ClaimedSpec
from ddpq.messages import ClaimedJob, GangReply
from ddpq.rules import (
    ARRAY_VAR,
    PARAMS_VAR,
    RUNGS_VAR,
    entrypoint_problem,
    env_problem,
    params_problem,
    rungs_problem,
)
from worker import tee
from worker.starting.outcome import Outcome, stopped

# How a rank starts: the program through worker.entry, which ends the process once the
# program has finished, before torch can abort in the interpreter's teardown
# (tests/test_entry_rounds.py).
RANK_ENTRY = ("-u", "-P", "-m", "worker.entry")
MONITOR_INTERVAL_S = 0.1  # torchrun's check of its ranks; the default 5 s delays every exit

# What a job inherits from the worker's environment: what programs, Python, CUDA, NCCL
# and the usual libraries read, and nothing else. An allow-list, not a deny-list: the
# worker's environment may hold anything its operator put there (a database password
# from an env file, cloud credentials), and job code is not trusted with any of it.
# A job sets anything else it needs in its spec's `env`.
INHERITED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
        "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "PYTHONPATH", "SSL_CERT_FILE",
        "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY",
        "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    }
)  # fmt: skip
# Not XDG_*: those name the worker user's own directories (XDG_CONFIG_HOME holds its
# ddpq login, XDG_RUNTIME_DIR its session), never a job's: a job's HOME is its scratch.
INHERITED_PREFIXES = (
    "LC_", "CUDA_", "NCCL_", "NVIDIA_", "OMP_", "MKL_", "OPENBLAS_", "GLOO_", "TORCH_",
    "PYTORCH_", "HF_", "TRANSFORMERS_",
)  # fmt: skip
# A name that says it holds a credential is never inherited, whatever its prefix: the
# operator's HF_TOKEN (their hub login) is theirs, not every job's. A job that needs one
# is given its owner's (`ddpq secrets set HF_TOKEN`, then `--secret HF_TOKEN`).
_CREDENTIAL = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|(?:^|_)KEY(?:$|_)")


def inherited(name: str) -> bool:
    """Whether the ranks get the worker's variable ``name`` (the one rule: the ranks'
    environment, a warm process's, pip's)."""
    if name in INHERITED_ENV:
        return True
    return name.startswith(INHERITED_PREFIXES) and _CREDENTIAL.search(name) is None


TORCHRUN_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
# The rank that failed first: worker.tee's line for it (tee.failure_line), else the root
# cause in the table of torchrun's own ChildFailedError (a launch without worker.tee).
FAILURE_LINE = re.compile(
    "^" + re.escape(tee.FIRST) + r"rank (?P<rank>\d+) \(local rank (?P<local>\d+)\) "
    r"(?:exited with code (?P<code>-?\d+)|killed by (?:SIG\w+|signal (?P<signum>\d+))"
    r"(?: \(pid (?P<pid>\d+)\))?)"
    r"(?:: (?P<said>.*))?$"
)
FINISHED_LINE = re.compile(
    r"^\[ddpq\] (rank \d+ \(local rank \d+\): " + re.escape(tee.AFTER_FINISH) + r".*)$"
)
TABLE_ROOT = "Root Cause (first observed failure):"
TABLE_RANK = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: (\d+)\)")
TABLE_EXITCODE = re.compile(r"^\s*exitcode\s*: (-?\d+)")


# ---- what runs -------------------------------------------------------------------------


def program(spec: ClaimedSpec, workspace: Path, where: str = "the worker's workspace") -> list[str]:
    """The program and its arguments as torchrun takes them: ``-m module`` for a recipe,
    else the entrypoint's path inside ``workspace`` (the worker's, or the job's own
    directory of its code: ``where`` says which), checked again since the worker runs it."""
    if spec.recipe:
        entry = catalog().get(spec.recipe)
        if entry is None:
            raise JobError(f"this worker has no recipe {spec.recipe!r}")
        return ["-m", str(entry["module"]), *spec.args]
    if spec.entrypoint is None:  # the API refuses such a spec; never trust the wire
        raise JobError("the spec names neither a recipe nor an entrypoint")
    entrypoint = spec.entrypoint
    problem = entrypoint_problem(entrypoint)
    if problem:
        raise JobError(f"entrypoint {entrypoint[:200]!r} {problem}")
    path = (workspace / entrypoint).resolve()
    # resolve() follows symlinks, so a link pointing out of the workspace is caught here.
    if not path.is_relative_to(workspace) or path == workspace:
        raise JobError(f"entrypoint {entrypoint!r} resolves outside {where}")
    if not path.is_file():
        raise JobError(f"entrypoint {entrypoint!r} is not a file in {where}")
    return [str(path), *spec.args]


def rendezvous(gang: GangReply | None, local_addr: str) -> list[str]:
    """torchrun's rendezvous flags: a store of its own on one node, else c10d on node 0's
    worker, which hosts the store (said outright rather than guessed from host names:
    on one machine every node's address is its own). --local-addr makes the address
    the ranks' process group uses (MASTER_ADDR) one the other hosts reach."""
    if gang is None:
        return ["--standalone", "--nnodes", "1"]
    conf = f"is_host={1 if gang.rdzv_host else 0},join_timeout={int(gang.join_timeout_s or 0)}"
    return [
        "--nnodes", str(gang.nnodes),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", str(gang.rdzv_endpoint),
        "--rdzv-id", str(gang.rdzv_id),
        "--rdzv-conf", conf,
        "--local-addr", local_addr,
    ]  # fmt: skip


def argv(
    python: str, claim: ClaimedJob, rdzv: list[str], program: list[str], log_dir: Path
) -> list[str]:
    """torchrun's command line. Its ranks' output goes to a file with a [rankN] prefix
    on every line (--tee 3), which the runner ships as the job's log; worker.tee runs
    torchrun so that those lines arrive whole. -P: torchrun starts in the job's
    directory, whose own modules (a package named worker, say) must not stand in for
    ddpq's. Each rank runs the program through worker.entry (RANK_ENTRY, which finds
    the program's modules beside it, as ``python -u PROGRAM`` does) under the same
    ``python``: --no-python, since torchrun's own ``-m`` cannot pass -P."""
    return [
        python, "-P", "-m", "worker.tee",
        *rdzv,
        "--nproc-per-node", str(claim.nproc_per_node),
        "--max-restarts", str(claim.spec.max_restarts),
        "--monitor-interval", str(MONITOR_INTERVAL_S),
        "--log-dir", str(log_dir),
        "--tee", "3",
        "--log-line-prefix-template", tee.PREFIX_TEMPLATE,
        "--no-python", python, *RANK_ENTRY,
        *program,
    ]  # fmt: skip


@dataclass
class Placement:
    """Where the ranks of an attempt report and write, besides the claim itself."""

    api_url: str
    checkpoint_dir: str
    launch_var: str
    launch_id: str
    resume_from: str | None = None
    # The attempt's own scratch directory (its TMPDIR), and when it runs walled the name
    # of its uid (worker.walled.walls): then the scratch is its HOME too, the worker's being
    # closed to it.
    scratch: str | None = None
    user: str | None = None
    # Where its owner's caches are (worker.files.caches: TORCHINDUCTOR_CACHE_DIR, HF_HOME, ...):
    # over the worker's own settings of them, under the spec's.
    cache_env: dict[str, str] = field(default_factory=dict)


def environment(environ: Mapping[str, str], claim: ClaimedJob, at: Placement) -> dict[str, str]:
    """The ranks' environment: the allow-listed part of the worker's, the spec's own
    (checked again), its owner's secrets the claim carries, and ddpq's, last: no variable
    of the spec or of a secret stands in for one of ddpq's."""
    env = {k: v for k, v in environ.items() if inherited(k)}
    if claim.device == "cpu":
        # accelerate on a CPU host runs each rank alone (DistributedType.NO, one process)
        # unless told: every rank trained apart, silently. The spec's env may say "0".
        env["ACCELERATE_USE_CPU"] = "1"
    if at.scratch:  # the spec's own env may still name others
        env["TMPDIR"] = at.scratch
        if at.user:
            env.update(HOME=at.scratch, USER=at.user, LOGNAME=at.user)
    env.update(at.cache_env)
    for name, value in claim.spec.env.items():
        problem = env_problem(str(name), str(value))
        if problem:  # the API refuses these at submission; never trust the wire
            raise JobError(f"env: {problem}")
        env[name] = value
    add_secrets(env, claim.secrets)
    env.update(
        {
            "DDPQ_URL": at.api_url,
            "DDPQ_JOB_ID": str(claim.job_id),
            "DDPQ_JOB_TOKEN": claim.token,
            "DDPQ_ATTEMPT": str(claim.attempt),
            "DDPQ_CHECKPOINT_DIR": at.checkpoint_dir,
            "DDPQ_DEVICE": claim.device,
            at.launch_var: at.launch_id,
            "PYTHONUNBUFFERED": "1",
            # torchrun 2.14 shares its rendezvous store with the ranks' process group
            # by default; after a restart (max_restarts) the new ranks then read the
            # dead ranks' addresses and init_process_group fails (pytorch#135712).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            # The ranks see only the GPUs the job holds, as cuda:0..n-1; none on a CPU job.
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, claim.gpus)),
            # ...numbered as the worker numbers them (NVML, nvidia-smi: PCI bus order),
            # not CUDA's default fastest-first, which may name other GPUs by the same index.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    )
    if at.resume_from:
        env["DDPQ_RESUME_FROM"] = at.resume_from
    params = claim.spec.params
    if params:  # a sweep's trial's: ddpq.train.params() reads them (checked again here)
        problem = params_problem(params)
        if problem:
            raise JobError(f"params: {problem}")
        env[PARAMS_VAR] = json.dumps(params)
    index = claim.spec.array_index
    if index is not None:  # an array's task's (Slurm's SLURM_ARRAY_TASK_ID)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise JobError(f"array_index: {index!r} is not an index")
        env[ARRAY_VAR] = str(index)
    rungs = claim.spec.rungs
    if rungs:  # a trial's, whose sweep stops early: its reporter asks at each
        problem = rungs_problem(rungs)
        if problem:
            raise JobError(problem)
        env[RUNGS_VAR] = ",".join(map(str, rungs))
    # The one DDPQ_* setting of the worker's own that ranks get (others stay private):
    # where ddpq.train writes TensorBoard runs. Absolute, since ranks run in the
    # workspace, not in the worker's directory.
    tensorboard_dir = environ.get("DDPQ_TENSORBOARD_DIR")
    if tensorboard_dir:
        env["DDPQ_TENSORBOARD_DIR"] = str(Path(tensorboard_dir).resolve())
    return env


def secrets_problem(claim: ClaimedJob) -> str | None:
    """Why an attempt cannot start for want of its secrets (the API said so at the claim,
    or sent no value for a name the spec gives), or None. Never quotes a value."""
    if claim.secrets_problem:
        return claim.secrets_problem
    missing = [n for n in secret_names(claim.spec) if n not in claim.secrets]
    if missing:
        return f"the API sent no value for secret {', '.join(missing)[:200]}"
    return None


def secret_names(spec: ClaimedSpec) -> list[str]:
    return list(spec.secrets)


def add_secrets(env: dict[str, str], secrets: Mapping[str, str]) -> None:
    """Put a job's secrets into its ranks' environment ``env``, each checked again as a
    spec's env is (a name ddpq, torchrun or CUDA sets is refused: never one of DDPQ_*).
    An error names the secret, never its value."""
    for name, value in secrets.items():
        problem = env_problem(str(name), "")
        if problem:
            raise JobError(f"secrets: {problem}")
        if "\x00" in value:
            raise JobError(f"secrets: the value of {name} contains a NUL character")
        env[name] = value


def resume_path(claim: ClaimedJob) -> str | None:
    """The checkpoint an attempt resumes from: the newest offered that is a file or a
    directory (a framework's) inside the job's directory here, else, for a fork, the
    checkpoint it starts from (worker.files.sending.write_fork wrote it there)."""
    offered = list(claim.resume_from)
    if claim.fork_from is not None:
        src = claim.fork_from
        offered.append(os.path.join(claim.checkpoint_dir, src.dirname, src.name))
    return next((p for p in offered if inside_job_dir(p, claim.job_id)), None)


def inside_job_dir(path: str, job_id: int) -> bool:
    """A registered checkpoint is a regular file or a directory that stays, symlinks
    resolved, inside the ``job-<id>`` directory its path names (the API checked the path's
    text when it was registered; only the host that holds it can check its links)."""
    parts = os.path.normpath(path).split(os.sep)
    name = f"job-{job_id}"
    if not os.path.isabs(path) or name not in parts[:-1]:
        return False
    job_dir = os.sep.join(parts[: len(parts) - parts[::-1].index(name)])
    real_dir = os.path.realpath(job_dir)
    real = os.path.realpath(path)
    return real.startswith(real_dir + os.sep) and (os.path.isfile(real) or os.path.isdir(real))


# ---- what an exit means ----------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    """The rank that failed first, as torchrun saw it; ``exitcode`` is torch's
    (negative: killed by that signal)."""

    rank: int
    local_rank: int
    exitcode: int
    said: str | None = None  # what its error file said, when it left one
    others: bool = False  # other ranks failed after it
    pid: int | None = None  # a rank killed by a signal: its pid (worker.edges.oom looks it up)

    @property
    def exit_status(self) -> int:
        return self.exitcode if self.exitcode >= 0 else 128 - self.exitcode


def first_failure(tail: list[str]) -> Failed | None:
    """The first rank to fail, from worker.tee's line, else torchrun's own table."""
    others = any(line.startswith(tee.ALSO) for line in tail)
    for line in tail:
        m = FAILURE_LINE.match(line)
        if m:
            code = int(m["code"]) if m["code"] else -_signum(line, m["signum"])
            pid = int(m["pid"]) if m["pid"] else None
            return Failed(int(m["rank"]), int(m["local"]), code, m["said"] or None, others, pid)
    if TABLE_ROOT not in tail:
        return None
    if "Failures:" in tail:  # the others, or "<NO_OTHER_FAILURES>"
        after = tail[tail.index("Failures:") + 1 :]
        others = bool(after) and "<NO_OTHER_FAILURES>" not in after[0]
    ranks: re.Match[str] | None = None
    exitcode: re.Match[str] | None = None
    for line in tail[tail.index(TABLE_ROOT) + 1 :]:
        ranks = ranks or TABLE_RANK.match(line)
        exitcode = exitcode or TABLE_EXITCODE.match(line)
    if ranks is None or exitcode is None:
        return None
    return Failed(int(ranks[1]), int(ranks[2]), int(exitcode[1]), None, others)


def _signum(line: str, number: str | None) -> int:
    if number:
        return int(number)
    name = re.search(r"killed by (SIG\w+)", line)
    try:
        return int(signal.Signals[name[1]]) if name else 0
    except KeyError:
        return 0


def root_cause(tail: list[str]) -> str | None:
    """Why an attempt failed: which rank failed first, with that rank's own error line
    (``rank 1 (local rank 1) failed first: ValueError: bad input``; ``rank 0 (local
    rank 0) failed first`` for one killed without a word); without a failed rank
    (torchrun itself failed), the error line of the whole output. How it ended is not
    repeated: the outcome's exit code is that rank's, and the service words it
    ("exited with code 1: rank 1 ...", "killed by SIGKILL ..., exit code 137: rank 0 ...")."""
    failed = first_failure(tail)
    if failed is None:
        found = tee.error_line(tail)
        return found[:500] if found else None
    first = " first" if failed.others else ""
    words = f"rank {failed.rank} (local rank {failed.local_rank}) failed{first}"
    prefix = f"[rank{failed.rank}]:"
    said = failed.said or tee.error_line(line for line in tail if line.startswith(prefix))
    return f"{words}: {said}"[:500] if said else words


def outcome(
    code: int,
    tail: list[str],
    stop_reason: str | None,
    timeout_s: Any,
    words: str | None = None,
) -> Outcome:
    """What torchrun's exit ``code`` (128 + N when killed by signal N) means, given why
    the worker stopped it, if it did (worker.starting.outcome.stopped, with its ``words``), and
    the last lines of its output."""
    if stop_reason is not None:
        return stopped(stop_reason, timeout_s, code, words)
    if code == 0:  # worker.tee's words when a rank died after its program finished
        said = next((m[1] for line in tail for m in [FINISHED_LINE.match(line)] if m), None)
        return Outcome(0, "exited", said)
    # torchrun exits 1 whenever a rank fails; the rank's own code is in its summary.
    rank_codes = [int(m.group(1)) for line in tail for m in [TORCHRUN_EXITCODE.search(line)] if m]
    exit_code = code if code >= 0 else 128 - code
    failed = first_failure(tail)
    if failed is not None:
        exit_code = failed.exit_status
    elif rank_codes:
        rc = rank_codes[0]
        exit_code = rc if rc >= 0 else 128 - rc
    # The service puts the exit status into words; it gets the program's error.
    return Outcome(exit_code, "exited", root_cause(tail))
