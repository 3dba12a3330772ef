"""toy-regression: the training system of the DDP multi-GPU tutorial (seed 001).

A ``Linear(20, 1)`` fitted to a random regression data set with
DistributedDataParallel; a DistributedSampler shards the data and is told the
epoch (``set_epoch``) so every epoch is shuffled anew; rank 0 reports the loss
every step and saves ``model.module.state_dict()`` with the optimizer every
``--save-every`` epochs; a restarted run resumes from its last checkpoint.

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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ddpq import train
from recipes._common import Dist, parse_args, setup, teardown


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


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        data: DataLoader,
        lr: float,
        env: Dist,
        save_every: int,
        config: dict,
    ) -> None:
        self.env = env
        self.data = data
        self.model = DDP(
            model.to(env.device), device_ids=[env.local_rank] if env.device.type == "cuda" else None
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.save_every = save_every
        self.config = config
        self.epoch = 0
        self.step = 0
        snapshot = train.load_checkpoint(map_location=env.device)
        if snapshot is not None:
            self.model.module.load_state_dict(snapshot["model"])
            self.optimizer.load_state_dict(snapshot["optimizer"])
            self.epoch = snapshot["epoch"] + 1
            self.step = snapshot["step"]
            if env.is_master:
                print(f"resuming at epoch {self.epoch}, step {self.step}", flush=True)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch: int) -> None:
        sampler = self.data.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)
        for x, y in self.data:
            loss = self._run_batch(x.to(self.env.device), y.to(self.env.device))
            self.step += 1
            train.report(self.step, loss=loss, epoch=epoch)

    def _save_snapshot(self, epoch: int) -> None:
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch": epoch,
            "step": self.step,
            "config": self.config,
        }
        path = train.save_checkpoint(state, step=self.step, epoch=epoch)
        print(f"epoch {epoch} | step {self.step} | checkpoint saved at {path}", flush=True)

    def train(self, total_epochs: int) -> None:
        for epoch in range(self.epoch, total_epochs):
            self._run_epoch(epoch)
            last = epoch == total_epochs - 1
            if self.env.is_master and ((epoch + 1) % self.save_every == 0 or last):
                self._save_snapshot(epoch)


def main(argv: list[str] | None = None) -> None:
    args = parse_args("toy-regression", argv)
    env = setup()
    torch.manual_seed(args.seed)  # identical initial weights; DDP also broadcasts rank 0's
    dataset = RandomRegression(args.dataset_size, args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=False,
        sampler=DistributedSampler(
            dataset, num_replicas=env.world_size, rank=env.rank, seed=args.seed
        ),
    )
    trainer = Trainer(torch.nn.Linear(20, 1), loader, args.lr, env, args.save_every, vars(args))
    trainer.train(args.total_epochs)
    train.flush()
    teardown()


if __name__ == "__main__":
    main()
