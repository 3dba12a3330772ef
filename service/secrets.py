"""Users' secrets (docs/security.md): the one owner of how a value is kept, who may touch it, and
the one way it leaves the API.

A secret is a user's named value (a WANDB_API_KEY) that a job of theirs names in its spec
(``secrets: [NAME]``) and that its ranks get as that environment variable. Where a plain
``env`` value is part of the spec every member reads (GET /jobs), a secret's value is in
no answer to a person, no log and no audit row:

- **At rest** it is AES-256-GCM ciphertext (``cryptography``'s AESGCM, a random 96-bit
  nonce per write), sealed with its owner and name as associated data, so a ciphertext
  copied into another row (another user's, another name) does not open. Each row names
  the key that sealed it (``key_id``, a digest of the key, never the key): the key is the
  API's setting ``DDPQ_SECRETS_KEY`` (service.config), and rows under a key named in
  ``DDPQ_SECRETS_OLD_KEYS`` are sealed again with the current one at start (``rekey``).
- **Who**: each user sets, lists and deletes only their own; an admin may list anyone's
  names, never read a value (no route answers one to a user token).
- **Out** it goes only in a worker's claim (worker token), looked up for the job's owner
  at that claim (``for_claim``), so a retried or resubmitted job gets the current value;
  and to the nodes of a Slurm attempt, which fetch them with their job token rather than
  carry them in the batch script Slurm keeps (``for_attempt``). A secret gone since the
  submit (deleted, or under a key this API lacks) makes the claim carry the problem
  instead: the worker fails the attempt with words naming it, running nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import CursorResult, delete, func, select

from ddpq import rules
from ddpq.jobspec import ClaimedSpec
from ddpq.messages import ClaimedJob
from service import config, queue, users
from service.db import Database
from service.errors import Conflict, Forbidden, Invalid, NotFound, ServiceError
from service.models import Attempt, Job, Secret, Worker, utcnow
from service.users import Principal

log = logging.getLogger("ddpq.service")
NONCE_BYTES = 12  # AES-GCM's standard nonce; random per write (2^-32 collision bound far off)
KEY_ID_CHARS = 16


class SecretUnreadable(ServiceError):
    """A stored secret that the API's keys cannot open (the key it names is not among
    them, or its ciphertext was changed or moved): said with its name, never a value."""


def key_id(key: bytes) -> str:
    """The id a row stores for the key that sealed it: a digest of the key (it cannot
    give the key back), so rows tell which key they need."""
    return hashlib.sha256(b"ddpq secrets key id\0" + key).hexdigest()[:KEY_ID_CHARS]


def _associated(owner: str, name: str) -> bytes:
    # Owner names and secret names hold no NUL (service.users.NAME, rules.ENV_NAME): the
    # pair is read back one way only.
    return b"ddpq secret\0" + owner.encode() + b"\0" + name.encode()


@dataclass(frozen=True)
class Keyring:
    """The key new values are sealed with, and old ones still opened until ``rekey``."""

    current: bytes
    old: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, settings: config.Settings) -> Keyring:
        return cls(config.secrets_key(settings), tuple(config.old_keys(settings)))

    @property
    def current_id(self) -> str:
        return key_id(self.current)

    def seal(self, owner: str, name: str, value: str) -> tuple[str, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        sealed = AESGCM(self.current).encrypt(nonce, value.encode(), _associated(owner, name))
        return self.current_id, nonce + sealed

    def open(self, owner: str, name: str, kid: str, sealed: bytes) -> str:
        key = next((k for k in (self.current, *self.old) if key_id(k) == kid), None)
        if key is None:
            raise SecretUnreadable(
                f"secret {name} of {owner} was stored under key {kid}, which this API does "
                f"not have (its DDPQ_SECRETS_KEY is key {self.current_id}): set it again"
            )
        try:
            value = AESGCM(key).decrypt(
                sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _associated(owner, name)
            )
        except (InvalidTag, ValueError):
            raise SecretUnreadable(
                f"secret {name} of {owner} does not open with key {kid} (its stored value "
                "was changed, or belongs to another row): set it again"
            ) from None
        return value.decode()


# ---- people: set, list, delete ------------------------------------------------------------


def put(db: Database, keys: Keyring, me: Principal, name: str, value: str) -> dict[str, Any]:
    """Set ``me``'s secret ``name`` (created or replaced); its listing row."""
    problem = rules.secret_name_problem(name)
    if problem:
        raise Invalid(("path", "name"), problem)
    problem = rules.secret_value_problem(value)
    if problem:
        raise Invalid(("body", "value"), f"the value {problem}")
    now = utcnow()
    kid, sealed = keys.seal(me.name, name, value)
    with db.write() as s:
        row = s.get(Secret, (me.name, name), with_for_update=True)
        if row is None:
            held = s.scalar(select(func.count()).where(Secret.owner == me.name)) or 0
            if held >= rules.MAX_USER_SECRETS:
                raise Conflict(
                    f"{me.name} keeps {held} secrets, the most a user may "
                    f"({rules.MAX_USER_SECRETS}): delete one first"
                )
            row = Secret(owner=me.name, name=name, created_at=now)
            s.add(row)
        row.key_id, row.sealed, row.updated_at = kid, sealed, now
        # The name only: the audit trail is read by every admin.
        users.audit(s, me.name, "secret.set", f"secret {name}")
        s.flush()
        return _public(row)


