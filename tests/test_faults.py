"""Failures: leases, fencing, the retry policy, resuming, and outages of the API and Postgres.

The protocol-level cases drive the worker API by hand; the rest run real workers,
real torchrun (gloo, 2 ranks) and a program that checkpoints every epoch.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    NO_JOBS,
    Server,
    _child_env,
    free_port,
    launcher_env,
    module_server,
    start_server,
    stop_process,
    stop_server,
    terminal,
    wait_for,
    worker_argv,
)
from tests.helpers import finish, its_turn, records, register, submit_and_claim
from tests.test_outage import HOLD
from worker.edges.procs import find_by_launch_id

# ---- the retry policy and fencing, through the worker protocol -------------------------


def _claim(server: Server, name: str = "hand", wait_s: float = 0) -> dict[str, Any] | None:
    r = server.client("worker").post(
        "/workers/claim",
        json={"name": name, "free_cpu_slots": 8, "free_gpus": [], "wait_s": wait_s},
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def _finish(server: Server, claim: dict[str, Any], name: str = "hand", **body: Any) -> Any:
    return server.client("worker").post(
        f"/workers/jobs/{claim['job_id']}/finish",
        json={"worker": name, "attempt": claim["attempt"], **body},
    )


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def retry_api(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server per database with a 1 s retry backoff for the retry policy's tests: each
    claims only its own jobs (the one before it left none active)."""
    yield from module_server(request, tmp_path_factory, DDPQ_RETRY_BACKOFF_S="1")


@pytest.fixture
def retry_server(retry_api: Server) -> Iterator[Server]:
    yield from its_turn(retry_api)


def test_signals_are_retried_with_backoff_until_attempts_run_out(retry_server: Server) -> None:
    server = retry_server
    user = server.client()
    claim = submit_and_claim(server, max_attempts=3)
    jid = claim["job_id"]

    sent = time.monotonic()
    job = finish(server, claim, exit_code=137)  # SIGKILL: the OOM killer, say
    assert job["status"] == "queued" and job["exit_code"] == 137
    assert "attempt 1 killed by SIGKILL (out of memory?), exit code 137" in job["reason"]
    assert "retrying as attempt 2 (1 of 3 attempts used) after 1 s" in job["reason"]
    # The backoff holds it back, and says so (checked only while this side of the clock
    # is sure the backoff is not over yet: a loaded machine may take longer to ask).
    early = _claim(server)
    reason = user.get(f"/jobs/{jid}").json()["reason"]
    if time.monotonic() - sent < 1:
        assert early is None and "waiting out its retry backoff" in reason, reason

    second = early or _claim(server, wait_s=10)
    assert second is not None and second["job_id"] == jid and second["attempt"] == 2
    job = finish(server, second, exit_code=143)  # SIGTERM: preempted
    assert job["status"] == "queued"
    assert "killed by SIGTERM" in job["reason"] and "after 2 s" in job["reason"]

    third = _claim(server, wait_s=10)
    assert third is not None and third["attempt"] == 3
    job = finish(server, third, exit_code=137)
    assert job["status"] == "failed" and job["finished_at"]
    assert job["reason"].endswith("all 3 attempts used")


def test_a_programs_own_error_fails_unless_retry_on_error(retry_server: Server) -> None:
    server = retry_server
    plain = submit_and_claim(server)
    job = finish(server, plain, exit_code=1)
    assert job["status"] == "failed"
    assert job["reason"].startswith("exited with code 1")
    assert "not retried unless the spec sets retry_on_error" in job["reason"]

    retried = submit_and_claim(server, retry_on_error=True)
    job = finish(server, retried, exit_code=2)
    assert job["status"] == "queued" and "retrying as attempt 2" in job["reason"]

    # The worker's error line is kept after ddpq's own words for the exit.
    other = submit_and_claim(server)
    r = _finish(server, other, exit_code=1, reason="ValueError: bad data")
    assert r.json()["reason"].startswith("exited with code 1: ValueError: bad data")


def test_a_worker_shutdown_hands_the_job_back_uncounted(retry_server: Server) -> None:
    server = retry_server
    claim = submit_and_claim(server, max_attempts=1)
    for number in (1, 2):
        assert claim["attempt"] == number
        job = _finish(server, claim, outcome="requeue").json()
        assert job["status"] == "queued" and "shut down" in job["reason"]
        # No backoff for a handback.
        claim = _claim(server)  # type: ignore[assignment]
        assert claim is not None
    # Two handbacks, and the one attempt it may fail is still unspent.
    assert finish(server, claim, exit_code=0)["status"] == "succeeded"


