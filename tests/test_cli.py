"""The `ddpq` CLI as a user runs it: subprocesses against a real `ddpq serve`.

Jobs run, log, report and end through the worker protocol driven by hand
(tests/helpers.py), so no torchrun is needed. One server for the module: every
test names its own jobs and its own hand worker, and leaves nothing queued. The
CLI is what is tested here, not the database: SQLite only.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpq.cli import live
from ddpq.cli.live import HISTORY_POINTS, SPARK_POINTS, _Watched, columns, sparkline, thin
from ddpq.client import Client
from tests.conftest import (
    REPO,
    Server,
    _child_env,
    free_port,
    run_ddpq,
    start_server,
    stop_process,
    stop_server,
    wait_for,
)
from tests.helpers import finish, register, report, send_log, submit_and_claim

SPARK = set("▁▂▃▄▅▆▇█")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("cli")
    s = start_server(f"sqlite:///{base / 'ddpq.db'}", base / "api")
    yield s
    stop_server(s)


@pytest.fixture(autouse=True)
def _nothing_left_queued(server: Server) -> Iterator[None]:
    # submit_and_claim claims the oldest queued job: a test's leftovers would be it.
    yield
    while Running.started:
        Running.started.pop().close()
    c = server.client()
    for job in c.get("/jobs", params={"status": "queued", "limit": 500}).json()["items"]:
        c.post(f"/jobs/{job['id']}/cancel")


def _vars(server: Server, **extra: str) -> dict[str, str]:
    """The variables that point `ddpq` at ``server`` as its user."""
    return {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token, **extra}


def ddpq(
    server: Server | None, *args: str, input: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    r = run_ddpq(*args, env=_vars(server, **env) if server else env, cwd=REPO, input=input)
    assert "Traceback" not in r.stderr, r.stderr  # errors are sentences, never tracebacks
    return r


class Running:
    """A `ddpq` command left running; its output is collected as it comes."""

    started: list[Running] = []

    def __init__(self, server: Server, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddpq.cli", *args],
            env=_child_env(_vars(server)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        self.out = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        Running.started.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(65536):
            self.out += chunk

    @property
    def text(self) -> str:
        return self.out.decode("utf-8", "replace")

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        assert self.proc.stderr is not None
        self.stderr = stderr = self.proc.stderr.read().decode()
        self.close()
        assert "Traceback" not in stderr, stderr
        return code

    def close(self) -> None:
        stop_process(self.proc, timeout=10)  # only if a failed test left it running
        self._reader.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def _job(server: Server, **spec: Any) -> dict[str, Any]:
    r = server.client().post("/jobs", json={"entrypoint": "train.py", **spec})
    assert r.status_code == 201, r.text
    job: dict[str, Any] = r.json()
    return job


# ---- submit ------------------------------------------------------------------------------


def test_submit_from_yaml_and_json_files_with_flags_over_them(
    server: Server, tmp_path: Path
) -> None:
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text(
        "name: from-yaml\n"
        "recipe: toy-regression\n"
        "world_size: 2\n"
        "args: [--total-epochs, 3]   # a number in argv is sent as text\n"
        "env: {OMP_NUM_THREADS: 1}\n"
        "priority: 5\n"
    )
    r = ddpq(server, "submit", "-f", str(yaml_file), "--json")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["spec"]
    assert spec["name"] == "from-yaml" and spec["recipe"] == "toy-regression"
    assert spec["world_size"] == 2 and spec["priority"] == 5
    assert spec["args"] == ["--total-epochs", "3"] and spec["env"] == {"OMP_NUM_THREADS": "1"}

    json_file = tmp_path / "job.json"
    json_file.write_text(
        json.dumps(
            {"name": "from-json", "recipe": "toy-regression", "args": ["--x"], "env": {"A": "1"}}
        )
    )
    # Flags override the file; -- ARGS replace its args; --env adds to its env; an
    # --entrypoint replaces the file's recipe rather than clash with it (--no-code: a
    # file of the worker's workspace, as no code is sent).
    r = ddpq(
        server,
        *["submit", "-f", str(json_file), "--world-size", "4", "--name", "renamed", "--no-code"],
        *["--entrypoint", "train.py", "--env", "B=2", "--json", "--", "--total-epochs", "1"],
    )
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["spec"]
    assert (spec["name"], spec["world_size"], spec["recipe"], spec["entrypoint"]) == (
        "renamed",
        4,
        None,
        "train.py",
    )
    assert spec["args"] == ["--total-epochs", "1"] and spec["env"] == {"A": "1", "B": "2"}

    r = ddpq(server, "submit", "-f", "-", "--name", "from-stdin", input='{"recipe": "char-gpt"}')
    assert r.returncode == 0, r.stderr
    assert "queued (char-gpt, world size 1)" in r.stdout

    # The example in the repository is a spec the API takes.
    r = ddpq(server, "submit", "-f", "examples/job.yaml", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["spec"]["recipe"] == "toy-regression"


def test_submit_refusals_name_the_field_and_change_nothing(server: Server, tmp_path: Path) -> None:
    before = server.client().get("/jobs", params={"limit": 500}).json()["items"]
    bad = tmp_path / "bad.yaml"
    for text, field in (
        ("recipe: toy-regression\nwold_size: 2\n", "wold_size"),  # unknown field
        ("recipe: toy-regression\nworld_size: 0\n", "world_size"),  # bad value
        ("recipe: toy-regression\nworld_size: '2'\n", "world_size"),  # wrong type
        ("recipe: no-such-recipe\n", "recipe"),
        ("entrypoint: /etc/passwd\n", "entrypoint"),
    ):
        bad.write_text(text)
        r = ddpq(server, "submit", "-f", str(bad))
        assert r.returncode == 1, (text, r.stdout, r.stderr)
        assert "HTTP 422" in r.stderr and f"{field}:" in r.stderr, (text, r.stderr)
    r = ddpq(server, "submit", "--recipe", "nope")
    assert r.returncode == 1 and "recipe" in r.stderr

    # Local mistakes are usage errors (2), with where they are.
    bad.write_text("recipe: [toy-regression\n")
    r = ddpq(server, "submit", "-f", str(bad))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "line 2" in r.stderr
    r = ddpq(server, "submit", "-f", "-", input='{"recipe": "toy-regression",}', **{})
    assert r.returncode == 2 and "line 1" in r.stderr, r.stderr
    bad.write_text("- recipe: toy-regression\n")
    r = ddpq(server, "submit", "-f", str(bad))
    assert r.returncode == 2 and "mapping" in r.stderr
    r = ddpq(server, "submit", "-f", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr
    r = ddpq(server, "submit", "--world-size", "2")
    assert r.returncode == 2 and "--recipe" in r.stderr
    r = ddpq(server, "submit", "--recipe", "toy-regression", "--entrypoint", "x.py")
    assert r.returncode == 2

    after = server.client().get("/jobs", params={"limit": 500}).json()["items"]
    assert len(after) == len(before)


def test_submit_wait_exits_4_when_the_job_is_cancelled(server: Server) -> None:
    run = Running(server, "submit", "--recipe", "toy-regression", "--name", "waited", "--wait")
    c = server.client()

    def submitted() -> int | None:
        items = c.get("/jobs", params={"status": "queued"}).json()["items"]
        return next((j["id"] for j in items if j["name"] == "waited"), None)

    job_id = wait_for(submitted, 30, "the submitted job")
    # The id at once, before anything happens to the job.
    wait_for(lambda: f"job {job_id} queued (toy-regression" in run.text, 30, "the job's id")
    c.post(f"/jobs/{job_id}/cancel")
    assert run.wait() == 4
    lines = run.text.splitlines()
    assert lines[0].startswith(f"job {job_id} queued (toy-regression, world size 1)"), lines
    # Then a line per change (stdout is not a terminal), the last the end.
    assert lines[-1].startswith(f"job {job_id} cancelled"), lines


def test_submit_wait_exits_5_at_once_when_no_worker_can_ever_run_the_job(server: Server) -> None:
    register(server, "two-slots", cpu_slots=2)
    too_big = ["--recipe", "toy-regression", "--world-size", "64", "--device", "cpu"]
    r = ddpq(server, "submit", *too_big, "--name", "too-big", "--wait")
    assert r.returncode == 5, (r.stdout, r.stderr)
    job_id = int(re.match(r"job (\d+) queued \(toy-regression, world size 64\)", r.stdout)[1])
    assert "no registered worker can ever run" in r.stderr, r.stderr
    assert "needs 64 CPU slots on one worker" in r.stderr, r.stderr
    assert f"ddpq cancel {job_id}" in r.stderr
    assert server.client().get(f"/jobs/{job_id}").json()["status"] == "queued"
    # --strict: refused, not queued.
    r = ddpq(server, "submit", *too_big, "--name", "too-big-strict", "--strict")
    assert r.returncode == 1 and "HTTP 409" in r.stderr and "unschedulable" in r.stderr, r.stderr
    named = server.client().get("/jobs", params={"name": "too-big-strict"}).json()["items"]
    assert named == []


def test_submit_wait_interrupted_says_the_job_goes_on_and_how_to_cancel(server: Server) -> None:
    run = Running(server, "submit", "--recipe", "toy-regression", "--name", "left", "--wait")
    seen = wait_for(lambda: re.search(r"job (\d+) queued", run.text), 30, "the job's id")
    job_id = int(seen[1])
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 130
    assert f"job {job_id} is still queued" in run.stderr, run.stderr
    assert f"ddpq cancel {job_id}" in run.stderr and f"ddpq watch {job_id}" in run.stderr
    assert server.client().get(f"/jobs/{job_id}").json()["status"] == "queued"


# ---- ls and workers -----------------------------------------------------------------------


def test_ls_filters_follows_cursors_and_prints_json(server: Server) -> None:
    c = server.client()
    old = _job(server, name="ls-needle-oldest")
    # More jobs than one page of a listing holds (50): the API filters by name, so
    # finding the oldest needs no cursor on the client's side.
    for i in range(52):
        _job(server, name=f"ls-hay-{i}")
    kept = _job(server, name="ls-needle-kept", world_size=2)
    gone = _job(server, name="ls-needle-gone")
    c.post(f"/jobs/{gone['id']}/cancel")

    r = ddpq(server, "ls", "--name", "ls-needle", "--json")
    assert r.returncode == 0, r.stderr
    page = json.loads(r.stdout)
    assert [j["id"] for j in page["items"]] == [gone["id"], kept["id"], old["id"]]
    assert page["next_cursor"] is None

    r = ddpq(server, "ls", "--name", "needle", "--status", "cancelled", "--json")
    assert [j["id"] for j in json.loads(r.stdout)["items"]] == [gone["id"]]
    r = ddpq(server, "ls", "--name", "NEEDLE", "-s", "queued", "-s", "cancelled", "--json")
    assert len(json.loads(r.stdout)["items"]) == 3
    r = ddpq(server, "ls", "--name", "ls-needle", "--limit", "2", "--json")
    page = json.loads(r.stdout)
    assert [j["id"] for j in page["items"]] == [gone["id"], kept["id"]]
    assert page["next_cursor"] == str(kept["id"])
    r = ddpq(server, "ls", "--name", "ls-needle", "--cursor", page["next_cursor"], "--json")
    assert [j["id"] for j in json.loads(r.stdout)["items"]] == [old["id"]]
    r = ddpq(server, "ls", "--limit", "3", "--json")
    assert [j["id"] for j in json.loads(r.stdout)["items"]] == [
        gone["id"],
        kept["id"],
        kept["id"] - 1,
    ]

    r = ddpq(server, "ls", "--name", "ls-needle")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == [
        "ID", "NAME", "OWNER", "PROGRAM", "STATUS", "ATTEMPT", "WORKER", "STEP", "LOSS", "AGE",
        "REASON",
    ]  # fmt: skip
    assert rows[0].split()[:5] == [
        str(gone["id"]), "ls-needle-gone", "admin", "train.py", "cancelled"
    ]  # fmt: skip
    assert "queued" in rows[1] and "in queue" in rows[1]  # why it waits

    r = ddpq(server, "ls", "--status", "sleeping")
    assert r.returncode == 1 and "status" in r.stderr and "sleeping" in r.stderr


def test_ls_shows_the_latest_loss_and_names_attempts_handed_back(server: Server) -> None:
    # Issue 30: the last report at a step carried only val_* values and LOSS was blank;
    # after a hand-back (no failure counted) ATTEMPT read `2/3`, as if one were counted.
    claim = submit_and_claim(server, name="hand", max_attempts=3)
    jid = claim["job_id"]
    c = server.client()
    report(server, claim, [{"step": 1, "values": {"loss": 0.25}}])
    report(server, claim, [{"step": 2, "values": {"val_loss": 0.75, "val_acc": 0.5}}])
    values = c.get(f"/jobs/{jid}").json()["latest_metrics"]["values"]
    assert values == {"loss": 0.25, "val_loss": 0.75, "val_acc": 0.5}
    # The worker hands the attempt back (its shutdown), and it is claimed again.
    r = server.client("worker").post(
        f"/workers/jobs/{jid}/finish",
        json={"worker": "hand", "attempt": 1, "outcome": "requeue"},
    )
    assert r.status_code == 200, r.text

    def row() -> list[str]:
        r = ddpq(server, "ls", "--name", "train.py", "--limit", "1")
        assert r.returncode == 0, r.stderr
        header, first = r.stdout.strip().splitlines()[:2]
        assert first.split()[0] == str(jid), r.stdout
        return [first[header.index(col) :].split("  ")[0].strip() for col in ("ATTEMPT", "LOSS")]

    assert row() == ["1 (1 handed back)/3", "0.25"]  # back in the queue
    again = server.client("worker").post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert again.status_code == 200 and again.json()["attempt"] == 2, again.text
    assert row() == ["2 (1 handed back)/3", "0.25"]
    finish(server, again.json(), exit_code=1)  # a failure, counted: named apart
    assert row() == ["2 (1 handed back)/3", "0.25"]


def test_workers_table_and_json(server: Server) -> None:
    claim = submit_and_claim(server, name="cli-workers")
    r = ddpq(server, "workers", "--json")
    assert r.returncode == 0, r.stderr
    mine = next(w for w in json.loads(r.stdout) if w["name"] == "cli-workers")
    assert [j["job_id"] for j in mine["running"]] == [claim["job_id"]]
    assert mine["cpu_slots"] == 8 and mine["free_cpu_slots"] == 7 and mine["alive"]
    r = ddpq(server, "workers")
    header, *rows = r.stdout.strip().splitlines()
    assert header.split()[:3] == ["NAME", "HOST", "STATE"]
    row = next(x for x in rows if x.split()[0] == "cli-workers")
    assert row.split()[2:4] == ["alive", "7/8"] and "ago" in row and str(claim["job_id"]) in row
    finish(server, claim, name="cli-workers")


# ---- data that would drive a terminal ------------------------------------------------------

# What a program can put in its own error line (copied into the job's reason), its
# output and a checkpoint's file name: an OSC that retitles the window, a bell, a
# clear-screen, a bidi override, a carriage return that forges a line, a C1 CSI.
HOSTILE = "job\x1b]0;TITLE\x07\x1b[2JX \u202eevil\r[ddpq] forged \x9b31m"
RAW_CONTROLS = ("\x1b", "\x07", "\u202e", "\r", "\x9b")


def _in_a_terminal(server: Server, *args: str) -> str:
    """What `ddpq ARGS` writes to a terminal (a pseudo-terminal: Rich styles included)."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpq.cli", *args],
        env=_child_env({**_vars(server), "COLUMNS": "200", "TERM": "xterm"}),
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    os.close(follower)
    got = b""
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(leader)
        _, stderr = proc.communicate(timeout=30)
    assert b"Traceback" not in stderr, stderr
    return got.decode("utf-8", "replace")


