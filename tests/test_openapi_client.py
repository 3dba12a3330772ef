"""For integrators: the live /openapi.json names every operation with a short, stable id
and types every field, so a client generated from it (openapi-python-client, pinned in
the Makefile) has functions such as ``submit_job`` returning typed objects. Here one is
generated, imported, and driven against a real `ddpq serve` on SQLite and Postgres."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import sqlalchemy

from service.models import Job
from service.schemas import JobSpec, JobSpecPublic
from tests.conftest import Server, free_port

# (method, path) -> (tag, operation id): the ids are part of the contract (generated
# clients name their functions and modules after them), so a renamed handler fails here.
OPERATIONS = {
    ("get", "/healthz"): ("meta", "get_health"),
    ("get", "/workers"): ("meta", "list_workers"),
    ("get", "/recipes"): ("meta", "list_recipes"),
    ("get", "/metrics"): ("meta", "get_prometheus_metrics"),
    ("post", "/jobs"): ("jobs", "submit_job"),
    ("get", "/jobs"): ("jobs", "list_jobs"),
    ("get", "/jobs/{job_id}"): ("jobs", "get_job"),
    ("post", "/jobs/{job_id}/cancel"): ("jobs", "cancel_job"),
    ("post", "/jobs/{job_id}/hold"): ("jobs", "hold_job"),
    ("post", "/jobs/{job_id}/release"): ("jobs", "release_job"),
    ("patch", "/jobs/{job_id}"): ("jobs", "change_job"),
    ("get", "/accounting"): ("box", "get_accounting"),
    ("get", "/queue"): ("box", "get_queue"),
    ("get", "/jobs/{job_id}/metrics"): ("jobs", "get_job_metrics"),
    ("get", "/jobs/{job_id}/attempts"): ("jobs", "list_job_attempts"),
    ("get", "/jobs/{job_id}/gpus"): ("jobs", "get_job_gpus"),
    ("get", "/jobs/{job_id}/events"): ("jobs", "get_job_events"),
    ("get", "/jobs/{job_id}/checkpoints"): ("jobs", "list_job_checkpoints"),
    ("post", "/jobs/{job_id}/checkpoints/{checkpoint_id}/send"): ("jobs", "send_job_checkpoint"),
    ("get", "/jobs/{job_id}/outputs"): ("jobs", "list_job_outputs"),
    ("get", "/jobs/{job_id}/logs"): ("jobs", "get_job_logs"),
    ("post", "/jobs/{job_id}/metrics"): ("reports", "report_metrics"),
    ("post", "/jobs/{job_id}/logs"): ("reports", "report_log"),
    ("post", "/jobs/{job_id}/checkpoints"): ("reports", "report_checkpoint"),
    ("post", "/workers/register"): ("workers", "register_worker"),
    ("post", "/workers/claim"): ("workers", "claim_job"),
    ("post", "/workers/gang"): ("workers", "wait_for_gang"),
    ("post", "/workers/heartbeat"): ("workers", "send_heartbeat"),
    ("post", "/workers/jobs/{job_id}/logs"): ("workers", "append_job_log"),
    ("post", "/workers/jobs/{job_id}/finish"): ("workers", "finish_attempt"),
    ("post", "/workers/leave"): ("workers", "leave_worker"),
    ("get", "/workers/code/snapshots/{snapshot_id}"): ("workers", "worker_get_snapshot"),
    ("get", "/workers/code/blobs/{digest}"): ("workers", "worker_get_blob"),
    ("post", "/workers/code/missing"): ("workers", "worker_find_missing"),
    ("put", "/workers/code/blobs/{digest}"): ("workers", "worker_put_blob"),
    ("post", "/workers/code/snapshots"): ("workers", "worker_create_snapshot"),
    ("get", "/workers/outputs/limits"): ("workers", "get_outputs_limits"),
    ("post", "/workers/jobs/{job_id}/outputs"): ("workers", "record_outputs"),
    ("get", "/code/limits"): ("code", "get_code_limits"),
    ("get", "/code/packs"): ("code", "get_pack_limits"),
    ("post", "/code/packs"): ("code", "upload_pack"),
    ("post", "/code/missing"): ("code", "find_missing_blobs"),
    ("put", "/code/blobs/{digest}"): ("code", "put_blob"),
    ("get", "/code/blobs/{digest}"): ("code", "get_blob"),
    ("post", "/code/snapshots"): ("code", "create_snapshot"),
    ("get", "/code/snapshots/{snapshot_id}"): ("code", "get_snapshot"),
    ("get", "/whoami"): ("users", "whoami"),
    ("get", "/usage"): ("users", "get_usage"),
    ("get", "/quotas"): ("users", "list_quotas"),
    ("put", "/quotas/{name}"): ("users", "set_quota"),
    ("delete", "/quotas/{name}"): ("users", "clear_quota"),
    ("get", "/users"): ("users", "list_users"),
    ("post", "/users"): ("users", "add_user"),
    ("post", "/users/{name}/revoke"): ("users", "revoke_user"),
    ("delete", "/users/{name}"): ("users", "deactivate_user"),
    ("post", "/users/{name}/reactivate"): ("users", "reactivate_user"),
    ("post", "/users/{name}/rotate"): ("users", "rotate_user"),
    ("get", "/audit"): ("users", "get_audit"),
    ("put", "/secrets/{name}"): ("secrets", "set_secret"),
    ("get", "/secrets"): ("secrets", "list_secrets"),
    ("delete", "/secrets/{name}"): ("secrets", "delete_secret"),
    ("get", "/jobs/{job_id}/secrets"): ("secrets", "get_job_secrets"),
    ("get", "/caches"): ("caches", "list_caches"),
    ("post", "/caches/clear"): ("caches", "clear_caches"),
    ("post", "/sweeps"): ("sweeps", "submit_sweep"),
    ("get", "/sweeps"): ("sweeps", "list_sweeps"),
    ("get", "/sweeps/{sweep_id}"): ("sweeps", "get_sweep"),
    ("post", "/sweeps/{sweep_id}/cancel"): ("sweeps", "cancel_sweep"),
    ("get", "/sweeps/{sweep_id}/export"): ("sweeps", "export_sweep"),
}
SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
PACKAGE = "ddpq_generated_client"  # a name no other module of the suite uses


def _document(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def _untyped(schema: Any, where: str) -> Iterator[str]:
    """Where a schema, or one nested in it, says nothing of its value's type."""
    if not isinstance(schema, dict):
        return
    if not schema.keys() & {"type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const"}:
        yield where
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key, [])):
            yield from _untyped(sub, f"{where}/{key}[{i}]")
    for name, sub in schema.get("properties", {}).items():
        yield from _untyped(sub, f"{where}.{name}")
    yield from _untyped(schema.get("items"), f"{where}[]")
    yield from _untyped(schema.get("additionalProperties"), f"{where}{{}}")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_every_operation_has_a_short_stable_id_and_typed_answers(server: Server) -> None:
    doc = _document(server)
    ids = {
        (method, path): op["operationId"]
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
    }
    assert ids == {key: op_id for key, (_, op_id) in OPERATIONS.items()}
    assert len(set(ids.values())) == len(ids)  # unique
    for (method, path), op_id in ids.items():
        # snake_case, and none of FastAPI's default path and method fragments
        assert SNAKE.fullmatch(op_id) and len(op_id) <= 24, op_id
        assert not op_id.endswith(("_get", "_post", "_put")), op_id
        assert doc["paths"][path][method]["tags"] == [OPERATIONS[method, path][0]]

    schemas = doc["components"]["schemas"]
    job = schemas["JobPublic"]["properties"]
    assert job["status"] == {"$ref": "#/components/schemas/JobStatus"}
    assert schemas["JobStatus"]["enum"] == [
        "queued", "running", "cancelling", "succeeded", "failed", "cancelled", "held",
    ]  # fmt: skip
    assert job["spec"] == {"$ref": "#/components/schemas/JobSpecPublic"}
    # Every field of a stored spec is in every answer, typed as the spec sent.
    assert set(schemas["JobSpecPublic"]["required"]) == set(JobSpec.model_fields)
    assert set(JobSpecPublic.model_fields) == set(JobSpec.model_fields)
    outcome = schemas["AttemptPublic"]["properties"]["outcome"]
    assert schemas[outcome["$ref"].rsplit("/", 1)[1]]["enum"] == [
        "running", "succeeded", "failed", "cancelled", "lost", "requeued",
    ]  # fmt: skip
    # Every field's value has a type; FastAPI's 422 item echoes the client's input as is.
    untyped = [
        where
        for name, schema in schemas.items()
        for where in _untyped(schema, name)
        if where != "ValidationError.input"
    ]
    assert untyped == []

    # The errors each operation documents are those it can give.
    def statuses(method: str, path: str) -> set[str]:
        return set(doc["paths"][path][method]["responses"])

    assert statuses("post", "/jobs") == {"201", "401", "403", "409", "413", "422", "429", "503"}
    assert statuses("post", "/jobs/{job_id}/cancel") == {
        "202", "401", "403", "404", "409", "422", "503",
    }  # fmt: skip
    assert statuses("get", "/jobs") == {"200", "401", "403", "422", "503"}
    # No parameter; the database only through the user token it looks up.
    assert statuses("get", "/recipes") == {"200", "401", "403", "503"}
    assert statuses("get", "/healthz") == {"200", "503"}
    assert "400" in statuses("post", "/workers/jobs/{job_id}/logs")
    for (method, path), _ in OPERATIONS.items():
        responses = doc["paths"][path][method]["responses"]
        if "404" in responses:
            named = ("/workers/claim", "/workers/heartbeat", "/workers/leave")  # a worker's
            assert "{" in path or path in named, path
        for status, answer in responses.items():
            if status.startswith(("4", "5")) and path != "/healthz":  # it answers Health
                (schema,) = [c["schema"]["$ref"] for c in answer["content"].values()]
                assert schema.endswith("/HTTPValidationError" if status == "422" else "/Error")


