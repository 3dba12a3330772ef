"""What running through ddpq costs over running torchrun by hand, with each launcher, and
where it goes.

Programs, world size 2, gloo on CPU: a trivial one (bench/trivial_ddp.py: a process group,
one barrier), and the plain DDP program (examples/ddp_plain.py) for N steps. Each is run
directly with ``torchrun --standalone`` and through ddpq (from POST /jobs until the job's
finished_at) with a cold torchrun (``launcher: torchrun``) and with the warm launcher
(``launcher: warm``, issue 34), in turn, ROUNDS rounds after one warm-up of each, for each
--backend. Prints each round and, per program, the medians and the ratios of the medians to
torchrun's (goals: the cold launcher <= 1.02x at 300 steps; warm <= 0.7x at 300 steps,
<= 0.95x at 2,000, the trivial job <= 0.8 s).

Each run of examples/ddp_plain.py also gives the loop's own time, rank 0's from its first
step to its last (its line ``trained N steps in S s``: a bare torchrun's output, the job's log
through the API): per program, the median of each way and the ratios to torchrun's (the median
of the pairs' ratios, each ddpq run against the torchrun run of its round, and the ratio of the
medians; goal: within 1 % at 300 and 3,000 steps). --ways runs only some of the ways (e.g.
``torchrun,ddpq-warm``). --cpu samples /proc while the ranks run (bench/_procs.py) and prints,
per way, the median CPU seconds per second of each process beside the ranks (the API, the
worker, the supervisor, torchrun's agent and tee, the warm process) and of the rest of the
machine (its load).

--trace runs the worker with ``--trace`` (worker/executors/trace.py) and prints, per backend and
program, the median over the cold-launcher jobs of each phase of an attempt: the API's side
(submit to claimed, from the job's own stamps), the worker's phases from the claim's reply to
the finish report, and the report to the job's finished_at.

    .venv/bin/python bench/overhead.py [--rounds 5] [--programs trivial,300,2000]
        [--backend sqlite|postgres|both] [--trace] [--ways torchrun,ddpq-warm] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
from _harness import Api, backends, child_env, children, database, phases, run_job, serve
from _procs import Meter

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from worker.executors import trace as trace_  # noqa: E402  (the repository's, beside this file)

PLAIN = "examples/ddp_plain.py"
TRIVIAL = "bench/trivial_ddp.py"
WAYS = ("torchrun", "ddpq", "ddpq-warm")


def program(name: str) -> list[str]:
    if name == "trivial":
        return [TRIVIAL]
    return [PLAIN, "--steps", str(int(name))]


LOOP_LINE = re.compile(rb"trained (\d+) steps in ([0-9.]+) s")


def loop_time(output: bytes) -> float | None:
    """The loop's own time the program printed on rank 0 (examples/ddp_plain.py), if any."""
    found = LOOP_LINE.findall(output)
    return float(found[-1][1]) if found else None


