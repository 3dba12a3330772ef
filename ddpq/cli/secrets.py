"""Your secrets: `ddpq secrets set|ls|rm`. A secret's value reaches only the ranks of your
jobs that name it (`ddpq submit --secret NAME`, `secrets: [NAME]` in a spec file), as the
environment variable NAME; where a plain --env value is shown to the whole team."""

from __future__ import annotations

import getpass
import sys
from typing import Annotated

import typer

from ddpq.cli.base import (
    API_HELP,
    EXIT_USAGE,
    JsonOpt,
    _client,
    _fail,
    _fit_table,
    _parse_time,
    _print_json,
    _print_table,
    _say,
    app,
    client_command,
)
from ddpq.rules import secret_name_problem, secret_value_problem

secrets_app = typer.Typer(
    help="Your secrets: values your jobs' ranks get as environment variables, shown to no "
    "one (not even you).",
    epilog=API_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(secrets_app, name="secrets")

SecretName = Annotated[
    str, typer.Argument(metavar="NAME", help="the environment variable the ranks get it as")
]


def _stamp(value: str | None) -> str:
    return _parse_time(value).astimezone().strftime("%Y-%m-%d %H:%M") if value else ""


def _read_value(name: str) -> str:
    """The value from stdin (piped: one final newline dropped) or typed at a hidden prompt,
    twice; never from the command line, which every user of the host can read (ps)."""
    if not sys.stdin.isatty():
        value = sys.stdin.read()
        value = value[:-2] if value.endswith("\r\n") else value.removesuffix("\n")
    else:
        value = getpass.getpass(f"value of {name} (not shown as you type): ")
        if getpass.getpass("again, to be sure: ") != value:
            _fail("the two values differ; nothing was set", EXIT_USAGE)
    problem = secret_value_problem(value)
    if problem:
        _fail(f"the value of {name} {problem}; nothing was set", EXIT_USAGE)
    return value


@client_command(secrets_app, name="set")
def set_secret(name: SecretName, as_json: JsonOpt = False) -> None:
    """Set a secret (or replace its value), read from stdin or typed at a hidden prompt.

    `printf %s "$KEY" | ddpq secrets set WANDB_API_KEY`, then `ddpq submit --secret
    WANDB_API_KEY ...`: the job's ranks get it as WANDB_API_KEY. It is kept encrypted and
    shown to no one; the job's spec shows only its name.
    """
    problem = secret_name_problem(name)
    if problem:
        _fail(f"NAME: {problem}", EXIT_USAGE)
    value = _read_value(name)
    with _client() as c:
        secret = c.set_secret(name, value)
    if as_json:
        _print_json(secret)
        return
    _say(f"secret {secret['name']} set; a job gets it with `ddpq submit --secret {name}`")


@client_command(secrets_app, name="ls")
def list_secrets(
    user: Annotated[
        str | None, typer.Option(metavar="NAME", help="another user's (admins: names only)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List your secrets' names and when each was set; never a value."""
    with _client() as c:
        items = c.secrets(user)
    if as_json:
        _print_json({"items": items})
        return
    rows = [[s["name"], _stamp(s.get("created_at")), _stamp(s.get("updated_at"))] for s in items]
    _print_table(_fit_table(["NAME", "CREATED", "UPDATED"], rows, caps={"NAME": 64}))


@client_command(secrets_app, name="rm")
def remove_secret(name: SecretName) -> None:
    """Delete a secret. A queued job that names it fails when a worker takes it."""
    with _client() as c:
        c.delete_secret(name)
    _say(f"secret {name} deleted")
