"""Hugging Face's Trainer under ddpq: one callback (docs/frameworks.md).

    from ddpq.integrations.transformers import DdpqCallback, output_dir, resume_from_checkpoint

    args = TrainingArguments(output_dir=output_dir(), save_strategy="epoch", ...)
    trainer = Trainer(model=model, args=args, ..., callbacks=[DdpqCallback()])
    trainer.train(resume_from_checkpoint=resume_from_checkpoint())

``DdpqCallback`` reports what the Trainer logs (``loss``, ``learning_rate``,
``grad_norm``, evaluation metrics...) with its global step and epoch, and the run's
``max_steps`` as it starts; it registers each ``checkpoint-<step>`` directory the
Trainer saves under its ``output_dir``, once every rank has written its part (each
writes its own RNG state into it). ``output_dir()`` is ``DDPQ_CHECKPOINT_DIR/transformers``
(the directories there are ddpq's to keep or prune); ``resume_from_checkpoint()`` the
directory a retry resumes from, or None (a fresh start).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ddpq import train
from ddpq.integrations import directory, register, report, total

__all__ = ["DdpqCallback", "output_dir", "resume_from_checkpoint"]

SUBDIR = "transformers"  # under DDPQ_CHECKPOINT_DIR


def output_dir() -> str:
    """TrainingArguments' ``output_dir`` for checkpoints ddpq registers and resumes from."""
    return str(directory(SUBDIR))


def resume_from_checkpoint() -> str | None:
    """``trainer.train(resume_from_checkpoint=...)``: the checkpoint directory a retry
    resumes from, or None."""
    path = train.resume_path()
    return str(path) if path is not None and path.is_dir() else None


class DdpqCallback:
    """``Trainer(..., callbacks=[DdpqCallback()])``: logs, total steps and checkpoints to
    ddpq."""

    def __new__(cls) -> Any:
        return _callback_class()()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@functools.cache
def _callback_class() -> type:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class Callback(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps = total(state.max_steps)
            if steps is not None:
                report(state.global_step, {}, total_steps=steps)

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            values = dict(logs or {})
            epoch = values.pop("epoch", state.epoch)
            report(state.global_step, values, epoch=None if epoch is None else float(epoch))

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # Every rank calls on_save; rank 0 registers the directory once all of them
            # have written their part of it (the Trainer waits for none after the last).
            _barrier()
            if state.is_world_process_zero:
                path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
                if path.is_dir():
                    epoch = None if state.epoch is None else float(state.epoch)
                    register(path, step=state.global_step, epoch=epoch)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            train.flush()

    Callback.__name__ = Callback.__qualname__ = "DdpqCallback"
    return Callback