def test_a_stale_attempt_is_fenced_off(server: Server) -> None:
    old = submit_and_claim(server, name="w1")
    jid = old["job_id"]
    # w1 comes back as a new process running nothing: its attempt is lost at once.
    r = server.client("worker").post(
        "/workers/register",
        json={"name": "w1", "hostname": "h", "cpu_slots": 8, "gpus": [], "checkpoint_root": "/c"},
    )
    assert r.status_code == 200
    job = server.client().get(f"/jobs/{jid}").json()
    assert job["status"] == "queued"
    assert "worker w1 restarted without it" in job["reason"]
    assert "requeued for attempt 2 (1 of 3 attempts used)" in job["reason"]

    register(server, "w2")
    new = _claim(server, name="w2")
    assert new is not None and new["job_id"] == jid and new["attempt"] == 2

    stale = server.client(old["token"])
    points = {"items": [{"step": 5, "values": {"loss": 0.1}}]}
    r = stale.post(f"/jobs/{jid}/metrics", json=points)
    # The superseded attempt's token is no longer valid (403), saying why.
    assert r.status_code == 403 and "superseded by attempt 2" in r.text
    r = stale.post(f"/jobs/{jid}/checkpoints", json={"path": f"/ckpt/job-{jid}/a.pt", "step": 5})
    assert r.status_code == 403
    w = server.client("worker")
    r = w.post(
        f"/workers/jobs/{jid}/logs",
        params={"worker": "w1", "attempt": 1, "offset": 0},
        content=b"late output\n",
    )
    assert r.status_code == 409
    assert _finish(server, old, name="w1", exit_code=0).status_code == 409
    beat = w.post(
        "/workers/heartbeat", json={"name": "w1", "running": [{"job_id": jid, "attempt": 1}]}
    )
    assert beat.json()["abandon"] == [{"job_id": jid, "attempt": 1}]

    # The new attempt is untouched by all of it.
    fresh = server.client(new["token"])
    assert fresh.post(f"/jobs/{jid}/metrics", json=points).status_code == 202
    job = server.client().get(f"/jobs/{jid}").json()
    assert job["status"] == "running" and job["attempt"] == 2 and job["worker"] == "w2"
    items = server.client().get(f"/jobs/{jid}/metrics").json()["items"]
    assert [(i["step"], i["attempt"]) for i in items] == [(5, 2)]


def test_an_attempt_without_heartbeats_is_lost_and_requeued(db_url: str, tmp_path: Path) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="1")
    try:
        claim = submit_and_claim(server, max_attempts=2)
        jid = claim["job_id"]

        def lost() -> dict[str, Any] | None:
            job: dict[str, Any] = server.client().get(f"/jobs/{jid}").json()
            return job if job["status"] == "queued" else None

        # The sweeper first waits a lease of its own uptime, then finds the silent attempt.
        job = wait_for(lost, 30, "the lease to expire")
        assert "worker hand lost (no heartbeat for 1 s)" in job["reason"]
        assert "requeued for attempt 2 (1 of 2 attempts used)" in job["reason"]
        second = _claim(server)
        assert second is not None and second["attempt"] == 2
        # This one is silent too, and the job has no attempt left.
        job = wait_for(
            lambda: (j := server.client().get(f"/jobs/{jid}").json())["status"] == "failed" and j,
            30,
            "the second lease to expire",
        )
        assert job["reason"].endswith("all 2 attempts used")
    finally:
        stop_server(server)


# ---- real workers, real torchrun --------------------------------------------------------
#
# What these test is the worker and torchrun; what each needs of the database (lease
# expiry, handback, fencing, the retry policy) is tested above on both databases, so
# they run on SQLite only, except the API restart, which is about the database too.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

