"""A job's directory across its attempts on one worker, and what its log says of it: a
retry prepared while the earlier attempt is still being stopped here (lost to the
service, or replaced) waits for that attempt's end and goes on in the directory it left;
the log's words hold whether or not the job goes on."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.test_code import Store, _manifest
from worker.files.code import Workdirs
from worker.files.outputs import Limits, where


def test_a_retry_waits_for_the_attempt_still_ending_here_and_goes_on_in_its_directory(
    tmp_path: Path,
) -> None:
    files = {"train.py": b"print('hi')\n"}
    store = Store(files)
    dirs = Workdirs(tmp_path / "data", cache_bytes=10**9, keep_s=0)
    first, _ = dirs.prepare(7, "s" * 64, lambda: _manifest(files), store.fetch)
    (first / "state.txt").write_text("written by attempt 1\n")
    got: list[tuple[Path, bool]] = []

    def retry() -> None:
        path, written = dirs.prepare(7, "s" * 64, lambda: _manifest(files), store.fetch)
        got.append((path, written.reused))

    t = threading.Thread(target=retry)
    t.start()
    t.join(0.5)  # the retry must still be waiting: attempt 1 has not ended
    assert t.is_alive() and not got
    dirs.attempt_ended(7)  # attempt 1's processes are gone: its directory is sealed
    t.join(30)
    assert got == [(first, True)]
    assert (first / "state.txt").read_text() == "written by attempt 1\n"


def test_the_log_says_where_the_directory_stays_whether_or_not_the_job_goes_on() -> None:
    lim = Limits(max_files=1, max_bytes=1, max_file_bytes=1, retention_s=7 * 86400, keep_newest=0)
    said = where(Path("/w/job-3"), lim)
    assert "a later attempt of the job here goes on in it" in said
    assert "once the job has ended it stays 7 d (DDPQ_WORKDIR_RETENTION)" in said
    assert "after the job ends" not in said
