"""Where the CLI and the Python client find the API and its token."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


def data_dir() -> Path:
    return Path(os.environ.get("DDPQ_DATA_DIR", "./var"))


def api_url() -> str:
    return os.environ.get("DDPQ_URL", DEFAULT_URL).rstrip("/")


def _token_from(var: str, filename: str) -> str | None:
    token = os.environ.get(var, "").strip()
    if token:
        return token
    path = data_dir() / filename
    if path.is_file():
        return path.read_text().strip() or None
    return None


def user_token() -> str | None:
    """DDPQ_TOKEN, else the token `ddpq serve` generated under DDPQ_DATA_DIR."""
    return _token_from("DDPQ_TOKEN", "api-token") or os.environ.get("DDPQ_API_TOKEN") or None


def worker_token() -> str | None:
    return _token_from("DDPQ_WORKER_TOKEN", "worker-token")
