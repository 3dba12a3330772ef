"""One node of a Slurm attempt: ``python -m worker.slurmnode`` (or ``ddpq slurm-node``),
which the bridge's batch script starts once per node with srun.

It starts torchrun on this node (through worker.tee, as a worker does) with the
rendezvous on the allocation's first node, and ships this node's output to the API
itself, with the attempt's job token (``POST /jobs/{id}/logs?node=K``): no shared
filesystem carries the log, and the node never holds the worker token. It exits with
torchrun's exit code, which Slurm reports to the bridge; a failure's root-cause line
goes into the Slurm job's comment, where the bridge reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ddpq.errors import ApiUnavailable
from ddpq.messages import ClaimedJob, GangReply
from ddpq.wire import Backoff
from worker.edges import procs
from worker.edges.api import WorkerAPI
from worker.executors import slurm
from worker.starting import launcher, torchrun, warm
from worker.starting.logship import LogShipper, Tailed

KILL_GRACE_S = 10.0
SECRETS_WAIT_S = 120.0  # the API away at a node's start: how long it asks for the secrets
# c10d's store port on the first node: the same on every node without a word between
# them, from the Slurm job id, in a range of 20000 ports above 20000.
RDZV_PORT_BASE = 20000


class NodeAPI(WorkerAPI):
    """The API as one node of an attempt reaches it: with the attempt's job token."""

    def __init__(self, url: str, token: str, node: int) -> None:
        super().__init__(url, token, f"node{node}")
        self.node = node

    def append_log(self, job_id: int, attempt: int, offset: int, data: bytes) -> int:
        r = self._request(
            "POST",
            f"/jobs/{job_id}/logs",
            params={"node": self.node, "offset": offset},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(r.json()["next_offset"])

    def secrets(self, job_id: int) -> dict[str, str]:
        """The values of the secrets the job's spec names (GET /jobs/{id}/secrets): the
        batch script carries none (worker.executors.bridge). Retried while the API is away, for at
        most SECRETS_WAIT_S."""
        backoff, deadline = Backoff(), time.monotonic() + SECRETS_WAIT_S
        while True:
            try:
                r = self._request("GET", f"/jobs/{job_id}/secrets")
                return {str(k): str(v) for k, v in r.json()["values"].items()}
            except ApiUnavailable:
                if time.monotonic() + backoff.delay > deadline:
                    raise
                backoff.wait()


def first_host(nodelist: str) -> str:
    """The allocation's first node, as ``scontrol show hostnames`` expands the list."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] if out else socket.gethostname()


def rendezvous(claim: ClaimedJob, node: int, slurm_job: str, nodelist: str) -> GangReply | None:
    """torchrun's rendezvous on this allocation (None: one node, a store of its own)."""
    if claim.nnodes == 1:
        return None
    port = RDZV_PORT_BASE + int(re.sub(r"\D", "", slurm_job) or 0) % 20000
    return GangReply(
        state="ready",
        nnodes=claim.nnodes,
        node_rank=node,
        rdzv_endpoint=f"{first_host(nodelist)}:{port}",
        rdzv_id=f"ddpq-{claim.job_id}-{claim.attempt}",
        rdzv_host=node == 0,
        join_timeout_s=300,
    )


def main() -> int:
    plan: dict[str, Any] = json.loads(os.environ.pop("DDPQ_SLURM_PLAN"))
    claim = ClaimedJob.model_validate({**plan["claim"], "token": plan["env"]["DDPQ_JOB_TOKEN"]})
    env = slurm.ranks_environment(plan["env"], os.environ, claim.device)
    node = int(os.environ.get("SLURM_NODEID", "0"))
    slurm_job = os.environ.get("SLURM_JOB_ID", "")
    api = NodeAPI(env["DDPQ_URL"], claim.token, node)
    shipper = LogShipper(api, claim.job_id, claim.attempt)
    shipper.start()
    host = socket.gethostname()
    shipper.write(
        f"[ddpq] attempt {claim.attempt} in Slurm job {slurm_job}: node {node} of "
        f"{claim.nnodes} on {host}, {claim.nproc_per_node} rank(s)\n".encode()
    )
    code = 1
    try:
        if torchrun.secret_names(claim.spec):  # in this process's memory only, then the ranks'
            torchrun.add_secrets(env, api.secrets(claim.job_id))
        code = _run(claim, plan, env, node, slurm_job, shipper)
    except Exception as exc:  # a launch that cannot start says why in the job's log
        shipper.write(f"[ddpq] node {node}: {exc}\n".encode())
        _say_why(slurm_job, plan["comment"], str(exc))
    finally:
        shipper.close(timeout_s=60.0)
        api.close()
    return code


def _run(
    claim: ClaimedJob,
    plan: dict[str, Any],
    env: dict[str, str],
    node: int,
    slurm_job: str,
    shipper: LogShipper,
) -> int:
    pool = None
    if plan.get("launcher") == "warm":  # its import overlaps the rendezvous's set-up
        pool = warm.WarmPool(keep=1)  # a node runs one attempt: one warm process
        zygote_env = warm.zygote_env(env, claim.spec, claim.nproc_per_node)
        pool.prestart(sys.executable, zygote_env)
    gang = rendezvous(claim, node, slurm_job, os.environ.get("SLURM_JOB_NODELIST", ""))
    rdzv = torchrun.rendezvous(gang, socket.gethostname())
    Path(claim.checkpoint_dir).mkdir(parents=True, exist_ok=True)

    def write(line: bytes) -> None:
        shipper.write(line)
        sys.stdout.buffer.write(line)  # Slurm's own output file keeps a copy

    with tempfile.TemporaryDirectory(prefix="ddpq-node-") as tmp:
        argv = torchrun.argv(sys.executable, claim, rdzv, plan["program"], Path(tmp))
        if pool is not None:  # forked by the warm process, under worker.launch's care
            try:
                sock = pool.socket_for(sys.executable, zygote_env)
            except OSError as exc:
                write(f"[ddpq] launcher: torchrun, not warm: {exc}\n".encode())
            else:
                argv = launcher.launcher_argv(argv, KILL_GRACE_S, warm=sock)
        run = Tailed(argv, Path(tmp) / "output.log", write, env=env, name=f"out-node{node}")
        stopping = threading.Event()
        _forward_stop(run.proc, stopping)
        code = run.exit_code()
        tail = run.drain()
    if code != 0 and not stopping.is_set():
        result = torchrun.outcome(code, tail, None, None)
        if result.reason:
            shipper.write(f"[ddpq] node {node}: {result.reason}\n".encode())
            _say_why(slurm_job, plan["comment"], result.reason)
        return result.exit_code if result.exit_code is not None else code
    return code


def _forward_stop(proc: subprocess.Popen[bytes], stopping: threading.Event) -> None:
    """scancel (or the time limit) sends SIGTERM: pass it to torchrun, which stops its
    ranks, and SIGKILL its process group after the grace period."""

    def stop(signum: int, _frame: Any) -> None:
        stopping.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

        def kill_later() -> None:
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                procs.signal_group(proc.pid, signal.SIGKILL)

        threading.Thread(target=kill_later, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _say_why(slurm_job: str, comment: str, reason: str) -> None:
    """Put why this attempt failed into its Slurm job's comment, where the bridge reads
    it when the job ends (the bridge sees Slurm, not the log)."""
    if not slurm_job:
        return
    # One line; no "=": scontrol's output is Key=Value pairs.
    text = f"{comment}: {reason}"[:250].replace("\n", " ").replace("=", ":")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            ["scontrol", "update", f"JobId={slurm_job}", f"Comment={text}"],
            capture_output=True,
            timeout=30,
        )


if __name__ == "__main__":
    sys.exit(main())
