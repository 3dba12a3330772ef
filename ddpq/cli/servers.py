"""The commands that start ddpq's processes: serve, worker, and up (both, supervised)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperCommand

from ddpq import config
from ddpq.cli.base import EXIT_USAGE, _fail, _failed, app, out
from ddpq.cli.extras import needs
from ddpq.errors import ApiRefused, SlurmError, WallsError

if TYPE_CHECKING:  # the CLI loads without the worker: imported where a command runs
    from worker.executors.settings import WorkerSettings


@app.command()
def serve(
    host: Annotated[str, typer.Option(envvar="DDPQ_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="DDPQ_PORT")] = 8000,
    log_level: str = "info",
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="API processes on the one port (else DDPQ_API_WORKERS, 1); more than 1 "
            "needs Postgres",
        ),
    ] = None,
) -> None:
    """Run the API (applies database migrations first)."""
    with needs("serve", "the API", "server"):
        from service.config import TokenError
        from service.main import serve as run_serve
        from worker.edges.procs import make_undumpable

    make_undumpable()  # its tokens and database URL stay out of reach of jobs on this host
    os.umask(0o077)  # what it writes (the SQLite database, token files) is its own alone

    try:
        run_serve(host, port, log_level, workers)
    except TokenError as exc:
        _fail(str(exc), EXIT_USAGE)


# `ddpq worker`'s options, by type: each is a field of worker.executors.settings.WorkerSettings
# of its name, which gives its help, default and variable (_SettingsCommand).
_Str = Annotated[str | None, typer.Option()]
_Int = Annotated[int | None, typer.Option()]
_Float = Annotated[float | None, typer.Option()]
_Path = Annotated[Path | None, typer.Option()]
_Strs = Annotated[list[str] | None, typer.Option()]


def describe_settings(command: Any) -> None:
    """Give ``command``'s options their field's help, default and variable, from
    worker.executors.settings (docs/gen_reference.py calls it too). Without the worker extra
    nothing is filled: the command itself says what to install."""
    try:
        from worker.executors import settings
    except ImportError:
        return
    for param in command.params:
        if param.name not in settings.WorkerSettings.model_fields:
            continue
        param.help = settings.WorkerSettings.model_fields[param.name].description
        param.default = settings.shown(param.name)  # shown in the help, never passed on
        param.envvar = settings.variable(param.name)


class _SettingsCommand(TyperCommand):
    """A command whose options are WorkerSettings' fields, described once it is asked
    for: ``ddpq --help`` imports no module of the worker (tests/test_install.py)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        describe_settings(self)
        return super().make_context(info_name, args, parent, **extra)


@app.command(cls=_SettingsCommand)
def worker(
    ctx: typer.Context,
    url: _Str = None,
    workspace: _Path = None,
    cpu_slots: _Int = None,
    gpus: _Str = None,
    name: _Str = None,
    data_dir: _Path = None,
    checkpoint_dir: _Path = None,
    kill_grace_s: _Float = None,
    advertise_addr: _Str = None,
    rdzv_ports: _Str = None,
    code_cache_gb: _Float = None,
    cache_gb: _Float = None,
    keep_workdirs_s: _Float = None,
    max_envs: _Int = None,
    executor: _Str = None,
    partition: _Str = None,
    account: _Str = None,
    sbatch_arg: _Strs = None,
    max_pending: _Int = None,
    poll_s: _Float = None,
    job_uids: _Str = None,
    pip_allow: _Strs = None,
    launcher: _Str = None,
    trace: _Path = None,
    log_level: _Str = None,
) -> None:
    """Run a worker on this host, or a bridge to a Slurm partition.

    A worker claims jobs from the API and runs them with torchrun. With --executor
    slurm, it hands each job to Slurm as one batch job instead (run it on a login
    node; the compute nodes need this Python with ddpq and must reach the API).
    """
    with needs("worker", "a worker", "worker"):
        from worker.edges.procs import make_undumpable
        from worker.executors.settings import SettingsError, WorkerSettings

    make_undumpable()  # before the token is read: jobs run as this user
    # The options given, or their variables as click read them; never a default, which
    # is the settings' own.
    given = {k: v for k, v in ctx.params.items() if _passed(ctx, k)}
    try:
        settings = WorkerSettings.load(**given)
    except SettingsError as exc:
        _fail(str(exc), EXIT_USAGE)
    token = config.worker_token()
    if not token:
        _fail(
            "no worker token: set DDPQ_WORKER_TOKEN (or DDPQ_DATA_DIR to the API's data dir)",
            EXIT_USAGE,
        )
    _log_to_stderr(settings.log_level)
    if settings.executor == "slurm":
        _run_bridge(settings, token)
    else:
        _run_agent(settings, token)


