"""The built-in recipes: each learns, resumes where its checkpoint left off, and refuses
bad arguments with its own message as the job's reason.

Jobs go through a real `ddpq serve` and `ddpq worker` (torchrun, gloo on CPU, world
size 2). The resume halves run the recipe under torchrun directly, with
``DDPQ_RESUME_FROM`` pointing at a checkpoint the job saved, as the worker does for
a job's next attempt. Recipes exercise torchrun and the models, not the database,
so these run on SQLite only.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO, Server, _child_env, _sqlite_copy, terminal

CATALOG = REPO / "recipes" / "catalog.json"
RECIPES = ["toy-regression", "mlp-classifier", "resnet-cifar10", "char-gpt"]
LOSS_LINE = re.compile(r"epoch \d+ \| step (\d+) \| loss ([\d.e+-]+)")


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _sqlite_copy(request, tmp_path / "ddpq.db")


def _catalog() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(CATALOG.read_text())
    return data


def _run_job(server: Server, recipe: str, args: list[str], timeout: float = 240) -> dict[str, Any]:
    c = server.client()
    r = c.post("/jobs", json={"recipe": recipe, "world_size": 2, "args": args})
    assert r.status_code == 201, r.text
    return terminal(c, r.json()["id"], timeout=timeout)


def _succeeded(server: Server, job: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The job's metric series and checkpoints, once it is known to have succeeded."""
    c = server.client()
    log = c.get(f"/jobs/{job['id']}/logs").text
    assert job["status"] == "succeeded", f"{job['status']}: {job['reason']}\n{log[-3000:]}"
    metrics = c.get(f"/jobs/{job['id']}/metrics").json()["items"]
    checkpoints = c.get(f"/jobs/{job['id']}/checkpoints").json()["items"]
    return metrics, checkpoints


def _series(metrics: list[dict], name: str) -> list[tuple[int, float]]:
    return [(m["step"], m["values"][name]) for m in metrics if name in m["values"]]


