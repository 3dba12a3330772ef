"""Secrets (service.secrets): a value in (never out to a person), names and times out, and
what a Slurm attempt's nodes fetch with their job token."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from ddpq.messages import Strict
from ddpq.rules import MAX_SECRET_BYTES


class SecretIn(Strict):
    """PUT /secrets/{name}: the value, 1 to 16 KiB of UTF-8 without NUL. An error about it
    never quotes it (service.routes.secrets reads the body itself)."""

    value: Annotated[str, Field(min_length=1, max_length=MAX_SECRET_BYTES)]


class SecretPublic(BaseModel):
    """A secret as anyone sees it: its name and times, never its value."""

    name: str
    owner: str
    created_at: datetime
    updated_at: datetime


class SecretsPublic(BaseModel):
    items: list[SecretPublic]


class JobSecrets(BaseModel):
    """GET /jobs/{id}/secrets (a Slurm attempt's job token): the values of the secrets its
    spec names, for its ranks' environment."""

    values: dict[str, str]
