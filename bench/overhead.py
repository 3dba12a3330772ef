"""What running through ddpq costs over running torchrun by hand.

The same plain DDP program (examples/ddp_plain.py, world size 2, gloo on CPU,
about 20 s of training) is run directly with ``torchrun --standalone`` and
through ddpq (from POST /jobs until the job's finished_at), alternating,
PAIRS pairs after one warm-up of each. Prints each pair and the median ratio
ddpq / torchrun (goal: <= 1.05).

    .venv/bin/python bench/overhead.py [--pairs 3] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _harness import child_env, database, phases, run_job, serve

REPO = Path(__file__).resolve().parent.parent
PROGRAM = "examples/ddp_plain.py"


def run_direct(steps: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            PROGRAM,
            "--steps",
            str(steps),
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def run_ddpq(client: httpx.Client, steps: int) -> tuple[float, str]:
    spec = {"entrypoint": PROGRAM, "world_size": 2, "args": ["--steps", str(steps)]}
    elapsed, final = run_job(client, spec)
    if final["status"] != "succeeded":
        raise SystemExit(f"job {final['id']} {final['status']}: {final['reason']}")
    return elapsed, phases(final)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=4500, help="training steps (about 20 s on 2 cores)"
    )
    args = ap.parse_args()

    with database("sqlite") as url, serve(url) as api:
        env = child_env(DDPQ_WORKER_TOKEN=api.worker_token)
        worker = subprocess.Popen(
            [
                *[sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url],
                *["--workspace", str(REPO), "--name", "bench", "--gpus", "none"],
                *["--data-dir", str(api.data_dir / "worker"), "--cpu-slots", "2"],
                *["--log-level", "warning"],
            ],
            env=env,
            cwd=api.data_dir,
        )
        client = api.client()
        try:
            direct = run_direct(args.steps)
            through, phases = run_ddpq(client, args.steps)
            print(f"warm-up: torchrun {direct:.2f}s, ddpq {through:.2f}s ({phases})")
            ratios = []
            for i in range(args.pairs):
                direct = run_direct(args.steps)
                through, phases = run_ddpq(client, args.steps)
                ratios.append(through / direct)
                print(
                    f"pair {i + 1}: torchrun {direct:.2f}s, ddpq {through:.2f}s ({phases}), "
                    f"ratio {through / direct:.3f}"
                )
            print(
                f"median ratio ddpq/torchrun: {statistics.median(ratios):.3f} "
                f"over {args.pairs} pairs"
            )
        finally:
            client.close()
            worker.terminate()
            worker.wait(timeout=60)


if __name__ == "__main__":
    main()
