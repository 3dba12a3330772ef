"""Forks: a job that starts from another job's checkpoint, however that job ended, on any
worker. On both databases through the worker protocol driven by hand: the fork waits,
saying for what, while the worker that holds the checkpoint is asked to send it; once
sent, every fork of it may start, its claim carrying the snapshot; one its worker could
not send fails the forks (and what waited for them), and a later fork of it is refused;
a checkpoint being sent is never pruned; bad forks are refused naming the field. Then the
worker's side, without a server: what it sends of a checkpoint and what it refuses.
Last, with real workers (SQLite: their launch is most of the time): a cancelled job's
checkpoint, held by one worker, resumed at its step by a fork on another;
`ddpq resubmit --resume` does the same; `ddpq checkpoints --download` fetches it."""

from __future__ import annotations

import json
import os
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from ddpq.client import Client
from ddpq.messages import ClaimedJob, ForkSource, SendOrder
from tests.conftest import Server, run_ddpq, wait_for
from tests.helpers import finish, register, submit_and_claim
from tests.test_checkpoints import _heartbeat, _register
from worker.files.code import BlobCache
from worker.files.sending import Refused, send_checkpoint, write_fork
from worker.starting.torchrun import resume_path

JOB = {"entrypoint": "train.py", "world_size": 1, "device": "cpu"}


def _submit(server: Server, **spec: Any) -> dict[str, Any]:
    r = server.client().post("/jobs", json={**JOB, **spec})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def _job(server: Server, job_id: int) -> dict[str, Any]:
    out: dict[str, Any] = server.client().get(f"/jobs/{job_id}").json()
    return out


