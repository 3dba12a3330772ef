"""``ddpq serve``: wait for the database, migrate it, and serve the API."""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI
from sqlalchemy.exc import OperationalError

from service import db as dbmod
from service import users
from service.app import begin_shutdown, create_app
from service.config import Settings, resolve_tokens
from service.tokens import hash_token

log = logging.getLogger("ddpq.service")
DB_WAIT_S = 60.0


def wait_for_database(database: dbmod.Database, timeout_s: float = DB_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            dbmod.refuse_unsupported(database.url)
            database.ping()
            return
        except dbmod.UnsupportedDatabase as exc:
            raise SystemExit(f"ddpq: {exc}") from None
        except (OperationalError, dbmod.Unreachable) as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"ddpq: the database is unreachable: {exc}") from exc
            log.warning("waiting for the database: %s", str(exc).splitlines()[0])
            time.sleep(1.0)


def build(host: str, settings: Settings | None = None) -> tuple[Settings, FastAPI]:
    """Resolve tokens, migrate, and create the app (shared by serve and up)."""
    settings = settings or Settings()
    api_token, worker_token = resolve_tokens(settings, host)
    database = dbmod.Database(
        settings.resolved_database_url,
        settings.policy(),
    )
    wait_for_database(database)
    dbmod.upgrade(settings.resolved_database_url)
    # The API token of a set-up from before users existed is the first admin's.
    if users.bootstrap(database, hash_token(api_token)):
        log.info("the API token is the first admin's (user %s)", users.FIRST_ADMIN)
    elif users.authenticate(database, hash_token(api_token)) is None:
        log.warning(
            "DDPQ_API_TOKEN (or %s) is no live user's token: it was rotated or revoked",
            settings.data_dir / "api-token",
        )
    return settings, create_app(settings, api_token, worker_token, database)


class ApiServer(uvicorn.Server):
    """uvicorn, telling the app when it starts to stop (see app.begin_shutdown)."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
        super().__init__(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
        )
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        begin_shutdown(self.app)
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """From another thread (``ddpq up``)."""
        begin_shutdown(self.app)
        self.should_exit = True


def serve(host: str, port: int, log_level: str = "info") -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _, app = build(host)
    ApiServer(app, host, port, log_level).run()
