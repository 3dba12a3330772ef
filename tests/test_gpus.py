"""The worker's GPUs come from NVML, never from torch. This machine has no GPU: a fake
``pynvml`` (tests/fakenvml/) stands in at that one edge; `make gpu-check` runs the real one."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    NO_JOBS,
    REPO,
    Server,
    Worker,
    run_ddpq,
    start_server,
    stop_server,
    terminal,
    wait_for,
)

FAKE_NVML = Path(__file__).resolve().parent / "fakenvml"
A100 = 80 * 1024**3


def fake_gpus(path: Path, n: int, **use: Any) -> Path:
    gpus = [
        {"uuid": f"GPU-{i:08x}-fake", "name": "NVIDIA A100-SXM4-80GB", "memory_total": A100, **use}
        for i in range(n)
    ]
    path.write_text(json.dumps({"gpus": gpus}))
    return path


def nvml_env(fake: Path) -> dict[str, str]:
    # The fake first, then this tree: the worker must run the code under test, not an
    # installed copy of it.
    path = os.pathsep.join([str(FAKE_NVML), str(REPO)])
    return {"PYTHONPATH": path, "DDPQ_FAKE_NVML": str(fake)}


def registered(server: Server, name: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        items = server.client().get("/workers").json()["items"]
        return next((w for w in items if w["name"] == name), None)

    w: dict[str, Any] = wait_for(found, 60, f"worker {name} to register")
    return w


def loaded(worker: Worker, library: str) -> bool:
    """Whether the worker process has mapped a shared library (torch's is libtorch)."""
    maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
    return library in maps


def test_the_worker_finds_its_gpus_through_nvml_without_torch(
    server: Server, start_worker: Any, tmp_path: Path
) -> None:
    fake = fake_gpus(tmp_path / "nvml.json", 4)
    worker = start_worker(server, name="gpu-host", gpus=None, env={**nvml_env(fake), **NO_JOBS})
    assert registered(server, "gpu-host")["gpus"] == [0, 1, 2, 3]
    assert not loaded(worker, "libtorch"), "the agent imported torch"


def test_without_nvml_a_worker_has_no_gpus_quietly(server: Server, start_worker: Any) -> None:
    worker = start_worker(server, name="cpu-host", gpus=None, env=NO_JOBS)
    assert registered(server, "cpu-host")["gpus"] == []
    assert "NVML" not in worker.log() and "Traceback" not in worker.log()
    assert not loaded(worker, "libtorch")


# ---- GPU use per job ---------------------------------------------------------------------

GIB = 1024**3
# Waits for its release file (tests/test_scheduling.py's PROBE, without the report).
HOLD = r"""
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
deadline = time.time() + 180
while not (out / f"release-{os.environ['DDPQ_JOB_ID']}").exists() and time.time() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture
def sampling_server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    """A server whose workers sample their jobs' GPUs every half second."""
    s = start_server(db_url, tmp_path / "api", DDPQ_GPU_SAMPLE_S="0.5")
    yield s
    stop_server(s)


def _submit_holder(server: Server, out: Path, world_size: int = 2) -> int:
    spec = {"entrypoint": "hold.py", "args": [str(out)], "device": "cuda", "world_size": world_size}
    r = server.client().post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def _running_on(server: Server, job_id: int, worker: str) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        job: dict[str, Any] = server.client().get(f"/jobs/{job_id}").json()
        return job if job["status"] == "running" else None

    job: dict[str, Any] = wait_for(running, 90, f"job {job_id} to run")
    assert job["worker"] == worker, job
    return job


def _gpu_lines(text: str) -> list[str]:
    """Prometheus samples (not HELP/TYPE) of the jobs' GPU families."""
    return [line for line in text.splitlines() if line.startswith("ddpq_job_gpu_")]


def _use(server: Server, job_id: int, utilization: float) -> list[dict[str, Any]]:
    """The job's GPUs once each one's latest sample shows ``utilization``."""

    def shown() -> list[dict[str, Any]] | None:
        items: list[dict[str, Any]] = server.client().get(f"/jobs/{job_id}/gpus").json()["items"]
        if len(items) == 2 and all(g["latest"]["utilization"] == utilization for g in items):
            return items
        return None

    items: list[dict[str, Any]] = wait_for(shown, 60, f"job {job_id}'s GPUs at {utilization}%")
    return items


@pytest.mark.torchrun
def test_a_jobs_gpu_use_is_stored_and_shown_and_absent_without_nvml(
    sampling_server: Server, start_worker: Any, tmp_path: Path
) -> None:
    server = sampling_server
    cli = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    out = tmp_path / "out"
    out.mkdir()

    # A host without NVML, told it has two GPUs: its job runs, and nothing GPU shows.
    plain = start_worker(server, name="plain-host", gpus="0,1")
    (plain.workspace / "hold.py").write_text(HOLD)
    quiet = _submit_holder(server, out)
    _running_on(server, quiet, "plain-host")

    fake = fake_gpus(tmp_path / "nvml.json", 4, utilization=37, memory_used=5 * GIB)
    gpu_host = start_worker(server, name="gpu-host", gpus=None, env=nvml_env(fake))
    (gpu_host.workspace / "hold.py").write_text(HOLD)
    devices = registered(server, "gpu-host")["gpu_devices"]
    assert [(d["index"], d["uuid"], d["memory_total"]) for d in devices] == [
        (i, f"GPU-{i:08x}-fake", A100) for i in range(4)
    ]
    assert {d["name"] for d in devices} == {"NVIDIA A100-SXM4-80GB"}
    job_id = _running_on(server, _submit_holder(server, out), "gpu-host")["id"]
    held = server.client().get(f"/jobs/{job_id}").json()["gpus"]
    assert len(held) == 2

    # Stored and visible through the API: each held GPU, its name, its use and history.
    items = _use(server, job_id, 37)
    assert sorted(g["gpu"] for g in items) == held
    for g in items:
        assert g["worker"] == "gpu-host" and g["attempt"] == 1
        assert g["uuid"] == f"GPU-{g['gpu']:08x}-fake" and g["name"] == "NVIDIA A100-SXM4-80GB"
        assert g["latest"]["memory_used"] == 5 * GIB and g["latest"]["memory_total"] == A100
        assert g["samples"] and g["samples"][-1] == g["latest"]

    status = run_ddpq("status", str(job_id), env=cli)
    assert status.returncode == 0, status.stderr
    for gpu in held:
        assert re.search(rf"gpu {gpu}\s+37% util, 5\.0/80\.0 GiB \(NVIDIA A100", status.stdout), (
            status.stdout
        )

    def workers_show(util: int) -> str | None:
        shown = run_ddpq("workers", env={**cli, "COLUMNS": "200"})
        assert shown.returncode == 0, shown.stderr
        # WORKER GPU NAME (two words) MEMORY (two) JOB OWNER USE
        rows = [r for r in map(str.split, shown.stdout.splitlines()) if r[:1] == ["gpu-host"]]
        holders = {r[1]: r[6:9] for r in rows if len(r) > 8}
        want = {str(g): [str(job_id), "admin", f"{util}%"] for g in held}
        return shown.stdout if all(holders.get(g) == w for g, w in want.items()) else None

    listed = wait_for(lambda: workers_show(37), 30, "ddpq workers to show the holders")
    free = [str(i) for i in range(4) if i not in held]
    for row in map(str.split, listed.splitlines()):
        if row[:1] == ["gpu-host"] and row[1] in free:
            assert row[6:8] == ["-", "-"], row

    def exported(util: float) -> list[str] | None:
        lines = _gpu_lines(server.client().get("/metrics").text)
        want = [
            f'ddpq_job_gpu_utilization_percent{{gpu="{g}",job="{job_id}",owner="admin",'
            f'worker="gpu-host"}} {util}'
            for g in held
        ]
        return lines if all(w in lines for w in want) else None

    lines = wait_for(lambda: exported(37.0), 30, "Prometheus to export the GPUs")
    # Only the running job's GPUs on the host with NVML: 2 GPUs x 3 families.
    assert len(lines) == 6, lines
    assert f'job="{quiet}"' not in "\n".join(lines)

    # A change of use shows up everywhere.
    fake_gpus(fake, 4, utilization=91, memory_used=7 * GIB)
    items = _use(server, job_id, 91)
    assert all(g["latest"]["memory_used"] == 7 * GIB for g in items)
    wait_for(lambda: exported(91.0), 30, "Prometheus to export the new use")
    wait_for(lambda: workers_show(91), 30, "ddpq workers to show the new use")
    history = server.client().get(f"/jobs/{job_id}/gpus").json()["items"][0]["samples"]
    assert {s["utilization"] for s in history} == {37.0, 91.0}

    # Without NVML: nothing GPU for its job, its worker, or in the export.
    assert server.client().get(f"/jobs/{quiet}/gpus").json() == {"items": []}
    quiet_status = run_ddpq("status", str(quiet), env=cli)
    assert quiet_status.returncode == 0 and "gpu " not in quiet_status.stdout.replace("gpus", ""), (
        quiet_status.stdout
    )
    assert registered(server, "plain-host")["gpu_devices"] == []
    assert "NVML" not in plain.log() and "Traceback" not in plain.log()

    # Once the job ends its GPUs leave the export and ddpq workers; its history stays.
    for j in (job_id, quiet):
        (out / f"release-{j}").touch()
    assert terminal(server.client(), job_id)["status"] == "succeeded"
    assert terminal(server.client(), quiet)["status"] == "succeeded"
    assert _gpu_lines(server.client().get("/metrics").text) == []
    assert all(g["job_id"] is None for g in registered(server, "gpu-host")["gpu_devices"])
    assert len(server.client().get(f"/jobs/{job_id}/gpus").json()["items"]) == 2


def test_bad_gpu_reports_name_the_field(server: Server) -> None:
    """What a worker sends about GPUs is checked like everything else: a 422 naming the
    field, never a 500; the history's bounds too."""
    worker = server.client("worker")
    base = {"name": "w", "hostname": "h", "cpu_slots": 1, "gpus": [0], "checkpoint_root": "/c"}
    device = {"index": 0, "uuid": "GPU-1", "name": "A100", "memory_total": A100}
    for bad, field in (
        ({**device, "memory_total": -1}, "memory_total"),
        ({**device, "uuid": "GPU 1\n"}, "uuid"),
        ({**device, "index": 5000}, "index"),
    ):
        r = worker.post("/workers/register", json={**base, "gpu_devices": [bad]})
        assert r.status_code == 422, r.text
        assert field in str(r.json()["detail"][0]["loc"]), r.text
    r = worker.post("/workers/register", json={**base, "gpu_devices": [device, device]})
    assert r.status_code == 422 and "gpu_devices" in r.text, r.text
    assert worker.post("/workers/register", json={**base, "gpu_devices": [device]}).is_success
    sample = {"gpu": 0, "ago_s": 0, "utilization": 50, "memory_used": 1, "memory_total": 2}
    for bad, field in (
        ({**sample, "utilization": 101}, "utilization"),
        ({**sample, "utilization": "50"}, "utilization"),
        ({**sample, "ago_s": -1}, "ago_s"),
        ({k: v for k, v in sample.items() if k != "memory_used"}, "memory_used"),
    ):
        running = [{"job_id": 1, "attempt": 1, "gpu_samples": [bad]}]
        r = worker.post("/workers/heartbeat", json={"name": "w", "running": running})
        assert r.status_code == 422, r.text
        assert field in str(r.json()["detail"][0]["loc"]), r.text
    # Samples of an attempt that is not the worker's are dropped, not stored.
    r = worker.post(
        "/workers/heartbeat",
        json={"name": "w", "running": [{"job_id": 1, "attempt": 1, "gpu_samples": [sample]}]},
    )
    assert r.status_code == 200 and r.json()["abandon"] == [{"job_id": 1, "attempt": 1}]
    user = server.client()
    assert user.get("/jobs/1/gpus").status_code == 404
    job = user.post("/jobs", json={"entrypoint": "t.py"}).json()["id"]
    assert user.get(f"/jobs/{job}/gpus").json() == {"items": []}
    r = user.get(f"/jobs/{job}/gpus", params={"max_points": -1})
    assert r.status_code == 422 and "max_points" in str(r.json()["detail"][0]["loc"])


# Reports a falling loss (rank 0) until released: the dashboard draws it beside the GPUs.
TRAIN_AND_HOLD = r"""
import os, pathlib, sys, time
import ddpq
out = pathlib.Path(sys.argv[1])
release = out / f"release-{os.environ['DDPQ_JOB_ID']}"
deadline, step = time.time() + 180, 0
while not release.exists() and time.time() < deadline:
    step += 1
    if os.environ["RANK"] == "0":
        ddpq.report(step, loss=2.0 / (1 + 0.3 * step))
    time.sleep(0.2)
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_dashboard_shows_a_jobs_gpu_use_beside_its_loss(
    sampling_server: Server, start_worker: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS, _console

    server = sampling_server
    fake = fake_gpus(tmp_path / "nvml.json", 4, utilization=12, memory_used=3 * GIB)
    worker = start_worker(server, name="gpu-host", gpus=None, env=nvml_env(fake))
    (worker.workspace / "train.py").write_text(TRAIN_AND_HOLD)
    out = tmp_path / "out"
    out.mkdir()
    spec = {"entrypoint": "train.py", "args": [str(out)], "device": "cuda", "world_size": 2}
    r = server.client().post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    held = _running_on(server, job_id, "gpu-host")["gpus"]
    # A CPU job beside it: its page has no GPU panel.
    cpu = server.client().post("/jobs", json={**spec, "device": "cpu", "world_size": 1}).json()

    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            expect.set_options(timeout=TIMEOUT_MS)
            page.on("console", lambda m: _console(m, problems))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(f"{server.url}/#/jobs/{job_id}")
            page.fill("#token-input", server.api_token)
            page.click("#login button[type=submit]")

            expect(page.locator("#chart path.chart-line")).to_have_count(1)  # the loss
            panel = page.locator("#gpus-panel")
            expect(panel).to_be_visible()
            rows = page.locator("#gpus .gpu")
            expect(rows).to_have_count(2)
            for gpu in held:
                row = page.locator(f'#gpus .gpu[data-gpu="gpu-host:{gpu}"]')
                expect(row.locator(".gpu-name")).to_contain_text(
                    f"GPU {gpu} · NVIDIA A100-SXM4-80GB"
                )
                expect(row.locator(".gpu-util")).to_have_text("12%")
                expect(row.locator(".gpu-mem")).to_have_text("3.0 / 80.0 GiB")
            # The use changes; the page follows, and its charts draw both values over time.
            fake_gpus(fake, 4, utilization=88, memory_used=61 * GIB)
            expect(rows.locator(".gpu-util")).to_have_text(["88%", "88%"])
            expect(rows.locator(".gpu-mem")).to_have_text(["61.0 / 80.0 GiB"] * 2)
            expect(rows.first.locator("svg.gpu-spark polyline")).to_have_count(2)
            page.wait_for_timeout(1500)  # a few more samples on the chart for the picture
            shot = Path(os.environ.get("DDPQ_SCREENSHOT_DIR", str(tmp_path))) / "job-gpus.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)

            page.goto(f"{server.url}/#/jobs/{cpu['id']}")
            expect(page.locator("#job-title")).to_contain_text(f"Job {cpu['id']}")
            expect(page.locator("#job-facts")).to_contain_text("program")
            expect(panel).to_be_hidden()
            assert not problems, problems
        finally:
            browser.close()
            (out / f"release-{job_id}").touch()
            (out / f"release-{cpu['id']}").touch()
    assert terminal(server.client(), job_id)["status"] == "succeeded"


def test_a_gpus_history_is_bounded_by_its_age_and_stays_in_time_order() -> None:
    from datetime import UTC, datetime, timedelta

    from service.gpus import FULL_SLOTS, slot_of

    start = datetime(2026, 11, 1, 12, 0, 0, 123000, tzinfo=UTC)
    month = [slot_of(start, start + timedelta(seconds=t), 5.0) for t in range(0, 30 * 86400, 5)]
    # Never back in time: a wider slot begins where the narrower ones ended.
    assert month == sorted(month)
    # The first hour at full resolution, then O(log(age)): about 4,100 for a month.
    assert len(set(month[:FULL_SLOTS])) == FULL_SLOTS
    assert FULL_SLOTS < len(set(month)) < 4500
    # A sample before the attempt's start (clocks) goes into its first slot.
    assert slot_of(start, start - timedelta(seconds=3), 5.0) == month[0]
