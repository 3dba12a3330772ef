"""The ``ddpq`` command.

Exit codes: 0 success; 1 the API refused the request (4xx) or failed (5xx);
2 bad usage; 3 the API could not be reached. ``ddpq status``/``ddpq submit --wait``
exit 0 only when the job succeeded, 4 when it failed or was cancelled.
Every command that prints accepts ``--json`` for scripts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.table import Table

from ddpq import config
from ddpq.client import ApiError, Client, format_detail

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Run PyTorch DDP jobs on shared GPU machines."
)
out = Console()
err = Console(stderr=True)

EXIT_API = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_JOB_FAILED = 4

JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _client() -> Client:
    return Client()


def _call(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except ApiError as exc:
        if exc.status == 401:
            _fail(
                f"{format_detail(exc.detail)} (set DDPQ_TOKEN, or run where ./var/api-token is)",
                EXIT_API,
            )
        _fail(f"HTTP {exc.status}: {format_detail(exc.detail)}", EXIT_API)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the ddpq API at {config.api_url()}: {exc}", EXIT_UNREACHABLE)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _loss(job: dict[str, Any]) -> str:
    m = job.get("latest_metrics") or {}
    v = (m.get("values") or {}).get("loss")
    return "" if v is None else (f"{v:.4g}" if isinstance(v, float | int) else str(v))


# ---- servers ------------------------------------------------------------------------


@app.command()
def serve(
    host: Annotated[str, typer.Option(envvar="DDPQ_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="DDPQ_PORT")] = 8000,
    log_level: str = "info",
) -> None:
    """Run the API (applies database migrations first)."""
    from service.config import TokenError
    from service.main import serve as run_serve

    try:
        run_serve(host, port, log_level)
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
    log_level: str = "info",
) -> None:
    """Run a worker: claim jobs from the API and run them with torchrun."""
    import logging

    from worker.agent import Agent, default_cpu_slots

    token = config.worker_token()
    if not token:
        _fail(
            "no worker token: set DDPQ_WORKER_TOKEN (or DDPQ_DATA_DIR to the API's data dir)",
            EXIT_USAGE,
        )
    if not workspace.is_dir():
        _fail(f"--workspace {workspace} is not a directory", EXIT_USAGE)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the rest
    Agent(
        url=url,
        token=token,
        name=name,
        workspace=workspace,
        data_dir=data_dir,
        checkpoint_dir=checkpoint_dir,
        cpu_slots=cpu_slots if cpu_slots is not None else default_cpu_slots(),
        gpus=_parse_gpus(gpus),
        kill_grace_s=kill_grace_s,
    ).run()


@app.command()
def up(
    host: Annotated[str, typer.Option(envvar="DDPQ_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="DDPQ_PORT")] = 8000,
    workspace: Annotated[Path, typer.Option(help="directory entrypoint jobs run from")] = Path("."),
    cpu_slots: Annotated[int | None, typer.Option()] = None,
    gpus: Annotated[
        str | None, typer.Option(help="GPU indices, or none (default: all torch sees)")
    ] = None,
) -> None:
    """Run the API and one local worker together (SQLite under DDPQ_DATA_DIR by default)."""
    import logging

    from service.config import TokenError
    from service.main import ApiServer, build
    from worker.procs import launcher_argv

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
    # The worker needs time to hand its jobs back before the supervisor gives up on it.
    local_worker = subprocess.Popen(launcher_argv(argv, grace_s=150), env=env)
    token_file = (settings.data_dir / "api-token").resolve()
    out.print(
        f"\n[bold]ddpq is up[/bold] at {url}  (database: {settings.resolved_database_url})\n"
        f"  user token: {'DDPQ_API_TOKEN' if settings.api_token else token_file}"
        " (the CLI reads it from there)\n"
        f"  try:  ddpq submit --recipe toy-regression --world-size 2 && ddpq ls\n"
        f'  curl: curl -H "Authorization: Bearer $(cat {token_file})" {url}/jobs\n',
        highlight=False,
        soft_wrap=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
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


# ---- jobs ---------------------------------------------------------------------------


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--env takes KEY=VALUE, not {pair!r}", EXIT_USAGE)
        env[key] = value
    return env


@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    args: Annotated[
        list[str] | None, typer.Argument(help="arguments for the program, after --")
    ] = None,
    recipe: Annotated[str | None, typer.Option(help="a built-in recipe (ddpq recipes)")] = None,
    entrypoint: Annotated[
        str | None, typer.Option(help="a script in the worker's workspace")
    ] = None,
    world_size: Annotated[int, typer.Option(help="total ranks")] = 1,
    nnodes: int = 1,
    name: str | None = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    priority: int = 0,
    max_attempts: int = 3,
    max_restarts: int = 0,
    retry_on_error: Annotated[
        bool, typer.Option(help="retry exits 1..127 too (signals are always retried)")
    ] = False,
    timeout_s: int | None = None,
    env: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE for the ranks (repeatable)")
    ] = None,
    idempotency_key: str | None = None,
    wait: Annotated[
        bool, typer.Option(help="wait for the job to end; exit 4 unless it succeeded")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job: --recipe NAME or --entrypoint PATH, with --world-size N [-- ARGS...]."""
    if (recipe is None) == (entrypoint is None):
        _fail("give exactly one of --recipe and --entrypoint", EXIT_USAGE)
    spec: dict[str, Any] = {
        "world_size": world_size,
        "nnodes": nnodes,
        "device": device,
        "priority": priority,
        "max_attempts": max_attempts,
        "max_restarts": max_restarts,
        "retry_on_error": retry_on_error,
        "args": list(args or []),
        "env": _parse_env(env or []),
    }
    for key, value in (
        ("recipe", recipe),
        ("entrypoint", entrypoint),
        ("name", name),
        ("timeout_s", timeout_s),
    ):
        if value is not None:
            spec[key] = value
    with _client() as c:
        job = _call(c.submit, spec, idempotency_key)
        if wait:
            job = _call(c.wait, job["id"])
    if as_json:
        _print_json(job)
    else:
        what = recipe or entrypoint
        out.print(
            f"job {job['id']} {job['status']} ({what}, world size {world_size})", highlight=False
        )
        if job.get("reason"):
            out.print(f"  {job['reason']}", highlight=False)
    if wait and job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command()
