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

# ddpq.train's public calls, offered at the top: `import ddpq; ddpq.report(...)` or
# `from ddpq import report`; the same names as ddpq.train.__all__ (a test holds them equal).
_TRAIN = (
    "flush",
    "is_master",
    "latest_checkpoint",
    "load_checkpoint",
    "report",
    "save_checkpoint",
)
__all__ = ["__version__", *_TRAIN]


def __getattr__(name: str) -> Any:
    if name in _TRAIN:
        from ddpq import train

        return getattr(train, name)
    raise AttributeError(f"module 'ddpq' has no attribute {name!r}")
