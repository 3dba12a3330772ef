"""Checkpoints that are directories: checkpoints.kind

A framework writes some checkpoints as a directory (accelerate's save_state, a Hugging
Face Trainer's checkpoint-<step>); ddpq.train.register_checkpoint registers those too.
``kind`` says which a row is, ``file`` (every row before this) or ``dir``: its worker
deletes a directory whole (walked without following a link, while its stamp is the one
registered: the bytes of its files and their newest mtime, in ``bytes`` and
``mtime_ns``), never a file in place of one or the other way round.

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(
            sa.Column("kind", sa.String(length=8), nullable=False, server_default="file")
        )


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("kind")
