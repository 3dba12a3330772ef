"""Why an attempt failed, in words (issue 30): which rank failed first and how, with its
own error, never torchrun's ChildFailedError. Read from real torchrun output
(tests/torchrun_samples, whose README says how each was made); the end-to-end check is
tests/test_e2e.py test_a_failure_after_init_names_the_exception."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import wait_for
from worker import tee
from worker.starting import torchrun
from worker.starting.logship import TAIL_LINES

SAMPLES = Path(__file__).parent / "torchrun_samples"


def _tail(name: str) -> list[str]:
    """The lines the runner keeps of an attempt's output (worker.starting.logship.pump)."""
    lines = (SAMPLES / name).read_text().splitlines()
    return [line.rstrip() for line in lines][-TAIL_LINES:]


RAISED = "rank 1 (local rank 1) failed first: ValueError: bad input"
KILLED = "rank 0 (local rank 0) failed first"  # the exit code says SIGKILL


@pytest.mark.parametrize(
    ("sample", "reason", "exit_code"),
    [
        ("tee-raise.txt", RAISED, 1),
        ("tee-kill.txt", KILLED, 137),
        ("tee-record.txt", RAISED, 1),  # the message from the rank's error file
        # torchrun's own table (no worker.tee, or the tee before issue 30)
        ("torch-table-raise.txt", RAISED, 1),
        ("torch-table-kill.txt", KILLED, 137),
    ],
)
def test_the_reason_names_the_rank_that_failed_first(
    sample: str, reason: str, exit_code: int
) -> None:
    tail = _tail(sample)
    assert torchrun.root_cause(tail) == reason
    # torchrun exits 1 whatever the rank's code; the outcome carries the rank's.
    assert torchrun.outcome(1, tail, None, None) == torchrun.Outcome(exit_code, "exited", reason)


def test_a_killed_rank_is_not_blamed_on_the_others_broken_connection() -> None:
    # In the kill sample rank 1 fails too, of the closed connection (a RuntimeError
    # naming gloo): that is the consequence, not the cause.
    tail = _tail("tee-kill.txt")
    assert any("RuntimeError" in line for line in tail)
    assert "RuntimeError" not in (torchrun.root_cause(tail) or "")


def test_the_tee_shows_no_child_failed_error_and_one_prefix_per_line() -> None:
    for name in ("tee-raise.txt", "tee-kill.txt", "tee-record.txt"):
        text = (SAMPLES / name).read_text()
        assert "ChildFailedError" not in text and "Traceback" in text, name
        assert "[rank1]: [rank1]:" not in text and "[rank0]: [rank0]:" not in text, name
    old = (SAMPLES / "torch-table-raise.txt").read_text()
    assert "[rank1]: [rank1]: ValueError: bad input" in old and "ChildFailedError" in old


def test_without_a_failed_rank_the_error_line_is_the_reason_but_never_child_failed() -> None:
    tail = [
        "Traceback (most recent call last):",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ]
    assert torchrun.root_cause(tail) is None
    tail = [
        "usage: train.py [-h] --lr LR",
        "train.py: error: the following arguments are required: --lr",
    ]
    assert torchrun.root_cause(tail) == tail[1]


@pytest.mark.parametrize(
    ("exitcode", "message", "words"),
    [
        (1, None, "rank 3 (local rank 1) exited with code 1"),
        (-9, None, "rank 3 (local rank 1) killed by SIGKILL"),
        (-15, "RuntimeError: x\n  y", "rank 3 (local rank 1) killed by SIGTERM: RuntimeError: x y"),
        (-99, None, "rank 3 (local rank 1) killed by signal 99"),
        (0, "ValueError: bad", "rank 3 (local rank 1) exited with code 0: ValueError: bad"),
    ],
)
def test_the_tee_line_and_its_reading_agree(exitcode: int, message: str | None, words: str) -> None:
    line = tee.failure_line(True, 3, 1, exitcode, message)
    assert line == f"[ddpq] first to fail: {words}"
    failed = torchrun.first_failure(
        ["[ddpq] also failed: rank 0 (local rank 0) killed by SIGTERM", line]
    )
    assert failed is not None
    assert (failed.rank, failed.local_rank, failed.exitcode) == (3, 1, exitcode)
    assert failed.said == (" ".join(message.split()) if message else None) and failed.others
    # The reason names the rank and its error; how it ended is the exit code's, which
    # the service words ("killed by SIGKILL ..., exit code 137: rank 3 ...").
    said = f": {failed.said}" if message else ""
    assert torchrun.root_cause([line]) == f"rank 3 (local rank 1) failed{said}"
    exit_status = exitcode if exitcode >= 0 else 128 - exitcode
    assert torchrun.outcome(1, [line], None, None).exit_code == exit_status


def test_failure_lines_put_the_first_to_fail_first_with_its_error_file() -> None:
    failures = {
        0: SimpleNamespace(local_rank=0, exitcode=-15, error_file="<N/A>", message="Signal 15"),
        1: SimpleNamespace(
            local_rank=1,
            exitcode=1,
            error_file="/x/error.json",
            message={"message": "ValueError: bad input", "extraInfo": {}},
        ),
    }
    assert tee.failure_lines(failures, 1) == [
        "[ddpq] first to fail: rank 1 (local rank 1) exited with code 1: ValueError: bad input",
        "[ddpq] also failed: rank 0 (local rank 0) killed by SIGTERM",
    ]


