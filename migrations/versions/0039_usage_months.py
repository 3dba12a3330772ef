"""Accounting's rollup by month

``usage_months``: each owner's sums per month of UTC, the sums of its days (service.rollup),
so a year's totals read 12 rows an owner, not 365 (GET /accounting over a year of 200
users read 73,000 days' rows). Filled here from ``usage_days``; the rollup adds to it
from now on in the transaction that adds to the days.

Revision ID: 0039
Revises: 0038
Create Date: 2026-11-29
"""

from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0039"
down_revision: str | None = "0038"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FLOATS = ("seconds", "gpu_s", "cpu_s")
_INTS = ("started", "started_preempted", "jobs_made")


def _utc(t: datetime) -> datetime:
    """A day as read back: naive UTC on SQLite, aware in the session's zone on Postgres."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def upgrade() -> None:
    months = op.create_table(
        "usage_months",
        sa.Column("month", sa.DateTime(timezone=True), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=False) for name in _FLOATS),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in _INTS),
        sa.PrimaryKeyConstraint("month", "owner"),
    )
    bind = op.get_bind()
    days = sa.table(
        "usage_days",
        sa.column("day", sa.DateTime(timezone=True)),
        sa.column("owner"),
        *map(sa.column, _FLOATS + _INTS),
    )
    # Added up here, not in SQL: date_trunc on Postgres cuts in the session's time zone, and
    # a year of a few hundred users is some 100,000 rows.
    sums: dict[tuple[datetime, str], dict[str, float]] = defaultdict(
        lambda: dict.fromkeys(_FLOATS + _INTS, 0)
    )
    for row in bind.execute(sa.select(days)):
        month = _utc(row.day).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        figures = sums[(month, row.owner)]
        for name in _FLOATS + _INTS:
            figures[name] += getattr(row, name)
    sqlite = bind.dialect.name == "sqlite"
    rows = [
        {"month": m.replace(tzinfo=None) if sqlite else m, "owner": owner, **figures}
        for (m, owner), figures in sorted(sums.items())
    ]
    if rows:
        op.bulk_insert(months, rows)


def downgrade() -> None:
    op.drop_table("usage_months")
