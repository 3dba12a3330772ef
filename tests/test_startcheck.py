"""The walled worker's start check for GPUs, and its one line at start when unwalled.

A job's uid must be able to open the device nodes of the worker's GPUs
(worker.walled.startcheck.gpu_devices); a host with GPUs configured but no NVIDIA nodes (this
machine's fake GPUs) is not refused for them. A directory of stand-in nodes plays /dev:
plain files, since a device node on a `nodev` mount refuses every open, whatever its mode.
The rest of the start check is tests/test_walls.py's. Host tests, not database tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpq.errors import WallsError
from tests import test_walls
from tests.conftest import NO_JOBS, Server, _child_env, stop_process, wait_for, worker_argv
from tests.test_gpus import fake_gpus, nvml_env
from worker.edges import nvml
from worker.walled import startcheck
from worker.walled.walls import NEEDED_CAPS, Walls

# The fixtures: an API on SQLite, and a directory job uids can reach.
api = test_walls.api
host_dir = test_walls.host_dir


def stand_in_nodes(dev: Path, modes: dict[str, int]) -> Path:
    """``dev`` with a root-owned stand-in for each node of ``modes``, at that mode."""
    dev.mkdir(mode=0o755)
    for name, mode in modes.items():
        (dev / name).touch()
        (dev / name).chmod(mode)  # not left to the umask
    return dev


def test_a_walled_worker_refuses_to_start_where_a_job_could_not_open_its_gpus(
    tmp_path: Path, host_dir: Path
) -> None:
    """A GPU's node closed to others (root:root 0660, as a host that keeps GPUs to a group
    has it) refuses, naming that node and the fix; nodes the host does not have are not
    looked for; once the node is 0666 the check passes."""
    dev = stand_in_nodes(
        host_dir / "dev", {"nvidiactl": 0o666, "nvidia-uvm": 0o666, "nvidia1": 0o660}
    )
    devices = startcheck.gpu_devices([0, 1], dev)
    assert devices == [dev / "nvidiactl", dev / "nvidia-uvm", dev / "nvidia1"]  # no nvidia0
    walls = Walls((71150, 71159), tmp_path / "locks")
    with pytest.raises(WallsError) as refused:
        walls.check(sys.executable, [], [], [], devices=devices)
    said = str(refused.value)
    assert f"cannot open {dev / 'nvidia1'} (-rw-rw---- root:root)" in said, said
    assert "nvidiactl" not in said and "nvidia-uvm" not in said, said
    assert "NVreg_DeviceFileMode=0666" in said and "--job-uids off" in said, said
    (dev / "nvidia1").chmod(0o666)
    walls.check(sys.executable, [], [], [], devices=devices)


def test_a_gpus_node_is_the_one_of_its_minor_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = stand_in_nodes(tmp_path / "dev", {"nvidia0": 0o666, "nvidia1": 0o666})
    monkeypatch.setattr(nvml, "minor_number", {0: 1, 1: 0}.get)
    assert startcheck.gpu_devices([1], dev) == [dev / "nvidia0"]
    monkeypatch.setattr(nvml, "minor_number", lambda index: None)  # NVML cannot say
    assert startcheck.gpu_devices([1], dev) == [dev / "nvidia1"]
    assert startcheck.gpu_devices([], dev) == []


def test_a_walled_worker_with_gpus_but_no_nvidia_nodes_starts(api: Server, host_dir: Path) -> None:
    """The tests' fake GPUs (NVML answers, no /dev/nvidia* here): nothing to open, so
    nothing to refuse."""
    workspace = host_dir / "workspace"
    workspace.mkdir()
    fake = fake_gpus(host_dir / "nvml.json", 4)
    argv = worker_argv(
        api, "gpu-host", workspace, host_dir / "data",
        "--cpu-slots", "1", "--gpus", "0,1,2,3", "--job-uids", test_walls.TEST_UIDS,
    )  # fmt: skip
    log = host_dir / "worker.log"
    caps = test_walls.COMPOSE_CAPS
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["setpriv", f"--bounding-set={caps}", "--inh-caps=-all", "--", *argv],
            env=_child_env({"DDPQ_WORKER_TOKEN": api.worker_token, **nvml_env(fake), **NO_JOBS}),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        said = wait_for(
            lambda: proc.poll() is not None or "jobs run walled" in log.read_text(),
            60,
            "the worker to start or stop",
        )
        assert said and proc.poll() is None, log.read_text()
    finally:
        stop_process(proc)
    assert "cannot open" not in log.read_text(), log.read_text()


def test_an_unwalled_worker_names_every_capability_walls_need() -> None:
    line = Walls(None).describe()
    assert "NOT walled" in line, line
    for cap in NEEDED_CAPS:
        assert cap.upper() in line, line
