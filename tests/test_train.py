"""ddpq.train from a real process against a real API."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Server, _child_env, start_server, stop_process, stop_server, wait_for
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
