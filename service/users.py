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

from sqlalchemy import Table, bindparam, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import queue
from service.db import Database
from service.errors import Conflict, Invalid, NotFound
from service.models import AuditEvent, Quota, User, UserRole, utcnow
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
            if s.scalar(select(User.id).where(User.name == name)) is not None:
                raise Conflict(f"user {name} exists: rotate its token, or choose another name")
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


def revoke_user(db: Database, actor: Principal, name: str) -> dict[str, Any]:
    """Its token stops working at once; its jobs stay (and stay its)."""
    with db.write() as s:
        user = _get(s, name)
        if user.revoked_at is not None:
            raise Conflict(f"user {name} is already revoked")
        if user.role == UserRole.ADMIN and _live_admins(s) <= 1:
            raise Conflict(f"{name} is the last admin: add another admin first")
        user.revoked_at = utcnow()
        _audit(s, actor.name, "user.revoke", f"user {name}", None)
        s.flush()
        return public(user)


def rotate_user(db: Database, actor: Principal, name: str) -> tuple[dict[str, Any], str]:
    """A new token for ``name``; the old one stops working at once."""
    token, token_hash = mint(USER_TOKEN_PREFIX)
    with db.write() as s:
        user = _get(s, name)
        if user.revoked_at is not None:
            raise Conflict(f"user {name} is revoked: add it again under a new name")
        user.token_hash = token_hash
        user.token_hint = token[:HINT_CHARS]
        user.token_created_at = utcnow()
        _audit(s, actor.name, "user.rotate", f"user {name}", None)
        s.flush()
        return public(user), token


def _get(s: Session, name: str) -> User:
    user = s.scalar(select(User).where(User.name == name))
    if user is None:
        raise NotFound(f"no user {name}")
    return user


def _live_admins(s: Session) -> int:
    q = select(func.count()).where(User.role == UserRole.ADMIN, User.revoked_at.is_(None))
    return int(s.scalar(q) or 0)


# ---- the audit trail ----------------------------------------------------------------------


def audit(s: Session, actor: str | None, action: str, target: str, detail: Any = None) -> None:
    """Record, in the caller's transaction, that ``actor`` did ``action`` to ``target``."""
    _audit(s, actor or "-", action, target, detail)


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
            }
            for q in s.scalars(select(Quota).order_by(Quota.owner))
        ]


def set_quota(db: Database, actor: Principal, owner: str, limits: dict[str, int | None]) -> None:
    """Set ``owner``'s limits (``*``: everyone's default); their queued jobs are held
    back, or let go, at once."""
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
        s.flush()
        _audit(s, actor.name, "quota.set", f"quota {owner}", limits)
        _reflag(s, owner)
        queue.notify_claimers(s)


def clear_quota(db: Database, actor: Principal, owner: str) -> None:
    with db.write() as s:
        row = s.get(Quota, owner)
        if row is None:
            raise NotFound(f"no quota for {owner}")
        s.delete(row)
        s.flush()
        _audit(s, actor.name, "quota.clear", f"quota {owner}", None)
        _reflag(s, owner)
        queue.notify_claimers(s)


def _reflag(s: Session, owner: str) -> None:
    if owner == queue.DEFAULT_QUOTA:
        queue.refresh_all_quota_flags(s)
    else:
        queue.refresh_quota_flags(s, owner)