def _passed(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)  # typer's own click: compared by name
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _log_to_stderr(level: str) -> None:
    import logging

    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the rest


def _run_agent(settings: WorkerSettings, token: str) -> None:
    """Run a worker on this host, or exit with why the API or the walls refuse it."""
    from worker.executors.agent import Agent
    from worker.files import datadir
    from worker.walled.walls import Walls

    identity = datadir.hold(settings.data_dir)  # DataDirBusy: another worker's (exit 2)
    walls = Walls.configure(settings.job_uids)  # WallsError: cannot wall as asked (exit 2)
    agent = Agent(settings, token=token, identity=identity, walls=walls)
    try:
        agent.run()
    except ApiRefused as exc:  # a live worker holds this name (409), or a bad token
        _failed(exc, f"the API refused this worker: {exc}")
    except WallsError as exc:
        _failed(exc, f"cannot wall jobs: {exc}")


def _run_bridge(settings: WorkerSettings, token: str) -> None:
    """Run a Slurm bridge, or exit with why the partition or the API refuse it."""
    from worker.executors.bridge import Bridge
    from worker.files import datadir

    identity = datadir.hold(settings.data_dir)  # DataDirBusy: another worker's (exit 2)
    bridge = Bridge(settings, token=token, identity=identity)
    try:
        bridge.shape()
    except SlurmError as exc:  # sinfo failed, or names no node of the partition
        _failed(exc, f"Slurm partition {settings.partition}: {exc}")
    try:
        bridge.run()
    except ApiRefused as exc:
        _failed(exc, f"the API refused this bridge: {exc}")


@app.command("slurm-node", hidden=True)
def slurm_node() -> None:
    """Run one node of a Slurm attempt (the bridge's batch script starts it with srun)."""
    with needs("slurm-node", "a Slurm node of a job", "worker"):
        from worker import slurmnode

    raise typer.Exit(slurmnode.main())


def _log_in_locally(
    host: str,
    port: int,
    token: str,
    api: threading.Thread,
    stop: threading.Event,
    token_from: str,
) -> str:
    """Once the API answers, save it and its admin token in the user's config file as
    the server "local" (ddpq.config.remember), unless a login for its URL is saved
    already: that one is kept, never overwritten. The banner's line saying who the CLI
    is logged in as there (checked with GET /whoami), or what to do."""
    import httpx

    url = config.local_url(host, port)
    deadline = time.monotonic() + 60
    answer = None
    while answer is None:
        if not api.is_alive() or stop.is_set() or time.monotonic() > deadline:
            return f"not logged in: the API did not answer at {url}"
        try:
            answer = httpx.get(
                f"{url}/whoami", headers={"Authorization": f"Bearer {token}"}, timeout=5
            )
        except httpx.HTTPError:
            stop.wait(0.2)
    if answer.status_code != 200:
        return (
            f"not logged in: the API refuses its own token (HTTP {answer.status_code}: it was"
            f" rotated or revoked); ddpq login {url} with an admin's token"
        )
    try:
        saved = config.remember(url, token, "local")
    except (OSError, config.ConfigError) as exc:
        return f"not logged in: {exc}"
    where = f'server "{saved.name}" in {config.shown(saved.path)}'
    if saved.login_kept:
        # A person's own login for this URL: whose it is, as this server sees it.
        try:
            answer = httpx.get(
                f"{url}/whoami", headers={"Authorization": f"Bearer {saved.token}"}, timeout=5
            )
        except httpx.HTTPError as exc:
            return f"your saved login for {url} ({where}) is kept; not checked: {exc}"
        if answer.status_code != 200:
            return (
                f"your saved login for {url} ({where}) is refused by this server (HTTP"
                f" {answer.status_code}: revoked, rotated, or another server's); it is kept"
                f" as it is. Log in again: ddpq login {url} --server {saved.name} (the first"
                f" admin's token: {token_from})"
            )
        where = f"your saved login for {url}, {where}"
    elif saved.kept:
        where += f' (the server "local" there is {saved.kept}: kept)'
    who = answer.json()
    said = f"logged in as {who.get('name')} ({who.get('role')}): {where}"
    if saved.default == saved.name:
        return f"{said}, the default: ddpq commands in any directory use it"
    return (
        f"{said}; the default server is {saved.default!r}, so use this one"
        f" with ddpq --server {saved.name} COMMAND"
    )