def test_control_characters_from_the_api_are_shown_escaped_everywhere(server: Server) -> None:
    claim = submit_and_claim(server, name="cli-hostile", entrypoint="hostile.py")
    jid = str(claim["job_id"])
    send_log(server, claim, 0, f"[rank0]: {HOSTILE}\n".encode(), worker="cli-hostile")
    r = server.client(claim["token"]).post(
        f"/jobs/{jid}/checkpoints",
        json={"path": f"{claim['checkpoint_dir']}/{HOSTILE}.pt", "step": 1},
    )
    assert r.status_code == 201, r.text
    r = server.client("worker").post(
        f"/workers/jobs/{jid}/finish",
        json={"worker": "cli-hostile", "attempt": 1, "exit_code": 1, "reason": HOSTILE},
    )
    assert r.status_code == 200 and HOSTILE in r.json()["reason"], r.text
    shown = "job\\x1b]0;TITLE\\x07\\x1b[2JX \\u202eevil\\x0d[ddpq] forged \\x9b31m"

    outputs = {
        "ls": ddpq(server, "ls", "--name", "hostile.py"),
        "status": ddpq(server, "status", jid),
        "watch": ddpq(server, "watch", jid),
        "logs": ddpq(server, "logs", jid),
    }
    for command, r in outputs.items():
        assert r.returncode in (0, 4), (command, r.stderr)
        assert not any(c in r.stdout for c in RAW_CONTROLS), (command, r.stdout)
        assert shown in r.stdout, (command, r.stdout)
    assert f"{shown}.pt" in outputs["status"].stdout  # the checkpoint's path
    # --raw gives the bytes as written; --json escapes them as JSON does.
    raw = ddpq(server, "logs", jid, "--raw").stdout
    assert HOSTILE.replace("\r", "\n") in raw  # (text mode reads a "\r" as a newline)
    assert HOSTILE in json.loads(ddpq(server, "status", jid, "--json").stdout)["reason"]
    assert "\\u001b]0;TITLE" in ddpq(server, "ls", "--name", "hostile.py", "--json").stdout

    # On a terminal Rich adds its own styles; none of the program's sequences get through.
    for args in (("status", jid), ("ls", "--name", "hostile.py"), ("watch", jid)):
        text = _in_a_terminal(server, *args)
        assert "TITLE" in text and not any(
            s in text for s in ("\x1b]0;", "\x1b[2J", "\x07", "\u202e", "\x9b", "\r[ddpq]")
        ), (args, text)


