"""What every recipe shares: its arguments from catalog.json, DDP set-up, and the training loop.

The loop (``Trainer``) is the DDP tutorial's (seed 001) without its two slips: it
resumes from the snapshot ddpq hands it (``DDPQ_RESUME_FROM``) and tells the
DistributedSampler the epoch, so every epoch is shuffled anew. Metrics are summed
on the device, all-reduced every ``--log-every`` optimizer steps and averaged over
every rank's samples before rank 0 reports them: no step waits for the device
except those.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from ddpq import train
from ddpq.catalog import catalog

_TYPES = {"int": int, "float": float, "str": str}


def parse_args(recipe: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the recipe's arguments as catalog.json declares them: bounds and choices included."""
    entry = catalog()[recipe]
    parser = argparse.ArgumentParser(prog=recipe, description=entry["description"])
    for arg in entry["args"]:
        parser.add_argument(
            arg["name"],
            type=_TYPES[arg["type"]],
            default=arg["default"],
            choices=arg.get("choices"),
            help=arg["help"],
        )
    ns = parser.parse_args(argv)
    for arg in entry["args"]:
        value = getattr(ns, arg["name"].lstrip("-").replace("-", "_"))
        if "min" in arg and value < arg["min"]:
            parser.error(f"argument {arg['name']}: must be at least {arg['min']}, got {value}")
        if "max" in arg and value > arg["max"]:
            parser.error(f"argument {arg['name']}: must be at most {arg['max']}, got {value}")
    return ns


def fail(recipe: str, message: str) -> NoReturn:
    """Stop as argparse does, ``RECIPE: error: MESSAGE`` and exit status 2.

    ddpq's worker makes that line the failed job's ``reason``.
    """
    print(f"{recipe}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def choose_precision(cuda: bool, bf16_supported: bool) -> str:
    """Mixed precision as the GPU allows: bf16 where it has bf16 units (Ampere and
    later), else fp16 with a GradScaler (V100, T4: bf16 there is emulated, slow, or
    refused); full fp32 on the CPU, where autocast buys nothing."""
    if not cuda:
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    precision: str = "fp32"  # choose_precision's answer for this device

    @property
    def is_master(self) -> bool:
        """Rank 0 does the logging and the checkpointing."""
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> AbstractContextManager[Any]:
        """The forward pass in bf16 or fp16 on a GPU (``precision``); fp32 on the CPU."""
        if self.precision in _AUTOCAST_DTYPE:
            return torch.autocast("cuda", dtype=_AUTOCAST_DTYPE[self.precision])
        return nullcontext()

    def grad_scaler(self) -> torch.amp.GradScaler:
        """fp16's gradients underflow without loss scaling; bf16's and fp32's do not
        (a disabled scaler passes everything through unchanged)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    def wrap(self, model: nn.Module) -> DDP:
        model = model.to(self.device)
        return DDP(model, device_ids=[self.local_rank] if self.cuda else None)


def setup() -> Dist:
    """Join the process group torchrun describes: nccl on a GPU, gloo on the CPU.

    ddpq's worker sets ``CUDA_VISIBLE_DEVICES`` to the GPUs the job holds and
    ``DDPQ_DEVICE`` to ``cuda`` or ``cpu``; a plain ``torchrun`` run picks CUDA
    when it is there.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    wanted = os.environ.get("DDPQ_DEVICE", "auto")
    use_cuda = wanted != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # TF32 matmuls: the precision mixed precision already gives up, at tensor-core speed.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        precision = choose_precision(True, torch.cuda.is_bf16_supported())
    else:
        device = torch.device("cpu")
        precision = choose_precision(False, False)
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend)
    else:
        # Plain ``python -m recipes.X``: a world of one, so the same DDP code path runs.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if rank == 0:
        print(f"device {device.type}, precision {precision}", flush=True)
    return Dist(rank, local_rank, world_size, device, precision)


