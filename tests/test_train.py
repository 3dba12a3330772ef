"""ddpq.train from a real process against a real API.

A test that reports to a job of its own runs on the module's server of its database
(``api``, helpers.its_turn); one that stops or restarts the API has a server of its own."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    Server,
    _child_env,
    start_server,
    stop_process,
    stop_server,
    wait_for,
)
from tests.helpers import submit_and_claim

REPORTER = r"""
import sys
from ddpq import train
for step in range(1, 501):
    train.report(step, loss=1.0 / step, epoch=step // 100)
print("reported", flush=True)  # every report() returned while the API was down
assert train.flush(timeout=120), "not everything was sent"
print("flushed", flush=True)
"""


def test_reports_survive_an_api_outage(server: Server, db_url: str, tmp_path: Path) -> None:
    claim = submit_and_claim(server)
    port = int(server.url.rsplit(":", 1)[1])
    stop_process(server.proc)  # the API goes away before the first report
    out = tmp_path / "reporter.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", REPORTER],
            env=_child_env(
                {
                    "DDPQ_URL": server.url,
                    "DDPQ_JOB_ID": str(claim["job_id"]),
                    "DDPQ_JOB_TOKEN": claim["token"],
                    "RANK": "0",
                }
            ),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "reported" in out.read_text(), 30, "report() calls to return")
        assert proc.poll() is None, out.read_text()  # still holding the unsent points
        back = start_server(
            db_url, server.data_dir, port=port, tokens=(server.api_token, server.worker_token)
        )
        assert proc.wait(timeout=120) == 0, out.read_text()
        assert "flushed" in out.read_text()
        items = back.client().get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
        assert [i["step"] for i in items] == list(range(1, 501))
        assert items[-1]["values"]["loss"] == pytest.approx(1 / 500)
        stop_server(back)
    finally:
        stop_process(proc)


def _reporter(
    server: Server, claim: dict[str, object], code: str, out: Path, *args: str
) -> subprocess.Popen[bytes]:
    with open(out, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env=_child_env(
                {
                    "DDPQ_URL": server.url,
                    "DDPQ_JOB_ID": str(claim["job_id"]),
                    "DDPQ_JOB_TOKEN": str(claim["token"]),
                    "RANK": "0",
                }
            ),
            stdout=f,
            stderr=subprocess.STDOUT,
        )


ONE_BAD_POINT = r"""
from ddpq import train
for step in range(1, 51):
    train.report(step, loss=1.0 / step)
for bad in (lambda: train.report(-1, loss=0.0), lambda: train.report(51, **{"a\x00b": 1.0})):
    try:
        bad()
    except ValueError as exc:
        print("refused:", exc, flush=True)
# A point the API refuses although report() let it through (an older ddpq, say), in a
# batch with good ones: the batch is split, the good ones stored, the bad one counted.
train._get_sender().add_point({"step": -5, "epoch": None, "values": {"loss": 0.0}})
for step in range(51, 101):
    train.report(step, loss=1.0 / step)
assert train.flush(timeout=60)
print("flushed", flush=True)
"""


def test_one_bad_point_never_drops_good_ones(api: Server, tmp_path: Path) -> None:
    # It used to: 50 steps, report(-1, ...), 50 more stored 0 of 100, and flush() said True.
    claim = submit_and_claim(api)
    out = tmp_path / "out"
    proc = _reporter(api, claim, ONE_BAD_POINT, out)
    assert proc.wait(timeout=120) == 0, out.read_text()
    said = out.read_text()
    assert "refused: report(): step must be between 0 and 2**63 - 1, not -1" in said, said
    assert "refused: report(): a metric name has printable characters only" in said, said
    user = api.client()
    items = user.get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
    assert [i["step"] for i in items] == list(range(1, 101))
    assert user.get(f"/jobs/{claim['job_id']}").json()["metrics_dropped"] == 1


TOTAL_STEPS = r"""
from ddpq import train
train.report(0, total_steps=300)                     # the total alone, before any loss
for step in range(1, 11):
    train.report(step, loss=1.0 / step, total_steps=400 if step == 1 else None)
for bad in (0, -1, 2**63, 1.5, "400", True, 400.0):
    try:
        train.report(11, loss=0.1, total_steps=bad)
    except (TypeError, ValueError) as exc:
        print("refused:", type(exc).__name__, exc, flush=True)
try:
    train.report(11)
except ValueError as exc:
    print("refused:", type(exc).__name__, exc, flush=True)
assert train.flush(timeout=60)
print("flushed", flush=True)
"""


def test_total_steps_is_sent_as_the_jobs_and_checked_where_it_is_made(
    api: Server, tmp_path: Path
) -> None:
    claim = submit_and_claim(api)
    out = tmp_path / "out"
    proc = _reporter(api, claim, TOTAL_STEPS, out)
    assert proc.wait(timeout=120) == 0, out.read_text()
    refused = [line for line in out.read_text().splitlines() if line.startswith("refused:")]
    assert refused == [
        "refused: ValueError report(): total_steps must be between 1 and 2**63 - 1, not 0",
        "refused: ValueError report(): total_steps must be between 1 and 2**63 - 1, not -1",
        f"refused: ValueError report(): total_steps must be between 1 and 2**63 - 1, not {2**63}",
        "refused: TypeError total_steps must be an int, not float",
        "refused: TypeError total_steps must be an int, not str",
        "refused: TypeError total_steps must be an int, not bool",
        "refused: TypeError total_steps must be an int, not float",
        "refused: ValueError report(): a point needs at least one metric, e.g. "
        "report(step, loss=...)",
    ]
    user = api.client()
    job = user.get(f"/jobs/{claim['job_id']}").json()
    assert job["total_steps"] == 400 and job["metrics_dropped"] == 0
    assert job["latest_metrics"]["values"] == {"loss": 0.1}
    items = user.get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
    assert [i["step"] for i in items] == list(range(1, 11))
    assert all(set(i["values"]) == {"loss"} for i in items)


WIDE = r"""
from ddpq import train
for step in range(1, 3001):
    train.report(step, **{f"metric_{k:02d}_with_a_longish_name": step + k / 100 for k in range(41)})
print("reported", flush=True)
assert train.flush(timeout=240), "not everything was sent"
print("flushed", flush=True)
"""


def test_wide_points_across_an_api_restart_are_all_kept(
    server: Server, db_url: str, tmp_path: Path
) -> None:
    # 1000 points of 41 metrics pass the 1 MiB body cap: batched by count alone they got
    # 413 and were dropped (3000 steps of 40 metrics across a restart lost 2000).
    claim = submit_and_claim(server)
    port = int(server.url.rsplit(":", 1)[1])
    stop_process(server.proc)  # down while the points pile up
    out = tmp_path / "out"
    proc = _reporter(server, claim, WIDE, out)
    try:
        wait_for(lambda: "reported" in out.read_text(), 60, "report() calls to return")
        back = start_server(
            db_url, server.data_dir, port=port, tokens=(server.api_token, server.worker_token)
        )
        try:
            assert proc.wait(timeout=300) == 0, out.read_text()
            user = back.client()
            job = user.get(f"/jobs/{claim['job_id']}").json()
            assert job["metrics_dropped"] == 0, job
            r = user.get(
                f"/jobs/{claim['job_id']}/metrics", params={"name": "metric_40_with_a_longish_name"}
            )
            assert [i["step"] for i in r.json()["items"]] == list(range(1, 3001))
            assert job["latest_metrics"]["step"] == 3000
            assert len(job["latest_metrics"]["values"]) == 41
        finally:
            stop_server(back)
    finally:
        stop_process(proc)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_load_checkpoint_refuses_pickled_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from ddpq import train

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"model": _Evil()}, protocol=2))
    monkeypatch.setenv("DDPQ_RESUME_FROM", str(evil))
    with pytest.raises(pickle.UnpicklingError):
        train.load_checkpoint()
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2), "step": 3}, good)
    monkeypatch.setenv("DDPQ_RESUME_FROM", str(good))
    state = train.load_checkpoint()
    assert state["step"] == 3 and torch.equal(state["w"], torch.ones(2))
    monkeypatch.delenv("DDPQ_RESUME_FROM")
    assert train.load_checkpoint() is None


def test_without_a_server_train_is_a_plain_logger(tmp_path: Path) -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from ddpq import train\n"
        "train.report(1, loss=0.5)\n"
        "import torch\n"
        "p = train.save_checkpoint({'x': torch.zeros(1)}, step=1)\n"
        "print('saved', p)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_child_env({"DDPQ_CHECKPOINT_DIR": str(tmp_path / "ck")}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "step 1: loss=0.5" in r.stderr
    assert (tmp_path / "ck" / "step-000000001.pt").is_file()


def test_under_a_bare_torchrun_with_ddpq_url_exported_report_prints_and_never_raises(
    tmp_path: Path,
) -> None:
    """A CLI user exports DDPQ_URL (the README says so) and runs their script under a bare
    torchrun: no job id, no job token. report() prints as a plain run does and says why."""
    code = (
        "from ddpq import train\n"
        "train.report(1, loss=0.5)\n"
        "train.report(2, loss=0.25)\n"
        "assert train.flush(timeout=5)\n"
        "print('done')\n"
    )
    env = _child_env({"DDPQ_URL": "http://127.0.0.1:9", "DDPQ_TOKEN": "ddpq_u_x"})
    for leaked in ("DDPQ_JOB_ID", "DDPQ_JOB_TOKEN"):
        env.pop(leaked, None)
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr and "KeyError" not in r.stderr, r.stderr
    assert "step 1: loss=0.5" in r.stderr
    assert r.stderr.count("this run is not a ddpq job") == 1, r.stderr


FIRST_AT_ONCE = r"""
import sys, time
from pathlib import Path
import ddpq
import ddpq.train
ddpq.train.SEND_INTERVAL_S = 3600.0  # later points wait an hour to be batched; the first not
ddpq.report(0, loss=2.5, total_steps=100)
print("reported", flush=True)
go = Path(sys.argv[1])
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
ddpq.report(1, loss=2.0)
assert ddpq.flush(timeout=60)
print("flushed", flush=True)
"""


def test_the_first_point_is_sent_at_once(api: Server, tmp_path: Path) -> None:
    claim = submit_and_claim(api)
    out, go = tmp_path / "out", tmp_path / "go"
    proc = _reporter(api, claim, FIRST_AT_ONCE, out, str(go))
    try:
        user = api.client()

        def stored() -> list[int]:
            items = user.get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
            return [i["step"] for i in items]

        # While the program waits (and its batch interval is an hour), the point is there.
        assert wait_for(stored, 30, "the first point") == [0], out.read_text()
        go.touch()
        assert proc.wait(timeout=90) == 0, out.read_text()
        assert stored() == [0, 1]
    finally:
        stop_process(proc)


def test_a_bare_run_prints_the_first_point_then_a_line_now_and_then_and_the_last(
    tmp_path: Path,
) -> None:
    code = (
        "from ddpq import report\n"
        "for step in range(10_000):\n"
        "    report(step, loss=1.0 / (step + 1), epoch=step // 1000)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=_child_env({}), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("ddpq: step")]
    # 10,000 reports in well under PLAIN_INTERVAL_S (5 s): the first and the last only.
    assert lines[0] == "ddpq: step 0 epoch 0: loss=1", lines
    assert lines[-1] == "ddpq: step 9999 epoch 9: loss=0.0001", lines
    assert len(lines) <= 4, lines
    # Other ranks print nothing.
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_child_env({"RANK": "1"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "ddpq:" not in r.stderr, r.stderr


def test_ddpq_offers_the_in_training_calls_under_names_that_do_not_clash() -> None:
    import ddpq
    from ddpq import train

    for name in train.__all__:
        assert getattr(ddpq, name) is getattr(train, name)
    # In a fresh interpreter, before ddpq.train is loaded: the names, and submodules.
    code = (
        "import ddpq\n"
        "from ddpq import client, report\n"
        "from ddpq import train\n"
        "assert report is train.report and client.Client\n"
        "try:\n    ddpq.nothing\nexcept AttributeError:\n    print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=_child_env({}), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    # A script's own `def train(...)` no longer shadows anything it needs.
    namespace: dict[str, object] = {}
    exec("from ddpq import report, save_checkpoint, load_checkpoint\ndef train(): pass", namespace)
    assert namespace["report"] is train.report


def test_a_steady_run_is_sent_less_and_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """While points keep coming, the batches' interval doubles up to its cap (a steady run
    costs rank 0 and the API a request per STEADY_SEND_INTERVAL_S); a pause in the reports
    starts it again from SEND_INTERVAL_S."""
    import itertools
    import threading
    import time

    from ddpq import train

    monkeypatch.setattr(train, "SEND_INTERVAL_S", 0.05)
    monkeypatch.setattr(train, "STEADY_SEND_INTERVAL_S", 0.4)
    sent: list[float] = []

    def post(self: object, what: str, body: dict, judge: bool = False) -> None:
        sent.append(time.monotonic())

    monkeypatch.setattr(train._Sender, "_post", post)
    sender = train._Sender("http://127.0.0.1:9", "1", "x")
    stop = threading.Event()

    def steady() -> None:
        step = 0
        while not stop.wait(0.002):
            sender.add_point({"step": step, "epoch": None, "values": {"loss": 1.0}})
            step += 1

    def at_the_cap() -> bool:
        return len(sent) > 1 and sent[-1] - sent[-2] > 0.3

    feeder = threading.Thread(target=steady)
    feeder.start()
    try:
        wait_for(at_the_cap, 10, "the batches' interval to reach its cap", interval=0.05)
    finally:
        stop.set()
    feeder.join()
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert gaps[-1] > 0.3, gaps  # at the cap
    assert min(gaps) < 0.15, gaps  # the first batches went at the short interval
    assert sender.flush(5)
    time.sleep(1.0)  # a pause in the reports: the next point waits the short interval again
    before, at = len(sent), time.monotonic()
    sender.add_point({"step": 10**6, "epoch": None, "values": {"loss": 1.0}})
    while len(sent) == before and time.monotonic() - at < 5:
        time.sleep(0.01)
    assert time.monotonic() - at < 0.3, gaps
