"""A year of history: does the API stay as fast with 1,000,000 finished jobs and
100,000,000 metric points in its database as with an empty one?

Two Postgres databases (or, with --backend sqlite, two SQLite files), both made by
`ddpq serve` (so through the real migrations):
"full" holds JOBS finished jobs of many users, their attempts (1-3 each), their logs
(one chunk per attempt, a few larger ones), checkpoints of a third of them and POINTS
metric points (three series per job, mostly short, lengths varying, finished_at spread
over a year), one job among them with a series of 1,000,000 points; "empty" holds that
job and 199 others, all of the measured user and half of them failed (a page of 50,
filtered or not, costs the same to build on both). Both are written
directly in SQL (generate_series, INSERT ... SELECT; on SQLite recursive CTEs and a table
of numbers, in large transactions with synchronous=OFF, which only the build uses):
through the API it would take days. The rows are those the API writes on each database
(on SQLite: JSON as text, datetimes as the naive UTC text of SQLAlchemy's SQLite dialect).
Then a `ddpq serve` on each, side by side, and the same requests to each, alternating
(the ratio full / empty is what counts on a noisy VM):

- GET /jobs?limit=50, and with the filters the dashboard and `ddpq ls` use: a user
  (`--user`, and `--mine`, the same query), a status, a user of few jobs;
- GET /jobs/{id}; the downsampled metrics of the 1,000,000-point series as the
  dashboard asks for them (max_points=1000); the claim (a job submitted, a registered
  worker claims it, then finishes it);
- GET /accounting (`ddpq acct`) over the last 30 days and over the year, per job and per
  attempt, and GET /queue (`ddpq queue`) with --queued jobs waiting (10,000 by default,
  submitted through the API by 20 users and the admin; kept in a kept database) (goal:
  p95 <= 50 ms on Postgres with 1,000,000 ended jobs).

Goal: each within 2x of its cost on the empty database (p50).

With --retention, the retention sweep (service/retention.py) then runs on the full
database until it is done, and the database's rows and bytes per 1,000 finished jobs
are shown before and after it (VACUUM FULL first with --vacuum-full: Postgres keeps the
space of deleted rows for reuse, it does not give it back; on SQLite VACUUM, and the bytes
are the pages of each table and its indexes, from dbstat). --job-retention DURATION
turns the job purge on for that sweep (DDPQ_JOB_RETENTION, e.g. 180d: the jobs that
ended longer ago go, each user's newest kept); the figures stay per 1,000 jobs that
finished, purged ones included.

    PYTHONPATH=$PWD .venv/bin/python bench/history.py [--backend postgres|sqlite]
        [--jobs 1000000] [--points 100000000] [--rounds 200] [--queued 10000] [--keep NAME]
        [--retention [--job-retention 180d]] [--vacuum-full] [--dir DIR]

--keep NAME builds into databases NAME_full and NAME_empty and leaves them (a later run
with the same NAME reuses them: building the full scale takes tens of minutes and
about 20 GB); without it they are dropped at the end. --drop NAME drops them. On SQLite
the databases are files DIR/h-history_NAME_full.db and _empty.db (DIR: --dir, the
system's temporary directory by default).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from _harness import PG_ADMIN, Api, percentile, register, serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BIG = 1_000_000  # points of the one long series
# The "empty" database: the long series' job and as many others as two dashboard pages
# show (so a page of 50 costs the same work on both; only what lies beyond differs).
EMPTY_JOBS = 200
PREFIX = "h-history_"
USERS = 200
YEAR_S = 365 * 86400
LINE = "[rank0]: step 00001000 loss 0.123456 lr 0.000300 epoch 1.00\n"  # a log line
NAMES = ("accuracy", "loss", "lr")


# The columns each builder fills, in the order of its SELECT (both backends' builders).
JOB_COLUMNS = (
    "id, name, status, spec, priority, nnodes, nproc_per_node, device, max_attempts, "
    "created_at, queued_at, started_at, finished_at, attempt, failures, exit_code, reason, "
    "worker, gpus, held_cpu_slots, latest_metrics, metrics_dropped, total_steps, log_size, "
    "metrics_seq, owner, share, quota_running, quota_gpus"
)
ATTEMPT_COLUMNS = (
    "job_id, number, worker, token_hash, gpus, checkpoint_dir, started_at, heartbeat_at, "
    "ended_at, counted_until, exit_code, log_bytes, outcome, reason"
)


def pg_url(name: str) -> str:
    host = PG_ADMIN.split("://", 1)[1].rsplit("/", 1)[0]
    return f"postgresql+psycopg://{host}/{name}"


def connect(name: str | None = None) -> object:
    import psycopg

    url = PG_ADMIN if name is None else f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"
    return psycopg.connect(url, autocommit=True)


def exists(name: str) -> bool:
    with connect() as conn:  # type: ignore[attr-defined]
        return bool(conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone())


def drop(name: str) -> None:
    with connect() as conn:  # type: ignore[attr-defined]
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def step(what: str) -> Callable[[], None]:
    t0 = time.monotonic()
    print(f"  {what} ...", end="", flush=True)

    def done() -> None:
        print(f" {time.monotonic() - t0:.1f} s", flush=True)

    return done


def build(name: str, jobs: int, points: int) -> None:
    """Make database ``name`` through `ddpq serve` (the migrations) and fill it: ``jobs``
    finished jobs (the long-series job among them) and ``points`` metric points."""
    print(f"building {name}: {jobs:,} jobs, {points:,} metric points", flush=True)
    with connect() as conn:  # type: ignore[attr-defined]
        conn.execute(f'CREATE DATABASE "{name}"')
    with serve(pg_url(name)) as api, api.client() as c:
        # One job through the API: its spec is what every generated job carries, so
        # the rows read back as the API writes them.
        template = c.post("/jobs", json={"entrypoint": "train.py", "device": "cpu"})
        template.raise_for_status()
        tid = template.json()["id"]
    with connect(name) as conn:  # type: ignore[attr-defined]
        spec = conn.execute("SELECT spec::text FROM jobs WHERE id = %s", [tid]).fetchone()[0]
        conn.execute("DELETE FROM jobs")
        big = (jobs + 1) // 2  # the long series' job: half-way through the year
        small = max(0, points - BIG)
        # Points per short series: 1 to 2 * mean - 1, varying by job (a pseudo-hash).
        mean = max(1, small // max(1, (jobs - 1) * len(NAMES)))
        spread = 2 * mean - 1
        # Per attempt n of job g: (10 + (g + n) % 60) log lines; every 1000th job
        # writes 64 times as much (a chatty run).
        lines = "((10 + (g + n) %% 60) * CASE WHEN g %% 1000 = 0 THEN 64 ELSE 1 END)"
        nattempts = "(1 + (g %% 10 = 0)::int + (g %% 50 = 0)::int)"
        t0 = f"(now() - interval '{YEAR_S} seconds')"
        created = f"({t0} + (g::float8 / {jobs} * {YEAR_S}) * interval '1 second')"
        run_s = "(60 + (g::bigint * 7919) %% 36000)"
        status = (
            "CASE WHEN g %% 20 = 0 THEN 'cancelled' WHEN g %% 7 = 0 THEN 'failed' "
            "ELSE 'succeeded' END"
        )
        owner = f"'u' || lpad((g %% {USERS})::text, 3, '0')"
        if jobs <= EMPTY_JOBS:
            # The empty database: every job the measured user's (u007) and every other
            # one failed, so each filtered page is as full as on the full database.
            status = "CASE WHEN g %% 2 = 0 THEN 'failed' ELSE 'succeeded' END"
            owner = "'u007'"
        done = step("jobs")
        conn.execute(
            f"""
            INSERT INTO jobs ({JOB_COLUMNS})
            SELECT g, 'run-' || g, {status}, %(spec)s::json, 0, 1, 1, 'cpu', 3,
                {created}, {created}, {created} + interval '5 seconds',
                {created} + ({run_s}) * interval '1 second',
                {nattempts}, {nattempts} - 1,
                CASE WHEN g %% 20 = 0 THEN -15 WHEN g %% 7 = 0 THEN 1 ELSE 0 END,
                CASE WHEN g %% 7 = 0 AND g %% 20 <> 0 THEN 'exit code 1' END,
                'host' || lpad((g %% 125)::text, 3, '0'), '[]'::json, 0,
                json_build_object('step', 1000, 'epoch', 3.0,
                    'values', json_build_object('loss', 0.1 + (g %% 97) / 1000.0, 'lr', 0.0003)),
                0, 1000,
                (SELECT sum({lines}) FROM generate_series(1, {nattempts}) n) * {len(LINE)},
                1, {owner}, 0, false, false
            FROM generate_series(1, %(jobs)s) g
            """,
            {"spec": spec, "jobs": jobs},
        )
        conn.execute("SELECT setval('jobs_id_seq', %s)", [jobs])
        done()
        done = step("attempts")
        conn.execute(
            f"""
            INSERT INTO attempts ({ATTEMPT_COLUMNS})
            SELECT g, n, 'host' || lpad((g %% 125)::text, 3, '0'),
                md5(g || '/' || n) || md5(n || '/' || g), '[]'::json, '/ckpt/' || g,
                {created}, {created}, {created} + interval '60 seconds',
                {created} + interval '60 seconds',
                CASE WHEN n < {nattempts} THEN 1 WHEN g %% 20 = 0 THEN -15
                     WHEN g %% 7 = 0 THEN 1 ELSE 0 END,
                {lines} * {len(LINE)},
                CASE WHEN n < {nattempts} THEN 'failed' ELSE {status} END,
                CASE WHEN n < {nattempts} THEN 'exit code 1' END
            FROM generate_series(1, %(jobs)s) g, generate_series(1, {nattempts}) n
            """,
            {"jobs": jobs},
        )
        done()
        done = step("log chunks")
        # start: the bytes of the attempts before (the stream of the whole job).
        conn.execute(
            f"""
            INSERT INTO log_chunks (job_id, attempt, start, data)
            SELECT g, n,
                coalesce((SELECT sum({lines.replace("n)", "m)")}) FROM generate_series(1, n - 1) m),
                         0) * {len(LINE)},
                convert_to(repeat(%(line)s, {lines}), 'UTF8')
            FROM generate_series(1, %(jobs)s) g, generate_series(1, {nattempts}) n
            """,
            {"jobs": jobs, "line": LINE},
        )
        done()
        done = step("checkpoints")
        conn.execute(
            f"""
            INSERT INTO checkpoints (job_id, attempt, path, step, epoch, metrics, created_at,
                worker, keep, bytes, state)
            SELECT g, {nattempts}, '/ckpt/' || g || '/step-1000.pt', 1000, 3.0,
                '{{"loss": 0.1}}'::json, {created} + interval '60 seconds',
                NULL, false, 45000000, 'kept'
            FROM generate_series(1, %(jobs)s) g WHERE g %% 3 = 0
            """,
            {"jobs": jobs},
        )
        done()
        # Metric points, a slice of jobs per statement (in primary-key order: the
        # index grows on its right edge, as reports make it).
        k = f"(1 + (g::bigint * 7919) %% {spread})"
        insert_points = f"""
            INSERT INTO metric_points (job_id, name, step, value, epoch, attempt, time, seq)
            SELECT g, nm, s * 10,
                CASE nm WHEN 'loss' THEN 2.0 * exp(-s::float8 / {k}) + (g %% 13) / 100.0
                        WHEN 'lr' THEN 0.0003 ELSE 1.0 - exp(-s::float8 / {k}) END,
                s::float8 / {k} * 3, {nattempts},
                {created} + s * interval '1 second', 1
            FROM generate_series(%(lo)s::int, %(hi)s::int) g,
                unnest(ARRAY['accuracy', 'loss', 'lr']) nm,
                generate_series(0, {k} - 1) s
            WHERE g <> %(big)s
            ORDER BY 1, 2, 3
        """
        if small and jobs > 1:
            done = step(f"metric points: ~{mean} per series")
            slice_ = 20_000
            for lo in range(1, jobs + 1, slice_):
                conn.execute(
                    insert_points, {"lo": lo, "hi": min(jobs, lo + slice_ - 1), "big": big}
                )
                print(".", end="", flush=True)
            done()
        done = step(f"the long series: job {big}, {BIG:,} points")
        conn.execute(
            """
            INSERT INTO metric_points (job_id, name, step, value, epoch, attempt, time, seq)
            SELECT %(g)s, nm, s,
                CASE nm WHEN 'loss' THEN 2.0 * exp(-s::float8 / 200000) + random() / 20
                        WHEN 'lr' THEN 0.0003 ELSE 1.0 - exp(-s::float8 / 200000) END,
                s / 10000.0, 1, now() - interval '180 days' + s * interval '10 ms', 1
            FROM unnest(ARRAY['accuracy', 'loss', 'lr']) nm,
                generate_series(0, CASE WHEN nm = 'loss' THEN %(n)s - 1 ELSE 999 END) s
            ORDER BY 1, 2, 3
            """,
            {"g": big, "n": BIG},
        )
        # The long job's own shape: it ran for days and finished half a year ago.
        conn.execute(
            f"""UPDATE jobs SET name = 'long-run', created_at = now() - interval '190 days',
                started_at = now() - interval '190 days',
                finished_at = now() - interval '180 days', total_steps = {BIG}
                WHERE id = %s""",
            [big],
        )
        done()
        done = step("VACUUM ANALYZE")
        conn.execute("VACUUM ANALYZE")
        done()
    print(f"  {name}: {size(name)}", flush=True)


def size(name: str) -> str:
    with connect(name) as conn:  # type: ignore[attr-defined]
        total = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
    return f"{total / 1e9:.2f} GB"


TABLES = ("jobs", "attempts", "log_chunks", "metric_points", "checkpoints", "gpu_samples")


def growth(name: str) -> dict[str, tuple[int, int]]:
    """Rows and bytes (table, its TOAST and its indexes) of the tables that grow with
    jobs."""
    out = {}
    with connect(name) as conn:  # type: ignore[attr-defined]
        for t in TABLES:
            rows = conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            nbytes = conn.execute("SELECT pg_total_relation_size(%s)", [t]).fetchone()[0]
            out[t] = (rows, nbytes)
    return out


# ---- SQLite -------------------------------------------------------------------------------
# The same shapes as build() above, in SQL that SQLite runs fast: it has no
# generate_series (not built in), so a temporary table of numbers (its rowid a range)
# stands for it, and everything is written in large transactions with synchronous=OFF,
# on this connection only (the API then opens the file with its own settings: WAL,
# synchronous=NORMAL, service/db.py). The values are stored as the API stores them:
# JSON as text (json.dumps' spacing), datetimes as SQLAlchemy's SQLite dialect writes
# them (naive UTC text, 'YYYY-MM-DD HH:MM:SS.ffffff'), booleans as 0/1, logs as BLOBs.
# Like the API, nothing runs ANALYZE: SQLite plans without statistics, as it does in use.

SQLITE_DIR = tempfile.gettempdir()


def lite_path(name: str) -> Path:
    return Path(SQLITE_DIR) / f"{name}.db"


def lite_connect(name: str) -> sqlite3.Connection:
    conn = sqlite3.connect(lite_path(name), isolation_level=None, timeout=60)
    conn.execute("PRAGMA busy_timeout=60000")
    return conn


def lite_files(name: str) -> list[Path]:
    db = lite_path(name)
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def lite_ts(seconds: str) -> str:
    """SQL for the datetime ``seconds`` (Unix time, an SQL expression) as SQLAlchemy's
    SQLite dialect stores it: strftime's %f has milliseconds, the dialect microseconds."""
    return f"(strftime('%Y-%m-%d %H:%M:%f', {seconds}, 'unixepoch') || '000')"


