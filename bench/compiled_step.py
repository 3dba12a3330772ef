"""The program of bench/caches.py: a small MLP under DDP (gloo) and `torch.compile`, a few
training steps; rank 0 prints how long the first step took (its compilation: Dynamo's
tracing, then inductor's code, from its cache when the cache is warm) and what inductor's
FX graph cache found.

    torchrun --standalone --nproc-per-node 2 bench/compiled_step.py [STEPS]
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model: nn.Module = nn.Sequential(
    nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
# Compiled, then wrapped: inductor compiles the model's forward and backward, DDP
# all-reduces the gradients (Dynamo traced through a DDP module compiles nothing here).
step: nn.Module = torch.compile(model)  # type: ignore[assignment]
if distributed:
    step = nn.parallel.DistributedDataParallel(step)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
times = []
for _ in range(steps):
    began = time.perf_counter()
    loss = nn.functional.cross_entropy(step(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - began)
if not distributed or dist.get_rank() == 0:
    hits = counters["inductor"]["fxgraph_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"]
    print(
        f"FIRST_STEP_S {times[0]:.3f} next {min(times[1:] or [0]):.4f} "
        f"fxgraph hits {hits} misses {misses} loss {loss.item():.4f}",
        flush=True,
    )
if distributed:
    dist.destroy_process_group()
