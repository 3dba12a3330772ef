"""Writers that lock several attempts lock them in one order, the jobs': the sweep's
count of running attempts' use and a heartbeat renewing the same attempts, released
together over many rounds, never deadlock. On Postgres they did (the fleet benchmark's
heartbeats answered 503 a few times a minute): the count locked in the attempts' own id
order, a heartbeat in job order, and attempts claimed out of job order (a later job of
higher priority first) cross. 30 rounds catch a 10 % race with probability > 95 %.

Cheap: no server; the service's functions on both databases.
"""

from __future__ import annotations

import itertools

from service import jobs, queue
from service.db import Database
from service.models import utcnow
from service.schemas import JobSpec
from tests.helpers import together

ROUNDS = 30
JOBS = 200  # a sweep's scan long enough for a heartbeat to cross it
HEARTBEATS = 4
_tokens = itertools.count(1)


def test_a_usage_sweep_and_a_heartbeat_never_deadlock(db: Database) -> None:
    queue.register_worker(db, "w", None, "host", JOBS, [], "/c")
    # Claimed latest job first: attempt ids run against job ids.
    for i in range(JOBS):
        spec = JobSpec(entrypoint="x.py", device="cpu", priority=i)
        jobs.submit_job(db, spec, None, owner=f"user{i % 3}", admin=True)
    keys = []
    for _ in range(JOBS):
        claim = queue.claim_next_job(db, "w", JOBS, [], f"{next(_tokens):064x}")
        assert claim is not None
        keys.append((claim.job_id, claim.attempt))
    assert keys == sorted(keys, reverse=True)

    def sweep() -> int:
        with db.write() as s:
            return queue.count_running(s, utcnow())

    def beat(i: int) -> object:
        # The highest job (the sweep's first row, in attempt order) and a low one.
        return lambda: queue.record_heartbeat(db, "w", [keys[i], keys[-1 - i]])

    for _ in range(ROUNDS):
        out = together(sweep, *(beat(i) for i in range(HEARTBEATS)))
        for result in out:
            assert not isinstance(result, Exception), repr(result)
