"""Which extra a command needs, and the one line that says so when it is missing.

A plain ``pip install ddpq`` is the CLI, the Python client and ``ddpq.train``; the commands
that start ddpq's processes need more: ``ddpq serve`` the server extra, ``ddpq worker``
(and the Slurm node it starts) the worker extra, ``ddpq up`` both. Such a command loads
its room inside ``with needs(...)``: a module of the extra that is not installed ends it
with ``ddpq serve: the API needs the server extra: pip install 'ddpq[server]'`` and exit
code 2, never a traceback. The modules are looked up without being imported (torch
costs seconds to import), then the import itself is watched for one the look-up missed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from ddpq.cli.base import EXIT_USAGE, _fail

# What each extra of pyproject.toml gives, as the top-level modules its rooms import
# (tests/test_install.py checks these against the imports and pyproject.toml).
MODULES: dict[str, tuple[str, ...]] = {
    "server": (
        "fastapi",
        "starlette",
        "uvicorn",
        "pydantic",
        "pydantic_settings",
        "typing_extensions",
        "sqlalchemy",
        "alembic",
        "psycopg",
        "prometheus_client",
    ),
    "worker": ("torch", "pydantic", "pydantic_settings", "packaging"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this Python cannot import (looked up, not imported)."""
    return [m for m in MODULES[extra] if importlib.util.find_spec(m) is None]


def message(command: str, what: str, extras: list[str]) -> str:
    names = " and ".join(extras) + (" extra" if len(extras) == 1 else " extras")
    return f"ddpq {command}: {what} needs the {names}: pip install 'ddpq[{','.join(extras)}]'"


@contextmanager
def needs(command: str, what: str, *extras: str) -> Iterator[None]:
    """Run the body (the command's imports) only with ``extras`` installed; else end the
    command with the line naming what to install (exit 2)."""
    lacking = [extra for extra in extras if missing(extra)]
    if lacking:
        _fail(message(command, what, lacking), EXIT_USAGE)
    try:
        yield
    except ImportError as exc:
        top = (exc.name or "").split(".")[0]
        owners = [extra for extra in extras if top in MODULES[extra]]
        if not owners:
            raise
        _fail(message(command, what, owners), EXIT_USAGE)
