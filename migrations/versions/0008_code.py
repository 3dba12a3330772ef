"""Code snapshots: content-addressed blobs, manifests, and the snapshot a job runs

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "code_blobs",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("used_at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_index("ix_code_blobs_used_at", "code_blobs", ["used_at"])
    if op.get_bind().dialect.name == "postgresql":
        # Stored as sent, out of line and uncompressed: wheels and archives are
        # compressed already, and pglz would spend the API's and the database's CPU on
        # every upload and every worker's fetch to save little on source files.
        op.execute("ALTER TABLE code_blobs ALTER COLUMN data SET STORAGE EXTERNAL")
    op.create_table(
        "code_snapshots",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("created_at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("used_at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_code_snapshots_used_at", "code_snapshots", ["used_at"])
    op.create_table(
        "code_snapshot_blobs",
        sa.Column("snapshot_id", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["snapshot_id"],
            ["code_snapshots.id"],
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["digest"],
            ["code_blobs.digest"],
        ),
        sa.PrimaryKeyConstraint("snapshot_id", "digest"),
    )
    op.create_index("ix_code_snapshot_blobs_digest", "code_snapshot_blobs", ["digest"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("code", sa.String(length=64), nullable=True))
        batch.create_index("ix_jobs_code", ["code"])
        batch.create_foreign_key(
            "fk_jobs_code_code_snapshots",
            "code_snapshots",
            ["code"],
            ["id"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("fk_jobs_code_code_snapshots", type_="foreignkey")
        batch.drop_index("ix_jobs_code")
        batch.drop_column("code")
    op.drop_table("code_snapshot_blobs")
    op.drop_table("code_snapshots")
    op.drop_table("code_blobs")
