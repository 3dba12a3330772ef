"""What the app does with a request's body before a route reads it: the size limit
(413, whether the body is declared or streamed; code uploads take larger ones) and the
lingering close that lets an early answer reach a client still sending. The app
(service.app) adds both as middleware."""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.errors import ServiceError


class LingeringClose:
    """Reads and discards the rest of a request body the app answered without reading,
    up to ``DRAIN_BYTES`` or ``DRAIN_S``, before the answer goes out (nginx's "lingering
    close"). A server that answers and closes while the client is still sending makes the
    kernel reset the connection, and the client sees `Connection reset by peer` instead of
    the answer: a test saw it for 27 of 40 POSTs of 2 MiB that got a 413, and a wrong
    token's 401 on a code upload lost the same way. It sits outside the token gate, so
    every early answer (401, 413, 404) arrives. A client that waits for `100 Continue`
    and was never asked for its body has sent nothing: it is answered at once."""

    DRAIN_BYTES = 64 * 1024 * 1024
    DRAIN_S = 5.0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        asked = False  # the app called receive (so a 100-continue client is sending)
        body_read = False  # the app has the whole body, or the client is gone

        async def tracked_receive() -> Message:
            nonlocal asked, body_read
            asked = True
            message = await receive()
            body_read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def draining_send(message: Message) -> None:
            early = message["type"] == "http.response.start" and not body_read
            if early and (asked or not _expects_continue(scope)):
                await self._drain(receive)
            await send(message)

        await self.app(scope, tracked_receive, draining_send)

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the rest of the request body, within the bounds."""
        left = self.DRAIN_BYTES
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.DRAIN_S):
                while left > 0:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    left -= len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return


class BodyLimit:
    """413 for request bodies over the limit, whether declared or streamed. Paths under
    a prefix of ``larger`` take that prefix's limit instead (code uploads). The rest of
    an oversize body is read and dropped by LingeringClose, outside, so the 413 arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}

    def _limit(self, path: str) -> int:
        for prefix, limit in self.larger.items():
            if path.startswith(prefix):
                return limit
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope.get("path", ""))
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send, limit)
                    return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps({"detail": _too_large(limit)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(ServiceError, HTTPException):
    """An HTTPException, so FastAPI's body reader passes it on (it turns any other
    exception while reading a body into a 400) and the app answers 413; a ServiceError,
    as every error the service raises on purpose is."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes))


def _has_body(scope: Scope) -> bool:
    """A request that declares a body: a length over 0, or chunked."""
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            return value.strip() not in (b"", b"0")
        if key == b"transfer-encoding":
            return True
    return False


def _expects_continue(scope: Scope) -> bool:
    return any(
        key == b"expect" and value.lower() == b"100-continue"
        for key, value in scope.get("headers", [])
    )


def _too_large(limit: int) -> str:
    return f"request body is larger than {limit} bytes"


def body_limits(settings: Settings) -> dict[str, int]:
    """The larger bodies code uploads take: one file's content, and a manifest (or its
    list of digests) of the most files a snapshot may hold (a job's directory: its code
    and its outputs)."""
    manifest = max(settings.max_body_bytes, settings.code_max_files * MANIFEST_ENTRY_BYTES)
    directory = max(
        manifest, (settings.code_max_files + settings.outputs_max_files) * MANIFEST_ENTRY_BYTES
    )
    return {
        "/code/blobs/": settings.code_max_file_bytes,
        "/code/packs": settings.pack_limits()[0],
        "/code/snapshots": manifest,
        "/code/missing": manifest,
        # A worker sends a job's directory as it ended (service.outputs): its code and
        # what it wrote.
        "/workers/code/blobs/": settings.code_max_file_bytes,
        "/workers/code/snapshots": directory,
        "/workers/code/missing": directory,
    }


# Room for one manifest entry in JSON: a long path, a digest, a size and a mode.
MANIFEST_ENTRY_BYTES = 512
