"""A small Python client of the ddpq API.

    from ddpq.client import Client
    with Client() as c:                       # DDPQ_URL / DDPQ_TOKEN, or ./var/api-token
        job = c.submit({"recipe": "toy-regression", "world_size": 2})
        job = c.wait(job["id"])

Errors: ``ApiError`` (the API answered 4xx/5xx; ``.status`` and ``.detail``),
``httpx.HTTPError`` for transport failures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx

from ddpq import config

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class ApiError(Exception):
    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"HTTP {status}: {format_detail(detail)}")


def format_detail(detail: Any) -> str:
    """FastAPI's validation errors as 'field: reason' lines."""
    if isinstance(detail, list):
        parts = []
        for e in detail:
            if isinstance(e, dict):
                loc = ".".join(
                    str(x) for x in e.get("loc", []) if x not in ("body", "query", "path")
                )
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


class Client:
    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 30.0
    ) -> None:
        self.url = (url or config.api_url()).rstrip("/")
        token = token or config.user_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, detail)
        return r

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._call("POST", "/jobs", json=spec, headers=headers).json()
        return result

    def job(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/jobs/{job_id}").json()
        return result

    def jobs(
        self, status: str | None = None, limit: int = 50, cursor: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = self._call("GET", "/jobs", params=params).json()
        return result

    def cancel(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/jobs/{job_id}/cancel").json()
        return result

    def metrics(self, job_id: int, name: str | None = None) -> list[dict[str, Any]]:
        params = {"name": name} if name else {}
        items: list[dict[str, Any]] = self._call(
            "GET", f"/jobs/{job_id}/metrics", params=params
        ).json()["items"]
        return items

    def checkpoints(self, job_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", f"/jobs/{job_id}/checkpoints").json()[
            "items"
        ]
        return items

    def workers(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", "/workers").json()["items"]
        return items

    def recipes(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", "/recipes").json()["items"]
        return items

    def logs(self, job_id: int, offset: int = 0) -> tuple[bytes, int, str]:
        """(bytes from offset, next offset, job status)."""
        r = self._call("GET", f"/jobs/{job_id}/logs", params={"offset": offset})
        return r.content, int(r.headers["X-Next-Offset"]), r.headers.get("X-Job-Status", "")

    def follow_logs(self, job_id: int, poll_s: float = 0.5) -> Iterator[bytes]:
        """Yield log bytes as they arrive until the job ends."""
        offset = 0
        while True:
            data, offset, status = self.logs(job_id, offset)
            if data:
                yield data
            elif status in TERMINAL:
                data, offset, _ = self.logs(job_id, offset)  # what arrived with the end
                if data:
                    yield data
                return
            else:
                time.sleep(poll_s)

    def wait(
        self, job_id: int, timeout: float | None = None, poll_s: float = 0.5
    ) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']}")
            time.sleep(poll_s)
