"""What running through ddpq costs over running torchrun by hand, with each launcher.

Three programs, world size 2, gloo on CPU: a trivial one (bench/trivial_ddp.py: a process
group, one barrier), and the plain DDP program (examples/ddp_plain.py) for 300 and for
2,000 steps. Each is run directly with ``torchrun --standalone`` and through ddpq (from
POST /jobs until the job's finished_at) with a cold torchrun (``launcher: torchrun``) and
with the warm launcher (``launcher: warm``, issue 34), in turn, ROUNDS rounds after one
warm-up of each. Prints each round and, per program, the medians and the ratios of the
medians to torchrun's (goals: 300 steps warm <= 0.7x, 2,000 steps warm <= 0.95x, the
trivial job warm <= 0.8 s; the cold launcher <= 1.05x as before).

    .venv/bin/python bench/overhead.py [--rounds 5] [--programs trivial,300,2000]
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
PLAIN = "examples/ddp_plain.py"
TRIVIAL = "bench/trivial_ddp.py"
WAYS = ("torchrun", "ddpq", "ddpq-warm")


def program(name: str) -> list[str]:
    if name == "trivial":
        return [TRIVIAL]
    return [PLAIN, "--steps", str(int(name))]


def run_direct(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *argv,
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def run_ddpq(client: httpx.Client, argv: list[str], launcher: str) -> tuple[float, str]:
    spec = {"entrypoint": argv[0], "world_size": 2, "args": argv[1:], "launcher": launcher}
    elapsed, final = run_job(client, spec)
    if final["status"] != "succeeded":
        raise SystemExit(f"job {final['id']} {final['status']}: {final['reason']}")
    return elapsed, phases(final)


def run_way(client: httpx.Client, way: str, argv: list[str]) -> tuple[float, str]:
    if way == "torchrun":
        return run_direct(argv), ""
    return run_ddpq(client, argv, "warm" if way == "ddpq-warm" else "torchrun")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--programs", default="trivial,300,2000")
    args = ap.parse_args()
    names = args.programs.split(",")

    with database("sqlite") as url, serve(url) as api:
        env = child_env(DDPQ_WORKER_TOKEN=api.worker_token)
        worker = subprocess.Popen(
            [
                *[sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url],
                *["--workspace", str(REPO), "--name", "bench", "--gpus", "none"],
                *["--data-dir", str(api.data_dir / "worker"), "--cpu-slots", "2"],
                *["--log-level", "warning"],
                # As root, a worker would wall each job under a uid of its own, which cannot
                # run this checkout's interpreter; walls cost ~1 % (bench/code.py --walls).
                *["--job-uids", "off"],
            ],
            env=env,
            cwd=api.data_dir,
        )
        client = api.client()
        try:
            for name in names:
                argv = program(name)
                times: dict[str, list[float]] = {w: [] for w in WAYS}
                for i in range(args.rounds + 1):
                    # The order turns each round: no way always follows another.
                    order = WAYS[i % 3 :] + WAYS[: i % 3]
                    said = []
                    for way in order:
                        took, ph = run_way(client, way, argv)
                        if i:
                            times[way].append(took)
                        said.append(f"{way} {took:.2f}s" + (f" ({ph})" if ph else ""))
                    print(f"{name} {'warm-up' if not i else f'round {i}'}: " + ", ".join(said))
                med = {w: statistics.median(t) for w, t in times.items()}
                base = med["torchrun"]
                print(
                    f"{name}: median torchrun {base:.2f}s, ddpq {med['ddpq']:.2f}s "
                    f"({med['ddpq'] / base:.3f}x), ddpq-warm {med['ddpq-warm']:.2f}s "
                    f"({med['ddpq-warm'] / base:.3f}x) over {args.rounds} rounds",
                    flush=True,
                )
        finally:
            client.close()
            worker.terminate()
            worker.wait(timeout=60)


if __name__ == "__main__":
    main()
