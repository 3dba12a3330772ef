"""The lone read on the driver's own cursor (Database.read_one: every user token's check,
and a heartbeat refused): what the driver raises comes out as SQLAlchemy's exceptions,
so a database that is down is a 503 (service.db.UNAVAILABLE), never a 500; and a
pooled connection found broken is dropped, so the next read works. Both databases."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from sqlalchemy import bindparam, literal, select
from sqlalchemy.engine import make_url

from service.db import UNAVAILABLE, Database, libpq_conninfo
from service.users import _BY_TOKEN


def test_a_database_out_of_reach_is_unavailable(db_url: str, tmp_path: Path) -> None:
    if db_url.startswith("sqlite"):
        gone = f"sqlite:///{tmp_path / 'no-such-dir' / 'ddpq.db'}"
    else:
        gone = make_url(db_url).set(port=1).render_as_string(hide_password=False)
    db = Database(gone)
    try:
        with pytest.raises(UNAVAILABLE):
            db.read_one(_BY_TOKEN, {"token_hash": "x" * 64})
        assert not db.health.up_for(0), "a read that failed counts toward the outage"
    finally:
        db.dispose()


@pytest.mark.postgres
def test_a_connection_the_server_dropped_is_unavailable_once_then_replaced(pg_url: str) -> None:
    db = Database(pg_url)
    try:
        assert db.read_one(_BY_TOKEN, {"token_hash": "x" * 64}) is None
        name = make_url(pg_url).database
        with psycopg.connect(libpq_conninfo(pg_url), autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        # At once (well inside the idle time after which a checkout pings first).
        with pytest.raises(UNAVAILABLE):
            db.read_one(_BY_TOKEN, {"token_hash": "x" * 64})
        assert db.read_one(_BY_TOKEN, {"token_hash": "x" * 64}) is None
    finally:
        db.dispose()


def test_a_statement_with_literals_of_its_own_binds_them_too(db: Database) -> None:
    stmt = select(literal(7)).where(literal("a") == bindparam("x"))
    assert db.read_one(stmt, {"x": "a"}) == (7,)
    assert db.read_one(stmt, {"x": "b"}) is None
