"""`make gpu-check`: everything ddpq promises about GPUs, on a host that has them.

This project's machines have no GPU, so CI and `make test` skip it with one line; when a
GPU host is lent, `make gpu-check` runs it in minutes and prints a table to paste into an
issue (tests/gpu/conftest.py). Real parts only: `ddpq serve`, `ddpq worker` finding its
GPUs through NVML, torchrun with NCCL, the recipes, the driver.

What it checks: the inventory (NVML against nvidia-smi, and what the worker registers);
two 1-GPU jobs on different physical GPUs, each seeing cuda:0, and a third waiting with
its reason; each recipe on 2 GPUs learning as it does on the CPU and resuming after its
worker is killed; `device: auto` picking CUDA; NCCL_* reaching the ranks; bf16 only where
the GPU has it, fp16 with loss scaling elsewhere; the DDP tutorial's program and nanoGPT
as jobs, when their checkouts are given (DDPQ_GPU_CHECK_TUTORIAL, DDPQ_GPU_CHECK_NANOGPT);
ranks forked by the warm launcher each making their own CUDA context (issue 34).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server, start_server, stop_server, terminal, wait_for
from tests.gpu.conftest import Table
from worker.edges import nvml

GPUS = nvml.inventory()


def _cuda_in_a_child() -> bool:
    """torch sees CUDA (asked in a child: this process must not hold a CUDA context)."""
    probe = "import torch; print(torch.cuda.is_available())"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return r.stdout.strip() == "True"


if not GPUS or not _cuda_in_a_child():
    pytest.skip(
        "no CUDA device here (NVML sees no GPU): `make gpu-check` runs on a GPU host",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.gpu, pytest.mark.torchrun]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite: what is checked here is the GPUs, not the database (make test does both)."""
    return f"sqlite:///{tmp_path / 'ddpq.db'}"


@pytest.fixture
def lease_server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    """An API that declares a killed worker's attempt lost after 3 s."""
    s = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="3")
    yield s
    stop_server(s)


def needs(n: int) -> None:
    if len(GPUS) < n:
        pytest.skip(f"needs {n} GPUs, this host has {len(GPUS)}")


def submit(server: Server, **spec: Any) -> int:
    r = server.client().post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def logs(server: Server, jid: int) -> str:
    return server.client().get(f"/jobs/{jid}/logs").text


def succeeded(server: Server, jid: int, timeout: float = 600) -> dict[str, Any]:
    job = terminal(server.client(), jid, timeout=timeout)
    assert job["status"] == "succeeded", (job["reason"], logs(server, jid)[-4000:])
    return job


def series(server: Server, jid: int, name: str) -> list[tuple[int, float]]:
    items = server.client().get(f"/jobs/{jid}/metrics").json()["items"]
    return [(m["step"], m["values"][name]) for m in items if name in m["values"]]


# ---- inventory ---------------------------------------------------------------------------


def test_the_worker_finds_every_gpu_with_its_uuid_and_memory(
    server: Server, start_worker: Any, table: Table
) -> None:
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = [line.split(", ") for line in smi.strip().splitlines()]
        assert [(int(i), u) for i, u, _ in rows] == [(g.index, g.uuid) for g in GPUS]
        for (_, _, mib), g in zip(rows, GPUS, strict=True):
            assert abs(int(mib) - g.memory_total / 2**20) <= 1, (mib, g)
    start_worker(server, name="gpu-host", gpus=None)

    def registered() -> dict[str, Any] | None:
        items = server.client().get("/workers").json()["items"]
        return next((w for w in items if w["name"] == "gpu-host"), None)

    worker = wait_for(registered, 60, "the worker to register")
    assert worker["gpus"] == [g.index for g in GPUS]
    for g in GPUS:
        table.add(f"GPU {g.index}", f"{g.name}, {g.memory_total / 2**30:.0f} GiB, {g.uuid}")


# ---- one job's GPUs are its own -----------------------------------------------------------

PROBE = r"""
import json, os, pathlib, sys, time
import torch
out = pathlib.Path(sys.argv[1])
job = os.environ["DDPQ_JOB_ID"]
props = torch.cuda.get_device_properties(0)
seen = {"device": torch.cuda.current_device(), "count": torch.cuda.device_count(),
        "uuid": str(props.uuid), "cvd": os.environ["CUDA_VISIBLE_DEVICES"],
        "nccl_debug": os.environ.get("NCCL_DEBUG")}
(out / f"job{job}.json").write_text(json.dumps(seen))
deadline = time.time() + 300
while not (out / f"release-{job}").exists() and time.time() < deadline:
    time.sleep(0.05)
"""


