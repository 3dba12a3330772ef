"""`docker compose up` for real, step by step as the README's compose section says.

Run by tests/compose/run.sh (`make compose-test`), which provides a Docker engine,
Compose v2 and the locally built base images; skipped anywhere else. The stack gets its
own project name, port and env file, so it never touches a user's `docker compose` stack
or `.env`.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port, run_ddpq, wait_for
from tests.helpers import make_wheel

REPO = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.skipif(
    os.environ.get("DDPQ_COMPOSE_TEST") != "1", reason="needs Docker: run `make compose-test`"
)

PROGRAM = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"my own program: rank {dist.get_rank()} of {dist.get_world_size()}, sum {t.item():g}")
dist.destroy_process_group()
"""


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.api_token = secrets.token_urlsafe(32)
        self.worker_token = secrets.token_urlsafe(32)
        self.db_password = secrets.token_urlsafe(24)
        self.env_file = tmp / "compose.env"
        self.env_file.write_text(
            f"POSTGRES_USER=ddpq\nPOSTGRES_PASSWORD={self.db_password}\nPOSTGRES_DB=ddpq\n"
            f"DDPQ_API_TOKEN={self.api_token}\nDDPQ_WORKER_TOKEN={self.worker_token}\n"
            f"DDPQ_SECRETS_KEY={secrets.token_urlsafe(32)}\nDDPQ_PORT={self.port}\n"
        )
        # make compose-test's override swaps in local base images and drops the GPU
        # reservation; a GPU host (make gpu-check-compose) runs the file as it is.
        override = os.environ.get("DDPQ_COMPOSE_OVERRIDE")
        self.files = [REPO / "docker-compose.yml", *([Path(override)] if override else [])]
        self.user = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {self.api_token}"},
            timeout=30,
        )

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = ["docker", "compose", "-p", "ddpq-compose-test", "--env-file", str(self.env_file)]
        for f in self.files:
            cmd += ["-f", str(f)]
        result = subprocess.run(
            [*cmd, "--project-directory", str(REPO), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result

    def up(self) -> None:
        self.compose("up", "-d", "--wait", "--wait-timeout", "300")

    def submit(self, **spec: Any) -> int:
        r = self.user.post("/jobs", json=spec)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def job(self, jid: int) -> dict[str, Any]:
        out: dict[str, Any] = self.user.get(f"/jobs/{jid}").json()
        return out

    def ended(self, jid: int, timeout: float = 300) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            job = self.job(jid)
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job: dict[str, Any] = wait_for(done, timeout, f"job {jid} to end", interval=1)
        return job

    def log(self, jid: int) -> str:
        return self.user.get(f"/jobs/{jid}/logs").text

    def until(self, what: str, check: Callable[[], Any], timeout: float = 300) -> Any:
        return wait_for(check, timeout, what, interval=1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("compose"))
    s.compose("down", "-v", "--remove-orphans")  # what an interrupted run left
    s.up()
    yield s
    s.user.close()
    s.compose("down", "-v", "--remove-orphans")


def test_a_recipe_job_learns_and_checkpoints(stack: Stack) -> None:
    jid = stack.submit(
        recipe="toy-regression",
        world_size=2,
        device="cpu",
        args=["--total-epochs", "20", "--save-every", "5"],
    )
    job = stack.ended(jid)
    assert job["status"] == "succeeded", (job, stack.log(jid))
    losses = [i["values"]["loss"] for i in stack.user.get(f"/jobs/{jid}/metrics").json()["items"]]
    assert len(losses) >= 5 and losses[-1] < losses[0], losses
    checkpoints = stack.user.get(f"/jobs/{jid}/checkpoints").json()["items"]
    assert checkpoints and all(
        c["path"].startswith(f"/data/checkpoints/job-{jid}/") for c in checkpoints
    )


def test_the_api_image_is_slim_holds_its_lock_and_no_torch(stack: Stack) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch'))"
    found = stack.compose("exec", "-T", "api", "python", "-c", probe)
    assert found.stdout.strip() == "None", found.stdout
    size = subprocess.run(
        ["docker", "image", "inspect", "ddpq-api:latest", "--format", "{{.Size}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    # Slim: no torch (GBs). Optuna, which decides sweeps (issue 43), brings numpy: 371 MB.
    assert int(size.stdout) < 400_000_000, f"the API image is {int(size.stdout) / 1e6:.0f} MB"
    installed = stack.compose("exec", "-T", "api", "pip", "list", "--format=freeze").stdout

    def canonical(name: str) -> str:  # PEP 503: pip list and pip-compile spell names apart
        return re.sub(r"[-_.]+", "-", name).lower()

    have = {canonical(n): v for n, _, v in (line.partition("==") for line in installed.split())}
    lock = (REPO / "requirements" / "server.txt").read_text()
    for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, flags=re.M):
        assert have.get(canonical(name)) == version, (name, version, have.get(canonical(name)))


def test_the_examples_run_as_the_readme_says(stack: Stack) -> None:
    jid = stack.submit(entrypoint="examples/ddp_plain.py", world_size=2, device="cpu")
    job = stack.ended(jid)
    assert job["status"] == "succeeded", (job, stack.log(jid))


MY_TRAIN = """
import torch.distributed as dist
import ddpqtestpkg
import helper
dist.init_process_group("gloo")
print(f"my code: rank {dist.get_rank()} magic {ddpqtestpkg.MAGIC} {helper.WORD}", flush=True)
dist.destroy_process_group()
"""


def test_your_own_code_from_your_laptop(stack: Stack, tmp_path: Path) -> None:
    """`ddpq submit` on the host sends a directory; the worker installs its requirements."""
    proj = tmp_path / "my-model"
    proj.mkdir()
    (proj / "train.py").write_text(MY_TRAIN)
    (proj / "helper.py").write_text('WORD = "from my laptop"\n')
    make_wheel(proj / "wheels")
    (proj / "requirements.txt").write_text("./wheels/ddpqtestpkg-0.1-py3-none-any.whl\n")
    out = run_ddpq(
        "submit", "--entrypoint", "train.py", "--world-size", "2", "--device", "cpu", "--wait",
        env={"DDPQ_URL": f"http://127.0.0.1:{stack.port}", "DDPQ_TOKEN": stack.api_token},
        cwd=proj,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert out.stdout.startswith("code: 4 files"), out.stdout
    jid = int(out.stdout.split(" · job ", 1)[1].split()[0])
    log = stack.log(jid)
    assert "Successfully installed ddpqtestpkg" in log, log
    assert "my code: rank 1 magic 42 from my laptop" in log, log


def test_your_own_program_with_docker_compose_cp(stack: Stack, tmp_path: Path) -> None:
    program = tmp_path / "mine.py"
    program.write_text(PROGRAM)
    stack.compose("cp", str(program), "worker:/workspace/mine.py")
    jid = stack.submit(entrypoint="mine.py", world_size=2, device="cpu")  # no code: the volume
    job = stack.ended(jid)
    log = stack.log(jid)
    assert job["status"] == "succeeded", (job, log)
    assert "my own program: rank 0 of 2, sum 3" in log


def test_no_secret_is_readable_from_inside_a_job(stack: Stack) -> None:
    stack.compose("cp", str(REPO / "tests" / "secret_probe.py"), "worker:/workspace/probe.py")
    jid = stack.submit(entrypoint="probe.py", world_size=1, device="cpu", args=["/data"])
    job = stack.ended(jid)
    log = stack.log(jid)
    assert job["status"] == "succeeded", (job, log)
    assert "PROBE " in log
    for secret in (stack.api_token, stack.worker_token, stack.db_password):
        assert secret not in log
    assert "POSTGRES_" not in log


def test_two_users_jobs_are_walled_from_each_other(stack: Stack, tmp_path: Path) -> None:
    """The compose worker runs each job under a uid of its own: one user's job cannot read
    or change another's directory, checkpoints, token or environment, nor the code cache
    the next job is written from (tests/test_walls.py's attacks, here under compose). The
    victim and the attacker are two users, each with a member token of its own that the
    stack's admin (its API token) makes."""
    from tests.test_walls import assert_walls_held, run_scenario

    log = stack.compose("logs", "worker").stdout
    assert "jobs run walled, each under a uid of its own from 70000-70999" in log, log[-2000:]
    # In the worker's container, where both jobs run; not right under /tmp, whose files of
    # a job's uid the worker removes after the job.
    signal = "/var/lib/ddpq-walls/signal"
    for where, mode in (("/var/lib/ddpq-walls", "0711"), (signal, "1777")):
        stack.compose("exec", "-T", "worker", "install", "-d", "-m", mode, where)
    seen = run_scenario(
        f"http://127.0.0.1:{stack.port}",
        stack.api_token,  # the first admin's: it adds the users "victim" and "attacker"
        tmp_path,
        signal,
        lambda: stack.compose("exec", "-T", "worker", "touch", f"{signal}/attacker-done"),
        hop=True,
    )
    assert_walls_held(seen, range(70000, 71000))


def test_jobs_and_checkpoints_survive_down_and_up(stack: Stack) -> None:
    before = stack.user.get("/jobs").json()["items"]
    first = min(j["id"] for j in before)
    checkpoints = stack.user.get(f"/jobs/{first}/checkpoints").json()["items"]
    stack.compose("down")  # keeps the volumes
    stack.up()
    after = stack.user.get("/jobs").json()["items"]
    assert {(j["id"], j["status"]) for j in after} == {(j["id"], j["status"]) for j in before}
    assert stack.user.get(f"/jobs/{first}/checkpoints").json()["items"] == checkpoints
    newest = checkpoints[-1]["path"]
    stack.compose("exec", "-T", "worker", "test", "-s", newest)


def test_your_own_code_with_a_bind_mount(stack: Stack, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(PROGRAM)
    code.chmod(0o755)
    (code / "train.py").chmod(0o644)
    override = tmp_path / "mine.compose.yml"
    override.write_text(f"services:\n  worker:\n    volumes:\n      - {code}:/workspace/mine:ro\n")
    stack.files.append(override)
    try:
        stack.up()  # recreates the worker with the mount
        jid = stack.submit(entrypoint="mine/train.py", world_size=2, device="cpu")
        job = stack.ended(jid)
        assert job["status"] == "succeeded", (job, stack.log(jid))
        assert "my own program: rank 1 of 2, sum 3" in stack.log(jid)
    finally:
        stack.files.remove(override)


def test_stopping_the_worker_mid_job_hands_it_back_and_it_resumes(stack: Stack) -> None:
    stack.up()
    jid = stack.submit(
        recipe="toy-regression",
        world_size=2,
        device="cpu",
        args=["--total-epochs", "400", "--save-every", "20"],
    )
    stack.until(
        "the job's first checkpoint",
        lambda: stack.user.get(f"/jobs/{jid}/checkpoints").json()["items"],
    )
    stack.compose("stop", "worker")
    job = stack.job(jid)
    assert job["status"] == "queued" and "shut down" in job["reason"], job
    stack.compose("start", "worker")
    stack.until("the second attempt", lambda: stack.job(jid)["attempt"] == 2)
    job = stack.ended(jid, timeout=600)
    assert job["status"] == "succeeded", (job, stack.log(jid))
    attempts = stack.user.get(f"/jobs/{jid}/attempts").json()["items"]
    assert [a["outcome"] for a in attempts] == ["requeued", "succeeded"], attempts
    log = stack.log(jid)
    assert "resuming at epoch" in log, log[-3000:]
    steps = [i["step"] for i in stack.user.get(f"/jobs/{jid}/metrics").json()["items"]]
    assert steps == sorted(set(steps)), "every step kept once"
