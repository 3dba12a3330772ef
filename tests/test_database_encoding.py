"""A Postgres database that is not UTF8 is refused at start, in one line that says how to
make one that is (it crashed `ddpq serve` with a TypeError from deep in SQLAlchemy)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _pg_admin, _pg_url, free_port, run_ddpq


@pytest.fixture
def sql_ascii_url(pg_template: str) -> Iterator[str]:
    name = f"ddpq_ascii_{uuid.uuid4().hex[:12]}"
    with _pg_admin() as conn:
        conn.execute(
            f"CREATE DATABASE \"{name}\" ENCODING 'SQL_ASCII' TEMPLATE template0 "
            "LC_COLLATE 'C' LC_CTYPE 'C'"
        )
    yield _pg_url(name)
    with _pg_admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.postgres
def test_serve_refuses_a_database_that_is_not_utf8(sql_ascii_url: str, tmp_path: Path) -> None:
    result = run_ddpq(
        "serve",
        "--port",
        str(free_port()),
        env={"DDPQ_DATABASE_URL": sql_ascii_url, "DDPQ_DATA_DIR": str(tmp_path)},
        timeout=60,
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert "uses the encoding SQL_ASCII; ddpq needs UTF8" in message, result.stderr
    assert "createdb -E UTF8 -T template0" in message, result.stderr