def teardown() -> None:
    """Send what rank 0 reported, then leave the process group."""
    train.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_without_finalizing() -> NoReturn:
    """End a recipe's process after ``teardown``, skipping the interpreter's finalization.

    A gloo worker thread can still be dropping the last reference to a finished
    collective's tensor (the metric all-reduces hand it Python-owned tensors, unlike
    DDP's own buckets). If that happens while the interpreter finalizes, the decref
    cannot take the GIL, the thread is torn down inside C++ and std::terminate aborts
    the rank ("terminate called without an active exception", exit -6): a finished
    job failed. Seen here about once in 30 runs under load; a core dump showed
    ProcessGroupGloo::runLoop destroying an AsyncAllreduceWork during Py_FinalizeEx.
    Everything worth keeping is written and flushed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum ``values`` over all ranks in place (nothing to do in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def sharded_loader(
    dataset: Dataset[Any], env: Dist, *, batch_size: int, seed: int, workers: int = 0
) -> DataLoader[Any]:
    """A loader over this rank's share of ``dataset``, reshuffled each epoch by ``set_epoch``.

    Every rank gets the same number of batches (the sampler pads the last share), so
    collectives placed by step count line up across ranks.
    """
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=env.cuda,
    )


Batch = Sequence[torch.Tensor]


class Trainer:
    """The training loop every recipe runs; a recipe says how a batch becomes a loss.

    One optimizer step takes ``grad_accum`` micro-batches; on all but the last the
    gradients stay local (``no_sync``), so DDP all-reduces once per step. Rank 0
    saves ``model.module.state_dict()``, the optimizer, epoch, step and config every
    ``--save-every`` epochs and at the end; a snapshot found at start is resumed,
    step count included.
    """

    reports_accuracy = False

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        loader: DataLoader[Any],
        env: Dist,
        args: argparse.Namespace,
        *,
        grad_accum: int = 1,
        grad_clip: float = 0.0,
        lr_at: Callable[[int], float] | None = None,
    ) -> None:
        self.env = env
        self.loader = loader
        self.model = env.wrap(model)
        # Built once the parameters are on their device, as torch.optim expects.
        self.optimizer = make_optimizer(self.model.module)
        self.scaler = env.grad_scaler()
        self.save_every: int = args.save_every
        self.log_every: int = args.log_every
        self.config = vars(args)
        self.grad_accum = grad_accum
        self.grad_clip = grad_clip
        self.lr_at = lr_at
        self.extra_state: dict[str, Any] = {}
        # Sent once, with the first report: the job keeps it, and `ddpq watch` and the
        # dashboard draw their progress bar from it.
        self._total_steps: int | None = None
        self.epoch = 0
        self.step = 0
        self.snapshot = train.load_checkpoint(map_location=env.device)
        if self.snapshot is not None:
            self.model.module.load_state_dict(self.snapshot["model"])
            self.optimizer.load_state_dict(self.snapshot["optimizer"])
            if "scaler" in self.snapshot:  # the loss scale fp16 had found, not 65536 again
                self.scaler.load_state_dict(self.snapshot["scaler"])
            self.epoch = self.snapshot["epoch"] + 1
            self.step = self.snapshot["step"]
            self.say(f"resuming at epoch {self.epoch}, step {self.step}")
        self._reset_window()

    # ---- what a recipe defines -----------------------------------------------------

    def batch_loss(
        self, model: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's mean loss and, for a classifier, how many samples it got right."""
        raise NotImplementedError

    # ---- the loop ------------------------------------------------------------------

    def say(self, line: str) -> None:
        if self.env.is_master:
            print(line, flush=True)

    def train(self, total_epochs: int, *, val_set: Dataset[Any] | None = None) -> None:
        """Train up to ``total_epochs``; with ``val_set``, report its loss after every epoch."""
        steps_per_epoch = math.ceil(len(self.loader) / self.grad_accum)  # optimizer steps
        self._total_steps = total_epochs * steps_per_epoch
        for epoch in range(self.epoch, total_epochs):
            self._run_epoch(epoch)
            if val_set is not None:
                scores = self.evaluate(val_set)
                self.report(epoch, {f"val_{k}": v for k, v in scores.items()})
            if (epoch + 1) % self.save_every == 0 or epoch == total_epochs - 1:
                self._save_snapshot(epoch)
            self.epoch = epoch + 1

    def _run_epoch(self, epoch: int) -> None:
        sampler = self.loader.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)  # the tutorial's slip: without it every epoch repeats one order
        self.model.train()
        started = time.perf_counter()
        epoch_samples = 0
        n = len(self.loader)
        for i, batch in enumerate(self.loader):
            batch = [t.to(self.env.device, non_blocking=True) for t in batch]
            group_start = i - i % self.grad_accum
            group = min(self.grad_accum, n - group_start)
            last = i == group_start + group - 1
            # no_sync must cover the backward pass: that is where DDP all-reduces.
            with nullcontext() if last else self.model.no_sync():
                with self.env.autocast():
                    loss, correct = self.batch_loss(self.model, batch)
                self.scaler.scale(loss / group).backward()
            self._loss_sum += loss.detach().float()
            if correct is not None:
                self._correct += correct.detach()
            self._micro += 1
            self._samples += len(batch[0])
            epoch_samples += len(batch[0])
            if last:
                self._optimizer_step()
                if self.step % self.log_every == 0:
                    self._log_window(epoch)
        if self._micro:
            self._log_window(epoch)
        seconds = time.perf_counter() - started
        rate = epoch_samples * self.env.world_size / seconds
        train.report(self.step, epoch=epoch, epoch_time_s=seconds)
        self.say(f"epoch {epoch} done | step {self.step} | {seconds:.2f} s | {rate:.0f} samples/s")

    def _optimizer_step(self) -> None:
        if self.lr_at is not None:
            lr = self.lr_at(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)  # skipped if fp16 overflowed (inf/nan gradients)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def _reset_window(self) -> None:
        self._loss_sum = torch.zeros((), device=self.env.device)
        self._correct = torch.zeros((), device=self.env.device)
        self._micro = 0
        self._samples = 0
        self._window_started = time.perf_counter()

    def _log_window(self, epoch: int) -> None:
        """Average the window's metrics over all ranks; rank 0 reports and prints them.

        Collective: every rank calls it at the same steps. Every rank ran the same
        number of micro-batches of the same size (the sampler pads), so the global
        counts are the local ones times the world size.
        """
        sums = all_reduce_sum(torch.stack([self._loss_sum, self._correct.float()]))
        seconds = time.perf_counter() - self._window_started
        world = self.env.world_size
        values: dict[str, float] = {"loss": sums[0].item() / (self._micro * world)}
        if self.reports_accuracy:
            values["accuracy"] = sums[1].item() / (self._samples * world)
        values["samples_per_s"] = self._samples * world / seconds
        self.report(epoch, values)
        self._reset_window()

    def report(self, epoch: int, values: dict[str, float]) -> None:
        """Report at the current step (rank 0) and print the line (rank 0)."""
        total, self._total_steps = self._total_steps, None
        train.report(self.step, epoch=epoch, total_steps=total, **values)
        shown = " | ".join(
            f"{k} {v:.0f}" if abs(v) >= 1000 else f"{k} {v:.4g}" for k, v in values.items()
        )
        self.say(f"epoch {epoch} | step {self.step} | {shown}")

    @torch.no_grad()
    def evaluate(self, dataset: Dataset[Any], batch_size: int = 256) -> dict[str, float]:
        """Mean loss (and accuracy) of the model on ``dataset``, over all ranks.

        Each rank scores every ``world_size``-th sample (no padding, unlike the
        training sampler, so no sample counts twice) with the bare module: no DDP
        collective runs while the ranks' shares differ in length.
        """
        indices = range(self.env.rank, len(dataset), self.env.world_size)
        loader = DataLoader(Subset(dataset, indices), batch_size=batch_size)
        module = self.model.module
        module.eval()
        totals = torch.zeros(3, device=self.env.device)  # loss x samples, correct, samples
        for batch in loader:
            batch = [t.to(self.env.device, non_blocking=True) for t in batch]
            with self.env.autocast():
                loss, correct = self.batch_loss(module, batch)
            totals[0] += loss.float() * len(batch[0])
            if correct is not None:
                totals[1] += correct
            totals[2] += len(batch[0])
        module.train()
        all_reduce_sum(totals)
        loss_sum, correct_sum, count = totals.tolist()
        scores = {"loss": loss_sum / count}
        if self.reports_accuracy:
            scores["accuracy"] = correct_sum / count
        return scores

    def test(self, dataset: Dataset[Any], batch_size: int = 256) -> dict[str, float]:
        """Score the trained model on the held-out ``dataset``; rank 0 reports ``test_*``."""
        scores = {f"test_{k}": v for k, v in self.evaluate(dataset, batch_size).items()}
        self.report(max(self.epoch - 1, 0), scores)
        return scores

    def _save_snapshot(self, epoch: int) -> None:
        if not self.env.is_master:
            return
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **({"scaler": self.scaler.state_dict()} if self.scaler.is_enabled() else {}),
            "epoch": epoch,
            "step": self.step,
            "config": self.config,
            **self.extra_state,
        }
        path = train.save_checkpoint(state, step=self.step, epoch=epoch)
        print(f"epoch {epoch} | step {self.step} | checkpoint saved at {path}", flush=True)


class Classifier(Trainer):
    """A Trainer for a model that maps inputs to class logits: cross-entropy and accuracy."""

    reports_accuracy = True

    def batch_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.float(), y), (logits.argmax(1) == y).sum()
