"""Sweeps: ASHA against the full grid on ddpq, and ddpq's ASHA against Ray Tune's.

The program (bench/sweep_train.py): an MLP of two hidden layers of ``width`` units
learning a fixed random teacher network's function (8 inputs, noise 0.1) with SGD at
``lr``, ``--steps`` steps of batch 512 on one thread, reporting the held-out MSE as
``loss`` every ``--every`` steps: its losses come from training, the same in every run.
The grid: ``--lrs`` (9, log-spaced 1e-4 to 0.1) x ``--widths`` (32, 128, 256), 27
points, the learning rates listed in a fixed shuffled order (as a search would visit
them: asynchronous successive halving keeps whatever reaches a rung first, so a grid
walked from the worst learning rate up would keep nearly everything). World size 1 (one
rank under torchrun), 2 trials at once (2 cores). The rungs: reduction factor 3 and
min_steps the first multiple of ``--every`` above steps / 27 (4,800 steps: 180, 540,
1,620; the fourth rung, 4,860, lies past the end, as Ray's max_t leaves none at the end:
a rung at the last step could prune a trial that has just finished).

1. ddpq (a real ``ddpq serve``, SQLite unless ``--backend postgres``, and ``ddpq worker``
   with 2 CPU slots and the warm launcher; the code pushed once, a warm-up job first):
   the grid as a sweep (method grid, every trial to its end), then the same grid with
   ``early_stopping: {type: asha, mode: pause}`` (``--mode stop``: Optuna's rule, a
   trial stopped for good at its cut). Printed: each one's best loss (of trials that ran
   to the end), whether ASHA's is within 2 % of the grid's, and the trial-steps ASHA
   spent / the grid's (goal <= 0.35), counted from the step each trial's job last
   reported (``latest_metrics``), so the steps a pruned trial ran past its cut count; a
   paused trial resumes from the checkpoint it saved where it stopped (the count of
   those without one, whose steps would run twice, is printed: 0).
2. Ray Tune (``--ray DIR``: a venv's bin/ with ``ray[tune]`` that imports this venv's
   torch; bench/sweep_ray.py runs in it): the same points in the same order
   (``tune.grid_search``), ``ASHAScheduler(time_attr="step", grace_period=min_steps,
   reduction_factor=3, max_t=steps)``, ``max_concurrent_trials=2``, a CPU a trial,
   actors reused (Ray's faster way; ``--ray-fresh-actors``: its default, a process a
   trial), after an untimed warm-up experiment. Printed: the wall time from the submit
   (POST /sweeps; ``Tuner.fit()``) until the sweep has ended (its ``finished_at``; fit
   returned), ddpq / Ray (goal <= 1), each one's best loss and trial-steps.

``--rounds N`` runs the two ASHA sweeps N times, their order turning each round (the
grid once); the ratios are medians. ``--quick``: 3 x 2 points, 600 steps, no Ray unless
``--ray``: a smoke run of the whole path (~1-2 min). ``--round-s S`` shortens the API's
sweeper round (default 5 s) by setting DDPQ_GANG_TIMEOUT_S to 3 S: a diagnostic of what
the round costs, not a default.

    .venv/bin/python bench/sweep.py --rounds 2 --ray /work/ray-venv/bin   # ~17 min
    .venv/bin/python bench/sweep.py --quick

The Ray venv, once (~1 min; torch comes from this venv through a .pth file, appended to
sys.path after Ray's own packages, so no second torch is installed):

    python3.11 -m venv /work/ray-venv && /work/ray-venv/bin/pip install "ray[tune]"
    .venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \\
        > /work/ray-venv/lib/python3.11/site-packages/zz_ddpq_torch.pth
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from _harness import Api, child_env, database, run_job, serve

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from ddpq.client import Client  # noqa: E402

RF = 3  # the reduction factor: a third of the trials go on at each rung
RUNGS = 3  # rungs before the end, as Ray's max_t leaves them: min_steps * 3**k < steps
LRS = [round(10 ** (-4 + 0.375 * k), 6) for k in range(9)]  # 1e-4 ... 0.1
WIDTHS = [32, 128, 256]
POLL_S = 2.0  # polling GET /sweeps/{id}: the API's CPU is the trials' too (2 cores)


@dataclass
class Trial:
    lr: float
    width: int
    state: str  # ddpq: complete, pruned, ...; Ray: complete (reached the end) or stopped
    step: int  # the last step it reported: how far it ran
    loss: float | None  # its last value
    cut_at: int | None = None  # ddpq: the step it was pruned at
    cut_lag_s: float | None = None  # ddpq: from that step's report to its job's end
    attempts: int = 1  # ddpq: its job's attempts (a lost or stopped attempt runs again)
    # ddpq: the checkpoints its attempts saved as they stopped (bench/sweep_train.py saves
    # one at the step it stops at, and stops right after it): one per attempt that did
    # not end the trial, or the next attempt ran some steps again.
    saved: int = 0


@dataclass
class Run:
    who: str
    wall: float
    trials: list[Trial]
    last_end: float | None = None  # ddpq: submit to the last trial's job's end
    gaps: list[float] = field(default_factory=list)  # ddpq: a slot freed to its next trial

    def steps(self) -> int:
        return sum(t.step for t in self.trials)

    def best(self, steps: int) -> float:
        """The best last loss of the trials that ran to the end (a pruned trial's last
        value is not a result: neither side's ranking counts it)."""
        done = [t.loss for t in self.trials if t.step >= steps and t.loss is not None]
        return min(done) if done else math.nan


def min_steps_for(steps: int, every: int) -> int:
    """The first multiple of ``every`` above steps / RF**RUNGS: RUNGS rungs before the end."""
    return every * (steps // RF**RUNGS // every + 1)


def order(lrs: list[float], seed: int) -> list[float]:
    shuffled = list(lrs)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def points(lrs: list[float], widths: list[int]) -> list[dict[str, Any]]:
    """The grid in ddpq's order: the last parameter by name (width) varies fastest."""
    return [{"lr": lr, "width": w} for lr in lrs for w in widths]


def stamp(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


@contextlib.contextmanager
def worker(api: Api, root: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A ``ddpq worker`` with 2 CPU slots, as bench/frameworks.py starts one, once it has
    registered."""
    (root / "workspace").mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [
            *[sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url],
            *["--workspace", str(root / "workspace"), "--name", "bench", "--gpus", "none"],
            *["--data-dir", str(root / "worker"), "--cpu-slots", "2"],
            *["--log-level", "warning", "--job-uids", "off", "--launcher", "warm"],
        ],
        env=child_env(DDPQ_WORKER_TOKEN=api.worker_token),
    )
    try:
        with api.client() as http:
            while not http.get("/workers").json()["items"]:
                if proc.poll() is not None:
                    raise SystemExit(f"ddpq worker exited ({proc.returncode})")
                time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def sweep_spec(
    code: str, lrs: list[float], widths: list[int], args: argparse.Namespace, asha: bool
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "bench-asha" if asha else "bench-grid",
        "job": {
            "entrypoint": "sweep_train.py",
            "code": code,
            "world_size": 1,
            "device": "cpu",
            "args": [
                *["--lr", "{lr}", "--width", "{width}"],
                *["--steps", str(args.steps), "--every", str(args.every)],
            ],
        },
        # Categorical, in the order given: a log-spaced grid has no step to walk.
        "space": {
            "lr": {"type": "categorical", "values": lrs},
            "width": {"type": "categorical", "values": widths},
        },
        "method": "grid",
        "metric": "loss",
        "direction": "minimize",
        "max_concurrent": args.max_concurrent,
        "seed": 1,
    }
    if asha:
        spec["early_stopping"] = {
            "type": "asha",
            "mode": args.mode,
            "min_steps": args.min_steps,
            "reduction_factor": RF,
        }
    return spec


def run_ddpq(
    c: Client, spec: dict[str, Any], expect: list[dict[str, Any]], proc: subprocess.Popen[bytes]
) -> Run:
    t0 = time.time()
    sweep = c.submit_sweep(spec)
    while sweep["status"] == "running":
        if proc.poll() is not None:
            raise SystemExit(f"ddpq worker exited ({proc.returncode})")
        time.sleep(POLL_S)
        sweep = c.sweep(sweep["id"])
    if sweep["status"] != "done":
        raise SystemExit(f"sweep {sweep['id']} {sweep['status']}: {sweep['reason']}")
    wall = stamp(sweep["finished_at"]) - t0
    trials, jobs = [], []
    for t in sorted(sweep["trials"], key=lambda t: t["number"]):
        if t["params"] != expect[t["number"]]:
            raise SystemExit(f"trial {t['number']}: {t['params']}, not {expect[t['number']]}")
        job = c.job(t["job_id"])
        jobs.append(job)
        latest = job["latest_metrics"] or {}
        trial = Trial(
            t["params"]["lr"],
            t["params"]["width"],
            t["state"],
            int(latest.get("step", 0)),
            (latest.get("values") or {}).get("loss"),
            attempts=int(job.get("attempt") or 1),
        )
        if trial.attempts > 1:
            trial.saved = len(c.checkpoints(t["job_id"]))
        if t["state"] == "pruned":
            trial.cut_at = t["step"]
            points = c.metrics(t["job_id"], name="loss", since_step=t["step"])
            at = next((p for p in points if p.get("step") == t["step"]), None)
            if at is not None and at.get("time") and job["finished_at"]:
                trial.cut_lag_s = stamp(job["finished_at"]) - stamp(at["time"])
        trials.append(trial)
    ends = sorted(stamp(j["finished_at"]) for j in jobs)
    made = sorted(stamp(j["created_at"]) for j in jobs)
    # Slots free as trials end; the next trial is made at the sweeper's next round.
    gaps = [m - e for e, m in zip(ends, made[spec["max_concurrent"] :], strict=False)]
    return Run("ddpq", wall, trials, ends[-1] - t0, gaps)


def run_ray(bin_dir: Path, plan: dict[str, Any], tmp: Path) -> Run:
    (tmp / "plan.json").write_text(json.dumps(plan))
    out = tmp / "ray.json"
    out.unlink(missing_ok=True)
    log = tmp / "ray.log"
    with log.open("wb") as f:
        done = subprocess.run(
            [
                str(bin_dir / "python"),
                str(BENCH / "sweep_ray.py"),
                str(tmp / "plan.json"),
                str(out),
            ],
            env=child_env(RAY_USAGE_STATS_ENABLED="0"),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
    if done.returncode or not out.exists():
        raise SystemExit(f"Ray's sweep failed ({done.returncode}): see {log}")
    found = json.loads(out.read_text())
    trials = [
        Trial(
            t["lr"],
            t["width"],
            "complete" if t["step"] >= plan["steps"] else "stopped",
            t["step"],
            t["loss"],
        )
        for t in found["trials"]
    ]
    bad = [t for t in found["trials"] if t["error"]]
    if bad:
        raise SystemExit(f"Ray trials failed: {bad[:3]} (see {log})")
    return Run(f"ray {found['ray']}", found["wall"], trials)


def show(text: str) -> None:
    print(text, flush=True)


def table(grid: Run | None, asha: Run, ray: Run | None, steps: int) -> None:
    """One row per point: the grid's last loss, and how far each ASHA ran it."""
    key = {(t.lr, t.width): t for t in asha.trials}
    rows = [key[(t.lr, t.width)] for t in (grid or asha).trials]
    ray_of = {(t.lr, t.width): t for t in ray.trials} if ray else {}
    gridded = {(t.lr, t.width): t for t in grid.trials} if grid else {}
    show(f"\n{'lr':>9} {'width':>5} {'grid loss':>10} {'ddpq asha':>22} {'ray asha':>17}")
    for t in rows:
        g = gridded.get((t.lr, t.width))
        r = ray_of.get((t.lr, t.width))
        cut = f" (cut {t.cut_at})" if t.cut_at is not None else ""
        show(
            f"{t.lr:>9.3g} {t.width:>5} {g.loss if g and g.loss else math.nan:>10.4f} "
            f"{t.step:>6} {t.state:<8}{cut:<11}"
            + (f"{r.step:>6} {r.loss if r.loss else math.nan:>10.4f}" if r else "")
        )
    show(f"(steps each trial reached; {steps} is the end)")


def ddpq_asha_notes(run: Run, args: argparse.Namespace) -> None:
    """What a pruned trial ran past its cut: steps and seconds (the sweeper's round, the
    metric sender's batching, the worker's heartbeat, the stop), and the gaps between
    trials."""
    again = [t for t in run.trials if t.attempts > 1]
    if again:
        paused = sum(t.attempts - 1 for t in again)
        rerun = [t for t in again if t.saved < t.attempts - (t.state == "complete")]
        show(
            f"  {run.who}: {len(again)} trial(s) ran {paused} more attempt(s), each from the "
            f"checkpoint its last saved at the step it stopped: {len(rerun)} without one "
            "(steps run twice, not counted)"
            + "".join(f"; lr {t.lr:g} width {t.width}" for t in rerun)
        )
    pruned = [t for t in run.trials if t.cut_at is not None]
    if pruned and args.mode == "pause":
        # A paused trial's job ends (cancelled) only when the sweep does: no lag to show.
        show(f"  ddpq: {len(pruned)} trials paused at their cuts and never promoted")
    elif pruned:
        past = sum(t.step - (t.cut_at or 0) for t in pruned)
        lags = [t.cut_lag_s for t in pruned if t.cut_lag_s is not None]
        lag = f", {statistics.median(lags):.1f} s median from the cut step's report" if lags else ""
        show(
            f"  ddpq: {len(pruned)} trials pruned; they ran {past} steps past their cuts "
            f"({past / (args.steps * len(run.trials)):.1%} of the grid's steps{lag} to the "
            "job's end)"
        )
        instant = sum(t.step if t.cut_at is None else t.cut_at for t in run.trials)
        show(
            f"  ddpq: had each cut stopped its trial at once: {instant} trial-steps "
            f"({instant / (args.steps * len(run.trials)):.3f} of the grid's)"
        )
    if run.gaps and args.mode == "stop":
        show(
            f"  ddpq: a trial's end to the next trial's creation: median "
            f"{statistics.median(run.gaps):.1f} s (max {max(run.gaps):.1f} s); submit to "
            f"the last trial's end {run.last_end or 0:.1f} s, to the sweep's end {run.wall:.1f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--steps", type=int, default=4800)
    ap.add_argument("--every", type=int, default=20, help="steps between reports")
    ap.add_argument("--lrs", default=",".join(map(str, LRS)))
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--rounds", type=int, default=1, help="ASHA rounds, ddpq and Ray in turn")
    ap.add_argument("--max-concurrent", type=int, default=2)
    ap.add_argument("--ray", type=Path, help="a venv's bin/ with ray[tune] (see the docstring)")
    ap.add_argument("--ray-fresh-actors", action="store_true", help="Ray: reuse_actors=False")
    ap.add_argument("--no-grid", action="store_true", help="skip the full grid on ddpq")
    ap.add_argument("--round-s", type=float, help="diagnostic: the API's sweeper round")
    ap.add_argument("--quick", action="store_true", help="3 x 2 points, 600 steps")
    ap.add_argument(
        "--mode",
        choices=["pause", "stop"],
        default="pause",
        help="ddpq's ASHA: pause and promote (default), or stop for good (Optuna's)",
    )
    args = ap.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    if args.quick:
        lrs, widths, args.steps = [1e-3, 0.01, 0.1], [32, 64], 600
    lrs = order(lrs, seed=7)
    grid_points = points(lrs, widths)
    args.min_steps = min_steps_for(args.steps, args.every)
    rungs = [args.min_steps * RF**k for k in range(RUNGS) if args.min_steps * RF**k < args.steps]
    show(
        f"grid: {len(grid_points)} points (lr in the order {', '.join(f'{x:g}' for x in lrs)}; "
        f"width {', '.join(map(str, widths))}), {args.steps} steps, loss every {args.every}; "
        f"ASHA rungs {', '.join(map(str, rungs))} (reduction factor {RF}); "
        f"{args.max_concurrent} trials at once, world size 1"
    )
    plan = {
        "points": grid_points,
        "steps": args.steps,
        "every": args.every,
        "min_steps": args.min_steps,
        "reduction_factor": RF,
        "max_concurrent": args.max_concurrent,
        "reuse_actors": not args.ray_fresh_actors,
    }
    env = {}
    if args.round_s:
        # The sweeper's round is min(lease, gang timeout) / 3, at most 5 s
        # (service/sweeper.py); the gang timeout touches multi-node jobs only.
        env["DDPQ_GANG_TIMEOUT_S"] = str(3 * args.round_s)
    tmp = Path(tempfile.mkdtemp(prefix="ddpq-bench-sweep-"))
    code = tmp / "code"
    code.mkdir()
    shutil.copy(BENCH / "sweep_train.py", code / "sweep_train.py")
    with database(args.backend) as url, serve(url, **env) as api, worker(api, tmp) as proc:
        grid, ashas, rays = measure(api, proc, args, lrs, widths, plan, tmp)
    report(args, grid, ashas, rays)
    shutil.rmtree(tmp, ignore_errors=True)


def measure(
    api: Api,
    proc: subprocess.Popen[bytes],
    args: argparse.Namespace,
    lrs: list[float],
    widths: list[int],
    plan: dict[str, Any],
    tmp: Path,
) -> tuple[Run | None, list[Run], list[Run]]:
    """The warm-up job, the grid on ddpq, then the rounds of ASHA on ddpq and on Ray."""
    grid: Run | None = None
    ashas: list[Run] = []
    rays: list[Run] = []
    grid_points = plan["points"]
    with Client(api.url, api.api_token) as c, api.client() as http:
        pushed = c.push_code(tmp / "code")
        warm: dict[str, object] = {
            "entrypoint": "sweep_train.py",
            "code": pushed.id,
            "device": "cpu",
            "args": ["--lr", "0.01", "--width", "32", "--steps", str(args.every)],
        }
        took, job = run_job(http, warm)
        if job["status"] != "succeeded":
            raise SystemExit(f"the warm-up job {job['id']} {job['status']}: {job['reason']}")
        show(f"warm-up job: {took:.1f} s")
        if not args.no_grid:
            grid = run_ddpq(c, sweep_spec(pushed.id, lrs, widths, args, False), grid_points, proc)
            show(f"ddpq grid: {grid.wall:.1f} s, best {grid.best(args.steps):.5f}")
        for r in range(args.rounds):
            # The order turns each round: load from elsewhere hits both alike.
            for side in ["ddpq", "ray"] if r % 2 == 0 else ["ray", "ddpq"]:
                if side == "ray" and args.ray is None:
                    continue
                if side == "ddpq":
                    spec = sweep_spec(pushed.id, lrs, widths, args, True)
                    ashas.append(run_ddpq(c, spec, grid_points, proc))
                    run = ashas[-1]
                else:
                    rays.append(run_ray(args.ray, plan, tmp))
                    run = rays[-1]
                show(
                    f"round {r + 1}: {run.who} ASHA: {run.wall:.1f} s, best "
                    f"{run.best(args.steps):.5f}, {run.steps()} trial-steps"
                )
    return grid, ashas, rays


def report(args: argparse.Namespace, grid: Run | None, ashas: list[Run], rays: list[Run]) -> None:
    table(grid, ashas[-1], rays[-1] if rays else None, args.steps)
    show("")
    for run in ashas:
        ddpq_asha_notes(run, args)
    full = len(ashas[-1].trials) * args.steps
    if grid is not None:
        show(
            f"ddpq grid: {grid.wall:.1f} s, {grid.steps()} trial-steps, best "
            f"{grid.best(args.steps):.5f}"
        )
        ddpq_asha_notes(grid, args)
    for run in ashas + rays:
        show(
            f"{run.who} ASHA: {run.wall:.1f} s, {run.steps()} trial-steps "
            f"({run.steps() / full:.3f} of the grid's), best {run.best(args.steps):.5f}"
        )
    if grid is not None:
        best = grid.best(args.steps)
        found = [a.best(args.steps) for a in ashas]
        within = all(f <= best * 1.02 for f in found)
        show(
            f"ASHA's best within 2 % of the grid's ({best:.5f}): {'yes' if within else 'no'} "
            f"({', '.join(f'{f / best - 1:+.1%}' for f in found)})"
        )
        ratio = statistics.median(a.steps() / grid.steps() for a in ashas)
        show(f"trial-steps, ddpq ASHA / ddpq grid (goal <= 0.35): ratio: {ratio:.2f}")
    if rays:
        pairs = [a.wall / r.wall for a, r in zip(ashas, rays, strict=False)]
        show(
            f"wall, submit to the sweep's end, ddpq ASHA / Ray ASHA (goal <= 1; rounds "
            f"{', '.join(f'{p:.2f}' for p in pairs)}): ratio: {statistics.median(pairs):.2f}"
        )
        steps = statistics.median(a.steps() / r.steps() for a, r in zip(ashas, rays, strict=False))
        show(f"trial-steps, ddpq ASHA / Ray ASHA: {steps:.2f}")


if __name__ == "__main__":
    main()
