"""worker.entry, the ranks' entry (issue 31): a program run through it sees and does what it
would under a bare ``python -u PROGRAM``, and a rank torch crashes on the way out after its
program finished ends as a success.

The equivalence is checked with plain Python programs run both ways (no torch, no
torchrun: cheap); the launches through real torchrun and ddpq follow. The many rounds that
show the abort itself gone are tests/test_entry_rounds.py (``make test-teardown``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Server, terminal
from worker import entry, tee
from worker.edges import oom
from worker.starting import torchrun

PROBE = Path(__file__).with_name("entry_probe.py")
SAID = "the program finished; torch crashed during interpreter exit (SIGABRT)"  # issue 31's words
ENTRY = [sys.executable, *torchrun.RANK_ENTRY]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPQ_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)  # worker.entry from this tree
    return {**env, **extra}


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=60
    )


def _probe_records(cwd: Path, args: list[str]) -> list[dict[str, Any]]:
    """The probe's records, bare and through the entry, each given the same argv."""
    records = []
    for argv in ([sys.executable, "-u"], ENTRY):
        done = _run([*argv, *args, str(cwd / "record"), "x y", "-z"], cwd)
        assert done.returncode == 0, done.stderr
        records.append(json.loads((cwd / "record").read_text()))
        (cwd / "record").unlink()
    return records


def test_a_program_sees_what_a_bare_python_gives_it(tmp_path: Path) -> None:
    # Through a link in another directory: sys.path[0] is the real file's directory,
    # __file__ and argv[0] the path as given, made absolute for __file__.
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(PROBE, code / "probe.py")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "link.py").symlink_to(code / "probe.py")
    (tmp_path / "run" / "worker").mkdir()  # the job's own package named worker
    (tmp_path / "run" / "worker" / "__init__.py").write_text("")
    bare, entered = _probe_records(tmp_path / "run", ["link.py"])
    assert bare == entered
    assert bare["path"][0] == str(code) and bare["argv"][0] == "link.py"
    assert bare["file"] == str(tmp_path / "run" / "link.py") and bare["spec"] is None
    assert bare["main_is_this"] and not bare["worker_module"] and not bare["at_exit_file"]


def test_a_module_sees_what_python_m_gives_it(tmp_path: Path) -> None:
    shutil.copy(PROBE, tmp_path / "probe_mod.py")
    bare, entered = _probe_records(tmp_path, ["-m", "probe_mod"])
    assert bare == entered
    assert bare["spec"]["name"] == "probe_mod" and bare["path"][0] == str(tmp_path)
    assert bare["at_exit_file"]  # python -m leaves __file__ for the atexit callbacks


