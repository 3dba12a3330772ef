"""What running through ddpq on Slurm costs over a bare sbatch.

The same plain DDP program (examples/ddp_plain.py, world size 2, gloo on CPU, about
15-20 s of training) is run on the one-node Slurm cluster of the tests (partition
debug; tests/slurmcluster.py starts it when it is down) two ways, alternating, PAIRS
pairs after one warm-up of each:

- through ddpq: POST /jobs to a `ddpq serve` (SQLite) that a Slurm bridge
  (``ddpq worker --executor slurm``, workspace the repository) hands to Slurm, timed
  from the POST until the job's finished_at;
- by hand: ``sbatch`` of a batch script running ``srun --ntasks-per-node=1 python -m
  torch.distributed.run --standalone --nproc-per-node 2 examples/ddp_plain.py``, the
  same allocation as the bridge's (one node, one task of 2 CPUs), timed from before
  sbatch until ``scontrol show job`` shows it ended.

Other tests share the cluster: before each run it waits until the partition has run
nothing for a few seconds, and a pair one of whose jobs was cancelled or retried from
outside (the tests' ``scancel -u``) is run again. Prints each pair and the median ratio
ddpq-on-slurm / bare sbatch.

    .venv/bin/python bench/slurm.py [--pairs 3] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _harness import child_env, database, phases, run_job, serve

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests import slurmcluster  # noqa: E402

PROGRAM = "examples/ddp_plain.py"
POLL_S = 0.2  # how often the bare run asks scontrol whether its job ended
BARE_NAME = "ddpq-bench-bare"
QUIET_S = 3.0  # the partition runs nothing this long before a run starts
TRIES = 5  # runs of one pair, when others' scancels keep disturbing it


class Disturbed(Exception):
    """A run was cancelled (or its ddpq job retried) by someone else's scancel."""


def _slurm(*argv: str) -> str:
    return slurmcluster._run(*argv, check=True).stdout


def wait_idle(cluster: slurmcluster.Cluster, timeout: float = 1800) -> float:
    """Wait until the partition has run and queued nothing for QUIET_S (other tests use
    the cluster); returns how long that took beyond QUIET_S."""
    t0 = quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < QUIET_S:
        if _slurm("squeue", "-h", "-p", cluster.partition, "-o", "%i").strip():
            quiet_since = time.monotonic()
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"partition {cluster.partition} still busy after {timeout:g}s")
        time.sleep(0.5)
    return time.monotonic() - t0 - QUIET_S


