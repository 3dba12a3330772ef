"""A Lightning program under ddpq (docs/frameworks.md): a small regression, 2 ranks.

torchrun --standalone --nproc-per-node 2 examples/frameworks/train_lightning.py
ddpq submit --entrypoint examples/frameworks/train_lightning.py --world-size 2
"""

import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpq.integrations.lightning import DdpqCallback, ckpt_path


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


if __name__ == "__main__":
    pl.seed_everything(0)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node,
        strategy="ddp" if per_node > 1 else "auto",
        max_epochs=3,
        log_every_n_steps=1,
        enable_progress_bar=False,  # ddpq draws the job's progress from its total steps
        callbacks=[DdpqCallback()],  # metrics, total steps, checkpoints registered
    )
    trainer.fit(Regressor(), data(), ckpt_path=ckpt_path())  # None on a first attempt
