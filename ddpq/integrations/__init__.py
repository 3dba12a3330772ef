"""ddpq for the frameworks people train with: Lightning, accelerate, ignite, Hugging Face.

One module per framework, each one argument or one import for its user
(docs/frameworks.md has a complete example of each):

    ddpq.integrations.lightning     DdpqCallback: Trainer(callbacks=[DdpqCallback()])
    ddpq.integrations.accelerate    DdpqTracker, project_config, save_state, load_state
    ddpq.integrations.ignite        DdpqHandler, DdpqCheckpoint
    ddpq.integrations.transformers  DdpqCallback: Trainer(callbacks=[DdpqCallback()])

Each reports what its framework logs through ``ddpq.train.report`` (the step, the
epoch, the run's total steps), registers the checkpoints the framework writes under
``DDPQ_CHECKPOINT_DIR`` with ``ddpq.train.register_checkpoint`` and hands
``ddpq.train.resume_path()`` to the framework's own resume. Outside a ddpq job they do
what ddpq.train does there: rank 0 prints a line now and then, nothing is sent.

No framework is a dependency of ddpq (``pip install 'ddpq[frameworks]'`` brings the
versions the tests ran with): this package imports none, and each module imports its
framework only when one of its names is first used, so ``import ddpq`` stays light and a
program that uses one framework never loads another. What they share is here: the
values a framework logs turned into a point, and a problem said once instead of
stopping a run (a metric name the API would refuse, a checkpoint written outside the
job's checkpoint directory, which no resume can reach).
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpq import train


@functools.cache
def say_once(message: str) -> None:
    """A problem of the integration's, said once per run on stderr (rank 0's lines reach
    the job's log), never raised into a training step."""
    print(f"ddpq: {message}", file=sys.stderr, flush=True)


def scalars(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values a framework logged that are metrics: numbers and one-element tensors
    (strings, lists, bools and larger tensors are left out)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, numbers.Real) or (
            callable(getattr(value, "item", None)) and _one_element(value)
        ):
            out[str(name)] = value
    return out


def _one_element(value: Any) -> bool:
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", 1)
    return bool(size == 1)


def report(
    step: int,
    values: Mapping[str, Any],
    *,
    epoch: float | None = None,
    total_steps: int | None = None,
) -> None:
    """ddpq.train.report of what a framework logged; a point the API would refuse (a name
    too long, more than 100 values) is said once and left out, not raised."""
    points = scalars(values)
    if not points and total_steps is None:
        return
    try:
        train.report(int(step), epoch=epoch, total_steps=total_steps, **points)
    except (TypeError, ValueError) as exc:
        say_once(f"a metric point left out ({exc})")


def total(value: Any) -> int | None:
    """A framework's estimate of the run's steps as report() takes it (None when it is
    unknown: an infinite or unset length)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")) or number < 1:
        return None
    return int(number)


def register(
    path: str | Path, *, step: int, epoch: float | None = None, keep: bool = False
) -> Path | None:
    """ddpq.train.register_checkpoint of a checkpoint a framework wrote, on rank 0; one it
    wrote outside the job's checkpoint directory is said once, not registered."""
    try:
        return train.register_checkpoint(path, step=int(step), epoch=epoch, keep=keep)
    except (ValueError, FileNotFoundError) as exc:
        say_once(f"checkpoint not registered: {exc}")
        return None


def directory(name: str) -> Path:
    """Where an integration points its framework's checkpoints: ``name`` under the job's
    checkpoint directory (``./checkpoints`` outside ddpq), absolute."""
    return (train.checkpoint_dir() / name).resolve()
