"""A torch.compile program under ddpq (docs/frameworks.md): a small regression, 2 ranks.

torchrun --standalone --nproc-per-node 2 examples/frameworks/train_compile.py
ddpq submit --entrypoint examples/frameworks/train_compile.py --world-size 2
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpq

EPOCHS = 3

if __name__ == "__main__":
    dist.init_process_group("gloo")  # torchrun's ranks, on CPU
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    pairs = TensorDataset(x, y)
    sampler = DistributedSampler(pairs, shuffle=True, seed=0)
    data = DataLoader(pairs, batch_size=32, sampler=sampler)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)

    step = 0
    state = ddpq.load_checkpoint()  # a retry goes on from its checkpoint; None at first
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    # The module compiled, then wrapped: torch.compile of the DDP wrapper itself compiles
    # nothing in torch 2.14 (its forward never reaches the compiler: pytorch#140416).
    # Compiled at the first step; every batch has one shape, so it never compiles again.
    model = DDP(torch.compile(net, dynamic=False))

    for epoch in range(step // len(data), EPOCHS):
        sampler.set_epoch(epoch)  # each epoch's order from its number alone
        for xb, yb in data:
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            ddpq.report(step, loss=loss.detach(), epoch=epoch, total_steps=EPOCHS * len(data))
        # the uncompiled module's state: its keys as the model's, without "_orig_mod."
        state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        ddpq.save_checkpoint(state, step=step, epoch=epoch + 1)  # rank 0 saves, registers
    ddpq.flush()
    dist.destroy_process_group()
