"""What running through ddpq costs over running torchrun by hand, and where it goes.

The same plain DDP program (examples/ddp_plain.py, world size 2, gloo on CPU,
about 20 s of training by default; the issue's figure is --steps 300) is run directly with
``torchrun --standalone`` and through ddpq (from POST /jobs until the job's finished_at),
alternating, PAIRS pairs after one warm-up of each. Prints each pair and the median ratio
ddpq / torchrun (goal: <= 1.02 at 300 steps), for each --backend.

--trace runs the worker with ``--trace`` (worker/trace.py) and prints, per backend, the
median over the pairs of each phase of an attempt: the API's side (submit to claimed, from
the job's own stamps), the worker's phases from the claim's reply to the finish report,
and the report to the job's finished_at.

    .venv/bin/python bench/overhead.py [--pairs 3] [--steps N] [--backend both] [--trace]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
from _harness import backends, child_env, database, phases, run_job, serve

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from worker import trace as trace_  # noqa: E402  (the repository's, beside this file)

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


def run_ddpq(client: httpx.Client, steps: int) -> tuple[float, str, dict]:
    spec = {"entrypoint": PROGRAM, "world_size": 2, "args": ["--steps", str(steps)]}
    # Polled every 2 s: the figure is the job's own finished_at, and on 2 cores each poll's
    # CPU in the API is taken from the ranks being measured.
    elapsed, final = run_job(client, spec, poll_s=2.0)
    if final["status"] != "succeeded":
        raise SystemExit(f"job {final['id']} {final['status']}: {final['reason']}")
    return elapsed, phases(final), final


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` itself has spent (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def breakdown(job: dict, posted: float, at: dict[str, float]) -> dict[str, float]:
    """One job's phases in seconds, in order: the API's (from its stamps), the worker's
    (worker.trace), and the finish report to finished_at."""
    stamp = {k: datetime.fromisoformat(job[k]).timestamp() for k in ("created_at", "started_at")}
    finished = datetime.fromisoformat(job["finished_at"]).timestamp()
    row = {
        "POST -> created_at": stamp["created_at"] - posted,
        "created_at -> claimed (API started_at)": stamp["started_at"] - stamp["created_at"],
        "API started_at -> worker has the claim": at["claimed"] - stamp["started_at"],
    }
    row.update({f"worker: -> {phase}": s for phase, s in trace_.steps(at).items()})
    # The API stamps finished_at before it answers the finish: before "reported".
    row["worker: kept/shipped -> API finished_at"] = finished - at.get("shipped", at["claimed"])
    row["ddpq's own (all but spawned -> exited)"] = (
        finished - posted - (at["exited"] - at["spawned"])
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=4500, help="training steps (about 20 s on 2 cores)"
    )
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="sqlite")
    ap.add_argument(
        "--job-uids",
        default="off",
        help="the worker's --job-uids (walled jobs need a Python every uid can read)",
    )
    ap.add_argument(
        "--trace", action="store_true", help="print where each job's time went, by phase"
    )
    args = ap.parse_args()
    summary = []
    for backend in backends(args.backend):
        ratio, table = measure(backend, args)
        summary.append(f"{backend}: median ratio ddpq/torchrun {ratio:.3f}")
        if table:
            print(f"\n{backend}: median of {args.pairs} jobs, seconds")
            for name, value in table.items():
                print(f"  {name:45s} {value:7.3f}")
    print("\n" + "\n".join(summary))


def measure(backend: str, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    pairs, steps, trace = args.pairs, args.steps, args.trace
    with database(backend) as url, serve(url) as api:
        trace_file = api.data_dir / "trace.jsonl"
        env = child_env(DDPQ_WORKER_TOKEN=api.worker_token)
        worker = subprocess.Popen(
            [
                *[sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url],
                *["--workspace", str(REPO), "--name", "bench", "--gpus", "none"],
                *["--data-dir", str(api.data_dir / "worker"), "--cpu-slots", "2"],
                *["--log-level", "warning", "--job-uids", args.job_uids],
                *(["--trace", str(trace_file)] if trace else []),
            ],
            env=env,
            cwd=api.data_dir,
        )
        client = api.client()
        try:
            direct = run_direct(steps)
            through, words, _ = run_ddpq(client, steps)
            print(f"{backend} warm-up: torchrun {direct:.2f}s, ddpq {through:.2f}s ({words})")
            ratios = []
            rows = []
            for i in range(pairs):
                direct = run_direct(steps)
                cpu = api.cpu_seconds(), cpu_seconds(worker.pid)
                posted = time.time()
                through, words, job = run_ddpq(client, steps)
                cpu = api.cpu_seconds() - cpu[0], cpu_seconds(worker.pid) - cpu[1]
                ratios.append(through / direct)
                print(
                    f"{backend} pair {i + 1}: torchrun {direct:.2f}s, ddpq {through:.2f}s "
                    f"({words}), ratio {through / direct:.3f}"
                )
                if trace:
                    at = trace_wait(trace_file, job["id"])
                    row = breakdown(job, posted, at)
                    # What the API and the worker spent meanwhile: on 2 cores, taken from
                    # the ranks (the API's includes the bench's own polls of the job).
                    row["CPU: the API process, during the job"] = cpu[0]
                    row["CPU: the worker process, during the job"] = cpu[1]
                    rows.append(row)
            table = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
            return statistics.median(ratios), table
        finally:
            client.close()
            worker.terminate()
            worker.wait(timeout=60)


def trace_wait(path: Path, job_id: int) -> dict[str, float]:
    """The job's attempt as the worker traced it (its line is written just after the
    finish report, so it may trail the job's end by a moment)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for item in trace_.read(path):
            if item["job_id"] == job_id:
                return dict(item["at"])
        time.sleep(0.05)
    raise SystemExit(f"job {job_id}: no trace line in {path}")


if __name__ == "__main__":
    main()
