"""The compose file's structure, read as YAML (quick, in `make test`). The stack itself is
brought up for real by `make compose-test` (tests/compose/)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_services_and_start_order() -> None:
    services = _compose()["services"]
    assert {"db", "api", "worker"} <= set(services)
    assert "healthcheck" in services["db"] and "pg_isready" in str(
        services["db"]["healthcheck"]["test"]
    )
    assert services["api"]["depends_on"]["db"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert "healthcheck" in services["api"]


def test_worker_reserves_nvidia_gpus_and_mounts_volumes() -> None:
    compose = _compose()
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d.get("count") == "all"
        for d in devices
    )
    mounts = {v.split(":")[1].split()[0] for v in worker["volumes"]}
    assert {"/data", "/workspace"} <= mounts
    named = {v.split(":")[0] for v in worker["volumes"]}
    assert named <= set(compose["volumes"])
    assert any(
        v.split(":")[1] == "/var/lib/postgresql/data" for v in compose["services"]["db"]["volumes"]
    )


def test_ports_are_loopback_only_and_each_service_gets_only_its_secrets() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        # A whole .env handed to every service put the database password into jobs.
        assert "env_file" not in svc, name
        for key, value in (svc.get("environment") or {}).items():
            assert "${" in str(value), f"{name}.{key}: secrets come from .env, not this file"
    assert "ports" not in services["db"]  # Postgres stays on the compose network
    assert set(services["db"]["environment"]) == {
        "POSTGRES_USER",
        "POSTGRES_PASSWORD",
        "POSTGRES_DB",
    }
    assert set(services["api"]["environment"]) == {
        "DDPQ_DATABASE_URL",
        "DDPQ_API_TOKEN",
        "DDPQ_WORKER_TOKEN",
        "DDPQ_SECRETS_KEY",
    }
    assert set(services["worker"]["environment"]) == {"DDPQ_WORKER_TOKEN"}


def test_worker_health_check_reads_no_token_and_the_image_owns_its_volumes() -> None:
    worker = _compose()["services"]["worker"]
    test = worker["healthcheck"]["test"]
    assert test[:4] == ["CMD", "env", "-u", "DDPQ_WORKER_TOKEN"]
    assert "worker.health" in test
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "mkdir -p /data/checkpoints /workspace" in dockerfile
    assert "chown -R ddpq:ddpq /data /workspace" in dockerfile
    assert ".venv" in (REPO / ".dockerignore").read_text().split()
    assert "deploy: !reset {}" in (REPO / "deploy" / "no-gpu.compose.yml").read_text()


def test_worker_health_follows_accepted_heartbeats(tmp_path: Path) -> None:
    from worker import health

    assert "no heartbeat recorded" in (health.problem(tmp_path) or "")
    health.record(tmp_path, 2.0)
    assert health.problem(tmp_path) is None
    stale = health.problem(tmp_path, now=time.time() + 31)
    assert stale is not None and "limit 30 s" in stale


def test_only_the_api_port_is_published_and_postgres_is_on_an_internal_network() -> None:
    compose = _compose()
    services = compose["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert published == {"api": ["127.0.0.1:${DDPQ_PORT:-8000}:8000"]}
    assert all("expose" not in svc for svc in services.values())
    assert services["db"]["networks"] == ["backend"]
    assert compose["networks"]["backend"]["internal"] is True
    assert "backend" not in services["worker"]["networks"]  # the worker never needs SQL
    assert all(svc.get("network_mode") != "host" for svc in services.values())
    # The API listens on every interface inside its container, so it must have tokens.
    assert "0.0.0.0" in services["api"]["command"]


def test_env_example_holds_placeholders_that_serve_refuses() -> None:
    from service.config import TokenError, _key_bytes, _weak

    env = dict(
        line.split("=", 1)
        for line in (REPO / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"DDPQ_API_TOKEN", "DDPQ_WORKER_TOKEN", "POSTGRES_PASSWORD"} <= set(env)
    for var in ("DDPQ_API_TOKEN", "DDPQ_WORKER_TOKEN"):
        assert _weak(env[var]), f"{var}={env[var]} would be accepted on 0.0.0.0"
    with pytest.raises(TokenError, match="DDPQ_SECRETS_KEY is not base64"):
        _key_bytes("DDPQ_SECRETS_KEY", env["DDPQ_SECRETS_KEY"])
    # And no secret sits in the compose file itself.
    text = (REPO / "docker-compose.yml").read_text()
    assert env["POSTGRES_PASSWORD"] not in text and env["DDPQ_API_TOKEN"] not in text


def test_two_images_from_one_dockerfile_each_from_its_part_of_the_lock() -> None:
    """The API runs the slim image (no torch), the worker PyTorch's; both install from the
    lock with hashes, so an image holds what the suite passed with."""
    services = _compose()["services"]
    assert services["api"]["build"] == {"context": ".", "target": "api"}
    assert services["worker"]["build"] == {"context": ".", "target": "worker"}
    assert services["api"]["image"] != services["worker"]["image"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "FROM ${PYTHON_IMAGE} AS api" in dockerfile
    assert "FROM ${BASE_IMAGE} AS worker" in dockerfile
    assert "--require-hashes -r requirements/server.txt" in dockerfile
    assert "--require-hashes -r requirements/worker.txt" in dockerfile
    # The API's part of the lock has no torch; the worker's holds it at the pinned version.
    server = (REPO / "requirements" / "server.txt").read_text()
    assert "\ntorch==" not in server and "\nnvidia-" not in server
    torch_pin = (REPO / "requirements" / "torch.txt").read_text().split("torch==")[1].split()[0]
    assert f"\ntorch=={torch_pin} " in (REPO / "requirements" / "worker.txt").read_text()
    host = yaml.safe_load((REPO / "deploy" / "worker-host.compose.yml").read_text())
    assert host["services"]["worker"]["build"]["target"] == "worker"
    assert host["services"]["worker"]["image"] == services["worker"]["image"]
