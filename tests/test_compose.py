"""No Docker engine runs here, so the compose file's structure is checked instead."""

from __future__ import annotations

from pathlib import Path

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
    mounts = {v.split(":")[1] for v in worker["volumes"]}
    assert {"/data/checkpoints", "/workspace"} <= mounts
    named = {v.split(":")[0] for v in worker["volumes"]}
    assert named <= set(compose["volumes"])
    assert any(
        v.split(":")[1] == "/var/lib/postgresql/data" for v in compose["services"]["db"]["volumes"]
    )


def test_ports_are_loopback_only_and_tokens_come_from_an_env_file() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    assert "ports" not in services["db"]  # Postgres stays on the compose network
    for name in ("api", "worker"):
        assert services[name]["env_file"], name
        env = services[name].get("environment", {})
        assert not any("TOKEN" in k for k in env), (
            "tokens come from the env file, not the compose file"
        )


def test_only_the_api_port_is_published_and_postgres_is_on_an_internal_network() -> None:
    compose = _compose()
    services = compose["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert published == {"api": ["127.0.0.1:8000:8000"]}
    assert all("expose" not in svc for svc in services.values())
    assert services["db"]["networks"] == ["backend"]
    assert compose["networks"]["backend"]["internal"] is True
    assert "backend" not in services["worker"]["networks"]  # the worker never needs SQL
    assert all(svc.get("network_mode") != "host" for svc in services.values())
    # The API listens on every interface inside its container, so it must have tokens.
    assert "0.0.0.0" in services["api"]["command"]


def test_env_example_holds_placeholders_that_serve_refuses() -> None:
    from service.config import _weak

    env = dict(
        line.split("=", 1)
        for line in (REPO / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"DDPQ_API_TOKEN", "DDPQ_WORKER_TOKEN", "DDPQ_DATABASE_URL"} <= set(env)
    for var in ("DDPQ_API_TOKEN", "DDPQ_WORKER_TOKEN"):
        assert _weak(env[var]), f"{var}={env[var]} would be accepted on 0.0.0.0"
    # And no secret sits in the compose file itself.
    text = (REPO / "docker-compose.yml").read_text()
    assert env["POSTGRES_PASSWORD"] not in text and env["DDPQ_API_TOKEN"] not in text
