"""The program bench/sweep.py sweeps: an MLP learning a fixed random teacher network.

The data are made here, deterministically (seeded generators, no download): 16,384
training and 4,096 held-out points, x ~ N(0, I) in 8 dimensions, y = a fixed random
teacher (8-32-1, tanh) of x plus noise of standard deviation 0.1. The student is an MLP
of two hidden layers of ``width`` units (ReLU), trained with SGD (momentum 0.9) at
``lr`` on minibatches of 512 drawn by a seeded generator, on one thread, so a
configuration's losses are the same in every run. Every ``every`` steps it reports the
held-out mean squared error as ``loss``: what the sweep ranks and early stopping cuts on.
Too small a learning rate learns slowly, a large one fast; a wider net costs more a step.

Stopped (SIGTERM: a sweep pausing or pruning it, a preemption), it saves a checkpoint at
the step it stopped at (the net, the optimizer's momentum, the batch generator) and
exits 0; started with one, it resumes from it, so a trial paused at a rung and promoted
runs each step once and reports the losses an uninterrupted run would.

Run by ddpq (one rank under torchrun: ``--lr 0.01 --width 64 --steps 4800``, reporting
through ``ddpq.report``) and imported by bench/sweep_ray.py (``train`` with a callback
that calls Ray Tune's ``tune.report``): the same training either way.
"""

from __future__ import annotations

import argparse
import math
import signal
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DIM, TEACHER, NOISE = 8, 32, 0.1
TRAIN_POINTS, EVAL_POINTS, BATCH = 16_384, 4_096, 512
DIVERGED = 10.0  # the loss reported once training diverged: worst, yet a number


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of the teacher's function with noise, from ``seed``."""
    t = torch.Generator().manual_seed(0)  # the teacher: the same for every set
    w1 = torch.randn(DIM, TEACHER, generator=t) / math.sqrt(DIM) * 2
    w2 = torch.randn(TEACHER, 1, generator=t) / math.sqrt(TEACHER)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return x, torch.tanh(x @ w1) @ w2 + NOISE * torch.randn(n, 1, generator=g)


def student(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )


def train(
    lr: float,
    width: int,
    steps: int,
    every: int,
    report: Callable[[int, float], bool],
    resume: dict[str, Any] | None = None,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> float:
    """Train ``steps`` steps, calling ``report(step, held-out loss)`` every ``every``
    steps and at the last; stops early when it returns False, handing ``save`` the
    state to resume from (``resume``). The last loss reported."""
    torch.set_num_threads(1)  # trials run side by side, a core each
    torch.manual_seed(0)  # the same initial weights for every lr of a width
    x, y = data(TRAIN_POINTS, seed=1)
    x_eval, y_eval = data(EVAL_POINTS, seed=2)
    net = student(width)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    mse = nn.functional.mse_loss
    batches = torch.Generator().manual_seed(3)
    loss, first = math.nan, 1
    if resume is not None:
        net.load_state_dict(resume["net"])
        opt.load_state_dict(resume["opt"])
        batches.set_state(resume["batches"])
        loss, first = resume["loss"], resume["step"] + 1
    for step in range(first, steps + 1):
        idx = torch.randint(0, TRAIN_POINTS, (BATCH,), generator=batches)
        opt.zero_grad(set_to_none=True)
        mse(net(x[idx]), y[idx]).backward()
        opt.step()
        if step % every == 0 or step == steps:
            with torch.no_grad():
                loss = float(mse(net(x_eval), y_eval))
            if not math.isfinite(loss):
                loss = DIVERGED
            if not report(step, loss):
                if save is not None:
                    state = {"net": net.state_dict(), "opt": opt.state_dict()}
                    save({**state, "batches": batches.get_state(), "step": step, "loss": loss})
                break
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=20)
    args = ap.parse_args()
    import ddpq  # here, not above: Ray's side imports train() without ddpq

    stopped: list[int] = []
    # ddpq stops a trial it pauses or prunes with SIGTERM, inside the report of its rung.
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))

    def report(step: int, loss: float) -> bool:
        ddpq.report(step, loss=loss, total_steps=args.steps)
        return not stopped

    def save(state: dict[str, Any]) -> None:
        ddpq.save_checkpoint(state, step=state["step"])

    resume = ddpq.load_checkpoint()
    train(args.lr, args.width, args.steps, args.every, report, resume, save)


if __name__ == "__main__":
    main()
