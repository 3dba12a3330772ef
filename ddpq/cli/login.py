"""Who you are to the API: login (save a server's URL and token), logout, whoami.

ddpq.config owns the config file and the order URL and token are found in; these
commands only change the file and say what they did.
"""

from __future__ import annotations

import getpass
import sys
from typing import Annotated, Any

import typer

from ddpq import config
from ddpq.cli.base import (
    EXIT_USAGE,
    JsonOpt,
    _Api,
    _client,
    _fail,
    _failed,
    _print_json,
    _say,
    _target,
    client_command,
)
from ddpq.client import Client
from ddpq.errors import ApiBadAnswer, ApiError, ApiUnreachable, ConfigError, format_detail

ServerName = Annotated[
    str | None,
    typer.Option(
        "--server",
        metavar="NAME",
        help="the server's name in the config file (the global --server, given here)",
    ),
]


def _server_name(here: str | None) -> str | None:
    """The --server given after the command, or before it (the global one)."""
    if here and _Api.server and here != _Api.server:
        _fail(f"--server {_Api.server} and --server {here}: give one", EXIT_USAGE)
    name = here or _Api.server
    return config.check_name(name) if name else None


def _read_token(url: str, token_stdin: bool) -> str:
    if token_stdin:
        token = sys.stdin.read().strip()
        where = "stdin"
    elif _Api.token:
        return _Api.token
    elif sys.stdin.isatty():
        token = getpass.getpass(f"token for {url} (not shown as you type): ").strip()
        where = "the prompt"
    else:
        _fail("no terminal to ask for the token on: pipe it in with --token-stdin", EXIT_USAGE)
    if not token:
        _fail(f"no token on {where}", EXIT_USAGE)
    if len(token.split()) != 1:
        _fail(f"the token on {where} is not one word", EXIT_USAGE)
    return token


def _check(url: str, token: str) -> dict[str, Any]:
    """Who ``token`` is at ``url`` (GET /whoami); exit with why if it is refused."""
    try:
        with Client(url, token) as c:
            who: dict[str, Any] = c.whoami()
            return who
    except ApiUnreachable as exc:
        why = format_detail(exc.detail)
        _failed(exc, f"cannot reach the ddpq API at {url}: {exc.asked}: {why}. Nothing saved")
    except ApiBadAnswer as exc:
        _failed(exc, f"{url} is not a ddpq API: {exc}. Nothing saved")
    except ApiError as exc:
        if exc.status == 404:
            _failed(exc, f"{url} has no /whoami: a ddpq API that knows users? Nothing saved")
        if exc.status == 401 or exc.status == 403:
            _failed(exc, f"{url} refused the token: {format_detail(exc.detail)}. Nothing saved")
        _failed(exc, f"{url}: {exc}. Nothing saved")


def _login_url(url: str | None, name: str | None) -> str:
    """Where a login goes: the URL given, else --url, the URL saved for --server NAME,
    DDPQ_URL or DDPQ_PORT, the default server's, the built-in default."""
    saved = config.load()
    if url is not None:
        return config.check_url(url)
    if _Api.url:
        return config.check_url(_Api.url)
    if name is not None and name in saved.servers:
        return saved.servers[name].url
    if (from_env := config.env_url()) is not None:
        return config.check_url(from_env[0])
    if saved.default is not None and saved.default in saved.servers:
        return saved.servers[saved.default].url
    return config.DEFAULT_URL