# ---- logs ----------------------------------------------------------------------------------


def test_logs_follow_prints_as_it_comes_and_ends_with_the_job(server: Server) -> None:
    claim = submit_and_claim(server, name="cli-logs")
    send_log(server, claim, 0, b"[rank0] first line\n", worker="cli-logs")
    run = Running(server, "logs", str(claim["job_id"]), "-f")
    wait_for(lambda: "first line" in run.text, 30, "the first line")
    send_log(server, claim, 19, "[rank0] second: é\n".encode(), worker="cli-logs")
    wait_for(lambda: "second" in run.text, 30, "the second line")
    assert run.proc.poll() is None  # still following: the job runs
    send_log(server, claim, 38, b"[rank0] last words\n", worker="cli-logs")
    finish(server, claim, name="cli-logs")
    assert run.wait() == 0
    assert run.text == "[rank0] first line\n[rank0] second: é\n[rank0] last words\n"

    r = ddpq(server, "logs", str(claim["job_id"]), "--json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines == [
        {"offset": 0, "text": "[rank0] first line"},
        {"offset": 19, "text": "[rank0] second: é"},
        {"offset": 38, "text": "[rank0] last words"},
    ]
    r = ddpq(server, "logs", str(claim["job_id"]), "--offset", "19")
    assert r.stdout == "[rank0] second: é\n[rank0] last words\n"

    # A job that never ran: nothing to print, and -f ends at once.
    job = _job(server, name="never-ran")
    server.client().post(f"/jobs/{job['id']}/cancel")
    r = ddpq(server, "logs", str(job["id"]), "-f", "--json")
    assert r.returncode == 0 and r.stdout == ""


