"""Checkpoint retention (service.checkpoints, worker.files.checkpoints; docs/checkpoints.md).

The protocol-level tests drive the worker protocol by hand, on both databases: which
checkpoints keep_last lets go (never the resume point, never a keep=True one), the
heartbeat's orders and reports, the retention of an ended job, refusals of bad input.
The worker's deletions are tested on real directories a hostile job could have built.
The end-to-end tests run `ddpq serve`, `ddpq worker` and torchrun: a hostile job that
tries to make its worker delete files outside its checkpoint directory, and a kill -9
of the worker mid-job after which the job resumes from its newest kept checkpoint.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ddpq.messages import PruneOrder
from tests.conftest import (
    Server,
    run_ddpq,
    start_server,
    stop_server,
    terminal,
    wait_for,
)
from tests.helpers import finish, records, register, submit_and_claim
from tests.test_faults import TRAINER as FAULTS_TRAINER
from tests.test_faults import _submit as submit_trainer
from worker.edges.procs import find_by_launch_id
from worker.files.checkpoints import Pruner, delete_checkpoint, drop_directory

# ---- the protocol, by hand --------------------------------------------------------------


def _register(server: Server, claim: dict[str, Any], name: str, step: int, **extra: Any) -> int:
    r = server.client(claim["token"]).post(
        f"/jobs/{claim['job_id']}/checkpoints",
        json={"path": f"{claim['checkpoint_dir']}/{name}", "step": step, **extra},
    )
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _states(server: Server, job_id: int) -> dict[int, str]:
    r = server.client().get(f"/jobs/{job_id}/checkpoints")
    assert r.status_code == 200, r.text
    return {c["step"]: c["state"] for c in r.json()["items"]}


def _heartbeat(server: Server, name: str = "hand", **body: Any) -> dict[str, Any]:
    r = server.client("worker").post("/workers/heartbeat", json={"name": name, **body})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def test_keep_last_lets_the_oldest_go_but_never_the_resume_point_nor_a_kept_one(
    server: Server,
) -> None:
    claim = submit_and_claim(server, keep_last=2, max_attempts=3)
    jid = claim["job_id"]
    ids = {
        10: _register(server, claim, "step-10.pt", 10, bytes=5, mtime_ns=123),
        20: _register(server, claim, "step-20.pt", 20, keep=True),
        30: _register(server, claim, "step-30.pt", 30),
    }
    assert _states(server, jid) == {10: "pruning", 20: "kept", 30: "kept"}
    # A run that restarted from scratch registers lower steps: the newest two by
    # registration stay, and so does step 30, which a resume would take (highest step).
    ids[1] = _register(server, claim, "step-1.pt", 1)
    ids[2] = _register(server, claim, "step-2.pt", 2)
    ids[3] = _register(server, claim, "step-3.pt", 3)
    assert _states(server, jid) == {
        10: "pruning", 20: "kept", 30: "kept", 1: "pruning", 2: "kept", 3: "kept"
    }  # fmt: skip

    # The worker that holds them is asked to delete them, with what was registered.
    reply = _heartbeat(server, running=[{"job_id": jid, "attempt": 1}])
    assert reply["prune"] == [
        {
            "id": ids[10],
            "job_id": jid,
            "path": f"/ckpt/job-{jid}/step-10.pt",
            "bytes": 5,
            "mtime_ns": 123,
            "kind": "file",
        },
        {"id": ids[1], "job_id": jid, "path": f"/ckpt/job-{jid}/step-1.pt"}
        | {"bytes": None, "mtime_ns": None, "kind": "file"},
    ]
    # Another worker's report about them changes nothing; this one's does.
    register(server, "other")
    _heartbeat(server, "other", pruned=[{"id": ids[10], "outcome": "deleted"}])
    assert _states(server, jid)[10] == "pruning"
    reply = _heartbeat(
        server,
        running=[{"job_id": jid, "attempt": 1}],
        pruned=[
            {"id": ids[10], "outcome": "deleted"},
            {"id": ids[1], "outcome": "refused", "why": "a symbolic link"},
        ],
    )
    assert reply["prune"] == []
    items = {c["step"]: c for c in server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]}
    assert items[10]["state"] == "pruned" and items[10]["pruned_at"]
    assert items[10]["note"] == "keep_last 2: newer checkpoints kept"
    assert items[1]["state"] == "refused"
    assert items[1]["note"] == "not deleted by hand: a symbolic link"
    assert items[20]["keep"] is True and items[10]["bytes"] == 5
    assert items[30]["expires_at"] is None  # the job runs

    # The next attempt is offered the kept ones only, the highest step first.
    r = server.client("worker").post(
        f"/workers/jobs/{jid}/finish", json={"worker": "hand", "attempt": 1, "outcome": "requeue"}
    )
    assert r.status_code == 200, r.text
    r = server.client("worker").post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert r.status_code == 200, r.text
    assert r.json()["resume_from"] == [
        f"/ckpt/job-{jid}/{name}" for name in ("step-30.pt", "step-20.pt", "step-3.pt", "step-2.pt")
    ]


def test_a_file_registered_again_is_superseded_not_deleted(server: Server) -> None:
    claim = submit_and_claim(server, keep_last=1)
    jid = claim["job_id"]
    first = _register(server, claim, "a.pt", 10)
    _register(server, claim, "b.pt", 20)
    assert _heartbeat(server)["prune"][0]["id"] == first
    # a.pt is written again (a step saved twice): its old row must not delete the file.
    _register(server, claim, "a.pt", 30)
    items = server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
    assert [(c["step"], c["state"]) for c in items] == [
        (10, "pruned"),
        (20, "pruning"),
        (30, "kept"),
    ]
    assert items[0]["note"] == "written again: the checkpoint of step 30"
    assert [o["path"] for o in _heartbeat(server)["prune"]] == [f"/ckpt/job-{jid}/b.pt"]
    # A late report of the old order changes nothing any more.
    _heartbeat(server, pruned=[{"id": first, "outcome": "deleted"}])
    assert _states(server, jid) == {10: "pruned", 20: "pruning", 30: "kept"}


def test_the_server_keeps_3_unless_a_job_says_and_an_ended_jobs_for_7_days(
    server: Server,
) -> None:
    every = submit_and_claim(server, keep_last=0)  # 0: every one
    for step in range(1, 6):
        _register(server, every, f"{step}.pt", step)
    assert set(_states(server, every["job_id"]).values()) == {"kept"}
    default = submit_and_claim(server)  # DDPQ_KEEP_LAST: 3
    for step in range(1, 6):
        _register(server, default, f"{step}.pt", step)
    assert _states(server, default["job_id"]) == {
        1: "pruning", 2: "pruning", 3: "kept", 4: "kept", 5: "kept"
    }  # fmt: skip
    # DDPQ_CHECKPOINT_RETENTION: 7d after the job's end, shown on each live checkpoint.
    ended = finish(server, every)
    finished = datetime.fromisoformat(ended["finished_at"])
    for c in server.client().get(f"/jobs/{every['job_id']}/checkpoints").json()["items"]:
        assert datetime.fromisoformat(c["expires_at"]) == finished + timedelta(days=7)
    job = server.client().get(f"/jobs/{every['job_id']}").json()
    assert job["latest_checkpoint"]["step"] == 5 and job["latest_checkpoint"]["expires_at"]
    assert _heartbeat(server)["drop"] == []


def test_an_ended_jobs_checkpoints_go_after_the_retention(db_url: str, tmp_path: Path) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_CHECKPOINT_RETENTION="0")
    try:
        claim = submit_and_claim(server)
        live = submit_and_claim(server)
        jid = claim["job_id"]
        _register(server, claim, "a.pt", 1)
        _register(server, live, "b.pt", 1)
        assert _heartbeat(server, running=[{"job_id": live["job_id"], "attempt": 1}])["drop"] == []
        ended = finish(server, claim)
        checkpoint = server.client().get(f"/jobs/{jid}/checkpoints").json()["items"][0]
        assert checkpoint["expires_at"] == ended["finished_at"]
        reply = _heartbeat(server, running=[{"job_id": live["job_id"], "attempt": 1}])
        assert reply["drop"] == [jid]
        # Another worker has none of it: it is asked nothing.
        register(server, "other")
        assert _heartbeat(server, "other")["drop"] == []
        # A report for a live job is ignored, whatever it says.
        _heartbeat(
            server,
            running=[{"job_id": live["job_id"], "attempt": 1}],
            dropped=[
                {"job_id": jid, "outcome": "deleted"},
                {"job_id": live["job_id"], "outcome": "deleted"},
            ],
        )
        assert _states(server, live["job_id"]) == {1: "kept"}
        (gone,) = server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
        assert gone["state"] == "pruned" and gone["expires_at"] is None
        assert gone["note"] == "retention: the job's checkpoint directory was removed at its end"
        assert _heartbeat(server)["drop"] == []
    finally:
        stop_server(server)


# Refused before the database is asked; and the CLI's formatting: SQLite is enough.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@SQLITE_ONLY
def test_bad_input_is_refused_naming_the_field(server: Server) -> None:
    c = server.client()
    for bad in (-1, "3", 1.5, 10**7):
        r = c.post("/jobs", json={"entrypoint": "t.py", "keep_last": bad})
        assert r.status_code == 422 and "keep_last" in r.text, (bad, r.text)
    r = c.get("/jobs/abc/checkpoints")
    assert r.status_code == 422 and "job_id" in r.text
    r = c.get("/jobs/99999999/checkpoints")
    assert r.status_code == 404 and "no job 99999999" in r.text
    claim = submit_and_claim(server)
    rank0 = server.client(claim["token"])
    path = f"{claim['checkpoint_dir']}/a.pt"
    for field, value in (("bytes", -1), ("mtime_ns", "1"), ("keep", "yes"), ("bytes", 2**64)):
        r = rank0.post(
            f"/jobs/{claim['job_id']}/checkpoints", json={"path": path, "step": 1, field: value}
        )
        assert r.status_code == 422 and field in r.text, (field, r.text)
    w = server.client("worker")
    for body in (
        {"pruned": [{"id": 1, "outcome": "burnt"}]},
        {"pruned": [{"id": 0, "outcome": "deleted"}]},
        {"dropped": [{"job_id": "x", "outcome": "deleted"}]},
        {"pruned": [{"id": 1, "outcome": "refused", "why": "x" * 501}]},
    ):
        r = w.post("/workers/heartbeat", json={"name": "hand", **body})
        assert r.status_code == 422, (body, r.text)
        field = next(iter(body))
        assert field in r.text


@SQLITE_ONLY
def test_the_cli_lists_checkpoints_and_submits_keep_last(server: Server, tmp_path: Path) -> None:
    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    claim = submit_and_claim(server, keep_last=1)
    _register(server, claim, "a.pt", 10, bytes=2048)
    _register(server, claim, "b.pt", 20, keep=True)
    _register(server, claim, "c.pt", 30)
    r = run_ddpq("checkpoints", str(claim["job_id"]), env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["STEP", "SIZE", "SAVED", "STATE", "PATH"]
    assert lines[1].split()[0:2] == ["10", "2.0"] and "pruning" in lines[1]
    assert "kept (keep)" in lines[2] and lines[3].split()[-1] == f"/ckpt/job-{claim['job_id']}/c.pt"
    r = run_ddpq("checkpoints", str(claim["job_id"]), "--json", env=env)
    items = json.loads(r.stdout)["items"]
    assert [(c["step"], c["state"], c["keep"]) for c in items] == [
        (10, "pruning", False), (20, "kept", True), (30, "kept", False)
    ]  # fmt: skip
    r = run_ddpq("checkpoints", "424242", env=env)
    assert r.returncode == 1 and "no job 424242" in r.stderr
    r = run_ddpq(
        "submit", "--no-code", "--entrypoint", "t.py", "--keep-last", "1", "--json", env=env
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["spec"]["keep_last"] == 1
    r = run_ddpq("submit", "--no-code", "--entrypoint", "t.py", "--keep-last", "-1", env=env)
    assert r.returncode == 2 and "keep-last" in r.stderr


def test_a_bad_retention_setting_stops_the_server_naming_it(tmp_path: Path) -> None:
    r = run_ddpq(
        "serve",
        "--port",
        "1",
        env={
            "DDPQ_CHECKPOINT_RETENTION": "soon",
            "DDPQ_DATA_DIR": str(tmp_path),
            "DDPQ_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        },
    )
    assert r.returncode != 0
    assert "checkpoint_retention" in r.stderr.lower() and "not a duration" in r.stderr


# ---- the worker's deletions, on directories a hostile job could build ------------------


def _order(root: Path, path: str, job_id: int = 7, **kw: Any) -> PruneOrder:
    return PruneOrder(id=1, job_id=job_id, path=path, **kw)


@pytest.fixture
def ckroot(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    (root / "job-7").mkdir(parents=True)
    (root / "job-8").mkdir()
    return root


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """What no job may make its worker delete: a directory and a file outside."""
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious.pt").write_bytes(b"x")
    return v


def test_a_registered_file_is_deleted_only_while_it_is_the_one_registered(ckroot: Path) -> None:
    f = ckroot / "job-7" / "sub" / "a.pt"
    f.parent.mkdir()
    f.write_bytes(b"12345")
    st = f.stat()
    changed = _order(ckroot, str(f), bytes=5, mtime_ns=st.st_mtime_ns + 1)
    assert delete_checkpoint(ckroot, changed)[0] == "refused" and f.exists()
    assert delete_checkpoint(ckroot, _order(ckroot, str(f), bytes=4))[0] == "refused"
    same = _order(ckroot, str(f), bytes=5, mtime_ns=st.st_mtime_ns)
    assert delete_checkpoint(ckroot, same) == ("deleted", None) and not f.exists()
    assert delete_checkpoint(ckroot, same) == ("missing", None)
    assert delete_checkpoint(ckroot, _order(ckroot, str(ckroot / "job-9" / "a.pt"), 9))[0] == (
        "missing"
    )


def test_no_path_a_job_gives_deletes_outside_its_directory(ckroot: Path, victim: Path) -> None:
    precious = victim / "precious.pt"
    other = ckroot / "job-8" / "b.pt"
    other.write_bytes(b"b")
    job = ckroot / "job-7"
    (job / "link.pt").symlink_to(precious)
    (job / "dirlink").symlink_to(victim, target_is_directory=True)
    (job / "adir").mkdir()
    for path in (
        str(precious),  # outside
        f"{job}/../job-8/b.pt",  # another job's
        str(other),
        f"{job}/link.pt",  # a link to a file outside
        f"{job}/dirlink/precious.pt",  # through a link to a directory outside
        f"{job}/adir",  # a directory
        str(job),
        "relative/a.pt",
        f"{job}/./../../victim/precious.pt",
    ):
        outcome, why = delete_checkpoint(ckroot, _order(ckroot, path))
        assert outcome == "refused" and why, (path, outcome)
    assert precious.exists() and other.exists() and (job / "link.pt").is_symlink()
    # The job's directory itself swapped for a link to somewhere else.
    (ckroot / "job-8").rename(ckroot / "job-8.real")
    (ckroot / "job-8").symlink_to(victim, target_is_directory=True)
    outcome, why = delete_checkpoint(ckroot, _order(ckroot, str(ckroot / "job-8/precious.pt"), 8))
    assert outcome == "refused" and "symbolic link" in str(why)
    assert precious.exists()


def test_an_ended_jobs_directory_goes_whole_and_nothing_outside(ckroot: Path, victim: Path) -> None:
    job = ckroot / "job-7"
    (job / "deep").mkdir()
    (job / "deep" / "a.pt").write_bytes(b"a")
    (job / "step.pt.tmp").write_bytes(b"cut off by a kill")
    (job / "link.pt").symlink_to(victim / "precious.pt")
    (job / "deep" / "dirlink").symlink_to(victim, target_is_directory=True)
    assert drop_directory(ckroot, 7) == ("deleted", None)
    assert not job.exists() and (victim / "precious.pt").exists()
    assert drop_directory(ckroot, 7) == ("missing", None)
    (ckroot / "job-8").rmdir()
    (ckroot / "job-8").symlink_to(victim, target_is_directory=True)
    outcome, _ = drop_directory(ckroot, 8)
    assert outcome == "refused" and not (ckroot / "job-8").exists()
    assert (victim / "precious.pt").exists()


def test_the_pruner_does_each_order_once_and_reports_until_answered(ckroot: Path) -> None:
    f = ckroot / "job-7" / "a.pt"
    f.write_bytes(b"a")
    pruner = Pruner(ckroot)
    order = PruneOrder(id=5, job_id=7, path=str(f))
    pruner.take([order], [7, 8], running={8})  # job 8 runs here: its directory stays
    assert pruner.wait_idle(10)
    pruned, dropped = pruner.reports()
    assert pruned == [{"id": 5, "outcome": "deleted", "why": None}]
    # The heartbeat failed: the same reply again adds nothing, the reports stay.
    pruner.take([order], [7], running=set())
    assert pruner.wait_idle(10)
    assert pruner.reports() == (pruned, dropped)
    assert [d["job_id"] for d in dropped] == [7] and (ckroot / "job-8").is_dir()
    pruner.answered(pruned, dropped)
    assert pruner.reports() == ([], [])


def test_save_checkpoint_registers_the_file_as_written_and_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from ddpq import train

    sent: list[dict[str, Any]] = []

    class Sender:
        def add_checkpoint(self, body: dict[str, Any]) -> None:
            sent.append(body)

    monkeypatch.setenv("DDPQ_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setattr(train, "_get_sender", lambda: Sender())
    path = train.save_checkpoint({"w": torch.zeros(3)}, step=4, keep=True)
    assert path is not None
    st = path.stat()
    assert sent == [
        {"path": str(path), "step": 4, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        | {"keep": True}
    ]
    train.save_checkpoint({"w": torch.zeros(3)}, step=5)
    assert "keep" not in sent[-1]


# ---- end to end: real serve, worker, torchrun -------------------------------------------

# A job that tries, with its own token, to make its worker delete what is not its own: a
# file and a directory outside (through links it plants), another job's file, paths with
# `..`. It registers its checkpoints by hand (no torch needed), keep_last 1 lets each go
# as the next registers, and it ends once the last ordinary one it let go is deleted
# (orders run in registration order), swapping its directory for a link to the victim.
HOSTILE = r"""
import json, os, sys, time, httpx

