"""A user's caches across their jobs (issue 42): the first compiled step of a user's
second job through ddpq against a bare torchrun with a warm inductor cache.

The program is bench/compiled_step.py (a small MLP under DDP over gloo, `torch.compile`,
2 ranks): rank 0 prints how long its first step took, which is Dynamo's tracing and
inductor's compilation, most of it skipped when inductor's FX graph cache is warm.

1. bare: `torchrun --standalone` with TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in a
   directory of the benchmark's; a warm-up run fills it, so each round's run is warm;
2. through ddpq: a `ddpq serve` (SQLite) and a worker, walled as the compose worker is
   when the benchmark runs as root (each job under a uid of its own: the case a cache
   shared by path broke), else unwalled; the program sent as code by one user, whose
   first job fills their cache on the worker, so each round's job is a later job of
   theirs. A second user's first job is timed once too (a cold cache: caches are per
   user), as is the first user's first.

Rounds alternate. The figure: median first step through ddpq / median bare warm (goal: at
most 1.1, as fast as a bare run with a warm cache).

    sudo .venv/bin/python bench/caches.py [--rounds 3] [--nproc 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from _harness import Api, child_env, database, run_job, serve

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ddpq.client import Client  # noqa: E402

FIRST = re.compile(r"FIRST_STEP_S ([0-9.]+) .*fxgraph hits (\d+) misses (\d+)")
UIDS = "72060-72079"  # not the tests' ranges


def first_step(output: str) -> tuple[float, int, int]:
    m = FIRST.search(output)
    if m is None:
        raise SystemExit(f"no FIRST_STEP_S line in:\n{output[-3000:]}")
    return float(m[1]), int(m[2]), int(m[3])


def bare(program: Path, cache: Path, nproc: int) -> tuple[float, int, int]:
    """A bare torchrun of ``program`` with its inductor and Triton caches in ``cache``."""
    env = child_env(
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton")
    )
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*argv, "--nproc-per-node", str(nproc), str(program)],
        env=env,
        capture_output=True,
        text=True,
        cwd=program.parent,
        check=False,
        timeout=900,
    )
    return first_step(done.stdout + done.stderr)


@contextlib.contextmanager
def worker(api: Api, base: Path, job_uids: str, nproc: int) -> Iterator[None]:
    (base / "workspace").mkdir(parents=True)
    argv = [
        sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url, "--name", "cachebench",
        "--workspace", str(base / "workspace"), "--data-dir", str(base / "data"),
        "--cpu-slots", str(nproc), "--gpus", "none", "--job-uids", job_uids,
        "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=child_env(DDPQ_WORKER_TOKEN=api.worker_token), cwd=base)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def through(api: Api, token: str, snap: str, nproc: int) -> tuple[float, int, int]:
    spec = {"entrypoint": "main.py", "code": snap, "world_size": nproc, "device": "cpu"}
    with api.client_with(token) as c:
        _, job = run_job(c, spec)
        log = c.get(f"/jobs/{job['id']}/logs").text
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job['id']} {job['status']}: {job.get('reason')}\n{log[-3000:]}")
    return first_step(log)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    walled = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(prefix="ddpq-bench-caches-", dir="/var/tmp"))
    base.chmod(0o711)
    code = base / "code"
    code.mkdir()
    shutil.copy(REPO / "bench" / "compiled_step.py", code / "main.py")
    times: dict[str, list[float]] = {"bare": [], "ddpq": []}
    try:
        with database("sqlite") as url, serve(url) as api:
            with Client(api.url, api.api_token) as admin:
                tokens = [admin.add_user(n)["token"] for n in ("alice", "bob")]
            with Client(api.url, tokens[0]) as alice:
                snap = alice.push_code(code).id
            with contextlib.ExitStack() as stack:
                stack.enter_context(worker(api, base / "w", UIDS if walled else "off", args.nproc))
                cold = bare(code / "main.py", base / "bare-cache", args.nproc)
                print(f"bare, cold cache (warm-up): first step {cold[0]:.2f} s {cold[1:]}")
                first = through(api, tokens[0], snap, args.nproc)
                print(f"ddpq, alice's first job (cold): first step {first[0]:.2f} s {first[1:]}")
                for i in range(args.rounds):
                    order = ("bare", "ddpq") if i % 2 == 0 else ("ddpq", "bare")
                    for how in order:
                        took = (
                            bare(code / "main.py", base / "bare-cache", args.nproc)
                            if how == "bare"
                            else through(api, tokens[0], snap, args.nproc)
                        )
                        times[how].append(took[0])
                        print(f"round {i + 1}: {how} first step {took[0]:.2f} s {took[1:]}")
                other = through(api, tokens[1], snap, args.nproc)
                print(f"ddpq, bob's first job (cold): first step {other[0]:.2f} s {other[1:]}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ratio = statistics.median(times["ddpq"]) / statistics.median(times["bare"])
    how = "walled" if walled else "unwalled"
    print(
        f"caches: {args.nproc}-rank compiled MLP, first step of a user's later job through "
        f"ddpq ({how}) {statistics.median(times['ddpq']):.2f} s against bare torchrun with a "
        f"warm cache {statistics.median(times['bare']):.2f} s: ratio {ratio:.3f} (rounds: "
        f"ddpq {', '.join(f'{t:.2f}' for t in times['ddpq'])}; bare "
        f"{', '.join(f'{t:.2f}' for t in times['bare'])}); cold first jobs: alice "
        f"{first[0]:.2f} s, bob {other[0]:.2f} s"
    )


if __name__ == "__main__":
    main()
