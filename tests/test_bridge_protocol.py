"""The API side of a Slurm bridge, driven by hand (no Slurm): whole-job claims, the Slurm
job id and pending reason on heartbeats, re-adoption, node logs with the job token,
and what worker/executors/slurm.py decides (pure).

A test that looks at its own jobs and its own bridge (a name of its own) runs on the
module's server of its database (``api``: every job a test leaves active is ended after
it, helpers.its_turn); one that looks at every worker, or at what every registered
bridge could run (the reasons, the claims), has a server of its own (``server``)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

from ddpq.cli.base import EXIT_USAGE, exit_code
from ddpq.errors import SlurmError
from ddpq.messages import ClaimedJob
from tests.conftest import Server
from tests.helpers import register
from worker.executors import slurm

SHAPE = {"partition": "gpu", "nodes": 4, "cpus_per_node": 16, "gpus_per_node": 0}


def _register_bridge(server: Server, name: str = "bridge", **shape: Any) -> dict[str, Any]:
    r = server.client("worker").post(
        "/workers/register",
        json={
            "name": name,
            "hostname": "login1",
            "cpu_slots": 0,
            "gpus": [],
            "checkpoint_root": "/shared/ckpt",
            "cluster": {**SHAPE, **shape},
        },
    )
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def _claim(server: Server, name: str = "bridge") -> dict[str, Any] | None:
    r = server.client("worker").post(
        "/workers/claim", json={"name": name, "free_cpu_slots": 0, "free_gpus": [], "wait_s": 0}
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def _beat(server: Server, running: list[dict[str, Any]], name: str = "bridge") -> dict[str, Any]:
    r = server.client("worker").post("/workers/heartbeat", json={"name": name, "running": running})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def test_a_bridge_claims_a_multi_node_job_whole_and_reports_its_slurm_id(server: Server) -> None:
    _register_bridge(server)
    c = server.client()
    job = c.post("/jobs", json={"entrypoint": "t.py", "world_size": 8, "nnodes": 2}).json()
    claim = _claim(server)
    assert claim is not None
    assert (claim["job_id"], claim["nnodes"], claim["node_rank"]) == (job["id"], 2, 0)
    assert claim["checkpoint_dir"] == f"/shared/ckpt/job-{job['id']}"
    ref = {"job_id": job["id"], "attempt": 1}
    pending = "pending in Slurm (job 81234): Resources (waiting for resources)"
    assert _beat(server, [{**ref, "external_id": "81234", "pending": pending}])["abandon"] == []
    shown = c.get(f"/jobs/{job['id']}").json()
    assert shown["status"] == "running" and shown["reason"] == pending
    assert shown["external_id"] == "81234" and shown["worker"] == "bridge"
    listed = c.get("/jobs").json()["items"]
    assert listed[0]["external_id"] == "81234"
    # Slurm starts it: the reason goes; the attempt keeps its Slurm id.
    _beat(server, [{**ref, "external_id": "81234", "pending": None}])
    assert c.get(f"/jobs/{job['id']}").json()["reason"] is None
    [attempt] = c.get(f"/jobs/{job['id']}/attempts").json()["items"]
    assert attempt["external_id"] == "81234"
    # The bridge's registration shows its partition.
    [w] = c.get("/workers").json()["items"]
    assert w["cluster"]["partition"] == "gpu" and w["cluster"]["nodes"] == 4


def test_a_restarted_bridge_is_handed_its_attempts_to_readopt(api: Server) -> None:
    server, name = api, "bridge-readopt"
    _register_bridge(server, name)
    c = server.client()
    ids = [c.post("/jobs", json={"entrypoint": "t.py", "world_size": 2}).json()["id"] for _ in "ab"]
    for _ in ids:
        assert _claim(server, name) is not None
    _beat(server, [{"job_id": ids[0], "attempt": 1, "external_id": "7"}], name)
    reply = _register_bridge(server, name)  # the bridge again, after a kill -9
    assert reply["held"] == [
        {"job_id": ids[0], "attempt": 1, "external_id": "7", "timeout_s": None},
        {"job_id": ids[1], "attempt": 1, "external_id": None, "timeout_s": None},
    ]
    # Nothing was released: both still run on the bridge's books.
    assert [c.get(f"/jobs/{i}").json()["status"] for i in ids] == ["running", "running"]


def test_an_attempt_slurm_ended_is_lost_and_retried_at_once(api: Server) -> None:
    server, name = api, "bridge-lost"
    _register_bridge(server, name)
    c = server.client()
    spec = {"entrypoint": "t.py", "world_size": 2, "max_attempts": 2}
    job_id = c.post("/jobs", json=spec).json()["id"]
    assert _claim(server, name) is not None
    why = "Slurm job 9 was cancelled in Slurm, outside ddpq"
    r = server.client("worker").post(
        f"/workers/jobs/{job_id}/finish",
        json={"worker": name, "attempt": 1, "outcome": "lost", "exit_code": 143, "reason": why},
    )
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "queued" and f"({why}; requeued" in job["reason"]
    assert "requeued for attempt 2 (1 of 2 attempts used)" in job["reason"]
    assert _claim(server, name) is not None  # no backoff: the program did not fail


def test_unschedulable_names_the_partition_and_fitting_jobs_wait_for_the_bridge(
    server: Server,
) -> None:
    _register_bridge(server, nodes=2, cpus_per_node=4, max_pending=3)
    c = server.client()
    wide = c.post("/jobs", json={"entrypoint": "t.py", "world_size": 8}).json()
    many = c.post("/jobs", json={"entrypoint": "t.py", "world_size": 3, "nnodes": 3}).json()
    fits = c.post("/jobs", json={"entrypoint": "t.py", "world_size": 8, "nnodes": 2}).json()
    limits = "Slurm partition gpu (bridge bridge) has 2 nodes of 4 CPUs and 0 GPUs"
    for job in (wide, many):
        assert job["reason"].startswith("unschedulable: "), job
        assert limits in job["reason"]
    assert fits["reason"] == (
        "waiting for the Slurm bridge bridge to hand it to Slurm (it lets at most 3 of its "
        "jobs wait in Slurm)"
    )
    # The claim agrees: the job that fits is the one handed out, the others stay.
    claim = _claim(server)
    assert claim is not None and claim["job_id"] == fits["id"]
    assert _claim(server) is None


def test_each_node_ships_its_own_stream_with_the_job_token(api: Server) -> None:
    server, name = api, "bridge-logs"
    _register_bridge(server, name)
    c = server.client()
    job_id = c.post("/jobs", json={"entrypoint": "t.py", "world_size": 4, "nnodes": 2}).json()["id"]
    claim = _claim(server, name)
    assert claim is not None
    ranks = server.client(claim["token"])

    def send(node: int, offset: int, data: bytes) -> Any:
        return ranks.post(
            f"/jobs/{job_id}/logs",
            params={"node": node, "offset": offset},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    assert send(0, 0, b"[rank0]: a\n").json() == {"next_offset": 11}
    assert send(1, 0, b"[rank2]: b\n").json() == {"next_offset": 11}
    assert send(0, 0, b"[rank0]: a\n").json() == {"next_offset": 11}  # a resend: stored once
    assert send(0, 11, b"[rank1]: c\n").json() == {"next_offset": 22}
    gap = send(1, 50, b"x\n")
    assert gap.status_code == 409 and "log gap" in gap.json()["detail"]
    beyond = send(2, 0, b"x\n")
    assert beyond.status_code == 422 and "node" in beyond.text and "2 node(s)" in beyond.text
    assert c.get(f"/jobs/{job_id}/logs").text == "[rank0]: a\n[rank2]: b\n[rank1]: c\n"
    # The user's token cannot write a log; a worker token cannot use this route either.
    assert c.post(f"/jobs/{job_id}/logs", params={"node": 0, "offset": 0}).status_code == 403
    # Once the attempt ended its token writes nothing more.
    server.client("worker").post(
        f"/workers/jobs/{job_id}/finish",
        json={"worker": name, "attempt": 1, "exit_code": 0},
    )
    assert send(0, 22, b"[rank0]: late\n").status_code == 403
    assert c.get(f"/jobs/{job_id}/logs").text.endswith("[rank1]: c\n")


def test_a_workers_job_token_cannot_ship_a_node_log(api: Server) -> None:
    """A worker ships its attempts' output itself: its ranks' token writes no log."""
    from tests.helpers import submit_and_claim

    server = api
    claim = submit_and_claim(server)
    r = server.client(claim["token"]).post(
        f"/jobs/{claim['job_id']}/logs",
        params={"node": 0, "offset": 0},
        content=b"[ddpq] forged\n",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 409 and "ships its log" in r.json()["detail"], r.text
    assert server.client().get(f"/jobs/{claim['job_id']}/logs").text == ""


@pytest.mark.parametrize("rounds", [20])
def test_a_gang_forming_on_workers_and_a_bridge_never_both_take_a_job(
    server: Server, rounds: int
) -> None:
    """Race, many rounds: two workers gather a 2-node job's slots while a bridge claims
    whole jobs. Each job is run either by the bridge (one attempt, no node slots) or by
    the workers' gang, never by both."""
    _register_bridge(server, nodes=2, cpus_per_node=8)
    for name in ("w0", "w1"):
        register(server, name)
    c = server.client()
    wc = server.client("worker")

    def worker_claim(name: str) -> dict[str, Any] | None:
        r = wc.post(
            "/workers/claim",
            json={"name": name, "free_cpu_slots": 8, "free_gpus": [], "wait_s": 0,
                  "advertise_addr": "127.0.0.1", "rdzv_port": 29400},
        )  # fmt: skip
        return r.json() if r.status_code == 200 else None

    for _ in range(rounds):
        job_id = c.post("/jobs", json={"entrypoint": "t.py", "world_size": 2, "nnodes": 2}).json()[
            "id"
        ]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda f: f(), [
                lambda: worker_claim("w0"), lambda: worker_claim("w1"), lambda: _claim(server),
            ]))  # fmt: skip
        by_bridge = got[2] is not None and got[2]["job_id"] == job_id
        slots = [g for g in got[:2] if g is not None and g["job_id"] == job_id]
        assert not (by_bridge and slots), got
        job = c.get(f"/jobs/{job_id}").json()
        if by_bridge:
            assert job["status"] == "running" and job["worker"] == "bridge"
        # End the round: cancel whatever holds it, so the next job is the only one.
        c.post(f"/jobs/{job_id}/cancel")
        if job["status"] == "running":
            who = "bridge" if by_bridge else job["worker"]
            for name in {who, *(g and "w0" for g in got[:1]), *(g and "w1" for g in got[1:2])}:
                if name:
                    wc.post(
                        f"/workers/jobs/{job_id}/finish",
                        json={"worker": name, "attempt": job["attempt"], "outcome": "cancelled"},
                    )