# ---- watch ----------------------------------------------------------------------------------


def test_sparkline_scales_between_min_and_max() -> None:
    assert sparkline(range(1, 9)) == "▁▂▃▄▅▆▇█"
    assert sparkline([3.0, "NaN", 1.0]) == "█▁"  # non-finite points are left out
    assert sparkline([2, 2]) == "▄▄" and sparkline([]) == ""


def test_columns_span_the_whole_run_and_thin_keeps_its_shape() -> None:
    assert columns([(1, 3.0), (2, "NaN"), (3, 1.0)]) == [3.0, 1.0]  # few: each its own
    # 1000 steps in 10 spans of 100: each span's mean; a span with none repeats the last.
    spans = columns([(s, float(s)) for s in range(1000)], width=10)
    assert spans == [49.5 + 100 * i for i in range(10)]
    gap = columns([(s, 1.0) for s in range(10)] + [(s, 5.0) for s in range(90, 100)], width=10)
    assert gap == [1.0] * 9 + [5.0]
    # As the API downsamples: the first and last points, each span's lowest and highest,
    # NaN ranked above every number.
    points = [(s, 1.0 / s, 1) for s in range(1, 1001)]
    points[500] = (501, "NaN", 1)
    points[700] = (701, -5.0, 1)
    kept = thin(points, 20)
    assert len(kept) <= 20 and kept[0] == points[0] and kept[-1] == points[-1]
    assert (501, "NaN", 1) in kept and (701, -5.0, 1) in kept
    assert thin(points[:20], 20) == points[:20]


