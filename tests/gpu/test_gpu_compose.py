"""`make gpu-check-compose`: docker-compose.yml as it is, on a GPU host with the NVIDIA
Container Toolkit: the real images, the worker's GPU reservation, a 2-GPU recipe job."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.compose.test_stack import Stack
from tests.gpu.conftest import Table
from worker.edges import nvml

if os.environ.get("DDPQ_GPU_CHECK_COMPOSE") != "1" or not nvml.inventory():
    pytest.skip(
        "no NVIDIA GPU here: the compose GPU check runs with `make gpu-check-compose` on a"
        " GPU host",
        allow_module_level=True,
    )

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("gpu-compose"))
    s.compose("down", "-v", "--remove-orphans")
    s.compose("build", timeout=3600)
    s.up()
    yield s
    s.user.close()
    s.compose("down", "-v", "--remove-orphans")


def test_the_compose_worker_has_the_hosts_gpus_and_a_recipe_learns_on_two(
    gpu_stack: Stack, table: Table
) -> None:
    listed = gpu_stack.compose("exec", "-T", "worker", "nvidia-smi", "-L").stdout
    assert listed.count("GPU ") >= 2, f"the worker's container sees: {listed}"
    jid = gpu_stack.submit(
        recipe="mlp-classifier",
        world_size=2,
        device="cuda",
        args=["--total-epochs", "20", "--save-every", "10"],
    )
    job = gpu_stack.ended(jid, timeout=900)
    log = gpu_stack.log(jid)
    assert job["status"] == "succeeded", (job, log[-3000:])
    assert "device cuda, precision" in log and len(job["gpus"]) == 2
    assert job["latest_metrics"]["values"]["test_accuracy"] >= 0.90
    table.add("compose", f"{len(listed.splitlines())} GPU(s) in the worker; 2-GPU job learned")