# ---- worker/executors/slurm.py: pure decisions --------------------------------------------------


def _claim_of(**over: Any) -> ClaimedJob:
    base: dict[str, Any] = {
        "job_id": 12,
        "attempt": 3,
        "token": "secret-job-token",
        "spec": {"timeout_s": 3600},
        "device": "cuda",
        "nproc_per_node": 8,
        "gpus": [],
        "checkpoint_dir": "/shared/ckpt/job-12",
        "resume_from": [],
        "nnodes": 4,
    }
    return ClaimedJob(**{**base, **over})


def test_sbatch_asks_one_task_per_node_with_its_gpus_and_a_time_bound() -> None:
    to = slurm.Submission("gpu", "proj", ("--qos=high",), "b1", "f" * 32, "/shared/out")
    argv = slurm.sbatch_argv(_claim_of(), to)
    joined = " ".join(argv)
    for part in (
        "--job-name ddpq-job12-a3", "--partition gpu", "--nodes 4", "--ntasks-per-node 1",
        "--cpus-per-task 8", "--gpus-per-node 8", "--account proj", "--time 61",
        "--export NONE", "--no-requeue", f"--comment ddpq bridge b1 {'f' * 32}",
    ):  # fmt: skip
        assert part in joined, part
    assert argv[-1] == "--qos=high"  # the script goes on standard input
    cpu = slurm.sbatch_argv(_claim_of(device="cpu", spec={}), to)
    assert "--gpus-per-node" not in cpu and "--time" not in cpu