def listing(db: Database, me: Principal, user: str | None) -> list[dict[str, Any]]:
    """``user``'s secrets (``me``'s when None), names and times only: anyone's for an
    admin, only one's own for a member (refused, and audited: a member probing another's
    secrets is what an admin reads the trail for)."""
    owner = user or me.name
    if owner != me.name and not me.admin:
        why = f"{me.name} is a member: a member lists only their own secrets"
        users.audit_refused(db, me.name, "secret.list", f"secrets of {owner}", why)
        raise Forbidden(why)
    with db.read() as s:
        rows = s.scalars(select(Secret).where(Secret.owner == owner).order_by(Secret.name))
        return [_public(r) for r in rows]


def remove(db: Database, me: Principal, name: str) -> None:
    """Delete ``me``'s secret ``name``. A queued job that names it fails when it is
    claimed, with words naming it (``for_claim``)."""
    with db.write() as s:
        gone = s.execute(delete(Secret).where(Secret.owner == me.name, Secret.name == name))
        if not cast(CursorResult[Any], gone).rowcount:
            raise NotFound(f"{me.name} has no secret named {name[:128]}")
        users.audit(s, me.name, "secret.delete", f"secret {name}")


def _public(row: Secret) -> dict[str, Any]:
    return {
        "name": row.name,
        "owner": row.owner,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


def require(db: Database, owner: str, names: Iterable[str]) -> None:
    """A submit by ``owner`` names only secrets ``owner`` has (422 naming the first
    missing one): another user's secret is never theirs to use."""
    wanted = list(names)
    if not wanted:
        return
    with db.read() as s:
        have = set(
            s.scalars(select(Secret.name).where(Secret.owner == owner, Secret.name.in_(wanted)))
        )
    missing = [n for n in wanted if n not in have]
    if missing:
        raise Invalid(
            ("body", "secrets"),
            f"{owner} has no secret named {', '.join(missing)[:300]}: set it first "
            f"(`ddpq secrets set {missing[0]}`); a job uses only its owner's secrets",
        )


# ---- out: to a worker's claim, to a Slurm attempt's nodes ---------------------------------


def names_of(spec: ClaimedSpec | dict[str, Any]) -> list[str]:
    """The secrets a spec names: a claim's (typed), or a job row's stored dict."""
    if isinstance(spec, ClaimedSpec):
        return list(spec.secrets)
    names = spec.get("secrets") or []
    return [str(n) for n in names] if isinstance(names, list) else []


def values(db: Database, keys: Keyring, owner: str | None, names: list[str]) -> dict[str, str]:
    """The values of ``owner``'s secrets ``names``; SecretUnreadable naming any that is
    gone or does not open."""
    if owner is None:
        raise SecretUnreadable("the job has no owner, so it has no secrets")
    with db.read() as s:
        rows = {
            r.name: r
            for r in s.scalars(select(Secret).where(Secret.owner == owner, Secret.name.in_(names)))
        }
    missing = [n for n in names if n not in rows]
    if missing:
        raise SecretUnreadable(
            f"secret {', '.join(missing)[:300]} of {owner} is gone (deleted since the job "
            f"was submitted): set it again (`ddpq secrets set {missing[0]}`) and resubmit"
        )
    return {n: keys.open(owner, n, rows[n].key_id, rows[n].sealed) for n in names}


def for_claim(db: Database, keys: Keyring, claim: ClaimedJob) -> ClaimedJob:
    """``claim`` with the values of the secrets its spec names, looked up for the job's
    owner now (or, when one cannot be given, the words why: the worker fails the attempt
    with them). A claim naming none costs nothing."""
    names = names_of(claim.spec)
    if not names:
        return claim
    with db.read() as s:
        owner = s.scalar(select(Job.owner).where(Job.id == claim.job_id))
    try:
        found = values(db, keys, owner, names)
    except SecretUnreadable as exc:
        return claim.model_copy(update={"secrets_problem": str(exc)})
    return claim.model_copy(update={"secrets": found})


def for_attempt(db: Database, keys: Keyring, attempt: Attempt) -> dict[str, str]:
    """What the nodes of a Slurm attempt fetch with its job token (the bridge keeps the
    values out of the batch script, which Slurm stores): its job's secrets, for a live
    attempt of a bridge only (a worker's ranks have them in their environment already)."""
    with db.read() as s:
        job = s.get(Job, attempt.job_id)
        now = s.get(Attempt, attempt.id)
        cluster = s.scalar(select(Worker.cluster).where(Worker.name == attempt.worker))
        if job is None or now is None:
            raise NotFound(f"no job {attempt.job_id}")
        stale = queue.fenced(attempt.number, now.ended_at is not None, job.attempt, job.status)
        owner, spec = job.owner, dict(job.spec)
    if stale:  # it ended between the token's check and this read
        raise Conflict(stale)
    if cluster is None:
        raise Conflict(
            f"attempt {attempt.number} runs on worker {attempt.worker}, which gives its "
            "ranks their secrets itself"
        )
    try:
        return values(db, keys, owner, names_of(spec))
    except SecretUnreadable as exc:
        raise Conflict(str(exc)) from None


# ---- the key ------------------------------------------------------------------------------


def rekey(db: Database, keys: Keyring) -> int:
    """Seal again with the current key every secret under an old one (at start, after a
    rotation); rows under a key this API lacks are left as they are (each says so when a
    job needs it). Returns how many were sealed again."""
    old = {key_id(k) for k in keys.old}
    if not old:
        return 0
    done = 0
    with db.write() as s:
        for row in s.scalars(select(Secret).where(Secret.key_id.in_(old)).with_for_update()):
            try:
                value = keys.open(row.owner, row.name, row.key_id, row.sealed)
            except SecretUnreadable as exc:  # said again when a job needs it
                log.warning("%s", exc)
                continue
            row.key_id, row.sealed = keys.seal(row.owner, row.name, value)
            done += 1
    return done
