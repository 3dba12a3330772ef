"""Driving the worker protocol by hand (for tests that need a job token but no torchrun),
and what several test files share: a stub JobRunner, reading a program's JSON records."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.conftest import Server, wait_for


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run calls released by one barrier (races: on clients connected before); their
    results (or exceptions) in order."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            out[i] = call()
        except Exception as exc:  # reported by the caller's checks
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def register(
    server: Server, name: str = "hand", cpu_slots: int = 8, gpus: list[int] | None = None
) -> None:
    if name in server.registered:
        return  # registering again would tell the service this worker restarted
    server.registered.add(name)
    w = server.client("worker")
    r = w.post(
        "/workers/register",
        json={
            "name": name,
            "hostname": "h",
            "cpu_slots": cpu_slots,
            "gpus": gpus or [],
            "checkpoint_root": "/ckpt",
        },
    )
    assert r.status_code == 200, r.text


def submit_and_claim(server: Server, name: str = "hand", **spec: Any) -> dict[str, Any]:
    """Submit a job and claim it as worker ``name``; returns the claim (with its job token)."""
    register(server, name)
    body = {"entrypoint": "train.py", "world_size": 1, **spec}
    job = server.client().post("/jobs", json=body)
    assert job.status_code == 201, job.text
    r = server.client("worker").post(
        "/workers/claim", json={"name": name, "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert r.status_code == 200, r.text
    claim: dict[str, Any] = r.json()
    assert claim["job_id"] == job.json()["id"]
    return claim


def finish(
    server: Server, claim: dict[str, Any], exit_code: int = 0, name: str = "hand"
) -> dict[str, Any]:
    r = server.client("worker").post(
        f"/workers/jobs/{claim['job_id']}/finish",
        json={"worker": name, "attempt": claim["attempt"], "exit_code": exit_code},
    )
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def claims_asked(server: Server) -> float:
    """Claims the API has run against the database so far (both outcomes)."""
    total = 0.0
    for line in server.client().get("/metrics").text.splitlines():
        if line.startswith("ddpq_claim_latency_seconds_count"):
            total += float(line.rsplit(" ", 1)[1])
    return total


ACTIVE = ("queued", "held", "running", "cancelling")  # a job's states before its end


def active_jobs(c: Any) -> list[dict[str, Any]]:
    """The jobs not ended yet on the server ``c`` (an httpx client) talks to."""
    items: list[dict[str, Any]] = c.get(
        "/jobs", params={"status": ",".join(ACTIVE), "limit": 500}
    ).json()["items"]
    return items


def settle_all(server: Server) -> None:
    """End every job left active on ``server`` (a module's shared one, after a test): a
    queued or held one cancelled, a running one cancelled and its cancel confirmed as its
    worker would. The next test then finds no job of another's to claim or in the queue,
    nor one that changes under it (a hand-driven worker never heartbeats: its attempts
    would be lost)."""
    c, w = server.client(), server.client("worker")
    for job in active_jobs(c):
        if job["status"] in ("queued", "held", "running"):
            r = c.post(f"/jobs/{job['id']}/cancel")
            assert r.status_code == 202, r.text
            job = r.json()
        if job["status"] == "cancelling":
            r = w.post(
                f"/workers/jobs/{job['id']}/finish",
                json={
                    "worker": job["worker"],
                    "attempt": job["attempt"],
                    "outcome": "cancelled",
                },
            )
            assert r.status_code == 200, r.text
        status_now = c.get(f"/jobs/{job['id']}").json()["status"]
        assert status_now in ("succeeded", "failed", "cancelled"), (job, status_now)


def end_jobs_left(server: Server, timeout: float = 60) -> None:
    """settle_all's for a real worker: every job left active on ``server`` cancelled, and
    waited for while that worker stops it (after a test that failed midway, on a worker
    the next test shares: conftest.module_worker)."""
    c = server.client()
    ids = {job["id"] for job in active_jobs(c)}
    for job_id in ids:
        r = c.post(f"/jobs/{job_id}/cancel")
        assert r.status_code in (202, 409), r.text  # 409: it ended meanwhile
    wait_for(
        lambda: not {job["id"] for job in active_jobs(c)} & ids,
        timeout,
        f"jobs {sorted(ids)} a test left to end",
    )


def its_turn(server: Server) -> Iterator[Server]:
    """One test's turn on a module's shared server (conftest.module_server): `hand`
    registers afresh (``register``), and what the test leaves active is ended after it
    (``settle_all``). A module's function-scoped fixture yields from it."""
    server.registered.clear()
    yield server
    settle_all(server)


def send_log(
    server: Server, claim: dict[str, Any], offset: int, data: bytes, worker: str = "hand"
) -> int:
    """Ship a chunk of the attempt's output from ``offset``, as a worker does; returns
    the attempt's bytes stored."""
    r = server.client("worker").post(
        f"/workers/jobs/{claim['job_id']}/logs",
        params={"worker": worker, "attempt": claim["attempt"], "offset": offset},
        content=data,
    )
    assert r.status_code == 202, r.text
    next_offset: int = r.json()["next_offset"]
    return next_offset


def report(server: Server, claim: dict[str, Any], items: list[dict[str, Any]]) -> None:
    """Report metric items with the claim's job token, as rank 0 does (1000 a request)."""
    rank0 = server.client(claim["token"])
    for i in range(0, len(items), 1000):
        r = rank0.post(f"/jobs/{claim['job_id']}/metrics", json={"items": items[i : i + 1000]})
        assert r.status_code == 202, r.text


def job_runner(workspace: Path, spec: dict[str, Any]) -> Any:
    """A worker's JobRunner for a claim of ``spec``, with a context of its own: for what
    the runner decides (program, argv, environment) without running anything."""
    import tempfile
    import threading

    from ddpq.messages import ClaimedJob
    from worker.executors.runner import JobRunner, RunContext
    from worker.executors.settings import WorkerSettings
    from worker.files.code import Workdirs
    from worker.starting.venvs import Venvs

    ctx = RunContext(
        api=None,  # type: ignore[arg-type]  # nothing is sent
        name="test",
        url="http://127.0.0.1:9",
        workspace=workspace.resolve(),
        data_dir=workspace,
        launch_prefix="test/",
        advertise_addr="127.0.0.1",
        settings=WorkerSettings(workspace=workspace, kill_grace_s=1.0),
        claimer_done=threading.Event(),
        workdirs=Workdirs(Path(tempfile.mkdtemp()), cache_bytes=10**6, keep_s=0),
        venvs=Venvs(Path(tempfile.mkdtemp()), max_envs=1),
    )
    claim = ClaimedJob(
        job_id=7,
        attempt=1,
        token="t",
        spec=spec,
        device="cpu",
        nproc_per_node=1,
        gpus=[],
        checkpoint_dir="/c/job-7",
        resume_from=[],
    )
    return JobRunner(ctx, claim, release=lambda _: None)


def records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a test program appended to ``path`` (none yet: empty)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_wheel(
    where: Path, name: str = "ddpqtestpkg", version: str = "0.1", magic: int = 42
) -> Path:
    """A pure-Python wheel built here (no network, no build backend): MAGIC = ``magic``."""
    files = {
        f"{name}/__init__.py": f"MAGIC = {magic}\n".encode(),
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
        ),
        f"{name}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: ddpq-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    wheel = where / f"{name}-{version}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    wheel.write_bytes(buf.getvalue())
    return wheel


def send_directory(server: Server, files: dict[str, bytes]) -> tuple[str, dict[str, str]]:
    """Send ``files`` as a worker sends a job's directory (contents, then the snapshot):
    the snapshot's id, and each file's digest."""
    w = server.client("worker")
    digests = {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}
    for path, digest in digests.items():
        r = w.put(f"/workers/code/blobs/{digest}", content=files[path])
        assert r.status_code == 204, r.text
    manifest = [
        {"path": p, "digest": d, "size": len(files[p]), "executable": False}
        for p, d in digests.items()
    ]
    r = w.post("/workers/code/snapshots", json={"files": manifest})
    assert r.status_code == 201, r.text
    return str(r.json()["id"]), digests