class Generated:
    """A client package generated from the first server's document; every later server
    of the module must serve the same document (then the same package serves it)."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.doc: dict[str, Any] | None = None
        self.package: ModuleType | None = None

    def for_server(self, server: Server) -> ModuleType:
        doc = _document(server)
        if self.package is None:
            self.doc = doc
            self.package = self._generate(doc)
        assert doc == self.doc
        return self.package

    def _generate(self, doc: dict[str, Any]) -> ModuleType:
        # make venv installs it in a venv of its own (it pins an older typer than ddpq's).
        tools = Path(sys.executable).parent.parent / "tools" / "bin" / "openapi-python-client"
        tool = str(tools) if tools.exists() else shutil.which("openapi-python-client")
        assert tool, "openapi-python-client: make venv installs it in .venv/tools"
        (self.where / "openapi.json").write_text(json.dumps(doc))
        # No formatting hooks (the package is imported, not read): no ruff run needed.
        (self.where / "config.yaml").write_text("post_hooks: []\n")
        dead = f"http://127.0.0.1:{free_port()}"  # offline: any fetch would fail here
        argv = ["generate", "--path", "openapi.json", "--meta", "none", "--config", "config.yaml"]
        r = subprocess.run(
            [tool, *argv, "--output-path", PACKAGE],
            cwd=self.where,
            env={**os.environ, "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "NO_PROXY": ""},
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "Warning" not in out, out
        sys.path.insert(0, str(self.where))
        importlib.invalidate_caches()
        return importlib.import_module(PACKAGE)

    def close(self) -> None:
        if str(self.where) in sys.path:
            sys.path.remove(str(self.where))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Generated]:
    g = Generated(tmp_path_factory.mktemp("openapi-client"))
    yield g
    g.close()


def _api(name: str) -> Any:
    """A module of the generated package: api.<tag>.<operation id>, or models."""
    return importlib.import_module(f"{PACKAGE}.{name}")


@pytest.fixture
def opened() -> Iterator[Callable[[Any], Any]]:
    """Enter a client's context (its connections), to be closed after the test."""
    with contextlib.ExitStack() as stack:
        yield stack.enter_context


