"""Training throughput of every built-in recipe at world size 1 and 2, and the scaling ratio.

Each recipe runs directly under ``torchrun --standalone`` (gloo on CPU, no ddpq
service: this measures the recipes, not the queue) with the arguments below,
at ``--nproc-per-node`` 1 and then 2. The per-rank batch stays the same, so world
size 2 takes half the steps per epoch, as in the seeds. The figure is rank 0's
samples/s over all ranks, the median of the epochs after the first (which pays
for warm-up); the ratio is samples/s at 2 over samples/s at 1, each the median
of ``--repeat`` runs, alternating so that load from elsewhere hits both alike.

On a CPU host the ratio compares two single-threaded ranks (torchrun sets
``OMP_NUM_THREADS=1`` when it starts several) with one rank that has all cores
for intra-op threads: above 1, DDP and its all-reduces use the cores better than
one process's threads do.

    .venv/bin/python bench/recipes.py [--recipes mlp-classifier,char-gpt] [--repeat 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import child_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# This file shares its name with the package it measures: let `import recipes` find the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
EPOCH_LINE = re.compile(r"epoch \d+ done \| step \d+ \| [\d.]+ s \| (\d+) samples/s")

# Short runs; the tiny models get more (sub-second) epochs to take a median over.
ARGS = {
    "toy-regression": ["--total-epochs", "6", "--dataset-size", "16384"],
    "mlp-classifier": ["--total-epochs", "10"],
    "resnet-cifar10": [
        *["--data-dir", "{data}", "--data-check", "presence", "--train-samples", "0"],
        *["--test-samples", "64", "--total-epochs", "2", "--batch-size", "64"],
    ],
    "char-gpt": ["--total-epochs", "2", "--stride", "16", "--sample-chars", "0"],
}
MODULES = {
    "toy-regression": "recipes.toy_regression",
    "mlp-classifier": "recipes.mlp_classifier",
    "resnet-cifar10": "recipes.resnet_cifar10",
    "char-gpt": "recipes.char_gpt",
}
CIFAR_TRAIN_IMAGES = 1024


def write_cifar_like(root: Path) -> None:
    """Random images in CIFAR-10's format: throughput does not depend on their content."""
    from recipes.resnet_cifar10 import write_cifar10_format

    rng = np.random.default_rng(0)

    def images(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n)

    write_cifar10_format(root, train=images(CIFAR_TRAIN_IMAGES), test=images(64))


def run(recipe: str, nproc: int, data: Path, out: Path) -> float:
    """Median samples/s of the recipe's epochs after the first, at ``nproc`` ranks."""
    args = [a.replace("{data}", str(data)) for a in ARGS[recipe]]
    r = subprocess.run(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
            *["--nproc-per-node", str(nproc), "-m", MODULES[recipe], *args],
        ],
        cwd=REPO,
        env=child_env(DDPQ_CHECKPOINT_DIR=str(out / f"{recipe}-{nproc}")),
        capture_output=True,
        text=True,
        check=False,
    )
    epochs = EPOCH_LINE.findall(r.stdout)[1:]  # the first epoch pays for warm-up
    if r.returncode != 0 or not epochs:
        raise SystemExit(
            f"{recipe} at {nproc} rank(s) exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        )
    return statistics.median(float(rate) for rate in epochs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default=",".join(ARGS), help="comma-separated recipe names")
    ap.add_argument("--repeat", type=int, default=3, help="runs at each world size (median)")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddpq-bench-recipes-") as tmp:
        data, out = Path(tmp) / "data", Path(tmp) / "out"
        write_cifar_like(data)
        print(f"{'recipe':<16} {'ws=1 samples/s':>15} {'ws=2 samples/s':>15} {'ratio':>6}")
        for name in opts.recipes.split(","):
            t0 = time.perf_counter()
            runs: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(opts.repeat):
                for nproc in runs:
                    runs[nproc].append(run(name, nproc, data, out))
            one, two = (statistics.median(runs[n]) for n in (1, 2))
            spread = "; ".join(
                f"ws={n}: {min(v):.0f}-{max(v):.0f}" for n, v in runs.items() if len(v) > 1
            )
            print(
                f"{name:<16} {one:>15.0f} {two:>15.0f} {two / one:>6.2f}"
                f"   ({time.perf_counter() - t0:.0f} s{'; ' + spread if spread else ''})",
                flush=True,
            )


if __name__ == "__main__":
    main()
