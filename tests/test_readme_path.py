"""A newcomer's path through the README, with the README's own commands, in its order, from
a home and a project directory outside the checkout: `make run`, the first recipe job,
log in, their own project (its data left out, then given by path), following it, curl.

The commands are read from README.md's code blocks, not copied here: a README edit that
breaks the path breaks this test. Only what a test must change is changed: the API's
port (a free one, not 8000), `ddpq` as this checkout's CLI, and the data path.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    _child_env,
    free_port,
    run_ddpq,
    stop_process,
    up_argv,
    wait_for,
)

README = (REPO / "README.md").read_text()

# The newcomer's project: a CSV of y = 3x + 1 (+ noise) in data/ (which .gitignore keeps
# home), a program that fits it with DDP on gloo, reports its loss and checkpoints.
TRAIN = """
import argparse, os
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import ddpq

p = argparse.ArgumentParser()
p.add_argument("--data", default="data")
p.add_argument("--epochs", type=int, default=20)
args = p.parse_args()
rows = [l.split(",") for l in open(os.path.join(args.data, "train.csv")).read().split()]
x = torch.tensor([[float(a)] for a, _ in rows])
y = torch.tensor([[float(b)] for _, b in rows])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
state = ddpq.load_checkpoint()
if state is not None:
    model.module.load_state_dict(state["model"])
    start = state["epoch"] + 1
elif os.path.exists("out/state.pt"):  # the tutorial's way: its own file in its directory
    state = torch.load("out/state.pt", weights_only=True)
    model.module.load_state_dict(state["model"])
    start = state["epoch"] + 1
for epoch in range(start, args.epochs):
    loss = torch.nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
    opt.zero_grad()
    loss.backward()
    opt.step()
    ddpq.report(epoch, loss=loss.detach(), epoch=epoch, total_steps=args.epochs)
    if rank == 0 and epoch % 5 == 4:
        ddpq.save_checkpoint({"model": model.module.state_dict(), "epoch": epoch}, step=epoch)
if rank == 0:
    os.makedirs("out", exist_ok=True)
    open("out/weights.txt", "w").write(str(model.module.weight.item()))
    torch.save({"model": model.module.state_dict(), "epoch": args.epochs - 1}, "out/state.pt")
dist.destroy_process_group()
"""


def section(title: str) -> str:
    """The README's text under a `## title` heading, to the next one."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, flags=re.M | re.S)
    assert match, f"the README has no section {title!r}"
    return match.group(1)


def blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)


def commands(block: str) -> list[str]:
    """A block's commands: comment lines and trailing comments (two spaces, then #) go."""
    out = []
    for line in block.splitlines():
        line = re.split(r"\s{2,}#", line)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


@dataclass
class Newcomer:
    home: Path
    url: str
    var: Path  # where `make run` keeps its state (the checkout's ./var)

    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "XDG_CONFIG_HOME": str(self.home / ".config")}

    def ddpq(
        self, line: str, cwd: Path | None = None, input: str | None = None, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        """A README command line: `ddpq ...` (or `.venv/bin/ddpq ...`), as the newcomer
        types it, with the README's URL swapped for this API's."""
        argv = shlex.split(line.replace("http://127.0.0.1:8000", self.url))
        assert argv[0] in ("ddpq", ".venv/bin/ddpq"), line
        r = run_ddpq(*argv[1:], env=self.env(), cwd=cwd or self.home, input=input, timeout=timeout)
        assert "Traceback" not in r.stderr, (line, r.stderr)
        return r


@pytest.fixture
def newcomer(tmp_path: Path) -> Iterator[Newcomer]:
    """`make run`: the Makefile's run target is `ddpq up`, started here as the README says,
    on a free port, its ./var in a directory of its own."""
    assert re.search(r"^run: venv\n\t\$\(BIN\)/ddpq up\n", (REPO / "Makefile").read_text(), re.M)
    home = tmp_path / "home"
    home.mkdir()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    port = free_port()
    log = tmp_path / "up.log"
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            up_argv(port, "--cpu-slots", "2"),
            env=_child_env({**env, "DDPQ_DATA_DIR": str(checkout / "var")}),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=checkout,
        )
    try:
        wait_for(lambda: "ddpq is up" in log.read_text(), 90, "`make run`'s banner")
        yield Newcomer(home, f"http://127.0.0.1:{port}", checkout / "var")
    finally:
        stop_process(proc)


