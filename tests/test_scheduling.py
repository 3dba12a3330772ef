"""The scheduler: GPU slots, priorities, backfill, the starvation guard, reasons, races.

Most of these drive the worker protocol by hand against a real `ddpq serve` (no
torchrun needed to hold a slot); one runs real jobs on a worker told it has 4 GPUs.

A test that looks at its own jobs, claimed by a worker that only it registers or runs,
runs on the module's server of its database (``api``: what the test before left active is
ended after it, helpers.its_turn, so the only jobs queued are the test's own); one whose
reasons or counts read every worker (the most GPUs free, none registered, the server's
claims), or that leaves workers behind, has a server of its own (``server``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import Server, launcher_env, start_server, stop_server, terminal, wait_for
from tests.helpers import claims_asked, register

GPU = {"entrypoint": "probe.py", "device": "cuda"}


def _claim(
    server: Server, name: str = "gpu", free_gpus: list[int] | None = None, cpu: int = 8
) -> dict | None:
    r = server.client("worker").post(
        "/workers/claim",
        json={
            "name": name,
            "free_cpu_slots": cpu,
            "free_gpus": free_gpus if free_gpus is not None else [0, 1, 2, 3],
            "wait_s": 0,
        },
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def _finish(server: Server, claim: dict, name: str = "gpu") -> None:
    r = server.client("worker").post(
        f"/workers/jobs/{claim['job_id']}/finish",
        json={"worker": name, "attempt": claim["attempt"], "exit_code": 0},
    )
    assert r.status_code == 200, r.text


def _submit(server: Server, **spec: Any) -> dict:
    r = server.client().post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    return r.json()


def _job(server: Server, job_id: int) -> dict:
    return server.client().get(f"/jobs/{job_id}").json()


def test_gpu_claims_are_disjoint_and_held_until_finish(server: Server) -> None:
    register(server, "gpu", cpu_slots=8, gpus=[0, 1, 2, 3])
    a = _submit(server, **GPU, world_size=2)
    b = _submit(server, **GPU, world_size=2)
    c = _submit(server, **GPU, world_size=4)
    ca, cb = _claim(server), _claim(server)
    assert ca and cb and ca["job_id"] == a["id"] and cb["job_id"] == b["id"]
    assert ca["device"] == "cuda" and len(ca["gpus"]) == 2 and len(cb["gpus"]) == 2
    assert not set(ca["gpus"]) & set(cb["gpus"])
    assert _job(server, a["id"])["gpus"] == ca["gpus"]
    # A worker whose own view lags still cannot get a GPU the books say is held.
    assert _claim(server, free_gpus=[0, 1, 2, 3]) is None
    assert _job(server, c["id"])["reason"] == "waiting for 4 GPUs; the most free on one worker is 0"
    assert _job(server, c["id"])["queue_position"] == 1
    workers = server.client().get("/workers").json()["items"]
    assert workers[0]["free_gpus"] == [] and {j["job_id"] for j in workers[0]["running"]} == {
        a["id"],
        b["id"],
    }
    _finish(server, ca)
    assert _claim(server) is None
    assert _job(server, c["id"])["reason"] == "waiting for 4 GPUs; the most free on one worker is 2"
    _finish(server, cb)
    cc = _claim(server)
    assert cc and cc["job_id"] == c["id"] and cc["gpus"] == [0, 1, 2, 3]


def test_priority_first_then_submission_order_with_backfill(api: Server) -> None:
    server = api
    register(server, "gpu", cpu_slots=8, gpus=[0, 1, 2, 3])
    hold = _submit(server, **GPU, world_size=2)
    held = _claim(server)
    assert held and held["job_id"] == hold["id"]
    big = _submit(server, **GPU, world_size=4)
    small = _submit(server, **GPU, world_size=2)
    urgent = _submit(server, **GPU, world_size=2, priority=5)
    assert [_job(server, j["id"])["queue_position"] for j in (urgent, big, small)] == [1, 2, 3]
    first = _claim(server)
    assert first and first["job_id"] == urgent["id"]
    _finish(server, first)
    # 2 GPUs free: the 4-GPU head waits; the 2-GPU job behind it backfills.
    second = _claim(server)
    assert second and second["job_id"] == small["id"]
    assert _job(server, big["id"])["status"] == "queued"
    _finish(server, held)
    _finish(server, second)
    third = _claim(server)
    assert third and third["job_id"] == big["id"]


def test_a_starving_head_job_is_not_jumped(tmp_path: Path, db_url: str) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_STARVATION_S="1")
    try:
        register(server, "gpu", cpu_slots=8, gpus=[0, 1, 2, 3])
        register(server, "cpu-only", cpu_slots=4, gpus=[])
        hold = _submit(server, **GPU, world_size=2)
        held = _claim(server)
        assert held and held["job_id"] == hold["id"]
        big = _submit(server, **GPU, world_size=4)
        wait_for(
            lambda: "no longer start ahead" in _job(server, big["id"])["reason"],
            30,
            "the head job to starve",
        )
        small = _submit(server, **GPU, world_size=2)
        assert _claim(server) is None, "a smaller job jumped a starving head job"
        # A worker that could never run the head job is not held back by it.
        cpu_job = _submit(server, entrypoint="probe.py", device="cpu", world_size=2)
        got = _claim(server, name="cpu-only", free_gpus=[], cpu=4)
        assert got and got["job_id"] == cpu_job["id"]
        _finish(server, held)
        nxt = _claim(server)
        assert nxt and nxt["job_id"] == big["id"]
        assert _job(server, small["id"])["status"] == "queued"
    finally:
        stop_server(server)


def test_unschedulable_jobs_say_so_and_strict_refuses_them(server: Server) -> None:
    c = server.client()
    early = _submit(server, **GPU, world_size=2)
    assert _job(server, early["id"])["reason"] == "waiting for a worker: none has registered"
    register(server, "gpu", cpu_slots=8, gpus=[0, 1, 2, 3])
    huge = _submit(server, **GPU, world_size=8)
    assert _job(server, huge["id"])["status"] == "queued"
    assert _job(server, huge["id"])["reason"] == (
        "unschedulable: needs 8 GPUs on one worker; the largest worker has 4 GPUs"
    )
    many_cpu = _submit(server, entrypoint="probe.py", device="cpu", world_size=16)
    assert _job(server, many_cpu["id"])["reason"].startswith("unschedulable: needs 16 CPU slots")
    before = len(c.get("/jobs").json()["items"])
    r = c.post("/jobs", params={"strict": "true"}, json={**GPU, "world_size": 8})
    assert r.status_code == 409 and "unschedulable" in r.json()["detail"]
    assert len(c.get("/jobs").json()["items"]) == before
    assert (
        c.post("/jobs", params={"strict": "true"}, json={**GPU, "world_size": 4}).status_code == 201
    )


def test_concurrent_claimers_take_each_job_exactly_once(server: Server) -> None:
    # 15 claims a claimer, each against seven others: far past the 30 rounds that catch a
    # 10 % race (two claims at once, 30 rounds on each database: tests/test_races.py).
    n_jobs, n_claimers = 120, 8
    for i in range(n_claimers):
        register(server, f"w{i}", cpu_slots=1000, gpus=[])
    c = server.client()
    ids = {_submit(server, entrypoint="noop.py", device="cpu")["id"] for _ in range(n_jobs)}
    claimed: list[list[int]] = [[] for _ in range(n_claimers)]
    errors: list[str] = []
    start = threading.Barrier(n_claimers)

    def claimer(i: int) -> None:
        with httpx.Client(
            base_url=server.url,
            headers={"Authorization": f"Bearer {server.worker_token}"},
            timeout=60,
        ) as w:
            start.wait()
            while True:
                r = w.post(
                    "/workers/claim",
                    json={"name": f"w{i}", "free_cpu_slots": 1000, "free_gpus": [], "wait_s": 0},
                )
                if r.status_code == 204:
                    return
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                claimed[i].append(r.json()["job_id"])

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(n_claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors
    everything = [j for per in claimed for j in per]
    assert len(everything) == len(set(everything)), "a job was claimed twice"
    assert set(everything) == ids
    assert sum(1 for per in claimed if per) > 1  # the claimers really raced
    assert c.get("/jobs", params={"status": "queued"}).json()["items"] == []


def _claim_behind_held_rows(
    server: Server, pg_url: str, jobs: int
) -> tuple[list[int], psycopg.Connection, threading.Thread, list[dict | None]]:
    """``jobs`` CPU jobs queued, every queued row held by another transaction (as a share
    refresh holds an owner's), and a claim of worker w waiting on those locks: the jobs,
    the holding connection, the claim's thread and where its answer goes."""
    register(server, "w", cpu_slots=8, gpus=[])
    ids = [_submit(server, entrypoint="noop.py", device="cpu")["id"] for _ in range(jobs)]
    holder = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://", 1))
    holder.execute("SELECT id FROM jobs WHERE status = 'queued' FOR UPDATE")
    got: list[dict | None] = []
    t = threading.Thread(target=lambda: got.append(_claim(server, "w", [])))
    t.start()

    def claim_waits_on_a_lock() -> bool:
        q = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        with psycopg.connect(holder.info.dsn, autocommit=True) as look:
            return bool(look.execute(q).fetchone()[0])  # type: ignore[index]

    wait_for(claim_waits_on_a_lock, 30, "the claim to wait on the held rows")
    return ids, holder, t, got


def test_a_claim_waits_out_a_transaction_holding_every_queued_row(
    pg_url: str, tmp_path: Path
) -> None:
    """A share refresh locks all of an owner's queued rows for its transaction: a claim
    meeting only locked rows that fit waits for them rather than answer "no job" while
    jobs wait (a worker told "none" idles until its next poll). Postgres only: SQLite
    has no row locks, a writer there holds the whole database and every claim waits."""
    server = start_server(pg_url, tmp_path / "api")
    try:
        ids, holder, t, got = _claim_behind_held_rows(server, pg_url, 3)
        holder.commit()
        holder.close()
        t.join(timeout=30)
        assert got and got[0] is not None and got[0]["job_id"] in ids
    finally:
        stop_server(server)


def test_a_waiting_claim_waits_for_the_best_row_alone_and_then_takes_the_next_free_one(
    pg_url: str, tmp_path: Path
) -> None:
    """The claim that waits for held rows waits for the lock of the best one only (a claim
    that waited walking the queue kept the lock of each row it passed that another claim
    took meanwhile, and two such walks deadlocked); if that job went to another worker
    as it waited, it takes the next free one at once. Postgres only (row locks)."""
    server = start_server(pg_url, tmp_path / "api")
    try:
        (first, second), holder, t, got = _claim_behind_held_rows(server, pg_url, 2)
        # Another worker's claim took the first job meanwhile (as its transaction would).
        holder.execute("UPDATE jobs SET status = 'running' WHERE id = %s", (first,))
        holder.commit()
        holder.close()
        t.join(timeout=30)
        assert got and got[0] is not None and got[0]["job_id"] == second
    finally:
        stop_server(server)


def test_concurrent_requests_with_one_idempotency_key_make_one_job(api: Server) -> None:
    server = api
    n = 12
    before = len(server.client().get("/jobs", params={"limit": 500}).json()["items"])
    results: list[httpx.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(n)
    body = {"entrypoint": "train.py", "world_size": 2}

    def submit() -> None:
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.api_token}"}, timeout=60
        ) as c:
            start.wait()
            r = c.post("/jobs", json=body, headers={"Idempotency-Key": "same-key"})
            with lock:
                results.append(r)

    threads = [threading.Thread(target=submit) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [r.status_code for r in results] == [201] * n, [
        r.text for r in results if r.status_code != 201
    ]
    assert len({r.json()["id"] for r in results}) == 1
    assert len(server.client().get("/jobs", params={"limit": 500}).json()["items"]) == before + 1


PROBE = r"""
import json, os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
job, rank = os.environ["DDPQ_JOB_ID"], os.environ["RANK"]
seen = {"cvd": os.environ["CUDA_VISIBLE_DEVICES"], "order": os.environ.get("CUDA_DEVICE_ORDER")}
(out / f"job{job}-rank{rank}.json").write_text(json.dumps(seen))
deadline = time.time() + 120
while not (out / f"release-{job}").exists() and time.time() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.torchrun
def test_gpu_jobs_on_a_four_gpu_worker(server: Server, start_worker, tmp_path: Path) -> None:
    worker = start_worker(server, gpus="0,1,2,3", cpu_slots=4)
    (worker.workspace / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    spec = {"entrypoint": "probe.py", "args": [str(out)], "device": "cuda"}
    a = _submit(server, **spec, world_size=2)
    b = _submit(server, **spec, world_size=2)
    c = _submit(server, **spec, world_size=4)

    def seen(job: dict, ranks: int) -> list[str] | None:
        files = [out / f"job{job['id']}-rank{r}.json" for r in range(ranks)]
        if all(f.exists() for f in files):
            return [json.loads(f.read_text())["cvd"] for f in files]
        return None

    cvd_a = wait_for(lambda: seen(a, 2), 90, "job A's ranks")
    cvd_b = wait_for(lambda: seen(b, 2), 90, "job B's ranks")
    assert len(set(cvd_a)) == 1 and len(set(cvd_b)) == 1, "every rank of a job sees the same GPUs"
    # CUDA numbers the GPUs as the worker (NVML, nvidia-smi) does, not fastest-first.
    orders = {json.loads(f.read_text())["order"] for f in out.glob(f"job{a['id']}-rank*.json")}
    assert orders == {"PCI_BUS_ID"}
    gpus_a, gpus_b = set(cvd_a[0].split(",")), set(cvd_b[0].split(","))
    assert len(gpus_a) == len(gpus_b) == 2 and not gpus_a & gpus_b
    assert _job(server, c["id"])["reason"] == "waiting for 4 GPUs; the most free on one worker is 0"
    (out / f"release-{a['id']}").touch()
    assert terminal(server.client(), a["id"])["status"] == "succeeded"
    wait_for(
        lambda: "most free on one worker is 2" in _job(server, c["id"])["reason"],
        30,
        "C's reason to update",
    )
    assert _job(server, c["id"])["status"] == "queued"
    (out / f"release-{b['id']}").touch()
    cvd_c = wait_for(lambda: seen(c, 4), 90, "job C's ranks")
    assert set(cvd_c) == {"0,1,2,3"}
    (out / f"release-{c['id']}").touch()
    assert terminal(server.client(), c["id"])["status"] == "succeeded"
    assert _job(server, c["id"])["gpus"] == [0, 1, 2, 3]


@pytest.mark.torchrun
def test_timeout_kills_the_attempt_and_fails_the_job(
    api: Server, start_worker, launcher: str
) -> None:
    server = api
    worker = start_worker(server, "--kill-grace-s", "2", env=launcher_env(launcher))
    (worker.workspace / "forever.py").write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    job = _submit(server, entrypoint="forever.py", world_size=2, timeout_s=3)
    final = terminal(server.client(), job["id"], timeout=90)
    assert final["status"] == "failed" and final["reason"] == "timeout after 3 s"


def test_submit_and_finish_notify_other_api_processes(pg_url: str, tmp_path: Path) -> None:
    """Every API process LISTENs on ddpq_jobs (Postgres only: SQLite has one API
    process); a submit and a finish must NOTIFY it."""
    import psycopg
    from sqlalchemy.engine import make_url

    server = start_server(pg_url, tmp_path / "api")
    conninfo = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("LISTEN ddpq_jobs")
        register(server, "gpu", cpu_slots=8, gpus=[0, 1, 2, 3])
        _submit(server, **GPU, world_size=2)
        assert [n.channel for n in conn.notifies(timeout=10, stop_after=1)] == ["ddpq_jobs"]
        claim = _claim(server)
        assert claim
        _finish(server, claim)
        assert [n.channel for n in conn.notifies(timeout=10, stop_after=1)] == ["ddpq_jobs"]
    stop_server(server)


def test_an_open_poll_takes_the_slots_its_own_worker_s_finish_frees(server: Server) -> None:
    """A worker's long-poll carries the GPUs free when it was sent; when one of its own
    attempts ends meanwhile, the job that needs the freed GPUs starts from that poll,
    not from the next one (its recheck finds nothing with the GPUs it was sent)."""
    register(server, "gpu", cpu_slots=8, gpus=[0, 1, 2, 3])
    a = _submit(server, **GPU, world_size=2)
    held = _claim(server)
    assert held and held["job_id"] == a["id"]
    rest = sorted({0, 1, 2, 3} - set(held["gpus"]))
    whole = _submit(server, **GPU, world_size=4)
    before = claims_asked(server)
    got: list[httpx.Response] = []
    poll = {"name": "gpu", "free_cpu_slots": 8, "free_gpus": rest, "wait_s": 30}
    waiting = threading.Thread(
        target=lambda: got.append(server.client("worker").post("/workers/claim", json=poll)),
        daemon=True,
    )
    waiting.start()
    # Parked once it has asked the database (and found the 4-GPU job does not fit).
    wait_for(lambda: claims_asked(server) > before, 20, "the poll's first claim")
    _finish(server, held)
    waiting.join(timeout=25)
    assert got and got[0].status_code == 200, got and got[0].text
    assert got[0].json()["job_id"] == whole["id"]
    assert sorted(got[0].json()["gpus"]) == [0, 1, 2, 3]
