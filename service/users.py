"""People: users, their roles and tokens, and the audit trail of what they did.

A user is a name, a role (admin: everything, manages users; member: submits, sees every
job, cancels only its own) and a token, of which only the sha256 is stored, with its
first characters to tell tokens apart. Tokens start with ``ddpqu_`` (like GitHub's
``ghp_``), so secret scanners can find a leaked one. The token ``ddpq serve`` was given
or generated (DDPQ_API_TOKEN, ``var/api-token``) becomes the first admin's, ``admin``,
the first time the API starts on an empty database: set-ups from before users existed
keep working. Every check reads the database: a revoked or rotated token is refused at
once by every API process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import queue
from service.db import Database
from service.errors import Conflict, Invalid, NotFound
from service.models import AuditEvent, Job, JobStatus, Quota, User, UserRole, utcnow
from service.tokens import USER_TOKEN_PREFIX, mint

FIRST_ADMIN = "admin"
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # fullmatch
HINT_CHARS = len(USER_TOKEN_PREFIX) + 4

_USERS = cast(Table, User.__table__)
# Every request with a user token runs this: built once (see service.jobs).
_BY_TOKEN = select(_USERS.c.name, _USERS.c.role).where(
    _USERS.c.token_hash == bindparam("token_hash"), _USERS.c.revoked_at.is_(None)
)


@dataclass(frozen=True)
class Principal:
    """Who a request comes from."""

    name: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == UserRole.ADMIN


def name_problem(name: str) -> str | None:
    if not NAME.fullmatch(name):
        return (
            "a user name is 1 to 64 lower-case letters, digits, '.', '_' or '-', starting "
            "with a letter or a digit"
        )
    return None


def authenticate(db: Database, token_hash: str) -> Principal | None:
    """The live user whose token hashes to ``token_hash``, or None."""
    row = db.read_one(_BY_TOKEN, {"token_hash": token_hash})
    return Principal(row[0], row[1]) if row is not None else None


def bootstrap(db: Database, token_hash: str) -> bool:
    """On an empty users table: the configured API token becomes the first admin's.
    True if it did (two API processes starting at once: one of them)."""
    with db.read() as s:
        if s.scalar(select(func.count()).select_from(User)):
            return False
    now = utcnow()
    try:
        with db.write() as s:
            if s.scalar(select(func.count()).select_from(User)):
                return False
            s.add(
                User(
                    name=FIRST_ADMIN,
                    role=UserRole.ADMIN,
                    token_hash=token_hash,
                    token_hint="(DDPQ_API_TOKEN)",  # noqa: S106 - a label, not a token
                    created_at=now,
                    token_created_at=now,
                )
            )
            _audit(s, FIRST_ADMIN, "user.add", f"user {FIRST_ADMIN}", {"role": "admin"})
    except IntegrityError:
        return False
    return True


def public(u: User) -> dict[str, Any]:
    return {
        "name": u.name,
        "role": u.role,
        "token_hint": u.token_hint,
        "created_at": u.created_at,
        "revoked_at": u.revoked_at,
        "state": "deactivated" if u.revoked_at is not None else "active",
        "deactivated_by": u.deactivated_by,
    }


def list_users(db: Database) -> list[dict[str, Any]]:
    with db.read() as s:
        return [public(u) for u in s.scalars(select(User).order_by(User.name))]


def add_user(db: Database, actor: Principal, name: str, role: str) -> tuple[dict[str, Any], str]:
    """A new user and its token (the only time it is shown)."""
    problem = name_problem(name)
    if problem:
        raise Invalid(("body", "name"), problem)
    token, token_hash = mint(USER_TOKEN_PREFIX)
    now = utcnow()
    try:
        with db.write() as s:
            existing = s.scalar(select(User).where(User.name == name))
            if existing is not None:
                raise Conflict(_taken(existing))
            user = User(
                name=name,
                role=role,
                token_hash=token_hash,
                token_hint=token[:HINT_CHARS],
                created_at=now,
                token_created_at=now,
            )
            s.add(user)
            _audit(s, actor.name, "user.add", f"user {name}", {"role": role})
            s.flush()
            return public(user), token
    except IntegrityError:  # the same name added by two requests at once
        raise Conflict(f"user {name} exists: rotate its token, or choose another name") from None


def _taken(user: User) -> str:
    """Why a name cannot be added: it is someone's, or was (never reused silently)."""
    if user.revoked_at is None:
        return f"user {user.name} exists: rotate its token, or choose another name"
    return (
        f"{user.name}'s account was closed on {user.revoked_at:%Y-%m-%d} by "
        f"{user.deactivated_by or 'an admin'}; its name stays its own (the audit trail and "
        f"usage history name it): `ddpq users reactivate {user.name}` opens it again, or "
        "choose another name"
    )


