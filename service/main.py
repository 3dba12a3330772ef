"""``ddpq serve``: wait for the database, migrate it, and serve the API."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from types import FrameType
from typing import Any, NoReturn

import uvicorn
from fastapi import FastAPI
from sqlalchemy.exc import OperationalError

from service import db as dbmod
from service import secrets, users
from service.app import begin_shutdown, create_app
from service.config import Settings, record_api_url, resolve_secrets_keys, resolve_tokens
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


def prepare(
    host: str, settings: Settings | None = None
) -> tuple[Settings, str, str, dbmod.Database]:
    """Resolve tokens, wait for the database and migrate it: once, before any API
    process serves (shared by serve and up)."""
    settings = settings or Settings()
    api_token, worker_token = resolve_tokens(settings, host)
    settings = resolve_secrets_keys(settings, host)  # its key: set, generated, or refused
    database = dbmod.Database(
        settings.resolved_database_url,
        settings.policy(),
    )
    wait_for_database(database)
    dbmod.upgrade(settings.resolved_database_url)
    # A rotated key (DDPQ_SECRETS_OLD_KEYS): what it sealed is sealed with the new one.
    rekeyed = secrets.rekey(database, secrets.Keyring.of(settings))
    if rekeyed:
        log.info("%d secret(s) sealed again with the current DDPQ_SECRETS_KEY", rekeyed)
    # The API token of a set-up from before users existed is the first admin's.
    if users.bootstrap(database, hash_token(api_token)):
        log.info("the API token is the first admin's (user %s)", users.FIRST_ADMIN)
    elif users.authenticate(database, hash_token(api_token)) is None:
        log.warning(
            "DDPQ_API_TOKEN (or %s) is no live user's token: it was rotated or revoked",
            settings.data_dir / "api-token",
        )
    return settings, api_token, worker_token, database


def build(host: str, settings: Settings | None = None) -> tuple[Settings, FastAPI]:
    """Resolve tokens, migrate, and create the app (one process: ``ddpq up``, tests)."""
    settings, api_token, worker_token, database = prepare(host, settings)
    return settings, create_app(settings, api_token, worker_token, database)


class ApiServer(uvicorn.Server):
    """uvicorn, telling the app when it starts to stop (see app.begin_shutdown)."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
        super().__init__(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
        )
        self.app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            # Now a local client can reach it: say where, beside a generated token file.
            settings: Settings | None = getattr(self.app.state, "settings", None)
            if settings is not None:
                try:
                    record_api_url(settings, self.config.host, self._port())
                except OSError as exc:  # the token file is then sent nowhere: said, not fatal
                    log.warning("cannot write %s: %s", settings.data_dir / "api-url", exc)

    def _port(self) -> int:
        """The port listened on (the configured one, unless that was 0: the kernel's)."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets or ():
                return int(sock.getsockname()[1])
        return int(self.config.port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        begin_shutdown(self.app)
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """From another thread (``ddpq up``)."""
        begin_shutdown(self.app)
        self.should_exit = True


def serve(host: str, port: int, log_level: str = "info", workers: int | None = None) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings()
    workers = workers or settings.api_workers
    if workers > 1 and not settings.resolved_database_url.startswith("postgresql"):
        raise SystemExit(
            f"ddpq: --workers {workers} needs Postgres (DDPQ_DATABASE_URL): several processes "
            "on one SQLite file would take turns at its write lock, and a claim waiting in "
            "one would not hear of a job submitted through another. Run one process on SQLite."
        )
    if workers == 1:
        _, app = build(host, settings)
        ApiServer(app, host, port, log_level).run()
        return
    settings, api_token, worker_token, database = prepare(host, settings)
    database.dispose()  # no connection of the parent's may be shared by its children
    # uvicorn binds it as for its own workers (reuse address, IPv6, a taken port refused).
    sock = uvicorn.Config(app="", host=host, port=port, log_level=log_level).bind_socket()
    Supervisor(sock, workers, log_level, (settings, api_token, worker_token)).run()


class Supervisor:
    """``ddpq serve --workers N``: N forked API processes accepting on one listening
    socket (as uvicorn's and gunicorn's workers do: the kernel hands each connection to
    one of them). Everything they share lives in Postgres: claim wake-ups travel by
    LISTEN/NOTIFY, event streams and token checks read the database, and one process at a
    time sweeps leases (an advisory lock, sweeper.SweepTurn). A process that dies unasked
    stops the others and the supervisor exits 1: the service manager restarts the whole,
    rather than this process hiding a crash loop."""

    def __init__(
        self, sock: socket.socket, workers: int, log_level: str, app_args: tuple[Any, ...]
    ) -> None:
        self.sock = sock
        self.workers = workers
        self.log_level = log_level
        self.app_args = app_args
        self.children: set[int] = set()
        self.stopping = False
        self.signal = 0  # the signal that asked it to stop

    def _child(self) -> NoReturn:
        code = 0
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)  # uvicorn installs its own in run()
            app = create_app(*self.app_args)
            host, port = self.sock.getsockname()[:2]
            ApiServer(app, host, port, self.log_level).run(sockets=[self.sock])
        except BaseException:
            log.exception("API process %d failed", os.getpid())
            code = 1
        finally:
            logging.shutdown()
            os._exit(code)  # never back into the supervisor's code

    def _stop(self, sig: int, _frame: FrameType | None) -> None:
        self.stopping = True
        self.signal = self.signal or sig
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for _ in range(self.workers):
            pid = os.fork()
            if pid == 0:
                self._child()
            self.children.add(pid)
        log.info("serving on %s with %d API processes", self.sock.getsockname(), self.workers)
        failed = False
        while self.children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            self.children.discard(pid)
            if not self.stopping:
                log.error(
                    "API process %d exited (%s): stopping the others", pid, _exit_text(status)
                )
                failed = True
                self._stop(signal.SIGTERM, None)
                self.signal = 0
        self.sock.close()
        if failed:
            raise SystemExit(1)
        if self.signal:
            # Die of the signal, as one uvicorn process does (exit 143 on SIGTERM), and
            # without tearing down every module imported (3 s on this machine).
            logging.shutdown()
            signal.signal(self.signal, signal.SIG_DFL)
            signal.raise_signal(self.signal)


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