def run_direct(argv: list[str]) -> tuple[float, float | None]:
    """A bare torchrun's wall time and the loop's own time. A run whose ranks finished but
    aborted in torch's interpreter teardown (issue 31: ddpq's worker.entry skips it) still
    counts, said."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            *argv,
        ],
        cwd=REPO,
        capture_output=True,
    )
    took = time.perf_counter() - t0
    if done.returncode:
        if b"SIGABRT" not in done.stderr and b"Signal 6" not in done.stderr:
            raise SystemExit(f"torchrun {argv}: exit {done.returncode}\n{done.stderr.decode()}")
        print(f"  (bare torchrun exit {done.returncode}: a rank aborted in torch's teardown)")
    return took, loop_time(done.stdout)


def run_ddpq(
    client: httpx.Client, argv: list[str], launcher: str
) -> tuple[float, str, dict, float | None]:
    spec = {"entrypoint": argv[0], "world_size": 2, "args": argv[1:], "launcher": launcher}
    # Polled every 2 s: the figure is the job's own finished_at, and on 2 cores each poll's
    # CPU in the API is taken from the ranks being measured.
    elapsed, final = run_job(client, spec, poll_s=2.0)
    if final["status"] != "succeeded":
        raise SystemExit(f"job {final['id']} {final['status']}: {final['reason']}")
    # The log is shipped before the attempt's end is reported: whole by finished_at.
    log = client.get(f"/jobs/{final['id']}/logs")
    log.raise_for_status()
    return elapsed, phases(final), final, loop_time(log.content)


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` itself has spent (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def breakdown(job: dict, posted: float, at: dict[str, float]) -> dict[str, float]:
    """One job's phases in seconds, in order: the API's (from its stamps), the worker's
    (worker.executors.trace), and the finish report to finished_at."""
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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--programs", default="trivial,300,2000")
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="sqlite")
    ap.add_argument(
        "--job-uids",
        default="off",
        help="the worker's --job-uids (as root, a worker would wall each job under a uid of "
        "its own, which cannot run this checkout's interpreter; walls cost ~1 %%: "
        "bench/code.py --walls)",
    )
    ap.add_argument(
        "--trace", action="store_true", help="print where each job's time went, by phase"
    )
    ap.add_argument("--ways", default=",".join(WAYS), help=f"some of {', '.join(WAYS)}")
    ap.add_argument(
        "--cpu", action="store_true", help="what each process beside the ranks spends meanwhile"
    )
    args = ap.parse_args()
    args.ways = tuple(w for w in WAYS if w in args.ways.split(","))
    if "torchrun" not in args.ways:
        ap.error("--ways must hold torchrun, the baseline")
    for backend in backends(args.backend):
        measure(backend, args)


def measure(backend: str, args: argparse.Namespace) -> None:
    with database(backend) as url, serve(url) as api:
        trace_file = api.data_dir / "trace.jsonl"
        env = child_env(DDPQ_WORKER_TOKEN=api.worker_token)
        worker = subprocess.Popen(
            [
                *[sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url],
                *["--workspace", str(REPO), "--name", "bench", "--gpus", "none"],
                *["--data-dir", str(api.data_dir / "worker"), "--cpu-slots", "2"],
                *["--log-level", "warning", "--job-uids", args.job_uids],
                *(["--trace", str(trace_file)] if args.trace else []),
            ],
            env=env,
            cwd=api.data_dir,
        )
        client = api.client()
        try:
            for name in args.programs.split(","):
                measure_program(client, api, worker.pid, backend, name, args, trace_file)
        finally:
            client.close()
            worker.terminate()
            worker.wait(timeout=60)


def measure_program(
    client: httpx.Client,
    api: Api,
    worker_pid: int,
    backend: str,
    name: str,
    args: argparse.Namespace,
    trace_file: Path,
) -> None:
    argv = program(name)
    ways = args.ways
    times: dict[str, list[float]] = {w: [] for w in ways}
    loops: dict[str, list[float | None]] = {w: [] for w in ways}
    cpus: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    rows = []
    for i in range(args.rounds + 1):
        # The order turns each round: no way always follows another.
        order = ways[i % len(ways) :] + ways[: i % len(ways)]
        said = []
        for way in order:
            meter = Meter({api.pid, *children(api.pid)}, worker_pid)
            if args.cpu:
                meter.start()
            loop: float | None
            if way == "torchrun":
                (took, loop), words = run_direct(argv), ""
            else:
                cpu = api.cpu_seconds(), cpu_seconds(worker_pid)
                posted = time.time()
                took, words, job, loop = run_ddpq(
                    client, argv, "warm" if way == "ddpq-warm" else "torchrun"
                )
                cpu = (
                    api.cpu_seconds() - cpu[0],
                    cpu_seconds(worker_pid) - cpu[1],
                )
                if args.trace and i and way == "ddpq":
                    row = breakdown(job, posted, trace_wait(trace_file, job["id"]))
                    # What the API and the worker spent meanwhile: on 2 cores, taken from
                    # the ranks (the API's includes the bench's own polls of the job).
                    row["CPU: the API process, during the job"] = cpu[0]
                    row["CPU: the worker process, during the job"] = cpu[1]
                    rows.append(row)
            if args.cpu:
                meter.stop()
            if i:
                times[way].append(took)
                loops[way].append(loop)
                if args.cpu and meter.window_s:
                    cpus[way].append({k: v / meter.window_s for k, v in meter.cpu.items()})
            said.append(
                f"{way} {took:.2f}s"
                + (f" (loop {loop:.3f}s)" if loop is not None else "")
                + (f" ({words})" if words else "")
            )
        label = "warm-up" if not i else f"round {i}"
        print(f"{backend} {name} {label}: " + ", ".join(said), flush=True)
    med = {w: statistics.median(t) for w, t in times.items()}
    base = med["torchrun"]
    print(
        f"{backend} {name}: median torchrun {base:.2f}s"
        + "".join(f", {w} {med[w]:.2f}s ({med[w] / base:.3f}x)" for w in ways[1:])
        + f" over {args.rounds} rounds",
        flush=True,
    )
    print_loops(backend, name, loops)
    print_cpu(backend, name, cpus)
    if rows:
        print(f"{backend} {name}: median of {len(rows)} cold-launcher jobs, seconds")
        for key in rows[0]:
            print(f"  {key:45s} {statistics.median(r[key] for r in rows):7.3f}")


def print_loops(backend: str, name: str, loops: dict[str, list[float | None]]) -> None:
    """The loop's own time: each way's median and, against torchrun's, the median of the
    rounds' ratios (alternating pairs) and the ratio of the medians."""
    if any(t is None for ts in loops.values() for t in ts):
        return  # a program that does not print its loop's time (the trivial one)
    med = {w: statistics.median(t for t in ts if t is not None) for w, ts in loops.items()}
    base = loops["torchrun"]
    parts = [f"torchrun {med['torchrun']:.3f}s"]
    for way, ts in loops.items():
        if way == "torchrun":
            continue
        pairs = [t / b for t, b in zip(ts, base, strict=True) if t is not None and b]
        parts.append(
            f"{way} {med[way]:.3f}s (pairs' median {statistics.median(pairs):.3f}x, "
            f"medians {med[way] / med['torchrun']:.3f}x; pairs "
            + " ".join(f"{r:.3f}" for r in pairs)
            + ")"
        )
    print(f"{backend} {name}: loop's own time, median: " + ", ".join(parts), flush=True)


def print_cpu(backend: str, name: str, cpus: dict[str, list[dict[str, float]]]) -> None:
    """Per way, the median CPU seconds per second each part spent while the ranks ran."""
    for way, rows in cpus.items():
        if not rows:
            continue
        kinds = sorted(
            {k for r in rows for k in r},
            key=lambda k: -statistics.median(r.get(k, 0.0) for r in rows),
        )
        shown = ", ".join(
            f"{k} {statistics.median(r.get(k, 0.0) for r in rows):.3f}" for k in kinds
        )
        print(f"{backend} {name} {way}: CPU s/s while the ranks ran: {shown}", flush=True)


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
