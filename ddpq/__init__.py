"""ddpq: a queue and REST service for PyTorch distributed training jobs.

What users import: the in-training calls, ``from ddpq import report, save_checkpoint,
load_checkpoint`` (they live in ``ddpq.train``; these names do not clash with the
``def train(...)`` most training scripts have), and ``ddpq.client.Client`` (to submit
and follow jobs from Python). Importing ddpq loads neither the service nor the worker,
and loads ``ddpq.train`` only when one of its names is first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# ddpq.train's public calls (its __all__ is this list), offered at the top too:
# `import ddpq; ddpq.report(...)` or `from ddpq import report`.
TRAINING_CALLS = (
    "flush",
    "is_master",
    "latest_checkpoint",
    "load_checkpoint",
    "report",
    "save_checkpoint",
)
__all__ = ["TRAINING_CALLS", "__version__", *TRAINING_CALLS]


def __getattr__(name: str) -> Any:
    if name in TRAINING_CALLS:
        from ddpq import train

        return getattr(train, name)
    raise AttributeError(f"module 'ddpq' has no attribute {name!r}")