# A 2-rank DDP program that checkpoints every epoch through ddpq.train and resumes from
# ddpq.train.load_checkpoint(); it records each start (attempt, torchrun restart, rank,
# the step it resumed at, pid) so the test can see who ran and find the ranks.
TRAINER = r"""
import argparse, json, os, time
import torch
import torch.distributed as dist
from ddpq import train

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=6)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--pace", type=float, default=0.05)
ap.add_argument("--record", required=True)
args = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
epoch, step = 0, 0
state = train.load_checkpoint()
if state is not None:
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    epoch, step = state["epoch"] + 1, state["step"]
with open(args.record, "a") as f:
    f.write(json.dumps({
        "attempt": int(os.environ.get("DDPQ_ATTEMPT", 0)),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "rank": rank, "start_step": step, "pid": os.getpid(),
    }) + "\n")
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
y = x.sum(dim=1, keepdim=True)
for e in range(epoch, args.epochs):
    for _ in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        train.report(step, epoch=e, loss=loss.detach())
        time.sleep(args.pace)
    if rank == 0:
        train.save_checkpoint(
            {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
             "epoch": e, "step": step},
            step=step, epoch=e,
        )
        print(f"epoch {e} done at step {step}", flush=True)
    dist.barrier()
train.flush()
dist.destroy_process_group()
"""


