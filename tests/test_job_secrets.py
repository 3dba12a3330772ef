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

import pytest

from tests.conftest import (
    REPO,
    Server,
    _child_env,
    stop_process,
    terminal,
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
    user = server.client()
    r = user.post(
        "/jobs",
        json={"entrypoint": "probe.py", "args": [str(data)], "world_size": 1, "device": "cpu"},
    )
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    job = terminal(user, jid)

    def probed() -> str | None:
        text = user.get(f"/jobs/{jid}/logs").text
        return text if "PROBE " in text else None

    log: str = wait_for(probed, 30, "the probe's report")
    assert job["status"] == "succeeded", (job, log)
    # It looked: the worker's environment was there to try, and was refused.
    probe = next(line for line in log.splitlines() if "PROBE " in line)
    assert "ddpq.cli worker" in probe.split("environ_denied", 1)[1].split("environ_read")[0]
    for value in (server.worker_token, server.api_token, *SECRETS.values()):
        assert value not in log, f"a job read {value!r}"