def rotate_user(db: Database, actor: Principal, name: str) -> tuple[dict[str, Any], str]:
    """A new token for ``name``; the old one stops working at once."""
    with db.write() as s:
        [user] = lock_for_change(s, name)
        if user.revoked_at is not None:
            raise Conflict(
                f"{name}'s account is closed: `ddpq users reactivate {name}` opens it again "
                "with a new token"
            )
        token = new_token(user)
        _audit(s, actor.name, "user.rotate", f"user {name}", None)
        s.flush()
        return public(user), token


def new_token(user: User) -> str:
    """Give ``user`` (a row the caller locked) a new token; the token, shown once."""
    token, token_hash = mint(USER_TOKEN_PREFIX)
    user.token_hash = token_hash
    user.token_hint = token[:HINT_CHARS]
    user.token_created_at = utcnow()
    return token


def lock_for_change(s: Session, *names: str) -> list[User]:
    """The rows of ``names``, locked in one order (the admins' first, when one of them is
    an admin: ``close_check`` counts them), read afresh. NotFound for a name that is
    nobody's."""
    roles = dict(s.execute(select(User.name, User.role).where(User.name.in_(names))).all())
    for name in names:
        if name not in roles:
            raise NotFound(f"no user {name}")
    if UserRole.ADMIN in roles.values():
        _live_admins(s)  # locked first, as every change that counts them does
    rows = s.scalars(
        select(User)
        .where(User.name.in_(names))
        .order_by(User.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).all()
    by_name = {u.name: u for u in rows}
    return [by_name[n] for n in names]


def close_check(s: Session, user: User) -> None:
    """Conflict unless ``user``'s account (a row locked by lock_for_change) may close."""
    if user.revoked_at is not None:
        raise Conflict(f"{user.name}'s account is already closed")
    if user.role == UserRole.ADMIN and _live_admins(s) <= 1:
        raise Conflict(f"{user.name} is the last admin: add another admin first")


def _live_admins(s: Session) -> int:
    """How many admins are live, their rows locked until the transaction ends (Postgres;
    SQLite serialises writers): two admins revoking each other at once each counted two
    under READ COMMITTED and both won, leaving none. Locked, the second waits for the
    first and counts again (a row its WHERE no longer matches is not returned)."""
    q = (
        select(User.id)
        .where(User.role == UserRole.ADMIN, User.revoked_at.is_(None))
        .order_by(User.id)  # one lock order
        .with_for_update()
    )
    return len(s.scalars(q).all())


# ---- the audit trail ----------------------------------------------------------------------


def audit(s: Session, actor: str | None, action: str, target: str, detail: Any = None) -> None:
    """Record, in the caller's transaction, that ``actor`` did ``action`` to ``target``."""
    _audit(s, actor or "-", action, target, detail)


def audit_refused(db: Database, actor: str | None, action: str, target: str, why: str) -> None:
    """Record, in a transaction of its own, that ``actor`` tried ``action`` on ``target``
    and was refused (``refused.ACTION``), with why: who tried what on whose job."""
    with db.write() as s:
        _audit(s, actor or "-", f"refused.{action}"[:32], target[:200], {"why": why[:500]})


def _audit(s: Session, actor: str, action: str, target: str, detail: Any) -> None:
    s.add(AuditEvent(at=utcnow(), actor=actor, action=action, target=target, detail=detail))


def audit_trail(db: Database, limit: int, cursor: int | None) -> tuple[list[Any], str | None]:
    """Newest first; ``cursor`` is the id the previous page ended at."""
    q = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit + 1)
    if cursor is not None:
        q = q.where(AuditEvent.id < cursor)
    with db.read() as s:
        rows = list(s.scalars(q))
        more = len(rows) > limit
        rows = rows[:limit]
        items = [
            {
                "id": e.id,
                "at": e.at,
                "actor": e.actor,
                "action": e.action,
                "target": e.target,
                "detail": e.detail or {},
            }
            for e in rows
        ]
    return items, (str(rows[-1].id) if more and rows else None)