def test_the_first_to_fail_carries_its_own_error_line_from_its_recent_output() -> None:
    # With 8 ranks each printing a consequence traceback, the runner's tail of the whole
    # output may have lost the first rank's error line: the tee's line carries it.
    failures = {
        r: SimpleNamespace(local_rank=r, exitcode=1 if r == 3 else -15, error_file="<N/A>")
        for r in range(8)
    }
    recent = {
        "[rank3]: ": ["Traceback (most recent call last):", "KeyError: 'label'"],
        "[rank0]: ": ["RuntimeError: [gloo] Connection closed by peer"],
    }
    lines = tee.failure_lines(failures, 3, recent)
    assert (
        lines[0]
        == "[ddpq] first to fail: rank 3 (local rank 3) exited with code 1: KeyError: 'label'"
    )
    assert lines[1] == "[ddpq] also failed: rank 0 (local rank 0) killed by SIGTERM"
    noise = [f"[rank{r}]: RuntimeError: Connection reset by peer" for r in range(8)] * 10
    tail = [*noise, *lines][-TAIL_LINES:]
    assert torchrun.root_cause(tail) == "rank 3 (local rank 3) failed first: KeyError: 'label'"


def test_the_prefix_the_tee_looks_for_is_the_one_torchrun_is_given(tmp_path: Path) -> None:
    from tests.helpers import job_runner

    argv = torchrun.argv("python", job_runner(tmp_path, {"world_size": 2}).claim, [], [], tmp_path)
    assert (
        argv[argv.index("--log-line-prefix-template") + 1]
        == tee.PREFIX_TEMPLATE
        == "[rank${rank}]: "
    )


def test_a_line_torch_already_prefixed_gets_no_second_prefix(tmp_path: Path) -> None:
    out = tmp_path / "rank1.log"
    out.write_bytes(b"plain\n[rank1]: ValueError: bad input\n[rank0]: not mine\n")
    dst = io.StringIO()
    finished = threading.Event()
    finished.set()
    tee.tail_whole_lines("[rank1]: ", str(out), dst, finished, 0.01)
    assert dst.getvalue() == (
        "[rank1]: plain\n[rank1]: ValueError: bad input\n[rank1]: [rank0]: not mine\n"
    )


def _tee(tmp_path: Path, header: str, data: bytes) -> str:
    out = tmp_path / f"{abs(hash(header))}.log"
    out.write_bytes(data)
    dst = io.StringIO()
    finished = threading.Event()
    finished.set()
    tee.tail_whole_lines(header, str(out), dst, finished, 0.01)
    return dst.getvalue()


def test_a_progress_bar_is_its_latest_state_and_torch_s_own_prefix_is_not_doubled(
    tmp_path: Path,
) -> None:
    # tqdm redraws its line with \r and ends it once; a CRLF line; a bar wiped on the way
    # out (leave=False) by blanks; torch's C++ warnings already say "[rank1]:".
    bar = b"epoch 1\n\r  0%|          \r 50%|#####     \r100%|##########| 4/4\nafter\r\n"
    assert _tee(tmp_path, "[rank1]: ", bar) == (
        "[rank1]: epoch 1\n[rank1]: 100%|##########| 4/4\n[rank1]: after\n"
    )
    wiped = b"\r 50%|#####     \r          \rdone\n\r 10%|#   "
    assert _tee(tmp_path, "[rank0]: ", wiped) == "[rank0]: done\n[rank0]:  10%|#   \n"
    warned = b"[rank1]:[W1129 02:00:00 ProcessGroupGloo.cpp:42] Warning: slow\n"
    assert _tee(tmp_path, "[rank1]: ", warned) == (
        "[rank1]: [W1129 02:00:00 ProcessGroupGloo.cpp:42] Warning: slow\n"
    )


def test_a_running_bar_is_shown_now_and_then_on_rank_0_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a bar runs, its latest state is shown once each PROGRESS_EVERY_S, on rank 0
    only (every rank draws the same bar); as it ends, every rank's last state once."""
    monkeypatch.setattr(tee, "PROGRESS_EVERY_S", 0.05)
    shown = {}
    for header in ("[rank0]: ", "[rank1]: "):
        out = tmp_path / f"{header[1:6]}.log"
        out.write_bytes(b"")
        dst = io.StringIO()
        finished = threading.Event()
        tail = threading.Thread(
            target=tee.tail_whole_lines, args=(header, str(out), dst, finished, 0.005)
        )
        tail.start()
        with open(out, "ab", buffering=0) as f:
            for step in range(1, 4):
                f.write(f"\r{step * 25:3d}%|{'#' * step}".encode())
                if header == "[rank0]: ":  # shown before the next redraw
                    seen = f"{step * 25:3d}%|"
                    wait_for(lambda seen=seen: seen in dst.getvalue(), 10, f"state {step}")
            f.write(b"\r100%|####\n")
        finished.set()
        tail.join(10)
        shown[header] = dst.getvalue().splitlines()
    assert shown["[rank0]: "] == [
        "[rank0]:  25%|#",
        "[rank0]:  50%|##",
        "[rank0]:  75%|###",
        "[rank0]: 100%|####",
    ]
    assert shown["[rank1]: "] == ["[rank1]: 100%|####"]
