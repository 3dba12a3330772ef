"""Outputs survive the job (issue 30, items 6 and 7): what a job writes in its directory is
kept on its worker and sent to the API as each attempt ends, `ddpq outputs` lists and
downloads it, `ddpq resubmit --resume` runs on in a copy of it, the directory goes by
the retention rule, and nothing a hostile job writes there (links out, a hard link to
a file outside, a FIFO, a name the rules refuse) is read or written outside it.
`submit` names the checkpoint-like files it sends; `resubmit` names the snapshot it
reruns and whether the files here differ."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpq.client import Client
from ddpq.snapshot import Entry
from tests.conftest import (
    REPO,
    Server,
    run_ddpq,
    start_server,
    stop_process,
    stop_server,
    terminal,
    wait_for,
)
from tests.helpers import register, send_directory
from tests.test_walls import open_the_way, start_host_worker
from worker.files.outputs import Limits, capture

# The pytorch/examples DDP tutorial's shape (issue 30): it saves snapshot.pt in its
# working directory every epoch and resumes from it when it is there. The first run
# stalls after epoch 2 (the test cancels it there); it also writes what a hostile
# program would.
TUTORIAL = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
snap = Path("snapshot.pt")
start = 0
if snap.exists():
    state = torch.load(snap, weights_only=True)
    model.module.load_state_dict(state["model"])
    start = state["epoch"] + 1
    print(f"resuming from snapshot at epoch {start}", flush=True)
elif rank == 0:
    hostile = sys.argv[1]
    Path("out").mkdir()
    Path("out/result.txt").write_text("done\\n")
    Path("notes.txt").write_text("changed by the job\\n")
    os.symlink("/etc/passwd", "abs-link")
    os.symlink("../../..", "up")
    os.symlink("out/result.txt", "inside")
    os.link(hostile, "stolen")
    os.mkfifo("pipe")
    Path("bad\\nname").write_text("x")
    Path("big.bin").write_bytes(b"b" * 300_000)
for epoch in range(start, 5):
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if rank == 0:
        torch.save({"epoch": epoch, "model": model.module.state_dict()}, snap)
        print(f"epoch {epoch} saved", flush=True)
    if epoch == 2 and start == 0:
        while True:  # the first run waits here to be cancelled
            time.sleep(0.2)
dist.destroy_process_group()
"""


def _env(server: Server) -> dict[str, str]:
    return {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}


def _log(c: Client, job_id: int) -> str:
    return c.logs(job_id)[0].decode(errors="replace")


def _dirs(data: Path, job_id: int) -> list[Path]:
    return sorted((data / "jobs").glob(f"job-{job_id}-*"))


