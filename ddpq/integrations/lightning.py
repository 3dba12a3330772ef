"""Lightning under ddpq: one callback (docs/frameworks.md).

    from ddpq.integrations.lightning import DdpqCallback, ckpt_path

    trainer = Trainer(..., callbacks=[DdpqCallback()])
    trainer.fit(model, data, ckpt_path=ckpt_path())

The callback adds a logger of its own to the trainer's (those you pass stay as they are)
that reports every metric Lightning logs with its step and epoch, and the run's total
steps (``trainer.estimated_stepping_batches``) as training starts, through
``ddpq.train.report``. It points each ``ModelCheckpoint`` that has no ``dirpath`` of
its own at ``DDPQ_CHECKPOINT_DIR/lightning`` and registers every file one writes
(``ddpq.train.register_checkpoint``, with the global step): a retry resumes from the
newest, which ``ckpt_path()`` hands to ``fit`` (None on a first attempt: a fresh start).

A logger, not only a callback, because Lightning tells loggers, and only them, once a
checkpoint file is written (``after_save_checkpoint``); a callback, because only a
callback sees the trainer (the total steps, the checkpoint callbacks' directories) and
is one argument for the user. Both ``lightning.pytorch`` and ``pytorch_lightning``
work: the callback is built for whichever the program imported.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from ddpq import train
from ddpq.integrations import directory, register, report, total

__all__ = ["DdpqCallback", "ckpt_path"]

SUBDIR = "lightning"  # under DDPQ_CHECKPOINT_DIR


def ckpt_path() -> str | None:
    """The checkpoint a retry resumes from (``fit(..., ckpt_path=ckpt_path())``), or None."""
    path = train.resume_path()
    return None if path is None else str(path)


def _package() -> Any:
    """The Lightning the program uses: ``lightning.pytorch`` once it imported the unified
    package (its Trainer accepts only its own Callback class), else ``pytorch_lightning``."""
    if "lightning" in sys.modules or "lightning.pytorch" in sys.modules:
        import lightning.pytorch as unified

        return unified
    try:
        import pytorch_lightning as classic
    except ImportError:
        import lightning.pytorch as unified

        return unified
    return classic


class DdpqCallback:
    """``Trainer(callbacks=[DdpqCallback()])``: metrics, total steps and checkpoints to ddpq.

    ``checkpoints=False`` leaves every ModelCheckpoint's directory as it is (files written
    outside ``DDPQ_CHECKPOINT_DIR`` are not registered: no retry can resume from them)."""

    def __new__(cls, *, checkpoints: bool = True) -> Any:
        return _built(_package())(checkpoints=checkpoints)


@functools.cache
def _built(pl: Any) -> type:
    """The callback class for Lightning package ``pl`` (built once, on first use)."""

    class _Logger(pl.loggers.Logger):
        """The trainer's metrics to ddpq.train.report; each checkpoint file written to
        its callback, to register."""

        def __init__(self, owner: Any) -> None:
            super().__init__()
            self._owner = owner

        @property
        def name(self) -> str:
            return "ddpq"

        @property
        def version(self) -> str:
            return "0"

        @property
        def save_dir(self) -> str | None:
            # Lightning reads a trainer's log_dir from its first logger: keep its default.
            trainer = self._owner.trainer
            return None if trainer is None else str(trainer.default_root_dir)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass  # ddpq keeps metrics, not hyperparameters (the job's spec has its args)

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            # At the trainer's global step (the optimizer steps done, as a checkpoint's),
            # not Lightning's ``step``, which counts the batches before this one: a run's
            # last point is then its total, as ddpq's progress bar expects.
            values = dict(metrics)
            epoch = values.pop("epoch", None)
            at = self._owner.step() if self._owner.trainer is not None else step
            report(at or 0, values, epoch=None if epoch is None else float(epoch))

        def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
            self._owner.saved(checkpoint_callback)

    class Callback(pl.Callback):
        def __init__(self, checkpoints: bool = True) -> None:
            super().__init__()
            self.checkpoints = checkpoints
            self.trainer: Any = None

        def step(self) -> int:
            return 0 if self.trainer is None else int(self.trainer.global_step)

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            # Lightning runs checkpoint callbacks' setup last, so their directory is
            # still ours to choose here; a retry finds the same one (the job's).
            self.trainer = trainer
            if not any(isinstance(logger, _Logger) for logger in trainer.loggers):
                trainer.loggers = [*trainer.loggers, _Logger(self)]
            if self.checkpoints:
                for callback in trainer.checkpoint_callbacks:
                    if getattr(callback, "dirpath", "") is None:
                        callback.dirpath = str(directory(SUBDIR))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            steps = total(trainer.estimated_stepping_batches)
            if steps is not None:
                report(trainer.global_step, {}, total_steps=steps)

        def saved(self, checkpoint_callback: Any) -> None:
            path = getattr(checkpoint_callback, "_last_checkpoint_saved", "") or getattr(
                checkpoint_callback, "last_model_path", ""
            )
            if path and self.trainer is not None:
                register(path, step=self.step(), epoch=float(self.trainer.current_epoch))

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            train.flush()  # the last points and registrations before the program goes on

    Callback.__name__ = Callback.__qualname__ = "DdpqCallback"
    return Callback
