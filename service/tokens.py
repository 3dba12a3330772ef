"""What a token looks like and how it is kept: one place for every kind.

Tokens ddpq makes carry a prefix that says what they are (like GitHub's ``ghp_``), so a
secret scanner can tell a leaked one: ``ddpqu_`` a user's, ``ddpqj_`` a job attempt's.
Only their sha256 is stored: the database never holds a usable token. (They are 256
random bits: a plain hash is enough, no slow password hash is needed.)
"""

from __future__ import annotations

import hashlib
import secrets

USER_TOKEN_PREFIX = "ddpqu_"  # noqa: S105 - a prefix, not a secret
JOB_TOKEN_PREFIX = "ddpqj_"  # noqa: S105


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def mint(prefix: str) -> tuple[str, str]:
    """A fresh token and the hash that is stored in its place."""
    token = prefix + secrets.token_urlsafe(32)
    return token, hash_token(token)