# ---- quotas -------------------------------------------------------------------------------


def list_quotas(db: Database) -> list[dict[str, Any]]:
    with db.read() as s:
        return [
            {
                "user": q.owner,
                "max_gpus": q.max_gpus,
                "max_running": q.max_running,
                "max_queued": q.max_queued,
                "max_priority": q.max_priority,
            }
            for q in s.scalars(select(Quota).order_by(Quota.owner))
        ]


def set_quota(db: Database, actor: Principal, owner: str, limits: dict[str, int | None]) -> None:
    """Set ``owner``'s limits (``*``: everyone's default); their queued jobs are held
    back, or let go, at once, and a lowered priority cap lowers the priority of the
    jobs of theirs queued or running above it (preemption goes no further than it)."""
    if owner != queue.DEFAULT_QUOTA:
        problem = name_problem(owner)
        if problem:
            raise Invalid(("path", "name"), problem)
    with db.write() as s:
        row = s.get(Quota, owner)
        if row is None:
            row = Quota(owner=owner)
            s.add(row)
        row.max_gpus = limits.get("max_gpus")
        row.max_running = limits.get("max_running")
        row.max_queued = limits.get("max_queued")
        row.max_priority = limits.get("max_priority")
        s.flush()
        lowered = _clamp_priorities(s, owner)
        detail = {**limits, "lowered": lowered[:50]} if lowered else limits
        _audit(s, actor.name, "quota.set", f"quota {owner}", detail)
        _reflag(s, owner)
        queue.notify_claimers(s)


def clear_quota(db: Database, actor: Principal, owner: str) -> None:
    with db.write() as s:
        row = s.get(Quota, owner)
        if row is None:
            raise NotFound(f"no quota for {owner}")
        s.delete(row)
        s.flush()
        lowered = _clamp_priorities(s, owner)
        _audit(
            s,
            actor.name,
            "quota.clear",
            f"quota {owner}",
            {"lowered": lowered[:50]} if lowered else None,
        )
        _reflag(s, owner)
        queue.notify_claimers(s)


_OWN_CAP = select(Quota.max_priority).where(Quota.owner == Job.owner).scalar_subquery()
_DEFAULT_CAP = (
    select(Quota.max_priority).where(Quota.owner == queue.DEFAULT_QUOTA).scalar_subquery()
)
# A job's owner's cap (queue.Limits.max_priority, field by field), correlated to its row.
_CAP = func.coalesce(_OWN_CAP, _DEFAULT_CAP, 0)


def _clamp_priorities(s: Session, owner: str) -> list[int]:
    """Lower to their owner's cap the priority of members' jobs queued or running above
    it (``owner``'s, or everyone's for the default); the ids lowered. Before the owners'
    locks are taken (_reflag): this waits for rows others hold."""
    members = select(User.name).where(User.role == UserRole.MEMBER)
    q = update(Job).where(
        Job.status.in_([JobStatus.QUEUED, JobStatus.HELD, JobStatus.RUNNING, JobStatus.CANCELLING]),
        Job.owner.in_(members),
        Job.priority > _CAP,
    )
    if owner != queue.DEFAULT_QUOTA:
        q = q.where(Job.owner == owner)
    return sorted(s.scalars(q.values(priority=_CAP).returning(Job.id)))


def _reflag(s: Session, owner: str) -> None:
    if owner == queue.DEFAULT_QUOTA:
        queue.refresh_all_quota_flags(s)
    else:
        queue.refresh_quota_flags(s, owner)
