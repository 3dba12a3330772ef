"""The one HTTP core of every client of the API: the CLI's (ddpq.client), the worker's
(worker.edges.api) and the ranks' reporter (ddpq.train).

A conversation with one API, a bearer token, timeouts; every answer either a success or
an error of the one tree (ddpq.errors): ApiUnreachable when none came, ApiUnavailable
when asking again may do (5xx, 429: ddpq.wire.retryable), ApiRefused when it will not
(4xx, with the API's ``detail``). A streamed answer (a log followed, a blob) raises the
same. Retrying is each caller's, with ddpq.wire.Backoff's jittered waits: a CLI command
asks once, a worker's report retries until the API takes it, a rank's metrics go back
in its buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from ddpq.errors import answer_error, no_answer


class Http:
    def __init__(self, url: str, token: str | None, timeout: float | httpx.Timeout = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def request(
        self, method: str, path: str, *, timeout: float | httpx.Timeout | None = None, **kw: Any
    ) -> httpx.Response:
        """The answer to ``method path`` if it is a success; else the error it makes."""
        how = timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
        try:
            r = self.client.request(method, path, timeout=how, **kw)
        except httpx.HTTPError as exc:
            raise no_answer(method, self.url + path, exc) from exc
        self.check(r)
        return r

    @contextmanager
    def stream(
        self, method: str, path: str, *, timeout: float | httpx.Timeout | None = None, **kw: Any
    ) -> Iterator[httpx.Response]:
        """A streamed answer, once it is known to be a success; a transfer that breaks
        meanwhile raises ApiUnreachable. (httpx.ReadTimeout is let through: a caller that
        follows a quiet stream asks again.)"""
        how = timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
        try:
            with self.client.stream(method, path, timeout=how, **kw) as r:
                if r.status_code >= 400:
                    r.read()
                    self.check(r)
                yield r
        except httpx.ReadTimeout:
            raise
        except httpx.HTTPError as exc:
            raise no_answer(method, self.url + path, exc) from exc

    @staticmethod
    def check(r: httpx.Response) -> None:
        """ApiUnavailable (5xx, 429) or ApiRefused (4xx) for an answer that is no success."""
        if r.status_code >= 400:
            raise answer_error(r.request.method, str(r.request.url), r.status_code, r.text)

    def close(self) -> None:
        self.client.close()
