"""A PyTorch-Ignite program under ddpq (docs/frameworks.md): a small regression, 2 ranks.

torchrun --standalone --nproc-per-node 2 examples/frameworks/train_ignite.py
ddpq submit --entrypoint examples/frameworks/train_ignite.py --world-size 2
"""

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from ignite.utils import manual_seed
from torch import nn
from torch.utils.data import TensorDataset

from ddpq.integrations.ignite import DdpqCheckpoint, DdpqHandler


def training(local_rank: int) -> None:
    manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    data = idist.auto_dataloader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model = idist.auto_model(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05))
    trainer = create_supervised_trainer(model, optimizer, nn.functional.mse_loss)

    DdpqHandler().attach(trainer)  # the loss of every iteration, the total iterations
    checkpoint = DdpqCheckpoint({"model": model, "optimizer": optimizer, "trainer": trainer})
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)  # saved and registered
    checkpoint.resume()  # a retry goes on from its checkpoint
    trainer.run(data, max_epochs=3)


if __name__ == "__main__":
    with idist.Parallel(backend="gloo") as parallel:  # torchrun's ranks, on CPU
        parallel.run(training)
