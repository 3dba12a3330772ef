"""resnet-cifar10: a torchvision ResNet on CIFAR-10, the training system of seed 004.

As the seed does: ``torchvision.models.resnet18`` (or ``resnet50``, ``--arch``) with
10 classes, ``torchvision.datasets.CIFAR10`` with the seed's augmentation (random
32x32 crop with 4 pixels of padding, horizontal flip, per-channel normalisation),
SGD with momentum 0.9 and weight decay 5e-4, a DistributedSampler told the epoch,
and the time of every epoch. Rank 0 reports ``loss``, ``accuracy`` and
``samples_per_s`` (averaged over all ranks) every ``--log-every`` steps,
``epoch_time_s`` after each epoch and ``test_loss``/``test_accuracy`` at the end,
and saves ``model.module.state_dict()`` with the optimizer every ``--save-every``
epochs; a restarted run resumes. On GPUs: nccl, bf16 or fp16 autocast, channels_last.

Unlike the seed, only one process per host downloads the data set (the seed had
every rank download into one directory at once), and a missing data set fails the
job with a message instead of a traceback.

The data: ``--data-dir`` holds ``cifar-10-batches-py`` (``data_batch_1`` to ``_5``,
``test_batch``, ``batches.meta``). With ``--data-check md5`` (the default)
torchvision checks every file's md5 sum and downloads the set (170 MB) when it is
missing and the host is online. ``--data-check presence`` reads any copy in that
format (a subset, a test fixture: see ``write_cifar10_format``) with torchvision's
own loader, checking only that the files exist, and never downloads.

The defaults (5,000 training images, 2 epochs, ResNet-18) take under a minute at
world size 2 on a 2-core CPU; ``--train-samples 0 --test-samples 0 --workers 8`` trains on the
whole set, as on a GPU host.

Run it with torchrun (gloo on CPU, nccl on GPUs):

    torchrun --standalone --nproc-per-node 2 -m recipes.resnet_cifar10 --data-dir data

or through ddpq (``--data-dir`` is relative to the worker's workspace):

    ddpq submit --recipe resnet-cifar10 --world-size 2 -- --arch resnet18 --data-dir data
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import Dataset, Subset
from torchvision import transforms as T
from torchvision.datasets import CIFAR10

from recipes._common import (
    Batch,
    Classifier,
    Dist,
    exit_without_finalizing,
    fail,
    parse_args,
    setup,
    sharded_loader,
    teardown,
)

RECIPE = "resnet-cifar10"
# The seed's normalisation: CIFAR-10's per-channel mean and standard deviation.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)
FILES = [name for name, _ in CIFAR10.train_list + CIFAR10.test_list] + [CIFAR10.meta["filename"]]


class PreparedCIFAR10(CIFAR10):
    """torchvision's CIFAR-10 loader, checking that the files exist instead of their md5 sums.

    torchvision's ``check_integrity`` skips the checksum when it is None; everything
    else (the pickles' parsing, the transforms) is torchvision's own.
    """

    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


def write_cifar10_format(
    root: Path,
    train: tuple[np.ndarray, Sequence[int]],
    test: tuple[np.ndarray, Sequence[int]],
) -> Path:
    """Write images (N x 32 x 32 x 3, uint8) in CIFAR-10's on-disk format under ``root``.

    What ``--data-check presence`` reads: five training batches, a test batch and
    the metadata, pickled as the published set is. Returns the batches' directory.
    """
    folder = Path(root) / CIFAR10.base_folder
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, obj: dict[str, Any]) -> None:
        with open(folder / name, "wb") as f:
            pickle.dump(obj, f, protocol=2)

    def rows(images: np.ndarray) -> np.ndarray:
        # The published layout: per image, 1024 red, then 1024 green, then 1024 blue bytes.
        return images.astype(np.uint8).transpose(0, 3, 1, 2).reshape(len(images), 3072)

    images, labels = train
    for i, part in enumerate(np.array_split(np.arange(len(images)), 5), start=1):
        data = {"data": rows(images[part]), "labels": [int(labels[j]) for j in part]}
        dump(f"data_batch_{i}", {"batch_label": f"training batch {i} of 5", **data})
    images, labels = test
    dump(
        "test_batch",
        {
            "batch_label": "testing batch 1 of 1",
            "data": rows(images),
            "labels": [int(x) for x in labels],
        },
    )
    names = [
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ]
    dump("batches.meta", {"label_names": names, "num_cases_per_batch": 10000, "num_vis": 3072})
    return folder


def fetch(root: Path, env: Dist) -> None:
    """Make sure an intact copy is under ``root``: one process per host downloads it."""
    if env.local_rank == 0:
        try:
            CIFAR10(root, train=False, download=True)  # a no-op when the md5 sums match
        except (OSError, RuntimeError) as exc:
            fail(
                RECIPE,
                f"argument --data-dir: no intact CIFAR-10 under {root / CIFAR10.base_folder} "
                f"and the download failed ({exc}); put the set there, or pass "
                "--data-check presence for a copy in CIFAR-10's format",
            )
    dist.barrier()


def load(root: Path, check: str, train: bool, limit: int, transform: Any) -> Dataset[Any]:
    cls = CIFAR10 if check == "md5" else PreparedCIFAR10
    try:
        data = cls(root, train=train, transform=transform)
    except (RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as exc:
        fail(RECIPE, f"argument --data-dir: {root / CIFAR10.base_folder} is not CIFAR-10: {exc!r}")
    return Subset(data, range(min(limit, len(data)))) if limit else data


class ImageClassifier(Classifier):
    channels_last = False

    def batch_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return super().batch_loss(model, (x, y))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(RECIPE, argv)
    root = Path(args.data_dir)
    if args.data_check == "presence":
        missing = [name for name in FILES if not (root / CIFAR10.base_folder / name).is_file()]
        if missing:
            fail(
                RECIPE,
                f"argument --data-dir: {root / CIFAR10.base_folder} lacks {', '.join(missing)} "
                "(--data-check presence never downloads)",
            )
    env = setup()
    if args.data_check == "md5":
        fetch(root, env)
    augment = T.Compose(
        [
            T.RandomCrop(32, padding=4),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ]
    )
    plain = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train_set = load(root, args.data_check, True, args.train_samples, augment)
    test_set = load(root, args.data_check, False, args.test_samples, plain)

    torch.manual_seed(args.seed)  # identical initial weights and per-rank augmentation streams
    model = getattr(torchvision.models, args.arch)(num_classes=10)
    if env.cuda:
        # Tensor cores want NHWC; on the CPU it measured no faster here.
        model = model.to(memory_format=torch.channels_last)
        torch.backends.cudnn.benchmark = True  # fixed 32x32 inputs: pick the fastest kernels once
    trainer = ImageClassifier(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4),
        sharded_loader(
            train_set, env, batch_size=args.batch_size, seed=args.seed, workers=args.workers
        ),
        env,
        args,
    )
    trainer.channels_last = env.cuda
    trainer.train(args.total_epochs)
    trainer.test(test_set)
    teardown()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
