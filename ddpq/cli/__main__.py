"""``python -m ddpq.cli``: the ``ddpq`` command."""

from ddpq.cli import main

main()
