"""`make gpu-check`: the summary table a person pastes into an issue, printed at the end.

Each test adds its rows (what it checked and what it saw) through the ``table`` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

_ROWS: list[tuple[str, str, str]] = []


class Table:
    def __init__(self, check: str) -> None:
        self.check = check

    def add(self, what: str, seen: Any) -> None:
        _ROWS.append((self.check, what, str(seen)))


@pytest.fixture
def table(request: pytest.FixtureRequest) -> Iterator[Table]:
    yield Table(request.node.name.removeprefix("test_"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    widths = [max(len(r[i]) for r in _ROWS) for i in range(2)]
    terminalreporter.section("ddpq gpu-check")
    for check, what, seen in _ROWS:
        terminalreporter.write_line(f"{check:<{widths[0]}}  {what:<{widths[1]}}  {seen}")
