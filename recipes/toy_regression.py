"""toy-regression: the training system of the DDP multi-GPU tutorial (seed 001).

A ``Linear(20, 1)`` fitted to a random regression data set with
DistributedDataParallel; a DistributedSampler shards the data and is told the
epoch (``set_epoch``) so every epoch is shuffled anew; rank 0 reports the loss,
averaged over all ranks, every ``--log-every`` steps and saves
``model.module.state_dict()`` with the optimizer every ``--save-every`` epochs; a
restarted run resumes from its last checkpoint.

Unlike the tutorial, every rank builds the same data set (a seeded generator):
the sampler assumes all ranks index one data set.

Run it with torchrun (2 processes on this machine, gloo on CPU, nccl on GPUs):

    torchrun --standalone --nproc-per-node 2 -m recipes.toy_regression --total-epochs 50

or through ddpq:

    ddpq submit --recipe toy-regression --world-size 2 -- --total-epochs 50 --save-every 10
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from recipes._common import (
    Batch,
    Trainer,
    exit_without_finalizing,
    parse_args,
    setup,
    sharded_loader,
    teardown,
)


class RandomRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The tutorial's MyTrainDataset: (rand(20), rand(1)) pairs, the same on every rank."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 20, generator=g)
        self.y = torch.rand(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Regression(Trainer):
    def batch_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, None]:
        x, y = batch
        return F.mse_loss(model(x), y), None


def main(argv: list[str] | None = None) -> None:
    args = parse_args("toy-regression", argv)
    env = setup()
    torch.manual_seed(args.seed)  # identical initial weights; DDP also broadcasts rank 0's
    dataset = RandomRegression(args.dataset_size, args.seed)
    loader = sharded_loader(dataset, env, batch_size=args.batch_size, seed=args.seed)
    trainer = Regression(
        nn.Linear(20, 1), lambda m: torch.optim.SGD(m.parameters(), lr=args.lr), loader, env, args
    )
    trainer.train(args.total_epochs)
    teardown()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
