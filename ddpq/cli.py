"""The ``ddpq`` command.

Exit codes (EXIT_CODES below is the one table; ``ddpq --help`` prints it): 0 ok;
1 the API refused the request (4xx) or failed (5xx); 2 bad usage; 3 the API could
not be reached; 4 the job failed or was cancelled (``watch``, ``status``,
``submit --wait``); 130 interrupted. Every command that prints accepts ``--json``.
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import httpx
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpq import config
from ddpq.client import TERMINAL, ApiError, Client, format_detail, marker_resume
from ddpq.rules import visible

EXIT_OK = 0
EXIT_API = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_JOB_FAILED = 4
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "ok (watch, status, submit --wait: the job succeeded)",
    EXIT_API: "the API refused the request or failed (4xx/5xx), with its reason",
    EXIT_USAGE: "bad usage: a flag, or a spec file that is not YAML/JSON",
    EXIT_UNREACHABLE: "the API could not be reached (DDPQ_URL)",
    EXIT_JOB_FAILED: "the job failed or was cancelled (watch, status, submit --wait)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run PyTorch DDP jobs on shared GPU machines.",
    epilog="Exit codes:\n" + "\n".join(f"{code:>5}  {what}" for code, what in EXIT_CODES.items()),
    # An error is a sentence with the API's detail, never a traceback with locals.
    pretty_exceptions_show_locals=False,
)
out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
F = TypeVar("F", bound=Callable[..., Any])


def _text(value: Any, style: str = "") -> Text:
    """What the API sent, as a terminal may show it: never read as markup (a job's name
    may hold "[red]"), and every control or format character escaped (ddpq.rules.visible),
    so that a name or a program's error line copied into a reason can neither retitle,
    clear or rewrite the terminal nor reorder what follows it. Every human-readable
    output of the API's data goes through here; --json needs nothing (json.dumps
    escapes them)."""
    return Text(visible(str(value)), style=style)


def _say(*parts: Text | str) -> None:
    """One line of output, whole (piped into grep, a line is better uncut); plain
    strings among ``parts`` are data (see _text)."""
    line = Text()
    for part in parts:
        line.append(part if isinstance(part, Text) else _text(part))
    out.print(line, highlight=False, soft_wrap=True)


def _fail(message: str, code: int) -> NoReturn:
    # The message may quote the API's words: brackets ("one of [a, b]"), escapes.
    err.print(Text("error: ", style="red") + _text(message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _client_command(fn: F) -> F:
    """Ctrl-C exits 130 (click would say 'Aborted!' and exit 1); a closed pipe
    (``ddpq logs 3 | head``) ends quietly."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except KeyboardInterrupt:
            err.print("interrupted", highlight=False)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            # Python would complain again when it flushes stdout at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(EXIT_OK) from None

    return wrapper  # type: ignore[return-value]


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
    except json.JSONDecodeError:
        _fail(f"{config.api_url()} answered something that is not the ddpq API's JSON", EXIT_API)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _print_json_line(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _table_width() -> int:
    # Piped into grep or a file, a row is better whole than cut at 80 columns.
    return out.width if out.is_terminal else 250


def _print_table(table: Table) -> None:
    (out if out.is_terminal else Console(width=_table_width())).print(table)


def _fit_table(headers: list[str], rows: list[list[str]], caps: dict[str, int]) -> Table:
    """A table whose last column takes what the others leave of the width: Rich, short
    of room, would rather squeeze the short columns (ID, STATUS) than cut the long one."""
    rows = [[visible(cell) for cell in row] for row in rows]  # as shown: escapes widen it
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    widths = [min(w, caps.get(h, w)) for w, h in zip(widths, headers, strict=True)]
    # Still too wide: the capped (free-text) columns give up room, widest first.
    free = [i for i, h in enumerate(headers[:-1]) if h in caps]
    rest = _table_width() - sum(widths[:-1]) - 2 * len(headers)
    while rest < 12 and free:
        widest = max(free, key=lambda i: widths[i])
        if widths[widest] <= 6:
            break
        widths[widest] -= 1
        rest += 1
    table = Table(box=None)
    for h, w in zip(headers[:-1], widths, strict=False):
        table.add_column(
            h,
            no_wrap=True,
            overflow="ellipsis",
            max_width=w,
            min_width=w,
            justify="right" if h in ("ID", "STEP") else "left",
        )
    table.add_column(headers[-1], no_wrap=True, overflow="ellipsis", max_width=max(rest, 8))
    for row in rows:
        table.add_row(*(_text(cell, style=CELL_STYLE.get(cell, "")) for cell in row))
    return table


def _parse_time(value: str) -> datetime:
    t = datetime.fromisoformat(value)
    return t if t.tzinfo else t.replace(tzinfo=UTC)  # the API's times are UTC


def _age(value: str | None) -> str:
    """'42s', '7m', '3h', '2d': how long ago ``value`` (an ISO time) was."""
    if not value:
        return ""
    seconds = max(0.0, (datetime.now(UTC) - _parse_time(value)).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


STATUS_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "cancelling": "magenta",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "dim",
}
# Cells are coloured by their whole text: states, and a worker's ALIVE.
CELL_STYLE = {**STATUS_STYLE, "alive": "green", "lost": "red"}


def _program(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    return str(spec.get("recipe") or spec.get("entrypoint") or "")


def _waiting(job: dict[str, Any]) -> str:
    """The reason, with the queue position while queued."""
    reason = job.get("reason") or ""
    if job["status"] == "queued" and job.get("queue_position"):
        return f"#{job['queue_position']} in queue" + (f": {reason}" if reason else "")
    return reason


def _number(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1e5 else f"{v:.4g}"
    return str(v)


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
    from worker.procs import make_undumpable

    make_undumpable()  # its tokens and database URL stay out of reach of jobs on this host

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
    log_level: str = "info",
) -> None:
    """Run a worker: claim jobs from the API and run them with torchrun."""
    import logging

    from worker import datadir
    from worker.agent import Agent, default_cpu_slots
    from worker.api import Refused
    from worker.procs import make_undumpable

    make_undumpable()  # before the token is read: jobs run as this user

    token = config.worker_token()
    if not token:
        _fail(
            "no worker token: set DDPQ_WORKER_TOKEN (or DDPQ_DATA_DIR to the API's data dir)",
            EXIT_USAGE,
        )
    if not workspace.is_dir():
        _fail(f"--workspace {workspace} is not a directory", EXIT_USAGE)
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
        identity = datadir.hold(data_dir)
    except datadir.DataDirBusy as exc:
        _fail(str(exc), EXIT_USAGE)
    agent = Agent(
        url=url,
        token=token,
        name=name,
        workspace=workspace,
        data_dir=data_dir,
        checkpoint_dir=checkpoint_dir,
        cpu_slots=cpu_slots if cpu_slots is not None else default_cpu_slots(),
        gpus=_parse_gpus(gpus),
        kill_grace_s=kill_grace_s,
        advertise_addr=advertise_addr,
        rdzv_ports=ports,
        identity=identity,
    )
    try:
        agent.run()
    except Refused as exc:  # a live worker holds this name (409), or a bad token
        _fail(f"the API refused this worker: {exc}", EXIT_USAGE)


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
        f"  dashboard: {url}/  (asks for that token once)\n"
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


def _read_spec_file(path: str) -> dict[str, Any]:
    """A job spec from a YAML or JSON file (``-``: stdin); exit 2 when it does not parse."""
    import yaml

    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        _fail(
            f"cannot read the spec file {where}: {getattr(exc, 'strerror', None) or exc}",
            EXIT_USAGE,
        )
    try:
        # JSON is (nearly) YAML, but JSON's own parser gives JSON's line and column.
        is_json = path.endswith(".json") or (path == "-" and text.lstrip().startswith("{"))
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        _fail(
            f"{where} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            EXIT_USAGE,
        )
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        _fail(f"{where} is not valid YAML: {getattr(exc, 'problem', None) or exc}{at}", EXIT_USAGE)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(
            f"{where}: a job spec is a mapping of fields (recipe, world_size, args, ...),"
            f" not a {type(data).__name__}",
            EXIT_USAGE,
        )
    # argv and environment values are strings; YAML reads `--epochs, 20` as a number.
    for key in ("args", "env"):
        value = data.get(key)
        if isinstance(value, list):
            data[key] = [_scalar_text(v) for v in value]
        elif isinstance(value, dict):
            data[key] = {k: _scalar_text(v) for k, v in value.items()}
    return data


def _scalar_text(v: Any) -> Any:
    # Only plain numbers: a bool or a list stays as it is for the API to refuse by name.
    return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


@app.command(context_settings={"allow_interspersed_args": False})
@_client_command
def submit(
    args: Annotated[
        list[str] | None, typer.Argument(help="arguments for the program, after --")
    ] = None,
    file: Annotated[
        str | None,
        typer.Option(
            "--file", "-f", help="a job spec in YAML or JSON (- for stdin); flags override it"
        ),
    ] = None,
    recipe: Annotated[str | None, typer.Option(help="a built-in recipe (ddpq recipes)")] = None,
    entrypoint: Annotated[
        str | None, typer.Option(help="a script in the worker's workspace")
    ] = None,
    world_size: Annotated[int | None, typer.Option(help="total ranks (default 1)")] = None,
    nnodes: Annotated[int | None, typer.Option(help="nodes (default 1)")] = None,
    name: str | None = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda (default auto)")] = None,
    priority: Annotated[int | None, typer.Option(help="higher first (default 0)")] = None,
    max_attempts: Annotated[int | None, typer.Option(help="(default 3)")] = None,
    max_restarts: Annotated[int | None, typer.Option(help="(default 0)")] = None,
    retry_on_error: Annotated[
        bool | None,
        typer.Option(
            "--retry-on-error/--no-retry-on-error",
            help="retry exits 1..127 too (signals are always retried) (default no)",
            show_default=False,
        ),
    ] = None,
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
    """Submit a job: --recipe NAME or --entrypoint PATH [-- ARGS...], or -f job.yaml.

    The spec file (YAML or JSON, - for stdin) holds the fields of POST /jobs.

    Flags given too override its fields; --env adds to its env.
    """
    if recipe is not None and entrypoint is not None:
        _fail("give exactly one of --recipe and --entrypoint", EXIT_USAGE)
    spec: dict[str, Any] = _read_spec_file(file) if file is not None else {}
    # A program given on the command line replaces the file's, whichever kind it is.
    if recipe is not None:
        spec.pop("entrypoint", None)
    if entrypoint is not None:
        spec.pop("recipe", None)
    flags = {
        "recipe": recipe,
        "entrypoint": entrypoint,
        "name": name,
        "world_size": world_size,
        "nnodes": nnodes,
        "device": device,
        "priority": priority,
        "max_attempts": max_attempts,
        "max_restarts": max_restarts,
        "retry_on_error": retry_on_error,
        "timeout_s": timeout_s,
    }
    spec.update({k: v for k, v in flags.items() if v is not None})
    if args:
        spec["args"] = list(args)
    if env:
        file_env = spec.get("env")
        spec["env"] = {**(file_env if isinstance(file_env, dict) else {}), **_parse_env(env)}
    if spec.get("recipe") is None and spec.get("entrypoint") is None:
        _fail(
            "give exactly one of --recipe and --entrypoint (or recipe/entrypoint in -f FILE)",
            EXIT_USAGE,
        )
    with _client() as c:
        job = _call(c.submit, spec, idempotency_key)
        if wait:
            job = _call(c.wait, job["id"])
    if as_json:
        _print_json(job)
    else:
        _say(
            f"job {job['id']} {job['status']} ({_program(job)},"
            f" world size {job['spec']['world_size']})"
        )
        if job.get("reason"):
            _say(f"  {job['reason']}")
    if wait and job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command()
@_client_command
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
            ("program", _program(job)),
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
        if job.get("metrics_dropped"):
            fields.append(("metrics lost", f"{job['metrics_dropped']} points never stored"))
        for key, value in fields:
            if value != "":
                _say(Text(f"{key:>15}", style="bold"), f"  {value}")
    if job["status"] in ("failed", "cancelled"):
        raise typer.Exit(EXIT_JOB_FAILED)


FILTERED_PAGE = 50  # jobs per request while filtering by name here


def _find_jobs(
    c: Client, statuses: list[str], name: str | None, limit: int, cursor: str | None = None
) -> tuple[list[dict[str, Any]], str | None]:
    """Up to ``limit`` jobs, newest first, following next_cursor; the API has no name
    filter, so that one is applied here, page by page."""
    needle = name.lower() if name else None
    found: list[dict[str, Any]] = []
    while True:
        # Without a name filter every job counts: ask for no more than is missing.
        size = FILTERED_PAGE if needle else min(500, limit - len(found))
        page = c.jobs(statuses, size, cursor)
        for i, j in enumerate(page["items"]):
            if needle and needle not in f"{j['name'] or ''} {_program(j)}".lower():
                continue
            found.append(j)
            if len(found) == limit:
                more = i < len(page["items"]) - 1 or page["next_cursor"] is not None
                return found, str(j["id"]) if more else None  # the API's cursor: an id
        cursor = page["next_cursor"]
        if cursor is None:
            return found, None


@app.command("ls")
@_client_command
def list_jobs(
    status: Annotated[
        list[str] | None,
        typer.Option("--status", "-s", help="only these states (repeatable, or comma-separated)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="only jobs whose name or program contains this")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many jobs")] = 50,
    cursor: Annotated[
        str | None, typer.Option(help="continue after this (next_cursor of --json)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first (--json: {"items": [Job], "next_cursor"})."""
    statuses = [x.strip() for s in status or [] for x in s.split(",") if x.strip()]
    with _client() as c:
        items, next_cursor = _call(_find_jobs, c, statuses, name, limit, cursor)
    if as_json:
        _print_json({"items": items, "next_cursor": next_cursor})
        return
    rows = []
    for j in items:
        m = j.get("latest_metrics") or {}
        rows.append(
            [
                str(j["id"]),
                j["name"] or "",
                _program(j),
                j["status"],
                f"{j['attempt']}/{j['spec'].get('max_attempts', '?')}",
                j["worker"] or "",
                str(m.get("step", "")),
                _loss(j),
                _age(j["created_at"]),
                _waiting(j),
            ]
        )
    headers = ["ID", "NAME", "PROGRAM", "STATUS", "ATTEMPT", "WORKER", "STEP", "LOSS", "AGE"]
    table = _fit_table([*headers, "REASON"], rows, caps={"NAME": 24, "PROGRAM": 20, "WORKER": 16})
    _print_table(table)
    if next_cursor:
        _say(_text(f"more: --cursor {next_cursor}", style="dim"))


@app.command()
@_client_command
def cancel(job_id: int, as_json: JsonOpt = False) -> None:
    """Cancel a job."""
    with _client() as c:
        job = _call(c.cancel, job_id)
    if as_json:
        _print_json(job)
    else:
        _say(f"job {job['id']} {job['status']}")


def _stored_log(c: Client, job_id: int, offset: int) -> Iterator[tuple[int, bytes]]:
    """What is stored from ``offset`` now; the API answers it in pieces of bounded size."""
    while True:
        data, next_offset, _ = c.logs(job_id, offset)
        if not data:
            return
        yield offset, data
        # Not offset + len(data): a cut marker in the answer counts for no offset.
        offset = next_offset


def _log_lines(chunks: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    """Whole lines (without the newline) and the byte offset each starts at; chunks
    may cut a line, or a UTF-8 character, anywhere."""
    pending = b""
    start = 0
    for offset, chunk in chunks:
        if not pending:
            start = offset
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield start, line
            # After a cut marker the output goes on at the offset it names.
            resume = marker_resume(line)
            start = resume if resume is not None else start + len(line) + 1
    if pending:
        yield start, pending


@app.command()
@_client_command
def logs(
    job_id: int,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream until the job ends")
    ] = False,
    offset: Annotated[int, typer.Option(min=0, help="start at this byte of the log")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help='JSON lines: {"offset": byte, "text": line}')
    ] = False,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="the bytes as the program wrote them, terminal escape sequences and "
            "carriage returns included (a progress bar redraws itself)",
        ),
    ] = False,
) -> None:
    """Print a job's combined output; -f follows it until the job ends.

    Control characters other than newline and tab are shown escaped (ESC as \\x1b)
    unless --raw: a program's output must not drive the terminal of whoever reads it.
    """
    with _client() as c:

        def show() -> None:
            # Inside _call, so an error mid-stream exits with its code too.
            chunks = c.follow_logs(job_id, offset) if follow else _stored_log(c, job_id, offset)
            if as_json:
                for at, line in _log_lines(chunks):
                    _print_json_line({"offset": at, "text": line.decode("utf-8", "replace")})
            elif raw:
                for _, chunk in chunks:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
            else:
                # A chunk may end inside a UTF-8 character; bytes that are not UTF-8
                # show as \xNN too. A carriage return is escaped as well: it would let a
                # line overwrite its own [rankN] prefix with, say, a forged [ddpq] line.
                decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
                for _, chunk in chunks:
                    sys.stdout.buffer.write(visible(decoder.decode(chunk), keep="\n\t").encode())
                    sys.stdout.flush()
                rest = decoder.decode(b"", final=True)
                sys.stdout.buffer.write(visible(rest, keep="\n\t").encode())

        _call(show)


@app.command()
@_client_command
def workers(as_json: JsonOpt = False) -> None:
    """List workers: CPU slots and GPUs (free of all), running jobs, last heartbeat."""
    with _client() as c:
        items = _call(c.workers)
    if as_json:
        _print_json(items)
        return
    rows = [
        [
            w["name"],
            w["hostname"],
            "alive" if w["alive"] else "lost",
            f"{w['free_cpu_slots']}/{w['cpu_slots']}",
            ",".join(map(str, w["gpus"])) or "-",
            ",".join(map(str, w["free_gpus"])) or "-",
            f"{_age(w['last_heartbeat'])} ago",
            " ".join(
                f"{j['job_id']}" + (f"[gpus {','.join(map(str, j['gpus']))}]" if j["gpus"] else "")
                for j in w["running"]
            )
            or "-",
        ]
        for w in items
    ]
    headers = ["NAME", "HOST", "STATE", "CPU FREE", "GPUS", "GPUS FREE", "HEARTBEAT", "RUNNING"]
    table = _fit_table(headers, rows, caps={"NAME": 24, "HOST": 24, "GPUS": 24})
    _print_table(table)


# ---- watch ----------------------------------------------------------------------------

SPARK = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60


def _finite(values: Iterable[Any]) -> list[float]:
    """The numbers among ``values``, without NaN and infinities (a diverged loss)."""
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def sparkline(values: Iterable[Any]) -> str:
    """One block per finite value, scaled between the values' min and max."""
    finite = _finite(values)
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    top = len(SPARK) - 1
    if hi == lo:
        return SPARK[top // 2] * len(finite)
    return "".join(SPARK[min(top, int((v - lo) / (hi - lo) * len(SPARK)))] for v in finite)


class _Watched:
    """What ``ddpq watch`` knows of a job: the Job, the last loss points, the total steps."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.job: dict[str, Any] = {}
        self.losses: deque[Any] = deque(maxlen=SPARK_POINTS)
        self.total_steps: int | None = None
        self._attempt: int | None = None
        self._fetched_step = -1  # metric points up to this step are in ``losses``
        self._latest_step: int | None = None

    def poll(self, c: Client) -> None:
        job = c.job(self.job_id)
        if self._attempt is not None and job["attempt"] != self._attempt:
            # A new attempt reports again from its checkpoint's step, over the old points.
            self.losses.clear()
            self._fetched_step = -1
            self._latest_step = None
        self._attempt = job["attempt"]
        latest = job.get("latest_metrics") or {}
        step = latest.get("step")
        if step is not None and step != self._latest_step:
            # since_step includes its step: ask only for the points not seen yet.
            for p in c.metrics(
                self.job_id, name=["loss", "total_steps"], since_step=self._fetched_step + 1
            ):
                self._take(p["values"])
                self._fetched_step = max(self._fetched_step, p["step"])
            self._latest_step = step
        # The latest step's total, should its points not have been fetched (same step).
        self._take({"total_steps": (latest.get("values") or {}).get("total_steps")})
        self.job = job

    def _take(self, values: dict[str, Any]) -> None:
        if "loss" in values:
            self.losses.append(values["loss"])
        total = values.get("total_steps")
        if isinstance(total, int | float) and total > 0:
            self.total_steps = int(total)

    @property
    def step(self) -> int | None:
        step = (self.job.get("latest_metrics") or {}).get("step")
        return step if isinstance(step, int) else None

    def snapshot(self) -> dict[str, Any]:
        """The --json object: stable keys, one object per change."""
        j = self.job
        latest = j.get("latest_metrics") or {}
        return {
            "id": j["id"],
            "name": j["name"],
            "status": j["status"],
            "attempt": j["attempt"],
            "max_attempts": j["spec"].get("max_attempts"),
            "worker": j["worker"],
            "gpus": j["gpus"],
            "reason": j["reason"],
            "queue_position": j["queue_position"],
            "exit_code": j["exit_code"],
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": latest.get("epoch"),
            "metrics": {k: v for k, v in (latest.get("values") or {}).items()},
        }

    def progress(self) -> str:
        if self.total_steps is None:
            return ""
        done = min(self.step or 0, self.total_steps)
        return f"step {done}/{self.total_steps} ({100 * done / self.total_steps:.0f}%)"

    def metrics_text(self) -> str:
        values = (self.job.get("latest_metrics") or {}).get("values") or {}
        return "  ".join(f"{k} {_number(v)}" for k, v in values.items() if k != "total_steps")

    def line(self) -> str:
        """One plain line (stdout is not a terminal)."""
        j = self.job
        parts = [f"job {j['id']} {j['status']}", f"attempt {j['attempt']}"]
        if j["worker"]:
            parts.append(f"worker {j['worker']}")
        if j["gpus"]:
            parts.append(f"gpus {','.join(map(str, j['gpus']))}")
        if j["status"] in TERMINAL and j["exit_code"] is not None:
            parts.append(f"exit code {j['exit_code']}")
        if progress := self.progress():
            parts.append(progress)
        elif self.step is not None:
            parts.append(f"step {self.step}")
        if self.losses:
            last = self.losses[-1]
            parts.append(f"loss {_number(last)} {sparkline(self.losses)}")
        if waiting := _waiting(j):
            parts.append(waiting)
        return visible(" | ".join(parts))

    def render(self) -> Any:
        from rich.progress_bar import ProgressBar

        j = self.job
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", justify="right")
        grid.add_column()
        title = f"{j['id']}  " + (f"{j['name']}  " if j["name"] else "")
        title += f"{_program(j)}, world size {j['spec']['world_size']}"
        grid.add_row("job", _text(title))
        state = _text(j["status"], style=STATUS_STYLE.get(j["status"], ""))
        state.append(f"   attempt {j['attempt']}/{j['spec'].get('max_attempts', '?')}")
        if j["status"] in TERMINAL and j["exit_code"] is not None:
            state.append(f"   exit code {j['exit_code']}")
        grid.add_row("status", state)
        if j["worker"]:
            gpus = ",".join(map(str, j["gpus"] or [])) or "none"
            grid.add_row("worker", _text(f"{j['worker']}   gpus {gpus}"))
        if waiting := _waiting(j):
            grid.add_row("reason", _text(waiting))
        if self.total_steps is not None:
            done = min(self.step or 0, self.total_steps)
            bar = Table.grid(padding=(0, 2))
            bar.add_row(
                ProgressBar(
                    total=self.total_steps,
                    completed=done,
                    width=40,
                    complete_style="cyan",
                    finished_style="green",
                ),
                Text(self.progress()),
            )
            grid.add_row("progress", bar)
        elif self.step is not None:
            grid.add_row("step", Text(str(self.step)))
        if metrics := self.metrics_text():
            grid.add_row("metrics", _text(metrics))
        if self.losses:
            finite = _finite(self.losses)
            span = f"  ({_number(min(finite))} .. {_number(max(finite))})" if finite else ""
            grid.add_row(
                "loss", Text(sparkline(self.losses), style="cyan").append(span, style="dim")
            )
        return grid


@app.command()
@_client_command
def watch(
    job_id: int,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between polls")] = 1.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="one JSON object per line, at every change")
    ] = False,
) -> None:
    """Follow a job live: status, progress, metrics, loss; exits 0 or 4 as the job ends.

    Status, attempt, worker, GPUs, why it waits, latest metrics, a loss sparkline.

    A progress bar when the program reports total_steps (the recipes do).

    When stdout is not a terminal: one line at each change (--json: one object).
    """
    from rich.live import Live

    watched = _Watched(job_id)
    with _client() as c:

        def polls() -> Iterator[None]:
            """Poll until the job ends; yields after each poll."""
            while True:
                watched.poll(c)
                yield
                if watched.job["status"] in TERMINAL:
                    return
                time.sleep(interval)

        def run() -> None:
            if as_json or not out.is_terminal:
                last: Any = None
                for _ in polls():
                    now: Any = watched.snapshot() if as_json else watched.line()
                    if now != last:
                        if as_json:
                            _print_json_line(now)
                        else:
                            sys.stdout.write(f"{now}\n")
                            sys.stdout.flush()
                        last = now
                return
            with Live(console=out, auto_refresh=False, transient=False) as live:
                for _ in polls():
                    live.update(watched.render(), refresh=True)

        _call(run)
    if watched.job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command()
@_client_command
def recipes(as_json: JsonOpt = False) -> None:
    """List the built-in recipes."""
    with _client() as c:
        items = _call(c.recipes)
    if as_json:
        _print_json(items)
        return
    for r in items:
        _say(_text(r["name"], style="bold"), f"  {r['description']}")
        for a in r["args"]:
            rules = [a["type"]]
            if a.get("choices"):
                rules.append(f"one of {', '.join(a['choices'])}")
            rules += [f"{k} {a[k]}" for k in ("min", "max") if a.get(k) is not None]
            rules.append(f"default {a['default']!r}")
            _say(f"    {a['name']} ({', '.join(rules)}): {a['help']}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
