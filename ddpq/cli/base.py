"""What every ddpq command shares: the app, exit codes (and ddpq.errors' map to them),
how an error is told, output."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, NoReturn, TypeVar, cast

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpq import config
from ddpq.client import Client
from ddpq.errors import (
    ApiError,
    ApiUnreachable,
    CodeError,
    ConfigError,
    DdpqError,
    SnapshotError,
    WorkerError,
    format_detail,
)
from ddpq.rules import visible

EXIT_OK = 0
EXIT_API = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_JOB_FAILED = 4
EXIT_UNSCHEDULABLE = 5
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "ok (watch, status, submit --wait: the job succeeded)",
    EXIT_API: "the API refused the request or failed (4xx/5xx), with its reason",
    EXIT_USAGE: "bad usage: a flag, a spec file that is not YAML/JSON, the config file",
    EXIT_UNREACHABLE: "the API could not be reached (--url, --server, DDPQ_URL, ddpq login)",
    EXIT_JOB_FAILED: "the job failed or was cancelled (watch, status, submit --wait)",
    EXIT_UNSCHEDULABLE: "submit --wait: no registered worker can ever run the job",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

# ddpq.errors' tree mapped to those codes, in this one place: the first row whose class
# an error is of gives its code (tests/test_errors.py checks that every class has a row).
EXIT_FOR_ERROR: tuple[tuple[type[DdpqError], int], ...] = (
    (ApiUnreachable, EXIT_UNREACHABLE),  # no answer: the API could not be reached
    (ApiError, EXIT_API),  # refused (4xx), failed (5xx), or not the API's answer
    (SnapshotError, EXIT_API),  # a manifest the API sent breaks a rule (code --download)
    (ConfigError, EXIT_USAGE),  # the config file, --server, DDPQ_PORT
    (CodeError, EXIT_USAGE),  # a directory that cannot be sent as code
    (WorkerError, EXIT_USAGE),  # `ddpq worker` cannot start as asked (data dir, walls, Slurm)
)


def exit_code(exc: DdpqError) -> int:
    """The exit code of EXIT_CODES that ``exc`` ends a command with."""
    return next((code for kind, code in EXIT_FOR_ERROR if isinstance(exc, kind)), EXIT_API)


# Where every client command finds the API: said under each one's help, since that is
# where a user looks when a command cannot reach it or is refused. (ddpq.config owns
# the order.)
API_HELP = (
    "The API and the user token: --url and --token, or --server NAME (a server "
    "`ddpq login` saved); else DDPQ_URL (or DDPQ_PORT: http://127.0.0.1:PORT) and "
    "DDPQ_TOKEN; else the default server of ~/.config/ddpq/config.toml; else "
    + config.DEFAULT_URL
    + " and the file var/api-token that `ddpq serve` wrote (DDPQ_DATA_DIR/api-token). "
    "They go before the command: ddpq --server lab ls."
)

# "\b" keeps click from re-wrapping a paragraph into one line.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run PyTorch DDP jobs on shared GPU machines.",
    epilog=API_HELP
    + "\n\n\b\nExit codes:\n"
    + "\n".join(f"{code:>5}  {what}" for code, what in EXIT_CODES.items()),
    # An error is a sentence with the API's detail, never a traceback with locals.
    pretty_exceptions_show_locals=False,
    # Click's plain help: Rich's boxes cut option names ("--no-retry-on-er…") and
    # typer's Rich help names Python types ("<list[str]>") at 80 columns.
    rich_markup_mode=None,
)
out = Console()
err = Console(stderr=True)


class _Api:
    """The global --url/--token/--server (None: ddpq.config decides), and the target
    they resolve to, once."""

    url: str | None = None
    token: str | None = None
    server: str | None = None
    target: config.Target | None = None


@app.callback()
def _global_options(
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            metavar="URL",
            help=f"the API (else DDPQ_URL, DDPQ_PORT, the config's default server, "
            f"{config.DEFAULT_URL})",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            metavar="TOKEN",
            help="the user token (else DDPQ_TOKEN, the config's server, the file "
            "var/api-token `ddpq serve` wrote)",
        ),
    ] = None,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            metavar="NAME",
            help="a server `ddpq login` saved in ~/.config/ddpq/config.toml: its URL and token",
        ),
    ] = None,
) -> None:
    # The environment is read by ddpq.config, which says where each value came from.
    _Api.url = url.rstrip("/") if url else None
    _Api.token = token.strip() if token else None
    _Api.server = server or None
    _Api.target = None


def _target() -> config.Target:
    """Where this command's requests go and with what token (ConfigError if the config
    file cannot say: an unknown --server, an unreadable file)."""
    if _Api.target is None:
        _Api.target = config.resolve(_Api.url, _Api.token, _Api.server)
    return _Api.target


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
    _tell(message)
    raise typer.Exit(code)


def _tell(message: str) -> None:
    """An error, in one line on stderr."""
    # The message may quote the API's words: brackets ("one of [a, b]"), escapes.
    err.print(Text("error: ", style="red") + _text(message), highlight=False, soft_wrap=True)


def _failed(exc: DdpqError, message: str | None = None) -> NoReturn:
    """End the command on ``exc`` with its exit code (EXIT_FOR_ERROR), told as
    ``message`` (a command's own words for it), else as _said tells it."""
    _fail(message or _said(exc), exit_code(exc))


def _said(exc: DdpqError) -> str:
    """How an error is told: its message, what was asked and what was answered; an
    error of the API this command talks to also names the URL tried and where its
    token came from, and for a refused token how to log in again."""
    target = _Api.target
    if not isinstance(exc, ApiError) or target is None:
        return str(exc)
    if isinstance(exc, ApiUnreachable):
        return (
            f"cannot reach the ddpq API at {target.url} ({target.origin()}): "
            f"{exc.asked}: {format_detail(exc.detail)}"
        )
    if exc.status == 401:
        return _refusal(exc, target)
    if exc.status == 403:
        return f"{exc} (at {target.url}; {target.origin()})"
    return str(exc)


def end(exc: DdpqError) -> int:
    """Tell an error no command handled (ddpq.cli.main catches them all, outside the
    command); the code to exit with."""
    _tell(_said(exc))
    return exit_code(exc)


INTERRUPT_GRACE_S = 3.0


def _on_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: unwind as KeyboardInterrupt, but exit 130 within a few seconds whatever
    the unwinding waits on (a connection being closed, a blocked write)."""
    timer = threading.Timer(INTERRUPT_GRACE_S, os._exit, args=(EXIT_INTERRUPTED,))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _client_command(fn: F) -> F:
    """Ctrl-C exits 130 (click would say 'Aborted!' and exit 1); a closed pipe
    (``ddpq logs 3 | head``) ends quietly."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        signal.signal(signal.SIGINT, _on_interrupt)
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
    return Client(target=_target())


def client_command(group: typer.Typer | None = None, **settings: Any) -> Callable[[F], F]:
    """Register a command that talks to the API (on ``group``, a group of commands like
    `ddpq users`, else on the app): Ctrl-C and closed pipes handled (_client_command),
    and the help saying where the API and token come from."""

    def register(fn: F) -> F:
        on = app if group is None else group
        return cast(F, on.command(epilog=API_HELP, **settings)(_client_command(fn)))

    return register


def _refusal(exc: ApiError, target: config.Target) -> str:
    """Why the API refused the token, where it came from, and what to do."""
    detail = format_detail(exc.detail)
    if target.token is None:
        withheld = f"; {target.withheld}" if target.withheld else ""
        return (
            f"{target.url} wants a user token and none was found (not in --token, "
            f"DDPQ_TOKEN, {config.shown(config.config_path())} or var/api-token{withheld}): "
            f"`ddpq login {target.url}` saves one ({detail})"
        )
    login = f"ddpq login {target.url}" + (f" --server {target.server}" if target.server else "")
    return f"{target.url} refused the token: {detail} ({target.origin()}); `{login}` saves another"


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


def _gib(n: int) -> str:
    """Device memory as nvidia-smi users read it: binary gigabytes."""
    return f"{n / 2**30:.1f} GiB"


def _gpu_use(use: dict[str, Any]) -> str:
    """'87% util, 12.3/80.0 GiB': one sample of a GPU (schemas.GpuUse)."""
    used, total = _gib(use["memory_used"]), _gib(use["memory_total"])
    return f"{use['utilization']:.0f}% util, {used.removesuffix(' GiB')}/{total}"


STATUS_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "cancelling": "magenta",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "dim",
}
# Cells are coloured by their whole text: states, and a worker's STATE.
CELL_STYLE = {**STATUS_STYLE, "alive": "green", "lost": "red", "leaving": "yellow", "left": "dim"}


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
