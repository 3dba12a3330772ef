"""A plain torchrun DDP script with ddpq's in-training calls: the shape of a user's program.

It trains a small MLP on a synthetic regression task, reports the loss on rank 0,
checkpoints every ``--save-every`` steps, and resumes from ddpq's checkpoint
when it is restarted. The same file runs three ways:

    python examples/ddp_plain.py --steps 200                            # one process
    torchrun --standalone --nproc-per-node 2 examples/ddp_plain.py      # DDP, 2 ranks
    ddpq submit --entrypoint examples/ddp_plain.py --world-size 2 -- --steps 500

(the last with the worker's ``--workspace`` at this repository's root; ``ddpq up``
uses the current directory).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: never)")
    args = p.parse_args()
    if args.steps < 1 or args.batch_size < 1 or args.width < 1:
        p.error("--steps, --batch-size and --width must be positive")

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    ddp_model = DDP(model) if distributed else model
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr)
    teacher = torch.randn(32, 1)
    start = 0
    state = ddpq.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]

    g = torch.Generator().manual_seed(1000 + rank)
    first = last = 0.0
    for step in range(start + 1, args.steps + 1):
        if step == start + 1:
            first = time.perf_counter()
        x = torch.randn(args.batch_size, 32, generator=g)
        y = x @ teacher + 0.1 * torch.randn(args.batch_size, 1, generator=g)
        loss = nn.functional.mse_loss(ddp_model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # total_steps, once: the job keeps it; `ddpq watch` shows a progress bar from it.
        total = args.steps if step == start + 1 else None
        ddpq.report(step, loss=loss.detach(), total_steps=total)
        if args.save_every and step % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            ddpq.save_checkpoint(state, step=step)
        last = time.perf_counter()
    if rank == 0 and args.steps > start:
        # The loop's own time, first step to last (bench/overhead.py reads this line).
        print(f"trained {args.steps - start} steps in {last - first:.3f} s", flush=True)
    ddpq.flush()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
