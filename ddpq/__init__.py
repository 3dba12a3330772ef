"""ddpq: a queue and REST service for PyTorch distributed training jobs.

What users import: the in-training calls, ``from ddpq import report, save_checkpoint,
load_checkpoint`` (they live in ``ddpq.train``; these names do not clash with the
``def train(...)`` most training scripts have), and ``ddpq.client.Client`` (to submit
and follow jobs from Python). Importing ddpq loads neither the service nor the worker,
and loads ``ddpq.train`` only when one of its names is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:
    """ddpq.train's public calls (its ``__all__``, the one list of them) offered at the
    top too: ``import ddpq; ddpq.report(...)`` or ``from ddpq import report``."""
    if not name.startswith("_") and name != "train":
        # import_module, not `from ddpq import train`: that asks this function again.
        train = importlib.import_module("ddpq.train")
        if name in train.__all__:
            return getattr(train, name)
    raise AttributeError(f"module 'ddpq' has no attribute {name!r}")
