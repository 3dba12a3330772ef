"""The frameworks' programs through ddpq against a bare torchrun (issue 42).

Each example of examples/frameworks/ (Lightning, accelerate, ignite, a Hugging Face
Trainer, a torch.compile'd model; a tiny regression, 3 epochs, world size 2, gloo on CPU,
with ddpq's integration or its own calls: metrics reported, checkpoints registered) runs
under a bare ``torchrun --standalone`` and as a job with the warm launcher (``launcher:
warm``, the default: ranks forked from a process that has imported torch), in turn, ROUNDS
rounds after one warm-up of each. The warm-up also fills inductor's caches for the compiled
program: the bare run's (``/tmp/torchinductor_$USER``) and the user's on the worker, so
both sides' rounds compile nothing (round 0's lines give the cold figures).
The figure is the wall time, from the start of torchrun to its end against from
POST /jobs to the job's finished_at; one row per framework: the medians and their ratio
(ddpq / bare; the issue's goal: at most 0.8).

    .venv/bin/python bench/frameworks.py [--rounds 3] [--frameworks lightning,compile]
        [--backend sqlite|postgres]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import child_env, database, run_job, serve

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "frameworks"
PROGRAMS = {
    "lightning": "train_lightning.py",
    "accelerate": "train_accelerate.py",
    "ignite": "train_ignite.py",
    "transformers": "train_transformers.py",
    "compile": "train_compile.py",
}


def bare(program: str, where: Path) -> float:
    """A bare torchrun's wall time (its checkpoints in a directory of its own). A run
    whose ranks finished but aborted in torch's teardown (issue 31) still counts, said."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
            *["--nproc-per-node=2", str(EXAMPLES / program)],
        ],
        cwd=where,
        env=child_env(DDPQ_CHECKPOINT_DIR=str(where / "checkpoints")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    took = time.perf_counter() - t0
    if done.returncode:
        if b"SIGABRT" not in done.stderr and b"Signal 6" not in done.stderr:
            raise SystemExit(f"torchrun {program}: exit {done.returncode}\n{done.stderr.decode()}")
        print(f"  (bare torchrun exit {done.returncode}: a rank aborted in torch's teardown)")
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frameworks", default=",".join(PROGRAMS))
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    args = ap.parse_args()
    names = [n for n in args.frameworks.split(",") if n]
    unknown = set(names) - set(PROGRAMS)
    if unknown:
        raise SystemExit(f"unknown frameworks: {', '.join(sorted(unknown))}")
    scratch = Path(tempfile.mkdtemp(prefix="ddpq-bench-frameworks-"))
    # The jobs' workspace: a copy, since what a program writes beside itself (Lightning's
    # lightning_logs/) must not land in the checkout.
    workspace = scratch / "workspace"
    shutil.copytree(EXAMPLES, workspace)
    rows: list[tuple[str, float, float]] = []
    with database(args.backend) as url, serve(url) as api:
        worker = subprocess.Popen(
            [
                *[sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url],
                *["--workspace", str(workspace), "--name", "bench", "--gpus", "none"],
                *["--data-dir", str(api.data_dir / "worker"), "--cpu-slots", "2"],
                *["--log-level", "warning", "--job-uids", "off", "--launcher", "warm"],
            ],
            env=child_env(DDPQ_WORKER_TOKEN=api.worker_token),
        )
        try:
            with api.client() as client:
                for name in names:
                    program = PROGRAMS[name]
                    spec = {"entrypoint": program, "world_size": 2, "launcher": "warm"}
                    walls: dict[str, list[float]] = {"bare": [], "ddpq": []}
                    for r in range(args.rounds + 1):  # round 0: the warm-up of each
                        # The order turns each round: load from elsewhere hits both alike.
                        for way in ("bare", "ddpq") if r % 2 else ("ddpq", "bare"):
                            if way == "bare":
                                took = bare(program, scratch / name)
                            else:
                                took, job = run_job(client, spec, poll_s=2.0)
                                if job["status"] != "succeeded":
                                    raise SystemExit(f"{name}: job {job['id']} {job['status']}")
                            if r:
                                walls[way].append(took)
                            print(f"{name} round {r} {way}: {took:.2f} s", flush=True)
                    rows.append(
                        (name, statistics.median(walls["ddpq"]), statistics.median(walls["bare"]))
                    )
        finally:
            worker.terminate()
            worker.wait(timeout=60)
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{'framework':<14}{'ddpq warm':>11}{'bare':>9}{'ratio':>8}  ({args.rounds} rounds)")
    for name, ddpq, plain in rows:
        print(f"{name:<14}{ddpq:>10.2f}s{plain:>8.2f}s{ddpq / plain:>8.2f}")


if __name__ == "__main__":
    main()