def test_the_batch_script_exports_only_its_plan_and_ranks_get_only_the_plans_environment() -> None:
    script = slurm.batch_script("/venv/bin/python", "/w d", '{"env": {}}')
    assert "export DDPQ_SLURM_PLAN='{\"env\": {}}'" in script
    assert "export SLURM_EXPORT_ENV=ALL" in script  # srun passes the script's environment on
    assert "cd '/w d' || exit 1" in script
    assert script.rstrip().endswith("/venv/bin/python -m worker.slurmnode")
    assert [line for line in script.splitlines() if line.startswith("export ")] == [
        line for line in script.splitlines() if "DDPQ_SLURM_PLAN" in line or "SLURM_EXPORT" in line
    ]
    # A node's login environment (sbatch --export=NONE loads it) reaches no rank: only
    # the plan's, the allocation's Slurm variables, and on a GPU job Slurm's GPUs.
    node = {
        "DDPQ_WORKER_TOKEN": "from-a-profile", "AWS_SECRET_ACCESS_KEY": "k", "PATH": "/login",
        "SLURM_JOB_ID": "81234", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }  # fmt: skip
    plan = {"PATH": "/usr/bin", "DDPQ_JOB_TOKEN": "t"}
    assert slurm.ranks_environment(plan, node, "cpu") == {
        "PATH": "/usr/bin", "DDPQ_JOB_TOKEN": "t", "SLURM_JOB_ID": "81234", "SLURM_NODEID": "1",
    }  # fmt: skip
    assert slurm.ranks_environment(plan, node, "cuda")["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_sbatch_refusals_fail_the_job_and_an_unreachable_slurm_does_not() -> None:
    assert slurm.refused(
        "sbatch: Batch job submission failed: Invalid account or account/partition "
        "combination specified"
    )
    assert not slurm.refused(
        "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"
    )
    assert not slurm.refused(
        "sbatch: error: Batch job submission failed: Unable to contact slurm controller "
        "(connect failure)"
    )
    assert not slurm.refused("sbatch: timed out after 60 s")


def test_scontrol_lines_and_what_each_ending_means() -> None:
    line = (
        "JobId=40 JobName=ddpq-job1-a2 UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
        "ExitCode=3:0 Comment=ddpq bridge b x: ValueError: bad input Partition=debug"
    )
    [job] = slurm.parse_show_job(line)
    assert (job.id, job.name, job.state, job.exit_code, job.signal) == (
        "40", "ddpq-job1-a2", "FAILED", 3, 0,
    )  # fmt: skip
    assert job.comment == "ddpq bridge b x: ValueError: bad input"
    assert slurm.ending(job, None, None).reason == "ValueError: bad input"
    assert slurm.ending(job, None, None).exit_code == 3
    # What a job writes into its comment cannot stand in for Slurm's own fields.
    forged = (
        "JobId=41 JobName=x JobState=FAILED ExitCode=1:0 Comment=c: JobState=COMPLETED ExitCode=0:0"
    )
    [job] = slurm.parse_show_job(forged)
    assert (job.state, job.exit_code) == ("FAILED", 1)

    def end(state: str, code: str = "0:0", stop: str | None = None) -> tuple[Any, ...]:
        [j] = slurm.parse_show_job(f"JobId=5 JobName=x JobState={state} ExitCode={code}")
        o = slurm.ending(j, stop, 60)
        return (o.outcome, o.exit_code)

    assert end("COMPLETED") == ("exited", 0)
    assert end("CANCELLED", "0:15") == ("lost", 143)
    assert end("CANCELLED", "0:15", stop="cancelled") == ("cancelled", None)
    assert end("TIMEOUT", "0:15") == ("timeout", 143)
    assert end("NODE_FAIL") == ("lost", 0)
    assert end("PREEMPTED") == ("lost", 0)
    assert end("OUT_OF_MEMORY") == ("exited", 137)
    assert slurm.pending_words("5", "Priority") == (
        "pending in Slurm (job 5): Priority (other jobs have priority)"
    )


def test_the_partition_shape_from_sinfo() -> None:
    sinfo = "n1|64|gpu:a100:8(S:0-1)\nn2|32|gpu:4\nn2|32|gpu:4\nn3|16|(null)\n"
    shape = slurm.partition_shape("gpu", sinfo, 2)
    assert shape == {
        "kind": "slurm", "partition": "gpu", "nodes": 3, "cpus_per_node": 64,
        "gpus_per_node": 8, "max_pending": 2,
    }  # fmt: skip
    # A typed error of ddpq.errors' tree: `ddpq worker --executor slurm` exits 2 on it
    # through the CLI's one map (cli.base.EXIT_FOR_ERROR), with no mapping of its own.
    with pytest.raises(SlurmError, match="no nodes") as e:
        slurm.partition_shape("none", "", 2)
    assert exit_code(e.value) == EXIT_USAGE