def my_model(root: Path) -> Path:
    """The newcomer's project, laid out as the README's step 2 shows it."""
    root.mkdir(parents=True)
    (root / "train.py").write_text(TRAIN)
    (root / "requirements.txt").write_text("pyyaml\n")  # the worker has it: nothing is built
    (root / ".gitignore").write_text("data/\nout/\n")
    (root / "data").mkdir()
    rows = [f"{x / 10:.2f},{3 * x / 10 + 1:.2f}" for x in range(-20, 20)]
    (root / "data" / "train.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.mark.long  # the README's whole path: about 35 s (make test-long)
@pytest.mark.torchrun
def test_the_readme_path_from_make_run_to_your_own_project_learning(
    newcomer: Newcomer, tmp_path: Path
) -> None:
    # Set up: the first job, from the README's block after `make run`.
    (first,) = [c for c in commands(blocks(section("Set up: `make run` and `make test`"))[0])
                if "ddpq" in c]  # fmt: skip
    r = newcomer.ddpq(first)
    assert r.returncode == 0, (first, r.stdout, r.stderr)

    # 1. Log in: `make run` logged this machine in; whoami and users add work as shown.
    step1 = commands(blocks(section("Your own project in five minutes"))[0])
    login, whoami, add = step1
    token = (newcomer.var / "api-token").read_text().strip()
    r = newcomer.ddpq(login + " --token-stdin", input=token + "\n")  # no terminal here
    assert r.returncode == 0, r.stderr
    r = newcomer.ddpq(whoami)
    assert r.returncode == 0 and r.stdout.startswith("admin (admin) at http://127.0.0.1:"), r.stdout
    r = newcomer.ddpq(add)
    assert r.returncode == 0 and re.search(r"ddpqu_[A-Za-z0-9_-]{43}", r.stdout), r.stdout

    # 2. Submit from the project's directory: data/ stays home, and the README's lines say so.
    shown = blocks(section("Your own project in five minutes"))[1]
    typed, *said = shown.splitlines()
    cd, submit = typed.removeprefix("$ ").split(" && ")
    project = my_model(newcomer.home / cd.removeprefix("cd ~/"))
    r = newcomer.ddpq(submit, cwd=project)
    assert r.returncode == 0, r.stderr
    assert re.match(r"code: \d+ files, .* · job (\d+) queued \(train\.py, world size 2\)", r.stdout)
    assert said[0].startswith("code: ") and said[1].startswith("  left out: data/ (")
    assert r.stdout.splitlines()[1].startswith("  left out: data/ ("), r.stdout
    assert "warning: train.py names data/, which was left out" in r.stderr, r.stderr
    assert said[2].split(":")[0] == "warning"
    left_home = int(re.search(r"job (\d+) queued", r.stdout)[1])
    r = newcomer.ddpq(f"ddpq watch {left_home}")
    assert r.returncode == 4, "the job looks for data/ in its own directory, and fails"
    logs = newcomer.ddpq(f"ddpq logs {left_home}").stdout
    assert "FileNotFoundError" in logs and "data/train.csv" in logs, logs

    # 3. Put the data where the job can see it, and pass the path.
    step3 = re.search(r"and pass\nthe path: `(ddpq submit [^`]+)`", README)
    assert step3, "the README's step 3 command"
    data = tmp_path / "srv-data" / "my-model"
    data.mkdir(parents=True)
    (data / "train.csv").write_text((project / "data" / "train.csv").read_text())
    data.chmod(0o755)
    r = newcomer.ddpq(step3[1].replace("/srv/data/my-model", str(data)), cwd=project)
    assert r.returncode == 0, r.stderr
    assert "(0 new, 0 B sent)" in r.stdout, "re-submitting sends only what changed"
    job = int(re.search(r"job (\d+) queued", r.stdout)[1])

    # 6. Follow it: watch ends with the job (0: succeeded); logs carry the rank prefixes.
    r = newcomer.ddpq(f"ddpq watch {job}")
    assert r.returncode == 0, (r.stdout, newcomer.ddpq(f"ddpq logs {job}").stdout)
    logs = newcomer.ddpq(f"ddpq logs {job}").stdout
    assert "[ddpq]" in logs and "no environment built" in logs, logs
    shown_job = newcomer.ddpq(f"ddpq status {job} --json").stdout
    assert '"status": "succeeded"' in shown_job
    import httpx

    with httpx.Client(base_url=newcomer.url, headers={"Authorization": f"Bearer {token}"}) as c:
        losses = [p["values"]["loss"] for p in c.get(f"/jobs/{job}/metrics").json()["items"]]
        assert len(losses) == 20 and losses[-1] < losses[0] / 4, losses
        assert c.get(f"/jobs/{job}/checkpoints").json()["items"], "it checkpointed"
    assert newcomer.ddpq("ddpq ls").returncode == 0

    # 7. Keep what it wrote, and go on from it: the README's block, job 1 being this one.
    step7 = commands(
        next(b for b in blocks(section("Your own project in five minutes")) if "outputs" in b)
    )
    outputs, download, resume = (re.sub(r"\b1\b", str(job), line) for line in step7)
    r = newcomer.ddpq(outputs, cwd=project)
    assert r.returncode == 0 and "out/weights.txt" in r.stdout and "out/state.pt" in r.stdout
    assert "train.py" not in r.stdout, "outputs are what it wrote, not what was sent"
    r = newcomer.ddpq(download, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    fetched = tmp_path / f"results-{job}" / "out" / "weights.txt"
    assert abs(float(fetched.read_text()) - 3.0) < 0.5, "the fitted slope, y = 3x + 1"
    r = newcomer.ddpq(f"{resume} -- --data {data} --epochs 30", cwd=project)
    assert r.returncode == 0, r.stderr
    assert f"resuming in a copy of job {job}'s directory" in r.stdout + r.stderr
    again = int(re.search(r"job (\d+) queued", r.stdout)[1])
    assert newcomer.ddpq(f"ddpq watch {again}").returncode == 0
    with httpx.Client(base_url=newcomer.url, headers={"Authorization": f"Bearer {token}"}) as c:
        steps = [p["step"] for p in c.get(f"/jobs/{again}/metrics").json()["items"]]
    assert steps == list(range(20, 30)), "it went on from epoch 20, not from the start"

    # Submitting with curl: the README's block, run by a shell from `make run`'s directory.
    curl = next(b for b in blocks(section("Submitting: the CLI and curl")) if "curl" in b)
    script = "set -e\n" + curl.replace("http://127.0.0.1:8000", newcomer.url)
    script = script.replace("curl -sN", "curl -sN --max-time 60")
    r = subprocess.run(
        ["bash", "-c", script],
        cwd=newcomer.var.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env({}),
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert '"recipe":"toy-regression"' in r.stdout.replace(" ", ""), r.stdout
