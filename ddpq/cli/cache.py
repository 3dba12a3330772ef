"""Your caches on the workers: `ddpq cache ls|clear`. Each worker keeps one cache per user
(inductor's and Triton's compiled kernels, Hugging Face's hub, torch hub, matplotlib),
which that user's later jobs there find warm; the worker reports them, and clears one when
asked (docs/jobs.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from ddpq.cli.base import (
    API_HELP,
    JsonOpt,
    _age,
    _client,
    _fit_table,
    _print_json,
    _print_table,
    _say,
    app,
    client_command,
)
from ddpq.snapshot import human_bytes

cache_app = typer.Typer(
    help="Your caches on the workers (compiled kernels, downloaded models): how big, and "
    "clearing them.",
    epilog=API_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(cache_app, name="cache")

UserOpt = Annotated[
    str | None,
    typer.Option(metavar="NAME", help="whose (admins: anyone's; `ls`: everyone's when absent)"),
]
WorkerOpt = Annotated[str | None, typer.Option(metavar="NAME", help="on this worker only")]


@client_command(cache_app, name="ls")
def list_caches(user: UserOpt = None, worker: WorkerOpt = None, as_json: JsonOpt = False) -> None:
    """Each of your caches per worker: its size, its files, when a job of yours last used
    it (as the worker last reported: at the end of each attempt)."""
    with _client() as c:
        items = c.caches(user, worker)
    if as_json:
        _print_json({"items": items})
        return
    rows = [
        [
            i["user"],
            i["worker"],
            human_bytes(i["bytes"]),
            str(i["files"]),
            f"{_age(i['last_used'])} ago",
            "clearing" if i.get("clearing") else "",
        ]
        for i in items
    ]
    headers = ["USER", "WORKER", "SIZE", "FILES", "LAST USED", "NOTE"]
    _print_table(_fit_table(headers, rows, caps={"USER": 64, "WORKER": 64}))


@client_command(cache_app, name="clear")
def clear_caches(user: UserOpt = None, worker: WorkerOpt = None, as_json: JsonOpt = False) -> None:
    """Clear your caches (on every worker that has one, or --worker's): each worker clears
    it at its next heartbeat, or once the job of yours using it there ends. An admin clears
    anyone's (--user)."""
    with _client() as c:
        items = c.clear_caches(user, worker)
    if as_json:
        _print_json({"items": items})
        return
    whose = f"{user}'s" if user else "your"
    where = f" on {worker}" if worker else ""
    if not items:
        _say(f"no worker reported a cache of {whose[:-2] if user else 'yours'}{where}")
        return
    total = human_bytes(sum(i["bytes"] for i in items))
    workers = ", ".join(i["worker"] for i in items)
    _say(
        f"clearing {whose} caches ({total}) on {workers}: at each worker's next heartbeat, or "
        "when a job using one there ends"
    )
