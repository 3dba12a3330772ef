"""Prometheus at GET /metrics, and TensorBoard event files from ddpq.train."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server, _child_env, start_server, stop_server
from tests.helpers import finish, job_runner, register, submit_and_claim

FAMILIES = {
    "ddpq_database_up",
    "ddpq_jobs",
    "ddpq_running_jobs",
    "ddpq_queue_oldest_wait_seconds",
    "ddpq_queue_wait_seconds",
    "ddpq_worker_gpu_slots",
    "ddpq_worker_cpu_slots",
    "ddpq_worker_running_jobs",
    "ddpq_worker_up",
    "ddpq_worker_last_heartbeat_timestamp_seconds",
    "ddpq_claim_latency_seconds",
    "ddpq_http_request_duration_seconds",
}


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    r = server.client().get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(r.text))
    assert {f.name for f in families} >= FAMILIES
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_metrics_after_jobs_ran(server: Server) -> None:
    assert server.client(None).get("/metrics").status_code == 401
    assert server.client("not-a-token").get("/metrics").status_code == 401
    assert server.client("worker").get("/metrics").status_code == 403
    user = server.client()
    # A job that ran on a CPU worker and succeeded; one running there now.
    done = submit_and_claim(server, "cpu-w", device="cpu")
    finish(server, done, name="cpu-w")
    running = submit_and_claim(server, "cpu-w", device="cpu", world_size=3)
    # A GPU worker running a 2-GPU job, with 2 of its 4 GPUs left.
    register(server, "gpu-w", cpu_slots=4, gpus=[0, 1, 2, 3])
    assert user.post("/jobs", json={"entrypoint": "t.py", "world_size": 2}).status_code == 201
    r = server.client("worker").post(
        "/workers/claim",
        json={"name": "gpu-w", "free_cpu_slots": 4, "free_gpus": [0, 1, 2, 3], "wait_s": 5},
    )
    assert r.status_code == 200, r.text
    assert "queued_at" not in r.json()  # the metrics' own field stays out of the claim
    # One queued job that no worker can take (8 GPUs on one worker).
    assert user.post("/jobs", json={"entrypoint": "t.py", "world_size": 8}).status_code == 201
    assert user.get(f"/jobs/{running['job_id']}").status_code == 200
    assert user.get("/no/such/path").status_code == 404

    m = scrape(server)

    def v(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert v("ddpq_database_up") == 1
    assert v("ddpq_jobs", state="succeeded") == 1
    assert v("ddpq_jobs", state="running") == 2
    assert v("ddpq_jobs", state="queued") == 1
    assert v("ddpq_jobs", state="failed") == 0
    assert v("ddpq_running_jobs") == 2
    assert v("ddpq_queue_oldest_wait_seconds") >= 0
    assert v("ddpq_worker_gpu_slots", worker="gpu-w", state="used") == 2
    assert v("ddpq_worker_gpu_slots", worker="gpu-w", state="free") == 2
    assert v("ddpq_worker_cpu_slots", worker="cpu-w", state="used") == 3
    assert v("ddpq_worker_cpu_slots", worker="cpu-w", state="free") == 5
    assert v("ddpq_worker_gpu_slots", worker="cpu-w", state="free") == 0
    assert v("ddpq_worker_running_jobs", worker="cpu-w") == 1
    assert v("ddpq_worker_running_jobs", worker="gpu-w") == 1
    assert v("ddpq_worker_up", worker="gpu-w") == 1
    assert v("ddpq_worker_last_heartbeat_timestamp_seconds", worker="gpu-w") > 1.7e9
    # Three claims handed out a job; each one's queue wait was observed.
    assert v("ddpq_claim_latency_seconds_count", outcome="claimed") == 3
    assert 0 < v("ddpq_claim_latency_seconds_sum", outcome="claimed") < 30
    assert v("ddpq_queue_wait_seconds_count") == 3
    # Requests are labelled by route template, never by the raw path.
    http = "ddpq_http_request_duration_seconds_count"
    assert v(http, method="GET", route="/jobs/{job_id}", status="200") == 1
    assert v(http, method="POST", route="/jobs", status="201") == 4
    assert v(http, method="POST", route="/workers/claim", status="200") == 3
    assert v(http, method="GET", route="unmatched", status="404") == 1
    # Refused by the token gate before routing: counted, without a route.
    assert v(http, method="GET", route="unmatched", status="403") == 1
    assert not any("/jobs/1" in str(labels) for _, labels in m)


# ---- TensorBoard ------------------------------------------------------------------------

REPORTER = r"""
import sys
from ddpq import train
first, last = int(sys.argv[1]), int(sys.argv[2])
for step in range(first, last + 1):
    train.report(step, loss=float(sys.argv[3]) / step, epoch=step // 5)
assert train.flush(timeout=60), "not everything was sent"
"""


def _report(server: Server, claim: dict[str, Any], tb_dir: Path, *args: str) -> None:
    env = {
        "DDPQ_URL": server.url,
        "DDPQ_JOB_ID": str(claim["job_id"]),
        "DDPQ_JOB_TOKEN": claim["token"],
        "DDPQ_ATTEMPT": str(claim["attempt"]),
        "DDPQ_TENSORBOARD_DIR": str(tb_dir),
        "RANK": "0",
    }
    out = subprocess.run(
        [sys.executable, "-c", REPORTER, *args],
        env=_child_env(env),
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()


def test_report_writes_tensorboard_runs(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    server = start_server(f"sqlite:///{tmp_path / 'ddpq.db'}", tmp_path / "api")
    try:
        claim = submit_and_claim(server)
        tb_dir = tmp_path / "tb"
        # A first process reports steps 1..20; a second (as a resumed attempt would)
        # reports 11..15 again with other values.
        _report(server, claim, tb_dir, "1", "20", "1.0")
        _report(server, claim, tb_dir, "11", "15", "100.0")
        run = tb_dir / f"job-{claim['job_id']}"
        assert len(list(run.glob("events.out.tfevents.*"))) == 2  # one file per process
        acc = EventAccumulator(str(run))
        acc.Reload()
        assert set(acc.Tags()["scalars"]) == {"loss", "epoch"}
        loss = {e.step: e.value for e in acc.Scalars("loss")}
        # The newer process's steps replace the older's from where it started.
        assert sorted(loss) == list(range(1, 16))
        assert loss[3] == pytest.approx(1 / 3)
        assert loss[12] == pytest.approx(100 / 12)
        assert {e.step: e.value for e in acc.Scalars("epoch")}[14] == 2
        # The API got the same points.
        items = server.client().get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
        assert [i["step"] for i in items] == list(range(1, 21))
    finally:
        stop_server(server)


def test_worker_passes_tensorboard_dir_to_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = job_runner(tmp_path, {"env": {}})
    monkeypatch.setenv("DDPQ_API_TOKEN", "secret")  # other DDPQ_* stay private
    monkeypatch.delenv("DDPQ_TENSORBOARD_DIR", raising=False)
    assert "DDPQ_TENSORBOARD_DIR" not in runner._env(None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPQ_TENSORBOARD_DIR", "runs")
    env = runner._env(None)
    assert env["DDPQ_TENSORBOARD_DIR"] == str(tmp_path / "runs")
    assert "DDPQ_API_TOKEN" not in env


def test_metrics_answer_while_the_database_is_down() -> None:
    from service.db import Database
    from service.telemetry import Telemetry
    from tests.conftest import free_port

    # Nothing listens on this port: every query fails at once.
    db = Database(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    try:
        text = Telemetry(db).exposition().decode()
    finally:
        db.dispose()
    assert "ddpq_database_up 0.0" in text
    assert "ddpq_http_request_duration_seconds" in text  # this process's own figures stay
