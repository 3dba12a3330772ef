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
from datetime import datetime
from pathlib import Path

import httpx
from _harness import child_env, database, serve

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


def _phases(job: dict) -> str:
    """Queue wait (submit to claim) and run time (claim to end), from the job's own stamps."""
    created, started, finished = (
        datetime.fromisoformat(job[k]) for k in ("created_at", "started_at", "finished_at")
    )
    waited, ran = (started - created).total_seconds(), (finished - started).total_seconds()
    return f"queued {waited:.2f}s, ran {ran:.2f}s"


def run_ddpq(client: httpx.Client, steps: int) -> tuple[float, str]:
    # The end is the job's own finished_at (stamped once its processes are gone), so
    # observing it needs no fast polling, which would itself load the API on 2 cores.
    t0 = time.time()
    job = client.post(
        "/jobs", json={"entrypoint": PROGRAM, "world_size": 2, "args": ["--steps", str(steps)]}
    )
    job.raise_for_status()
    job_id = job.json()["id"]
    while True:
        status = client.get(f"/jobs/{job_id}").json()["status"]
        if status in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.5)
    final = client.get(f"/jobs/{job_id}").json()
    elapsed = datetime.fromisoformat(final["finished_at"]).timestamp() - t0
    if status != "succeeded":
        raise SystemExit(f"job {job_id} {status}: {final['reason']}")
    return elapsed, _phases(final)


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
