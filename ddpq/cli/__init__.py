"""The ``ddpq`` command.

Exit codes (base.EXIT_CODES is the one table; ``ddpq --help`` prints it): 0 ok;
1 the API refused the request (4xx) or failed (5xx); 2 bad usage; 3 the API could
not be reached; 4 the job failed or was cancelled (``watch``, ``status``,
``submit --wait``); 5 ``submit --wait``: no worker can ever run the job;
130 interrupted. An error of ddpq.errors' tree that a command does not handle ends
it in main, with the code base.EXIT_FOR_ERROR gives it. Every command that prints
accepts ``--json``.

One module per group of commands; importing each registers its commands on the app.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from ddpq.cli import (  # noqa: F401
    box,
    cache,
    checkpoints,
    code,
    compare,
    info,
    jobs,
    live,
    login,
    logs,
    secrets,
    servers,
    submit,
    sweep,
    users,
)
from ddpq.cli.base import app, end
from ddpq.errors import DdpqError

# The order `ddpq --help` lists the commands in: starting things, who you are, a job's
# life, then the people of the server (groups of commands too: `users`).
ORDER = [
    "serve", "worker", "up",
    "login", "logout", "whoami", "secrets",
    "submit", "resubmit", "status", "ls", "queue", "cancel", "hold", "release", "update",
    "code", "outputs", "logs", "watch",
    "checkpoints", "cache", "sweep", "compare",
    "workers", "recipes",
    "users", "audit", "usage", "share", "acct", "quota",
    "slurm-node",  # hidden: what the Slurm bridge starts on each node
]  # fmt: skip


def _metavar(param: Any) -> str:
    """What help shows for a value: N for a count, SECONDS for a time (options named
    *_s), else the option's name (``--recipe RECIPE``), as argparse does; typer's own
    would be a Python type (``<list[str]>``)."""
    name = (param.name or "value").upper()
    if param.param_type_name == "argument":
        return name
    bare = getattr(param, "bare_type", lambda: "")()
    if bare in ("int", "list[int]"):
        return "N"
    if bare == "float":
        return "SECONDS" if name.endswith("_S") else "X"
    return name


def _name_values(command: Any) -> None:
    """Give every option and argument without a metavar of its own a readable one.
    (Any: typer ships its own copy of click, whose classes these are.)"""
    for param in command.params:
        if param.metavar is None and not getattr(param, "is_flag", False):
            many = param.nargs == -1 and param.param_type_name == "option"
            param.metavar = _metavar(param) + ("..." if many else "")
        if param.param_type_name == "argument":
            # typer lists an argument as "ARGS... <list[str]>": the name says enough.
            param.display_type_rich = lambda ctx: None
    for sub in getattr(command, "commands", {}).values():
        _name_values(sub)


def _ordered(command: Any) -> None:
    """Commands and groups in ORDER (the click group lists them as its dict holds them);
    one missing from ORDER fails here, in every test that runs the CLI."""
    command.commands = {
        name: command.commands[name] for name in sorted(command.commands, key=ORDER.index)
    }


def main() -> None:
    command = typer.main.get_command(app)
    _ordered(command)
    _name_values(command)
    try:
        command()
    except DdpqError as exc:  # one line and its exit code, never a traceback
        sys.exit(end(exc))
