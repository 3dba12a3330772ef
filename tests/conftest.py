"""Fixtures that build real things: a database per test, `ddpq serve` and
`ddpq worker` as subprocesses on free ports.

Postgres: every test gets its own database cloned from a migrated template; SQLite: a
copy of a migrated file.
Without a reachable Postgres those tests are skipped with the reason, unless
DDPQ_REQUIRE_POSTGRES=1 (set by .ci/run), when they fail instead.

Slurm: a one-node cluster (tests/slurmcluster.py) set up once per session; without one
those tests are skipped, unless DDPQ_REQUIRE_SLURM=1 (set by .ci/run).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from service.db import Database, upgrade
from tests import slurmcluster
from tests.ddpqfork import Forked
from worker.edges.procs import launch_prefix

# No test reads or writes the config file of whoever runs them (`ddpq login` and `ddpq up`
# write ~/.config/ddpq/config.toml): this process, and every `ddpq` it starts, use one of
# the session's own unless a test gives its own XDG_CONFIG_HOME.
_CONFIG_HOME = tempfile.mkdtemp(prefix="ddpq-test-config-")
os.environ["XDG_CONFIG_HOME"] = _CONFIG_HOME
atexit.register(shutil.rmtree, _CONFIG_HOME, ignore_errors=True)

PG_ADMIN = os.environ.get("DDPQ_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REQUIRE_PG = os.environ.get("DDPQ_REQUIRE_POSTGRES") == "1"
REQUIRE_SLURM = os.environ.get("DDPQ_REQUIRE_SLURM") == "1"
REPO = Path(__file__).resolve().parent.parent


# The test modules as pytest rewrites them (for its assert messages), cached in __pycache__
# as a plain run caches them: where PYTHONDONTWRITEBYTECODE is set, each of a run's pytest
# processes (four in `make test`) rewrote every one of them again, about 4 s of CPU each.
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """The checkout's bytecode, written once before any test (by the one process that
    starts pytest's others): where PYTHONDONTWRITEBYTECODE is set (container images often
    set it), every `ddpq serve`, worker, CLI call and rank would otherwise compile the
    checkout's modules from source again (0.1-0.2 s of CPU each, hundreds of times a run).
    compileall writes in spite of the variable, skips what is up to date, and its files
    are the ones a plain interpreter writes (__pycache__, ignored by git)."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller did it
        return
    import compileall

    for package in ("ddpq", "service", "worker", "recipes", "migrations"):
        compileall.compile_dir(REPO / package, quiet=2)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the condition may not be observable yet
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}"
        + (f" (last error: {last_exc})" if last_exc else "")
    )


# The TLS context of every client the tests make: httpx builds one per client unless given
# one (loading the CA bundle: 24 ms of CPU), and a run makes thousands of clients, for
# servers it reaches over plain HTTP.
TLS = httpx.create_ssl_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- databases ------------------------------------------------------------------------


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN.rsplit("/", 1)[0]
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{dbname}"


