"""The worker protocol is one set of models for both sides (ddpq.messages): each route a
worker calls validates its body with the very class the worker's client (worker.edges.api)
validates what it sends with, and the client sends what that class dumps; a body the
service would refuse is refused by the client the same way, 422 naming the field, and
never sent. Adding a field to the heartbeat is then one edit, in one model."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ddpq import messages
from ddpq.errors import ApiRefused
from worker.edges.api import WorkerAPI

# Each route a worker sends a body to, and the one model both sides validate it with.
ROUTES: dict[str, type[BaseModel]] = {
    "/workers/register": messages.WorkerRegister,
    "/workers/claim": messages.ClaimRequest,
    "/workers/gang": messages.GangRequest,
    "/workers/heartbeat": messages.Heartbeat,
    "/workers/jobs/{job_id}/finish": messages.FinishBody,
    "/workers/leave": messages.WorkerLeave,
}


def _walk(routes: list[Any]) -> Iterator[APIRoute]:
    """The app's API routes, those of its included routers too (which FastAPI keeps
    behind a router of its own until a request matches them)."""
    for r in routes:
        if isinstance(r, APIRoute):
            yield r
        elif hasattr(r, "original_router"):
            yield from _walk(r.original_router.routes)


@pytest.fixture(scope="module")
def routes() -> Iterator[dict[str, APIRoute]]:
    from service.app import create_app
    from service.config import Settings, resolve_secrets_keys

    with tempfile.TemporaryDirectory() as tmp:
        settings = resolve_secrets_keys(Settings(data_dir=Path(tmp)), "127.0.0.1")
        app = create_app(settings, "a" * 32, "b" * 32)
        try:
            yield {r.path: r for r in _walk(app.routes)}
        finally:
            app.state.db.dispose()


def test_each_worker_route_takes_the_model_the_worker_sends(routes: dict[str, APIRoute]) -> None:
    for path, model in ROUTES.items():
        route = routes[path]
        assert route.body_field is not None, path
        assert route.body_field.field_info.annotation is model, (path, route.body_field)
        # ... and the models are the protocol's, not copies made elsewhere.
        assert model.__module__ == "ddpq.messages", model


class Recorder:
    """A transport that answers as the API would and keeps each request's JSON body."""

    def __init__(self) -> None:
        self.sent: dict[str, Any] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.sent[path] = json.loads(request.content) if request.content else None
        if path == "/workers/register":
            return httpx.Response(200, json={"name": "w1", "heartbeat_s": 2.0, "lease_s": 30.0})
        if path == "/workers/claim":
            return httpx.Response(204)
        if path == "/workers/gang":
            return httpx.Response(200, json={"state": "forming"})
        if path == "/workers/heartbeat":
            return httpx.Response(200, json={"cancel": [], "abandon": []})
        if path == "/workers/leave":
            return httpx.Response(200, json={"name": "w1", "left_at": "2026-11-30T00:00:00Z"})
        return httpx.Response(200, json={"id": 3})


def client(recorder: Recorder) -> WorkerAPI:
    api = WorkerAPI("http://api.invalid", "t" * 32, "w1", identity="0" * 32)
    api._http.client = httpx.Client(base_url=api.url, transport=httpx.MockTransport(recorder))
    return api


def test_the_worker_sends_what_the_models_dump_and_refuses_what_they_refuse() -> None:
    recorder = Recorder()
    api = client(recorder)
    register = {
        "name": "w1", "hostname": "h", "cpu_slots": 2, "gpus": [0],
        "checkpoint_root": "/ckpt", "running": [{"job_id": 3, "attempt": 1}],
    }  # fmt: skip
    api.register(register)
    assert api.claim(2, [0], 1.0) is None
    api.gang(3, 1, 1.0)
    sample = {"gpu": 0, "utilization": 50.0, "memory_used": 1, "memory_total": 2}
    running = [{"job_id": 3, "attempt": 1, "gpu_samples": [sample]}]
    api.heartbeat(running, kept=[3], caches=[])
    api.finish(3, {"attempt": 1, "exit_code": 0, "outcome": "exited", "reason": None})
    assert api.leave(5.0).name == "w1"
    for path, model in ROUTES.items():
        sent_path = path.replace("{job_id}", "3")
        body = recorder.sent[sent_path]
        # What went is the model's own dump of it: the route will take it as it is.
        again = model.model_validate(body).model_dump(mode="json", exclude_unset=True)
        assert again == body, (path, body)
    assert recorder.sent["/workers/register"]["identity"] == "0" * 32
    assert recorder.sent["/workers/leave"] == {"name": "w1", "identity": "0" * 32}
    assert recorder.sent["/workers/heartbeat"]["caches"] == []  # sent: they changed
    # A body the service would refuse is refused here, naming the field, and not sent.
    recorder.sent.clear()
    with pytest.raises(ApiRefused) as refused:
        api.heartbeat([{"job_id": 0, "attempt": 1}], kept=[])
    assert refused.value.status == 422 and "running.0.job_id" in str(refused.value)
    with pytest.raises(ApiRefused, match="outcome"):
        api.finish(3, {"attempt": 1, "outcome": "vanished"})
    with pytest.raises(ApiRefused, match="free_cpu_slots"):
        api.claim(-1, [], 1.0)
    assert recorder.sent == {}