def _say_up(url: str, database: str, token_from: str, logged_in: str, token_file: Path) -> None:
    """What `ddpq up` prints once the API answers: where, with which token, what to try."""
    out.print(
        f"\n[bold]ddpq is up[/bold] at {url}  (database: {database})\n"
        f"  user token: {token_from} (the first admin's)\n"
        f"  {escape(logged_in)}\n"
        f"  dashboard: {url}/  (asks for that token once)\n"
        f"  try:  ddpq submit --recipe toy-regression --world-size 2 && ddpq ls\n"
        f"  a team: ddpq users add NAME prints a token for each person, who runs"
        f" ddpq login {url}\n"
        f'  curl: curl -H "Authorization: Bearer $(cat {token_file})" {url}/jobs\n',
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def up(
    host: Annotated[str, typer.Option(envvar="DDPQ_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="DDPQ_PORT")] = 8000,
    workspace: Annotated[Path, typer.Option(help="directory entrypoint jobs run from")] = Path("."),
    cpu_slots: Annotated[
        int | None, typer.Option(help="the local worker's CPU ranks at once (default: cores)")
    ] = None,
    gpus: Annotated[
        str | None, typer.Option(help="GPU indices, or none (default: all NVML sees)")
    ] = None,
    job_uids: Annotated[
        str | None,
        typer.Option(
            help="the worker's --job-uids: FIRST-LAST, auto or off (default: auto, from "
            "DDPQ_JOB_UIDS)"
        ),
    ] = None,
) -> None:
    """Run the API and one local worker together.

    SQLite under DDPQ_DATA_DIR by default.
    """
    import logging

    with needs("up", "the API with a local worker", "server", "worker"):
        from service.config import TokenError
        from service.main import ApiServer, build
        from worker.edges.procs import make_undumpable
        from worker.starting.launcher import launcher_argv

    # It holds the API's tokens and database URL, and hands the worker its token.
    make_undumpable()
    os.umask(0o077)  # the SQLite database and the token files are its own alone

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings, api = build(host)
    except TokenError as exc:
        _fail(str(exc), EXIT_USAGE)
    server = ApiServer(api, host, port)
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    env = {
        **os.environ,
        "DDPQ_WORKER_TOKEN": api.state.worker_token,
        "DDPQ_DATA_DIR": str(settings.data_dir),
    }
    argv = [sys.executable, "-m", "ddpq.cli", "worker", "--url", url]
    argv += ["--workspace", str(workspace), "--name", "local"]
    for option, value in (("--cpu-slots", cpu_slots), ("--gpus", gpus), ("--job-uids", job_uids)):
        argv += [option, str(value)] if value is not None else []
    # The worker needs time to hand its jobs back before the supervisor gives up on it.
    local_worker = subprocess.Popen(launcher_argv(argv, grace_s=150), env=env)
    token_file = (settings.data_dir / "api-token").resolve()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    token_from = "DDPQ_API_TOKEN" if settings.api_token else str(token_file)
    logged_in = _log_in_locally(host, port, api.state.api_token, thread, stop, token_from)
    _say_up(url, settings.resolved_database_url, token_from, logged_in, token_file)
    while not stop.wait(0.5):
        if not thread.is_alive() or local_worker.poll() is not None:
            break
    # Stop the worker first so it can hand its jobs back while the API still answers.
    if local_worker.poll() is None:
        local_worker.send_signal(signal.SIGTERM)
        try:
            local_worker.wait(timeout=120)
        except subprocess.TimeoutExpired:
            local_worker.kill()
    server.stop()
    thread.join(timeout=30)
