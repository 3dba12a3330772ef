"""`ddpq serve` and `ddpq up` start-up rules (the CLI's commands: tests/test_cli.py)."""

from __future__ import annotations

import json
import re
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    _child_env,
    free_port,
    run_ddpq,
    serve_on_a_reachable_address,
    start_server,
    stop_process,
    stop_server,
    up_argv,
    wait_for,
)


@pytest.mark.parametrize(
    ("args", "given"),
    [
        (("--help",), None),
        (("submit", "--world-size", "0", "train.py"), None),  # a usage error: exit 2
        (("jobs",), None),  # no API to reach: its error, exit 1
        (("login", "http://127.0.0.1:9", "--token-stdin"), "a token\n"),  # unreachable: exit 3
    ],
)
def test_a_forked_ddpq_answers_as_a_new_interpreter_would(
    tmp_path: Path, args: tuple[str, ...], given: str | None
) -> None:
    # The tests' `ddpq` calls are forked from a zygote that imported ddpq ahead
    # (tests/ddpqfork.py): the same output, errors and exit code as a new interpreter's.
    env = {"DDPQ_URL": "http://127.0.0.1:9", "XDG_CONFIG_HOME": str(tmp_path)}
    forked = run_ddpq(*args, env=env, cwd=tmp_path, input=given)
    new = subprocess.run(
        [sys.executable, "-m", "ddpq.cli", *args],
        env=_child_env(env), capture_output=True, text=True, input=given, cwd=tmp_path,
    )  # fmt: skip
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        new.returncode, new.stdout, new.stderr,
    ), (forked, new)  # fmt: skip


def test_serve_refuses_a_reachable_address_without_tokens(tmp_path: Path) -> None:
    r = serve_on_a_reachable_address(
        {"DDPQ_DATA_DIR": str(tmp_path)},
    )
    assert r.returncode == 2
    assert "DDPQ_API_TOKEN" in r.stderr and "DDPQ_WORKER_TOKEN" in r.stderr
    r = serve_on_a_reachable_address(
        {
            "DDPQ_DATA_DIR": str(tmp_path),
            "DDPQ_API_TOKEN": "changeme",
            "DDPQ_WORKER_TOKEN": "x" * 40,
        },
    )
    assert r.returncode == 2 and "DDPQ_API_TOKEN" in r.stderr
    assert not (tmp_path / "api-token").exists()


def test_loopback_serve_generates_private_tokens_the_cli_finds(tmp_path: Path) -> None:
    port = free_port()
    env = {"DDPQ_DATA_DIR": str(tmp_path / "var")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpq.cli", "serve", "--port", str(port)],
        env=_child_env(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import httpx

        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, 60, "serve"
        )
        for name in ("api-token", "worker-token"):
            mode = stat.S_IMODE((tmp_path / "var" / name).stat().st_mode)
            assert mode == 0o600, oct(mode)
        cli_env = {**env, "DDPQ_URL": f"http://127.0.0.1:{port}"}
        r = run_ddpq(
            "submit",
            "--recipe",
            "toy-regression",
            "--world-size",
            "2",
            "--json",
            "--",
            "--total-epochs",
            "1",
            env=cli_env,
        )
        assert r.returncode == 0, r.stderr
        job = json.loads(r.stdout)
        assert job["spec"]["args"] == ["--total-epochs", "1"]
        r = run_ddpq("ls", "--json", env=cli_env)
        assert [j["id"] for j in json.loads(r.stdout)["items"]] == [job["id"]]
        r = run_ddpq("status", str(job["id"]), env=cli_env)
        assert r.returncode == 0 and "queued" in r.stdout
        # The CLI's commands and exit codes: tests/test_cli.py.
    finally:
        stop_process(proc)


def test_up_runs_the_api_and_a_local_worker(tmp_path: Path) -> None:
    import httpx

    port = free_port()
    (tmp_path / "hello.py").write_text(
        "print('hello from rank', __import__('os').environ['RANK'])\n"
    )
    log = tmp_path / "up.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            up_argv(port, "--cpu-slots", "2"),
            env=_child_env({"DDPQ_DATA_DIR": str(tmp_path / "var")}),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/healthz").status_code == 200, 60, "ddpq up")
        # The banner comes once the API answers: it says the user is logged in to it.
        wait_for(lambda: "ddpq is up" in log.read_text(), 60, "the banner")
        text = log.read_text()
        assert url in text and str(tmp_path / "var" / "api-token") in text and "ddpq submit" in text
        token = (tmp_path / "var" / "api-token").read_text().strip()
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})
        job = c.post("/jobs", json={"entrypoint": "hello.py", "world_size": 2}).json()

        def ended() -> dict | None:
            j = c.get(f"/jobs/{job['id']}").json()
            return j if j["status"] in ("succeeded", "failed") else None

        final = wait_for(ended, 90, "the job to run on the local worker")
        assert final["status"] == "succeeded" and final["worker"] == "local"
        assert "hello from rank 1" in c.get(f"/jobs/{job['id']}/logs").text
        c.close()
    finally:
        stop_process(proc)
    assert proc.returncode == 0


@pytest.mark.parametrize("files", ["none", "bare"])
def test_generated_tokens_say_what_they_are_and_bare_ones_from_before_keep_working(
    files: str, db_url: str, tmp_path: Path
) -> None:
    """A fresh loopback `ddpq serve` writes a user token (the first admin's) and a worker
    token, each with its prefix (service/tokens.py); files written before the prefixes
    existed are read as they are, and both of their tokens still work."""
    var = tmp_path / "var"
    var.mkdir()
    bare = {"api-token": secrets.token_urlsafe(32), "worker-token": secrets.token_urlsafe(32)}
    if files == "bare":
        for name, token in bare.items():
            (var / name).write_text(token + "\n")
    # Empty variables: none set, so serve generates (or reads) the files.
    server = start_server(db_url, var, tokens=("", ""))
    try:
        api, worker = ((var / n).read_text().strip() for n in ("api-token", "worker-token"))
        if files == "bare":
            assert (api, worker) == (bare["api-token"], bare["worker-token"])  # not rewritten
        else:
            assert re.fullmatch(r"ddpqu_[A-Za-z0-9_-]{43}", api), api
            assert re.fullmatch(r"ddpqw_[A-Za-z0-9_-]{43}", worker), worker
        server.api_token, server.worker_token = api, worker
        assert server.client().get("/whoami").json() == {"name": "admin", "role": "admin"}
        me = {"name": "w", "hostname": "h", "cpu_slots": 1, "gpus": [], "checkpoint_root": "/c"}
        r = server.client("worker").post("/workers/register", json=me)
        assert r.status_code == 200, r.text
        # Each token is of its own kind only: the worker's is no user's.
        assert server.client(worker).get("/whoami").status_code == 403
        # The CLI finds the first admin's in the data directory, as before.
        r = run_ddpq("whoami", "--json", env={"DDPQ_DATA_DIR": str(var), "DDPQ_URL": server.url})
        assert r.returncode == 0 and json.loads(r.stdout)["name"] == "admin", r.stderr
    finally:
        stop_server(server)
