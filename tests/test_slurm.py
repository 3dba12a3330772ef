"""The Slurm bridge against a real one-node Slurm (tests/slurmcluster.py): a real
`ddpq serve`, `ddpq worker --executor slurm`, sbatch, srun and torchrun (gloo, CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    Server,
    Worker,
    run_ddpq,
    start_server,
    stop_server,
    terminal,
    wait_for,
)
from tests.slurmcluster import Cluster

pytestmark = pytest.mark.slurm

# What these test is the bridge, Slurm and torchrun; what each needs of the database (a
# whole-job claim, the Slurm id and pending reason, re-adoption, a lost attempt's retry,
# node logs, the reasons) is tested on both databases in tests/test_bridge_protocol.py,
# so most run on SQLite only: the two that go through everything (a job that learns, a
# bridge killed and re-adopting) run on both.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

# Sleeps until a file appears (or its time is up), reporting a loss each second: a job
# that runs as long as the test needs it to, and that says which attempt it is.
WAITER = """
import os, sys, time
import torch.distributed as dist
import ddpq
dist.init_process_group("gloo")
attempt = int(os.environ["DDPQ_ATTEMPT"])
release = sys.argv[1] if len(sys.argv) > 1 else ""
for step in range(1, 600):
    ddpq.report(step=step, loss=1.0 / step)
    print(f"rank {dist.get_rank()} attempt {attempt} step {step}", flush=True)
    if release and os.path.exists(release) or attempt > 1 and step > 2:
        break
    time.sleep(0.5)
