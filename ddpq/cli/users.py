"""The people of a server (admins manage them): `ddpq users
add|ls|rotate|deactivate|reactivate`, `ddpq audit`, who did what and when, `ddpq usage`,
who uses the hosts, and `ddpq quota`, what each may hold."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ddpq import config
from ddpq.cli.base import (
    API_HELP,
    JsonOpt,
    _client,
    _fit_table,
    _parse_time,
    _print_json,
    _print_table,
    _say,
    _target,
    _text,
    app,
    client_command,
    err,
)
from ddpq.client import Client

users_app = typer.Typer(
    help="Manage the server's users and their tokens (admins).",
    epilog=API_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(users_app, name="users")

UserName = Annotated[str, typer.Argument(metavar="NAME", help="the user's name")]


def _stamp(value: str | None, seconds: bool = False) -> str:
    """An API time (UTC) in this machine's time zone, to the minute (or second)."""
    if not value:
        return ""
    return _parse_time(value).astimezone().strftime("%Y-%m-%d %H:%M" + (":%S" if seconds else ""))


def _show_token(name: str, token: str, what: str) -> None:
    """A token, alone on its line, and the one line that says it is shown only now."""
    url = _target().url
    _say(f"{what}:")
    _say(token)
    _say(
        _text(
            f"shown only now: {name} logs in with `ddpq login {url}` and gives it when asked",
            style="bold",
        )
    )


@client_command(users_app, name="add")
def add(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME",
            help="1-64 lower-case letters, digits, '.', '_', '-', starting with a letter or digit",
        ),
    ],
    admin: Annotated[
        bool, typer.Option("--admin", help="an admin (manages users), not a member")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Add a user and print their token, this once."""
    with _client() as c:
        user = c.add_user(name, admin)
    if as_json:
        _print_json(user)
        return
    _show_token(user["name"], user["token"], f"added {user['name']} ({user['role']}); token")


@client_command(users_app, name="ls")
def list_users(as_json: JsonOpt = False) -> None:
    """List the users, closed accounts too.

    TOKEN is the start of each one's token, to tell tokens apart; CLOSED, when and by
    whom an account was closed.
    """
    with _client() as c:
        items = c.users()
    if as_json:
        _print_json({"items": items})
        return
    rows = [
        [
            u["name"],
            u["role"],
            u.get("state") or ("deactivated" if u.get("revoked_at") else "active"),
            u.get("token_hint") or "",
            _stamp(u.get("created_at")),
            _closed(u),
        ]
        for u in items
    ]
    header = ["NAME", "ROLE", "STATE", "TOKEN", "CREATED", "CLOSED"]
    _print_table(_fit_table(header, rows, caps={"NAME": 64}))


def _closed(user: dict[str, Any]) -> str:
    if not user.get("revoked_at"):
        return ""
    by = user.get("deactivated_by")
    return _stamp(user["revoked_at"]) + (f" by {by}" if by else "")


JOBS_CHOICES = ("cancel-queued", "cancel-all", "keep", "transfer")


def _deactivate(name: str, jobs: str, to: str | None, yes: bool, as_json: bool) -> None:
    if jobs not in JOBS_CHOICES:
        raise typer.BadParameter(f"one of {', '.join(JOBS_CHOICES)}", param_hint="--jobs")
    if (jobs == "transfer") != (to is not None):
        raise typer.BadParameter("give --to USER with --jobs transfer, and only then")
    what = {
        "cancel-queued": "their queued jobs are cancelled, running ones finish",
        "cancel-all": "their queued and running jobs are cancelled",
        "keep": "their jobs run and start as before",
        "transfer": f"their queued and running jobs become {to}'s",
    }[jobs]
    if not yes and not as_json:
        typer.confirm(f"close {name}'s account? their token stops working; {what}", abort=True)
    with _client() as c:
        closed = c.deactivate_user(name, jobs, to)
    if as_json:
        _print_json(closed)
        return
    counts = ", ".join(
        f"{len(closed[k])} {k}" for k in ("cancelled", "cancelling", "transferred", "kept")
        if closed[k]
    )  # fmt: skip
    _say(
        f"closed {name}'s account: their token is refused from now on"
        + (f"; jobs: {counts}" if counts else "; they had no queued or running jobs")
    )


JobsOpt = Annotated[
    str,
    typer.Option(
        "--jobs",
        metavar="CHOICE",
        help="what becomes of their jobs: cancel-queued (running ones finish), cancel-all, "
        "keep, or transfer (with --to)",
    ),
]
ToOpt = Annotated[
    str | None, typer.Option("--to", metavar="USER", help="with --jobs transfer: whose they become")
]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="do not ask to confirm")]


def deactivate(
    name: UserName,
    jobs: JobsOpt = "cancel-queued",
    to: ToOpt = None,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Close a user's account: their token is refused at once (open streams end too).

    The account stays, for the audit trail and usage; its name is not given to anyone
    else (`ddpq users reactivate` opens it again). Their jobs: --jobs.
    """
    _deactivate(name, jobs, to, yes, as_json)


# `delete` is the same command: an account is closed, never erased.
client_command(users_app, name="deactivate")(deactivate)
client_command(users_app, name="delete", help="The same as `ddpq users deactivate`.")(deactivate)


@client_command(users_app)
def revoke(name: UserName, as_json: JsonOpt = False) -> None:
    """Close a user's account as `deactivate` does by default (its older name).

    Their queued jobs are cancelled; running ones finish.
    """
    with _client() as c:
        user = c.revoke_user(name)
    if as_json:
        _print_json(user)
        return
    _say(f"revoked {user['name']} ({user['role']}): their token is refused from now on")


@client_command(users_app)
def reactivate(name: UserName, as_json: JsonOpt = False) -> None:
    """Open a closed account again, with a new token (printed this once)."""
    with _client() as c:
        user = c.reactivate_user(name)
    if as_json:
        _print_json(user)
        return
    _show_token(user["name"], user["token"], f"reopened {user['name']}'s account; token")


@client_command(users_app)
def rotate(name: UserName, as_json: JsonOpt = False) -> None:
    """Give a user a new token; the old one stops working at once.

    The new one is printed this once. Your own: the config file's server it came
    from is given the new one.
    """
    target = _target()
    with _client() as c:
        me = c.whoami()["name"]
        user = c.rotate_user(name)
    own = _own(user, target) if me == user["name"] else None
    if as_json:
        _print_json(user)
        return
    _show_token(user["name"], user["token"], f"new token of {user['name']}; the old one is dead")
    if own:
        _say(own)


def _own(user: dict[str, Any], target: config.Target) -> str:
    """Your own token was rotated: put the new one where the old one was saved."""
    dead = f"it was yours: the old one, from {target.token_from}, no longer works"
    if target.server is None:
        return dead
    try:
        with config.editing() as cfg:
            old = cfg.servers.get(target.server)
            if old is None or old.token != target.token:
                return dead  # changed meanwhile: left alone
            old.token = user["token"]
            return f'it was yours: saved as server "{target.server}" in {config.shown(cfg.path)}'
    except (OSError, config.ConfigError) as exc:
        err.print(_text(f"warning: the new token is not saved: {exc}"), highlight=False)
        return dead


def _find_events(c: Client, limit: int, cursor: str | None) -> tuple[list[Any], str | None]:
    found: list[dict[str, Any]] = []
    while True:
        page = c.audit(min(500, limit - len(found)), cursor)
        found += page["items"]
        cursor = page["next_cursor"]
        if cursor is None or len(found) >= limit:
            return found, cursor


def _detail(detail: Any) -> str:
    if not isinstance(detail, dict):
        return "" if detail is None else json.dumps(detail)
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in detail.items())