@pytest.mark.long  # a tutorial cancelled and resumed: about 30 s each (make test-long)
@pytest.mark.torchrun
def test_a_cancelled_tutorial_keeps_its_outputs_and_resumes_from_its_saved_epoch(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    # Retention 0 and the newest 1 of each user kept: once the resumed job ends, the
    # first job's directory goes and the resumed one's stays. Outputs over 200 KB stay
    # on the worker only.
    server = start_server(
        db_url,
        tmp_path / "api",
        DDPQ_WORKDIR_RETENTION="0",
        DDPQ_WORKDIR_KEEP_NEWEST="1",
        DDPQ_OUTPUTS_MAX_BYTES="200000",
    )
    worker = start_worker(server)
    work = tmp_path / "project"
    work.mkdir()
    (work / "train.py").write_text(TUTORIAL)
    (work / "notes.txt").write_text("as sent\n")
    secret = tmp_path / "outside-secret.txt"
    secret.write_text("SECRET outside the job\n")
    try:
        with Client(server.url, server.api_token) as c:
            sub = run_ddpq(
                "submit", "--entrypoint", "train.py", "--json", "--", str(secret),
                env=_env(server), cwd=work,
            )  # fmt: skip
            assert sub.returncode == 0, sub.stderr
            first = json.loads(sub.stdout)["id"]
            wait_for(lambda: "epoch 2 saved" in _log(c, first), 120, "epoch 2 of the first run")
            c.cancel(first)
            assert terminal(server.client(), first)["status"] == "cancelled"
            log = _log(c, first)
            assert "[ddpq] outputs:" in log and "`ddpq outputs" in log, log
            assert "its directory" in log and "DDPQ_WORKDIR_RETENTION" in log, log

            outs = run_ddpq("outputs", str(first), "--json", env=_env(server))
            assert outs.returncode == 0, outs.stderr
            listed = json.loads(outs.stdout)
            items = {i["path"]: i for i in listed["items"]}
            assert set(items) == {"out/result.txt", "notes.txt", "inside", "snapshot.pt"}, items
            assert items["notes.txt"]["change"] == "changed"
            assert items["inside"]["symlink"] == "out/result.txt"
            left = {x["path"]: x["why"] for x in listed["left"]}
            assert set(left) == {"abs-link", "up", "stolen", "pipe", "bad?name", "big.bin"}, left
            assert "hard link" in left["stolen"] and "DDPQ_OUTPUTS_MAX_BYTES" in left["big.bin"]

            table = run_ddpq("outputs", str(first), env=_env(server))
            assert "snapshot.pt" in table.stdout and "big.bin" in table.stdout, table.stdout

            dl = tmp_path / "downloads" / "first"
            got = run_ddpq("outputs", str(first), "--download", str(dl), env=_env(server))
            assert got.returncode == 0, got.stderr
            written = sorted(str(p.relative_to(dl)) for p in dl.rglob("*"))
            assert written == ["inside", "notes.txt", "out", "out/result.txt", "snapshot.pt"]
            assert (dl / "out/result.txt").read_text() == "done\n"
            assert os.readlink(dl / "inside") == "out/result.txt"
            assert sorted(p.name for p in dl.parent.iterdir()) == ["first"]
            for p in dl.rglob("*"):
                if p.is_file() and not p.is_symlink():
                    assert b"SECRET" not in p.read_bytes()

            again = run_ddpq(
                "resubmit", str(first), "--resume", "--json", env=_env(server), cwd=tmp_path
            )
            assert again.returncode == 0, again.stderr
            assert f"resuming in a copy of job {first}'s directory" in again.stderr, again.stderr
            second = json.loads(again.stdout)["id"]
            job = terminal(server.client(), second, timeout=180)
            resumed = _log(c, second)
            assert job["status"] == "succeeded", resumed
            assert "resuming from snapshot at epoch 3" in resumed, resumed
            assert "epoch 4 saved" in resumed and "epoch 0 saved" not in resumed, resumed
            # A fresh directory written from the snapshot, never the old one.
            old_dirs, new_dirs = _dirs(worker.data_dir, first), _dirs(worker.data_dir, second)
            assert new_dirs and not set(new_dirs) & set(old_dirs)

            wait_for(
                lambda: not _dirs(worker.data_dir, first), 60, "the first job's directory to go"
            )
            assert _dirs(worker.data_dir, second), "the newest job's directory was removed"
            assert run_ddpq("outputs", str(second), env=_env(server)).returncode == 0
    finally:
        stop_process(worker.proc)
        stop_server(server)


def test_capture_reads_nothing_outside_the_directory_and_names_what_it_left(
    tmp_path: Path,
) -> None:
    """The worker's reading of a job's directory, against what a hostile job leaves."""
    root = tmp_path / "job"
    (root / "sub").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "sub" / "made.txt").write_text("made\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("SECRET\n")
    os.link(outside, root / "stolen")
    os.symlink(str(outside), root / "abs")
    os.symlink("..", root / "parent")
    os.symlink("parent/outside.txt", root / "through")  # out through another link
    os.symlink("sub", root / "subdir-link")  # a link to a directory, kept as a link
    os.mkfifo(root / "fifo")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / "tab\tname").write_text("x")
    (root / "large.bin").write_bytes(b"x" * 2000)
    # Importing the job's own modules writes bytecode: no output of the job's, nor left.
    (root / "sub" / "__pycache__").mkdir()
    (root / "sub" / "__pycache__" / "made.cpython-311.pyc").write_bytes(b"\x00" * 16)
    code = {"train.py": Entry("train.py", "0" * 64, 12)}
    got = capture(root, code, Limits(10, 1000, 1500, 0, 0))
    kept = {e.path for e in got.entries}
    assert kept == {"train.py", "sub/made.txt", "subdir-link"}, kept
    assert {e.path for e in got.written} == {"train.py", "sub/made.txt"}  # train.py changed
    left = {x["path"]: x["why"] for x in got.left}
    assert set(left) == {
        "stolen", "abs", "parent", "through", "fifo", ".git", "tab?name", "large.bin"
    }, left  # fmt: skip


