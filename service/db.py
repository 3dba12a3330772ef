"""The engine, sessions, and migrations: the only place that opens the database.

SQLite must be correct under concurrency: WAL so readers never block the writer,
a busy timeout so writers queue instead of failing, and ``BEGIN IMMEDIATE`` for
every write transaction, so that a transaction that reads before it writes takes
the write lock first and can never be upgraded into a deadlock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Select, String, Update, column, create_engine, event, text
from sqlalchemy.engine import Connection, Engine, Row, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import Executable

from service.errors import ServiceError

log = logging.getLogger("ddpq.service")

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# A transaction that took this long found the database unavailable for a while (a
# network partition that hangs queries, another process holding SQLite's lock), even
# though it did not fail: it counts as an outage that ended when it did. A long query
# taken for a stall costs a later lease expiry: a whole lease. So the bar is a quarter
# of the lease, at least STALL_S and at most STALL_MAX_S: a stall shorter than that
# delays no live worker's heartbeat past its lease (the lease leaves DDPQ_LEASE_S -
# DDPQ_HEARTBEAT_S to spare, 28 s by default). With 2 s for every lease, transactions
# slowed by load alone counted as stalls at 1,000 hosts, and a host killed there was
# declared lost 33 s after its 48-s lease (bench/fleet.py).
STALL_S = 2.0
STALL_MAX_S = 10.0
# What an unreachable or refusing database raises (a pool that cannot hand out a
# connection in time, too).
UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeout)


# What makes a Postgres transaction's commit return without waiting for its WAL to reach
# the disk, as a condition of an UPDATE (Database.not_durable): set_config(..., true) is
# SET LOCAL, for the transaction it runs in only, and Postgres reads synchronous_commit
# when the transaction commits (RecordTransactionCommit), after the statement. As an
# uncorrelated sub-SELECT it is an InitPlan that the UPDATE's one-time filter evaluates
# before it scans (an unreferenced CTE is never evaluated: measured, its commits each
# waited for a WAL flush; a sub-SELECT in FROM works too, but SQLAlchemy warns of a
# cartesian product). So one statement on an autocommit connection is a whole
# non-durable transaction: 2,000 of them took 5-70 WAL flushes (pg_stat_wal.wal_sync,
# the WAL writer's and other databases') where the plain UPDATE took 2,000, and on this
# machine's disk 190-220 us each instead of 300-380.
_NOT_DURABLE = (
    text("SELECT set_config('synchronous_commit', 'off', true)")
    .columns(column("off", String))
    .scalar_subquery()
)


class _Pending(threading.local):
    """Per thread: what each open write transaction hands on once it commits."""

    def __init__(self) -> None:
        self.stack: list[list[Any]] = []


_pending = _Pending()


def after_commit(what: Any) -> None:
    """Hand ``what`` to the Database's ``on_commit`` once the write transaction this thread
    is in commits; nothing if it rolls back (or runs outside ``Database.write``). What a
    commit makes claimable wakes claimers then: not before (they would not see it), and
    not twice (the route and the process's own NOTIFY each did, before)."""
    if _pending.stack:
        _pending.stack[-1].append(what)


class UnsupportedDatabase(ServiceError):
    """A database ddpq cannot run on; the message says how to make one it can."""


class Unreachable(ServiceError):
    """The database server did not answer (yet)."""


def libpq_conninfo(url: str) -> str:
    """A SQLAlchemy Postgres URL as plain libpq connection info, for psycopg itself."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def refuse_unsupported(url: str) -> None:
    """Refuse a Postgres whose encoding is not UTF8 before anything else talks to it.

    psycopg returns text as bytes from a SQL_ASCII database, and the first thing to
    notice is SQLAlchemy parsing the server version (a TypeError, a crash); metric names
    and job names in any script need UTF8 anyway. Raises Unreachable while the server
    does not answer."""
    if make_url(url).get_backend_name() != "postgresql":
        return
    import psycopg  # here: an API on SQLite never loads the Postgres driver

    try:
        with psycopg.connect(libpq_conninfo(url), connect_timeout=5) as conn:
            row = conn.execute("SHOW server_encoding").fetchone()
    except psycopg.OperationalError as exc:
        raise Unreachable(str(exc)) from exc
    value = row[0] if row else ""
    encoding = value.decode() if isinstance(value, bytes) else str(value)
    if encoding.upper().replace("-", "") != "UTF8":
        name = make_url(url).database
        raise UnsupportedDatabase(
            f"the database {name!r} uses the encoding {encoding}; ddpq needs UTF8. Create it "
            f"with: createdb -E UTF8 -T template0 {name}"
        )


class Health:
    """When the database last came back: the owner of "has it been reachable long enough".

    Every transaction reports here: a failure (connection refused or dropped, a pool
    timeout) marks the database down, the first success after that marks it recovered,
    and a transaction that stalled counts as an outage that ended when it did. The
    lease sweeper declares nothing lost until the database has been up for a full lease
    since it last recovered: heartbeats that got 503 during an outage came from workers
    that were alive, and they need a heartbeat interval after the recovery to get through.
    The clock starts at process start, so a restarted API waits a lease too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down = False
        self._up_since = time.monotonic()

    def failed(self) -> None:
        with self._lock:
            self._down = True

    def succeeded(self) -> None:
        if self._down:  # read unlocked: the common case costs nothing
            with self._lock:
                if self._down:
                    self._down = False
                    self._up_since = time.monotonic()

    def stalled(self) -> None:
        """A transaction waited long for the database: it was unavailable until now."""
        with self._lock:
            self._down = False
            self._up_since = time.monotonic()

    def up_for(self, seconds: float) -> bool:
        """Whether the database has answered for ``seconds`` since it last recovered."""
        with self._lock:
            return not self._down and time.monotonic() - self._up_since >= seconds


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
    engine = create_engine(url, pool_size=10, max_overflow=20)
    _ping_when_idle(engine)
    return engine


# A pooled Postgres connection idle for longer than this is pinged before it is handed
# out (a server restart or a firewall may have dropped it meanwhile). SQLAlchemy's
# pool_pre_ping pings at every checkout: two round trips of seven on GET /jobs/{id} (the
# token check and the read each check one out) and a quarter of its CPU in the API
# process (bench/api.py). A connection in steady use that the server drops fails its
# next statement instead: a 503 the client retries, and SQLAlchemy then replaces every
# pooled connection opened before it.
IDLE_PING_S = 2.0


def _ping_when_idle(engine: Engine) -> None:
    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since <= IDLE_PING_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            # The pool discards this connection and checks out another (or a new one).
            raise DisconnectionError(str(exc)) from exc


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
    # Fair share (service.queue.shares): what a user used this long ago counts half;
    # a CPU slot counts this much of a GPU.
    fairshare_half_life_s: float = 86400.0
    cpu_slot_weight: float = 0.125
    # Preemption (service.queue.preempt): off, priority, or fair-share; never a job that
    # has run less than this.
    preemption: str = "off"
    preempt_min_run_s: float = 60.0
    # Checkpoint retention (service.checkpoints): a job's newest checkpoints kept when
    # its spec does not say (0: all); how long an ended job's stay (None: forever).
    keep_last: int = 3
    checkpoint_retention_s: float | None = 7 * 24 * 3600.0
    # History retention (service.retention): an ended job's metric series downsampled
    # to at most this many points each this long after its end, its log deleted this
    # long after (None: never).
    metrics_downsample_after_s: float | None = 30 * 24 * 3600.0
    metrics_downsample_points: int = 2000
    log_retention_s: float | None = 180 * 24 * 3600.0
    # The job purge (service.retention): an ended job deleted this long after its end
    # (None: never, the default: a purge deletes history, an operator turns it on).
    job_retention_s: float | None = None
    # The audit retention (service.retention): an audit row deleted this long after it
    # was written (None: never, the default, as for the purge).
    audit_retention_s: float | None = None


class Database:
    """Read and write sessions over one engine, and the queue policy they serve."""

    def __init__(self, url: str, policy: Policy | None = None) -> None:
        self.url = url
        self.policy = policy or Policy()
        self.health = Health()
        self.engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        writer = self.engine
        if self.dialect == "sqlite":
            writer = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        self._writer = writer
        self._write = sessionmaker(writer, expire_on_commit=False)
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._compiled: dict[Any, Any] = {}  # read_one's statements, compiled once
        # Called, on the committing thread, with what a write transaction handed to
        # after_commit (the API: its claimers' wake-ups).
        self.on_commit: Callable[[list[Any]], None] | None = None
        self._not_durable: dict[Update, Update] = {}  # not_durable's, built once
        # SQLite's busy handler sleeps in steps of up to 100 ms while another
        # connection writes; threads of this process queue on a lock instead and
        # are handed the database the moment it is free (5x the claims a second).
        self._write_lock: threading.Lock | contextlib.nullcontext[None] = (
            threading.Lock() if self.dialect == "sqlite" else contextlib.nullcontext()
        )

    @contextmanager
    def _watched(self) -> Iterator[None]:
        """Report how a transaction went to ``health``."""
        started = time.monotonic()
        try:
            yield
        except UNAVAILABLE:
            self.health.failed()
            raise
        took = time.monotonic() - started
        if took > min(max(STALL_S, self.policy.lease_s / 4), STALL_MAX_S):
            log.warning("a transaction took %.1f s: counted as an outage of the database", took)
            self.health.stalled()
        else:
            self.health.succeeded()

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._watched(), self._read() as session, session.begin():
            session.info["policy"] = self.policy
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that holds the write lock from its first statement on SQLite."""
        with (
            self._committed(),
            self._watched(),
            self._write_lock,
            self._write() as session,
            session.begin(),
        ):
            session.info["policy"] = self.policy
            yield session

    @contextmanager
    def _committed(self) -> Iterator[None]:
        """Hand what the transaction inside gave after_commit to on_commit, once committed."""
        handed: list[Any] = []
        _pending.stack.append(handed)
        try:
            yield
        finally:
            _pending.stack.pop()
        if handed and self.on_commit is not None:
            self.on_commit(handed)

    def not_durable(self, stmt: Update) -> Update:
        """``stmt`` made to turn, on Postgres, the commit of the transaction it runs in
        non-durable: the commit returns without waiting for the WAL to reach the disk
        (synchronous_commit off for that transaction only: _NOT_DURABLE, a condition
        evaluated before any row is written), for what a crash may lose the last
        fraction of a second of without harm (a lease renewal: the next one comes
        seconds later). Still atomic and in order with every other commit; the wait it
        saves was 8-11 ms a commit (p99 26-46 ms) on a busy disk. Not a ``SET LOCAL`` of
        its own: that was a round trip more, a quarter of an idle host's heartbeat.
        SQLite in WAL mode with synchronous=NORMAL does not wait for the disk anyway:
        ``stmt`` unchanged. Built once per statement."""
        if self.dialect != "postgresql":
            return stmt
        made = self._not_durable.get(stmt)
        if made is None:
            made = self._not_durable[stmt] = stmt.where(_NOT_DURABLE == "off")
        return made

    def write_one(self, stmt: Update, params: dict[str, Any], durable: bool = True) -> int:
        """One prebuilt UPDATE as a write transaction of its own; the rows it touched.

        On Postgres one round trip: on an autocommit connection the statement is its own
        transaction (no BEGIN and no COMMIT), made non-durable by ``not_durable`` when
        ``durable`` is False. An idle host's heartbeat is this, a thousand hosts every
        2 s: as BEGIN, SET LOCAL, UPDATE, COMMIT it took four. On SQLite a transaction
        of ``write_conn`` (BEGIN IMMEDIATE, under the process's write lock)."""
        if self.dialect != "postgresql":
            with self.write_conn() as conn:
                return int(conn.execute(stmt, params).rowcount)
        if not durable:
            stmt = self.not_durable(stmt)
        with self._watched(), self._autocommit.connect() as conn:
            return int(conn.execute(stmt, params).rowcount)

    def read_one(self, stmt: Select[Any], params: dict[str, Any]) -> tuple[Any, ...] | None:
        """One row of one prebuilt SELECT, on the lightest path there is: the driver's own
        cursor, no Session, no SQLAlchemy execution and no transaction around it (a lone
        SELECT needs none). A user token's lookup runs it on every request: through a
        Session it cost ~90 us on SQLite, here ~14 us; on Postgres SQLAlchemy's execution
        cost more than the round trip (0.68 against 0.46 ms a lookup on this VM, 1.23
        against 0.79 ms with the caches cold). So its parameters and columns must need no
        type processing (text, numbers: SQLAlchemy's is skipped)."""
        compiled = self._compiled.get(stmt)
        if compiled is None:
            compiled = self._compiled[stmt] = stmt.compile(dialect=self.engine.dialect)
        bound = compiled.construct_params(params)  # a literal's own bind parameter too
        args: Any = (
            [bound[k] for k in compiled.positiontup or ()] if self.dialect == "sqlite" else bound
        )
        with self._watched(), self._driver() as conn:
            cur = conn.cursor()
            try:
                cur.execute(compiled.string, args)
                row = cur.fetchone()
            finally:
                cur.close()
        return tuple(row) if row is not None else None

    @contextmanager
    def _driver(self) -> Iterator[Any]:
        """A pooled connection's driver connection (sqlite3's, psycopg's), outside any
        transaction: on Postgres in autocommit (no BEGIN and no ROLLBACK round trip around
        a lone statement). What the driver raises comes out as SQLAlchemy's exceptions
        (UNAVAILABLE: the routes' 503), and a connection it found broken leaves the pool."""
        dialect = self.engine.dialect
        dbapi = dialect.loaded_dbapi
        try:
            raw = self.engine.raw_connection()  # a new connection may be made: its errors too
        except dbapi.Error as exc:
            raise DBAPIError.instance(None, None, exc, dbapi.Error, dialect=dialect) from exc
        try:
            conn: Any = raw.driver_connection
            if self.dialect == "postgresql":
                conn.autocommit = True  # psycopg sends nothing for it (idle)
            try:
                yield conn
            finally:
                if self.dialect == "postgresql" and not conn.closed:
                    conn.autocommit = False
        except dbapi.Error as exc:
            gone = dialect.is_disconnect(exc, raw.dbapi_connection, None)
            if gone:
                raw.invalidate(exc)
            raise DBAPIError.instance(
                None, None, exc, dbapi.Error, connection_invalidated=gone, dialect=dialect
            ) from exc
        finally:
            raw.close()

    def read_all(self, stmt: Executable, params: dict[str, Any]) -> list[Row[Any]]:
        """Every row of one prebuilt SELECT with no Session and no transaction around it
        (on Postgres, autocommit: no BEGIN and no ROLLBACK round trip), for what every
        heartbeat asks: through a read Session, the reply's checkpoint orders cost a
        third of an idle heartbeat's CPU in the API."""
        engine = self._autocommit if self.dialect == "postgresql" else self.engine
        with self._watched(), engine.connect() as conn:
            return list(conn.execute(stmt, params))

    @contextmanager
    def write_conn(self) -> Iterator[Connection]:
        """A write transaction on a bare Core connection: no Session to set up and tear
        down, for the claim, which runs once per job and per idle poll of every worker."""
        with self._committed(), self._watched(), self._write_lock, self._writer.begin() as conn:
            yield conn

    def ping(self) -> None:
        with self._watched(), self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(url: str) -> Any:
    from alembic.config import Config  # only when migrating

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would read a '%' in a password as a directive.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> None:
    """Bring the schema to the newest migration (run by ``ddpq serve`` at start)."""
    from alembic import command

    command.upgrade(alembic_config(url), "head")