def status(job_id: int, as_json: JsonOpt = False) -> None:
    """Show one job. Exits 0 unless it failed or was cancelled (4)."""
    with _client() as c:
        job = _call(c.job, job_id)
    if as_json:
        _print_json(job)
    else:
        fields = [
            ("id", job["id"]),
            ("name", job["name"] or ""),
            ("status", job["status"]),
            ("program", job["spec"].get("recipe") or job["spec"].get("entrypoint")),
            ("world size", job["spec"]["world_size"]),
            ("attempt", job["attempt"]),
            ("worker", job["worker"] or ""),
            ("gpus", ",".join(map(str, job["gpus"] or [])) or "-"),
            ("created", job["created_at"]),
            ("started", job["started_at"] or ""),
            ("finished", job["finished_at"] or ""),
            ("exit code", "" if job["exit_code"] is None else job["exit_code"]),
            ("reason", job["reason"] or ""),
            ("queue position", job["queue_position"] or ""),
        ]
        m = job.get("latest_metrics")
        if m:
            values = ", ".join(
                f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in m["values"].items()
            )
            fields.append(("latest", f"step {m['step']}: {values}"))
        if job.get("latest_checkpoint"):
            fields.append(("checkpoint", job["latest_checkpoint"]["path"]))
        for key, value in fields:
            if value != "":
                out.print(f"[bold]{key:>15}[/bold]  {value}", highlight=False)
    if job["status"] in ("failed", "cancelled"):
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command("ls")
def list_jobs(
    status: Annotated[str | None, typer.Option(help="comma-separated states")] = None,
    limit: int = 50,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first."""
    with _client() as c:
        page = _call(c.jobs, status, limit)
    if as_json:
        _print_json(page)
        return
    table = Table(box=None)
    for col in (
        "ID",
        "NAME",
        "STATUS",
        "PROGRAM",
        "RANKS",
        "ATTEMPT",
        "WORKER",
        "STEP",
        "LOSS",
        "REASON",
    ):
        table.add_column(col)
    for j in page["items"]:
        m = j.get("latest_metrics") or {}
        table.add_row(
            str(j["id"]),
            j["name"] or "",
            j["status"],
            j["spec"].get("recipe") or j["spec"].get("entrypoint") or "",
            str(j["spec"]["world_size"]),
            str(j["attempt"]),
            j["worker"] or "",
            str(m.get("step", "")),
            _loss(j),
            (j["reason"] or "")[:60],
        )
    out.print(table)


@app.command()
def cancel(job_id: int, as_json: JsonOpt = False) -> None:
    """Cancel a job."""
    with _client() as c:
        job = _call(c.cancel, job_id)
    if as_json:
        _print_json(job)
    else:
        out.print(f"job {job['id']} {job['status']}", highlight=False)


@app.command()
def logs(
    job_id: int,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream until the job ends")
    ] = False,
) -> None:
    """Print a job's combined output."""
    with _client() as c:
        if follow:

            def stream() -> None:
                # Inside _call, so an error mid-stream exits with its code too.
                for chunk in c.follow_logs(job_id):
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()

            _call(stream)
        else:
            data, _, _ = _call(c.logs, job_id)
            sys.stdout.buffer.write(data)


@app.command()
def workers(as_json: JsonOpt = False) -> None:
    """List workers: slots, free GPUs and CPU slots, running jobs, last heartbeat."""
    with _client() as c:
        items = _call(c.workers)
    if as_json:
        _print_json(items)
        return
    table = Table(box=None)
    for col in (
        "NAME",
        "HOST",
        "ALIVE",
        "GPUS",
        "FREE GPUS",
        "CPU SLOTS",
        "FREE CPU",
        "RUNNING",
        "HEARTBEAT",
    ):
        table.add_column(col)
    for w in items:
        table.add_row(
            w["name"],
            w["hostname"],
            "yes" if w["alive"] else "no",
            ",".join(map(str, w["gpus"])) or "-",
            ",".join(map(str, w["free_gpus"])) or "-",
            str(w["cpu_slots"]),
            str(w["free_cpu_slots"]),
            " ".join(
                f"{j['job_id']}" + (f"[{','.join(map(str, j['gpus']))}]" if j["gpus"] else "")
                for j in w["running"]
            ),
            w["last_heartbeat"],
        )
    out.print(table)


@app.command()
def recipes(as_json: JsonOpt = False) -> None:
    """List the built-in recipes."""
    with _client() as c:
        items = _call(c.recipes)
    if as_json:
        _print_json(items)
        return
    for r in items:
        out.print(f"[bold]{r['name']}[/bold]  {r['description']}", highlight=False)
        for a in r["args"]:
            rules = [a["type"]]
            if a.get("choices"):
                rules.append(f"one of {', '.join(a['choices'])}")
            rules += [f"{k} {a[k]}" for k in ("min", "max") if a.get(k) is not None]
            rules.append(f"default {a['default']!r}")
            out.print(f"    {a['name']} ({', '.join(rules)}): {a['help']}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
