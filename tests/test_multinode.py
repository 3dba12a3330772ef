"""Multi-node jobs (nnodes > 1) and several API processes on one Postgres.

The protocol cases drive the worker API by hand on both databases: the gang claim,
node slots holding their workers' slots, one finish for all nodes, a failed node
ending the attempt for all, the gang timeout. The process cases run real workers (each
with its own workspace, advertising 127.0.0.1) and real torchrun: a 2-node x 2-rank
gloo job through two `ddpq serve` processes, one of whose workers is killed mid-job.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import (
    REPO,
    Server,
    launcher_env,
    start_server,
    stop_server,
    terminal,
    wait_for,
)
from tests.helpers import records, register, send_log
from worker.edges.procs import find_by_launch_id

CPU_JOB = {"entrypoint": "train.py", "device": "cpu"}

# A heartbeat's reply that asks nothing of the worker.
NOTHING_ASKED = {
    "cancel": [], "abandon": [], "preempt": [], "ended": [], "prune": [], "drop": [], "send": [],
    "clear": [],
}  # fmt: skip
PACE = ("heartbeat_s", "lease_s", "claim_wait_s")  # the fleet's pace (service.pace)


def _submit(server: Server, **spec: Any) -> dict[str, Any]:
    r = server.client().post("/jobs", json={**CPU_JOB, **spec})
    assert r.status_code == 201, r.text
    job: dict[str, Any] = r.json()
    return job


def _job(server: Server, job_id: int) -> dict[str, Any]:
    job: dict[str, Any] = server.client().get(f"/jobs/{job_id}").json()
    return job


def _claim(
    server: Server,
    name: str,
    cpu: int = 8,
    port: int | None = 29400,
    gpus: list[int] | None = None,
) -> dict[str, Any] | None:
    body: dict[str, Any] = {
        "name": name,
        "free_cpu_slots": cpu,
        "free_gpus": gpus or [],
        "wait_s": 0,
    }
    if port is not None:
        body.update(advertise_addr=f"10.0.0.{len(name)}", rdzv_port=port)
    r = server.client("worker").post("/workers/claim", json=body)
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def _gang(server: Server, name: str, claim: dict[str, Any], **body: Any) -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/gang",
        json={"name": name, "job_id": claim["job_id"], "attempt": claim["attempt"], "wait_s": 0}
        | body,
    )
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def _finish(server: Server, name: str, claim: dict[str, Any], **body: Any) -> dict[str, Any]:
    r = server.client("worker").post(
        f"/workers/jobs/{claim['job_id']}/finish",
        json={"worker": name, "attempt": claim["attempt"], **body},
    )
    assert r.status_code == 200, r.text
    job: dict[str, Any] = r.json()
    return job


def _beat(server: Server, name: str, *claims: dict[str, Any]) -> dict[str, Any]:
    running = [{"job_id": c["job_id"], "attempt": c["attempt"]} for c in claims]
    r = server.client("worker").post("/workers/heartbeat", json={"name": name, "running": running})
    assert r.status_code == 200, r.text
    # What it asks of the worker, less the pace it sets (service.pace), which asks nothing.
    reply: dict[str, Any] = {k: v for k, v in r.json().items() if k not in PACE}
    return reply


def test_a_gang_forms_from_one_slot_per_worker_and_succeeds_when_every_node_does(
    server: Server,
) -> None:
    register(server, "w1", cpu_slots=2)
    register(server, "w2", cpu_slots=2)
    register(server, "w3", cpu_slots=2)
    job = _submit(server, world_size=4, nnodes=2)
    assert "waiting for 2 nodes: 0 of 2 held" in _job(server, job["id"])["reason"]
    # A worker that gives no address for a rendezvous is never offered a node slot.
    assert _claim(server, "w1", port=None) is None

    first = _claim(server, "w1")
    assert first and first["job_id"] == job["id"] and first["attempt"] == 1
    assert (first["nnodes"], first["node_rank"], first["nproc_per_node"]) == (2, 0, 2)
    forming = _gang(server, "w1", first)
    assert (forming["state"], forming["held"], forming["nnodes"]) == ("forming", 1, 2)
    queued = _job(server, job["id"])
    assert queued["status"] == "queued" and "1 of 2 held" in queued["reason"]
    # The slot holds w1's 2 CPU slots, and w1 cannot be two nodes of one attempt.
    assert _claim(server, "w1") is None
    single = _submit(server, world_size=2)
    assert _claim(server, "w1") is None
    workers = {w["name"]: w for w in server.client().get("/workers").json()["items"]}
    assert workers["w1"]["free_cpu_slots"] == 0
    assert [j["job_id"] for j in workers["w1"]["running"]] == [job["id"]]
    # Its heartbeat keeps the forming slot.
    assert _beat(server, "w1", first) == NOTHING_ASKED

    second = _claim(server, "w2")
    assert second and second["job_id"] == job["id"] and second["node_rank"] == 1
    running = _job(server, job["id"])
    assert running["status"] == "running" and running["attempt"] == 1
    assert running["worker"] == "w1"  # node 0's
    ready = [_gang(server, "w1", first), _gang(server, "w2", second)]
    for rank, reply in enumerate(ready):
        assert reply["state"] == "ready" and reply["node_rank"] == rank
        assert reply["rdzv_endpoint"] == "10.0.0.2:29400"  # node 0's worker's address
        assert reply["rdzv_id"] == f"ddpq-{job['id']}-1"
        assert reply["rdzv_host"] is (rank == 0)
        assert reply["workers"] == ["w1", "w2"]
        assert reply["checkpoint_dir"] == f"/ckpt/job-{job['id']}"
    # A leave that comes after the gang completed releases nothing: the answer is the
    # rendezvous, so the worker knows to hand the attempt back (see the next test).
    assert _gang(server, "w2", second, leave=True)["state"] == "ready"
    assert _job(server, job["id"])["status"] == "running"
    # The single-node job behind it runs on the third worker.
    third = _claim(server, "w3")
    assert third and third["job_id"] == single["id"] and third["nnodes"] == 1

    # Every node's token reports for the one attempt; logs of both nodes go to one log.
    points = {"items": [{"step": 1, "values": {"loss": 0.5}}]}
    for c in (first, second):
        assert (
            server.client(c["token"]).post(f"/jobs/{job['id']}/metrics", json=points).status_code
            == 202
        )
    for name, c in (("w1", first), ("w2", second)):
        send_log(server, c, 0, f"[rank0]: from {name}\n".encode(), worker=name)
    log = server.client().get(f"/jobs/{job['id']}/logs").text
    assert "from w1" in log and "from w2" in log

    # Node 0 done: the attempt goes on until node 1 is done too.
    assert _finish(server, "w1", first, exit_code=0)["status"] == "running"
    assert _finish(server, "w1", first, exit_code=0)["status"] == "running"  # repeated
    assert _beat(server, "w2", second) == NOTHING_ASKED
    done = _finish(server, "w2", second, exit_code=0)
    assert done["status"] == "succeeded" and done["finished_at"]


def test_a_node_handed_back_before_it_started_requeues_the_attempt_on_every_node(
    server: Server,
) -> None:
    """A worker that shuts down just as its gang completes (its leave answered ready)
    hands the attempt back: the job waits again, not counted as a failure, and the other
    node is told to stop at its next heartbeat instead of waiting out a lease."""
    register(server, "w1")
    register(server, "w2")
    job = _submit(server, world_size=2, nnodes=2)
    a, b = _claim(server, "w1"), _claim(server, "w2")
    assert a and b and _job(server, job["id"])["status"] == "running"
    assert _gang(server, "w2", b, leave=True)["state"] == "ready"
    done = _finish(server, "w2", b, exit_code=None, outcome="requeue", reason="worker shut down")
    assert done["status"] == "queued", done
    assert "worker w2 shut down; requeued" in done["reason"]
    assert _beat(server, "w1", a)["abandon"] == [{"job_id": job["id"], "attempt": 1}]
    again = wait_for(lambda: _claim(server, "w1"), 30, "the job to be claimable again")
    assert again["job_id"] == job["id"] and again["attempt"] == 2


def test_node_slots_hold_gpus_on_each_worker(server: Server) -> None:
    register(server, "g1", cpu_slots=8, gpus=[0, 1, 2, 3])
    register(server, "g2", cpu_slots=8, gpus=[0, 1])
    job = _submit(server, entrypoint="probe.py", device="cuda", world_size=4, nnodes=2)

    a = _claim(server, "g1", gpus=[0, 1, 2, 3])
    assert a and a["device"] == "cuda" and a["gpus"] == [0, 1]
    other = _submit(server, entrypoint="probe.py", device="cuda", world_size=4)
    # g1's two GPUs of the node slot are held: a 4-GPU job cannot start there.
    assert _claim(server, "g1", gpus=[0, 1, 2, 3]) is None
    assert "the most free on one worker is 2" in _job(server, other["id"])["reason"]
    b = _claim(server, "g2", gpus=[0, 1])
    assert b and b["gpus"] == [0, 1] and b["node_rank"] == 1
    running = _job(server, job["id"])
    assert running["status"] == "running" and running["gpus"] == [0, 1]
    free = {x["name"]: x["free_gpus"] for x in server.client().get("/workers").json()["items"]}
    assert free == {"g1": [2, 3], "g2": []}
    # Node 1 ended: its GPUs are free again while node 0 still runs.
    _finish(server, "g2", b, exit_code=0)
    free = {x["name"]: x["free_gpus"] for x in server.client().get("/workers").json()["items"]}
    assert free == {"g1": [2, 3], "g2": [0, 1]}


def test_an_auto_gang_keeps_one_device_on_every_node(server: Server) -> None:
    """One process group has one backend: a `device: auto` gang whose node 0 went to a
    GPU worker (nccl) takes no node on a CPU-only worker (gloo)."""
    register(server, "g1", cpu_slots=8, gpus=[0, 1])
    register(server, "c1", cpu_slots=8, gpus=[])
    register(server, "g2", cpu_slots=8, gpus=[0, 1])
    job = _submit(server, entrypoint="probe.py", device="auto", world_size=2, nnodes=2)

    a = _claim(server, "g1", gpus=[0, 1])
    assert a and a["device"] == "cuda"
    assert _claim(server, "c1", gpus=[]) is None
    b = _claim(server, "g2", gpus=[0, 1])
    assert b and b["device"] == "cuda" and b["node_rank"] == 1
    assert _job(server, job["id"])["status"] == "running"


def test_a_cancel_reaches_every_node_and_ends_once_all_have_stopped(server: Server) -> None:
    register(server, "w1")
    register(server, "w2")
    job = _submit(server, world_size=2, nnodes=2)
    a, b = _claim(server, "w1"), _claim(server, "w2")
    assert a and b
    r = server.client().post(f"/jobs/{job['id']}/cancel")
    assert r.json()["status"] == "cancelling"
    for name, c in (("w1", a), ("w2", b)):
        assert _beat(server, name, c)["cancel"] == [{"job_id": job["id"], "attempt": 1}]
    assert _finish(server, "w2", b, outcome="cancelled", exit_code=143)["status"] == "cancelling"
    done = _finish(server, "w1", a, outcome="cancelled", exit_code=143)
    assert done["status"] == "cancelled" and done["reason"] == "cancelled by admin"


def test_a_failed_node_ends_the_attempt_on_every_node_and_the_job_retries_as_one(
    db_url: str, tmp_path: Path
) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_RETRY_BACKOFF_S="0")
    try:
        register(server, "w1")
        register(server, "w2")
        job = _submit(server, world_size=2, nnodes=2, max_attempts=2)
        a1, b1 = _claim(server, "w1"), _claim(server, "w2")
        assert a1 and b1 and _job(server, job["id"])["status"] == "running"
        failed = _finish(
            server, "w2", b1, exit_code=1, reason="RuntimeError: Connection closed by peer"
        )
        # A program's exit code, yet retried: a lost peer makes the others fail too.
        assert failed["status"] == "queued", failed
        assert "on node 1 (worker w2)" in failed["reason"]
        assert "retrying as attempt 2" in failed["reason"]
        # The other node is told to stop; it reports nothing, and its token is fenced off
        # once the next attempt exists.
        assert _beat(server, "w1", a1)["abandon"] == [{"job_id": job["id"], "attempt": 1}]
        assert _gang(server, "w1", a1)["state"] == "released"
        # The whole job is claimed again as one: attempt 2, two fresh slots.
        b2, a2 = _claim(server, "w2"), _claim(server, "w1")
        assert a2 and b2 and a2["attempt"] == b2["attempt"] == 2
        assert b2["node_rank"] == 0 and a2["node_rank"] == 1
        assert _gang(server, "w1", a2)["rdzv_id"] == f"ddpq-{job['id']}-2"
        r = server.client(a1["token"]).post(
            f"/jobs/{job['id']}/metrics", json={"items": [{"step": 1, "values": {"loss": 1}}]}
        )
        assert r.status_code == 403 and "superseded" in r.text  # the old node's token ended
        # A node of a multi-node job that is lost (a worker restarting without it) ends it.
        r = server.client("worker").post(
            "/workers/register",
            json={
                "name": "w1",
                "hostname": "h",
                "cpu_slots": 8,
                "gpus": [],
                "checkpoint_root": "/c",
            },
        )
        assert r.status_code == 200
        lost = _job(server, job["id"])
        assert lost["status"] == "failed", lost
        assert "worker w1 restarted without it" in lost["reason"]
        assert _beat(server, "w2", b2)["abandon"] == [{"job_id": job["id"], "attempt": 2}]
    finally:
        stop_server(server)


def test_a_gang_not_complete_in_time_releases_its_slots_and_says_why(
    db_url: str, tmp_path: Path
) -> None:
    server = start_server(
        db_url, tmp_path / "api", DDPQ_GANG_TIMEOUT_S="1", DDPQ_RETRY_BACKOFF_S="1"
    )
    try:
        register(server, "w1", cpu_slots=2)
        job = _submit(server, world_size=4, nnodes=2)
        # Alone, a worker holds no slot of a 2-node job: it would only sit idle.
        assert _claim(server, "w1") is None
        assert "1 live worker(s) can run a node" in _job(server, job["id"])["reason"]
        register(server, "w2", cpu_slots=2)  # alive, but it never claims
        held = _claim(server, "w1")
        assert held and held["node_rank"] == 0

        def released() -> bool:
            return _gang(server, "w1", held)["state"] == "released"

        wait_for(released, 30, "the gang timeout to release the slot")
        reason = _job(server, job["id"])["reason"]
        assert "waiting for 2 nodes: 1 of 2 held, gang timed out after 1 s; retrying" in reason
        assert _beat(server, "w1", held)["abandon"] == [{"job_id": job["id"], "attempt": 1}]
        # The slot holds nothing now: a single-node job can use the worker.
        workers = {x["name"]: x for x in server.client().get("/workers").json()["items"]}
        assert workers["w1"]["free_cpu_slots"] == 2 and workers["w1"]["running"] == []
        # After its backoff it gathers again (attempt 1 still: none has started).
        again = wait_for(lambda: _claim(server, "w1"), 30, "the job to be claimable again")
        assert again["job_id"] == job["id"] and again["attempt"] == 1
        # A worker that shuts down while the gang forms gives its slot back.
        assert _gang(server, "w1", again, leave=True)["state"] == "released"
        workers = {x["name"]: x for x in server.client().get("/workers").json()["items"]}
        assert workers["w1"]["free_cpu_slots"] == 2
        # Cancelling a forming job releases its slots at once.
        held = wait_for(lambda: _claim(server, "w1"), 30, "the job to be claimable again")
        assert server.client().post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        assert _gang(server, "w1", held)["state"] == "released"
    finally:
        stop_server(server)


def test_a_worker_holding_a_node_slot_goes_on_claiming_and_stands_down_on_timeout(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    server = start_server(
        db_url, tmp_path / "api", DDPQ_GANG_TIMEOUT_S="3", DDPQ_RETRY_BACKOFF_S="60"
    )
    try:
        register(server, "busy")  # a second live worker, which never claims
        w = start_worker(server, "--advertise-addr", "127.0.0.1", name="only", cpu_slots=4)
        gang = _submit(server, world_size=4, nnodes=2)
        wait_for(
            lambda: "1 of 2 held" in (_job(server, gang["id"])["reason"] or ""),
            30,
            "the worker to hold a node slot",
        )
        # Its two other CPU slots still take jobs while the gang waits for a second worker
        # (this one fails before torchrun: its entrypoint is missing).
        single = _submit(server, entrypoint="missing.py", world_size=2)
        failed = terminal(server.client(), single["id"], timeout=60)
        assert "is not a file in the worker's workspace" in failed["reason"], failed
        # Alone, the gang times out: the slot is released, the worker stands down, and the
        # job waits with the reason.
        reason = wait_for(
            lambda: (r := _job(server, gang["id"])["reason"]) and "gang timed out" in r and r,
            30,
            "the gang timeout",
        )
        assert "waiting for 2 nodes: 1 of 2 held, gang timed out after 3 s; retrying" in reason
        # (Told by its gang long-poll, or by its heartbeat, whichever answers first.)
        wait_for(
            lambda: "node slot released" in w.log() or "is no longer ours" in w.log(),
            30,
            "the worker to stand down",
        )
        me = next(x for x in server.client().get("/workers").json()["items"] if x["name"] == "only")
        assert me["free_cpu_slots"] == 4 and me["running"] == []
        assert _job(server, gang["id"])["status"] == "queued"
    finally:
        stop_server(server)


@pytest.mark.postgres
def test_two_api_processes_claim_each_job_exactly_once(pg_url: str, tmp_path: Path) -> None:
    api1 = start_server(pg_url, tmp_path / "api1")
    api2 = start_server(pg_url, tmp_path / "api2", tokens=(api1.api_token, api1.worker_token))
    try:
        names = [f"c{i}" for i in range(4)]
        for name in names:
            register(api1, name, cpu_slots=1000)
        ids = [_submit(api2 if i % 2 else api1, world_size=1)["id"] for i in range(40)]
        gang = _submit(api1, world_size=2, nnodes=2)
        claimed: list[tuple[str, int, int]] = []

        def claimer(name: str, api: Server) -> None:
            body = {
                "name": name,
                "free_cpu_slots": 1000,
                "free_gpus": [],
                # A long-poll, as workers do: a claimer that skipped a row another
                # held locked is woken when that claim commits.
                "wait_s": 1,
                "advertise_addr": "127.0.0.1",
                "rdzv_port": 29400,
            }
            with httpx.Client(
                base_url=api.url, headers={"Authorization": f"Bearer {api.worker_token}"}
            ) as c:
                while True:
                    r = c.post("/workers/claim", json=body)
                    assert r.status_code in (200, 204), r.text
                    if r.status_code == 204:
                        return
                    claimed.append((name, r.json()["job_id"], r.json()["node_rank"]))

        threads = [
            threading.Thread(target=claimer, args=(n, api1 if i % 2 else api2))
            for i, n in enumerate(names)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a claimer hung"
        singles = sorted(j for _, j, _ in claimed if j != gang["id"])
        assert singles == ids, "every job claimed exactly once"
        nodes = [(w, rank) for w, j, rank in claimed if j == gang["id"]]
        assert sorted(rank for _, rank in nodes) == [0, 1]
        assert len({w for w, _ in nodes}) == 2, "two workers, one node slot each"
        assert _job(api2, gang["id"])["status"] == "running"
    finally:
        stop_server(api1)
        stop_server(api2)


def test_deploy_files_for_an_added_host_and_slurm() -> None:
    compose = yaml.safe_load((REPO / "deploy" / "worker-host.compose.yml").read_text())
    assert set(compose["services"]) == {"worker"}, "an added host runs only a worker"
    worker = compose["services"]["worker"]
    command = [str(part) for part in worker["command"]]
    assert command[:2] == ["ddpq", "worker"]
    for flag in ("--url", "--advertise-addr", "--rdzv-ports", "--checkpoint-dir"):
        assert flag in command
    assert worker["network_mode"] == "host"  # the rendezvous ports reachable as the host's
    assert worker["env_file"] == "worker.env" and "ports" not in worker
    assert "environment" not in worker, "the token comes from the env file only"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    example = (REPO / "deploy" / "worker.env.example").read_text()
    assert "DDPQ_WORKER_TOKEN=\n" in example

    sbatch = REPO / "deploy" / "slurm-worker.sbatch"
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    text = sbatch.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --signal=TERM@" in text
    assert "srun " in text and "exec ddpq worker" in text
    assert '--gpus "${CUDA_VISIBLE_DEVICES:-none}"' in text and "--advertise-addr" in text


# ---- real workers, real torchrun, two API processes -------------------------------------

# Each rank records its start (attempt, RANK, WORLD_SIZE, the node's group rank, pid);
# rank 0 reports the loss of every step.
PROGRAM = r"""
import argparse, json, os, time
import torch
import torch.distributed as dist
from ddpq import train

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--pace", type=float, default=0.0)
ap.add_argument("--record", required=True)
args = ap.parse_args()
dist.init_process_group("gloo")
with open(args.record, "a") as f:
    f.write(json.dumps({
        "attempt": int(os.environ["DDPQ_ATTEMPT"]), "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]), "node": int(os.environ["GROUP_RANK"]),
        "pid": os.getpid(),
    }) + "\n")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(32, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
y = x.sum(dim=1, keepdim=True)
for step in range(1, args.steps + 1):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    train.report(step, loss=loss.detach())
    time.sleep(args.pace)
dist.barrier()
train.flush()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.torchrun
@pytest.mark.postgres
@pytest.mark.long  # about 35 s: `make test-long` runs it (CI does too)
def test_two_workers_on_two_api_processes_run_a_2x2_job_and_retry_it_as_one(
    pg_url: str, tmp_path: Path, start_worker: Any, launcher: str
) -> None:
    # A lease long enough that a loaded machine's slow heartbeat never loses a node; the
    # teardown does not wait for it when the survivor's ranks fail on the lost peer.
    env = {"DDPQ_LEASE_S": "15", "DDPQ_RETRY_BACKOFF_S": "0"}
    api1 = start_server(pg_url, tmp_path / "api1", **env)
    api2 = start_server(
        pg_url, tmp_path / "api2", tokens=(api1.api_token, api1.worker_token), **env
    )
    try:
        local = ("--advertise-addr", "127.0.0.1", "--rdzv-ports", "29400-29999")
        workers = {
            "a": start_worker(api1, *local, name="a", cpu_slots=2, env=launcher_env(launcher)),
            "b": start_worker(api2, *local, name="b", cpu_slots=2, env=launcher_env(launcher)),
        }
        for w in workers.values():
            (w.workspace / "train.py").write_text(PROGRAM)
        record = tmp_path / "ranks.jsonl"
        steps = 40
        # Submitted through one API process; the gang forms across both.
        job = _submit(
            api1,
            entrypoint="train.py",
            world_size=4,
            nnodes=2,
            args=["--steps", str(steps), "--pace", "0.25", "--record", str(record)],
        )
        jid = job["id"]

        def first_attempt_started() -> bool:
            return len({r["rank"] for r in records(record) if r["attempt"] == 1}) == 4

        wait_for(first_attempt_started, 120, "the 4 ranks of attempt 1 to start")
        first = [r for r in records(record) if r["attempt"] == 1]
        assert sorted(r["rank"] for r in first) == [0, 1, 2, 3]
        assert {r["world"] for r in first} == {4} and sorted(r["node"] for r in first) == [
            0,
            0,
            1,
            1,
        ]
        running = _job(api2, jid)  # read through the other API process
        assert running["status"] == "running" and running["attempt"] == 1
        wait_for(lambda: (_job(api1, jid)["latest_metrics"] or {}).get("step", 0) >= 3, 60, "loss")

        # kill -9 the worker of node 0, whose torchrun hosts the rendezvous store.
        victim = workers[running["worker"]]
        survivor = workers["b" if victim.name == "a" else "a"]
        victim.proc.kill()
        victim.proc.wait()
        # Both nodes' processes of attempt 1 go: the victim's by its parent-death signal,
        # the survivor's when the service tells its worker the attempt is over.
        for w in (victim, survivor):
            wait_for(
                lambda w=w: not find_by_launch_id(w.launch_id(jid, 1)),
                60,
                f"{w.name}'s ranks to go",
            )
        for r in first:
            assert not os.path.exists(f"/proc/{r['pid']}"), r
        # Requeued as one job (whichever came first: the survivor's ranks failing on
        # the lost peer, or the victim's lease), waiting for a second worker.
        requeued = wait_for(
            lambda: (j := _job(api1, jid))["status"] == "queued" and j, 60, "the requeue"
        )
        assert requeued["attempt"] == 1, requeued
        assert "attempt 2" in requeued["reason"], requeued["reason"]
        print("requeued:", requeued["reason"])

        # The killed worker comes back; the job is claimed again as one, as attempt 2.
        back = start_worker(
            api1 if victim.name == "a" else api2,
            *local,
            name=victim.name,
            cpu_slots=2,
            env=launcher_env(launcher),
        )
        assert back.workspace == victim.workspace
        final = terminal(api1.client(), jid, timeout=150)
        log = api2.client().get(f"/jobs/{jid}/logs").text  # logs through either process
        assert final["status"] == "succeeded", (final, log)
        assert final["attempt"] == 2, log
        second = [r for r in records(record) if r["attempt"] == 2]
        assert sorted(r["rank"] for r in second) == [0, 1, 2, 3]
        for rank in range(4):
            assert f"[rank{rank}]: rank {rank} of 4 done" in log
        assert "node 0 of 2" in log and "node 1 of 2" in log
        items = api1.client().get(f"/jobs/{jid}/metrics").json()["items"]
        assert [i["step"] for i in items] == list(range(1, steps + 1)), "one loss series"
        assert {i["attempt"] for i in items} == {2}  # attempt 2 reported every step again
    finally:
        stop_server(api1)
        stop_server(api2)