# Each program ends one way; bare and through the entry, its status and output are the same.
ENDINGS = {
    "sys.exit(3)": ("import sys\nprint('before')\nsys.exit(3)\n", 3),
    "sys.exit(text)": ("import sys\nsys.exit('giving up: no data')\n", 1),
    "raise": ("def main():\n    raise ValueError('bad input')\nmain()\n", 1),
    "syntax": ("x = (\n", 1),
    "SIGKILL": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", -signal.SIGKILL),
    "SIGTERM": ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", -signal.SIGTERM),
    "KeyboardInterrupt": ("raise KeyboardInterrupt\n", -signal.SIGINT),
    # What the interpreter does on the way out: wait for non-daemon threads, atexit
    # callbacks (after them, the status), every stream flushed: a last line without its
    # newline, a file the program left open, a line a thread prints after main returned.
    "the way out": (
        "import atexit, sys, threading\n"
        "ready = threading.Event()\n"
        "def late():\n"
        "    ready.wait()\n"
        "    print('the thread ends')\n"
        "threading.Thread(target=late).start()\n"
        "atexit.register(lambda: print('atexit ran', '__file__' in globals()))\n"
        "left = open(sys.argv[1], 'w')\n"
        "left.write('kept, unflushed')\n"
        "sys.stderr.write('an error line without newline')\n"
        "sys.stdout.write('last line without newline and no flush, ')\n"
        "ready.set()\n",
        0,
    ),
    # What torch.compile leaves in the heap (issue 42): weak proxies whose referent is
    # gone, on which isinstance raises ReferenceError, and an object whose __class__ is a
    # property that raises. A program that finished is never failed for what it left.
    "dead proxies": (
        "import weakref\n"
        "class Gone: pass\n"
        "class Liar:\n"
        "    @property\n"
        "    def __class__(self): raise RuntimeError('ask me not')\n"
        "g = Gone()\n"
        "left = [weakref.proxy(g), weakref.proxy(lambda: None), Liar()]\n"
        "del g\n"
        "print('done')\n",
        0,
    ),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_program_ends_as_it_would_bare(tmp_path: Path, ending: str) -> None:
    source, status = ENDINGS[ending]
    (tmp_path / "prog.py").write_text(source)
    results = []
    for i, argv in enumerate(([sys.executable, "-u"], ENTRY)):
        errors = tmp_path / f"error-{i}.json"
        left = tmp_path / f"left-{i}.txt"
        done = _run([*argv, "prog.py", str(left)], tmp_path, TORCHELASTIC_ERROR_FILE=str(errors))
        kept = left.read_text() if left.exists() else None
        results.append((done.returncode, done.stdout, done.stderr, kept))
    assert results[0] == results[1]
    assert results[0][0] == status
    if ending == "the way out":
        out = "last line without newline and no flush, the thread ends\natexit ran False\n"
        assert results[0][1] == out
        assert results[0][3] == "kept, unflushed"
    # torch's error file, as its @record writes it, names an uncaught exception; a program
    # that finished well leaves the entry's mark there; nothing else leaves one.
    written = tmp_path / "error-1.json"
    if ending == "raise":
        data = json.loads(written.read_text())["message"]
        assert data["message"] == "ValueError: bad input"
        assert "line 2, in main\n    raise ValueError" in data["extraInfo"]["py_callstack"]
        assert int(data["extraInfo"]["timestamp"]) > 0
    elif ending == "syntax":
        assert json.loads(written.read_text())["message"]["message"].startswith("SyntaxError: ")
    elif status == 0:
        assert json.loads(written.read_text())["message"]["message"] == entry.FINISHED
    else:
        assert not written.exists()
    assert not (tmp_path / "error-0.json").exists()


def test_a_program_that_cannot_be_opened_is_said_as_python_says_it(tmp_path: Path) -> None:
    results = [_run([*argv, "missing.py"], tmp_path) for argv in ([sys.executable, "-u"], ENTRY)]
    assert [(r.returncode, r.stdout, r.stderr) for r in results] == [
        (2, "", f"{sys.executable}: can't open file {str(tmp_path / 'missing.py')!r}:"
         " [Errno 2] No such file or directory\n")
    ] * 2  # fmt: skip


def test_the_error_file_the_program_wrote_itself_is_kept(tmp_path: Path) -> None:
    # A program under torch's @record writes its own error file, then re-raises.
    (tmp_path / "prog.py").write_text(
        "import os\n"
        "try:\n    raise KeyError('label')\n"
        "except KeyError:\n"
        "    open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write('{\"message\": \"mine\"}')\n"
        "    raise\n"
    )
    errors = tmp_path / "error.json"
    done = _run([*ENTRY, "prog.py"], tmp_path, TORCHELASTIC_ERROR_FILE=str(errors))
    assert done.returncode == 1 and "KeyError: 'label'" in done.stderr
    assert json.loads(errors.read_text()) == {"message": "mine"}


# ---- what the tee and the worker make of a rank that died after its program finished ----


def test_a_rank_killed_after_it_finished_is_a_success_in_words(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    marked = tmp_path / "marked.json"
    (tmp_path / "prog.py").write_text("print('done')\n")
    _run([*ENTRY, "prog.py"], tmp_path, TORCHELASTIC_ERROR_FILE=str(marked))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGABRT, error_file=str(marked))
    assert tee.finished(failure)
    assert not tee.finished(ProcessFailure(1, 2, -9, str(tmp_path / "none.json")))
    words = tee.finished_words(0, 0, -signal.SIGABRT)
    assert words == f"rank 0 (local rank 0): {SAID}"
    assert tee.finished_words(3, 1, -15).endswith("; stopped during interpreter exit (SIGTERM)")
    tail = ["[rank0]: done", f"[ddpq] {words}"]
    assert torchrun.outcome(0, tail, None, None) == torchrun.Outcome(0, "exited", words)
    assert torchrun.outcome(0, ["[rank0]: done"], None, None).reason is None
    # Among real failures its line says its program had finished.
    lines = tee.failure_lines({0: failure, 1: ProcessFailure(1, 2, 3, "<N/A>")}, 1, {})
    assert lines[1].endswith(
        " rank 0 (local rank 0) killed by SIGABRT (pid 1): its program had finished"
    )


def test_the_ranks_start_through_the_entry_with_the_launchers_python(tmp_path: Path) -> None:
    from tests.helpers import job_runner

    claim = job_runner(tmp_path, {"world_size": 2}).claim
    argv = torchrun.argv("/venv/bin/python", claim, [], ["/w/train.py", "--lr", "1"], tmp_path)
    at = argv.index("--no-python")
    assert argv[at:] == ["--no-python", "/venv/bin/python", "-u", "-P", "-m", "worker.entry",
                         "/w/train.py", "--lr", "1"]  # fmt: skip


# ---- through real torchrun and ddpq --------------------------------------------------------

# A rank that does its work, then dies by SIGABRT in an atexit callback: a stand-in, every
# time, for the abort torch 2.14.1 makes in 1 of 5 runs (tests/test_entry_rounds.py has it).
CRASHES_ON_THE_WAY_OUT = r"""
import atexit, os, signal
print(f"rank {os.environ['RANK']} did its work", flush=True)
atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))
"""
# Rank 1 fails as said (argv[1]); rank 0 waits to be stopped.
FAILS = r"""
import os, signal, sys, time
print(f"rank {os.environ['RANK']} up", flush=True)
if os.environ["RANK"] == "1":
    if sys.argv[1] == "exit3":
        sys.exit(3)
    if sys.argv[1] == "raise":
        raise ValueError("bad input")
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(0.1)
"""


KILLED_HOW = "" if oom.killed_for_memory([1]) is not None else " (out of memory?)"


@pytest.mark.torchrun
def test_ddpq_runs_ranks_through_the_entry(server: Server, start_worker) -> None:
    # One worker, the jobs side by side: a job torch crashes on the way out succeeds at its
    # first attempt and says so; programs that fail keep their exit codes and reasons.
    worker = start_worker(server, cpu_slots=7)
    (worker.workspace / "crashes.py").write_text(CRASHES_ON_THE_WAY_OUT)
    (worker.workspace / "fails.py").write_text(FAILS)
    c = server.client()

    def submit(entrypoint: str, world_size: int, *args: str) -> int:
        spec = {"entrypoint": entrypoint, "world_size": world_size, "device": "cpu"}
        job = c.post("/jobs", json={**spec, "args": list(args), "max_attempts": 1}).json()
        return int(job["id"])

    crashed = submit("crashes.py", 1)
    failed = {how: submit("fails.py", 2, how) for how in ("exit3", "raise", "kill")}
    final = terminal(c, crashed)
    log = c.get(f"/jobs/{crashed}/logs").text
    assert (final["status"], final["attempt"], final["exit_code"]) == ("succeeded", 1, 0), log
    said = f"rank 0 (local rank 0): {SAID}"
    assert final["reason"] == said, log
    assert f"[ddpq] {said}" in log.splitlines() and "rank 0 did its work" in log
    first = "rank 1 (local rank 1) failed first"
    expected = {
        "exit3": (3, f"exited with code 3: {first}"),
        "raise": (1, f"exited with code 1: {first}: ValueError: bad input"),
        # The worker reads the kernel's log where it may (root): a kill -9 is no OOM kill.
        "kill": (137, f"killed by SIGKILL{KILLED_HOW}, exit code 137: {first}"),
    }
    for how, job_id in failed.items():
        job = terminal(c, job_id)
        code, reason = expected[how]
        assert (job["status"], job["exit_code"]) == ("failed", code), job
        assert job["reason"].startswith(reason), (job["reason"], c.get(f"/jobs/{job_id}/logs").text)


APART = r"""
import os, sys
if sys.argv[1] == "joins":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
elif sys.argv[1] == "mesh":
    from torch.distributed.device_mesh import init_device_mesh
    init_device_mesh("cpu", (2,))
print(f"rank {os.environ['RANK']} done", flush=True)
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_world_whose_ranks_never_joined_a_process_group_says_so(
    server: Server, start_worker
) -> None:
    """Two ranks that never call init_process_group train apart, each as if alone
    (accelerate on a CPU host without ACCELERATE_USE_CPU did it, silently): the job
    succeeds and its reason says so. One that joins, by DDP's call or a device mesh's,
    under either launcher, says nothing."""
    worker = start_worker(server, cpu_slots=8)
    (worker.workspace / "apart.py").write_text(APART)
    c = server.client()

    def submit(how: str, launcher: str) -> int:
        spec = {"entrypoint": "apart.py", "world_size": 2, "device": "cpu", "args": [how]}
        return int(c.post("/jobs", json={**spec, "launcher": launcher}).json()["id"])

    jobs = {
        (how, launcher): submit(how, launcher)
        for how in ("apart", "joins", "mesh")
        for launcher in ("warm", "torchrun")
    }
    for (how, launcher), job_id in jobs.items():
        final = terminal(c, job_id)
        log = c.get(f"/jobs/{job_id}/logs").text
        assert final["status"] == "succeeded", (how, launcher, log)
        if how == "apart":
            assert final["reason"] == (
                "rank 0 (local rank 0): the program finished; it never joined a process "
                "group (torch.distributed.init_process_group): the world of 2 ranks ran "
                "apart, each training alone"
            ), (launcher, final["reason"], log)
        else:
            assert final["reason"] is None, (how, launcher, final["reason"], log)


SEES_RICH = r"""
import importlib.metadata, importlib.util
try:
    installed = importlib.metadata.version("rich")
except importlib.metadata.PackageNotFoundError:
    installed = None
listed = any(d.metadata["Name"].lower() == "rich" for d in importlib.metadata.distributions())
import rich  # still importable: only its metadata is hidden
print(f"installed={installed is not None} listed={listed} imports={rich is not None}", flush=True)
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_job_sees_rich_installed_only_when_it_asks_for_it(server: Server, start_worker) -> None:
    """The worker's rich (ddpq's CLI's) makes Lightning draw a Rich progress bar, which
    writes nothing to a log until the run ends: a job does not see it installed unless
    its requirements name it (issue 42). Importing it still works."""
    worker = start_worker(server)
    (worker.workspace / "sees.py").write_text(SEES_RICH)
    c = server.client()
    plain = c.post("/jobs", json={"entrypoint": "sees.py", "device": "cpu"}).json()["id"]
    asks = c.post("/jobs", json={"entrypoint": "sees.py", "device": "cpu", "pip": ["rich"]})
    said = {}
    for name, job_id in (("plain", plain), ("asks", asks.json()["id"])):
        final = terminal(c, job_id)
        log = c.get(f"/jobs/{job_id}/logs").text
        assert final["status"] == "succeeded", log
        said[name] = next(line for line in log.splitlines() if "installed=" in line)
    assert said["plain"].endswith("installed=False listed=False imports=True"), said
    assert said["asks"].endswith("installed=True listed=True imports=True"), said