def _claim(server: Server, name: str) -> dict[str, Any] | None:
    register(server, name)
    r = server.client("worker").post(
        "/workers/claim", json={"name": name, "free_cpu_slots": 8, "free_gpus": [], "wait_s": 0}
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def _snapshot(server: Server, tmp_path: Path, name: str, data: bytes) -> str:
    """A code snapshot of one file, as a worker sends a checkpoint."""
    where = tmp_path / f"ck-{name}"
    where.mkdir()
    (where / name).write_bytes(data)
    with Client(server.url, server.api_token) as c:
        return c.push_code(where).id


def test_a_fork_waits_for_its_checkpoint_to_be_sent_then_starts_anywhere(
    server: Server, tmp_path: Path
) -> None:
    source = submit_and_claim(server, "holder")
    _register(server, source, "step-10.pt", 10)
    ck = _register(server, source, "step-20.pt", 20)
    finish(server, source, exit_code=1, name="holder")  # failed: forks start from it anyway
    a = source["job_id"]

    fork = _submit(server, from_checkpoint={"job": a})
    assert fork["spec"]["from_checkpoint"] == {"job": a, "step": 20}, "the newest kept"
    assert fork["reason"].startswith(
        f"waiting for job {a}'s checkpoint at step 20 to be sent by worker holder"
    ), fork["reason"]
    assert _claim(server, "other") is None, "no claim takes a fork before its checkpoint"
    chained = _submit(server, after=[{"job": fork["id"]}])
    (sending,) = [
        c for c in server.client().get(f"/jobs/{a}/checkpoints").json()["items"] if c["step"] == 20
    ]
    assert sending["sending"] and sending["snapshot"] is None
    assert _heartbeat(server, "other")["send"] == [], "only its own worker is asked"
    (order,) = _heartbeat(server, "holder")["send"]
    assert (order["id"], order["job_id"], order["kind"]) == (ck, a, "file")
    assert order["path"].endswith("/step-20.pt")

    sid = _snapshot(server, tmp_path, "step-20.pt", b"weights at 20")
    assert _heartbeat(server, "holder", sent=[{"id": ck, "snapshot": sid}])["send"] == []
    claimed = _claim(server, "other")
    assert claimed is not None and claimed["job_id"] == fork["id"], claimed
    assert claimed["fork_from"] == {
        "job_id": a, "step": 20, "snapshot": sid, "name": "step-20.pt", "kind": "file",
    }  # fmt: skip
    # Sent once, forked at once: a later fork of it waits for nothing.
    again = _submit(server, from_checkpoint={"job": a, "step": 20})
    assert not (again["reason"] or "").startswith("waiting for job"), again["reason"]
    finish(server, claimed, name="other")
    nxt = _claim(server, "other")
    assert nxt is not None and {nxt["job_id"]} <= {again["id"], chained["id"]}


def test_a_checkpoint_that_cannot_be_sent_fails_its_forks_and_is_never_pruned_meanwhile(
    server: Server,
) -> None:
    source = submit_and_claim(server, "holder", keep_last=1)
    ck = _register(server, source, "step-5.pt", 5)
    b = source["job_id"]
    fork = _submit(server, from_checkpoint={"job": b, "step": 5})
    after_fork = _submit(server, after=[{"job": fork["id"], "when": "ok"}])
    # keep_last 1 would let step 5 go: not while a fork waits for it to be sent.
    _register(server, source, "step-6.pt", 6)
    _register(server, source, "step-7.pt", 7)
    states = {
        c["step"]: c["state"] for c in server.client().get(f"/jobs/{b}/checkpoints").json()["items"]
    }
    assert states == {5: "kept", 6: "pruning", 7: "kept"}, states
    (order,) = _heartbeat(server, "holder")["send"]
    assert order["id"] == ck
    _heartbeat(server, "holder", sent=[{"id": ck, "why": "it is no longer on its worker's disk"}])
    failed = _job(server, fork["id"])
    assert failed["status"] == "failed", failed
    assert failed["reason"] == (
        f"from_checkpoint: job {b}'s checkpoint at step 5 could not be sent: it is no longer "
        "on its worker's disk"
    ), failed["reason"]
    chained = _job(server, after_fork["id"])
    assert chained["status"] == "failed" and "can never be met" in chained["reason"]
    refused = server.client().post("/jobs", json={**JOB, "from_checkpoint": {"job": b, "step": 5}})
    assert refused.status_code == 409 and "could not be sent" in refused.text, refused.text
    # A report for a checkpoint of another worker's, or told already, changes nothing.
    _heartbeat(server, "holder", sent=[{"id": ck, "snapshot": "0" * 64}])
    (five,) = [
        c for c in server.client().get(f"/jobs/{b}/checkpoints").json()["items"] if c["step"] == 5
    ]
    assert five["snapshot"] is None and five["send_problem"], five


def test_bad_forks_and_downloads_are_refused_naming_the_field(server: Server) -> None:
    source = submit_and_claim(server, "holder")
    ck = _register(server, source, "step-3.pt", 3)
    a = source["job_id"]
    c = server.client()
    for given, loc, words in (
        ({"job": 10**9}, "job", "no job"),
        ({"job": a, "step": 7}, "step", "steps kept: 3"),
        ({"job": 0}, "job", "greater than or equal"),
        ({"job": a, "step": -1}, "step", "greater than or equal"),
        ({"job": a, "when": "now"}, "when", "Extra inputs"),
    ):
        r = c.post("/jobs", json={**JOB, "from_checkpoint": given})
        assert r.status_code == 422, (given, r.text)
        detail = r.json()["detail"][0]
        assert detail["loc"][:3] == ["body", "from_checkpoint", loc] and words in detail["msg"], (
            given,
            detail,
        )
    jobs_before = len(c.get("/jobs").json()["items"])
    assert jobs_before == 1, "nothing refused was queued"
    asked = c.post(f"/jobs/{a}/checkpoints/{ck}/send")
    assert asked.status_code == 202 and asked.json()["sending"], asked.text
    assert c.post(f"/jobs/{a}/checkpoints/{ck + 1000}/send").status_code == 404
    assert c.post(f"/jobs/{a + 1000}/checkpoints/{ck}/send").status_code == 404


# ---- the worker's side: what it sends of a checkpoint --------------------------------------


class _Api:
    """What send_checkpoint asks of the API, recorded: a worker's API without a server."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.files: list[dict[str, Any]] = []

    def outputs_limits(self) -> dict[str, Any]:
        return {
            "max_files": 10, "max_bytes": 1000, "max_file_bytes": 100,
            "retention_s": 60.0, "keep_newest": 1,
        }  # fmt: skip

    def missing_blobs(self, digests: list[str]) -> list[str]:
        return [d for d in digests if d not in self.blobs]

    def put_blob(self, digest: str, data: bytes) -> None:
        self.blobs[digest] = data

    def create_snapshot(self, files: list[dict[str, Any]]) -> dict[str, Any]:
        self.files = files
        return {"id": "f" * 64}


def test_the_worker_sends_what_was_registered_and_nothing_a_job_could_swap_in(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    job = root / "job-7"
    (job / "dir" / "sub").mkdir(parents=True)
    (job / "one.pt").write_bytes(b"1" * 10)
    (job / "dir" / "sub" / "a").write_bytes(b"a")
    (job / "big.pt").write_bytes(b"b" * 101)
    outside = tmp_path / "secret"
    outside.write_text("the worker's")
    (job / "link.pt").symlink_to(outside)
    (job / "via").symlink_to(tmp_path)
    st = (job / "one.pt").stat()

    def order(path: str, **kw: Any) -> SendOrder:
        return SendOrder(id=1, job_id=7, path=str(job / path), **kw)

    api = _Api()
    sid = send_checkpoint(root, api, order("one.pt", bytes=10, mtime_ns=st.st_mtime_ns))  # type: ignore[arg-type]
    assert sid == "f" * 64 and [f["path"] for f in api.files] == ["one.pt"]
    assert list(api.blobs.values()) == [b"1" * 10]
    send_checkpoint(root, api, order("dir", kind="dir"))  # type: ignore[arg-type]
    assert [f["path"] for f in api.files] == ["dir/sub/a"], "a directory's under its name"
    for bad, words in (
        (order("one.pt", bytes=11), "written again"),
        (order("big.pt"), "over the"),
        (order("link.pt"), "symbolic link"),
        (order("via/secret"), "is a symbolic link"),
        (order("../job-8/x.pt"), "is not inside"),
        (order("gone.pt"), "no longer on"),
        (order("one.pt", kind="dir"), "not a directory"),
    ):
        with pytest.raises(Refused, match=words):
            send_checkpoint(root, api, bad)  # type: ignore[arg-type]
    assert b"the worker's" not in b"".join(api.blobs.values())


def test_what_the_holder_sends_the_forks_worker_writes_out_under_its_name(
    tmp_path: Path,
) -> None:
    """Both ends agree: a framework's directory checkpoint sent by its holder is written
    by the fork's worker as <its checkpoint dir>/fork-of-job-7-step-5/<its name>/..., and
    that path is what the ranks resume from."""
    root = tmp_path / "ckpt"
    (root / "job-7" / "state" / "sub").mkdir(parents=True)
    (root / "job-7" / "state" / "sub" / "a").write_bytes(b"weights")
    (root / "job-7" / "state" / "b").write_bytes(b"optimizer")
    api = _Api()
    sid = send_checkpoint(
        root,
        api,
        SendOrder(id=1, job_id=7, path=str(root / "job-7" / "state"), kind="dir"),  # type: ignore[arg-type]
    )

    class Served:
        def snapshot(self, _: str) -> Any:
            return type("Snapshot", (), {"manifest": api.files})()

        def blob(self, digest: str) -> Any:
            yield api.blobs[digest]

    fork_from = ForkSource(job_id=7, step=5, snapshot=sid, name="state", kind="dir")
    claim = ClaimedJob(
        job_id=9, attempt=1, token="t", spec={"from_checkpoint": {"job": 7, "step": 5}},
        device="cpu", nproc_per_node=1, gpus=[], checkpoint_dir=str(tmp_path / "here" / "job-9"),
        resume_from=[], fork_from=fork_from,
    )  # fmt: skip
    cache = BlobCache(tmp_path / "cache", 10**6)
    path = write_fork(Served(), cache, claim, threading.Event())  # type: ignore[arg-type]
    assert path == str(tmp_path / "here" / "job-9" / "fork-of-job-7-step-5" / "state")
    assert (Path(path) / "sub" / "a").read_bytes() == b"weights"
    assert (Path(path) / "b").read_bytes() == b"optimizer"
    assert resume_path(claim) == path
    # A later attempt here finds it whole and writes nothing again.
    assert write_fork(None, cache, claim, threading.Event()) == path  # type: ignore[arg-type]


# ---- end to end -----------------------------------------------------------------------------

PROGRAM = """
import sys
import time

import ddpq

state = ddpq.load_checkpoint()
start = state["step"] if state else 0
print(f"starting at step {start}", flush=True)
for step in range(start + 1, start + 4):
    ddpq.save_checkpoint({"step": step}, step=step)
if sys.argv[1:] == ["hang"]:
    time.sleep(600)
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_cancelled_jobs_checkpoint_is_resumed_at_its_step_on_another_worker(
    server: Server, tmp_path: Path, start_worker: Any
) -> None:
    holder = start_worker(server, name="holder", cpu_slots=2)
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent(PROGRAM))
    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}

    def submit(command: str, *argv: str) -> int:
        r = run_ddpq(command, "--json", *argv, env=env, cwd=code)
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout)["id"])

    first = submit("submit", "--entrypoint", "train.py", "--device", "cpu", "--", "hang")
    c = server.client()
    wait_for(
        lambda: any(k["step"] == 3 for k in c.get(f"/jobs/{first}/checkpoints").json()["items"]),
        120,
        "its third checkpoint",
    )
    assert c.post(f"/jobs/{first}/cancel").status_code == 202
    wait_for(lambda: _job(server, first)["status"] == "cancelled", 60, "the cancel")
    # Only the other worker has a GPU: the forks (device cuda) run there, not on the holder.
    start_worker(server, name="other", gpus="0", cpu_slots=2)
    fork = submit(
        "submit", "--from-checkpoint", str(first), "--entrypoint", "train.py", "--device", "cuda"
    )
    resumed = submit("resubmit", "--resume", "--device", "cuda", str(first), "--", "done")
    for job_id in (fork, resumed):
        done = wait_for(
            lambda j=job_id: (x := _job(server, j))["status"] in ("succeeded", "failed") and x,
            180,
            f"job {job_id} to end",
        )
        log = c.get(f"/jobs/{job_id}/logs").text
        assert done["status"] == "succeeded", (done, log)
        assert done["worker"] == "other" and "starting at step 3" in log, log
        steps = [k["step"] for k in c.get(f"/jobs/{job_id}/checkpoints").json()["items"]]
        assert steps == [4, 5, 6], steps
    assert _job(server, fork)["spec"]["from_checkpoint"] == {"job": first, "step": 3}

    got = run_ddpq("checkpoints", str(first), "--download", str(tmp_path / "got"), env=env)
    assert got.returncode == 0, got.stderr
    (held,) = [k for k in c.get(f"/jobs/{first}/checkpoints").json()["items"] if k["step"] == 3]
    name = os.path.basename(held["path"])
    on_holder = holder.data_dir / "checkpoints" / f"job-{first}" / name
    assert (tmp_path / "got" / name).read_bytes() == on_holder.read_bytes()
