"""jobs.total_steps: the run's length is the job's, not a metric series

Programs reported total_steps among their metric values; it was stored as a series
and offered as a metric. It moves to the job: each job's latest reported total (a
whole number of at least 1) becomes jobs.total_steps, and its total_steps series and
the name in jobs.latest_metrics are removed.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

import math
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "total_steps"

jobs = sa.table(
    "jobs",
    sa.column("id", sa.BigInteger),
    sa.column("latest_metrics", sa.JSON),
    sa.column("total_steps", sa.BigInteger),
)
points = sa.table(
    "metric_points",
    sa.column("job_id", sa.BigInteger),
    sa.column("name", sa.String),
    sa.column("step", sa.BigInteger),
    sa.column("value", sa.Float),
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("total_steps", sa.BigInteger(), nullable=True))
    conn = op.get_bind()
    # Per job, the series' newest point: an index probe each (the primary key starts
    # with job_id), never a scan of every point for the name.
    newest = (
        sa.select(points.c.value)
        .where(points.c.job_id == jobs.c.id, points.c.name == NAME)
        .order_by(points.c.step.desc())
        .limit(1)
        .scalar_subquery()
    )
    having = (
        sa.select(points.c.job_id)
        .where(points.c.job_id == jobs.c.id, points.c.name == NAME)
        .exists()
    )
    found = conn.execute(sa.select(jobs.c.id, newest, jobs.c.latest_metrics).where(having)).all()
    for job_id, value, latest in found:
        # As metrics.ingest_metrics reads a total sent among the values.
        changes: dict[str, object] = {}
        if value is not None and math.isfinite(value) and 1 <= value < 2**63:
            changes["total_steps"] = int(value)
        if isinstance(latest, dict) and NAME in (latest.get("values") or {}):
            values = {k: v for k, v in latest["values"].items() if k != NAME}
            changes["latest_metrics"] = {**latest, "values": values}
        if changes:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**changes))
        conn.execute(points.delete().where(points.c.job_id == job_id, points.c.name == NAME))


def downgrade() -> None:
    # The totals are not put back as series: the column goes, and with it the totals.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("total_steps")
