"""History retention (service/retention.py): an ended job's long metric series
downsampled, its log deleted, each after its own period; nothing of a running or recent
job touched; what was dropped said to whoever reads it (the API, `ddpq status`,
`ddpq logs`, the dashboard's metrics route)."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from service import retention, sweeper
from service.config import Settings
from service.db import Database, Policy, upgrade
from service.models import AuditEvent, Job, utcnow
from service.retention import Swept, sweep
from tests.conftest import Server, run_ddpq, start_server, stop_server, wait_for
from tests.helpers import finish, register, report, send_log, submit_and_claim

LONG = 1000  # points of the long series
KEEP = 50  # DDPQ_METRICS_DOWNSAMPLE_POINTS in these tests


def _items(n: int) -> list[dict[str, Any]]:
    # A decaying loss with a spike and a NaN, and a short series beside it (lr, 10 points).
    items = []
    for step in range(n):
        loss = 2.0 * math.exp(-step / 500) + (5.0 if step == 734 else 0.0)
        values: dict[str, Any] = {"loss": "NaN" if step == 845 else loss}
        if step % 100 == 0:
            values["lr"] = 0.001
        items.append({"step": step, "values": values})
    return items


def _job(server: Server, name: str, end: bool = True) -> dict[str, Any]:
    """A job (claimed by worker ``name``) with LONG points of loss, 10 of lr and a log."""
    claim = submit_and_claim(server, name)
    report(server, claim, _items(LONG))
    send_log(server, claim, 0, b"[rank0]: hello\n" * 100, worker=name)
    if end:
        finish(server, claim, name=name)
    return claim


def _metrics(server: Server, job_id: int, **params: Any) -> list[dict[str, Any]]:
    r = server.client().get(f"/jobs/{job_id}/metrics", params=params)
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def _series(items: list[dict[str, Any]], name: str) -> list[tuple[int, Any]]:
    return [(i["step"], i["values"][name]) for i in items if name in i["values"]]


def _shape(items: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return [(i["step"], i["values"]) for i in items]


def _backdate(db_url: str, job_id: int, days: float) -> None:
    db = Database(db_url)
    with db.write() as s:
        s.execute(
            update(Job).where(Job.id == job_id).values(finished_at=utcnow() - timedelta(days=days))
        )
    db.engine.dispose()


def test_retention_thins_and_drops_only_what_is_due(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep under test is this test's own (the default periods: 30d, 180d). The
    # server's sweeper finds nothing due meanwhile: a round of its own coming in between
    # on a slow day marked a job the test was thinning as swept, uncounted by the test.
    server = start_server(
        db_url, tmp_path / "api", DDPQ_METRICS_DOWNSAMPLE_AFTER="never", DDPQ_LOG_RETENTION="365d"
    )
    try:
        old = _job(server, "w-old")  # ended 200 days ago: both rules apply
        month = _job(server, "w-month")  # ended 40 days ago: metrics only
        recent = _job(server, "w-recent")  # ended now: neither
        running = _job(server, "w-run", end=False)  # running: never
        _backdate(db_url, old["job_id"], 200)
        _backdate(db_url, month["job_id"], 40)
        # What the API's own downsampling to KEEP answers before: retention keeps these.
        picked = _series(_metrics(server, old["job_id"], name="loss", max_points=KEEP), "loss")
        whole = _shape(_metrics(server, recent["job_id"]))

        # BATCH_ROWS of 100: a long series goes in several transactions; with no budget,
        # each round does one transaction's work and stops: rounds cut short add up.
        monkeypatch.setattr(retention, "BATCH_ROWS", 100)
        db = Database(db_url, Policy(metrics_downsample_points=KEEP))
        try:
            got = Swept(done=False)
            rounds = 0
            while not got.done:
                one = sweep(db, budget_s=0)
                got = Swept(
                    got.points + one.points, got.jobs + one.jobs, got.logs + one.logs, one.done
                )
                rounds += 1
            assert rounds > 5 and got.logs == 1 and got.jobs == 2
            assert got.points == 2 * (LONG - len(picked))
            again = sweep(db, budget_s=60)  # nothing left, nothing more removed
            assert again.done and (again.points, again.jobs, again.logs) == (0, 0, 0)
        finally:
            db.engine.dispose()

        c = server.client()
        for claim in (old, month):
            job = c.get(f"/jobs/{claim['job_id']}").json()
            assert job["metrics_downsampled"] == LONG - len(picked)
            assert job["metrics_downsampled_at"] is not None
            items = _metrics(server, claim["job_id"])
            assert _series(items, "loss") == picked  # each bucket's extremes, spike, NaN
            assert any(step == 734 for step, _ in picked)  # the spike
            assert (845, "NaN") in picked
            assert len(_series(items, "lr")) == 10  # a short series stays whole
        old_job = c.get(f"/jobs/{old['job_id']}").json()
        assert old_job["log_dropped_at"] is not None
        log = c.get(f"/jobs/{old['job_id']}/logs")
        assert log.status_code == 200
        assert log.text.startswith("[ddpq] this job's log (1500 bytes) was deleted on ")
        assert "DDPQ_LOG_RETENTION=365d" in log.text  # the server's setting, as it reads
        assert int(log.headers["X-Next-Offset"]) == 1500
        assert c.get(f"/jobs/{old['job_id']}/logs", params={"offset": 1500}).content == b""
        assert c.get(f"/jobs/{month['job_id']}").json()["log_dropped_at"] is None
        assert c.get(f"/jobs/{month['job_id']}/logs").content == b"[rank0]: hello\n" * 100
        for claim in (recent, running):
            job = c.get(f"/jobs/{claim['job_id']}").json()
            assert job["metrics_downsampled"] == 0 and job["metrics_downsampled_at"] is None
            assert job["log_dropped_at"] is None
            assert _shape(_metrics(server, claim["job_id"])) == whole
            assert c.get(f"/jobs/{claim['job_id']}/logs").content == b"[rank0]: hello\n" * 100
    finally:
        stop_server(server)


def test_the_sweeper_applies_retention_and_readers_are_told(db_url: str, tmp_path: Path) -> None:
    server = start_server(
        db_url,
        tmp_path / "api",
        DDPQ_METRICS_DOWNSAMPLE_AFTER="0",
        DDPQ_METRICS_DOWNSAMPLE_POINTS=str(KEEP),
        DDPQ_LOG_RETENTION="0s",
    )
    try:
        register(server, "w")
        running = _job(server, "w", end=False)
        ended = _job(server, "w2")
        c = server.client()
        job = wait_for(
            lambda: (
                (j := c.get(f"/jobs/{ended['job_id']}").json())["log_dropped_at"]
                and j["metrics_downsampled"]
                and j
            ),
            30,
            "the sweeper to apply retention",
        )
        # The dashboard's fetch (max_points of a chart) and a whole read both answer.
        chart = _metrics(server, ended["job_id"], max_points=500)
        assert 0 < len(_series(chart, "loss")) <= KEEP and len(_series(chart, "lr")) == 10
        assert len(_series(_metrics(server, ended["job_id"]), "loss")) <= KEEP
        env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
        status = run_ddpq("status", str(ended["job_id"]), env=env)
        assert status.returncode == 0, status.stderr
        assert f"{job['metrics_downsampled']} points of long series removed" in status.stdout
        assert "deleted" in status.stdout and "log retention" in status.stdout
        logs = run_ddpq("logs", str(ended["job_id"]), env=env)
        assert logs.returncode == 0, logs.stderr
        assert "this job's log (1500 bytes) was deleted on" in logs.stdout
        assert "DDPQ_LOG_RETENTION=0s" in logs.stdout
        # The running job keeps everything, however short the periods.
        live = c.get(f"/jobs/{running['job_id']}").json()
        assert live["metrics_downsampled"] == 0 and live["log_dropped_at"] is None
        assert len(_series(_metrics(server, running["job_id"]), "loss")) == LONG
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30d", 30 * 86400.0), ("12h", 43200.0), ("0", 0.0), ("never", None), ("90", 90.0)],
)
def test_retention_periods_are_durations(value: str, seconds: float | None) -> None:
    s = Settings(metrics_downsample_after=value, log_retention=value)
    assert s.metrics_downsample_after == seconds and s.log_retention == seconds
    policy = s.policy()
    assert policy.metrics_downsample_after_s == seconds and policy.log_retention_s == seconds


def test_retention_defaults_and_bad_values() -> None:
    s = Settings()
    assert s.metrics_downsample_after == 30 * 86400 and s.log_retention == 180 * 86400
    assert s.metrics_downsample_points == 2000
    with pytest.raises(ValueError, match="not a duration"):
        Settings(log_retention="soon")
    with pytest.raises(ValueError, match="metrics_downsample_points"):
        Settings(metrics_downsample_points=3)


def test_a_bad_retention_period_stops_the_server_naming_it(tmp_path: Path) -> None:
    r = run_ddpq(
        "serve",
        "--port",
        "1",
        env={
            "DDPQ_METRICS_DOWNSAMPLE_AFTER": "-1d",
            "DDPQ_DATA_DIR": str(tmp_path),
            "DDPQ_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        },
    )
    assert r.returncode != 0
    assert "metrics_downsample_after" in r.stderr.lower() and "not a duration" in r.stderr


# ---- the audit trail (DDPQ_AUDIT_RETENTION) -----------------------------------------------


def _audit_rows(db: Database, ages_days: list[float]) -> None:
    now = utcnow()
    with db.write() as s:
        for i, days in enumerate(ages_days):
            s.add(
                AuditEvent(
                    at=now - timedelta(days=days),
                    actor="alice",
                    action="submit",
                    target=f"job {i}",
                    detail=None,
                )
            )


def _audit_targets(db: Database) -> list[str]:
    with db.read() as s:
        return list(s.scalars(select(AuditEvent.target).order_by(AuditEvent.id)))


def test_the_audit_retention_deletes_old_rows_in_bounded_rounds(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    upgrade(db_url)
    # 7 rows older than 30 days (job 0..6), 3 newer (job 7..9), and its jobs long gone.
    ages = [400, 100, 90, 60, 45, 31, 30.01, 29.9, 1, 0]
    never = Database(db_url, Policy(audit_retention_s=None))
    db = Database(db_url, Policy(audit_retention_s=30 * 86400))
    try:
        _audit_rows(db, ages)
        assert sweep(never).audit == 0 and len(_audit_targets(db)) == len(ages)  # never: all

        monkeypatch.setattr(retention, "BATCH_ROWS", 3)
        rounds = []
        while True:
            # No budget: each round does one transaction's work, at most BATCH_ROWS rows.
            swept = sweep(db, budget_s=0)
            rounds.append(swept.audit)
            if swept.done:
                break
        assert rounds == [3, 3, 1], rounds  # oldest first, never more than the bound
        assert _audit_targets(db) == ["job 7", "job 8", "job 9"]
        assert sweep(db).audit == 0
    finally:
        never.dispose()
        db.dispose()


def test_the_audit_retention_is_a_duration_never_by_default() -> None:
    assert Settings().audit_retention is None and Settings().policy().audit_retention_s is None
    s = Settings(audit_retention="730d")
    assert s.audit_retention == 730 * 86400 and s.policy().audit_retention_s == 730 * 86400
    assert Settings(audit_retention="never").audit_retention is None
    with pytest.raises(ValueError, match="audit_retention") as e:
        Settings(audit_retention="two years")
    assert "not a duration" in str(e.value)
    # The sweeper looks again within a quarter of the shortest period (at most a minute).
    assert sweeper._retention_every(Settings(audit_retention="40s").policy()) == 10
    with_defaults = Settings(metrics_downsample_after="never", log_retention="never").policy()
    assert sweeper._retention_every(with_defaults) == sweeper.RETENTION_IDLE_S
