"""People: users with roles and hashed tokens, each job's owner, an audit trail

Users (users) hold a role (admin or member) and the sha256 of their token (never the
token), revoked_at once revoked. A job records who submitted it (jobs.owner, a user's
name; empty for jobs from before users existed). audit_events keeps who did what and
when: submits, cancels, users added, revoked and rotated.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = service.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(length=64), nullable=False, unique=True),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False, unique=True),
        sa.Column("token_hint", sa.String(length=16), nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.Column("token_created_at", When, nullable=False),
        sa.Column("revoked_at", When, nullable=True),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=64), nullable=True))
    op.create_index("ix_jobs_owner_status", "jobs", ["owner", "status"])
    op.create_table(
        "audit_events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("at", When, nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("audit_events")
    op.drop_index("ix_jobs_owner_status", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("owner")
    op.drop_table("users")
