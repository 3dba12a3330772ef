"""accelerate under ddpq: a tracker, and save_state/load_state that ddpq knows of
(docs/frameworks.md).

    from ddpq.integrations.accelerate import DdpqTracker, load_state, project_config, save_state

    accelerator = Accelerator(log_with=DdpqTracker(total_steps=steps),
                              project_config=project_config())
    accelerator.init_trackers("demo")
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    start = load_state(accelerator) or 0         # the step a retry resumes at
    ...
    accelerator.log({"loss": loss.item()}, step=step)
    save_state(accelerator, step=step)           # accelerator.save_state(), registered

``DdpqTracker`` is an ``accelerate.tracking.GeneralTracker``: what ``accelerator.log``
gets goes to ``ddpq.train.report`` (rank 0 only, as accelerate calls trackers).
``project_config()`` puts accelerate's checkpoints under ``DDPQ_CHECKPOINT_DIR/accelerate``
with automatic naming (``checkpoints/checkpoint_<n>``). ``save_state`` is
``accelerator.save_state`` followed by the registration of the directory it wrote, once
every process has written its part of it; ``load_state`` loads the directory
``ddpq.train.resume_path()`` names (nothing on a first attempt) and says at which step it
was saved, from the ``ddpq.json`` that ``save_state`` leaves in it.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from ddpq import train
from ddpq.integrations import directory, register, report

__all__ = ["DdpqTracker", "load_state", "project_config", "save_state"]

SUBDIR = "accelerate"  # under DDPQ_CHECKPOINT_DIR
MARKER = "ddpq.json"  # in a saved state's directory: the step and epoch it was saved at


class DdpqTracker:
    """``Accelerator(log_with=DdpqTracker())`` (or in a list with other trackers):
    ``accelerator.log(values, step=...)`` to ddpq. ``total_steps`` (or a ``total_steps``
    in ``init_trackers``' config) draws the job's progress bar."""

    def __new__(cls, total_steps: int | None = None) -> Any:
        return _tracker_class()(total_steps)


@functools.cache
def _tracker_class() -> type:
    from accelerate.tracking import GeneralTracker

    class Tracker(GeneralTracker):
        name = "ddpq"
        requires_logging_directory = False

        def __init__(self, total_steps: int | None) -> None:
            super().__init__()
            self.total_steps = total_steps
            self._next_step = 0

        @property
        def tracker(self) -> Any:
            return None  # nothing of a third party's behind it

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            steps = values.get("total_steps")
            if isinstance(steps, int) and not isinstance(steps, bool):
                self.total_steps = steps

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            if step is None:  # accelerate allows it: count the calls
                step = self._next_step
            self._next_step = int(step) + 1
            values = dict(values)
            epoch = values.pop("epoch", None)
            total, self.total_steps = self.total_steps, None  # sent once is enough
            report(step, values, epoch=epoch, total_steps=total)

        def finish(self) -> None:
            train.flush()

    Tracker.__name__ = Tracker.__qualname__ = "DdpqTracker"
    return Tracker


def project_config(**kwargs: Any) -> Any:
    """An ``accelerate.utils.ProjectConfiguration`` whose saved states go under the job's
    checkpoint directory, named automatically; ``kwargs`` are passed on (``total_limit``,
    ``logging_dir``, which otherwise is that directory too)."""
    from accelerate.utils import ProjectConfiguration

    kwargs.setdefault("project_dir", str(directory(SUBDIR)))
    kwargs.setdefault("automatic_checkpoint_naming", True)
    return ProjectConfiguration(**kwargs)


def save_state(
    accelerator: Any, *, step: int, epoch: float | None = None, keep: bool = False, **kwargs: Any
) -> Path:
    """``accelerator.save_state(**kwargs)`` on every process, then, once each has written
    its part (its random states go into the same directory), the directory registered by
    the main process with ``step``. Returns the directory."""
    where = Path(accelerator.save_state(**kwargs))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (where / MARKER).write_text(json.dumps({"step": int(step), "epoch": epoch}))
        register(where, step=step, epoch=epoch, keep=keep)
    return where


def load_state(accelerator: Any) -> int | None:
    """On every process: load the state a retry resumes from (``accelerator.load_state``)
    and return the step it was saved at; None, loading nothing, when there is none."""
    path = train.resume_path()
    if path is None or not path.is_dir():
        return None
    accelerator.load_state(str(path))
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        # save_state refuses to write over a checkpoint_<n>: go on after the newest here
        # (the resume point, or one an attempt that was cut off wrote after it).
        config.iteration = _next_iteration(path.parent)
    try:
        return int(json.loads((path / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _next_iteration(checkpoints: Path) -> int:
    numbers = [
        int(m.group(1))
        for p in checkpoints.iterdir()
        if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))
    ]
    return max(numbers, default=-1) + 1
