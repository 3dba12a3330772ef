"""The engine, sessions, and migrations: the only place that opens the database.

SQLite must be correct under concurrency: WAL so readers never block the writer,
a busy timeout so writers queue instead of failing, and ``BEGIN IMMEDIATE`` for
every write transaction, so that a transaction that reads before it writes takes
the write lock first and can never be upgraded into a deadlock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            # More connections than FastAPI's 40 worker threads: GET /jobs/{id} reads on
            # the event loop, which must never wait for a connection the threads hold.
            pool_size=48,
            max_overflow=16,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
            # Hand transaction control to SQLAlchemy's "begin" hook below; pysqlite's
            # own implicit BEGIN would be DEFERRED.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@dataclass(frozen=True)
class Policy:
    """The rules the queue runs by (from Settings)."""

    lease_s: float = 30.0
    starvation_s: float = 600.0
    # A retried attempt waits base * 2^(failures - 1) seconds, at most the cap.
    retry_backoff_s: float = 10.0
    retry_backoff_max_s: float = 600.0
    # How long a multi-node job's held node slots wait for the rest of the gang.
    gang_timeout_s: float = 120.0
    # A job's stored log is capped at about this many bytes (service.logs).
    log_max_bytes: int = 32 * 1024 * 1024


class Database:
    """Read and write sessions over one engine, and the queue policy they serve."""

    def __init__(self, url: str, policy: Policy | None = None) -> None:
        self.url = url
        self.policy = policy or Policy()
        self.engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        writer = self.engine
        if self.dialect == "sqlite":
            writer = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        self._writer = writer
        self._write = sessionmaker(writer, expire_on_commit=False)
        # SQLite's busy handler sleeps in steps of up to 100 ms while another
        # connection writes; threads of this process queue on a lock instead and
        # are handed the database the moment it is free (5x the claims a second).
        self._write_lock: threading.Lock | contextlib.nullcontext[None] = (
            threading.Lock() if self.dialect == "sqlite" else contextlib.nullcontext()
        )

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session, session.begin():
            session.info["policy"] = self.policy
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that holds the write lock from its first statement on SQLite."""
        with self._write_lock, self._write() as session, session.begin():
            session.info["policy"] = self.policy
            yield session

    @contextmanager
    def write_conn(self) -> Iterator[Connection]:
        """A write transaction on a bare Core connection: no Session to set up and tear
        down, for the claim, which runs once per job and per idle poll of every worker."""
        with self._write_lock, self._writer.begin() as conn:
            yield conn

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would read a '%' in a password as a directive.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> None:
    """Bring the schema to the newest migration (run by ``ddpq serve`` at start)."""
    command.upgrade(alembic_config(url), "head")
