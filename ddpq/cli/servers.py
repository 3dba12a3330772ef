"""The commands that start ddpq's processes: serve, worker, and up (both, supervised)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ddpq import config
from ddpq.cli.base import EXIT_USAGE, _fail, _failed, app, out
from ddpq.cli.extras import needs
from ddpq.errors import ApiRefused, SlurmError, WallsError


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
        from worker.procs import make_undumpable

    make_undumpable()  # its tokens and database URL stay out of reach of jobs on this host
    os.umask(0o077)  # what it writes (the SQLite database, token files) is its own alone

    try:
        run_serve(host, port, log_level, workers)
    except TokenError as exc:
        _fail(str(exc), EXIT_USAGE)


def _parse_gpus(gpus: str | None) -> list[int]:
    if gpus is None:
        from worker.agent import detect_gpus

        return detect_gpus()
    if gpus.strip().lower() in ("none", ""):
        return []
    try:
        return sorted({int(g) for g in gpus.split(",")})
    except ValueError:
        _fail(f"--gpus takes 'none' or a list like 0,1,2,3, not {gpus!r}", EXIT_USAGE)


@app.command()
def worker(
    url: Annotated[str, typer.Option(envvar="DDPQ_URL", help="the API's URL")] = config.DEFAULT_URL,
    workspace: Annotated[Path, typer.Option(help="directory entrypoint jobs run from")] = Path("."),
    cpu_slots: Annotated[
        int | None, typer.Option(help="CPU ranks at once (default: cores)")
    ] = None,
    gpus: Annotated[
        str | None, typer.Option(help="GPU indices like 0,1,2,3, or none (default: all torch sees)")
    ] = None,
    name: Annotated[str | None, typer.Option(help="worker name (default: host name)")] = None,
    data_dir: Annotated[Path, typer.Option(envvar="DDPQ_DATA_DIR")] = Path("./var"),
    checkpoint_dir: Annotated[
        Path | None, typer.Option(help="default: DATA_DIR/checkpoints")
    ] = None,
    kill_grace_s: Annotated[float, typer.Option(help="SIGTERM to SIGKILL on cancel")] = 10.0,
    advertise_addr: Annotated[
        str | None,
        typer.Option(
            envvar="DDPQ_ADVERTISE_ADDR",
            help="address the other workers reach this host at, for multi-node jobs "
            "(default: what the host name resolves to, else 127.0.0.1)",
        ),
    ] = None,
    rdzv_ports: Annotated[
        str,
        typer.Option(
            envvar="DDPQ_RDZV_PORTS",
            help="ports (FIRST-LAST) a multi-node job's rendezvous may use on this host "
            "when it is node 0; open them between workers",
        ),
    ] = "29400-29499",
    code_cache_gb: Annotated[
        float, typer.Option(help="cap of the cache of jobs' code contents, in GB")
    ] = 10.0,
    cache_gb: Annotated[
        float,
        typer.Option(
            envvar="DDPQ_CACHE_GB",
            help="cap of each user's caches kept across their jobs on this worker (inductor, "
            "Triton, Hugging Face, torch hub, matplotlib), in GB: the least recently used "
            "files go as an attempt ends; 0 keeps none",
        ),
    ] = config.DEFAULT_CACHE_GB,
    keep_workdirs_s: Annotated[
        float,
        typer.Option(
            help="keep a job's directory this long past the API's retention for it "
            "(DDPQ_WORKDIR_RETENTION; debugging)"
        ),
    ] = 0.0,
    max_envs: Annotated[
        int, typer.Option(help="environments kept for jobs' Python requirements")
    ] = 8,
    executor: Annotated[
        str,
        typer.Option(
            help="local: run jobs on this host; slurm: a bridge that hands each job to Slurm"
        ),
    ] = "local",
    partition: Annotated[
        str | None, typer.Option(help="slurm: the partition jobs go to (required)")
    ] = None,
    account: Annotated[str | None, typer.Option(help="slurm: sbatch --account")] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(help="slurm: an argument passed to sbatch as is (repeat for several)"),
    ] = None,
    max_pending: Annotated[
        int, typer.Option(help="slurm: jobs the bridge lets wait in Slurm at once")
    ] = 2,
    poll_s: Annotated[float, typer.Option(help="slurm: how often squeue is asked")] = 2.0,
    job_uids: Annotated[
        str,
        typer.Option(
            envvar="DDPQ_JOB_UIDS",
            help="run each job under a uid of its own from FIRST-LAST (walls between jobs; "
            "needs root or the capabilities docs/security.md names); auto: 70000-70999 when "
            "the worker may, else its own user; off: the worker's own user",
        ),
    ] = "auto",
    pip_allow: Annotated[
        list[str] | None,
        typer.Option(
            help="what else jobs' requirements may hold besides names with versions and "
            "files of their code: url, option or path-outside (repeat for several)"
        ),
    ] = None,
    launcher: Annotated[
        str,
        typer.Option(
            envvar="DDPQ_LAUNCHER",
            help="how jobs whose spec names no launcher start: warm (forked from a process "
            "with torch imported: seconds faster) or torchrun (a cold torchrun per attempt)",
        ),
    ] = "warm",  # worker.warm.DEFAULT_LAUNCHER (not imported: the CLI loads without the worker)
    trace: Annotated[
        Path | None,
        typer.Option(
            help="append one JSON line per attempt to this file: when it reached each phase "
            "(claimed, prepared, spawned, first line, exited, reported; bench/overhead.py "
            "--trace reads it)"
        ),
    ] = None,
    log_level: str = "info",
) -> None:
    """Run a worker on this host, or a bridge to a Slurm partition.

    A worker claims jobs from the API and runs them with torchrun. With --executor
    slurm, it hands each job to Slurm as one batch job instead (run it on a login
    node; the compute nodes need this Python with ddpq and must reach the API).
    """
    import logging

    with needs("worker", "a worker", "worker"):
        from worker import datadir
        from worker.agent import Agent, default_cpu_slots
        from worker.procs import make_undumpable
        from worker.requirements import Policy
        from worker.walls import Walls

    make_undumpable()  # before the token is read: jobs run as this user

    token = config.worker_token()
    if not token:
        _fail(
            "no worker token: set DDPQ_WORKER_TOKEN (or DDPQ_DATA_DIR to the API's data dir)",
            EXIT_USAGE,
        )
    if not workspace.is_dir():
        _fail(f"--workspace {workspace} is not a directory", EXIT_USAGE)
    if not 0 <= cache_gb < 1e9:
        _fail(f"--cache-gb takes a size in GB from 0 (no caches), not {cache_gb}", EXIT_USAGE)
    first, _, last = rdzv_ports.partition("-")
    try:
        ports = (int(first), int(last or first))
    except ValueError:
        ports = (0, -1)
    if not 1 <= ports[0] <= ports[1] <= 65535:
        _fail(f"--rdzv-ports takes FIRST-LAST within 1-65535, not {rdzv_ports!r}", EXIT_USAGE)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the rest
    try:
        pip_policy = Policy.parse(pip_allow or [])
    except ValueError as exc:
        _fail(f"--pip-allow: {exc}", EXIT_USAGE)
    identity = datadir.hold(data_dir)  # DataDirBusy: another worker's (exit 2)
    common: dict[str, Any] = {
        "url": url, "token": token, "name": name, "workspace": workspace,
        "data_dir": data_dir, "checkpoint_dir": checkpoint_dir, "identity": identity,
        "code_cache_bytes": int(code_cache_gb * 1000**3), "max_envs": max(1, max_envs),
        "pip_policy": pip_policy, "cache_bytes": int(cache_gb * 1000**3),
    }  # fmt: skip
    if launcher not in ("torchrun", "warm"):
        _fail(f"--launcher takes torchrun or warm, not {launcher!r}", EXIT_USAGE)
    if executor == "slurm":
        if not partition:
            _fail("--executor slurm needs --partition", EXIT_USAGE)
        _run_bridge(
            common,
            partition,
            account,
            tuple(sbatch_arg or ()),
            max(1, max_pending),
            poll_s,
            launcher,
        )
        return
    if executor != "local":
        _fail(f"--executor takes local or slurm, not {executor!r}", EXIT_USAGE)
    try:
        walls = Walls.configure(job_uids)  # WallsError: cannot wall as asked (exit 2)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    agent = Agent(
        **common,
        cpu_slots=cpu_slots if cpu_slots is not None else default_cpu_slots(),
        gpus=_parse_gpus(gpus),
        kill_grace_s=kill_grace_s,
        advertise_addr=advertise_addr,
        rdzv_ports=ports,
        keep_workdirs_s=keep_workdirs_s,
        walls=walls,
        launcher=launcher,
        trace_file=trace.resolve() if trace else None,
    )
    try:
        agent.run()
    except ApiRefused as exc:  # a live worker holds this name (409), or a bad token
        _failed(exc, f"the API refused this worker: {exc}")
    except WallsError as exc:
        _failed(exc, f"cannot wall jobs: {exc}")


def _run_bridge(
    common: dict[str, Any],
    partition: str,
    account: str | None,
    sbatch_args: tuple[str, ...],
    max_pending: int,
    poll_s: float,
    launcher: str = "warm",
) -> None:
    """Run a Slurm bridge, or exit with why the partition or the API refuse it."""
    from worker.bridge import Bridge

    bridge = Bridge(
        **common,
        partition=partition,
        account=account,
        sbatch_args=sbatch_args,
        max_pending=max_pending,
        poll_s=max(0.2, poll_s),
        launcher=launcher,
    )
    try:
        bridge.shape()
    except SlurmError as exc:  # sinfo failed, or names no node of the partition
        _failed(exc, f"Slurm partition {partition}: {exc}")
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


@app.command()
def up(
    host: Annotated[str, typer.Option(envvar="DDPQ_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="DDPQ_PORT")] = 8000,
    workspace: Annotated[Path, typer.Option(help="directory entrypoint jobs run from")] = Path("."),
    cpu_slots: Annotated[int | None, typer.Option()] = None,
    gpus: Annotated[
        str | None, typer.Option(help="GPU indices, or none (default: all torch sees)")
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
        from worker.procs import launcher_argv, make_undumpable

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
    argv = [
        sys.executable,
        "-m",
        "ddpq.cli",
        "worker",
        "--url",
        url,
        "--workspace",
        str(workspace),
        "--name",
        "local",
    ]
    if cpu_slots is not None:
        argv += ["--cpu-slots", str(cpu_slots)]
    if gpus is not None:
        argv += ["--gpus", gpus]
    if job_uids is not None:
        argv += ["--job-uids", job_uids]
    # The worker needs time to hand its jobs back before the supervisor gives up on it.
    local_worker = subprocess.Popen(launcher_argv(argv, grace_s=150), env=env)
    token_file = (settings.data_dir / "api-token").resolve()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    token_from = "DDPQ_API_TOKEN" if settings.api_token else str(token_file)
    logged_in = _log_in_locally(host, port, api.state.api_token, thread, stop, token_from)
    out.print(
        f"\n[bold]ddpq is up[/bold] at {url}  (database: {settings.resolved_database_url})\n"
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
