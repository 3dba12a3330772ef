"""Job arrays, as Slurm's --array=0-31%4: a sweep over one parameter, ``index``, whose
tasks run every index once, at most N at once, each seeing its index in
DDPQ_ARRAY_INDEX and as {index} in its args. On both databases through the worker
protocol driven by hand (a task that fails is counted, not retried by the array; the
array ends once every task has); malformed arrays and their neighbours are refused
naming the field, creating nothing; last, `ddpq submit --array` with a real worker
(SQLite: a worker's launch is most of its time)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import typer

from ddpq.cli.submit import _array
from ddpq.rules import MAX_ARRAY_TASKS, array_indices
from tests.conftest import Server, run_ddpq, start_server, stop_server, wait_for
from tests.test_sweeps import FAST, api, claim, ended, finish, made, sweep_of

__all__ = ["api"]  # the module-scoped API per database, shared with test_sweeps

ASHA = {"type": "asha", "min_steps": 5}
BASE = {"entrypoint": "task.py", "device": "cpu", "args": ["--seed", "{index}"]}


def test_indices_are_read_as_slurm_reads_them() -> None:
    assert array_indices("0-6:2,9") == [0, 2, 4, 6, 9]
    assert array_indices("3, 1-2,3") == [1, 2, 3]
    assert array_indices(f"0-{MAX_ARRAY_TASKS - 1}") == list(range(MAX_ARRAY_TASKS))
    for bad, words in (
        ("5-1", "a range goes up"),
        (f"0-{MAX_ARRAY_TASKS}", f"at most {MAX_ARRAY_TASKS} tasks"),
        ("0-2147483647", f"at most {MAX_ARRAY_TASKS} tasks"),  # counted, never made
        ("0-999,1000", f"at most {MAX_ARRAY_TASKS} tasks"),
        ("2147483648", "an index is at most"),
        ("a", "is not an index"),
        ("1-3:0", "a step is at least 1"),
        ("", "is not an index"),
    ):
        with pytest.raises(ValueError, match=words):
            array_indices(bad)
    assert _array("0-31%4", False, None, False) == ("0-31", 4)
    assert _array("1,3", False, None, False) == ("1,3", None)
    for bad in ("0-3%0", "0-3%x", "x%2"):
        with pytest.raises(typer.BadParameter):
            _array(bad, False, None, False)


def test_an_array_runs_every_index_once_at_most_n_at_once(api: Server) -> None:
    user = api.client()
    r = user.post(
        "/sweeps", json={"name": "arr", "job": BASE, "array": "0-6:2,9", "max_concurrent": 2}
    )
    assert r.status_code == 201, r.text
    sweep = r.json()
    spec = sweep["spec"]
    assert spec["array"] == "0-6:2,9" and spec["method"] == "grid" and spec["metric"] is None
    assert spec["space"] == {"index": {**spec["space"]["index"], "values": [0, 2, 4, 6, 9]}}
    assert sweep["max_trials"] == 5 and sweep["trials_made"] == 2
    seen: dict[int, dict[str, Any]] = {}
    worker = f"arrays-{sweep['id']}"
    while len(seen) < 5:
        held = []
        while (c := claim(api, worker)) is not None:
            held.append(c)
        assert 1 <= len(held) <= 2, "at most max_concurrent tasks at once"
        for c in held:
            job = user.get(f"/jobs/{c['job_id']}").json()
            index = job["spec"]["array_index"]
            assert job["spec"]["params"] == {"index": index}
            assert job["spec"]["name"] == f"arr/{index}"
            assert c["spec"]["args"] == ["--seed", str(index)], c["spec"]
            seen[index] = job
            # One task's program fails: the array counts it and goes on.
            finish(api, c, worker, exit_code=1 if index == 4 else 0)
        if len(seen) < 5:
            made(user, sweep["id"], min(len(seen) + 2, 5))
    assert sorted(seen) == [0, 2, 4, 6, 9], "every index once"
    done = ended(user, sweep["id"])
    assert done["status"] == "done", done
    assert done["reason"] == "every trial ended (4 complete, 1 failed)", done["reason"]
    assert done["best"] is None and all(t["rank"] is None for t in done["trials"])
    failed = [t for t in done["trials"] if t["state"] == "failed"]
    assert [t["params"] for t in failed] == [{"index": 4}]
    table = user.get(f"/sweeps/{sweep['id']}/export", params={"format": "csv"}).text
    assert table.splitlines()[0] == "rank,trial,job,state,status,value,step,param.index,reason"


def test_malformed_arrays_are_refused_naming_the_field(api: Server) -> None:
    user = api.client()
    before = user.get("/sweeps").json()["items"]
    index = {"type": "categorical", "values": [0, 1]}
    for body, field, words in (
        ({"array": "5-1"}, "array", "a range goes up"),
        ({"array": f"0-{MAX_ARRAY_TASKS}"}, "array", "at most"),
        ({"array": "0-3", "method": "random", "metric": "loss", "max_trials": 2}, "method", "grid"),
        ({"array": "0-3", "space": {"index": index}}, "space", "its indices"),
        ({"array": "0-3", "max_concurrent": 0}, "max_concurrent", "greater than or equal"),
        ({"array": "0-1", "space": {"index": index}, "job": {**BASE, "array_index": -1}},
         "array_index", "greater than or equal"),
        ({"space": {"x": index}, "method": "random", "max_trials": 2}, "metric", "to draw"),
        ({"space": {"x": index}, "method": "grid", "early_stopping": ASHA}, "metric", "stop early"),
    ):  # fmt: skip
        r = user.post("/sweeps", json={"job": BASE, **body})
        assert r.status_code == 422, (body, r.text)
        assert field in r.text and words in r.text, (body, r.text)
    # Given both, the same space is the array's.
    same = user.post("/sweeps", json={"job": BASE, "array": "0-1", "space": {"index": index}})
    assert same.status_code == 201, same.text
    user.post(f"/sweeps/{same.json()['id']}/cancel")
    assert len(user.get("/sweeps").json()["items"]) == len(before) + 1


TASK_PROGRAM = """
import os
import sys

