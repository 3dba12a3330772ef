"""The one-node Slurm cluster of tests/slurmcluster.py runs batch jobs and cancels them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.slurmcluster import Cluster

pytestmark = pytest.mark.slurm


def sleep_pids(job_id: str) -> list[int]:
    """The `sleep 300` processes that Slurm started for ``job_id`` (found by their
    SLURM_JOB_ID, so that another `sleep 300` on this machine does not count)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "cmdline").read_bytes() != b"sleep\x00300\x00":
                continue
            environ = (proc / "environ").read_bytes().split(b"\x00")
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:  # gone meanwhile
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and state != "Z":
            pids.append(int(proc.name))
    return pids


def test_batch_job_runs(slurm_clean: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job_id = slurm_clean.sbatch_wrap(f"echo hello from $SLURM_JOB_ID > {out}")
    assert slurm_clean.wait_state(job_id, "COMPLETED", timeout=30) == "COMPLETED"
    assert out.read_text() == f"hello from {job_id}\n"
    fields = slurm_clean.job(job_id)
    assert fields is not None and fields["ExitCode"] == "0:0"


def test_scancel_ends_the_job_and_its_processes(slurm_clean: Cluster) -> None:
    job_id = slurm_clean.sbatch_wrap("sleep 300", "--job-name=ddpq-test-sleep")
    slurm_clean.wait_state(job_id, "RUNNING", timeout=30)
    assert slurm_clean.ids_by_name("ddpq-test-sleep") == [job_id]
    deadline = time.monotonic() + 30
    while not sleep_pids(job_id):
        assert time.monotonic() < deadline, "the job's `sleep 300` never showed up in /proc"
        time.sleep(0.1)

    slurm_clean.scancel(job_id)
    assert slurm_clean.wait_state(job_id, "CANCELLED", timeout=30) == "CANCELLED"
    deadline = time.monotonic() + 30
    while pids := sleep_pids(job_id):
        assert time.monotonic() < deadline, f"`sleep 300` still running after scancel: {pids}"
        time.sleep(0.1)
    assert slurm_clean.ids_by_name("ddpq-test-sleep") == []