def _load(path: Path | str) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def _torchrun(module: str, args: list[str], cwd: Path, out: Path, **env: str) -> str:
    """Run ``module`` under torchrun (2 ranks, no ddpq service), checkpoints into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
            *["--nproc-per-node", "2", "--monitor-interval", "0.1", "-m", module, *args],
        ],
        env=_child_env({"DDPQ_CHECKPOINT_DIR": str(out), **env}),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _resume(
    module: str, checkpoint: str, args: list[str], cwd: Path, out: Path
) -> tuple[str, dict[str, Any]]:
    """Run ``module`` from ``checkpoint``; its output and the last checkpoint it saved."""
    stdout = _torchrun(module, args, cwd, out, DDPQ_RESUME_FROM=checkpoint)
    saved = sorted(out.glob("step-*.pt"))
    assert saved, stdout
    return stdout, _load(saved[-1])


def _assert_resumed(stdout: str, before: dict[str, Any], after: dict[str, Any]) -> None:
    """The resumed run started at the next epoch and step, and went on for one epoch."""
    epoch, step = before["epoch"], before["step"]
    assert f"resuming at epoch {epoch + 1}, step {step}" in stdout, stdout
    assert after["epoch"] == epoch + 1
    assert after["step"] == step + step // (epoch + 1), "one more epoch of steps, counted on"
    assert after["config"]["total_epochs"] == epoch + 2
    assert set(after) >= {"model", "optimizer", "epoch", "step", "config"}


def _first_loss_after(stdout: str, step: int) -> float:
    return next(float(m[2]) for m in LOSS_LINE.finditer(stdout) if int(m[1]) > step)


# ---- no torchrun --------------------------------------------------------------------


def test_every_recipe_documents_its_torchrun_and_ddpq_commands() -> None:
    catalog = _catalog()
    assert sorted(catalog) == sorted(RECIPES)
    for name, entry in catalog.items():
        spec = importlib.util.find_spec(entry["module"])
        assert spec is not None and spec.origin is not None, name
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
        assert f"torchrun --standalone --nproc-per-node 2 -m {entry['module']}" in doc, name
        assert f"ddpq submit --recipe {name} --world-size 2" in doc, name


BAD_ARGS = [
    ("toy-regression", ["--total-epochs", "0"], "argument --total-epochs: must be at least 1"),
    ("mlp-classifier", ["--lr", "-1"], "argument --lr: must be at least 0, got -1.0"),
    ("mlp-classifier", ["--test-fraction", "0.9"], "argument --test-fraction: must be at most 0.5"),
    ("resnet-cifar10", ["--arch", "resnet34"], "argument --arch: invalid choice: 'resnet34'"),
    ("resnet-cifar10", ["--data-check", "presence", "--data-dir", "{empty}"], "lacks data_batch_1"),
    ("char-gpt", ["--n-embd", "100", "--n-head", "3"], "100 is not a multiple of --n-head 3"),
    ("char-gpt", ["--text", "{empty}/nope.txt"], "argument --text: no such file"),
    ("char-gpt", ["--block-size", "4096"], "too short for --block-size 4096"),
]


@pytest.mark.parametrize(("recipe", "argv", "message"), BAD_ARGS)
def test_a_bad_argument_stops_the_recipe_before_it_joins_the_group(
    recipe: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No RANK: a recipe that got past its checks would start a world of one, not hang.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    module = importlib.import_module(_catalog()[recipe]["module"])
    with pytest.raises(SystemExit) as exit_info:
        module.main([a.replace("{empty}", str(tmp_path)) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{recipe}: error: " in err and message in err, err


def test_recipes_are_listed_with_their_rules(server: Server) -> None:
    items = {r["name"]: r for r in server.client().get("/recipes").json()["items"]}
    assert sorted(items) == sorted(RECIPES)
    arch = next(a for a in items["resnet-cifar10"]["args"] if a["name"] == "--arch")
    assert arch["choices"] == ["resnet18", "resnet50"] and arch["default"] == "resnet18"
    lr = next(a for a in items["mlp-classifier"]["args"] if a["name"] == "--lr")
    assert lr["min"] == 0 and lr["max"] is None and lr["type"] == "float"


# ---- through ddpq, then resumed ------------------------------------------------------


@pytest.mark.torchrun
@pytest.mark.learning
def test_mlp_classifier_learns_the_digits_and_resumes(
    server: Server, start_worker, tmp_path: Path
) -> None:
    worker = start_worker(server)
    job = _run_job(server, "mlp-classifier", ["--total-epochs", "20", "--save-every", "10"])
    metrics, checkpoints = _succeeded(server, job)

    latest = job["latest_metrics"]["values"]
    assert latest["test_accuracy"] >= 0.90, latest
    loss, accuracy = _series(metrics, "loss"), _series(metrics, "accuracy")
    assert loss[-1][1] < loss[0][1] / 4 and accuracy[-1][1] > 0.9, (loss, accuracy)
    assert all(v > 0 for _, v in _series(metrics, "samples_per_s"))
    # 1438 training images / (32 per rank x 2 ranks) = 23 steps an epoch, 20 epochs.
    assert [ck["step"] for ck in checkpoints] == [230, 460]
    # Every 10 steps (--log-every) and at each epoch's end, never every step.
    assert {s for s, _ in loss} == {s for s in range(1, 461) if s % 10 == 0 or s % 23 == 0}

    before = _load(checkpoints[-1]["path"])
    assert before["epoch"] == 19 and before["config"]["lr"] == 0.1
    stdout, after = _resume(
        "recipes.mlp_classifier",
        checkpoints[-1]["path"],
        ["--total-epochs", "21", "--save-every", "10"],
        worker.workspace,
        tmp_path / "resumed",
    )
    _assert_resumed(stdout, before, after)
    assert _first_loss_after(stdout, 460) < loss[0][1] / 4, "the weights came back too"
    assert "test_accuracy" in stdout


@pytest.mark.torchrun
@pytest.mark.learning
def test_char_gpt_loss_at_least_halves_and_resumes(
    server: Server, start_worker, tmp_path: Path
) -> None:
    worker = start_worker(server)
    small = ["--block-size", "32", "--stride", "6", "--lr", "0.006", "--n-embd", "96"]
    small += ["--sample-chars", "80"]
    job = _run_job(
        server, "char-gpt", [*small, "--total-epochs", "4", "--save-every", "2", "--log-every", "5"]
    )
    metrics, checkpoints = _succeeded(server, job)

    loss = _series(metrics, "loss")
    assert loss[0][0] == 5 and loss[-1][1] <= loss[0][1] / 2, loss
    val = _series(metrics, "val_loss")
    assert len(val) == 4 and val[-1][1] < val[0][1], val
    log = server.client().get(f"/jobs/{job['id']}/logs").text
    assert "[rank0]: sample:" in log and "[rank1]: sample:" not in log

    before = _load(checkpoints[-1]["path"])
    assert before["epoch"] == 3 and isinstance(before["vocab"], str)
    stdout, after = _resume(
        "recipes.char_gpt",
        checkpoints[-1]["path"],
        [*small, "--total-epochs", "5", "--save-every", "2", "--log-every", "5"],
        worker.workspace,
        tmp_path / "resumed",
    )
    _assert_resumed(stdout, before, after)
    assert _first_loss_after(stdout, before["step"]) <= loss[0][1] / 2, "the weights came back too"


def _cifar_like(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Images whose class shows in their colour, so there is something to learn."""
    labels = rng.integers(0, 10, n)
    colour = np.stack([labels * 25, 255 - labels * 25, (labels % 3) * 120], axis=1)
    noise = rng.normal(0, 30, (n, 32, 32, 3))
    return np.clip(colour[:, None, None, :] + noise, 0, 255).astype(np.uint8), labels


