"""An attempt's launch, prepared one way whatever runs it (a worker's runner, the Slurm
bridge): the job's directory of its code, the program, the checkpoint it resumes from,
the ranks' environment (worker.starting.torchrun decides each) and the interpreter with the
job's requirements (worker.starting.venvs), activated in that environment."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ddpq.errors import JobError
from ddpq.messages import ClaimedJob
from worker import entry
from worker.edges import procs
from worker.edges.api import WorkerAPI
from worker.files.code import Workdirs, describe
from worker.starting import torchrun, venvs
from worker.starting.venvs import Venvs, activate, python_for
from worker.walled.walls import JobUser


class Sources(Protocol):
    """Where a launch comes from: the same for every attempt of one worker."""

    api: WorkerAPI
    url: str  # the API as ranks reach it
    workspace: Path
    workdirs: Workdirs
    venvs: Venvs


@dataclass
class Launch:
    """What an attempt runs: in ``cwd``, ``program`` under ``python``, with ``env``."""

    cwd: Path
    program: list[str]
    env: dict[str, str]
    python: str


def environment(
    src: Sources,
    claim: ClaimedJob,
    launch_id: str,
    resume_from: str | None,
    scratch: Path | None = None,
    user: JobUser | None = None,
    cache_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ranks' environment (worker.starting.torchrun.environment) for this worker's attempt."""
    at = torchrun.Placement(
        api_url=src.url,
        checkpoint_dir=claim.checkpoint_dir,
        launch_var=procs.LAUNCH_ID_VAR,
        launch_id=launch_id,
        resume_from=resume_from,
        scratch=str(scratch) if scratch else None,
        user=user.name if user else None,
        cache_env=dict(cache_env or {}),
    )
    return torchrun.environment(os.environ, claim, at)


@contextlib.contextmanager
def prepared(
    src: Sources,
    claim: ClaimedJob,
    *,
    launch_id: str,
    say: Callable[[str], None],
    stop: threading.Event,
    where: str,
    scratch: Path | None = None,
    user: JobUser | None = None,
    own: Callable[[Path], Path] = lambda path: path,
    lend: venvs.Lend = venvs.unwalled,
    with_secrets: bool = True,
    cache_env: Mapping[str, str] | None = None,
) -> Iterator[Launch]:
    """The attempt's launch, held while the block runs (its environment is in use).
    ``say`` writes a line to the job's log; ``stop`` ends a wait for code or pip early
    (worker.starting.venvs.Stopped); ``where`` names the workspace a job without code runs
    in; walled, ``own`` gives the code directory to the attempt's ``user``, and ``lend`` a
    requirements build's directory while pip runs (worker.walled.walls' Held).
    ``with_secrets``: the job's secrets go into ``env`` (not for a Slurm attempt, whose
    nodes fetch them: worker.slurmnode). ``cache_env``: where the ranks' caches are
    (worker.files.caches). A job that cannot start raises JobError."""
    spec = claim.spec
    # A secret the API could not give (deleted since the submit): nothing is fetched or
    # run, and the job fails with words that name it.
    problem = torchrun.secrets_problem(claim)
    if problem:
        raise JobError(problem)
    if not with_secrets:
        claim = claim.model_copy(update={"secrets": {}})
    if spec.code:
        snapshot_id = spec.code
        workdir, written = src.workdirs.fetch(src.api, claim.job_id, snapshot_id, stop)
        say(describe(snapshot_id, workdir, written))
        cwd, where = own(workdir), "the job's code"
    else:
        cwd = src.workspace
    program = torchrun.program(spec, cwd, where)
    resume_from = torchrun.resume_path(claim)
    if claim.fork_from is not None and resume_from is None:
        # Never a silent start from scratch (a Slurm attempt: its bridge fetches none).
        raise JobError(
            f"job {claim.fork_from.job_id}'s checkpoint at step {claim.fork_from.step}, which "
            "it starts from, is not on this host (forks run on ddpq workers, not through "
            "the Slurm bridge)"
        )
    if resume_from:
        say(f"[ddpq] resuming from {resume_from}\n")
    env = environment(src, claim, launch_id, resume_from, scratch, user, cache_env)
    hidden = venvs.hidden_distributions(spec, cwd, src.venvs.policy)
    if hidden:
        env[entry.HIDE_VAR] = ",".join(hidden)
    with python_for(src.venvs, spec, cwd, env, say, stop, lend) as python:
        activate(env, python)
        yield Launch(cwd, program, env, python)