def _pg_admin() -> psycopg.Connection:
    return psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    try:
        conn = _pg_admin()
    except psycopg.OperationalError as exc:
        if REQUIRE_PG:
            pytest.fail(f"Postgres is required (DDPQ_REQUIRE_POSTGRES=1) but unreachable: {exc}")
        pytest.skip(f"Postgres unreachable at {PG_ADMIN}: {exc}")
    name = f"ddpq_tmpl_{os.getpid()}"
    with conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    from service.db import upgrade

    upgrade(_pg_url(name))
    yield name
    with _pg_admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    name = f"ddpq_t_{uuid.uuid4().hex[:12]}"
    with _pg_admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    yield _pg_url(name)
    with _pg_admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, made once a session: a test's database is a copy of it, as
    a Postgres one is a clone of pg_template (migrating a new file waits on the disk for
    each migration's commit, a second or more under load; a copy takes milliseconds)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "ddpq.db"
    upgrade(f"sqlite:///{path}")
    return path


def _sqlite_copy(request: pytest.FixtureRequest, path: Path) -> str:
    """A migrated SQLite database at ``path`` (a copy of sqlite_template), as a URL."""
    shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return _sqlite_copy(request, tmp_path / "ddpq.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """The service's Database on a fresh, migrated database (each backend), no server."""
    if db_url.startswith("sqlite"):
        upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


# ---- Slurm ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm() -> slurmcluster.Cluster:
    """The one-node Slurm cluster, installed and started when missing."""
    try:
        return slurmcluster.ensure()
    except Exception as exc:
        if REQUIRE_SLURM:
            pytest.fail(f"Slurm is required (DDPQ_REQUIRE_SLURM=1) but could not be set up: {exc}")
        pytest.skip(f"no one-node Slurm cluster: {exc}")


@pytest.fixture
def slurm_clean(slurm: slurmcluster.Cluster) -> Iterator[slurmcluster.Cluster]:
    """The cluster with none of this user's jobs queued or running."""
    slurm.cancel_all()
    yield slurm


# ---- processes --------------------------------------------------------------------------


# `ddpq serve` and the CLI calls run_ddpq makes are forked from a zygote (_zygote), unless
# DDPQ_TEST_FORK=off: then each starts a new interpreter, as they did before.
FORK = os.environ.get("DDPQ_TEST_FORK") != "off"


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
    # Tests run as root, where a worker would wall its jobs under uids of their own; the
    # directories tests make (pytest's, 0700) are closed to those. Jobs run as the worker's
    # user unless a test asks for walls (tests/test_walls.py).
    env["DDPQ_JOB_UIDS"] = "off"
    # The whole suite under a cold torchrun, the launcher before issue 34's warm one became
    # the default: DDPQ_TEST_LAUNCHER=torchrun.
    if os.environ.get("DDPQ_TEST_LAUNCHER"):
        env["DDPQ_LAUNCHER"] = os.environ["DDPQ_TEST_LAUNCHER"]
    # A worker's 1-rank jobs get one thread each, as torchrun gives each rank of a larger
    # job: then one warm process serves all of a worker's jobs (without it a 1-rank job's
    # environment differs from the one the worker starts ahead, and its own warm process
    # imports torch again: about 3 s of CPU a worker), and a 2-core machine running three
    # tests at once is not oversubscribed by a rank's thread pool.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_ddpq(
    *args: str,
    env: dict[str, str],
    cwd: Path | None = None,
    timeout: float = 60,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the `ddpq` command to its end, with ``env`` over this environment's non-DDPQ
    variables; its output is text (spawn_ddpq: forked, unless DDPQ_TEST_FORK=off)."""
    with tempfile.TemporaryDirectory(prefix="ddpq-run-") as where:
        out, err, given = (Path(where) / name for name in ("stdout", "stderr", "stdin"))
        given.write_text(input or "")
        proc = spawn_ddpq(args, _child_env(env), cwd or Path.cwd(), out, err, given)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc, signal.SIGKILL)
            raise
        return subprocess.CompletedProcess(list(args), code, out.read_text(), err.read_text())


def spawn_ddpq(
    args: Sequence[str],
    env: dict[str, str],
    cwd: Path,
    stdout: Path,
    stderr: Path | None = None,
    stdin: Path | None = None,
) -> subprocess.Popen[bytes] | Forked:
    """`python -m ddpq.cli *args`, its output in files (``stderr`` None: into ``stdout``):
    forked from the zygote (_zygote), or a new interpreter if DDPQ_TEST_FORK=off."""
    if FORK:
        return Forked(_zygote(), list(args), env, cwd, stdout, stderr, stdin)
    with contextlib.ExitStack() as files:
        return subprocess.Popen(
            [sys.executable, "-m", "ddpq.cli", *args],
            env=env,
            cwd=cwd,
            stdin=files.enter_context(open(stdin or os.devnull, "rb")),
            stdout=files.enter_context(open(stdout, "ab")),
            stderr=files.enter_context(open(stderr, "ab")) if stderr else subprocess.STDOUT,
        )


def serve_on_a_reachable_address(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`ddpq serve` on 0.0.0.0, where weak or missing tokens must make it exit."""
    return run_ddpq("serve", "--host", "0.0.0.0", "--port", str(free_port()), env=env)


def stop_process(
    proc: subprocess.Popen[bytes] | Forked, sig: int = signal.SIGTERM, timeout: float = 60
) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Server:
    url: str
    api_token: str
    worker_token: str
    data_dir: Path
    proc: subprocess.Popen[bytes] | Forked  # forked from the zygote (_zygote)
    log_path: Path
    clients: list[httpx.Client] = field(default_factory=list)
    registered: set[str] = field(default_factory=set)  # worker names tests registered by hand
    shared: bool = False  # one server for a module's tests (module_server): workers of their own
    db_url: str = ""  # the database it serves (a test that reads it, or starts a second process)

    def client(self, token: str | None = "user") -> httpx.Client:
        headers = {}
        if token == "user":
            headers["Authorization"] = f"Bearer {self.api_token}"
        elif token == "worker":
            headers["Authorization"] = f"Bearer {self.worker_token}"
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        c = httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=TLS)
        self.clients.append(c)
        return c

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


_ZYGOTE: list[subprocess.Popen[bytes]] = []  # this process's, started at its first use


def _zygote() -> str:
    """The socket of this pytest process's zygote (tests/ddpqfork.py), started at its
    first `ddpq serve` or CLI call: every one after is forked from it (0.2 s of CPU for a
    server's start against 1 s in a new interpreter, a few hundred starts a run)."""
    path = str(Path(_CONFIG_HOME) / f"zygote-{os.getpid()}.sock")
    if not _ZYGOTE or _ZYGOTE[0].poll() is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.ddpqfork", path],
            env=_child_env({}),
            stdin=subprocess.PIPE,  # its end: this process's (the pipe closes with it)
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        assert zygote.stdout is not None and zygote.stdout.readline() == b"ready\n"
        _ZYGOTE[:] = [zygote]
        atexit.register(_stop_zygote, zygote)
    return path


def _stop_zygote(zygote: subprocess.Popen[bytes]) -> None:
    """At this process's exit: the zygote's stdin closed, it ends (and kills any server
    a failed test left running)."""
    for pipe in (zygote.stdin, zygote.stdout):
        if pipe is not None:
            pipe.close()
    try:
        zygote.wait(timeout=10)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()


def start_server(
    db_url: str,
    data_dir: Path,
    port: int | None = None,
    tokens: tuple[str, str] | None = None,
    **env: str,
) -> Server:
    port = port or free_port()
    api_token, worker_token = tokens or (secrets.token_urlsafe(24), secrets.token_urlsafe(24))
    log_path = data_dir / f"serve-{port}.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    server_env = _child_env(
        {
            "DDPQ_DATABASE_URL": db_url,
            "DDPQ_DATA_DIR": str(data_dir),
            "DDPQ_API_TOKEN": api_token,
            "DDPQ_WORKER_TOKEN": worker_token,
            "DDPQ_HEARTBEAT_S": "0.5",
            **env,
        }
    )
    log_path.write_bytes(b"")
    proc = spawn_ddpq(argv, server_env, data_dir, log_path)
    server = Server(
        f"http://127.0.0.1:{port}", api_token, worker_token, data_dir, proc, log_path, db_url=db_url
    )

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"ddpq serve exited {proc.returncode}:\n{server.log()}")
        return httpx.get(f"{server.url}/healthz", timeout=2, verify=TLS).status_code == 200

    wait_for(healthy, 60, "ddpq serve to answer /healthz")
    return server