@client_command()
def audit(
    limit: Annotated[int, typer.Option(min=1, help="at most this many events")] = 50,
    cursor: Annotated[
        str | None, typer.Option(help="continue after this (next_cursor of --json)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Who did what and when, newest first (admins).

    Submits, cancels, and changes to users. --json prints {"items", "next_cursor"}.
    """
    with _client() as c:
        items, next_cursor = _find_events(c, limit, cursor)
    if as_json:
        _print_json({"items": items, "next_cursor": next_cursor})
        return
    rows = [
        [
            _stamp(e.get("at"), seconds=True),
            e.get("actor") or "",
            e.get("action") or "",
            e.get("target") or "",
            _detail(e.get("detail")),
        ]
        for e in items
    ]
    _print_table(
        _fit_table(
            ["AT", "ACTOR", "ACTION", "TARGET", "DETAIL"], rows, caps={"ACTOR": 24, "TARGET": 32}
        )
    )
    if next_cursor:
        _say(_text(f"more: --cursor {next_cursor}", style="dim"))


@client_command()
def usage(as_json: JsonOpt = False) -> None:
    """Who uses the hosts: each user's running and queued jobs, GPU-hours over the last
    day and week (CPU-slot-hours too), and the recent usage fair share goes by.

    Among queued jobs of one priority, the user who used least lately goes first.
    """
    with _client() as c:
        items = c.usage()
    if as_json:
        _print_json({"items": items})
        return
    rows = [
        [
            u["user"],
            str(u["running"]),
            str(u["queued"]),
            f"{u['gpu_hours_1d']:.2f}",
            f"{u['gpu_hours_7d']:.2f}",
            f"{u['cpu_slot_hours_7d']:.2f}",
            f"{u['usage_gpu_s']:.1f}",
        ]
        for u in items
    ]
    header = ["USER", "RUNNING", "QUEUED", "GPU-HOURS 1D", "GPU-HOURS 7D", "CPU-SLOT-HOURS 7D",
              "FAIR-SHARE USAGE (GPU-S)"]  # fmt: skip
    _print_table(_fit_table(header, rows, caps={"USER": 24}))
    _say(
        _text(
            "GPU-hours and CPU-slot-hours: what each user's attempts held, for how long; "
            "fair-share usage: GPU-equivalent seconds, decayed (`ddpq share` ranks it)",
            style="dim",
        )
    )


@client_command()
def share(as_json: JsonOpt = False) -> None:
    """Fair share (Slurm's sshare): each user's recent usage, in GPU-equivalent seconds
    decayed by the half-life, their part of everyone's, and their turn among jobs of one
    priority (the least used first); what the queue's order goes by (`ddpq queue`)."""
    with _client() as c:
        items = c.usage()
        rules = c.queue(limit=1)["scheduling"]
    total = sum(u["usage_gpu_s"] for u in items) or 1.0
    ranked = sorted(items, key=lambda u: (u["usage_gpu_s"], u["user"]))
    if as_json:
        _print_json({"scheduling": rules, "items": ranked})
        return
    half = rules["fairshare_half_life_s"]
    _say(
        _text(
            f"usage decays by half every {half / 3600:g} h; a CPU slot counts "
            f"{rules['cpu_slot_weight']:g} GPU; preemption {rules['preemption']}",
            style="dim",
        )
    )
    rows = [
        [
            str(i + 1),
            u["user"],
            f"{u['usage_gpu_s']:.1f}",
            f"{100 * u['usage_gpu_s'] / total:.1f} %",
            str(u["running"]),
            str(u["queued"]),
        ]
        for i, u in enumerate(ranked)
    ]
    header = ["TURN", "USER", "USAGE (GPU-S)", "OF ALL", "RUNNING", "QUEUED"]
    _print_table(_fit_table(header, rows, caps={"USER": 24}))


quota_app = typer.Typer(
    help="Limits per user: GPUs and jobs at once, jobs queued (admins set them).",
    epilog=API_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(quota_app, name="quota")

QuotaName = Annotated[
    str, typer.Argument(metavar="NAME", help="a user's name, or '*' for everyone's default")
]
Limit = Annotated[int | None, typer.Option(min=0, help="the most at once (default: no limit)")]
PriorityCap = Annotated[
    int | None,
    typer.Option(
        "--max-priority",
        min=-1_000_000,
        max=1_000_000,
        help="the highest priority a member may give a job (default: everyone's default's, "
        "else 0: they may only lower it); admins have no cap",
    ),
]


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


@client_command(quota_app, name="ls")
def quota_ls(as_json: JsonOpt = False) -> None:
    """Every user's limits, and everyone's default (*); a user's own row wins whole,
    but for MAX PRIO, which falls back to the default's on its own (then 0)."""
    with _client() as c:
        items = c.quotas()
    if as_json:
        _print_json({"items": items})
        return
    rows = [
        [
            q["user"],
            _limit(q["max_gpus"]),
            _limit(q["max_running"]),
            _limit(q["max_queued"]),
            _limit(q.get("max_priority")),
        ]
        for q in items
    ]
    header = ["USER", "GPUS", "RUNNING", "QUEUED", "MAX PRIO"]
    _print_table(_fit_table(header, rows, caps={"USER": 24}))


@client_command(quota_app, name="set")
def quota_set(
    name: QuotaName,
    gpus: Limit = None,
    running: Limit = None,
    queued: Limit = None,
    max_priority: PriorityCap = None,
    as_json: JsonOpt = False,
) -> None:
    """Set a user's limits (or everyone's, '*'): what is not given has no limit.

    Their queued jobs are held back at once, each saying which limit holds it. A lower
    --max-priority lowers their queued and running jobs above it.
    """
    with _client() as c:
        q = c.set_quota(
            name,
            max_gpus=gpus,
            max_running=running,
            max_queued=queued,
            max_priority=max_priority,
        )
    if as_json:
        _print_json(q)
        return
    _say(
        f"quota {q['user']}: GPUs {_limit(q['max_gpus'])}, running {_limit(q['max_running'])}, "
        f"queued {_limit(q['max_queued'])}, max priority {_limit(q.get('max_priority'))}"
    )


@client_command(quota_app, name="clear")
def quota_clear(name: QuotaName) -> None:
    """Remove a user's limits (everyone's default applies again), or the default."""
    with _client() as c:
        c.clear_quota(name)
    _say(f"quota {name}: cleared")