victim, record = sys.argv[1], sys.argv[2]
ckpt = os.environ["DDPQ_CHECKPOINT_DIR"]
api = httpx.Client(base_url=os.environ["DDPQ_URL"], timeout=30,
                   headers={"Authorization": "Bearer " + os.environ["DDPQ_JOB_TOKEN"]})
url = "/jobs/%s/checkpoints" % os.environ["DDPQ_JOB_ID"]
step = 0
answers = {}

def register(path, name=None):
    global step
    step += 1
    r = api.post(url, json={"path": path, "step": step})
    answers[name or os.path.basename(path)] = r.status_code
    return r

def saved(name):
    path = os.path.join(ckpt, name)
    with open(path, "wb") as f:
        f.write(b"weights")
    return register(path)

os.makedirs(ckpt, exist_ok=True)
saved("a.pt")
os.symlink(os.path.join(victim, "precious.pt"), os.path.join(ckpt, "link.pt"))
register(os.path.join(ckpt, "link.pt"))
os.symlink(victim, os.path.join(ckpt, "dirlink"))
register(os.path.join(ckpt, "dirlink", "precious.pt"), "dirlink")
register(ckpt + "/../../victim/precious.pt", "dotdot")
register(os.path.join(victim, "precious.pt"), "outside")
saved("b.pt")
saved("c.pt")
deadline = time.monotonic() + 120
while os.path.exists(os.path.join(ckpt, "b.pt")) and time.monotonic() < deadline:
    time.sleep(0.1)
