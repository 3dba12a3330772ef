"""The ``ddpq`` command.

Exit codes (base.EXIT_CODES is the one table; ``ddpq --help`` prints it): 0 ok;
1 the API refused the request (4xx) or failed (5xx); 2 bad usage; 3 the API could
not be reached; 4 the job failed or was cancelled (``watch``, ``status``,
``submit --wait``); 130 interrupted. Every command that prints accepts ``--json``.

One module per group of commands; importing each registers its commands on the app,
in the order ``ddpq --help`` lists them.
"""

from __future__ import annotations

# The order of these imports is the order help lists the commands in.
# isort: off
from ddpq.cli import servers, jobs, code, logs, live, info  # noqa: F401

# isort: on
from ddpq.cli.base import app


def main() -> None:
    app()
