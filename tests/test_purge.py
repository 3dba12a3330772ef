"""The job purge (service/retention.py, DDPQ_JOB_RETENTION): an ended job deleted with
every row that hangs off it once the retention has passed, its checkpoints are deleted
and its directory is no longer kept; never a queued or running job, nor one of each
user's newest ended jobs, nor one whose checkpoints are still on a worker; in bounded
transactions, over as many rounds as it takes, by any number of sweepers at once; and
what it let go of (code, directories) collected by code collection."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from service import retention, rollup
from service.config import Settings
from service.db import Database, Policy
from service.models import (
    Attempt,
    Checkpoint,
    GpuSample,
    Job,
    JobNode,
    LogChunk,
    MetricPoint,
    utcnow,
)
from service.retention import Swept, sweep
from service.schemas import OutputsLimits
from tests.conftest import Server, start_server, stop_server, wait_for
from tests.helpers import (
    finish,
    register,
    report,
    send_directory,
    send_log,
    submit_and_claim,
)

POINTS = 300  # metric points of each job: more than a batch (BATCH_ROWS is 100 here)
KEEP_NEWEST = 2  # DDPQ_WORKDIR_KEEP_NEWEST in these tests
CHILDREN = (MetricPoint, GpuSample, LogChunk, Checkpoint, Attempt, JobNode)
SAMPLE = {"gpu": 0, "ago_s": 0, "utilization": 50, "memory_used": 1, "memory_total": 2}


def _limits(keep_newest: int = KEEP_NEWEST) -> OutputsLimits:
    return Settings(workdir_retention="1d", workdir_keep_newest=keep_newest).outputs_limits()


def _checkpoint(server: Server, claim: dict[str, Any], name: str) -> None:
    r = server.client(claim["token"]).post(
        f"/jobs/{claim['job_id']}/checkpoints",
        json={"path": f"{claim['checkpoint_dir']}/{name}", "step": 1},
    )
    assert r.status_code == 201, r.text


def _heartbeat(server: Server, name: str, **body: Any) -> dict[str, Any]:
    r = server.client("worker").post("/workers/heartbeat", json={"name": name, **body})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def _ended(server: Server, worker: str, checkpoint: str | None = None) -> int:
    """A job run by ``worker`` that left metric points, a log, GPU samples and,
    if ``checkpoint``, one registered checkpoint, then ended."""
    claim = submit_and_claim(server, worker)
    report(server, claim, [{"step": s, "values": {"loss": 1.0 / (s + 1)}} for s in range(POINTS)])
    send_log(server, claim, 0, b"[rank0]: hello\n" * 20, worker=worker)
    running = [{"job_id": claim["job_id"], "attempt": 1, "gpu_samples": [SAMPLE]}]
    _heartbeat(server, worker, running=running)
    if checkpoint:
        _checkpoint(server, claim, checkpoint)
    finish(server, claim, name=worker)
    return int(claim["job_id"])


def _set(db_url: str, job_ids: list[int], **values: Any) -> None:
    """Age jobs (finished_at) or give them an owner, as a year of use would have."""
    db = Database(db_url)
    with db.write() as s:
        s.execute(update(Job).where(Job.id.in_(job_ids)).values(**values))
    db.engine.dispose()


def _rows(db: Database, job_id: int) -> dict[str, int]:
    with db.read() as s:
        out = {
            m.__tablename__: s.scalar(select(func.count()).where(m.job_id == job_id)) or 0
            for m in CHILDREN
        }
        out["jobs"] = s.scalar(select(func.count()).where(Job.id == job_id)) or 0
    return out


def _sweep_all(db: Database, limits: OutputsLimits) -> tuple[int, int]:
    """Rounds with no budget (each one transaction's work at least) until done:
    (jobs purged, rounds)."""
    purged = rounds = 0
    got = Swept(done=False)
    while not got.done:
        got = sweep(db, budget_s=0, outputs=limits)
        purged += got.purged
        rounds += 1
        assert rounds < 10_000
    return purged, rounds


def test_the_purge_deletes_what_is_due_whole_and_spares_the_rest(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's own sweeper does nothing here: no purge, no other retention.
    server = start_server(
        db_url,
        tmp_path / "api",
        DDPQ_METRICS_DOWNSAMPLE_AFTER="never",
        DDPQ_LOG_RETENTION="never",
        DDPQ_CHECKPOINT_RETENTION="0",
    )
    try:
        register(server, "w")
        # alice: the oldest two due, one of them with a checkpoint its worker has deleted,
        # one with a checkpoint still on its worker, two newest ended, one running, one
        # queued. bob: one ended old, one ended lately (within the retention), two newest.
        # Jobs from before users (no owner): one due, two newest.
        a_due = [_ended(server, "w"), _ended(server, "w", checkpoint="gone.pt")]
        a_ckpt = _ended(server, "w", checkpoint="kept.pt")
        b_due = _ended(server, "w")
        b_late = _ended(server, "w")
        n_due = _ended(server, "w")
        a_new = [_ended(server, "w"), _ended(server, "w")]
        b_new = [_ended(server, "w"), _ended(server, "w")]
        n_new = [_ended(server, "w"), _ended(server, "w")]
        a_run = submit_and_claim(server, "w")["job_id"]
        a_queued = server.client().post("/jobs", json={"entrypoint": "t.py"}).json()["id"]
        # The worker deletes the directory of the job with gone.pt and says so; not kept.pt's.
        reply = _heartbeat(server, "w", running=[{"job_id": a_run, "attempt": 1}])
        assert a_due[1] in reply["drop"] and a_ckpt in reply["drop"]
        _heartbeat(
            server,
            "w",
            running=[{"job_id": a_run, "attempt": 1}],
            dropped=[{"job_id": a_due[1], "outcome": "deleted"}],
        )
        alice = [*a_due, a_ckpt, *a_new, a_run, a_queued]
        bob = [b_due, b_late, *b_new]
        _set(db_url, alice, owner="alice")
        _set(db_url, bob, owner="bob")
        _set(db_url, [n_due, *n_new], owner=None)
        everyone = [*alice, *bob, n_due, *n_new]
        _set(db_url, everyone, finished_at=utcnow() - timedelta(days=400))
        _set(db_url, [a_run, a_queued], finished_at=None)
        _set(db_url, [b_late], finished_at=utcnow() - timedelta(days=10))

        due = [*a_due, b_due, n_due]
        kept = [j for j in everyone if j not in due]
        db = Database(db_url, Policy(job_retention_s=365 * 86400, log_retention_s=None))
        try:
            # The purge takes only what accounting's rollup has counted: the sweeper's
            # rounds roll up what ended before its retention round comes to it.
            while rollup.roll(db, budget_s=5.0):
                pass
            before = {j: _rows(db, j) for j in everyone}
            assert all(before[j]["metric_points"] == POINTS for j in due)
            assert all(before[j]["gpu_samples"] and before[j]["log_chunks"] for j in due)
            assert before[a_due[1]]["checkpoints"] == 1 and before[a_ckpt]["checkpoints"] == 1
            # Small batches: a job's points take several transactions, and the jobs several
            # batches; with no budget, each round does one transaction's work and stops.
            monkeypatch.setattr(retention, "BATCH_ROWS", 100)
            monkeypatch.setattr(retention, "BATCH_JOBS", 2)
            purged, rounds = _sweep_all(db, _limits())
            assert purged == len(due) and rounds > len(due)
            for j in due:
                assert _rows(db, j) == dict.fromkeys(before[j], 0), j
            for j in kept:
                assert _rows(db, j) == before[j], j
            again = sweep(db, budget_s=60, outputs=_limits())
            assert again.done and again.purged == 0
        finally:
            db.engine.dispose()

        c = server.client()
        for j in due:
            r = c.get(f"/jobs/{j}")
            # This server has no purge: a plain 404.
            assert r.status_code == 404 and r.json()["detail"] == f"no job {j}", r.text
        for j in kept:
            assert c.get(f"/jobs/{j}").status_code == 200
        assert c.get(f"/jobs/{a_run}").json()["status"] == "running"
        assert c.get(f"/jobs/{a_queued}").json()["status"] == "queued"
        # The audit trail keeps its rows naming the purged jobs.
        audit = c.get("/audit", params={"limit": 500}).json()["items"]
        assert {f"job {j}" for j in due} <= {e["target"] for e in audit}
    finally:
        stop_server(server)


def test_the_sweeper_purges_a_purged_job_is_a_404_and_its_blobs_are_collected(
    db_url: str, tmp_path: Path
) -> None:
    env = {
        "DDPQ_JOB_RETENTION": "1s",
        "DDPQ_WORKDIR_RETENTION": "0",
        "DDPQ_WORKDIR_KEEP_NEWEST": "1",
        "DDPQ_CODE_RETENTION_S": "0",
        "DDPQ_CHECKPOINT_RETENTION": "0",
    }
    server = start_server(db_url, tmp_path / "api", **env)
    # On Postgres a second API process sweeps the same database (only the holder of the
    # sweep lock works, the other waits its turn): neither fails.
    second = None
    if db_url.startswith("postgresql"):
        tokens = (server.api_token, server.worker_token)
        second = start_server(db_url, tmp_path / "api2", tokens=tokens, **env)
    try:
        user, w = server.client(), server.client("worker")
        code, _ = send_directory(server, {"train.py": b"print(1)\n"})
        register(server)
        jobs, dirs, digests = [], {}, {}
        for n in (1, 2):
            job = user.post("/jobs", json={"entrypoint": "train.py", "code": code}).json()
            claim = w.post(
                "/workers/claim",
                json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5},
            ).json()
            assert claim["job_id"] == job["id"]
            files = {"train.py": b"print(1)\n", f"out-{n}.txt": f"purge run {n}\n".encode()}
            dirs[job["id"]], found = send_directory(server, files)
            digests[job["id"]] = found[f"out-{n}.txt"]
            body = {"worker": "hand", "attempt": 1, "directory": dirs[job["id"]], "workdir": "/d"}
            assert w.post(f"/workers/jobs/{job['id']}/outputs", json=body).status_code == 204
            report(server, claim, [{"step": s, "values": {"loss": 1.0}} for s in range(10)])
            finish(server, claim)
            jobs.append(job["id"])
        old, new = jobs
        running = submit_and_claim(server)["job_id"]

        wait_for(lambda: user.get(f"/jobs/{old}").status_code == 404, 60, "the purge")
        detail = user.get(f"/jobs/{old}").json()["detail"]
        assert detail == (
            f"no job {old}: it may have been purged (jobs that ended more than "
            "DDPQ_JOB_RETENTION=1s ago are deleted)"
        )
        assert user.get(f"/jobs/{old}/metrics").status_code == 404
        # Its directory and what only it held go with the next code collection.
        wait_for(
            lambda: user.get(f"/code/snapshots/{dirs[old]}").status_code == 404,
            60,
            "the purged job's directory to be collected",
        )
        wait_for(
            lambda: w.get(f"/workers/code/blobs/{digests[old]}").status_code == 404,
            60,
            "the content only the purged job's directory held to be collected",
        )
        # The newest ended job stays, its directory and its code with it; the running one too.
        assert user.get(f"/jobs/{new}").json()["status"] == "succeeded"
        assert user.get(f"/code/snapshots/{dirs[new]}").status_code == 200
        assert w.get(f"/workers/code/blobs/{digests[new]}").status_code == 200
        assert user.get(f"/jobs/{running}").json()["status"] == "running"
        for s in (server, second):
            if s is not None:
                assert "retention sweep failed" not in s.log() and "Traceback" not in s.log()
    finally:
        if second is not None:
            stop_server(second)
        stop_server(server)


def test_two_sweepers_at_once_purge_each_job_once(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two purges side by side on one database, small batches so that they meet (the
    advisory lock makes it rare, a lost lock or a restart makes it possible)."""
    server = start_server(db_url, tmp_path / "api", DDPQ_LOG_RETENTION="never")
    try:
        register(server, "w")
        ended = [_ended(server, "w") for _ in range(8)]
    finally:
        stop_server(server)
    # Not yet in accounting's rollup (whatever the server's sweeper did before it stopped).
    _set(db_url, ended, finished_at=utcnow() - timedelta(days=2), rolled=False)
    monkeypatch.setattr(retention, "BATCH_ROWS", 50)
    monkeypatch.setattr(retention, "BATCH_JOBS", 3)
    dbs = [Database(db_url, Policy(job_retention_s=86400, log_retention_s=None)) for _ in "ab"]
    assert _sweep_all(dbs[0], _limits(keep_newest=0))[0] == 0  # not counted yet: none goes
    while rollup.roll(dbs[0], budget_s=5.0):  # what the server's sweeper would have done
        pass
    purged: list[int] = []
    errors: list[BaseException] = []

    def run(db: Database) -> None:
        try:
            purged.append(_sweep_all(db, _limits(keep_newest=0))[0])
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(db,)) for db in dbs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert sum(purged) == len(ended)
        with dbs[0].read() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 0
            assert s.scalar(select(func.count()).select_from(MetricPoint)) == 0
    finally:
        for db in dbs:
            db.engine.dispose()


def test_the_job_retention_is_a_duration_never_by_default() -> None:
    assert Settings().job_retention is None and Settings().policy().job_retention_s is None
    s = Settings(job_retention="365d")
    assert s.job_retention == 365 * 86400 and s.policy().job_retention_s == 365 * 86400
    assert Settings(job_retention="never").job_retention is None
    with pytest.raises(ValueError, match="job_retention") as e:
        Settings(job_retention="a year")
    assert "not a duration" in str(e.value)
