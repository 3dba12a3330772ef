"""Wakes long-polling claimers when something may have become claimable."""

from __future__ import annotations

import asyncio
import contextlib


class Wakeup:
    """A broadcast signal with a generation counter, so a wake-up between a
    claimer's empty claim and its wait is never missed."""

    def __init__(self) -> None:
        self.generation = 0
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _fire(self) -> None:
        self.generation += 1
        self._event.set()
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Callable from any thread."""
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._fire()
        else:
            self._loop.call_soon_threadsafe(self._fire)

    async def wait(self, seen_generation: int, timeout: float) -> None:
        if self.generation != seen_generation:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
