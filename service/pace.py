"""How often workers heartbeat and how long a worker's lease runs, set by the size of the
fleet, so the API's heartbeat load does not grow with it.

Every live worker heartbeats once an interval: 1,000 hosts at the configured 2 s are 500
heartbeats a second, a third of an API process (docs/benchmarks.md, "How it grows").
As Nomad does (``max_heartbeats_per_second``), the interval handed to workers is the
configured one (``DDPQ_HEARTBEAT_S``) or, once the fleet is larger, what keeps the whole
fleet within ``DDPQ_MAX_HEARTBEATS_PER_S``: ``live / budget`` seconds. The lease grows
with it and keeps the slack the settings give a late heartbeat (``DDPQ_LEASE_S`` less
``DDPQ_HEARTBEAT_S``: 28 s by default), so a host that stops is lost one interval and
that slack after its last heartbeat, at any size, and no heartbeat that arrives within
its interval and the slack is ever too late.

When the fleet shrinks the interval shrinks, but workers learn it only at their next
heartbeat, one old interval later: until then the lease stays the old interval's
(``Pace.update``), so a worker still waiting out the old interval is never lost for it.
Claim long-polls follow the same rule: a worker holds one open and sends the next when it
ends, so 1,000 hosts polling for the protocol's 5 s (``CLAIM_WAIT_S``) are 200 requests a
second that find nothing. A poll is held for the interval too (at most
``DDPQ_MAX_CLAIM_WAIT_S``): a longer poll delays nothing, since a submit or a finish wakes
the polls it concerns at once (service.wakeup).

An open poll also re-checks now and then (``DDPQ_CLAIM_RECHECK_S``, 1 s) for a wake-up it
was not among the first woken for; 1,000 open polls re-checking every second kept most of
an API process busy with nothing to do. The re-check is slowed in step, to at most
``RECHECKS_PER_HEARTBEAT`` times the heartbeat budget a second for the whole fleet.

Each API process keeps its own pace from the same count of live workers (the sweeper's
loop, every round); two processes that differ for a round differ by a few workers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ddpq.messages import CLAIM_WAIT_S

# A long-poll's re-check costs the API no database work and no request: this many of them
# for one heartbeat's worth of budget.
RECHECKS_PER_HEARTBEAT = 4


@dataclass
class Pace:
    """The interval and lease now in force. ``heartbeat_s`` and ``lease_s`` are the
    settings' (the least they ever are); ``budget`` the fleet's heartbeats a second."""

    heartbeat_s: float
    lease_s: float
    budget: float
    interval: float = 0.0  # handed to workers now
    lease: float = 0.0  # a worker is lost after this long without a heartbeat
    _older: tuple[float, float] = (0.0, 0.0)  # a longer interval's lease, kept until then
    _live: int = 0  # live workers, as last counted

    def __post_init__(self) -> None:
        self.interval = self.heartbeat_s
        self.lease = self.lease_s

    def _lease_of(self, interval: float) -> float:
        return interval + max(0.0, self.lease_s - self.heartbeat_s)

    def update(self, live: int, now: float) -> bool:
        """The pace for ``live`` workers at ``now`` (monotonic seconds); whether the
        lease changed."""
        self._live = live
        interval = max(self.heartbeat_s, live / self.budget if self.budget > 0 else 0.0)
        if interval < self.interval:  # the old interval's lease until all have heard
            older = (self._lease_of(self.interval), now + self.interval)
            lease, until = self._older
            if now < until:  # an earlier one still in force: the longer of both
                older = (max(lease, older[0]), max(until, older[1]))
            self._older = older
        self.interval = interval
        lease, until = self._older
        new = max(self.lease_s, self._lease_of(interval), lease if now < until else 0.0)
        changed, self.lease = new != self.lease, new
        return changed

    def claim_wait(self, longest: float) -> float:
        """How long a worker is to hold its claim long-poll open: the interval, not less
        than the protocol's default nor more than ``longest`` (DDPQ_MAX_CLAIM_WAIT_S)."""
        return min(longest, max(CLAIM_WAIT_S, self.interval))

    def recheck(self, every: float) -> float:
        """How often an open long-poll re-checks: ``every`` (DDPQ_CLAIM_RECHECK_S), or
        less often in a fleet whose polls would re-check more than their budget."""
        if self.budget <= 0:
            return every
        return max(every, self._live / (self.budget * RECHECKS_PER_HEARTBEAT))

    def handed(self) -> float:
        """The interval for one heartbeat's reply: past the settings' own, up to a tenth
        shorter at random, so a fleet that registered at once does not heartbeat in
        step (Nomad staggers its TTLs likewise); within the lease either way."""
        if self.interval <= self.heartbeat_s:
            return self.interval
        return self.interval * random.uniform(0.9, 1.0)