def stop_server(s: Server) -> None:
    """Close the test's clients, then stop the server process."""
    for c in s.clients:
        c.close()
    stop_process(s.proc)


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    s = start_server(db_url, tmp_path / "api")
    yield s
    stop_server(s)


@contextlib.contextmanager
def module_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """A database of a module's own (``request.param``: "sqlite" or "postgres"), and a
    directory beside it: the URL for the servers a module starts on it (module_server)."""
    where = tmp_path_factory.mktemp("server")
    name = f"ddpq_t_{uuid.uuid4().hex[:12]}"
    if request.param == "postgres":
        template = request.getfixturevalue("pg_template")
        with _pg_admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        url = _pg_url(name)
    else:
        url = _sqlite_copy(request, where / "ddpq.db")
    try:
        yield url, where
    finally:
        if request.param == "postgres":
            with _pg_admin() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def module_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, **env: str
) -> Iterator[Server]:
    """One `ddpq serve` on a database of its own (``request.param``: "sqlite" or
    "postgres"), for a module's tests that need nothing else of a server (its start is
    most of such a test's time): each test uses jobs and workers of its own (start_worker
    names them apart), or a worker the module shares (module_worker). A module defines it
    as its ``server``::

        @pytest.fixture(scope="module", params=["sqlite", "postgres"])
        def server(request, tmp_path_factory):
            yield from module_server(request, tmp_path_factory)
    """
    with module_database(request, tmp_path_factory) as (url, where):
        s = start_server(url, where / "api", **env)
        s.shared = True
        try:
            yield s
        finally:
            stop_server(s)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def module_api(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server per database for the module that asks for it (module_server)."""
    yield from module_server(request, tmp_path_factory)


@pytest.fixture
def api(module_api: Server) -> Iterator[Server]:
    """The module's shared server, with no job of another test's active (its_turn)."""
    from tests.helpers import its_turn  # here: tests.helpers imports this module

    yield from its_turn(module_api)


@dataclass
class Worker:
    name: str
    workspace: Path
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def launch_id(self, job_id: int, attempt: int = 1) -> str:
        return f"{self.launch_prefix}{job_id}/{attempt}"

    @property
    def launch_prefix(self) -> str:
        return launch_prefix(self.name, self.data_dir)


def worker_argv(
    server: Server, name: str, workspace: Path, data_dir: Path, *args: str
) -> list[str]:
    """`ddpq worker` against ``server`` (tests that start one outside start_worker)."""
    return [
        sys.executable, "-m", "ddpq.cli", "worker", "--url", server.url, "--name", name,
        "--workspace", str(workspace), "--data-dir", str(data_dir), *args,
    ]  # fmt: skip


def up_argv(port: int, *args: str) -> list[str]:
    """`ddpq up` on ``port`` with no GPUs (tests that run the API and a worker together)."""
    return [
        sys.executable, "-m", "ddpq.cli", "up", "--port", str(port), "--gpus", "none", *args,
    ]  # fmt: skip


@pytest.fixture(params=["warm", pytest.param("torchrun", marks=pytest.mark.launchers)])
def launcher(request: pytest.FixtureRequest) -> str:
    """A test that runs both ways: its workers start jobs forked from a warm process (issue
    34, the default), or with a cold torchrun (a job's ``launcher: torchrun``): pass
    ``env=launcher_env(launcher)`` to start_worker. The cold runs are marked
    ``launchers``: `make test-launchers` runs them (`make test`'s 15 minutes hold the
    default's)."""
    return str(request.param)


def launcher_env(launcher: str) -> dict[str, str]:
    return {"DDPQ_LAUNCHER": launcher}


# For a worker that runs no job (``env=NO_JOBS``): it starts no warm process, whose import
# of torch (about 3 s of CPU) such a test would pay for and never use.
NO_JOBS = launcher_env("torchrun")


def launch_worker(
    server: Server,
    base: Path,
    name: str,
    *args: str,
    cpu_slots: int = 4,
    gpus: str | None = "none",
    env: dict[str, str] | None = None,
) -> Worker:
    """A `ddpq worker` for ``server``, its files under ``base``; ``gpus=None`` lets it find
    its GPUs (NVML). Tests start theirs with start_worker, or share one (module_worker)."""
    workspace = base / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    log_path = base / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            worker_argv(
                server,
                name,
                workspace,
                base / "data",
                "--cpu-slots",
                str(cpu_slots),
                *(["--gpus", gpus] if gpus is not None else []),
                *args,
            ),
            env=_child_env({"DDPQ_WORKER_TOKEN": server.worker_token, **(env or {})}),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=base,
        )
    return Worker(name, workspace, base / "data", proc, log_path)


def stop_workers(workers: list[Worker]) -> None:
    """All at once: each worker's stop hands its jobs back (its claim long-poll ends at its
    leave; without an API to take the leave, it is waited out: up to 5 s), side by side."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def start(server: Server, *args: str, name: str | None = None, **kw: Any) -> Worker:
        """launch_worker's, named for this test (``cpu_slots``, ``gpus``, ``env``)."""
        # On a server shared by a module's tests, a name no other test's worker had.
        name = name or f"w{len(workers)}" + (f"-{uuid.uuid4().hex[:8]}" if server.shared else "")
        w = launch_worker(server, tmp_path / f"worker-{name}", name, *args, **kw)
        workers.append(w)
        return w

    yield start
    stop_workers(workers)


def module_worker(
    server: Server, tmp_path_factory: pytest.TempPathFactory, *args: str
) -> Iterator[Worker]:
    """One worker for a module's tests on its module_server, where each test's jobs are its
    own but the worker is not: a warm worker's start is about 4 s of CPU (torch imported).
    Each test runs its jobs to their end (helpers.end_jobs_left, for one that fails midway); a test
    that needs a worker set up otherwise starts its own on a server of its own, or this one
    would take its jobs. A module defines it as::

        @pytest.fixture(scope="module")
        def worker(server, tmp_path_factory):
            yield from module_worker(server, tmp_path_factory)
    """
    name = f"shared-{uuid.uuid4().hex[:8]}"
    w = launch_worker(server, tmp_path_factory.mktemp("worker"), name, *args)
    try:
        yield w
    finally:
        stop_workers([w])


def terminal(client: httpx.Client, job_id: int, timeout: float = 120) -> dict[str, Any]:
    """Wait for a job to reach a terminal state and return it."""

    def done() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    result: dict[str, Any] = wait_for(done, timeout, f"job {job_id} to end")
    return result
