"""Users' caches on the workers (worker.files.caches keeps them: inductor, Triton, Hugging Face,
torch hub, matplotlib, one directory per user per worker): what the API knows of them,
who may list and clear whose, and the clear orders a worker's heartbeat reply carries.

The worker owns the files; the API owns the rule:

- A member lists and clears their own caches; an admin anyone's (every user's are listed
  when no user is named, their own cleared).
- A worker reports its caches whole (bytes, files, when each was last used), with a
  heartbeat, only when they changed: a report replaces what the API knew of that
  worker's caches (``worker_round``).
- A clear becomes an order per worker that holds a cache of the user (``worker`` narrows
  it to one). The worker does it when a heartbeat's reply carries it (a cache an attempt
  holds: when that attempt ends) and reports it on the next heartbeat; the order's row
  goes then. An order is asked again until reported; the worker does each order once.
- The orders reach heartbeat replies from each API process's memo (``Orders``), read
  from the database at most every ``REFRESH_S`` for all workers at once, and at once
  after this process took a clear: an idle heartbeat runs no statement of its own for
  them (every host heartbeats every 2 s, and its cost is counted: docs/benchmarks.md). A
  clear taken by another API process reaches its worker within ``REFRESH_S`` more.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, exists, insert, select

from ddpq.messages import CacheClearOrder
from service import users
from service.db import Database
from service.errors import Forbidden, Invalid
from service.models import CacheClear, User, Worker, WorkerCache, utcnow
from service.schemas import CacheCleared, CacheUsage
from service.users import Principal

REFRESH_S = 5.0
MAX_ORDERS = 100  # clear orders one reply carries; the rest in later ones
MAX_PENDING = 10_000  # pending orders each process keeps in mind at once
MAX_LISTED = 10_000  # caches one listing answers

_PENDING = (
    select(CacheClear.id, CacheClear.worker, CacheClear.owner)
    .order_by(CacheClear.id)
    .limit(MAX_PENDING)
)


class Orders:
    """This API process's copy of the pending clear orders, by worker."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._generation = 0  # bumped by ``stale``: a read begun before it is not fresh
        self._by_worker: dict[str, list[CacheClearOrder]] = {}
        self._reading = False

    def of(self, db: Database, worker: str) -> list[CacheClearOrder]:
        """The orders for ``worker``: read again by one heartbeat when the copy is older
        than refresh_s (the others meanwhile answer from the copy)."""
        with self._lock:
            due = not self._reading and time.monotonic() - self._read_at >= self.refresh_s
            self._reading = self._reading or due
            generation = self._generation
        if due:
            began = time.monotonic()
            by: defaultdict[str, list[CacheClearOrder]] = defaultdict(list)
            try:
                for r in db.read_all(_PENDING, {}):
                    by[r.worker].append(CacheClearOrder(id=r.id, user=r.owner))
            finally:
                with self._lock:
                    self._reading = False
            with self._lock:
                self._by_worker = dict(by)
                if generation == self._generation:
                    self._read_at = began
        with self._lock:
            return list(self._by_worker.get(worker, ())[:MAX_ORDERS])

    def stale(self) -> None:
        """A clear was taken: the next heartbeat reads the orders again."""
        with self._lock:
            self._generation += 1
            self._read_at = float("-inf")

    def done(self, worker: str, ids: set[int]) -> None:
        with self._lock:
            left = [o for o in self._by_worker.get(worker, ()) if o.id not in ids]
            self._by_worker[worker] = left


# ---- a worker's heartbeat --------------------------------------------------------------


