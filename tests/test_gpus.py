"""The worker's GPUs come from NVML, never from torch. This machine has no GPU: a fake
``pynvml`` (tests/fakenvml/) stands in at that one edge; `make gpu-check` runs the real one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import Server, Worker, wait_for

FAKE_NVML = Path(__file__).resolve().parent / "fakenvml"
A100 = 80 * 1024**3


def fake_gpus(path: Path, n: int, **use: Any) -> Path:
    gpus = [
        {"uuid": f"GPU-{i:08x}-fake", "name": "NVIDIA A100-SXM4-80GB", "memory_total": A100, **use}
        for i in range(n)
    ]
    path.write_text(json.dumps({"gpus": gpus}))
    return path


def nvml_env(fake: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAKE_NVML), "DDPQ_FAKE_NVML": str(fake)}


def registered(server: Server, name: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        items = server.client().get("/workers").json()["items"]
        return next((w for w in items if w["name"] == name), None)

    w: dict[str, Any] = wait_for(found, 60, f"worker {name} to register")
    return w


def loaded(worker: Worker, library: str) -> bool:
    """Whether the worker process has mapped a shared library (torch's is libtorch)."""
    maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
    return library in maps


def test_the_worker_finds_its_gpus_through_nvml_without_torch(
    server: Server, start_worker: Any, tmp_path: Path
) -> None:
    fake = fake_gpus(tmp_path / "nvml.json", 4)
    worker = start_worker(server, name="gpu-host", gpus=None, env=nvml_env(fake))
    assert registered(server, "gpu-host")["gpus"] == [0, 1, 2, 3]
    assert not loaded(worker, "libtorch"), "the agent imported torch"


def test_without_nvml_a_worker_has_no_gpus_quietly(server: Server, start_worker: Any) -> None:
    worker = start_worker(server, name="cpu-host", gpus=None)
    assert registered(server, "cpu-host")["gpus"] == []
    assert "NVML" not in worker.log() and "Traceback" not in worker.log()
    assert not loaded(worker, "libtorch")