dist.barrier()
dist.destroy_process_group()
"""


def _bridge(start_worker: Any, server: Server, *args: str, name: str = "slurm") -> Worker:
    w: Worker = start_worker(
        server, "--executor", "slurm", "--partition", "debug", "--poll-s", "0.5", *args, name=name
    )
    (w.workspace / "waiter.py").write_text(WAITER)
    return w


def _job(c: httpx.Client, job_id: int) -> dict[str, Any]:
    job: dict[str, Any] = c.get(f"/jobs/{job_id}").json()
    return job


def _running_in_slurm(c: httpx.Client, job_id: int, timeout: float = 90) -> dict[str, Any]:
    """The job once its ranks run in Slurm (its first metric point is in)."""

    def running() -> dict[str, Any] | None:
        job = _job(c, job_id)
        assert job["status"] in ("queued", "running"), job
        return job if job["latest_metrics"] and job["external_id"] else None

    found: dict[str, Any] = wait_for(running, timeout, f"job {job_id} to run in Slurm")
    return found


def _processes_of(job_id: int) -> list[int]:
    """Processes whose environment names this ddpq job (its ranks, torchrun, the node)."""
    needle = f"DDPQ_JOB_ID={job_id}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_job_runs_on_slurm_learns_and_logs_each_rank(
    server: Server, start_worker: Any, slurm_clean: Cluster
) -> None:
    bridge = _bridge(start_worker, server)
    c = server.client()
    r = c.post(
        "/jobs",
        json={
            "recipe": "toy-regression",
            "world_size": 2,
            "args": ["--total-epochs", "3", "--log-every", "1"],
        },
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    final = terminal(c, job_id, timeout=180)
    logs = c.get(f"/jobs/{job_id}/logs").text
    assert final["status"] == "succeeded", (final, logs, bridge.log())
    assert final["worker"] == "slurm" and final["attempt"] == 1
    slurm_id = final["external_id"]
    assert slurm_id and slurm_id.isdigit()
    attempts = c.get(f"/jobs/{job_id}/attempts").json()["items"]
    assert [a["external_id"] for a in attempts] == [slurm_id]
    # The job ran under its ddpq name in Slurm, and Slurm says it completed.
    assert slurm_clean.state(slurm_id) == "COMPLETED"
    assert slurm_clean.ids_by_name(f"ddpq-job{job_id}-a1") in ([], [slurm_id])
    # It learned: rank 0 reported every step straight to the API.
    items = c.get(f"/jobs/{job_id}/metrics").json()["items"]
    assert len(items) == 96
    assert items[-1]["values"]["loss"] < items[0]["values"]["loss"]
    # Each rank's lines reached the job's log through the API, marked with the rank.
    assert f"in Slurm job {slurm_id}: node 0 of 1" in logs
    assert "[rank0]: epoch 0 | step 1 |" in logs
    # `ddpq ls` and `ddpq status` show the Slurm job id.
    env = {"DDPQ_URL": server.url, "DDPQ_API_TOKEN": server.api_token}
    listed = run_ddpq("ls", env=env)
    assert f"Slurm job {slurm_id}" in listed.stdout, listed
    shown = run_ddpq("status", str(job_id), env=env)
    assert f"slurm (Slurm job {slurm_id})" in shown.stdout, shown


@SQLITE_ONLY
def test_each_rank_is_logged_and_cancel_leaves_no_process(
    server: Server, start_worker: Any, slurm_clean: Cluster
) -> None:
    bridge = _bridge(start_worker, server)
    c = server.client()
    job_id = c.post("/jobs", json={"entrypoint": "waiter.py", "world_size": 2}).json()["id"]
    job = _running_in_slurm(c, job_id)
    slurm_id = job["external_id"]
    assert job["status"] == "running" and job["reason"] is None, job
    wait_for(lambda: "[rank1]: rank 1 attempt 1" in c.get(f"/jobs/{job_id}/logs").text, 30,
             "rank 1's lines in the job's log")  # fmt: skip
    ranks = _processes_of(job_id)
    assert ranks, "the ranks run, with the job's environment"
    # sbatch --export=NONE and the allow-list: the bridge's worker token reached no rank.
    for pid in ranks:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert server.worker_token.encode() not in f.read()
    # No file of the bridge holds the job's token: the batch script went to sbatch's stdin.
    with open(f"/proc/{ranks[0]}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    job_token = env[b"DDPQ_JOB_TOKEN"]
    for path in bridge.data_dir.rglob("*"):
        if path.is_file():
            assert job_token not in path.read_bytes(), path
    assert c.post(f"/jobs/{job_id}/cancel").status_code == 202
    final = terminal(c, job_id, timeout=60)
    assert final["status"] == "cancelled", (final, bridge.log())
    assert final["reason"] == "cancelled by admin"
    assert slurm_clean.state(slurm_id) == "CANCELLED"
    wait_for(lambda: not _processes_of(job_id), 30, "no process of the job left")


@SQLITE_ONLY
def test_an_outside_scancel_ends_the_attempt_with_the_reason_and_it_is_retried(
    server: Server, start_worker: Any, slurm_clean: Cluster
) -> None:
    bridge = _bridge(start_worker, server)
    c = server.client()
    spec = {"entrypoint": "waiter.py", "world_size": 2, "max_attempts": 2}
    job_id = c.post("/jobs", json=spec).json()["id"]
    first = _running_in_slurm(c, job_id)["external_id"]
    slurm_clean.scancel(first)
    final = terminal(c, job_id, timeout=120)
    assert final["status"] == "succeeded", (final, bridge.log())
    attempts = c.get(f"/jobs/{job_id}/attempts").json()["items"]
    assert [a["outcome"] for a in attempts] == ["lost", "succeeded"], attempts
    assert f"Slurm job {first} was cancelled in Slurm, outside ddpq" in attempts[0]["reason"]
    assert "requeued for attempt 2" in attempts[0]["reason"]
    assert attempts[1]["external_id"] not in (None, first)


@SQLITE_ONLY
def test_a_pending_reason_shows_and_the_bridge_keeps_its_cap(
    server: Server, start_worker: Any, slurm_clean: Cluster
) -> None:
    # Every CPU of the node taken by a job from outside ddpq: ddpq's job waits in Slurm.
    blocker = slurm_clean.sbatch_wrap("sleep 600", "-c", str(slurm_clean.cpus))
    slurm_clean.wait_state(blocker, {"RUNNING"}, 30)
    bridge = _bridge(start_worker, server, "--max-pending", "1")
    c = server.client()
    first = c.post("/jobs", json={"entrypoint": "waiter.py", "world_size": 2}).json()["id"]

    def pending() -> dict[str, Any] | None:
        job = _job(c, first)
        return job if (job["reason"] or "").endswith("(waiting for resources)") else None

    job = wait_for(pending, 60, "the pending reason")
    assert job["status"] == "running"
    assert job["reason"] == (
        f"pending in Slurm (job {job['external_id']}): Resources (waiting for resources)"
    )
    # The cap: a second job waits in ddpq's queue, not in Slurm, and says so.
    second = c.post("/jobs", json={"entrypoint": "waiter.py", "world_size": 2}).json()["id"]
    job2 = wait_for(lambda: _job(c, second)["reason"], 10, "the second job's reason")
    assert _job(c, second)["status"] == "queued"
    assert job2.startswith("waiting for the Slurm bridge slurm to hand it to Slurm"), job2
    slurm_clean.scancel(blocker)
    _running_in_slurm(c, first)
    assert _job(c, first)["reason"] is None
    for job_id in (first, second):
        c.post(f"/jobs/{job_id}/cancel")
        assert terminal(c, job_id, timeout=90)["status"] == "cancelled", bridge.log()


def test_a_bridge_killed_with_sigkill_readopts_its_jobs_without_submitting_twice(
    server: Server, start_worker: Any, slurm_clean: Cluster, tmp_path: Path
) -> None:
    bridge = _bridge(start_worker, server)
    c = server.client()
    release = tmp_path / "release"
    spec = {"entrypoint": "waiter.py", "world_size": 2, "args": [str(release)]}
    job_id = c.post("/jobs", json=spec).json()["id"]
    slurm_id = _running_in_slurm(c, job_id)["external_id"]
    bridge.proc.send_signal(signal.SIGKILL)
    bridge.proc.wait()
    # The job goes on in Slurm without its bridge; a new bridge process of that name
    # takes it back and reports its end.
    assert slurm_clean.state(slurm_id) == "RUNNING"
    again = _bridge(start_worker, server, name="slurm")
    release.write_text("done")
    final = terminal(c, job_id, timeout=90)
    assert final["status"] == "succeeded", (final, bridge.log(), again.log())
    assert final["attempt"] == 1 and final["external_id"] == slurm_id
    assert slurm_clean.ids_by_name(f"ddpq-job{job_id}-a1") in ([], [slurm_id])
    assert f"re-adopted Slurm job {slurm_id}" in again.log()
    assert _submitted_by(bridge) == [f"ddpq-job{job_id}-a1"], "submitted once"


def _submitted_by(bridge: Worker) -> list[str]:
    """The names of the jobs Slurm remembers that this test's bridge submitted (their
    output goes into its data dir)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o"], capture_output=True, text=True, check=False
    ).stdout
    mine = [line for line in out.splitlines() if f"StdOut={bridge.data_dir}/" in line]
    return [f.removeprefix("JobName=") for line in mine for f in line.split()
            if f.startswith("JobName=")]  # fmt: skip


