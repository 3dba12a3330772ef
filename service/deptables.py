"""The jobs' dependencies (service.queue.deps owns what is written here), on
service.models' Base: a module of its own, as service.sweeptables is, because
service/models.py is near the line limit. Whatever reads Base.metadata whole (the
migrations' environment, tests/test_schema.py) imports this module too."""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from service.models import Base, BigId


class JobDep(Base):
    """A dependency a queued job still waits for: ``job_id`` starts after ``on_job`` has
    succeeded (``when`` ok) or ended (any). The row goes once it is met; while any is
    left, the job's ``waits_on`` counts them and no claim takes it."""

    __tablename__ = "job_deps"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    # Not a foreign key: the job waited for may be purged; its end settled this row first.
    on_job: Mapped[int] = mapped_column(BigInteger)
    when: Mapped[str] = mapped_column(String(8))

    __table_args__ = (
        Index("ix_job_deps_on_job", "on_job"),
        Index("ix_job_deps_job_id", "job_id"),
    )
