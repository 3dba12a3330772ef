"""The job state machine (service/queue/states.py): the table, its one owner, its picture.

Cheap: no server. The moves as the service makes them are driven at random, on both
databases, by tests/test_states_property.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.errors import Conflict
from service.models import ACTIVE, TERMINAL, JobStatus
from service.queue.states import MOVES, Event, IllegalMove, diagram, move, sources

REPO = Path(__file__).resolve().parent.parent
PAIRS = [(status, event) for status in [None, *JobStatus] for event in Event]


@pytest.mark.parametrize(("status", "event"), PAIRS, ids=lambda v: str(v))
def test_every_move_is_in_the_table_or_refused_naming_both_states(
    status: JobStatus | None, event: Event
) -> None:
    legal = {(m.source, m.event): m for m in MOVES}
    if (status, event) in legal:
        assert move(7, status, event) is legal[(status, event)]
        return
    with pytest.raises(IllegalMove) as refused:
        move(7, status, event)
    assert isinstance(refused.value, Conflict)  # the API answers 409
    detail = refused.value.detail
    if status is None:
        assert "job 7 does not exist yet" in detail, detail
        return
    assert f"job 7 is {'already ' if event == Event.CANCEL else ''}{status}" in detail or (
        status == JobStatus.CANCELLED and "was already cancelled" in detail
    ), detail
    for allowed in sources(event):
        assert allowed.value in detail, detail


def test_the_table_keeps_the_invariants_the_service_relies_on() -> None:
    for m in MOVES:
        # An ended job never moves again; a new one only waits.
        assert m.source not in TERMINAL, m
        if m.source is None:
            assert m.target == JobStatus.QUEUED, m
        # Leaving the slots (active -> not active) always ends the attempt that held them,
        # and an attempt ends only where its job held slots.
        leaves = m.source in ACTIVE and m.target not in ACTIVE
        assert leaves == (m.ends is not None), m
        # Only an attempt that failed or was lost counts against max_attempts.
        assert m.counted == (m.ends in ("failed", "lost") and m.source == JobStatus.RUNNING), m
        # A requeue holds nothing: the move says so, and _set clears the slots.
        assert m.requeues == (m.target == JobStatus.QUEUED and m.source in ACTIVE), m
    reached = {m.target for m in MOVES}
    assert reached == set(JobStatus), "every status is reachable"
    assert all(any(m.event == e for m in MOVES) for e in Event), "every event moves something"


def test_the_diagram_in_the_architecture_doc_is_the_table() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    found = re.search(
        r"<!-- states:begin -->\n```mermaid\n(.*?)```\n<!-- states:end -->", doc, re.S
    )
    assert found, "docs/architecture.md lacks the states block"
    assert found.group(1) == diagram(), (
        "docs/architecture.md's state diagram is stale; put this between its markers:\n" + diagram()
    )


# A status or an attempt's outcome written anywhere but the state module: an assignment
# to .status/.outcome, a "status"/"outcome" key or keyword given a JobStatus or a literal.
WRITES = re.compile(
    r"""(\bjob\.status\s*=[^=]|\battempt\.outcome\s*=[^=]|["']status["']\s*:\s*JobStatus"""
    r"""|\bstatus\s*=\s*JobStatus\.|["']outcome["']\s*:\s*["']|\boutcome\s*=\s*["'])"""
)


def test_only_the_state_module_writes_a_status() -> None:
    offenders = []
    for path in sorted((REPO / "service").rglob("*.py")):
        if path.name == "states.py" and path.parent.name == "queue":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if WRITES.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "status writes outside service/queue/states.py:\n" + "\n".join(offenders)
