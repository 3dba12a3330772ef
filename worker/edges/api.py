"""The worker's HTTP client of the service, with retries for what must not be lost.

Each request's body is validated, before it is sent, by the model the service's route
validates it with (ddpq.messages: register, claim, gang, heartbeat, finish, leave): one
definition for both sides, so what the worker sends cannot drift from what the service
takes, and a body the service would refuse is refused here as the service would, 422
naming the field (ApiRefused), without a request."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from ddpq.errors import ApiRefused, ApiUnavailable, format_detail, no_answer
from ddpq.http import Http
from ddpq.messages import (
    ClaimedJob,
    ClaimRequest,
    CodeSnapshot,
    FinishBody,
    GangReply,
    GangRequest,
    Heartbeat,
    HeartbeatReply,
    WorkerLeave,
    WorkerLeft,
    WorkerRegister,
    WorkerRegistered,
)
from ddpq.wire import Backoff

log = logging.getLogger("ddpq.worker")


class WorkerAPI:
    def __init__(self, url: str, token: str, name: str, identity: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.identity = identity  # worker.files.datadir: the same worker across restarts
        self._http = Http(self.url, token, httpx.Timeout(15.0, connect=5.0))

    def _request(
        self, method: str, path: str, *, timeout: float | None = None, **kw: Any
    ) -> httpx.Response:
        return self._http.request(method, path, timeout=timeout, **kw)

    def _send(
        self,
        path: str,
        model: type[BaseModel],
        body: dict[str, Any],
        *,
        timeout: float | None = None,
        **kw: Any,
    ) -> httpx.Response:
        """POST ``body`` once ``model`` (the route's own) has taken it: its JSON as the
        model dumps it, or ApiRefused (422) naming what it refused, as the route would."""
        try:
            json = model.model_validate(body).model_dump(mode="json", exclude_unset=True)
        except ValidationError as exc:
            detail = format_detail(exc.errors(include_url=False, include_context=False))
            raise ApiRefused("POST", self.url + path, 422, detail) from None
        return self._request("POST", path, json=json, timeout=timeout, **kw)

    def register(self, body: dict[str, Any]) -> WorkerRegistered:
        if self.identity:
            body = {**body, "identity": self.identity}
        r = self._send("/workers/register", WorkerRegister, body)
        return WorkerRegistered.model_validate_json(r.content)

    def claim(
        self,
        free_cpu_slots: int,
        free_gpus: list[int],
        wait_s: float,
        advertise_addr: str | None = None,
        rdzv_port: int | None = None,
    ) -> ClaimedJob | None:
        body: dict[str, Any] = {
            "name": self.name,
            "free_cpu_slots": free_cpu_slots,
            "free_gpus": free_gpus,
            "wait_s": wait_s,
        }
        if advertise_addr and rdzv_port:
            body.update(advertise_addr=advertise_addr, rdzv_port=rdzv_port)
        r = self._send("/workers/claim", ClaimRequest, body, timeout=wait_s + 15.0)
        if r.status_code == 204:
            return None
        return ClaimedJob.model_validate_json(r.content)

    def leave(self, timeout: float) -> WorkerLeft:
        """Say this worker is stopping: the API claims nothing more for it and answers its
        open claim long-poll now. Once: a stop does not wait for an API that is away."""
        body: dict[str, Any] = {"name": self.name}
        if self.identity:
            body["identity"] = self.identity
        r = self._send("/workers/leave", WorkerLeave, body, timeout=timeout)
        return WorkerLeft.model_validate_json(r.content)

    def gang(self, job_id: int, attempt: int, wait_s: float, leave: bool = False) -> GangReply:
        """Wait on a held node slot: forming, ready (with the rendezvous) or released."""
        body = {"name": self.name, "job_id": job_id, "attempt": attempt, "wait_s": wait_s}
        r = self._send("/workers/gang", GangRequest, {**body, "leave": leave}, timeout=wait_s + 15)
        return GangReply.model_validate_json(r.content)

    def heartbeat(
        self,
        running: list[dict[str, Any]],
        kept: list[int],
        pruned: list[dict[str, Any]] | None = None,
        dropped: list[dict[str, Any]] | None = None,
        caches: list[dict[str, Any]] | None = None,
        cleared: list[dict[str, Any]] | None = None,
        sent: list[dict[str, Any]] | None = None,
    ) -> HeartbeatReply:
        body: dict[str, Any] = {"name": self.name, "running": running}
        if self.identity:
            body["identity"] = self.identity
        if kept:
            body["kept"] = kept
        if pruned:
            body["pruned"] = pruned
        if dropped:
            body["dropped"] = dropped
        if caches is not None:  # only when they changed (worker.files.caches)
            body["caches"] = caches
        if cleared:
            body["cleared"] = cleared
        if sent:
            body["sent"] = sent
        r = self._send("/workers/heartbeat", Heartbeat, body)
        return HeartbeatReply.model_validate_json(r.content)

    def append_log(self, job_id: int, attempt: int, offset: int, data: bytes) -> int:
        r = self._request(
            "POST",
            f"/workers/jobs/{job_id}/logs",
            params={"worker": self.name, "attempt": attempt, "offset": offset},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(r.json()["next_offset"])

    def finish(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        path = f"/workers/jobs/{job_id}/finish"
        result: dict[str, Any] = self._send(path, FinishBody, {"worker": self.name, **body}).json()
        return result

    def snapshot(self, snapshot_id: str) -> CodeSnapshot:
        r = self._request("GET", f"/workers/code/snapshots/{snapshot_id}", timeout=120.0)
        return CodeSnapshot.model_validate_json(r.content)

    def blob(self, digest: str) -> Iterator[bytes]:
        """A content's bytes as they arrive (ApiUnavailable if the transfer breaks)."""
        path = f"/workers/code/blobs/{digest}"
        try:
            with self._http.stream("GET", path, timeout=httpx.Timeout(120.0, connect=5.0)) as r:
                yield from r.iter_bytes(1 << 20)
        except httpx.ReadTimeout as exc:  # a transfer that stalls is one that broke
            raise no_answer("GET", self.url + path, exc) from exc

    # ---- a job's directory as it ended (worker.files.outputs) ---------------------------------

    def outputs_limits(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/workers/outputs/limits").json()
        return result

    def missing_blobs(self, digests: list[str]) -> list[str]:
        r = self._request("POST", "/workers/code/missing", json={"digests": digests})
        return list(r.json()["missing"])

    def put_blob(self, digest: str, data: bytes) -> None:
        self._request(
            "PUT",
            f"/workers/code/blobs/{digest}",
            content=data,
            headers={"Content-Type": "application/octet-stream"},
            timeout=600.0,
        )

    def create_snapshot(self, files: list[dict[str, Any]]) -> dict[str, Any]:
        r = self._request("POST", "/workers/code/snapshots", json={"files": files}, timeout=120.0)
        result: dict[str, Any] = r.json()
        return result

    def record_outputs(self, job_id: int, body: dict[str, Any]) -> None:
        self._request("POST", f"/workers/jobs/{job_id}/outputs", json={"worker": self.name, **body})

    def close(self) -> None:
        self._http.close()


def retry(
    call: Any, *, what: str, stop: threading.Event | None = None, give_up_s: float | None = None
) -> Any:
    """Call until it succeeds or is refused, backing off while the API is unavailable."""
    backoff = Backoff()
    deadline = None if give_up_s is None else time.monotonic() + give_up_s
    while True:
        try:
            return call()
        except ApiUnavailable as exc:
            if deadline is not None and time.monotonic() > deadline:
                raise
            log.warning("%s: API unavailable (%s); retrying in %.1fs", what, exc, backoff.delay)
            if backoff.wait(stop):
                raise


def claim_or_wait(
    claim: Callable[[], ClaimedJob | None],
    *,
    stop: threading.Event,
    backoff: Backoff,
    register: Callable[[], Any],
) -> ClaimedJob | None:
    """One claim long-poll of a claim loop: the job, or None once what went wrong is
    waited out (the API away: the backoff; this worker forgotten: register again; a
    refusal: 5 s)."""
    try:
        claimed = claim()
    except ApiUnavailable as exc:
        log.warning("claim: API unavailable (%s)", exc)
        backoff.wait(stop)
        return None
    except ApiRefused as exc:
        if exc.status == 404:
            register()
        else:
            log.error("claim refused: %s", exc)
            stop.wait(5.0)
        return None
    backoff.reset()
    return claimed