def test_watch_shows_progress_and_loss_then_exits_with_the_outcome(server: Server) -> None:
    claim = submit_and_claim(server, name="cli-watch")
    job_id = str(claim["job_id"])
    # total_steps comes once, with the first report, as the recipes send it: the job's.
    report(
        server,
        claim,
        [{"step": 1, "total_steps": 8, "values": {"loss": 2.0}}]
        + [{"step": s, "values": {"loss": 2.0 / s}} for s in range(2, 5)],
    )
    run = Running(server, "watch", job_id, "--interval", "0.2")
    wait_for(lambda: "step 4/8 (50%)" in run.text, 30, "the progress line")
    line = run.text.splitlines()[-1]
    assert line.startswith(f"job {job_id} running | attempt 1 | worker cli-watch")
    assert f"loss 0.5 {sparkline([2.0, 1.0, 2 / 3, 0.5])}" in line  # the loss points so far
    report(server, claim, [{"step": s, "values": {"loss": 2.0 / s}} for s in range(5, 9)])
    wait_for(lambda: "step 8/8 (100%)" in run.text, 30, "the progress to reach the end")
    finish(server, claim, name="cli-watch")
    assert run.wait() == 0
    last = run.text.splitlines()[-1]
    assert last.startswith(f"job {job_id} succeeded") and "exit code 0" in last
    assert len(set(last.split()[-1]) & SPARK) >= 4 and len(last.split()[-1]) == 8

    # --json: one object per change, stable keys; a failed job exits 4.
    claim = submit_and_claim(server, name="cli-watch")
    run = Running(server, "watch", str(claim["job_id"]), "--json", "--interval", "0.2")
    wait_for(lambda: '"running"' in run.text, 30, "the first object")
    finish(server, claim, exit_code=3, name="cli-watch")
    assert run.wait() == 4
    objects = [json.loads(x) for x in run.text.splitlines()]
    assert [o["status"] for o in objects] == ["running", "failed"]
    assert set(objects[-1]) == {
        "id", "name", "status", "attempt", "max_attempts", "worker", "gpus", "reason",
        "queue_position", "exit_code", "step", "total_steps", "epoch", "metrics",
    }  # fmt: skip
    assert objects[-1]["exit_code"] == 3 and objects[-1]["reason"]

    # Queued: why it waits; cancelled while watched: 4.
    job = _job(server, name="watched-in-queue")
    run = Running(server, "watch", str(job["id"]), "--interval", "0.2")
    wait_for(lambda: "in queue" in run.text, 30, "the queued line")
    server.client().post(f"/jobs/{job['id']}/cancel")
    assert run.wait() == 4
    assert run.text.splitlines()[-1].startswith(f"job {job['id']} cancelled")


