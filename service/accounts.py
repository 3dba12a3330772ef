"""An account's life after it is made: closed (with a choice of what becomes of its jobs)
and opened again.

Closing an account (``DELETE /users/NAME``, ``ddpq users deactivate``; the older
``POST /users/NAME/revoke`` is the same) refuses its token at once, on every API process
and on every stream already open (service.streams, service.logs), and keeps the row: the
audit trail and the usage history name it, and the name is never given to another user
silently (adding it again is a 409 that says how to reopen it). What becomes of the
user's jobs is the admin's choice (``jobs``):

- ``cancel-queued`` (the default): queued jobs are cancelled, running ones finish;
- ``cancel-all``: running ones are cancelled too (their workers stop them);
- ``keep``: nothing changes (they run, and start, as theirs);
- ``transfer``: queued and running jobs become ``to``'s (an active user): fair share
  and quotas count them as theirs from then on.

A cancelled job's reason names who and why: ``cancelled by alice (admin) before it
started: bob's account was closed``. The last admin cannot be closed, however many
admins close each other at once (service.users locks the admins' rows to count them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import select, update

from service import jobs, queue, users
from service.db import Database
from service.errors import Conflict, Invalid
from service.models import ACTIVE, Job, JobStatus, User, utcnow
from service.users import Principal

JobsChoice = Literal["cancel-queued", "cancel-all", "keep", "transfer"]
JOBS_CHOICES: tuple[JobsChoice, ...] = ("cancel-queued", "cancel-all", "keep", "transfer")


@dataclass
class Closed:
    """A closed account, and what became of its jobs (their ids)."""

    user: dict[str, Any]
    jobs: JobsChoice
    to: str | None = None
    cancelled: list[int] = field(default_factory=list)
    cancelling: list[int] = field(default_factory=list)
    transferred: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)


def deactivate(
    db: Database, actor: Principal, name: str, choice: JobsChoice = "cancel-queued",
    to: str | None = None,
) -> Closed:  # fmt: skip
    """Close ``name``'s account in one transaction: its token refused, its jobs as
    ``choice`` says (``to``: whose they become on ``transfer``)."""
    if (choice == "transfer") != (to is not None):
        raise Invalid(("query", "to"), "give to=USER with jobs=transfer, and only then")
    if to == name:
        raise Invalid(("query", "to"), f"{name}'s jobs cannot be handed to {name}")
    now = utcnow()
    why = f"{name}'s account was closed"
    with db.write() as s:
        if to is not None and s.scalar(select(User.id).where(User.name == to)) is None:
            raise Invalid(("query", "to"), f"no user {to}")
        user, *heirs = users.lock_for_change(s, name, *([to] if to else []))
        users.close_check(s, user)
        heir = heirs[0] if heirs else None
        if heir is not None and heir.revoked_at is not None:
            raise Invalid(("query", "to"), f"{to}'s account is closed: choose an active user")
        user.revoked_at = now
        user.deactivated_by = actor.name
        closed = Closed(users.public(user), choice, to)
        # The jobs in the lock order: by ascending id (service.jobs._get).
        owned = s.scalars(
            select(Job)
            .where(Job.owner == name, Job.status.in_([JobStatus.QUEUED, JobStatus.HELD, *ACTIVE]))
            .order_by(Job.id)
            .with_for_update()
        ).all()
        for job in owned:
            queued = job.status in (JobStatus.QUEUED, JobStatus.HELD)
            if choice == "keep" or (choice == "cancel-queued" and not queued):
                closed.kept.append(job.id)
            elif choice == "transfer":
                job.owner = to
                closed.transferred.append(job.id)
            elif jobs.cancel(s, job, actor, now, why):
                (closed.cancelled if queued else closed.cancelling).append(job.id)
            else:
                closed.kept.append(job.id)  # being cancelled already
        s.flush()
        users.audit(
            s, actor.name, "user.deactivate", f"user {name}",
            {"jobs": choice, "to": to, **_counts(closed)},
        )  # fmt: skip
        if closed.transferred and heir is not None:
            _settle_transfer(s, name, heir.name, now)
        closed.user = users.public(user)
        return closed


def _counts(closed: Closed) -> dict[str, int]:
    return {
        "cancelled": len(closed.cancelled),
        "cancelling": len(closed.cancelling),
        "transferred": len(closed.transferred),
        "kept": len(closed.kept),
    }


def _settle_transfer(s: Any, old: str, new: str, now: Any) -> None:
    """Jobs moved from ``old`` to ``new``: the queued ones take ``new``'s fair share,
    and both owners' quota flags are refreshed, each under its lock (taken after the
    job rows, in one order)."""
    share, _ = queue.usage_and_limits(s, new, now)
    s.execute(
        update(Job).where(Job.owner == new, Job.status == JobStatus.QUEUED).values(share=share)
    )
    for owner in sorted((old, new)):
        queue.refresh_quota_flags(s, owner)
    queue.notify_claimers(s)


def reactivate(db: Database, actor: Principal, name: str) -> tuple[dict[str, Any], str]:
    """Open a closed account again, with a new token (shown this once); its jobs stay
    as its closing left them."""
    with db.write() as s:
        [user] = users.lock_for_change(s, name)
        if user.revoked_at is None:
            raise Conflict(f"{name}'s account is open: rotate its token instead")
        token = users.new_token(user)
        user.revoked_at = None
        user.deactivated_by = None
        users.audit(s, actor.name, "user.reactivate", f"user {name}", None)
        s.flush()
        return users.public(user), token