@client_command()
def login(
    url: Annotated[
        str | None,
        typer.Argument(
            help="the API, like http://HOST:8000 (default: --url, the URL saved for "
            "--server NAME, DDPQ_URL or DDPQ_PORT, the default server's, "
            + config.DEFAULT_URL
            + ")"
        ),
    ] = None,
    token_stdin: Annotated[
        bool,
        typer.Option(
            "--token-stdin",
            help="read the token from stdin (else the global --token, else it is asked for)",
        ),
    ] = False,
    server: ServerName = None,
    make_default: Annotated[
        bool,
        typer.Option("--default", help="make it the default server (the first one saved is)"),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Log in: save a server's URL and your token, once checked.

    They go in ~/.config/ddpq/config.toml ($XDG_CONFIG_HOME/ddpq), mode 0600, under
    a name: --server NAME, else the name the URL is saved under already, else
    "default" (the first), else HOST:PORT. Then every command, in any directory,
    uses the default server, or the one --server NAME picks: ddpq --server NAME ls.
    """
    name = _server_name(server)
    target = _login_url(url, name)
    token = _read_token(target, token_stdin)
    who = _check(target, token)
    replaced = None
    try:
        with config.editing() as cfg:
            if name is None:
                name = cfg.of_url(target)
            if name is None:
                name = "default" if "default" not in cfg.servers else config.name_for(target)
                while name in cfg.servers:  # a HOST:PORT name of another URL
                    name = f"{name}-{len(cfg.servers)}"
            old = cfg.servers.get(name)
            if old is not None and old.url != target:
                replaced = old.url
            cfg.servers[name] = config.Server(target, token)
            if make_default or cfg.default is None or cfg.default not in cfg.servers:
                cfg.default = name
            default = cfg.default
            path = cfg.path
    except ConfigError as exc:
        _failed(exc, f"cannot save the login: {exc}")
    except OSError as exc:
        _fail(f"cannot save the login: {exc}", EXIT_USAGE)
    if as_json:
        _print_json(
            {**who, "url": target, "server": name, "default": default == name, "config": str(path)}
        )
        return
    _say(
        f"logged in to {target} as {who['name']} ({who['role']}): saved as server"
        f' "{name}" in {config.shown(path)}' + (f" (replacing its {replaced})" if replaced else "")
    )
    if default == name:
        _say("it is the default server: ddpq commands in any directory use it")
    else:
        _say(
            f'the default server stays "{default}": use this one with ddpq --server {name}'
            f" COMMAND, or make it the default with ddpq login --server {name} --default"
        )


@client_command()
def logout(server: ServerName = None, as_json: JsonOpt = False) -> None:
    """Remove a saved server and its token.

    --server NAME, else the one saved for --url (or DDPQ_URL, DDPQ_PORT), else the
    default.

    The token itself stays valid until an admin revokes or rotates it.
    """
    name = _server_name(server)
    saved = config.load()
    if name is None:
        url = _Api.url or (config.env_url() or ("", ""))[0]
        name = saved.of_url(url) if url else saved.default
        if name is None:
            _fail(
                f"not logged in to {url or 'a default server'}: no server of"
                f" {config.shown(saved.path)} is it (ddpq logout --server NAME)",
                EXIT_USAGE,
            )
    if name not in saved.servers:
        saved.named(name)  # ConfigError: no such server, and the ones there are
    try:
        with config.editing() as cfg:
            gone = cfg.servers.pop(name, None)
            if cfg.default == name or cfg.default not in cfg.servers:
                # The one left, if one is, becomes the default.
                cfg.default = next(iter(cfg.servers)) if len(cfg.servers) == 1 else None
            default, path = cfg.default, cfg.path
    except ConfigError as exc:
        _failed(exc, f"cannot change the config file: {exc}")
    except OSError as exc:
        _fail(f"cannot change the config file: {exc}", EXIT_USAGE)
    if as_json:
        _print_json({"server": name, "url": gone.url if gone else None, "default": default})
        return
    _say(
        f'logged out: server "{name}" ({gone.url if gone else "?"}) removed from'
        f" {config.shown(path)}; its token stays valid until an admin revokes or rotates it"
    )
    if default is not None:
        _say(f'the default server is "{default}"')


@client_command()
def whoami(as_json: JsonOpt = False) -> None:
    """Show who you are: name and role, URL, and the token's source."""
    target = _target()
    with _client() as c:
        who = c.whoami()
    if as_json:
        _print_json(
            {
                **who,
                "url": target.url,
                "url_from": target.url_from,
                "token_from": target.token_from,
                "server": target.server,
            }
        )
        return
    _say(f"{who['name']} ({who['role']}) at {target.url} ({target.origin()})")
