"""People, hardened: who closed an account, who cancelled a job, each user's priority cap

- ``users.deactivated_by``: the admin who closed the account (``revoked_at`` is when);
  the row stays, for the audit trail and the usage history, and its name is never given
  to another user silently.
- ``jobs.cancelled_by``: who cancelled the job, in the words its reason shows
  (``alice (admin): bob's account was closed``).
- ``quotas.max_priority``: the highest priority a member may give a job (null: the
  default row's, else 0: a member may only lower their jobs' priority).

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("deactivated_by", sa.String(64), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cancelled_by", sa.String(300), nullable=True))
    with op.batch_alter_table("quotas") as batch:
        batch.add_column(sa.Column("max_priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("max_priority")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("cancelled_by")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("deactivated_by")