index = int(os.environ["DDPQ_ARRAY_INDEX"])
assert sys.argv[1:] == ["--seed", str(index)], sys.argv
assert index in (1, 3), index
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_submit_array_runs_each_task_with_its_index(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    """`ddpq submit --array 1,3%1`: the code is sent once, each task's ranks see their
    index, one task at a time; `ddpq sweep status` shows the array."""
    server = start_server(db_url, tmp_path / "api", **FAST)
    try:
        start_worker(server, cpu_slots=2)
        code = tmp_path / "code"
        code.mkdir()
        (code / "task.py").write_text(textwrap.dedent(TASK_PROGRAM))
        env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
        submitted = run_ddpq(
            "submit", "--array", "1,3%1", "--entrypoint", "task.py", "--device", "cpu",
            "--name", "seeds", "--", "--seed", "{index}", env=env, cwd=code,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        assert "array 1,3 (sweep 1) running: 2 tasks, 1 at once" in submitted.stdout
        assert "tasks queued as jobs 1" in submitted.stdout, submitted.stdout
        done = wait_for(
            lambda: (s := sweep_of(server.client(), 1))["status"] != "running" and s,
            120,
            "the array to end",
        )
        assert done["status"] == "done", done
        assert sorted(t["state"] for t in done["trials"]) == ["complete", "complete"], done
        shown = run_ddpq("sweep", "status", "1", env=env)
        assert "array 1,3" in shown.stdout and "VALUE" in shown.stdout, shown.stdout
        refused = run_ddpq("submit", "--array", "0-3", "--wait", "--entrypoint", "t.py", env=env)
        assert refused.returncode == 2 and "--wait is for one job" in refused.stderr
    finally:
        stop_server(server)
