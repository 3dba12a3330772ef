"""What a token looks like and how it is kept: one place for every kind.

Tokens ddpq makes carry a prefix that says what they are (like GitHub's ``ghp_``), so a
secret scanner can tell a leaked one: ``ddpqu_`` a user's (the first admin's too, the one
``ddpq serve`` writes to ``var/api-token``), ``ddpqw_`` the workers' (``var/worker-token``),
``ddpqj_`` a job attempt's. Every one is made by ``new_token``. Users' and jobs' are stored
as their sha256 only: the database never holds a usable token. (They are 256 random bits:
a plain hash is enough, no slow password hash is needed.) A token a person sets
(DDPQ_API_TOKEN, DDPQ_WORKER_TOKEN, or a file written before the prefixes) needs none.
"""

from __future__ import annotations

import hashlib
import secrets

USER_TOKEN_PREFIX = "ddpqu_"  # noqa: S105 - a prefix, not a secret
JOB_TOKEN_PREFIX = "ddpqj_"  # noqa: S105
WORKER_TOKEN_PREFIX = "ddpqw_"  # noqa: S105


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def new_token(prefix: str) -> str:
    """A fresh token of the kind ``prefix`` names: the prefix and 43 url-safe characters."""
    return prefix + secrets.token_urlsafe(32)


def mint(prefix: str) -> tuple[str, str]:
    """A fresh token and the hash that is stored in its place."""
    token = new_token(prefix)
    return token, hash_token(token)