def test_the_outputs_routes_refuse_bad_input_by_name(server: Server, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    with Client(server.url, server.api_token) as c:
        snap = c.push_code(work)
        job = c.submit({"entrypoint": "train.py", "code": snap.id})
    register(server)
    w = server.client("worker")
    claim = w.post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    ).json()
    assert claim["job_id"] == job["id"]
    url = f"/workers/jobs/{job['id']}/outputs"
    body = {"worker": "hand", "attempt": 1, "directory": snap.id, "workdir": "/x"}
    r = w.post(url, json={**body, "directory": "../../etc"})
    assert r.status_code == 422 and "directory" in r.text, r.text
    r = w.post(url, json={**body, "directory": "f" * 64})
    assert r.status_code == 404 and "snapshot" in r.text, r.text
    r = w.post(url, json={**body, "worker": "other"})
    assert r.status_code == 409, r.text
    r = w.post("/workers/jobs/999999/outputs", json=body)
    assert r.status_code == 404, r.text
    hostile = [{"path": "../evil", "digest": "0" * 64, "size": 1}]
    r = w.post("/workers/code/snapshots", json={"files": hostile})
    assert r.status_code == 422 and "normalised" in r.text, r.text
    r = w.post(url, json=body)  # the directory as its code: nothing written
    assert r.status_code == 204, r.text
    user = server.client()
    outs = user.get(f"/jobs/{job['id']}/outputs").json()
    assert outs["directory"] == snap.id and outs["items"] == [] and outs["kept_until"] is None
    assert user.get("/jobs/999999/outputs").status_code == 404
    # The user token does not send outputs; the worker token reads no user route.
    assert user.post(url, json=body).status_code in (401, 403)
    assert w.get(f"/jobs/{job['id']}/outputs").status_code in (401, 403)