os.rename(ckpt, ckpt + ".moved")
os.symlink(victim, ckpt)
with open(record, "w") as f:
    json.dump({"answers": answers, "b_deleted": not os.path.exists(ckpt + ".moved/b.pt"),
               "a_deleted": not os.path.exists(ckpt + ".moved/a.pt")}, f)
"""


@pytest.mark.torchrun
def test_a_hostile_job_cannot_make_its_worker_delete_outside_its_directory(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_CHECKPOINT_RETENTION="0")
    try:
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "precious.pt").write_bytes(b"not yours")
        record = tmp_path / "hostile.json"
        w = start_worker(server, name="w", cpu_slots=1)
        (w.workspace / "hostile.py").write_text(HOSTILE)
        r = server.client().post(
            "/jobs",
            json={
                "entrypoint": "hostile.py",
                "device": "cpu",
                "keep_last": 1,
                "args": [str(victim), str(record)],
            },
        )
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        final = terminal(server.client(), jid, timeout=180)
        assert final["status"] == "succeeded", server.client().get(f"/jobs/{jid}/logs").text
        seen = json.loads(record.read_text())
        assert seen["answers"] == {
            "a.pt": 201, "link.pt": 201, "dirlink": 201, "dotdot": 422, "outside": 422,
            "b.pt": 201, "c.pt": 201,
        }  # fmt: skip
        assert seen["a_deleted"] and seen["b_deleted"]

        # Its retention (0) over, the worker removes its checkpoint directory: here the
        # link the job left in its place, never what it names.
        root = w.data_dir.resolve() / "checkpoints"

        def settled() -> list[dict[str, Any]] | None:
            items: list[dict[str, Any]] = (
                server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
            )
            live = any(c["state"] in ("kept", "pruning") for c in items)
            return None if live or (root / f"job-{jid}").is_symlink() else items

        items = wait_for(settled, 60, "the job's checkpoints to be settled")
        assert (victim / "precious.pt").read_bytes() == b"not yours"
        assert sorted(os.listdir(victim)) == ["precious.pt"]
        by_name = {Path(c["path"]).name: c for c in items}
        assert by_name["a.pt"]["state"] == "pruned" and by_name["b.pt"]["state"] == "pruned"
        assert by_name["link.pt"]["state"] == "refused"
        assert "symbolic link" in by_name["link.pt"]["note"]
        assert by_name["precious.pt"]["state"] == "refused"
        assert f"job-{jid}/dirlink is a symbolic link" in by_name["precious.pt"]["note"]
        # c.pt, kept to the end, went with the directory; the link in its place was
        # refused as a directory and removed, alone.
        assert by_name["c.pt"]["state"] == "refused"
        assert "the link was removed, not what it named" in by_name["c.pt"]["note"]
        assert (root / f"job-{jid}.moved" / "c.pt").exists()
    finally:
        stop_server(server)


# The fault tests' trainer, recording also where a start resumed from: the checkpoint the
# worker offered (DDPQ_RESUME_FROM) and the one it loaded.
RECORDED = '"rank": rank, "start_step": step, "pid": os.getpid(),'
TRAINER = FAULTS_TRAINER.replace(
    RECORDED,
    RECORDED + ' "offered": os.environ.get("DDPQ_RESUME_FROM"),'
    ' "loaded": str(train.latest_checkpoint()) if step else None,',
)
assert TRAINER != FAULTS_TRAINER


def _checkpoints(server: Server, jid: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = server.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
    return items


# What this needs of the database (which checkpoints are kept and offered for a resume)
# is tested above on both; the kill and the resume are the worker's and torchrun's.
@pytest.mark.long  # a kill -9 and a resume through torchrun: about 40 s (make test-long)
@pytest.mark.torchrun
@SQLITE_ONLY
def test_kill_9_of_the_worker_mid_job_resumes_from_the_newest_kept_checkpoint(
    db_url: str, tmp_path: Path, start_worker: Any
) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="3")
    try:
        record = tmp_path / "starts.jsonl"
        a = start_worker(server, name="a")
        (a.workspace / "trainer.py").write_text(TRAINER)
        jid = submit_trainer(server, record, "--pace", "0.2", keep_last=1)

        def pruning_mid_job() -> bool:
            items = _checkpoints(server, jid)
            return items[0]["state"] == "pruned" and max(c["step"] for c in items) >= 30

        wait_for(pruning_mid_job, 120, "step 10's checkpoint pruned, step 30's registered")
        assert not Path(_checkpoints(server, jid)[0]["path"]).exists()
        a.proc.kill()  # kill -9: mid-job, perhaps mid-save
        a.proc.wait()
        wait_for(lambda: not find_by_launch_id(a.launch_prefix, prefix=True), 30, "ranks to die")
        (newest,) = [c for c in _checkpoints(server, jid) if c["state"] == "kept"]
        assert Path(newest["path"]).is_file()

        # The same worker again (the files are on its disk): it takes the job back.
        start_worker(server, name="a")
        final = terminal(server.client(), jid, timeout=180)
        assert final["status"] == "succeeded", server.client().get(f"/jobs/{jid}/logs").text
        assert final["attempt"] == 2
        second = [s for s in records(record) if s["attempt"] == 2]
        assert {s["rank"] for s in second} == {0, 1}
        # Offered the newest kept checkpoint; loaded it, or a newer save the kill cut off
        # before it registered (on this disk, in the job's directory).
        assert second[0]["offered"] == newest["path"]
        assert second[0]["start_step"] >= newest["step"]
        if second[0]["start_step"] == newest["step"]:
            assert second[0]["loaded"] == newest["path"]

        def settled() -> list[dict[str, Any]] | None:
            items = _checkpoints(server, jid)
            return None if any(c["state"] == "pruning" for c in items) else items

        items = wait_for(settled, 60, "the pruned checkpoints to be deleted")
        assert [c["step"] for c in items if c["state"] == "kept"] == [60]
        for c in items:
            assert Path(c["path"]).exists() == (c["state"] == "kept"), c
            if c["state"] == "kept":
                assert Path(c["path"]).stat().st_size == c["bytes"]
    finally:
        stop_server(server)
