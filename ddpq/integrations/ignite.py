"""PyTorch-Ignite under ddpq: a handler for metrics, a Checkpoint ddpq knows of
(docs/frameworks.md).

    from ddpq.integrations.ignite import DdpqCheckpoint, DdpqHandler

    DdpqHandler().attach(trainer)                     # loss and metrics, every iteration
    checkpoint = DdpqCheckpoint({"model": model, "optimizer": optimizer, "trainer": trainer})
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    checkpoint.resume()                               # a retry goes on where it was saved
    trainer.run(data, max_epochs=epochs)

``DdpqHandler`` reports the engine's output (a number or a one-element tensor as
``loss``, or the numbers of a dict) and its metrics at the iteration, and the run's
total iterations as it starts. ``DdpqCheckpoint`` is ignite's ``Checkpoint`` saving
under ``DDPQ_CHECKPOINT_DIR/ignite`` and registering each file it writes with the
trainer's iteration; ``resume()`` loads ``ddpq.train.resume_path()`` into the objects
it saves (``Checkpoint.load_objects``; the trainer's own state included, so ``run``
goes on from there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpq import train
from ddpq.integrations import directory, register, report, scalars, total

__all__ = ["DdpqCheckpoint", "DdpqHandler"]

SUBDIR = "ignite"  # under DDPQ_CHECKPOINT_DIR


class DdpqHandler:
    """An ignite event handler that reports to ddpq.

    ``output_transform`` turns ``engine.state.output`` into a dict of values (by default
    a number is ``loss``, a dict's numbers are kept, anything else is left out);
    ``metric_names`` picks ``engine.state.metrics`` ("all", or a list); ``tag`` prefixes
    the names (``val/accuracy``); ``step_engine``, for an evaluator's handler, is the
    trainer whose iteration and epoch the values are reported at."""

    def __init__(
        self,
        output_transform: Callable[[Any], Mapping[str, Any]] | None = None,
        metric_names: str | Sequence[str] = "all",
        tag: str | None = None,
        step_engine: Any = None,
    ) -> None:
        self.output_transform = output_transform or _output
        self.metric_names = metric_names
        self.tag = tag
        self.step_engine = step_engine

    def attach(self, engine: Any, event_name: Any = None) -> DdpqHandler:
        """Report at ``event_name`` (every completed iteration by default) and, for a
        trainer (no ``step_engine``), its total iterations as it starts."""
        from ignite.engine import Events

        engine.add_event_handler(event_name or Events.ITERATION_COMPLETED, self)
        if self.step_engine is None:
            engine.add_event_handler(Events.STARTED, self.started)
        return self

    def started(self, engine: Any) -> None:
        state = engine.state
        steps = state.max_iters or (state.epoch_length or 0) * (state.max_epochs or 0)
        n = total(steps)
        if n is not None:
            report(state.iteration, {}, total_steps=n)

    def __call__(self, engine: Any) -> None:
        values = dict(scalars(self.output_transform(engine.state.output) or {}))
        metrics = engine.state.metrics or {}
        names = metrics if self.metric_names == "all" else self.metric_names
        values.update(scalars({n: metrics[n] for n in names if n in metrics}))
        if self.tag:
            values = {f"{self.tag}/{name}": v for name, v in values.items()}
        at = (self.step_engine or engine).state
        report(at.iteration, values, epoch=float(at.epoch))


def _output(output: Any) -> Mapping[str, Any]:
    if isinstance(output, Mapping):
        return output
    return scalars({"loss": output})


class DdpqCheckpoint:
    """ignite's ``Checkpoint(to_save, ...)`` into the job's checkpoint directory, each
    file registered with ddpq; ``kwargs`` are Checkpoint's (``n_saved``, ``score_function``,
    ``filename_prefix``...)."""

    def __new__(cls, to_save: Mapping[str, Any], **kwargs: Any) -> Any:
        return _checkpoint_class()(to_save, **kwargs)


@functools.cache
def _checkpoint_class() -> type:
    import ignite.distributed as idist
    from ignite.handlers import Checkpoint, DiskSaver

    class Saver(DiskSaver):
        """DiskSaver (atomic: a temporary name, then renamed), then the registration.
        A retry finds the files of the attempt before: not required empty."""

        def __init__(self, dirname: Path) -> None:
            super().__init__(dirname, require_empty=False)
            self.step, self.epoch = 0, 0.0

        def __call__(
            self, checkpoint: Mapping[str, Any], filename: str, metadata: Any = None
        ) -> None:
            super().__call__(checkpoint, filename, metadata)
            if idist.get_rank() == self.save_on_rank:
                register(self.dirname / filename, step=self.step, epoch=self.epoch)

    class Saving(Checkpoint):
        def __init__(self, to_save: Mapping[str, Any], save_handler: Any = None, **kwargs: Any):
            super().__init__(to_save, save_handler or Saver(directory(SUBDIR)), **kwargs)

        def __call__(self, engine: Any) -> None:
            # The step a checkpoint registers at is the trainer's iteration, whatever
            # ignite names the file by (a score, an epoch).
            if isinstance(self.save_handler, Saver):
                self.save_handler.step = int(engine.state.iteration)
                self.save_handler.epoch = float(engine.state.epoch)
            super().__call__(engine)

        def resume(self) -> bool:
            """Load the checkpoint a retry resumes from into the objects saved (every
            rank); False, loading nothing, when there is none."""
            path = train.resume_path()
            if path is None or not path.is_file():
                return False
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True)
            Checkpoint.load_objects(to_load=self.to_save, checkpoint=state)
            return True

    Saving.__name__ = Saving.__qualname__ = "DdpqCheckpoint"
    return Saving
