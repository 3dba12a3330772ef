"""An accelerate program under ddpq (docs/frameworks.md): a small regression, 2 ranks.

torchrun --standalone --nproc-per-node 2 examples/frameworks/train_accelerate.py
ddpq submit --entrypoint examples/frameworks/train_accelerate.py --world-size 2
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpq.integrations.accelerate import DdpqTracker, load_state, project_config, save_state

EPOCHS = 3

if __name__ == "__main__":
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    accelerator = Accelerator(
        cpu=True,  # on a CPU host: gloo between the ranks (without it each trains alone)
        # each epoch's order from its number alone: a retry sees the batches a run would
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=DdpqTracker(),  # accelerator.log(...) to ddpq
        project_config=project_config(),  # saved states under DDPQ_CHECKPOINT_DIR
    )
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    accelerator.init_trackers("regression", config={"total_steps": EPOCHS * len(data)})
    step = load_state(accelerator) or 0  # a retry goes on from its checkpoint
    for epoch in range(step // len(data), EPOCHS):
        data.set_epoch(epoch)
        for x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            accelerator.log({"loss": loss.item(), "epoch": epoch}, step=step)
        save_state(accelerator, step=step, epoch=epoch + 1)  # saved and registered
    accelerator.end_training()
