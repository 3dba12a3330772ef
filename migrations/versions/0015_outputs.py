"""Outputs: what a job's working directory held when its last attempt ended

jobs.outputs: a code snapshot of the directory (its code and what the job wrote), kept
for the workdir retention (service.outputs); jobs.outputs_left: what was not sent
([{path, size, why}]); jobs.workdir: the directory on its worker; jobs.outputs_attempt:
the attempt that left it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("outputs", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("outputs_left", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("workdir", sa.Text(), nullable=True))
        batch.add_column(sa.Column("outputs_attempt", sa.Integer(), nullable=True))
        batch.create_index("ix_jobs_outputs", ["outputs"])
        batch.create_foreign_key(
            "fk_jobs_outputs_code_snapshots",
            "code_snapshots",
            ["outputs"],
            ["id"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("fk_jobs_outputs_code_snapshots", type_="foreignkey")
        batch.drop_index("ix_jobs_outputs")
        batch.drop_column("outputs_attempt")
        batch.drop_column("workdir")
        batch.drop_column("outputs_left")
        batch.drop_column("outputs")