def _submit(server: Server, record: Path, *args: str, **spec: Any) -> int:
    body = {
        "entrypoint": "trainer.py",
        "world_size": 2,
        "device": "cpu",
        "args": ["--record", str(record), *args],
        **spec,
    }
    r = server.client().post("/jobs", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _checkpointed(server: Server, jid: int, at_least_step: int) -> bool:
    items = server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
    return any(c["step"] >= at_least_step for c in items)


def _one_series(server: Server, jid: int, total: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = server.client().get(f"/jobs/{jid}/metrics").json()["items"]
    assert [i["step"] for i in items] == list(range(1, total + 1)), "every step exactly once"
    return items


@pytest.mark.long  # a kill -9 and a resume elsewhere: about 30 s (make test-long)
@pytest.mark.torchrun
@SQLITE_ONLY
def test_kill_9_worker_mid_job_resumes_elsewhere_from_last_checkpoint(
    db_url: str, tmp_path: Path, start_worker: Any, launcher: str
) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="3")
    try:
        record = tmp_path / "starts.jsonl"
        a = start_worker(server, name="a", env=launcher_env(launcher))
        (a.workspace / "trainer.py").write_text(TRAINER)
        jid = _submit(server, record, "--epochs", "6", "--steps", "10")
        wait_for(lambda: _checkpointed(server, jid, 20), 90, "the second epoch's checkpoint")
        a.proc.kill()  # kill -9: no chance to hand anything back
        a.proc.wait()
        # Its torchrun got SIGTERM from the parent-death signal and took the ranks with it.
        try:
            wait_for(
                lambda: not find_by_launch_id(a.launch_prefix, prefix=True), 30, "a's ranks to die"
            )
        except AssertionError:
            left = find_by_launch_id(a.launch_prefix, prefix=True)
            ps = subprocess.run(
                ["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, left))],
                capture_output=True,
                text=True,
            ).stdout
            raise AssertionError(f"left behind:\n{ps}") from None

        b = start_worker(server, name="b", env=launcher_env(launcher))
        (b.workspace / "trainer.py").write_text(TRAINER)
        final = terminal(server.client(), jid, timeout=120)
        assert final["status"] == "succeeded", (
            final,
            server.client().get(f"/jobs/{jid}/logs").text,
        )
        assert final["attempt"] == 2 and final["worker"] == "b"

        starts = records(record)
        second = [s for s in starts if s["attempt"] == 2]
        assert {s["rank"] for s in second} == {0, 1}
        resumed_at = second[0]["start_step"]
        assert resumed_at >= 20 and resumed_at % 10 == 0
        items = _one_series(server, jid, 60)
        # Steps past the checkpoint were run twice; the newer attempt's points are kept.
        assert all(i["attempt"] == (1 if i["step"] <= resumed_at else 2) for i in items)
    finally:
        stop_server(server)


@pytest.mark.torchrun
@SQLITE_ONLY
def test_kill_9_one_rank_restarts_the_group_inside_the_attempt(
    server: Server, start_worker: Any, tmp_path: Path, launcher: str
) -> None:
    record = tmp_path / "starts.jsonl"
    w = start_worker(server, env=launcher_env(launcher))
    (w.workspace / "trainer.py").write_text(TRAINER)
    jid = _submit(server, record, "--epochs", "5", "--steps", "10", max_restarts=1)
    wait_for(lambda: _checkpointed(server, jid, 10), 90, "the first epoch's checkpoint")
    rank1 = next(s for s in records(record) if s["rank"] == 1)
    os.kill(rank1["pid"], signal.SIGKILL)

    final = terminal(server.client(), jid)
    assert final["status"] == "succeeded", (final, server.client().get(f"/jobs/{jid}/logs").text)
    assert final["attempt"] == 1
    restarted = [s for s in records(record) if s["restart"] == 1]
    assert {s["rank"] for s in restarted} == {0, 1}
    assert restarted[0]["start_step"] >= 10  # from the snapshot, not from scratch
    _one_series(server, jid, 50)


@pytest.mark.torchrun
@SQLITE_ONLY
def test_sigterm_worker_requeues_the_job_without_counting_it(
    server: Server, start_worker: Any, tmp_path: Path
) -> None:
    record = tmp_path / "starts.jsonl"
    a = start_worker(server, name="a")
    (a.workspace / "trainer.py").write_text(TRAINER)
    jid = _submit(server, record, "--epochs", "5", "--steps", "10", max_attempts=1)
    wait_for(lambda: _checkpointed(server, jid, 10), 90, "the first epoch's checkpoint")
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0
    job = server.client().get(f"/jobs/{jid}").json()
    assert job["status"] == "queued", job
    assert "worker a shut down" in job["reason"]
    assert not find_by_launch_id(a.launch_prefix, prefix=True)

    b = start_worker(server, name="b")
    (b.workspace / "trainer.py").write_text(TRAINER)
    # max_attempts is 1: the handback did not use it up.
    final = terminal(server.client(), jid)
    assert final["status"] == "succeeded" and final["attempt"] == 2
    _one_series(server, jid, 50)


@pytest.mark.long  # an API restarted under a running job: about 25 s each (make test-long)
@pytest.mark.torchrun
def test_restarting_the_api_mid_job_loses_nothing(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    port, tokens = free_port(), (secrets.token_urlsafe(24), secrets.token_urlsafe(24))
    # A short lease: the restart takes longer than it, and the job must not be lost.
    env = {"DDPQ_LEASE_S": "2"}
    server = start_server(db_url, tmp_path / "api", port=port, tokens=tokens, **env)
    record = tmp_path / "starts.jsonl"
    w = start_worker(server)
    (w.workspace / "trainer.py").write_text(TRAINER)
    jid = _submit(server, record, "--epochs", "6", "--steps", "10", "--pace", "0.08")
    wait_for(lambda: _checkpointed(server, jid, 10), 90, "the first epoch's checkpoint")
    stop_server(server)
    # Training goes on while the API is down; the worker and ddpq.train keep what they
    # cannot send.
    wait_for(lambda: "API unavailable" in w.log(), 30, "the worker to notice the API is gone")
    server = start_server(db_url, tmp_path / "api", port=port, tokens=tokens, **env)
    try:
        final = terminal(server.client(), jid)
        log = server.client().get(f"/jobs/{jid}/logs").text
        assert final["status"] == "succeeded" and final["attempt"] == 1, (final, log)
        _one_series(server, jid, 60)
        checkpoints = server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
        assert [c["step"] for c in checkpoints] == [10, 20, 30, 40, 50, 60]
        for e in range(6):
            assert f"[rank0]: epoch {e} done at step {10 * (e + 1)}" in log
    finally:
        stop_server(server)


@pytest.mark.postgres
@pytest.mark.exclusive  # restarts the Postgres every other test shares
def test_restarting_postgres_gives_503_then_recovers(pg_url: str, tmp_path: Path) -> None:
    server = start_server(pg_url, tmp_path / "api")
    user = server.client()
    jid = user.post("/jobs", json={"entrypoint": "train.py"}).json()["id"]
    seen: dict[int, int] = {}
    retry_after: set[str | None] = set()
    stop = threading.Event()

    def traffic() -> None:
        c = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.api_token}"}, timeout=30
        )
        with c:
            while not stop.is_set():
                for r in (
                    c.get(f"/jobs/{jid}"),
                    c.get("/jobs"),
                    c.post("/jobs", json={"entrypoint": "t.py"}),
                ):
                    seen[r.status_code] = seen.get(r.status_code, 0) + 1
                    if r.status_code == 503:
                        retry_after.add(r.headers.get("retry-after"))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        wait_for(lambda: seen.get(200, 0) > 20, 30, "traffic to flow")
        version = sorted(os.listdir("/etc/postgresql"))[-1]
        subprocess.run(
            [
                "pg_ctlcluster",
                "--skip-systemctl-redirect",
                version,
                "main",
                "restart",
                "-m",
                "fast",
            ],
            check=True,
            timeout=120,
        )
        before = seen.get(200, 0)
        wait_for(lambda: seen.get(200, 0) > before + 50, 60, "requests to succeed again")
    finally:
        stop.set()
        t.join(timeout=60)
        stop_server(server)
    assert set(seen) <= {200, 201, 503}, seen
    assert seen.get(503, 0) > 0, "the restart was not noticed"
    assert retry_after and None not in retry_after


# ---- one worker per name and per data dir -----------------------------------------------

IDENTITY_A, IDENTITY_B = "a" * 32, "b" * 32


def _register(server: Server, identity: str, hostname: str) -> httpx.Response:
    return server.client("worker").post(
        "/workers/register",
        json={
            "name": "twin",
            "identity": identity,
            "hostname": hostname,
            "cpu_slots": 2,
            "gpus": [],
            "checkpoint_root": "/ckpt",
        },
    )


def test_a_name_in_use_is_refused_until_its_heartbeats_stop(db_url: str, tmp_path: Path) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="2")
    try:
        w = server.client("worker")
        assert _register(server, IDENTITY_A, "host-a").status_code == 200
        # The same worker starting again (same identity) is welcome at once.
        assert _register(server, IDENTITY_A, "host-a").status_code == 200
        r = _register(server, IDENTITY_B, "host-b")
        assert r.status_code == 409, r.text
        assert "in use by a running worker on host host-a" in r.json()["detail"]
        beat = {"name": "twin", "identity": IDENTITY_A, "running": []}
        assert w.post("/workers/heartbeat", json=beat).status_code == 200
        # Silent for a lease: the name is free for another process, and the old one,
        # should it come back, is told it was taken over.
        wait_for(
            lambda: _register(server, IDENTITY_B, "host-b").status_code == 200,
            30,
            "the name to be free after a silent lease",
        )
        r = w.post("/workers/heartbeat", json=beat)
        assert r.status_code == 409 and "taken over" in r.json()["detail"], r.text
    finally:
        stop_server(server)