def lite_lines(g: str, n: str) -> str:
    """Log lines of attempt ``n`` of job ``g`` (as build()'s ``lines``)."""
    return f"((10 + ({g} + {n}) % 60) * CASE WHEN {g} % 1000 = 0 THEN 64 ELSE 1 END)"


def lite_build(name: str, jobs: int, points: int) -> None:
    """build() on the SQLite file of ``name``."""
    print(f"building {lite_path(name)}: {jobs:,} jobs, {points:,} metric points", flush=True)
    with serve(lite_url(name)) as api, api.client() as c:
        template = c.post("/jobs", json={"entrypoint": "train.py", "device": "cpu"})
        template.raise_for_status()
        tid = template.json()["id"]
    conn = lite_connect(name)
    try:
        _lite_fill(conn, jobs, points, tid)
    finally:
        conn.close()
    print(f"  {name}: {lite_size(name)}", flush=True)


def _lite_fill(conn: sqlite3.Connection, jobs: int, points: int, tid: int) -> None:
    conn.execute("PRAGMA journal_mode=WAL")  # as the API left it; said again, to be sure
    conn.execute("PRAGMA synchronous=OFF")  # this connection only: the build's
    conn.execute("PRAGMA cache_size=-262144")  # 256 MB
    conn.execute("PRAGMA temp_store=MEMORY")
    spec = conn.execute("SELECT spec FROM jobs WHERE id = ?", [tid]).fetchone()[0]
    conn.execute("DELETE FROM jobs")
    big = (jobs + 1) // 2
    small = max(0, points - BIG)
    mean = max(1, small // max(1, (jobs - 1) * len(NAMES)))
    spread = 2 * mean - 1
    now = time.time()
    p = {"jobs": jobs, "t0": now - YEAR_S, "year": YEAR_S, "now": now, "big": big}
    done = step("numbers")
    conn.execute("CREATE TEMP TABLE n (i INTEGER PRIMARY KEY)")
    conn.execute(
        "INSERT INTO n WITH RECURSIVE r(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM r "
        "WHERE i < ?) SELECT i FROM r",
        [max(jobs, BIG, spread) + 1],
    )
    done()
    nattempts = "(1 + (g % 10 = 0) + (g % 50 = 0))"
    created = "(:t0 + g * 1.0 / :jobs * :year)"
    run_s = "(60 + (g * 7919) % 36000)"
    status = (
        "CASE WHEN g % 20 = 0 THEN 'cancelled' WHEN g % 7 = 0 THEN 'failed' ELSE 'succeeded' END"
    )
    owner = f"('u' || printf('%03d', g % {USERS}))"
    if jobs <= EMPTY_JOBS:
        status = "CASE WHEN g % 2 = 0 THEN 'failed' ELSE 'succeeded' END"
        owner = "'u007'"

    # The bytes of attempts 1 .. m of a job: its log_size (m = its attempts) or where the
    # chunk of attempt m + 1 starts.
    def before(m: str) -> str:
        return (
            f"({lite_lines('g', '1')} * ({m} >= 1) + {lite_lines('g', '2')} * ({m} >= 2)"
            f" + {lite_lines('g', '3')} * ({m} >= 3)) * {len(LINE)}"
        )

    jobs_g = "(SELECT i AS g FROM n WHERE i BETWEEN 1 AND :jobs)"
    # Attempts 1 .. nattempts of each job, g outer (an attempt's id grows with its job's).
    attempts_gn = f"{jobs_g} CROSS JOIN (SELECT 1 AS a UNION ALL SELECT 2 UNION ALL SELECT 3)"
    host = "('host' || printf('%03d', g % 125))"
    done = step("jobs")
    conn.execute("BEGIN")
    conn.execute(
        f"""
        INSERT INTO jobs ({JOB_COLUMNS})
        SELECT g, 'run-' || g, {status}, :spec, 0, 1, 1, 'cpu', 3,
            {lite_ts(created)}, {lite_ts(created)}, {lite_ts(f"{created} + 5")},
            {lite_ts(f"{created} + {run_s}")},
            {nattempts}, {nattempts} - 1,
            CASE WHEN g % 20 = 0 THEN -15 WHEN g % 7 = 0 THEN 1 ELSE 0 END,
            CASE WHEN g % 7 = 0 AND g % 20 <> 0 THEN 'exit code 1' END,
            {host}, '[]', 0,
            '{{"step": 1000, "epoch": 3.0, "values": {{"loss": '
                || (0.1 + (g % 97) / 1000.0) || ', "lr": 0.0003}}}}',
            0, 1000, {before(nattempts)}, 1, {owner}, 0.0, 0, 0
        FROM {jobs_g}
        """,
        {**p, "spec": spec},
    )
    conn.execute("COMMIT")
    done()
    done = step("attempts")
    conn.execute("BEGIN")
    conn.execute(
        f"""
        INSERT INTO attempts ({ATTEMPT_COLUMNS})
        SELECT g, a, {host}, lower(hex(randomblob(32))), '[]', '/ckpt/' || g,
            {lite_ts(created)}, {lite_ts(created)}, {lite_ts(f"{created} + 60")},
            {lite_ts(f"{created} + 60")},
            CASE WHEN a < {nattempts} THEN 1 WHEN g % 20 = 0 THEN -15
                 WHEN g % 7 = 0 THEN 1 ELSE 0 END,
            {lite_lines("g", "a")} * {len(LINE)},
            CASE WHEN a < {nattempts} THEN 'failed' ELSE {status} END,
            CASE WHEN a < {nattempts} THEN 'exit code 1' END
        FROM {attempts_gn} WHERE a <= {nattempts}
        """,
        p,
    )
    conn.execute("COMMIT")
    done()
    done = step("log chunks")
    conn.execute("BEGIN")
    # repeat() is not SQLite's: n zero bytes in hex are n '00's, each replaced by a line.
    conn.execute(
        f"""
        INSERT INTO log_chunks (job_id, attempt, start, data)
        SELECT g, a, {before("a - 1")},
            CAST(replace(hex(zeroblob({lite_lines("g", "a")})), '00', :line) AS BLOB)
        FROM {attempts_gn} WHERE a <= {nattempts}
        """,
        {**p, "line": LINE},
    )
    conn.execute("COMMIT")
    done()
    done = step("checkpoints")
    conn.execute("BEGIN")
    conn.execute(
        f"""
        INSERT INTO checkpoints (job_id, attempt, path, step, epoch, metrics, created_at,
            worker, keep, bytes, state)
        SELECT g, {nattempts}, '/ckpt/' || g || '/step-1000.pt', 1000, 3.0,
            '{{"loss": 0.1}}', {lite_ts(f"{created} + 60")}, NULL, 0, 45000000, 'kept'
        FROM {jobs_g} WHERE g % 3 = 0
        """,
        p,
    )
    conn.execute("COMMIT")
    done()
    # Metric points in primary-key order (the table has no rowid: its rows are that
    # index), jobs outer, then names, then steps: CROSS JOIN fixes SQLite's loop order.
    k = f"(1 + (g * 7919) % {spread})"
    insert_points = f"""
        INSERT INTO metric_points (job_id, name, step, value, epoch, attempt, time, seq)
        SELECT g, nm, s * 10,
            CASE nm WHEN 'loss' THEN 2.0 * exp(-s * 1.0 / {k}) + (g % 13) / 100.0
                    WHEN 'lr' THEN 0.0003 ELSE 1.0 - exp(-s * 1.0 / {k}) END,
            s * 1.0 / {k} * 3, {nattempts}, {lite_ts(f"{created} + s")}, 1
        FROM (SELECT i AS g FROM n WHERE i BETWEEN :lo AND :hi AND i <> :big)
            CROSS JOIN (SELECT 'accuracy' AS nm UNION ALL SELECT 'loss' UNION ALL SELECT 'lr')
            CROSS JOIN (SELECT i AS s FROM n)
        WHERE s < {k}
    """
    if small and jobs > 1:
        done = step(f"metric points: ~{mean} per series")
        slice_ = 100_000
        for lo in range(1, jobs + 1, slice_):
            conn.execute("BEGIN")
            conn.execute(insert_points, {**p, "lo": lo, "hi": min(jobs, lo + slice_ - 1)})
            conn.execute("COMMIT")
            print(".", end="", flush=True)
        done()
    done = step(f"the long series: job {big}, {BIG:,} points")
    conn.execute("BEGIN")
    conn.execute(
        f"""
        INSERT INTO metric_points (job_id, name, step, value, epoch, attempt, time, seq)
        SELECT :big, nm, s,
            CASE nm WHEN 'loss' THEN 2.0 * exp(-s / 200000.0)
                        + (abs(random()) % 1000000) / 20000000.0
                    WHEN 'lr' THEN 0.0003 ELSE 1.0 - exp(-s / 200000.0) END,
            s / 10000.0, 1, {lite_ts(f":now - {180 * 86400} + s * 0.01")}, 1
        FROM (SELECT 'accuracy' AS nm UNION ALL SELECT 'loss' UNION ALL SELECT 'lr')
            CROSS JOIN (SELECT i AS s FROM n)
        WHERE s < CASE WHEN nm = 'loss' THEN {BIG} ELSE 1000 END
        """,
        p,
    )
    conn.execute(
        f"""UPDATE jobs SET name = 'long-run',
            created_at = {lite_ts(f":now - {190 * 86400}")},
            started_at = {lite_ts(f":now - {190 * 86400}")},
            finished_at = {lite_ts(f":now - {180 * 86400}")}, total_steps = {BIG}
            WHERE id = :big""",
        p,
    )
    conn.execute("COMMIT")
    done()
    done = step("WAL checkpoint")
    conn.execute("DROP TABLE n")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    done()


def lite_url(name: str) -> str:
    return f"sqlite:///{lite_path(name)}"


def lite_size(name: str) -> str:
    total = sum(f.stat().st_size for f in lite_files(name) if f.exists())
    return f"{total / 1e9:.2f} GB"


def lite_growth(name: str) -> dict[str, tuple[int, int]]:
    """Rows and bytes (the pages of the table and of its indexes, from dbstat) of the
    tables that grow with jobs; without dbstat (SQLite built without it), the bytes are
    0 and the file's size alone says how large it is."""
    out = {}
    conn = lite_connect(name)
    try:
        tables = dict(
            conn.execute(
                "SELECT name, tbl_name FROM sqlite_master WHERE tbl_name IN "
                f"({', '.join('?' * len(TABLES))})",
                TABLES,
            ).fetchall()
        )
        try:
            pages = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
        except sqlite3.OperationalError:  # no such table: dbstat
            pages = []
        for t in TABLES:
            rows = conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            nbytes = sum(b for n, b in pages if tables.get(n) == t)
            out[t] = (rows, nbytes)
    finally:
        conn.close()
    return out


class Postgres:
    """The databases, by name, on the Postgres server of PG_ADMIN."""

    url = staticmethod(pg_url)
    exists = staticmethod(exists)
    drop = staticmethod(drop)
    build = staticmethod(build)
    size = staticmethod(size)
    growth = staticmethod(growth)

    @staticmethod
    def one(name: str, sql: str, params: list[object] | None = None) -> tuple:
        with connect(name) as conn:  # type: ignore[attr-defined]
            cur = conn.execute(sql, params or [])
            return tuple(cur.fetchone() or ()) if cur.description else ()  # not an UPDATE's

    @staticmethod
    def vacuum(name: str, full: bool) -> None:
        with connect(name) as conn:  # type: ignore[attr-defined]
            conn.execute("VACUUM FULL" if full else "VACUUM")


class Sqlite:
    """The databases, by name, as files of SQLITE_DIR."""

    url = staticmethod(lite_url)
    build = staticmethod(lite_build)
    size = staticmethod(lite_size)
    growth = staticmethod(lite_growth)

    @staticmethod
    def exists(name: str) -> bool:
        return lite_path(name).exists()

    @staticmethod
    def drop(name: str) -> None:
        for f in lite_files(name):
            f.unlink(missing_ok=True)

    @staticmethod
    def one(name: str, sql: str, params: list[object] | None = None) -> tuple:
        conn = lite_connect(name)
        try:
            return tuple(conn.execute(sql.replace("%s", "?"), params or []).fetchone() or ())
        finally:
            conn.close()

    @staticmethod
    def vacuum(name: str, full: bool) -> None:
        # SQLite's VACUUM rewrites the file (Postgres' VACUUM FULL); a plain VACUUM of
        # Postgres has no counterpart: freed pages stay in the file, out of dbstat's sums.
        if full:
            Sqlite.one(name, "VACUUM")
        Sqlite.one(name, "PRAGMA wal_checkpoint(TRUNCATE)")


Store = type[Postgres] | type[Sqlite]


def show_growth(label: str, g: dict[str, tuple[int, int]], jobs: int) -> None:
    per = jobs / 1000
    parts = [f"{t} {r / per:,.0f} rows {b / per / 1e6:.2f} MB" for t, (r, b) in g.items() if r]
    total = sum(b for _, b in g.values())
    print(f"{label}: per 1,000 finished jobs: {total / per / 1e6:.1f} MB ({'; '.join(parts)})")


# ---- measuring ------------------------------------------------------------------------


def timed(c: httpx.Client, method: str, path: str, **kw: object) -> float:
    t0 = time.perf_counter()
    r = c.request(method, path, **kw)  # type: ignore[arg-type]
    took = time.perf_counter() - t0
    r.raise_for_status()
    return took


def long_job(store: Store, name: str) -> int:
    return int(
        store.one(name, "SELECT id FROM jobs WHERE name = 'long-run' ORDER BY id LIMIT 1")[0]
    )


def ask(
    kind: str, api: Api, c: httpx.Client, w: httpx.Client, big: int, i: int, jobs: int
) -> float:
    """One request of ``kind``, timed."""
    if kind == "claim":
        c.post("/jobs", json={"entrypoint": "noop.py", "device": "cpu"}).raise_for_status()
        t0 = time.perf_counter()
        r = w.post(
            "/workers/claim",
            json={"name": "bench-w", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 0},
        )
        took = time.perf_counter() - t0
        r.raise_for_status()
        claim = r.json()
        w.post(
            f"/workers/jobs/{claim['job_id']}/finish",
            json={"worker": "bench-w", "attempt": claim["attempt"], "exit_code": 0},
        ).raise_for_status()
        return took
    if kind == "job":
        job = 1 + (i * 104_729) % jobs  # spread over the year
        return timed(c, "GET", f"/jobs/{job}")
    if kind == "metrics":
        return timed(c, "GET", f"/jobs/{big}/metrics", params={"name": "loss", "max_points": 1000})
    if kind in ACCOUNTING:
        return timed(c, "GET", "/accounting", params=ACCOUNTING[kind])
    if kind in QUEUE:
        return timed(c, "GET", "/queue", params=QUEUE[kind])
    return timed(c, "GET", "/jobs", params=QUERIES[kind])


# Accounting (GET /accounting, `ddpq acct`) over a month and over the whole year, a row
# per job and per attempt, one user's: a page of 100 and every user's totals each time.
ACCOUNTING: dict[str, dict[str, str | int]] = {
    "acct 30d": {"limit": 100},
    "acct 30d --per attempt": {"limit": 100, "per": "attempt"},
    "acct 30d --user": {"limit": 100, "user": "u007"},
    "acct a year": {"limit": 100, "since": "2000-01-01T00:00:00"},
}


# The queue in order (GET /queue, `ddpq queue`) with QUEUED jobs waiting (--queued):
# its first page and one further in, each with its reasons and estimated starts.
QUEUE: dict[str, dict[str, str | int]] = {
    "queue": {"limit": 100},
    "queue --offset 5000": {"limit": 100, "offset": 5000},
}
QUEUE_USERS = 20


def fill_queue(store: Store, name: str, api: Api, admin: httpx.Client, queued: int) -> None:
    """``queued`` jobs waiting, submitted through the API by QUEUE_USERS users (their
    fair-share standing, their sizes varied), the admin's at priorities of their own;
    those a kept database has already stay."""
    have = store.one(name, "SELECT count(*) FROM jobs WHERE status = 'queued'")[0]
    if have >= queued:
        return
    t0 = time.monotonic()
    users = []
    for k in range(QUEUE_USERS):
        user = f"q{k:02d}"
        r = admin.post("/users", json={"name": user})
        if r.status_code == 409:
            r = admin.post(f"/users/{user}/rotate")
        r.raise_for_status()
        users.append(api.client_with(r.json()["token"]))
    for n in range(queued - have):
        body = {"entrypoint": "noop.py", "device": "cpu", "world_size": 1 + n % 4}
        if n % 10 == 0:
            admin.post("/jobs", json={**body, "priority": n % 7}).raise_for_status()
        else:
            users[n % QUEUE_USERS].post("/jobs", json=body).raise_for_status()
    for c in users:
        c.close()
    print(f"  {name}: {queued - have:,} jobs queued in {time.monotonic() - t0:.0f} s")


QUERIES: dict[str, dict[str, str | int]] = {
    "ls": {"limit": 50},
    "ls dashboard (100)": {"limit": 100},
    "ls --user": {"limit": 50, "user": "u007"},
    "ls --status failed": {"limit": 50, "status": "failed"},
    "ls --user --status failed": {"limit": 50, "user": "u007", "status": "failed"},
    "ls --status running": {"limit": 50, "status": "running,queued"},
    "ls --mine (few jobs)": {"limit": 50, "mine": "true"},
    "ls --user (no jobs)": {"limit": 50, "user": "nobody"},
    # Not a goal: a text search of names walks the jobs until it has a page, but where
    # pg_trgm could be created a trigram index serves it (migration 0026).
    "ls --name (one match)": {"limit": 50, "name": "long-run"},
}
KINDS = [*QUERIES, "job", "metrics", "claim", *ACCOUNTING, *QUEUE]


def measure(
    store: Store, full: str, empty: str, rounds: int, kinds: list[str], queued: int = 0
) -> None:
    with contextlib.ExitStack() as stack:
        # No retention sweep while measuring: on the full database it would be going
        # over a year of jobs meanwhile (its own cost is measured with --retention).
        off = {"DDPQ_METRICS_DOWNSAMPLE_AFTER": "never", "DDPQ_LOG_RETENTION": "never"}
        apis = {
            label: stack.enter_context(serve(store.url(name), **off))
            for label, name in (("full", full), ("empty", empty))
        }
        for name in (empty, full):
            roll_up(store, name)
        bigs = {"full": long_job(store, full), "empty": long_job(store, empty)}
        njobs = {}
        clients = {}
        for label, api in apis.items():
            name = full if label == "full" else empty
            # The database's first admin was made with the token of the `ddpq serve`
            # that built it: this one's token becomes theirs.
            store.one(
                name,
                "UPDATE users SET token_hash = %s, revoked_at = NULL WHERE role = 'admin'",
                [hashlib.sha256(api.api_token.encode()).hexdigest()],
            )
            register(api, "bench-w", cpu_slots=1)
            clients[label] = (
                stack.enter_context(api.client()),
                stack.enter_context(api.client("worker")),
            )
            njobs[label] = store.one(name, "SELECT max(id) FROM jobs")[0]
            if queued and any(kind in QUEUE for kind in kinds):
                fill_queue(store, name, api, clients[label][0], queued)
        print(
            f"\n{'request':32} {'full p50/p95 ms':>18} {'empty p50/p95 ms':>18}   ratio p50 (p95)"
        )
        for kind in kinds:
            samples: dict[str, list[float]] = {"full": [], "empty": []}
            for i in range(rounds + 10):  # the first 10 warm up
                for label in ("full", "empty") if i % 2 else ("empty", "full"):
                    c, w = clients[label]
                    took = ask(kind, apis[label], c, w, bigs[label], i, njobs[label])
                    if i >= 10:
                        samples[label].append(took * 1000)
            f50, f95 = percentile(samples["full"], 0.5), percentile(samples["full"], 0.95)
            e50, e95 = percentile(samples["empty"], 0.5), percentile(samples["empty"], 0.95)
            flag = "" if f50 <= 2 * e50 else "   OVER 2x"
            print(
                f"{kind:32} {f50:8.2f} / {f95:7.2f} {e50:8.2f} / {e95:7.2f}   "
                f"{f50 / e50:5.2f} ({f95 / e95:.2f}){flag}",
                flush=True,
            )


def roll_up(store: Store, name: str) -> None:
    """Accounting's hourly rollup (service.rollup) of the whole history, before
    measuring: what the API's sweeper does a batch a round after an upgrade, here
    at once (the sweeper takes what is left meanwhile), and how long it took."""
    from service.db import Database
    from service.rollup import roll

    db = Database(store.url(name))
    t0, done = time.monotonic(), 0
    while n := roll(db, budget_s=5.0, batch=10_000):
        done += n
    db.engine.dispose()
    print(f"  rollup of {name}: {done:,} attempts and jobs in {time.monotonic() - t0:.1f} s")
    if done > 10_000:  # as autovacuum would after so many updates: fresh statistics, and
        store.vacuum(name, full=False)  # the rolled rows out of the partial indexes
        if store is Postgres:  # the class itself (Store): isinstance() never held
            store.one(name, "ANALYZE")


def retention(
    store: Store, name: str, jobs: int, vacuum_full: bool, job_retention: str | None
) -> None:
    """Run the retention sweep on ``name`` until it has nothing left, with the default
    settings (and the job purge after ``job_retention``); rows and bytes per 1,000 jobs
    before and after."""
    from service.config import Settings
    from service.db import Database
    from service.retention import sweep

    if vacuum_full:
        store.vacuum(name, full=True)
    show_growth("without retention", store.growth(name), jobs)
    print(f"  (the database: {store.size(name)})")
    settings = Settings(database_url=store.url(name), job_retention=job_retention)
    db = Database(settings.resolved_database_url, settings.policy())
    t0 = time.monotonic()
    done = {"points": 0, "logs": 0, "purged": 0}
    while True:
        got = sweep(db, budget_s=5.0, outputs=settings.outputs_limits())
        done["points"] += got.points
        done["logs"] += got.logs
        done["purged"] += got.purged
        if got.done:
            break
    db.engine.dispose()
    print(
        f"retention: {done['purged']:,} jobs purged, {done['points']:,} points and the logs "
        f"of {done['logs']:,} jobs dropped in {time.monotonic() - t0:.0f} s"
    )
    store.vacuum(name, full=vacuum_full)
    show_growth("with retention", store.growth(name), jobs)
    print(f"  (the database: {store.size(name)})")


@contextlib.contextmanager
def databases(store: Store, keep: str | None, jobs: int, points: int) -> Iterator[tuple[str, str]]:
    base = PREFIX + (keep or f"tmp{int(time.time())}")
    full, empty = f"{base}_full", f"{base}_empty"
    try:
        for name, j, p in ((empty, EMPTY_JOBS, BIG + EMPTY_JOBS * 30), (full, jobs, points)):
            if keep and store.exists(name):
                print(f"reusing {name} ({store.size(name)})")
            else:
                store.drop(name)
                try:
                    store.build(name, j, p)
                except BaseException:
                    store.drop(name)  # never reused half-built
                    raise
        yield full, empty
    finally:
        if not keep:
            store.drop(full)
            store.drop(empty)


def main() -> None:
    global SQLITE_DIR
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    ap.add_argument(
        "--dir", default=SQLITE_DIR, help="where --backend sqlite keeps its files (%(default)s)"
    )
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--points", type=int, default=100_000_000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument(
        "--queued", type=int, default=10_000, help="jobs waiting for the queue's requests"
    )
    ap.add_argument("--keep", metavar="NAME", help=f"build into {PREFIX}NAME_full/_empty and keep")
    ap.add_argument("--drop", metavar="NAME", help="drop the databases --keep NAME made, and exit")
    ap.add_argument("--only", nargs="*", choices=KINDS, help="measure only these")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--retention", action="store_true", help="then run retention, show growth")
    ap.add_argument("--vacuum-full", action="store_true")
    ap.add_argument(
        "--job-retention", metavar="DURATION", help="with --retention: purge jobs (e.g. 180d)"
    )
    args = ap.parse_args()
    SQLITE_DIR = os.path.abspath(args.dir)
    store: Store = Sqlite if args.backend == "sqlite" else Postgres
    if args.drop:
        for suffix in ("_full", "_empty"):
            store.drop(f"{PREFIX}{args.drop}{suffix}")
        return
    with databases(store, args.keep, args.jobs, args.points) as (full, empty):
        if not args.build_only:
            measure(store, full, empty, args.rounds, args.only or KINDS, args.queued)
        if args.retention:
            jobs = store.one(full, "SELECT count(*) FROM jobs")[0]
            retention(store, full, jobs, args.vacuum_full, args.job_retention)


if __name__ == "__main__":
    main()