@SQLITE_ONLY
def test_a_job_larger_than_the_partition_is_unschedulable_with_the_limit_named(
    server: Server, start_worker: Any, slurm_clean: Cluster
) -> None:
    _bridge(start_worker, server)
    c = server.client()
    wait_for(lambda: c.get("/workers").json()["items"], 30, "the bridge to register")
    [w] = c.get("/workers").json()["items"]
    assert w["cluster"]["partition"] == "debug" and w["cluster"]["nodes"] == 1
    env = {"DDPQ_URL": server.url, "DDPQ_API_TOKEN": server.api_token}
    listed = run_ddpq("workers", env=env)
    assert "slurm debug" in listed.stdout and "1 node(s) x" in listed.stdout, listed
    too_wide = c.post("/jobs", json={"entrypoint": "waiter.py", "world_size": 64}).json()
    too_many = c.post(
        "/jobs", json={"entrypoint": "waiter.py", "world_size": 2, "nnodes": 2}
    ).json()
    limits = (
        f"Slurm partition debug (bridge slurm) has 1 node of {slurm_clean.cpus} CPUs and 0 GPUs"
    )
    for job in (too_wide, too_many):
        reason = _job(c, job["id"])["reason"]
        assert reason.startswith("unschedulable: "), reason
        assert limits in reason, reason
    # `submit --wait` stops at once on it, with exit code 5.
    done = run_ddpq("submit", "--recipe", "toy-regression", "--world-size", "64", "--wait",
                    env=env)  # fmt: skip
    assert done.returncode == 5, done


@SQLITE_ONLY
def test_two_nodes_of_one_attempt_rendezvous_and_ship_their_own_logs(
    server: Server, slurm: Cluster, tmp_path: Path
) -> None:
    """Multi-node as far as one machine allows (one Slurm node cannot hold a 2-node
    allocation): the two node launchers srun would start, run by hand with the
    variables Slurm gives them, rendezvous as one world of 4 ranks and each ships
    its own output with the job token."""
    import json
    import sys

    from tests.test_bridge_protocol import _claim, _register_bridge

    _register_bridge(server, nodes=2, cpus_per_node=2)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "waiter.py").write_text(WAITER)
    release = tmp_path / "release"
    release.write_text("go")  # every rank reports once, then ends
    c = server.client()
    spec = {"entrypoint": "waiter.py", "world_size": 4, "nnodes": 2, "args": [str(release)]}
    job_id = c.post("/jobs", json=spec).json()["id"]
    claim = _claim(server)
    assert claim is not None and claim["nnodes"] == 2
    plan_env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "DDPQ_URL": server.url,
        "DDPQ_JOB_ID": str(job_id),
        "DDPQ_JOB_TOKEN": claim["token"],
        "DDPQ_ATTEMPT": "1",
        "DDPQ_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "DDPQ_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    plan = {
        "claim": {k: v for k, v in claim.items() if k != "token"},
        "program": [str(workspace / "waiter.py"), str(release)],
        "env": plan_env,
        "comment": "ddpq bridge bridge -",
    }
    # What srun gives each task: the script's plan, Slurm's variables, and here a secret
    # of the node's login environment, which must reach no rank.
    env = {
        **plan_env,
        "DDPQ_WORKER_TOKEN": server.worker_token,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": slurm.node,
        "DDPQ_SLURM_PLAN": json.dumps(plan),
    }
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "worker.slurmnode"],
            env={**env, "SLURM_NODEID": str(k)},
            cwd=workspace,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    logs = c.get(f"/jobs/{job_id}/logs").text
    for k in (0, 1):
        assert f"in Slurm job 4242: node {k} of 2" in logs, logs
    for rank in range(4):
        assert f"[rank{rank}]: rank {rank} attempt 1 step 1" in logs, logs
    assert _job(c, job_id)["latest_metrics"]["step"] == 1
    assert server.worker_token not in logs