def test_two_one_gpu_jobs_are_on_different_gpus_each_as_cuda_0_and_a_third_waits(
    server: Server, start_worker: Any, tmp_path: Path, table: Table
) -> None:
    needs(2)
    worker = start_worker(server, gpus="0,1")
    (worker.workspace / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o777)  # a walled job runs under a uid of its own
    spec = {"entrypoint": "probe.py", "args": [str(out)], "device": "cuda", "world_size": 1}
    a, b, c = (submit(server, **spec) for _ in range(3))

    def seen(jid: int) -> dict[str, Any] | None:
        f = out / f"job{jid}.json"
        return json.loads(f.read_text()) if f.exists() else None

    sa = wait_for(lambda: seen(a), 120, "job A's probe")
    sb = wait_for(lambda: seen(b), 120, "job B's probe")
    assert sa["device"] == sb["device"] == 0 and sa["count"] == sb["count"] == 1
    assert sa["uuid"] != sb["uuid"], "two jobs on one physical GPU"
    by_index = {g.index: g.uuid.removeprefix("GPU-") for g in GPUS}
    for jid, s in ((a, sa), (b, sb)):
        held = server.client().get(f"/jobs/{jid}").json()["gpus"]
        assert s["uuid"].removeprefix("GPU-") == by_index[held[0]], (held, s)
    reason = server.client().get(f"/jobs/{c}").json()["reason"]
    assert reason.startswith("waiting for 1 GPU") and "most free on one worker is 0" in reason
    for jid in (a, b, c):
        (out / f"release-{jid}").touch()
    for jid in (a, b, c):
        succeeded(server, jid)
    table.add("job A / job B", f"cuda:0 on {sa['uuid'][:13]}… / cuda:0 on {sb['uuid'][:13]}…")
    table.add("third job", reason)


def test_device_auto_picks_cuda_and_nccl_settings_reach_the_ranks(
    server: Server, start_worker: Any, tmp_path: Path, table: Table
) -> None:
    worker = start_worker(server, gpus=None)
    (worker.workspace / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o777)
    jid = submit(
        server,
        entrypoint="probe.py",
        args=[str(out)],
        device="auto",
        env={"NCCL_DEBUG": "INFO"},
    )
    seen = wait_for(lambda: (out / f"job{jid}.json").exists(), 120, "the probe")
    assert seen
    record = json.loads((out / f"job{jid}.json").read_text())
    (out / f"release-{jid}").touch()
    job = succeeded(server, jid)
    assert job["gpus"] and record["count"] == len(job["gpus"]), (job["gpus"], record)
    assert record["nccl_debug"] == "INFO"
    table.add("device: auto", f"{len(job['gpus'])} GPU(s), NCCL_DEBUG passed through")


# ---- the recipes learn on GPUs, and resume after a kill -----------------------------------

