"""mlp-classifier: the small network of seeds 002 and 003, trained with DDP, then tested.

Seed 002 trains a three-layer perceptron (``NeuralNetwork``: two hidden layers of
30 and 20 units) and scores it on a held-out split at the end; seed 003 trains a
small ``SeqNet`` the same way but only names it (its code is included by
reference), so 002's network stands for both. The data are real and ship offline:
scikit-learn's handwritten digits (1797 images of 8x8 pixels, 10 classes, inside
the wheel). Every rank builds the same seeded train/test split; a DistributedSampler
shards the training part and is told the epoch. Rank 0 reports ``loss`` and
``accuracy`` (averaged over all ranks) every ``--log-every`` steps and
``test_loss``/``test_accuracy`` at the end, saves ``model.module.state_dict()``
with the optimizer every ``--save-every`` epochs, and a restarted run resumes.

Run it with torchrun (gloo on CPU, nccl with bf16 or fp16 autocast on GPUs):

    torchrun --standalone --nproc-per-node 2 -m recipes.mlp_classifier --total-epochs 30

or through ddpq:

    ddpq submit --recipe mlp-classifier --world-size 2 -- --total-epochs 30 --save-every 10
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from recipes._common import (
    Classifier,
    exit_without_finalizing,
    parse_args,
    setup,
    sharded_loader,
    teardown,
)


class NeuralNetwork(nn.Module):
    """Seed 002's network: two hidden layers of 30 and 20 units with ReLU."""

    def __init__(self, num_inputs: int, num_outputs: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(num_inputs, 30),
            nn.ReLU(),
            nn.Linear(30, 20),
            nn.ReLU(),
            nn.Linear(20, num_outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.layers(x)
        return logits


def digits(test_fraction: float, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits, pixels scaled to [0, 1], split the same way on every rank."""
    from sklearn.datasets import load_digits  # deferred: only this recipe needs scikit-learn

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(x) * test_fraction)
    test, fit = order[:n_test], order[n_test:]
    return TensorDataset(x[fit], y[fit]), TensorDataset(x[test], y[test])


def main(argv: list[str] | None = None) -> None:
    args = parse_args("mlp-classifier", argv)
    env = setup()
    torch.manual_seed(args.seed)  # identical initial weights; DDP also broadcasts rank 0's
    train_set, test_set = digits(args.test_fraction, args.seed)
    trainer = Classifier(
        NeuralNetwork(64, 10),
        lambda m: torch.optim.SGD(m.parameters(), lr=args.lr, momentum=args.momentum),
        sharded_loader(train_set, env, batch_size=args.batch_size, seed=args.seed),
        env,
        args,
    )
    trainer.train(args.total_epochs)
    trainer.test(test_set)
    teardown()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