@SQLITE_ONLY
def test_a_users_directory_with_requirements_runs_on_slurm_as_submitted(
    server: Server, start_worker: Any, slurm_clean: Cluster, tmp_path: Path
) -> None:
    """Users change nothing: `ddpq submit --wait` from their directory (code sent, a
    requirement built into an environment) runs on the cluster."""
    from tests.test_code import _cli, _job_id, _project

    _bridge(start_worker, server)
    proj = _project(tmp_path / "my-model")
    out, code = _cli(
        server, proj, "submit", "--entrypoint", "train.py", "--world-size", "2", "--wait"
    )
    assert code == 0, out
    job_id = _job_id(out)
    log = server.client().get(f"/jobs/{job_id}/logs").text
    assert "Successfully installed ddpqtestpkg" in log, log
    assert "handed to Slurm as job" in log and "by the bridge slurm" in log, log
    assert "[rank0]: state fresh magic 42 scale 1.0" in log, log


@SQLITE_ONLY
def test_a_failure_and_a_timeout_on_slurm_end_the_job_with_their_reasons(
    server: Server, start_worker: Any, slurm_clean: Cluster
) -> None:
    bridge = _bridge(start_worker, server)
    (bridge.workspace / "bad.py").write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('bad input on rank 1')\n"
        "dist.barrier()\n"
    )
    c = server.client()
    bad = c.post("/jobs", json={"entrypoint": "bad.py", "world_size": 2}).json()["id"]
    slow = c.post(
        "/jobs", json={"entrypoint": "waiter.py", "world_size": 2, "timeout_s": 4}
    ).json()["id"]
    failed = terminal(c, bad, timeout=120)
    assert failed["status"] == "failed" and failed["exit_code"] == 1, (failed, bridge.log())
    assert "ValueError: bad input on rank 1" in failed["reason"], failed
    timed_out = terminal(c, slow, timeout=120)
    assert timed_out["status"] == "failed", timed_out
    assert timed_out["reason"] == "timeout after 4 s", timed_out
    assert slurm_clean.state(timed_out["external_id"]) == "CANCELLED"
    wait_for(lambda: not _processes_of(slow), 30, "no process of the timed-out job left")


@SQLITE_ONLY
def test_a_bridge_back_after_its_lease_cancels_the_slurm_job_ddpq_moved_on_from(
    db_url: str, start_worker: Any, slurm_clean: Cluster, tmp_path: Path
) -> None:
    """Down longer than the lease, the bridge's attempt is lost and requeued while its
    Slurm job still runs; the bridge, back, cancels that job (nothing is left running
    that ddpq thinks ended) and runs the job's next attempt."""
    server = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="3")
    try:
        bridge = _bridge(start_worker, server)
        c = server.client()
        spec = {"entrypoint": "waiter.py", "world_size": 2, "max_attempts": 2}
        job_id = c.post("/jobs", json=spec).json()["id"]
        first = _running_in_slurm(c, job_id)["external_id"]
        bridge.proc.send_signal(signal.SIGKILL)
        bridge.proc.wait()
        wait_for(lambda: _job(c, job_id)["attempt"] == 1 and _job(c, job_id)["status"] == "queued",
                 30, "the lost attempt's job requeued")  # fmt: skip
        assert slurm_clean.state(first) == "RUNNING"
        again = _bridge(start_worker, server, name="slurm")
        slurm_clean.wait_state(first, {"CANCELLED"}, 30)
        final = terminal(c, job_id, timeout=120)
        assert final["status"] == "succeeded", (final, again.log())
        assert final["attempt"] == 2 and final["external_id"] not in (None, first)
        assert f"Slurm job {first} (ddpq-job{job_id}-a1) is no longer ddpq's" in again.log()
    finally:
        stop_server(server)
