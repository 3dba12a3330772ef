"""The whole path with real processes: ddpq serve, ddpq worker, torchrun (gloo, CPU).

One `ddpq serve` per database for the module (module_server), and one worker on it
(module_worker): each test runs its jobs to their end and looks only at those jobs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import Server, Worker, module_server, module_worker, terminal, wait_for
from tests.helpers import end_jobs_left
from worker.edges.procs import find_by_launch_id
from worker.executors import trace

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    yield from module_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def traced(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's --trace file: every test's jobs in one, each read by its job's id."""
    return tmp_path_factory.mktemp("trace") / "trace.jsonl"


@pytest.fixture(scope="module")
def worker(
    server: Server, traced: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    # The default kill grace (10 s): a polite job's torchrun must have time to stop its
    # ranks on SIGTERM (test_a_cancelled_job_says_so_in_one_line).
    yield from module_worker(server, tmp_path_factory, "--trace", str(traced))


@pytest.fixture(autouse=True)
def _jobs_end_with_their_test(server: Server, worker: Worker) -> Iterator[None]:
    assert worker.proc.poll() is None, worker.log()[-3000:]  # else every test times out
    yield
    end_jobs_left(server)


def traced_lines(traced: Path, job_id: int) -> list[dict]:
    return [item for item in trace.read(traced) if item["job_id"] == job_id]


def test_toy_regression_runs_to_success_and_reports_one_series(
    server: Server, worker: Worker, traced: Path
) -> None:
    c = server.client()
    r = c.post(
        "/jobs",
        json={
            "recipe": "toy-regression",
            "world_size": 2,
            "args": ["--total-epochs", "4", "--save-every", "2", "--log-every", "1"],
        },
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued"
    seen = {job["status"]}

    def observe() -> bool:
        status = c.get(f"/jobs/{job['id']}").json()["status"]
        seen.add(status)
        return status in ("succeeded", "failed", "cancelled")

    wait_for(observe, 120, "the job to end", interval=0.05)
    final = c.get(f"/jobs/{job['id']}").json()
    assert final["status"] == "succeeded", (
        final,
        c.get(f"/jobs/{job['id']}/logs").text,
        worker.log(),
    )
    assert "running" in seen
    assert final["exit_code"] == 0 and final["attempt"] == 1 and final["worker"] == worker.name
    assert final["started_at"] and final["finished_at"]

    # 2048 samples / (32 per rank x 2 ranks) = 32 steps an epoch, 4 epochs.
    assert final["latest_metrics"]["step"] == 128
    assert isinstance(final["latest_metrics"]["values"]["loss"], float)

    items = c.get(f"/jobs/{job['id']}/metrics").json()["items"]
    steps = [i["step"] for i in items]
    assert steps == list(range(1, 129)), "one series from rank 0, every step once"
    assert all(i["attempt"] == 1 for i in items)
    assert items[-1]["values"]["loss"] < items[0]["values"]["loss"]
    # Sent once, with the first report: the job's, for the progress bars, never a series.
    assert final["total_steps"] == 128
    assert not any("total_steps" in i["values"] for i in items)

    checkpoints = c.get(f"/jobs/{job['id']}/checkpoints").json()["items"]
    assert [ck["step"] for ck in checkpoints] == [64, 128]
    for ck in checkpoints:
        assert Path(ck["path"]).is_file()
        assert Path(ck["path"]).is_relative_to(
            worker.data_dir.resolve() / "checkpoints" / f"job-{job['id']}"
        )
    assert final["latest_checkpoint"]["step"] == 128

    log = c.get(f"/jobs/{job['id']}/logs").text
    assert "[rank0]: epoch 3 | step 128 | checkpoint saved" in log
    tail = c.get(f"/jobs/{job['id']}/logs", params={"offset": len(log.encode()) - 20})
    assert tail.content == log.encode()[-20:]
    assert int(tail.headers["X-Next-Offset"]) == len(log.encode())

    # --trace: the attempt's phases, every one reached, in order, within the job's own
    # stamps (the worker's clock is the API's here: one host). The first line is read
    # beside the supervisor: after the spawn and before the drain, maybe after the exit.
    at = wait_for(lambda: [t["at"] for t in traced_lines(traced, job["id"])], 30, "the trace")[0]
    assert sorted(at) == sorted(trace.PHASES)
    ordered = [p for p in trace.PHASES if p != "first_line"]
    assert [p for p in at if p != "first_line"] == ordered
    assert list(at.values()) == sorted(at.values())
    assert at["spawned"] <= at["first_line"] <= at["drained"]
    stamp = {k: datetime.fromisoformat(final[k]).timestamp() for k in ("started_at", "finished_at")}
    assert stamp["started_at"] - 1 <= at["claimed"] and at["shipped"] <= stamp["finished_at"] + 1


CANCEL_PROBE = r"""
import os, signal, sys, time
# A rank that shrugs off SIGTERM: the worker must still leave nothing behind.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = sys.argv[1]
with open(os.path.join(out, f"rank{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
print(f"rank {os.environ['RANK']} up", flush=True)
while True:
    time.sleep(0.2)
"""


def test_cancel_running_job_leaves_no_process_behind(
    server: Server, worker: Worker, tmp_path: Path, launcher: str
) -> None:
    (worker.workspace / "stubborn.py").write_text(CANCEL_PROBE)
    out = tmp_path / "pids"
    out.mkdir()
    c = server.client()
    job = c.post(
        "/jobs",
        json={
            "entrypoint": "stubborn.py",
            "world_size": 2,
            "args": [str(out)],
            "launcher": launcher,
        },
    ).json()
    wait_for(lambda: len(list(out.glob("rank*.pid"))) == 2, 60, "both ranks to start")
    pids = [int(p.read_text()) for p in out.glob("rank*.pid")]
    launch_id = worker.launch_id(job["id"])
    assert len(find_by_launch_id(launch_id)) >= 3  # torchrun and two ranks

    r = c.post(f"/jobs/{job['id']}/cancel")
    assert r.status_code == 202
    assert r.json()["status"] == "cancelling"
    final = terminal(c, job["id"], timeout=60)
    assert final["status"] == "cancelled", final
    # The ranks ignored SIGTERM: the exit status says they were killed.
    assert final["exit_code"] == 137, final
    log = c.get(f"/jobs/{job['id']}/logs").text
    assert (
        log.rstrip()
        .splitlines()[-1]
        .startswith("[ddpq] cancelled by user: stopped the ranks with SIGKILL in ")
    ), log[-2000:]
    # Once the job says cancelled, not one of its processes is left.
    assert find_by_launch_id(launch_id) == []
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        )


ECHO_PROGRAM = r"""
import json, os, sys
rank = os.environ["RANK"]
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDPQ_URL",
        "DDPQ_JOB_ID", "DDPQ_ATTEMPT", "DDPQ_CHECKPOINT_DIR", "DDPQ_JOB_TOKEN",
        "CUDA_VISIBLE_DEVICES", "MY_SETTING", "DDPQ_WORKER_TOKEN", "DDPQ_API_TOKEN"]
seen = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "cwd": os.getcwd()}
with open(f"rank{rank}.json", "w") as f:
    json.dump(seen, f)
if rank == "0" and "--fail" in sys.argv:
    raise ValueError("the data directory is empty")
"""


def test_entrypoint_gets_literal_args_and_ddpq_environment(server: Server, worker: Worker) -> None:
    (worker.workspace / "echo.py").write_text(ECHO_PROGRAM)
    c = server.client()
    args = ["; rm -rf /", "$(id)", "`id`", 'it\'s "quoted"', "two\nlines", "--flag=1"]
    job = c.post(
        "/jobs",
        json={"entrypoint": "echo.py", "world_size": 2, "args": args, "env": {"MY_SETTING": "x y"}},
    ).json()
    final = terminal(c, job["id"])
    assert final["status"] == "succeeded", c.get(f"/jobs/{job['id']}/logs").text
    for rank in ("0", "1"):
        seen = json.loads((worker.workspace / f"rank{rank}.json").read_text())
        assert seen["argv"] == args
        env = seen["env"]
        assert env["RANK"] == rank and env["WORLD_SIZE"] == "2"
        assert env["DDPQ_URL"] == server.url and env["DDPQ_JOB_ID"] == str(job["id"])
        assert env["DDPQ_ATTEMPT"] == "1" and env["DDPQ_JOB_TOKEN"].startswith("ddpqj_")
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["MY_SETTING"] == "x y"
        assert env["DDPQ_WORKER_TOKEN"] is None and env["DDPQ_API_TOKEN"] is None
        assert Path(env["DDPQ_CHECKPOINT_DIR"]).name == f"job-{job['id']}"
        assert os.path.realpath(seen["cwd"]) == os.path.realpath(worker.workspace)


def test_failed_program_says_why(server: Server, worker: Worker) -> None:
    (worker.workspace / "echo.py").write_text(ECHO_PROGRAM)
    c = server.client()
    job = c.post(
        "/jobs", json={"entrypoint": "echo.py", "world_size": 2, "args": ["--fail"]}
    ).json()
    final = terminal(c, job["id"])
    assert final["status"] == "failed"
    assert final["exit_code"] == 1
    assert "ValueError: the data directory is empty" in final["reason"]


def test_missing_entrypoint_fails_with_reason(server: Server, worker: Worker, traced: Path) -> None:
    c = server.client()
    job = c.post("/jobs", json={"entrypoint": "nope/train.py", "world_size": 1}).json()
    final = terminal(c, job["id"], timeout=30)
    assert final["status"] == "failed"
    assert "nope/train.py" in final["reason"] and "workspace" in final["reason"]
    # Traced as far as it went: it never got its program, so no process ran.
    [item] = wait_for(lambda: traced_lines(traced, job["id"]), 30, "the trace line")
    assert (item["job_id"], item["attempt"]) == (job["id"], 1)
    assert list(item["at"]) == ["claimed", "started", "held", "released", "kept", "shipped",
                                "reported"]  # fmt: skip


AFTER_INIT = r"""
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("labels and logits differ in shape: (32,) vs (32, 10)")
dist.barrier()  # rank 0 waits here until rank 1's failure ends the group
"""


def test_a_failure_after_init_names_the_exception(server: Server, worker: Worker) -> None:
    # Most real failures happen after init_process_group, where PyTorch's excepthook
    # prefixes a traceback's lines with "[rank1]: " as torchrun's tail does, and the
    # other rank fails too, of the broken connection: the reason names the rank that
    # failed first and its error (issue 30), and the log shows each line once with one
    # prefix, without torchrun's ChildFailedError traceback.
    (worker.workspace / "after_init.py").write_text(AFTER_INIT)
    c = server.client()
    job = c.post(
        "/jobs", json={"entrypoint": "after_init.py", "world_size": 2, "device": "cpu"}
    ).json()
    final = terminal(c, job["id"])
    log = c.get(f"/jobs/{job['id']}/logs").text
    assert final["status"] == "failed", final
    assert final["exit_code"] == 1, final
    assert final["reason"].startswith(
        "exited with code 1: rank 1 (local rank 1) failed first: "
        "ValueError: labels and logits differ"
    ), (final["reason"], log[-3000:])
    assert "ChildFailedError" not in final["reason"]
    lines = log.splitlines()
    error = "[rank1]: ValueError: labels and logits differ in shape: (32,) vs (32, 10)"
    assert lines.count(error) == 1, log
    assert not [line for line in lines if line.startswith(("[rank0]: [rank0]", "[rank1]: [rank1]"))]
    assert "ChildFailedError" not in log and "worker/tee.py" not in log, log
    first = "[ddpq] first to fail: rank 1 (local rank 1) exited with code 1: ValueError: labels"
    assert [line for line in lines if line.startswith(first)], log


POLITE = r"""
import os, time
print(f"rank {os.environ['RANK']} up", flush=True)
while True:
    time.sleep(0.2)
"""


def test_a_cancelled_job_says_so_in_one_line(server: Server, worker: Worker) -> None:
    # torchrun answers SIGTERM with a 30-line SignalException traceback and exit code 1;
    # the log ends instead with one [ddpq] line, and the exit status is SIGTERM's.
    (worker.workspace / "polite.py").write_text(POLITE)
    c = server.client()
    job = c.post("/jobs", json={"entrypoint": "polite.py", "world_size": 2, "device": "cpu"}).json()
    wait_for(lambda: "rank 1 up" in c.get(f"/jobs/{job['id']}/logs").text, 60, "the ranks")
    assert c.post(f"/jobs/{job['id']}/cancel").status_code == 202
    final = terminal(c, job["id"], timeout=60)
    assert final["status"] == "cancelled" and final["exit_code"] == 143, final
    log = c.get(f"/jobs/{job['id']}/logs").text
    assert "SignalException" not in log and "Traceback" not in log, log
    last = log.rstrip().splitlines()[-1]
    assert last.startswith("[ddpq] cancelled by user: stopped the ranks with SIGTERM in "), log


PIECES = r"""
import os, sys, time
rank = os.environ["RANK"]
for i in range(60):
    sys.stdout.write(f"r{rank} line {i} part one, ")
    sys.stdout.flush()
    if i % 20 == 0:
        time.sleep(0.5)  # torchrun's tail reads in between: the old tee split the line here
    sys.stdout.write("part two\n")
    sys.stdout.flush()
    print(f"r{rank} err {i}", file=sys.stderr, flush=True)
print("x" * 100_000)  # longer than one read
sys.stdout.write(f"r{rank} ends without a newline")
sys.stdout.flush()
"""


def test_rank_lines_arrive_whole_each_with_its_rank(server: Server, worker: Worker) -> None:
    (worker.workspace / "pieces.py").write_text(PIECES)
    c = server.client()
    job = c.post("/jobs", json={"entrypoint": "pieces.py", "world_size": 2}).json()
    final = terminal(c, job["id"])
    log = c.get(f"/jobs/{job['id']}/logs").text
    assert final["status"] == "succeeded", log
    ranks = [line for line in log.splitlines() if line.startswith("[rank")]
    expected = [
        f"[rank{r}]: {text}"
        for r in (0, 1)
        for text in (
            *(f"r{r} line {i} part one, part two" for i in range(60)),
            *(f"r{r} err {i}" for i in range(60)),
            "x" * 100_000,
            f"r{r} ends without a newline",
        )
    ]
    assert sorted(ranks) == sorted(expected), [x[:120] for x in set(ranks) ^ set(expected)]
    # Each rank's lines keep their order.
    for r in (0, 1):
        own = [x for x in ranks if x.startswith(f"[rank{r}]: r{r} line")]
        assert own == [f"[rank{r}]: r{r} line {i} part one, part two" for i in range(60)]