def bare_script(steps: int) -> str:
    """The hand-written batch script: this Python by absolute path, the venv's bin first
    on PATH, and srun passing the script's environment on (sbatch runs with --export=NONE,
    which srun would inherit)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), slurmcluster.SEARCH_PATH])
    program = [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
        *["--nproc-per-node", "2", PROGRAM, "--steps", str(steps)],
    ]
    return "\n".join(
        [
            "#!/bin/sh",
            f"export PATH={shlex.quote(path)}",
            f"export HOME={shlex.quote(os.environ.get('HOME', '/tmp'))}",
            "export LANG=C.UTF-8",
            "export SLURM_EXPORT_ENV=ALL",
            f"cd {shlex.quote(str(REPO))} || exit 1",
            f"exec srun --ntasks-per-node=1 {shlex.join(program)}",
            "",
        ]
    )


def run_bare(cluster: slurmcluster.Cluster, steps: int, out_dir: Path, live: set[str]) -> float:
    script = out_dir / "bare.sh"
    script.write_text(bare_script(steps))
    t0 = time.perf_counter()
    job_id = (
        _slurm(
            *["sbatch", "--parsable", "--job-name", BARE_NAME, "--partition", cluster.partition],
            *["--nodes", "1", "--ntasks-per-node", "1", "--cpus-per-task", "2"],
            *["--export", "NONE", "--no-requeue", "--output", f"{out_dir}/%x-%j.out"],
            str(script),
        )
        .strip()
        .split(";")[0]
    )
    live.add(job_id)
    while (state := cluster.state(job_id)) not in slurmcluster.TERMINAL:
        if state is None:
            raise SystemExit(f"Slurm forgot job {job_id}")
        time.sleep(POLL_S)
    elapsed = time.perf_counter() - t0
    live.discard(job_id)
    if state == "CANCELLED":
        raise Disturbed(f"bare sbatch job {job_id} was cancelled")
    if state != "COMPLETED":
        raise SystemExit(f"bare sbatch job {job_id} ended {state}: see {out_dir}/")
    return elapsed


def run_ddpq(client: httpx.Client, steps: int) -> tuple[float, str]:
    # As in bench/overhead.py, the end is the job's own finished_at: stamped when the
    # bridge reports the Slurm job's end.
    spec = {"entrypoint": PROGRAM, "world_size": 2, "args": ["--steps", str(steps)]}
    elapsed, final = run_job(client, spec)
    status = final["status"]
    if final["attempt"] > 1 or "outside ddpq" in (final["reason"] or ""):
        raise Disturbed(f"ddpq job {final['id']} {status} after attempt {final['attempt']}")
    if status != "succeeded":
        raise SystemExit(f"job {final['id']} {status}: {final['reason']}")
    return elapsed, phases(final)


def cancel_leftovers(bridge: str, live: set[str]) -> None:
    """scancel what this benchmark submitted and Slurm still runs: the bare job, and the
    jobs of this run's bridge (a stopped bridge leaves its jobs running), found by the
    comment the bridge puts on them. Nobody else's."""
    out = slurmcluster._run("squeue", "-h", "-o", "%i|%k").stdout
    mine = {
        i for i, _, k in (line.partition("|") for line in out.splitlines())
        if k.startswith(f"ddpq bridge {bridge} ")
    }  # fmt: skip
    for job_id in sorted(mine | live):
        slurmcluster._run("scancel", job_id)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=4000, help="training steps (about 15-20 s on 2 cores)"
    )
    args = ap.parse_args()

    cluster = slurmcluster.ensure()
    bridge_name = f"bench-slurm-{secrets.token_hex(4)}"
    live: set[str] = set()
    with database("sqlite") as url, serve(url) as api:
        out_dir = Path(tempfile.mkdtemp(prefix="ddpq-bench-sbatch-"))
        bridge_log = api.data_dir / "bridge.log"
        env = child_env(DDPQ_WORKER_TOKEN=api.worker_token)
        with open(bridge_log, "wb") as log:
            bridge = subprocess.Popen(
                [
                    *[sys.executable, "-m", "ddpq.cli", "worker", "--executor", "slurm"],
                    *["--partition", cluster.partition, "--poll-s", "0.5", "--url", api.url],
                    *["--name", bridge_name, "--workspace", str(REPO)],
                    *["--data-dir", str(api.data_dir / "bridge"), "--log-level", "info"],
                ],
                env=env,
                cwd=api.data_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        client = api.client()
        ok = False
        try:

            def pair() -> tuple[float, float, str, str]:
                for _ in range(TRIES):
                    try:
                        busy = wait_idle(cluster)
                        bare = run_bare(cluster, args.steps, out_dir, live)
                        busy += wait_idle(cluster)
                        through, phases = run_ddpq(client, args.steps)
                    except Disturbed as exc:
                        print(f"  ({exc} from outside: running the pair again)", flush=True)
                        continue
                    note = f", waited {busy:.0f}s for the partition" if busy >= 1 else ""
                    return bare, through, phases, note
                raise SystemExit(f"a pair was disturbed {TRIES} times: is a test suite running?")

            bare, through, phases, note = pair()
            print(
                f"warm-up: bare sbatch {bare:.2f}s, ddpq {through:.2f}s ({phases}){note}",
                flush=True,
            )
            ratios = []
            for i in range(args.pairs):
                bare, through, phases, note = pair()
                ratios.append(through / bare)
                print(
                    f"pair {i + 1}: bare sbatch {bare:.2f}s, ddpq {through:.2f}s ({phases}), "
                    f"ratio {through / bare:.3f}{note}",
                    flush=True,
                )
            print(
                f"ddpq-on-slurm / bare sbatch: {statistics.median(ratios):.3f}x "
                f"(median of {args.pairs} pairs)"
            )
            ok = True
        finally:
            client.close()
            bridge.terminate()
            try:
                bridge.wait(timeout=60)
            except subprocess.TimeoutExpired:
                bridge.kill()
                bridge.wait()
            cancel_leftovers(bridge_name, live)
            if not ok:
                tail = bridge_log.read_text(errors="replace").splitlines()[-30:]
                print(f"bridge log ({bridge_log}), last lines:", *tail, sep="\n", file=sys.stderr)


if __name__ == "__main__":
    main()
