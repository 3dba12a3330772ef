"""Users' caches on the workers

``worker_caches`` holds one row per (worker, user): that user's cache on that worker
(inductor, Triton, Hugging Face, torch hub, matplotlib: worker.caches), as the worker's
heartbeat last reported it; a report replaces the worker's rows. ``cache_clears`` holds
the clear orders (``ddpq cache clear``) a worker has not yet reported done; a row goes
when it does (service.caches).

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

When = service.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "worker_caches",
        sa.Column("worker", sa.String(length=200), primary_key=True),
        sa.Column("owner", sa.String(length=64), primary_key=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.BigInteger(), nullable=False),
        sa.Column("last_used", When, nullable=False),
        sa.Column("reported_at", When, nullable=False),
    )
    op.create_index("ix_worker_caches_owner", "worker_caches", ["owner"])
    op.create_table(
        "cache_clears",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("asked_by", sa.String(length=64), nullable=False),
        sa.Column("asked_at", When, nullable=False),
    )
    op.create_index("ix_cache_clears_worker_owner", "cache_clears", ["worker", "owner"])


def downgrade() -> None:
    op.drop_index("ix_cache_clears_worker_owner", table_name="cache_clears")
    op.drop_table("cache_clears")
    op.drop_index("ix_worker_caches_owner", table_name="worker_caches")
    op.drop_table("worker_caches")
