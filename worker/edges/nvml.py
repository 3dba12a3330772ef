"""The worker's one edge to NVIDIA's management library (NVML, through ``nvidia-ml-py``'s
``pynvml``): which GPUs a host has, and how busy each one is.

NVML, not torch: it answers the same in a few MB, where ``import torch`` costs the agent
about 570 MB resident and initialises nothing it needs. Indices are NVML's (PCI bus
order, as ``nvidia-smi`` numbers them); jobs get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that
``CUDA_VISIBLE_DEVICES`` means the same GPUs to CUDA (worker/starting/torchrun.py).

Where there is no NVML (no driver, no GPU, the package missing) every call answers
"nothing" quietly: a CPU host is not an error. Tests put a fake ``pynvml`` module first on
the worker's path, the one thing this machine cannot run (tests/fakenvml/).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from types import ModuleType

log = logging.getLogger("ddpq.worker.nvml")


@dataclass(frozen=True)
class Gpu:
    """One GPU of the host, as NVML names it."""

    index: int
    uuid: str
    name: str
    memory_total: int  # bytes


@dataclass(frozen=True)
class GpuUse:
    """One GPU's use at one moment: NVML's utilisation over its last sample period (%),
    and the device memory in use (bytes), whoever holds it."""

    index: int
    uuid: str
    utilization: float
    memory_used: int
    memory_total: int


_lock = threading.Lock()
_nvml: ModuleType | None = None
_tried = False


def _library() -> ModuleType | None:
    """pynvml, initialised once per process; None where NVML cannot start."""
    global _nvml, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, a driver fault
                log.debug("no NVML here: %s", exc)
        return _nvml


def _text(value: str | bytes) -> str:
    # pynvml answers str in recent releases, bytes in older ones.
    return value.decode() if isinstance(value, bytes) else value


def inventory() -> list[Gpu]:
    """Every GPU NVML sees, in its index order; [] without NVML."""
    nv = _library()
    if nv is None:
        return []
    try:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                Gpu(
                    index=i,
                    uuid=_text(nv.nvmlDeviceGetUUID(h)),
                    name=_text(nv.nvmlDeviceGetName(h)),
                    memory_total=int(nv.nvmlDeviceGetMemoryInfo(h).total),
                )
            )
        return gpus
    except Exception as exc:
        log.warning("NVML could not list the GPUs: %s", exc)
        return []


def sample(indices: list[int] | tuple[int, ...]) -> list[GpuUse]:
    """The use of the GPUs at ``indices`` now; a GPU NVML cannot read is left out (one
    that fell off the bus must not stop the others' samples)."""
    nv = _library()
    if nv is None:
        return []
    out = []
    for i in indices:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append(
                GpuUse(
                    index=i,
                    uuid=_text(nv.nvmlDeviceGetUUID(h)),
                    utilization=float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
                    memory_used=int(mem.used),
                    memory_total=int(mem.total),
                )
            )
        except Exception as exc:
            log.debug("NVML could not read GPU %s: %s", i, exc)
    return out


def minor_number(index: int) -> int | None:
    """The minor number of the GPU at ``index``: its device node is /dev/nvidia<minor>,
    which need not be /dev/nvidia<index>; None without NVML or where it cannot say."""
    nv = _library()
    if nv is None:
        return None
    try:
        return int(nv.nvmlDeviceGetMinorNumber(nv.nvmlDeviceGetHandleByIndex(index)))
    except Exception as exc:  # an older or fake pynvml, a GPU that fell off the bus
        log.debug("NVML could not give GPU %s's minor number: %s", index, exc)
        return None