@pytest.mark.torchrun
@pytest.mark.learning
def test_resnet_cifar10_reads_cifar_format_data_and_resumes(
    server: Server, start_worker, tmp_path: Path
) -> None:
    from recipes.resnet_cifar10 import write_cifar10_format

    worker = start_worker(server)
    rng = np.random.default_rng(0)
    write_cifar10_format(
        worker.workspace / "data", train=_cifar_like(160, rng), test=_cifar_like(40, rng)
    )
    args = ["--data-dir", "data", "--data-check", "presence", "--batch-size", "16"]
    args += ["--lr", "0.01", "--log-every", "2"]
    job = _run_job(server, "resnet-cifar10", [*args, "--total-epochs", "1"])
    metrics, checkpoints = _succeeded(server, job)

    # 160 images / (16 per rank x 2 ranks) = 5 steps.
    assert [s for s, _ in _series(metrics, "loss")] == [2, 4, 5]
    for name in ("accuracy", "samples_per_s", "epoch_time_s", "test_accuracy"):
        assert all(v >= 0 for _, v in _series(metrics, name)) and _series(metrics, name), name
    assert 0 <= job["latest_metrics"]["values"]["test_accuracy"] <= 1
    assert [ck["step"] for ck in checkpoints] == [5]

    before = _load(checkpoints[0]["path"])
    assert before["config"]["arch"] == "resnet18"
    stdout, after = _resume(
        "recipes.resnet_cifar10",
        checkpoints[0]["path"],
        [*args, "--total-epochs", "2"],
        worker.workspace,
        tmp_path / "resumed",
    )
    _assert_resumed(stdout, before, after)


@pytest.mark.torchrun
def test_toy_regression_resumes_and_continues_its_step_count(tmp_path: Path) -> None:
    args = ["--save-every", "1", "--dataset-size", "512"]
    first = tmp_path / "first"
    _torchrun("recipes.toy_regression", [*args, "--total-epochs", "1"], tmp_path, first)
    checkpoint = first / "step-000000008.pt"  # 512 / (32 x 2) steps
    stdout, after = _resume(
        "recipes.toy_regression",
        str(checkpoint),
        [*args, "--total-epochs", "2"],
        tmp_path,
        tmp_path / "resumed",
    )
    _assert_resumed(stdout, _load(checkpoint), after)


@pytest.mark.torchrun
def test_bad_arguments_fail_the_job_with_the_recipes_own_reason(
    server: Server, start_worker
) -> None:
    start_worker(server)
    c = server.client()
    bad = {
        "mlp-classifier": (["--lr", "-1"], "argument --lr: must be at least 0, got -1.0"),
        "resnet-cifar10": (
            ["--data-check", "presence", "--data-dir", "nowhere"],
            "argument --data-dir: nowhere/cifar-10-batches-py lacks data_batch_1",
        ),
    }
    ids = {
        recipe: c.post("/jobs", json={"recipe": recipe, "world_size": 2, "args": argv}).json()["id"]
        for recipe, (argv, _) in bad.items()
    }
    for recipe, job_id in ids.items():
        final = terminal(c, job_id, timeout=120)
        assert final["status"] == "failed" and final["exit_code"] == 2, final
        # The rank that failed first, then its error (issue 30).
        first = r"exited with code 2: rank (\d) \(local rank \1\) failed first: "
        assert re.match(first + re.escape(f"{recipe}: error: "), final["reason"]), final
        assert bad[recipe][1] in final["reason"], final


@pytest.mark.parametrize(
    ("cuda", "bf16", "chosen"),
    [(True, True, "bf16"), (True, False, "fp16"), (False, False, "fp32"), (False, True, "fp32")],
)
def test_precision_is_bf16_only_where_the_gpu_has_it_else_fp16_with_a_scaler(
    cuda: bool, bf16: bool, chosen: str
) -> None:
    """V100s and T4s (no bf16) train in fp16 with loss scaling, as is standard there; the
    real GPUs are checked by `make gpu-check`."""
    import torch

    from recipes._common import Dist, choose_precision

    assert choose_precision(cuda, bf16) == chosen
    if not cuda:  # this machine's device: no autocast, and no loss scaling outside fp16
        env = Dist(0, 0, 1, torch.device("cpu"), chosen)
        assert not env.grad_scaler().is_enabled()
        assert not isinstance(env.autocast(), torch.autocast)


def test_a_scaled_fp16_step_unscales_before_clipping_and_skips_an_overflow() -> None:
    """The Trainer's step with a live scaler (fp16's path) on the CPU: clipping sees the
    true gradients, and a step whose gradients overflowed leaves the weights as they were."""
    import torch
    from torch import nn

    from recipes._common import Trainer

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    host = type("Host", (), {})()
    host.model, host.optimizer, host.scaler, host.grad_clip = model, opt, scaler, 1.0
    host.lr_at, host.step = None, 0

    def weights() -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    start = weights()
    scaler.scale(model(torch.ones(1, 2)).sum() * 1e3).backward()
    Trainer._optimizer_step(host)  # type: ignore[arg-type]
    # Clipped to norm 1 after unscaling, the step is lr * 1; clipping the scaled gradients
    # and unscaling after would have moved the weights 1024 times less.
    moved = float((weights() - start).norm())
    assert host.step == 1 and abs(moved - 0.1) < 1e-4, moved
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    Trainer._optimizer_step(host)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() < 2.0**10, "an overflow halves the scale"