def test_a_generated_client_submits_polls_and_cancels(
    server: Server, db_url: str, generated: Generated, opened: Callable[[Any], Any]
) -> None:
    generated.for_server(server)
    root = generated.where / PACKAGE
    for tag, op_id in OPERATIONS.values():  # one module per operation, by its short id
        assert (root / "api" / tag / f"{op_id}.py").is_file(), (tag, op_id)

    client_mod, models = _api("client"), _api("models")
    submit_job, get_job = _api("api.jobs.submit_job"), _api("api.jobs.get_job")
    cancel_job, list_jobs = _api("api.jobs.cancel_job"), _api("api.jobs.list_jobs")
    # Strict: an answer whose status the document does not list raises.
    user = opened(
        client_mod.AuthenticatedClient(
            base_url=server.url, token=server.api_token, raise_on_unexpected_status=True
        )
    )
    JobStatus = models.JobStatus

    spec = models.JobSpec.from_dict(
        {"recipe": "toy-regression", "world_size": 2, "args": ["--total-epochs", "3"]}
    )
    job = submit_job.sync(client=user, body=spec, idempotency_key="openapi-client-1")
    assert isinstance(job, models.JobPublic), job
    assert job.status is JobStatus.QUEUED and job.queue_position == 1
    assert isinstance(job.spec, models.JobSpecPublic)
    assert (job.spec.recipe, job.spec.world_size, job.spec.args) == (
        "toy-regression", 2, ["--total-epochs", "3"],
    )  # fmt: skip
    assert job.spec.device is models.JobSpecPublicDevice.AUTO and job.spec.pip == []
    assert isinstance(job.created_at, datetime.datetime) and job.created_at.tzinfo

    # Poll: nothing runs it (no worker), so it waits in the queue.
    got = get_job.sync(client=user, job_id=job.id)
    assert isinstance(got, models.JobPublic) and got.status is JobStatus.QUEUED
    assert got.id == job.id and got.reason and got.spec.to_dict() == job.spec.to_dict()
    page = list_jobs.sync(client=user, status="queued")
    assert isinstance(page, models.JobsPublic) and [j.id for j in page.items] == [job.id]

    answer = cancel_job.sync_detailed(client=user, job_id=job.id)
    assert answer.status_code == 202 and isinstance(answer.parsed, models.JobPublic)
    assert answer.parsed.status is JobStatus.CANCELLED
    assert get_job.sync(client=user, job_id=job.id).status is JobStatus.CANCELLED

    # The documented errors come back typed too.
    again = cancel_job.sync_detailed(client=user, job_id=job.id)
    assert again.status_code == 409 and isinstance(again.parsed, models.Error)
    assert "already cancelled" in again.parsed.detail
    missing = get_job.sync_detailed(client=user, job_id=10**12)
    assert missing.status_code == 404 and isinstance(missing.parsed, models.Error)
    other = models.JobSpec.from_dict({"recipe": "toy-regression", "world_size": 3})
    reused = submit_job.sync_detailed(client=user, body=other, idempotency_key="openapi-client-1")
    assert reused.status_code == 409 and isinstance(reused.parsed, models.Error)
    bad = models.JobSpec.from_dict({"recipe": "toy-regression", "world_size": 3, "nnodes": 2})
    invalid = submit_job.sync_detailed(client=user, body=bad)
    assert invalid.status_code == 422 and isinstance(invalid.parsed, models.HTTPValidationError)
    assert "nnodes" in invalid.parsed.detail[0].msg
    stranger = opened(
        client_mod.AuthenticatedClient(
            base_url=server.url, token="not-a-token-0000", raise_on_unexpected_status=True
        )
    )
    refused = get_job.sync_detailed(client=stranger, job_id=job.id)
    assert refused.status_code == 401 and isinstance(refused.parsed, models.Error)

    # A spec stored by an earlier version (fields missing, a recipe and a variable that
    # today's rules refuse, a key this version does not know) is still answered, typed.
    old = {"recipe": "gone-recipe", "world_size": 1, "env": {"LD_PRELOAD": "x"}, "extra": 1}
    with pytest.raises(ValueError):
        JobSpec.model_validate(old)
    engine = sqlalchemy.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.update(Job).where(Job.id == job.id).values(spec=old))
    engine.dispose()
    stored = get_job.sync(client=user, job_id=job.id)
    assert isinstance(stored, models.JobPublic)
    assert (stored.spec.recipe, stored.spec.env.to_dict()) == ("gone-recipe", {"LD_PRELOAD": "x"})
    assert stored.spec.max_attempts == 3 and stored.spec.additional_properties == {"extra": 1}

    # The rest of the reads a script makes, typed: attempts, recipes, health.
    attempts = _api("api.jobs.list_job_attempts").sync(client=user, job_id=job.id)
    assert isinstance(attempts, models.AttemptsPublic) and attempts.items == []
    recipes = _api("api.meta.list_recipes").sync(client=user)
    arg = next(r for r in recipes.items if r.name == "toy-regression").args[0]
    assert isinstance(arg.type_, models.RecipeArgType)
    anyone = opened(client_mod.Client(base_url=server.url, raise_on_unexpected_status=True))
    health = _api("api.meta.get_health").sync(client=anyone)
    assert health.status is models.HealthStatus.OK
