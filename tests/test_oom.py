"""A rank SIGKILL ended is said to be out of memory only when the kernel's log says its OOM
killer did it (issue 42): worker.edges.oom reads /dev/kmsg for the rank's pid, which worker.tee
names. Before, every SIGKILL was "out of memory?", a person's `kill -9` too."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.queue.leases import exit_words
from tests.conftest import Server, _child_env, stop_process, terminal, wait_for, worker_argv
from worker.edges import oom
from worker.starting import torchrun

RECORDS = [
    b"6,1,1000,-;Linux version 6.18\n",
    b"3,2,5000000,-;Memory cgroup out of memory: Killed process 4242 (python3) "
    b"total-vm:900kB, anon-rss:800kB\n",
    b"3,3,9000000,-;Out of memory: Killed process 777 (python3) total-vm:1kB\n",
    b"4,4,9500000,-;oom_reaper: reaped process 777 (python3)\n",
]


def test_the_kernel_s_records_name_the_pids_its_oom_killer_killed() -> None:
    assert oom.killed_in(RECORDS) == {4242, 777}
    assert oom.killed_in(RECORDS, floor_us=6_000_000) == {777}  # since the attempt began
    assert oom.killed_in([b"garbage", b"6,5,1,-;Killed process 9 (x)\n"]) == set()


def test_a_cgroup_s_oom_kill_count_is_read_on_v1_and_v2(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    v1 = tmp_path / "memory" / "box" / "w"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    proc.write_text("9:name=systemd:/\n4:memory:/box/w\n0::/\n")
    assert oom.cgroup_oom_kills(str(tmp_path), str(proc)) == 3
    # A container's mount shows its own cgroup at the mount's root, not under its path.
    proc.write_text("4:memory:/elsewhere/x\n")
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill 7\n")
    assert oom.cgroup_oom_kills(str(tmp_path), str(proc)) == 7
    v2 = tmp_path / "unified" / "user.slice"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    proc.write_text("0::/user.slice\n")
    assert oom.cgroup_oom_kills(str(tmp_path), str(proc)) == 1
    proc.write_text("0::/nowhere\n")
    assert oom.cgroup_oom_kills(str(tmp_path / "none"), str(proc)) is None
    assert oom.cgroup_oom_kills(str(tmp_path), str(tmp_path / "no-proc-file")) is None


def test_where_the_kernel_s_log_is_unreadable_the_cgroup_s_count_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(oom, "_oom_kills", lambda since_s: None)
    monkeypatch.setattr(oom, "cgroup_oom_kills", lambda: 5)
    assert oom.killed_for_memory([4242], 1.0, kills_before=4) is True
    assert oom.killed_for_memory([4242], 1.0, kills_before=5) is False  # a person's kill -9
    assert oom.killed_for_memory([4242], 1.0, kills_before=None) is None
    monkeypatch.setattr(oom, "cgroup_oom_kills", lambda: None)
    assert oom.killed_for_memory([4242], 1.0, kills_before=4) is None  # still a question
    monkeypatch.setattr(oom, "_oom_kills", lambda since_s: {4242})
    assert oom.killed_for_memory([4242], 1.0, kills_before=None) is True  # the log first


def test_the_reason_says_what_the_worker_found() -> None:
    assert exit_words(137, True) == (
        "killed by SIGKILL: out of memory (the kernel's OOM killer), exit code 137"
    )
    assert exit_words(137, False) == "killed by SIGKILL, exit code 137"
    assert exit_words(137, None) == "killed by SIGKILL (out of memory?), exit code 137"
    assert exit_words(143, True) == "killed by SIGTERM, exit code 143"
    line = "[ddpq] first to fail: rank 1 (local rank 1) killed by SIGKILL (pid 4242): gone"
    failed = torchrun.first_failure([line])
    assert failed is not None and (failed.exitcode, failed.pid, failed.said) == (
        -signal.SIGKILL, 4242, "gone"
    )  # fmt: skip


# A rank that asks to be the OOM killer's choice, then eats memory until it is killed.
EATS = r"""
import os, time
print(f"rank {os.environ['RANK']} up", flush=True)
if os.environ["RANK"] == "1":
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    eaten = []
    while True:
        eaten.append(bytearray(64 << 20))
        for page in range(0, len(eaten[-1]), 4096):
            eaten[-1][page] = 1
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup of its own (v1 or v2), limited to 2 GiB: what runs in it is killed
    by the kernel's OOM killer, not the host's."""
    if os.geteuid() != 0 or oom.killed_for_memory([1]) is None:
        pytest.skip("needs root and the kernel's log (/dev/kmsg)")
    name = f"ddpq-oom-{uuid.uuid4().hex[:8]}"
    where = (
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),  # v1
        ("/sys/fs/cgroup/unified", "memory.max"),  # v2 beside v1
        ("/sys/fs/cgroup", "memory.max"),  # v2 alone
    )
    for root, limit in where:
        group = Path(root) / name
        try:
            group.mkdir()
            (group / limit).write_text(str(2 << 30))
        except OSError:
            if group.exists():
                group.rmdir()
            continue
        yield group
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 10, "empty")
        return
    pytest.skip("no memory cgroup can be made here")


@pytest.mark.long  # one real OOM kill: make test-long
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_rank_the_oom_killer_ended_is_said_to_be_out_of_memory(
    server: Server, memory_cgroup: Path, tmp_path: Path
) -> None:
    workspace, data = tmp_path / "ws", tmp_path / "data"
    workspace.mkdir()
    (workspace / "eats.py").write_text(EATS)
    argv = worker_argv(server, "oomw", workspace, data, "--cpu-slots", "2", "--gpus", "none")
    # The worker (and so its ranks) in the cgroup from its first instruction.
    procs = memory_cgroup / "cgroup.procs"
    shell = f'echo $$ > {procs} && exec "$@"'
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            ["sh", "-c", shell, "sh", *argv],
            env=_child_env({"DDPQ_WORKER_TOKEN": server.worker_token}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        c = server.client()
        spec = {"entrypoint": "eats.py", "world_size": 2, "device": "cpu", "max_attempts": 1}
        job = terminal(c, c.post("/jobs", json=spec).json()["id"], timeout=180)
        text = c.get(f"/jobs/{job['id']}/logs").text
        assert job["status"] == "failed" and job["exit_code"] == 137, (job, text)
        assert job["reason"].startswith(
            "killed by SIGKILL: out of memory (the kernel's OOM killer), exit code 137: "
            "rank 1 (local rank 1) failed first"
        ), (job["reason"], text)
    finally:
        stop_process(worker)
