"""Job code is hostile: it never reaches a secret of the worker, the API or the database.

A worker runs with secrets in its environment, as one given a whole env file would
(the API token, the database URL and password, a cloud key, its own worker token), and
without any capability (`setpriv --bounding-set=-all`: uid 0 with no privilege is a
plain user, the job's user, as on a real host). The job is tests/secret_probe.py: it
prints its own environment, every other process's /proc environ and memory it can open,
and every file in the worker's data directory. None of the secrets may be in its log.
Before the worker was made undumpable and jobs got an allow-listed environment, the
probe printed all of them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    REPO,
    Server,
    _child_env,
    free_port,
    stop_process,
    terminal,
    up_argv,
    wait_for,
    worker_argv,
)

SECRETS = {
    "DDPQ_API_TOKEN": "api-token-that-jobs-must-not-see-1f0e",
    "DDPQ_DATABASE_URL": "postgresql://ddpq:db-password-4b7c@db/ddpq",
    "POSTGRES_PASSWORD": "db-password-4b7c",
    "AWS_SECRET_ACCESS_KEY": "cloud-key-9d2a",
}


@pytest.fixture
def hostile_job(server: Server, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    base = tmp_path / "worker"
    workspace, data = base / "workspace", base / "data"
    workspace.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "secret_probe.py", workspace / "probe.py")
    log = base / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                "setpriv",
                "--bounding-set=-all",
                "--inh-caps=-all",
                "--",
                *worker_argv(
                    server, "plain-user", workspace, data, "--cpu-slots", "2", "--gpus", "none"
                ),
            ],
            env=_child_env({"DDPQ_WORKER_TOKEN": server.worker_token, **SECRETS}),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=base,
        )
    yield server, data
    stop_process(proc)


def test_a_job_finds_no_secret_of_the_worker(hostile_job: tuple[Server, Path]) -> None:
    server, data = hostile_job
    denied, log = probe(server.client(), [str(data)])
    # It looked: the worker's environment was there to try, and was refused.
    assert "ddpq.cli worker" in denied, log
    for value in (server.worker_token, server.api_token, *SECRETS.values()):
        assert value not in log, f"a job read {value!r}"


def probe(user: httpx.Client, args: list[str]) -> tuple[str, str]:
    """Run the probe as a job: the command lines whose environment it was refused, and
    its log (everything it could read)."""
    r = user.post(
        "/jobs", json={"entrypoint": "probe.py", "args": args, "world_size": 1, "device": "cpu"}
    )
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    job = terminal(user, jid)

    def probed() -> str | None:
        text = user.get(f"/jobs/{jid}/logs").text
        return text if "PROBE " in text else None

    log: str = wait_for(probed, 30, "the probe's report")
    assert job["status"] == "succeeded", (job, log)
    report = next(line for line in log.splitlines() if "PROBE " in line)
    return report.split("environ_denied", 1)[1].split("environ_read")[0], log


def test_a_job_under_ddpq_up_finds_no_secret_of_the_api_or_the_worker(tmp_path: Path) -> None:
    """`ddpq up` holds the API's tokens and database URL and hands the worker its token:
    it and the launcher it starts the worker with are undumpable too (issue 26, item 9)."""
    workspace, data = tmp_path / "workspace", tmp_path / "data"
    workspace.mkdir()
    shutil.copy(REPO / "tests" / "secret_probe.py", workspace / "probe.py")
    port = free_port()
    tokens = {
        "DDPQ_API_TOKEN": "up-api-token-jobs-must-not-see-7c1d",
        "DDPQ_WORKER_TOKEN": "up-worker-token-jobs-must-not-see-2b9e",
    }
    env = {**SECRETS, **tokens, "DDPQ_DATA_DIR": str(data)}
    env.pop("DDPQ_DATABASE_URL")  # up's own SQLite under DDPQ_DATA_DIR
    with open(tmp_path / "up.log", "wb") as out:
        plain_user = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
        proc = subprocess.Popen(
            [*plain_user, *up_argv(port, "--cpu-slots", "1", "--workspace", str(workspace))],
            env=_child_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        user = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {tokens['DDPQ_API_TOKEN']}"}
        )
        wait_for(lambda: user.get("/healthz").status_code == 200, 60, "ddpq up to answer")
        denied, log = probe(user, [])
        user.close()
    finally:
        stop_process(proc)
    assert "ddpq.cli up" in denied and "worker.launch" in denied, log
    for value in (*tokens.values(), *SECRETS.values()):
        assert value not in log, f"a job read {value!r}"
