"""Ray Tune's side of bench/sweep.py, run by the Ray venv's Python (``--ray DIR``).

    RAY_VENV/bin/python bench/sweep_ray.py PLAN.json RESULT.json

PLAN.json (written by bench/sweep.py): the grid's points in the order ddpq's grid runs
them, steps, every, the rungs (min_steps, reduction factor), max_concurrent, a warm-up.
It starts a local Ray (2 CPUs, as the machine has), runs a small untimed warm-up
experiment (as ddpq runs a warm-up job), then times ``Tuner.fit()`` of the grid under
``ASHAScheduler`` (time_attr ``step``, grace_period = min_steps, max_t = steps), one CPU
a trial, ``max_concurrent_trials`` as given. The trainable is sweep_train.train, the
same code ddpq's trials run, reporting ``tune.report({"loss", "step"})`` at the same
steps. RESULT.json: the wall time of fit() and each trial's last step and loss.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_train import train


def trainable(config: dict[str, Any]) -> None:
    point = config["point"]

    def report(step: int, loss: float) -> bool:
        tune.report({"loss": loss, "step": step})
        return True  # ASHA stops the trial's actor itself

    train(point["lr"], point["width"], config["steps"], config["every"], report)


def fit(plan: dict[str, Any], points: list[dict[str, Any]], steps: int, asha: bool) -> Any:
    scheduler = None
    if asha:
        scheduler = ASHAScheduler(
            time_attr="step",
            max_t=steps,
            grace_period=plan["min_steps"],
            reduction_factor=plan["reduction_factor"],
        )
    # One grid_search over the points, not one per parameter: Ray varies the first
    # parameter by name fastest, ddpq the last, and async successive halving decides by
    # the order trials reach a rung, so both sides must visit the points in one order.
    space = {"point": tune.grid_search(points), "steps": steps, "every": plan["every"]}
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}),
        param_space=space,
        tune_config=tune.TuneConfig(
            metric="loss",
            mode="min",
            scheduler=scheduler,
            max_concurrent_trials=plan["max_concurrent"],
            reuse_actors=plan["reuse_actors"],
        ),
        run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(prefix="ray-sweep-"), verbose=0),
    )
    return tuner.fit()


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    warm = [{"lr": p["lr"], "width": p["width"]} for p in plan["points"][:2]]
    fit(plan, warm, plan["every"], asha=False)
    t0 = time.time()
    grid = fit(plan, plan["points"], plan["steps"], asha=True)
    wall = time.time() - t0
    trials = []
    for r in grid:
        m = r.metrics or {}
        trials.append(
            {
                "lr": r.config["point"]["lr"],
                "width": r.config["point"]["width"],
                "step": int(m.get("step", 0)),
                "loss": m.get("loss"),
                "error": None if r.error is None else str(r.error)[:300],
            }
        )
    found = {"wall": wall, "trials": trials, "ray": ray.__version__}
    Path(sys.argv[2]).write_text(json.dumps(found))
    ray.shutdown()


if __name__ == "__main__":
    main()