def test_submit_names_checkpoint_like_files_and_resubmit_says_what_it_reruns(
    server: Server, tmp_path: Path
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    (work / "snapshot.pt").write_bytes(b"\0" * 2000)
    (work / "model.safetensors").write_bytes(b"\0" * 10)
    sub = run_ddpq("submit", "--entrypoint", "train.py", "--json", env=_env(server), cwd=work)
    assert sub.returncode == 0, sub.stderr
    assert "warning: sending checkpoint-like file(s)" in sub.stderr, sub.stderr
    assert "snapshot.pt (2.0 KB), model.safetensors (10 B)" in sub.stderr, sub.stderr
    job = json.loads(sub.stdout)
    sid = job["spec"]["code"]

    same = run_ddpq("resubmit", str(job["id"]), env=_env(server), cwd=work)
    assert same.returncode == 0, same.stderr
    assert f"rerunning job {job['id']}'s code {sid[:12]}" in same.stdout, same.stdout
    assert "the files here are the same" in same.stdout, same.stdout

    (work / "train.py").write_text("print(2)\n")
    (work / "new.py").write_text("")
    (work / "model.safetensors").unlink()
    edited = run_ddpq("resubmit", str(job["id"]), env=_env(server), cwd=work)
    assert edited.returncode == 0, edited.stderr
    assert (
        "the files here differ from it: model.safetensors (not here), new.py (new here), "
        "train.py (changed) (`ddpq submit` sends them)"
    ) in edited.stdout, edited.stdout

    elsewhere = run_ddpq("resubmit", str(job["id"]), env=_env(server), cwd=tmp_path)
    assert f"rerunning job {job['id']}'s code {sid[:12]}" in elsewhere.stdout
    assert "files here" not in elsewhere.stdout

    none = run_ddpq("resubmit", str(job["id"]), "--resume", env=_env(server), cwd=tmp_path)
    assert none.returncode == 1 and "left no directory to resume in" in none.stderr, none.stderr


# Walled: the kept directory is the worker's again (0700) once the attempt ends, so the
# job after it (another uid) can neither read, list nor write it; `resubmit --resume`
# gives that job a fresh directory holding a copy. A host test: SQLite only.
WALLED = """
import os, sys
from pathlib import Path
if sys.argv[1] == "write":
    Path("secret.txt").write_text("A's output")
    print(f"WROTE cwd={os.getcwd()} uid={os.getuid()}", flush=True)
    sys.exit(0)
old = Path(sys.argv[2])
for what, attempt in (
    ("list", lambda: os.listdir(old)),
    ("read", lambda: (old / "secret.txt").read_text()),
    ("write", lambda: (old / "planted.txt").write_text("x")),
):
    try:
        attempt()
        print(f"ATTACK {what} done", flush=True)
    except OSError as exc:
        print(f"ATTACK {what} denied {exc.errno}", flush=True)
print(f"COPY cwd={os.getcwd()} holds={Path('secret.txt').read_text()!r}", flush=True)
"""


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory job uids can reach (as tests/test_walls.py's)."""
    open_the_way(Path(sys.executable))
    open_the_way(REPO / "worker")
    base = Path(tempfile.mkdtemp(prefix="ddpq-outputs-", dir="/var/tmp"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.torchrun
def test_a_kept_directory_is_closed_to_the_next_job_and_resume_gets_a_copy(
    tmp_path: Path, host_dir: Path
) -> None:
    server = start_server(f"sqlite:///{tmp_path / 'ddpq.db'}", tmp_path / "api")
    worker, worker_log = start_host_worker(server, host_dir, True)
    project = tmp_path / "walled"
    project.mkdir()
    (project / "train.py").write_text(WALLED)
    try:
        wait_for(lambda: "jobs run walled" in worker_log.read_text(), 60, "the worker to start")
        with Client(server.url, server.api_token) as c:
            snap = c.push_code(project)
            first = c.submit({"entrypoint": "train.py", "args": ["write"], "code": snap.id})["id"]
            assert c.wait(first, timeout=180)["status"] == "succeeded", _log(c, first)
            old = Path(_log(c, first).split("WROTE cwd=")[1].split()[0])
            st = old.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
            again = run_ddpq(
                "resubmit", str(first), "--resume", "--json", "--", "attack", str(old),
                env=_env(server), cwd=tmp_path,
            )  # fmt: skip
            assert again.returncode == 0, again.stderr
            second = json.loads(again.stdout)["id"]
            job = c.wait(second, timeout=180)
            log = _log(c, second)
            assert job["status"] == "succeeded", log
            for what in ("list", "read", "write"):
                assert f"ATTACK {what} denied" in log, log
            cwd = Path(log.split("COPY cwd=")[1].split()[0])
            assert cwd != old and 'holds="A\'s output"' in log, log
            assert (old / "secret.txt").read_text() == "A's output"
            assert not (old / "planted.txt").exists()
            assert {i["path"] for i in c.outputs(first)["items"]} == {"secret.txt"}
    finally:
        stop_process(worker)
        stop_server(server)


def test_the_api_keeps_the_newest_directory_of_each_user_and_collects_the_rest(
    db_url: str, tmp_path: Path
) -> None:
    server = start_server(
        db_url,
        tmp_path / "api",
        DDPQ_CODE_RETENTION_S="0",
        DDPQ_WORKDIR_RETENTION="0",
        DDPQ_WORKDIR_KEEP_NEWEST="1",
    )
    try:
        user, w = server.client(), server.client("worker")
        code, _ = send_directory(server, {"train.py": b"print(1)\n"})
        register(server)
        dirs = {}
        for n in (1, 2):
            job = user.post("/jobs", json={"entrypoint": "train.py", "code": code}).json()
            claim = w.post(
                "/workers/claim",
                json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5},
            ).json()
            assert claim["job_id"] == job["id"]
            files = {"train.py": b"print(1)\n", f"out-{n}.txt": f"run {n}\n".encode()}
            dirs[job["id"]], _ = send_directory(server, files)
            body = {"worker": "hand", "attempt": 1, "directory": dirs[job["id"]], "workdir": "/d"}
            assert w.post(f"/workers/jobs/{job['id']}/outputs", json=body).status_code == 204
            done = {"worker": "hand", "attempt": 1, "exit_code": 0}
            assert w.post(f"/workers/jobs/{job['id']}/finish", json=done).status_code == 200
        older, newer = sorted(dirs)

        def collected() -> bool:
            return user.get(f"/jobs/{older}/outputs").json()["directory"] is None

        wait_for(collected, 30, "the older job's directory to be collected")
        assert user.get(f"/code/snapshots/{dirs[older]}").status_code == 404
        kept = user.get(f"/jobs/{newer}/outputs").json()
        assert kept["directory"] == dirs[newer] and kept["kept_newest"], kept
        assert [i["path"] for i in kept["items"]] == ["out-2.txt"]
        # The worker is told the older directory may go, not the newer.
        beat = w.post("/workers/heartbeat", json={"name": "hand", "kept": [older, newer]})
        assert beat.json()["ended"] == [older], beat.text
    finally:
        stop_server(server)


def test_the_workdir_retention_takes_a_duration_with_an_end() -> None:
    """As DDPQ_CHECKPOINT_RETENTION does (7d, 12h); never is refused: each user's newest
    ended jobs keep their directories anyway (DDPQ_WORKDIR_KEEP_NEWEST)."""
    import pydantic

    from service.config import Settings

    assert Settings(workdir_retention="7d").workdir_retention == 7 * 24 * 3600
    assert Settings(workdir_retention=90).workdir_retention == 90
    for bad in ("never", "soon", -1):
        with pytest.raises(pydantic.ValidationError, match="duration"):
            Settings(workdir_retention=bad)