def _bare_worker(server: Server, name: str, data: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    """A `ddpq worker` outside the start_worker fixture (which gives each name one data
    dir and one log), its output in tmp_path/<name>-<n>.log."""
    workspace = tmp_path / "bare-ws"
    workspace.mkdir(exist_ok=True)
    n = len(list(tmp_path.glob(f"{name}-*.log")))
    with open(tmp_path / f"{name}-{n}.log", "wb") as out:
        return subprocess.Popen(
            worker_argv(server, name, workspace, data, "--gpus", "none"),
            env=_child_env({"DDPQ_WORKER_TOKEN": server.worker_token, **NO_JOBS}),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.torchrun
def test_a_second_worker_with_a_live_workers_name_leaves_its_job_alone(
    server: Server, tmp_path: Path, start_worker: Any
) -> None:
    w = start_worker(server, name="gpu-host")
    (w.workspace / "hold.py").write_text(HOLD)
    flag = tmp_path / "release"
    user = server.client()
    r = user.post(
        "/jobs",
        json={"entrypoint": "hold.py", "args": [str(flag)], "world_size": 1, "device": "cpu"},
    )
    jid = r.json()["id"]
    wait_for(lambda: "holding" in user.get(f"/jobs/{jid}/logs").text, 90, "the program to run")
    # Another process under the same name, with its own data dir (so another identity).
    twin = _bare_worker(server, "gpu-host", tmp_path / "twin-data", tmp_path)
    assert twin.wait(timeout=60) == 1  # the API refused it (409): exit code 1
    said = (tmp_path / "gpu-host-0.log").read_text()
    assert "is in use by a running worker on host" in said, said
    flag.write_text("go")
    final = terminal(user, jid)
    attempts = user.get(f"/jobs/{jid}/attempts").json()["items"]
    assert final["status"] == "succeeded", (final, attempts)
    assert [a["outcome"] for a in attempts] == ["succeeded"], attempts


@SQLITE_ONLY
def test_two_workers_never_share_a_data_dir(server: Server, tmp_path: Path) -> None:
    data = tmp_path / "shared-data"
    first = _bare_worker(server, "one", data, tmp_path)
    try:
        wait_for(lambda: (data / "worker-id").exists(), 60, "the first worker to hold its dir")
        second = _bare_worker(server, "two", data, tmp_path)
        assert second.wait(timeout=60) == 2
        said = (tmp_path / "two-0.log").read_text()
        assert f"is in use by another worker (pid {first.pid})" in said, said
        assert first.poll() is None  # the first one goes on
    finally:
        stop_process(first)