RECIPES: dict[str, dict[str, Any]] = {
    # The same runs and thresholds as tests/test_recipes.py's CPU checks.
    "toy-regression": {"args": ["--total-epochs", "20", "--save-every", "5"], "drop": 2},
    "mlp-classifier": {"args": ["--total-epochs", "20", "--save-every", "5"], "drop": 4},
    "char-gpt": {
        "args": [
            "--block-size",
            "32",
            "--stride",
            "6",
            "--lr",
            "0.006",
            "--n-embd",
            "96",
            "--sample-chars",
            "80",
            "--total-epochs",
            "4",
            "--save-every",
            "1",
            "--log-every",
            "5",
        ],
        "drop": 2,
    },
    "resnet-cifar10": {
        "args": [
            "--data-dir",
            "data",
            "--data-check",
            "presence",
            "--batch-size",
            "16",
            "--lr",
            "0.01",
            "--log-every",
            "2",
            "--total-epochs",
            "3",
            "--save-every",
            "1",
        ],
        "drop": 1,
    },
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_learns_on_two_gpus_with_nccl_and_resumes_after_a_kill(
    recipe: str, lease_server: Server, start_worker: Any, table: Table
) -> None:
    needs(2)
    server = lease_server
    a = start_worker(server, name="a", gpus="0,1")
    if recipe == "resnet-cifar10":
        import numpy as np

        from recipes.resnet_cifar10 import write_cifar10_format
        from tests.test_recipes import _cifar_like

        rng = np.random.default_rng(0)
        data = (_cifar_like(320, rng), _cifar_like(80, rng))
        write_cifar10_format(a.workspace / "data", train=data[0], test=data[1])
    jid = submit(server, recipe=recipe, world_size=2, device="cuda", args=RECIPES[recipe]["args"])

    def checkpointed() -> bool:
        return bool(server.client().get(f"/jobs/{jid}/checkpoints").json()["items"])

    wait_for(checkpointed, 600, "the first checkpoint")
    a.proc.kill()  # kill -9: no chance to hand anything back
    a.proc.wait()
    b = start_worker(server, name="b", gpus="0,1")
    if recipe == "resnet-cifar10":
        shutil.copytree(a.workspace / "data", b.workspace / "data")
    job = succeeded(server, jid)
    log = logs(server, jid)
    assert job["attempt"] == 2 and job["worker"] == "b", job
    assert "resuming at epoch" in log, log[-3000:]
    bf16 = _bf16_here()
    precision = "bf16" if bf16 else "fp16"
    assert f"device cuda, precision {precision}" in log, "bf16 only where the GPU has it"
    loss = series(server, jid, "loss")
    drop = RECIPES[recipe]["drop"]
    assert loss[-1][1] <= loss[0][1] / drop, loss
    if recipe == "mlp-classifier":
        assert job["latest_metrics"]["values"]["test_accuracy"] >= 0.90
    table.add(recipe, f"{precision}, loss {loss[0][1]:.3g} → {loss[-1][1]:.3g}, resumed")


def _bf16_here() -> bool:
    probe = "import torch; print(torch.cuda.is_bf16_supported())"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return r.stdout.strip() == "True"


# ---- the warm launcher (issue 34) on GPUs --------------------------------------------------

WARM_PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
# Forked from a warm process that must never have touched CUDA: a fork cannot use a CUDA
# context its parent made.
before = torch.cuda.is_initialized()
# torchrun's own module, which only a rank forked from the warm process has at its start.
forked = "torch.distributed.run" in sys.modules
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
out = {"before": before, "device": torch.cuda.current_device(), "sum": t.item(),
       "forked": forked}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_the_warm_launcher_forks_ranks_that_each_make_their_own_cuda_context(
    server: Server, start_worker: Any, tmp_path: Path, table: Table
) -> None:
    needs(2)
    worker = start_worker(server, gpus="0,1")
    (worker.workspace / "warm_probe.py").write_text(WARM_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o777)
    jid = submit(
        server,
        entrypoint="warm_probe.py",
        args=[str(out)],
        device="cuda",
        world_size=2,
        launcher="warm",
    )
    succeeded(server, jid)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["forked"] for r in ranks] == [True, True], ranks
    assert [r["before"] for r in ranks] == [False, False], ranks  # CUDA not inherited
    assert sorted(r["device"] for r in ranks) == [0, 1], ranks
    assert [r["sum"] for r in ranks] == [3.0, 3.0], ranks  # NCCL all-reduce across them
    table.add("warm launcher", "2 ranks forked, each its own CUDA context, NCCL all-reduce")


# ---- the seeds' own programs, unmodified ---------------------------------------------------


def test_the_ddp_tutorials_program_runs_unmodified(
    server: Server, start_worker: Any, table: Table
) -> None:
    """pytorch/examples' distributed/ddp-tutorial-series: `multigpu_torchrun.py 50 10`."""
    where = os.environ.get("DDPQ_GPU_CHECK_TUTORIAL")
    if not where:
        pytest.skip("set DDPQ_GPU_CHECK_TUTORIAL to a checkout of ddp-tutorial-series")
    needs(2)
    worker = start_worker(server, gpus="0,1")
    for f in Path(where).glob("*.py"):
        shutil.copy(f, worker.workspace / f.name)
    jid = submit(
        server,
        entrypoint="multigpu_torchrun.py",
        args=["50", "10"],
        world_size=2,
        device="cuda",
    )
    succeeded(server, jid)
    assert "Training snapshot saved" in logs(server, jid)
    table.add("multigpu_torchrun.py", "ran as a job on 2 GPUs")


def test_nanogpt_trains_as_a_job(server: Server, start_worker: Any, table: Table) -> None:
    """karpathy/nanoGPT's train.py with a tiny config, on its shakespeare_char data."""
    where = os.environ.get("DDPQ_GPU_CHECK_NANOGPT")
    if not where:
        pytest.skip("set DDPQ_GPU_CHECK_NANOGPT to a nanoGPT checkout with data prepared")
    needs(2)
    worker = start_worker(server, gpus="0,1")
    shutil.copytree(where, worker.workspace / "nanoGPT", dirs_exist_ok=True)
    tiny = ["config/train_shakespeare_char.py", "--max_iters=200", "--eval_interval=100"]
    tiny += ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--compile=False"]
    jid = submit(server, entrypoint="nanoGPT/train.py", args=tiny, world_size=2, device="cuda")
    job = succeeded(server, jid)
    assert "iter 190" in logs(server, jid)
    table.add("nanoGPT train.py", f"200 iterations on 2 GPUs, attempt {job['attempt']}")
