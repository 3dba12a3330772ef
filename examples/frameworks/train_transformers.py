"""A Hugging Face Trainer program under ddpq (docs/frameworks.md): a small regression
model built here (no download), 2 ranks.

    torchrun --standalone --nproc-per-node 2 examples/frameworks/train_transformers.py
    ddpq submit --entrypoint examples/frameworks/train_transformers.py --world-size 2
"""

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments, set_seed

from ddpq.integrations.transformers import DdpqCallback, output_dir, resume_from_checkpoint


class Pairs(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


if __name__ == "__main__":
    set_seed(0)
    args = TrainingArguments(
        output_dir=output_dir(),  # checkpoint-<step> directories under DDPQ_CHECKPOINT_DIR
        use_cpu=True,
        per_device_train_batch_size=32,
        num_train_epochs=3,
        learning_rate=0.05,
        optim="sgd",
        max_grad_norm=0,  # no clipping, as the other examples
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="epoch",
        report_to="none",
        disable_tqdm=True,  # ddpq draws the job's progress from its total steps
    )
    trainer = Trainer(
        model=Regressor(), args=args, train_dataset=Pairs(), callbacks=[DdpqCallback()]
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint())  # None on a first attempt
