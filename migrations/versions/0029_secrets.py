"""Secrets for jobs: each user's values, encrypted at rest

``secrets`` holds one row per (owner, name): the value only as AES-256-GCM ciphertext
(its nonce first), sealed with the owner and name as associated data so a row's
ciphertext means nothing in another row, and the id of the key that sealed it
(service.secrets), so the API's key can be rotated. A job's spec names the secrets it
wants (``spec.secrets``, in the spec's JSON: no column); the values reach its ranks
through the worker's claim.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

When = service.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("owner", sa.String(length=64), primary_key=True),
        sa.Column("name", sa.String(length=128), primary_key=True),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("sealed", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.Column("updated_at", When, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("secrets")