def worker_round(
    db: Database,
    orders: Orders,
    worker: str,
    reported: Sequence[CacheUsage] | None,
    cleared: Sequence[CacheCleared],
) -> list[CacheClearOrder]:
    """Store what ``worker`` reports (its caches whole, when they changed; the orders it
    did); answer the clear orders it is to do."""
    if reported is not None or cleared:
        now = utcnow()
        with db.write() as s:
            if reported is not None:
                s.execute(delete(WorkerCache).where(WorkerCache.worker == worker))
                by_user = {c.user: c for c in reported}  # a user twice: the last one
                if by_user:
                    s.execute(
                        insert(WorkerCache),
                        [
                            {
                                "worker": worker,
                                "owner": c.user,
                                "bytes": c.bytes,
                                "files": c.files,
                                "last_used": now - timedelta(seconds=c.idle_s),
                                "reported_at": now,
                            }
                            for c in by_user.values()
                        ],
                    )
            if cleared:
                ids = [c.id for c in cleared]
                # Its own orders only: a report naming another worker's changes nothing.
                s.execute(
                    delete(CacheClear).where(CacheClear.worker == worker, CacheClear.id.in_(ids))
                )
        if cleared:
            orders.done(worker, {c.id for c in cleared})
    return orders.of(db, worker)


# ---- people ----------------------------------------------------------------------------


def _whose(db: Database, me: Principal, user: str | None, verb: str) -> str | None:
    """The user whose caches ``me`` may ``verb`` (None: everyone's, an admin's listing);
    another member's is refused, and audited as every refusal of a known user is."""
    if user is not None and user != me.name and not me.admin:
        why = f"{me.name} is a member: a member {verb} only their own caches"
        action = "cache.list" if verb == "lists" else "cache.clear"
        users.audit_refused(db, me.name, action, f"caches of {user}", why)
        raise Forbidden(why)
    return user


def public(row: Any, clearing: bool) -> dict[str, Any]:
    return {
        "worker": row.worker,
        "user": row.owner,
        "bytes": row.bytes,
        "files": row.files,
        "last_used": row.last_used,
        "reported_at": row.reported_at,
        "clearing": clearing,
    }


def listing(db: Database, me: Principal, user: str | None, worker: str | None) -> list[Any]:
    """Each cache as its worker last reported it, by user then worker: ``user``'s (a
    member: their own; an admin without ``user``: everyone's), on ``worker`` if named."""
    owner = _whose(db, me, user, "lists")
    if owner is None and not me.admin:
        owner = me.name
    clearing = (
        exists()
        .where(CacheClear.worker == WorkerCache.worker, CacheClear.owner == WorkerCache.owner)
        .label("clearing")
    )
    q = select(WorkerCache, clearing).order_by(WorkerCache.owner, WorkerCache.worker)
    if owner is not None:
        q = q.where(WorkerCache.owner == owner)
    if worker is not None:
        q = q.where(WorkerCache.worker == worker)
    with db.read() as s:
        return [public(row, bool(c)) for row, c in s.execute(q.limit(MAX_LISTED))]


def clear(
    db: Database, orders: Orders, me: Principal, user: str | None, worker: str | None
) -> list[Any]:
    """Ask each worker that holds a cache of ``user`` (``me`` when None), or ``worker``
    alone, to clear it; the caches asked for (none when no worker reported one)."""
    owner = _whose(db, me, user, "clears") or me.name
    with db.write() as s:
        if worker is not None and s.get(Worker, worker) is None:
            raise Invalid(("body", "worker"), f"no worker {worker} is registered")
        if owner != me.name and s.scalar(select(User.id).where(User.name == owner)) is None:
            raise Invalid(("body", "user"), f"no user {owner}")
        q = select(WorkerCache).where(WorkerCache.owner == owner)
        if worker is not None:
            q = q.where(WorkerCache.worker == worker)
        rows = list(s.scalars(q.order_by(WorkerCache.worker)))
        asked = set(s.scalars(select(CacheClear.worker).where(CacheClear.owner == owner)))
        now = utcnow()
        for r in rows:
            if r.worker not in asked:  # one order per cache is enough
                s.add(CacheClear(worker=r.worker, owner=owner, asked_by=me.name, asked_at=now))
        if rows:
            names = [r.worker for r in rows]
            users.audit(s, me.name, "cache.clear", f"caches of {owner}", {"workers": names[:100]})
        items = [public(r, True) for r in rows]
    orders.stale()
    return items