def _loss(step: int) -> float:
    """High and falling for the first half of the run, then flat with noise: the last
    60 points alone look like noise."""
    return 10.0 - step / 100 if step <= 500 else 1.0 + 0.01 * (step % 7)


def test_watch_sparkline_draws_the_whole_run(server: Server) -> None:
    claim = submit_and_claim(server, name="cli-watch")
    job_id = str(claim["job_id"])
    # An older ddpq.train: total_steps among the values still makes the progress bar.
    report(server, claim, [{"step": 1, "values": {"loss": _loss(1), "total_steps": 1000.0}}])
    report(server, claim, [{"step": s, "values": {"loss": _loss(s)}} for s in range(2, 1001)])
    run = Running(server, "watch", job_id, "--interval", "0.2")
    wait_for(lambda: "step 1000/1000 (100%)" in run.text, 30, "the progress line")
    line = run.text.splitlines()[-1]
    spark = line.split()[-1]
    assert len(spark) == SPARK_POINTS and set(spark) <= SPARK, line
    # The run's start is there: highest first, falling, then flat at the bottom.
    assert spark[0] == "█" and spark[-1] == "▁", spark
    assert spark[SPARK_POINTS // 4] in "▄▅▆", spark
    finish(server, claim, name="cli-watch")
    assert run.wait() == 0


class _Recording(Client):
    """The CLI's client, noting each metrics request it sends."""

    def __init__(self, server: Server) -> None:
        super().__init__(server.url, server.api_token)
        self.asked: list[dict[str, Any]] = []

    def metrics(self, job_id: int, **kw: Any) -> list[dict[str, Any]]:
        self.asked.append(kw)
        return super().metrics(job_id, **kw)


def test_watch_fetches_the_history_once_then_what_is_new_and_follows_the_attempt(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = submit_and_claim(server, name="cli-watch")
    job_id = claim["job_id"]
    report(server, claim, [{"step": s, "values": {"loss": _loss(s)}} for s in range(1, 601)])
    rank0 = server.client(claim["token"])
    r = rank0.post(
        f"/jobs/{job_id}/checkpoints", json={"path": f"{claim['checkpoint_dir']}/a.pt", "step": 400}
    )
    assert r.status_code == 201, r.text
    watched = _Watched(job_id)
    with _Recording(server) as c:
        watched.poll(c)
        # The whole run, downsampled: its first step and its last.
        assert c.asked == [{"name": "loss", "max_points": HISTORY_POINTS}]
        assert len(watched.loss.points) <= HISTORY_POINTS
        assert watched.loss.points[0][0] == 1 and watched.loss.points[-1][0] == 600
        watched.poll(c)
        assert len(c.asked) == 1  # nothing new: nothing asked
        # Then only what is new, bounded however much that is; kept bounded here too.
        for end in (700, 1500, 1600):
            first = watched.loss.points[-1][0] + 1
            report(
                server,
                claim,
                [{"step": s, "values": {"loss": _loss(s)}} for s in range(first, end + 1)],
            )
            watched.poll(c)
            assert c.asked[-1] == {
                "name": "loss", "since_step": first - 1, "max_points": HISTORY_POINTS
            }  # fmt: skip
            assert watched.loss.points[0][0] == 1 and watched.loss.points[-1][0] == end
            assert len(watched.loss.points) <= 2 * HISTORY_POINTS
        assert len(c.asked) == 4
        losses = watched.losses
        assert len(losses) == SPARK_POINTS and losses[0] == max(losses)

        # Attempt 2 resumes from the checkpoint at step 400 and reports 401.. again,
        # below the step attempt 1 reached: the line ends where attempt 2 is.
        w = server.client("worker")
        r = w.post(
            f"/workers/jobs/{job_id}/finish",
            json={"worker": "cli-watch", "attempt": 1, "outcome": "requeue"},
        )
        assert r.status_code == 200, r.text
        r = w.post(
            "/workers/claim",
            json={"name": "cli-watch", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5},
        )
        assert r.status_code == 200 and r.json()["attempt"] == 2, r.text
        again = r.json()
        report(server, again, [{"step": s, "values": {"loss": 0.5}} for s in range(401, 451)])
        watched.poll(c)
        assert c.asked[-1] == {"name": "loss", "max_points": HISTORY_POINTS}  # all again, once
        steps = [(step, attempt) for step, _, attempt in watched.loss.points]
        # Attempt 1's points past 400 are gone; the history before it is kept. (The
        # answer is downsampled over steps 1..1600: the newest point may be a little
        # before 450.)
        assert steps[0] == (1, 1) and steps[-1][1] == 2 and 401 <= steps[-1][0] <= 450
        assert all(attempt == 2 for step, attempt in steps if step > 400), steps
        assert any(attempt == 1 and step <= 400 for step, attempt in steps), steps
        assert watched.loss.behind  # attempt 1 reached 1600: the job's latest step stays
        # While it catches up, the job's latest step does not move: asked on a timer,
        # from the attempt's newest step.
        monkeypatch.setattr(live, "BEHIND_REFRESH_S", 0.0)
        newest = steps[-1][0]
        report(server, again, [{"step": s, "values": {"loss": 0.25}} for s in range(451, 461)])
        watched.poll(c)
        assert c.asked[-1] == {
            "name": "loss", "since_step": newest, "max_points": HISTORY_POINTS
        }  # fmt: skip
        step, value, attempt = watched.loss.points[-1]
        assert attempt == 2 and value == 0.25 and 451 <= step <= 460
        assert all(a == 2 for s, _, a in watched.loss.points if s > 400)
        assert watched.job["latest_metrics"]["step"] == 1600
    finish(server, again, name="cli-watch")


def test_watch_interrupted_exits_130(server: Server) -> None:
    job = _job(server, name="interrupted")
    run = Running(server, "watch", str(job["id"]))
    wait_for(lambda: "queued" in run.text, 30, "the first line")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 130


# ---- errors and exit codes --------------------------------------------------------------------


def test_exit_codes_for_errors_and_their_table_in_help(server: Server) -> None:
    job = _job(server, name="to-cancel")
    assert ddpq(server, "status", str(job["id"])).returncode == 0
    r = ddpq(server, "cancel", str(job["id"]), "--json")
    assert json.loads(r.stdout)["status"] == "cancelled"
    assert ddpq(server, "status", str(job["id"])).returncode == 4
    assert ddpq(server, "watch", str(job["id"])).returncode == 4

    for cmd in (["status", "999999"], ["watch", "999999"], ["logs", "999999", "-f"]):
        r = ddpq(server, *cmd)
        assert r.returncode == 1 and "HTTP 404" in r.stderr, (cmd, r.stderr)
    r = ddpq(server, "recipes", "--json")
    assert "toy-regression" in [x["name"] for x in json.loads(r.stdout)]
    r = ddpq(server, "ls", DDPQ_TOKEN="wrong-token-wrong-token")
    assert r.returncode == 1 and "invalid token" in r.stderr

    nowhere = {"DDPQ_URL": f"http://127.0.0.1:{free_port()}", "DDPQ_TOKEN": "t" * 20}
    spec_file = ["submit", "-f", "examples/job.yaml"]
    for cmd in (["ls"], ["workers"], ["watch", "1"], ["logs", "1", "-f"], spec_file):
        r = ddpq(None, *cmd, **nowhere)
        assert r.returncode == 3 and "cannot reach" in r.stderr, (cmd, r.stderr)

    r = ddpq(None, "--help", COLUMNS="100")
    codes = r.stdout[r.stdout.index("Exit codes") :]
    for code in ("0", "1", "2", "3", "4", "5", "130"):
        assert re.search(rf"^\s+{code}  \w", codes, re.MULTILINE), codes


def test_help_says_where_the_api_and_token_come_from_and_fits_80_columns() -> None:
    for cmd in ([], ["submit"], ["resubmit"], ["ls"], ["status"], ["watch"], ["logs"], ["worker"]):
        r = ddpq(None, *cmd, "--help", COLUMNS="80")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert max(map(len, lines)) <= 80, cmd
        assert "…" not in r.stdout, cmd  # no option name cut short
        assert not re.search(r"<(?:str|int|bool|float|path|list)", r.stdout), cmd  # no types
        if cmd != ["worker"]:  # the worker has its own --url (and its worker token)
            assert "DDPQ_URL" in r.stdout and "DDPQ_TOKEN" in r.stdout, cmd
            assert "var/api-token" in r.stdout, cmd
    r = ddpq(None, "submit", "--help", COLUMNS="80")
    assert "--retry-on-error / --no-retry-on-error" in r.stdout
    assert "--strict" in r.stdout and "--env KEY=VALUE" in r.stdout


def test_url_and_token_options_stand_in_for_the_variables(server: Server) -> None:
    r = ddpq(None, "--url", server.url, "--token", server.api_token, "ls", "--json")
    assert r.returncode == 0, r.stderr
    assert "items" in json.loads(r.stdout)
    r = ddpq(None, "--url", server.url, "--token", "wrong-token-wrong-token", "ls")
    assert r.returncode == 1 and "invalid token" in r.stderr and "--token" in r.stderr
    # The options win over the variables.
    r = ddpq(server, "--token", "wrong-token-wrong-token", "ls")
    assert r.returncode == 1 and "invalid token" in r.stderr


def test_logs_of_a_capped_log_print_it_once_with_offsets_past_the_cut(tmp_path: Path) -> None:
    """`ddpq logs` pages through the stored log by X-Next-Offset: the cut marker counts
    for no offset, so nothing after it is printed twice, and --json gives each line
    the offset it has in the stored stream."""
    capped = start_server(
        f"sqlite:///{tmp_path / 'ddpq.db'}", tmp_path / "api", DDPQ_LOG_MAX_BYTES="4096"
    )
    try:
        claim = submit_and_claim(capped)
        jid = str(claim["job_id"])
        lines = [f"[rank{i % 2}]: step {i:05d}\n".encode() for i in range(600)]
        sent = b""
        for i in range(0, len(lines), 20):
            chunk = b"".join(lines[i : i + 20])
            send_log(capped, claim, len(sent), chunk)
            sent += chunk
        stored = capped.client().get(f"/jobs/{jid}/logs").content
        assert b"bytes of output cut here" in stored
        r = ddpq(capped, "logs", jid)
        assert r.returncode == 0 and r.stdout.encode() == stored

        rows = [json.loads(x) for x in ddpq(capped, "logs", jid, "--json").stdout.splitlines()]
        marks = [i for i, row in enumerate(rows) if row["text"].startswith("[ddpq]")]
        assert len(marks) == 1
        # The head ends where the cap cut it, mid-line: that piece has no newline of its own.
        *head, cut_line = rows[: marks[0]]
        assert sent[cut_line["offset"] :].startswith(cut_line["text"].encode())
        for row in head + rows[marks[0] + 1 :]:
            assert sent[row["offset"] :].startswith(row["text"].encode() + b"\n"), row
        assert rows[-1]["offset"] == len(sent) - len(lines[-1])
        finish(capped, claim)
    finally:
        stop_server(capped)


def test_follow_resumes_after_a_cut_marker_at_the_offset_it_names() -> None:
    """A follow stream that broke after crossing the log cap's cut resumes at the right
    byte: the marker line counts for no offset, however the chunks split it."""
    from ddpq.client import _Offsets
    from service.logs import cut_marker

    data = b"[rank0]: head\n" + cut_marker(500, 1000, 900) + b"[rank0]: tail\n"
    for split in range(1, len(data)):
        at = _Offsets(0)
        at.feed(data[:split])
        assert at.feed(data[split:]) == 900 + len(b"[rank0]: tail\n"), split
    assert _Offsets(10).feed(b"abc") == 13
    # A rank that prints the marker's words does not move the offset: its line starts "[rankN]:".
    fake = b"[rank0]: " + cut_marker(1, 1, 99_999_999)
    assert _Offsets(0).feed(fake) == len(fake)


def test_status_shows_the_latest_step_of_the_total(server: Server) -> None:
    claim = submit_and_claim(server, "status-hand")
    report(server, claim, [{"step": 3, "values": {"loss": 0.5}, "total_steps": 10}])
    r = ddpq(server, "status", str(claim["job_id"]))
    assert r.returncode == 0, r.stderr
    assert re.search(r"latest  step 3 of 10: loss=0\.5$", r.stdout, re.MULTILINE), r.stdout
    finish(server, claim, 0, name="status-hand")
