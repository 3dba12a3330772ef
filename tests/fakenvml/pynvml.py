"""A fake ``pynvml`` for tests: the one edge this machine (no GPU, no driver) cannot run.
Put this directory first on PYTHONPATH; ``DDPQ_FAKE_NVML`` names a JSON file that holds
the GPUs and their current use, read at every call so a test can change it while a
worker runs:

    {"gpus": [{"uuid": "GPU-...", "name": "NVIDIA A100", "memory_total": 85899345920,
               "utilization": 87, "memory_used": 1234}]}

Only what worker/edges/nvml.py calls is here, with pynvml's names and shapes.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


def _gpus() -> list[dict[str, Any]]:
    path = os.environ.get("DDPQ_FAKE_NVML")
    if not path:
        raise NVMLError("NVML Shared Library Not Found")
    with open(path) as f:
        gpus: list[dict[str, Any]] = json.load(f)["gpus"]
    return gpus


def nvmlInit() -> None:
    _gpus()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < len(_gpus()):
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_gpus()[handle]["uuid"])


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpus()[handle].get("name", "NVIDIA Fake GPU"))


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    g = _gpus()[handle]
    total = int(g.get("memory_total", 80 << 30))
    used = int(g.get("memory_used", 0))
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    g = _gpus()[handle]
    return SimpleNamespace(gpu=int(g.get("utilization", 0)), memory=0)


def nvmlDeviceGetMinorNumber(handle: int) -> int:
    return int(_gpus()[handle].get("minor", handle))
