"""The job state machine (service/queue/states.py): the table, its one owner, its picture.

Cheap: no server. The moves as the service makes them are driven at random, on both
databases, by tests/test_states_property.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from service.errors import Conflict
from service.models import ACTIVE, TERMINAL, JobStatus
from service.queue.states import (
    ATTEMPT_MOVES,
    MOVES,
    Event,
    IllegalMove,
    NodeEvent,
    Slot,
    attempt_diagram,
    attempt_move,
    diagram,
    move,
    node_diagram,
    node_move,
    sources,
)

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
        # A requeue holds nothing: the move says so, and _set clears the slots (a pause,
        # to held, is one too).
        waits = m.target in (JobStatus.QUEUED, JobStatus.HELD)
        assert m.requeues == (waits and m.source in ACTIVE), m
    reached = {m.target for m in MOVES}
    assert reached == set(JobStatus), "every status is reachable"
    assert all(any(m.event == e for m in MOVES) for e in Event), "every event moves something"


def test_an_attempt_and_a_node_slot_move_only_by_their_tables() -> None:
    # An attempt ends only as a job move ends it, once, and every such end is in its table.
    ends = {(m.event, m.ends) for m in MOVES if m.ends is not None}
    assert {(m.event, m.target) for m in ATTEMPT_MOVES if m.source == "running"} == ends
    assert attempt_move(None, Event.START).target == "running"
    for m in ATTEMPT_MOVES:
        if m.source is not None:
            with pytest.raises(Conflict):  # an ended attempt never moves again
                attempt_move(m.target, m.event)
    # A node slot is released only while forming, and ends (once) only after it ran.
    assert node_move(Slot.FORMING, NodeEvent.RELEASE).target is None
    for slot in (Slot.RUNNING, Slot.ENDED):
        with pytest.raises(Conflict):
            node_move(slot, NodeEvent.RELEASE)
    with pytest.raises(Conflict):
        node_move(Slot.FORMING, NodeEvent.REPORT)
    again = node_move(Slot.ENDED, NodeEvent.REPORT)
    assert again.source == again.target, "a retried report changes nothing"


@pytest.mark.parametrize(
    ("marker", "render"),
    [("states", diagram), ("attempts", attempt_diagram), ("nodes", node_diagram)],
)
def test_the_diagrams_in_the_architecture_doc_are_the_tables(
    marker: str, render: Callable[[], str]
) -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    found = re.search(
        rf"<!-- {marker}:begin -->\n```mermaid\n(.*?)```\n<!-- {marker}:end -->", doc, re.S
    )
    assert found, f"docs/architecture.md lacks the {marker} block"
    assert found.group(1) == render(), (
        f"docs/architecture.md's {marker} diagram is stale; put this between its markers:\n"
        + render()
    )


# A status, or an attempt's or a node slot's end, written anywhere but the state module:
# an assignment to .status/.outcome/.ended_at/.exit_code on a row (a node's, an
# attempt's, a job's); an ended_at given as a keyword or a key (an UPDATE's values); a
# "status"/"outcome" key or keyword given a JobStatus or a literal; a node slot's or an
# attempt's row inserted or deleted.
WRITES = re.compile(
    r"""(?<!self)\.(status|outcome|ended_at|exit_code)\s*=[^=]"""
    r"""|\bended_at\s*=[^=]|["']ended_at["']\s*:"""
    r"""|["']status["']\s*:\s*JobStatus|\bstatus\s*=\s*JobStatus\."""
    r"""|["']outcome["']\s*:\s*["']|\boutcome\s*=\s*["']"""
    r"""|\b(insert|delete)\((JobNode|nodes|Attempt|attempts)\b"""
)


def offenders(files: dict[str, str]) -> list[str]:
    """The lines of ``files`` (path: text) that write a status outside the state module."""
    found = []
    for path, text in sorted(files.items()):
        if path == "service/queue/states.py":
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if WRITES.search(line):
                found.append(f"{path}:{n}: {line.strip()}")
    return found


def test_only_the_state_module_writes_a_status() -> None:
    files = {
        str(path.relative_to(REPO)): path.read_text() for path in (REPO / "service").rglob("*.py")
    }
    found = offenders(files)
    assert not found, "status writes outside service/queue/states.py:\n" + "\n".join(found)


def test_the_guard_sees_the_writes_it_is_for() -> None:
    """Each way the state module's writes were once made elsewhere (a node slot's end in
    leases.end_attempt, a gang's slots deleted in gangs) and a few more, as the guard
    must catch them; and reads that look alike, as it must not."""
    caught = [
        "job.status = JobStatus.QUEUED",
        "attempt.outcome = 'lost'",
        "node.outcome = report.outcome",
        "node.ended_at = now",
        "node.exit_code = report.exit_code",
        "attempt.ended_at = now",
        "update(JobNode).values(ended_at=now)",
        "s.execute(delete(JobNode).where(JobNode.id.in_(gone)))",
        "conn.execute(insert(nodes), {...})",
        "s.execute(insert(Attempt).values(...))",
        '{"status": JobStatus.RUNNING}',
        '{"outcome": "running"}',
        '{"ended_at": now}',
        "values(status=JobStatus.FAILED)",
    ]
    for line in caught:
        assert offenders({"service/x.py": line}), line
    for line in [
        "if node.ended_at is None:",
        "exit_code=j.exit_code,",
        "self.status = status",
        '{"status": job.status}',
        "JobNode.ended_at.is_(None)",
        "a.ended_at == b.ended_at",
    ]:
        assert not offenders({"service/x.py": line}), line
