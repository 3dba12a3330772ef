"""A job spec from the command line's flags and from a YAML or JSON file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ddpq.cli.base import EXIT_USAGE, _fail
from ddpq.rules import secret_like


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--env takes KEY=VALUE, not {pair!r}", EXIT_USAGE)
        env[key] = value
    return env


def _read_spec_file(path: str) -> dict[str, Any]:
    """A job spec from a YAML or JSON file (``-``: stdin); exit 2 when it does not parse."""
    import yaml

    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        _fail(
            f"cannot read the spec file {where}: {getattr(exc, 'strerror', None) or exc}",
            EXIT_USAGE,
        )
    try:
        # JSON is (nearly) YAML, but JSON's own parser gives JSON's line and column.
        is_json = path.endswith(".json") or (path == "-" and text.lstrip().startswith("{"))
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        _fail(
            f"{where} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            EXIT_USAGE,
        )
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        _fail(f"{where} is not valid YAML: {getattr(exc, 'problem', None) or exc}{at}", EXIT_USAGE)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(
            f"{where}: a job spec is a mapping of fields (recipe, world_size, args, ...),"
            f" not a {type(data).__name__}",
            EXIT_USAGE,
        )
    # argv and environment values are strings; YAML reads `--epochs, 20` as a number.
    for key in ("args", "env"):
        value = data.get(key)
        if isinstance(value, list):
            data[key] = [_scalar_text(v) for v in value]
        elif isinstance(value, dict):
            data[key] = {k: _scalar_text(v) for k, v in value.items()}
    return data


def _scalar_text(v: Any) -> Any:
    # Only plain numbers: a bool or a list stays as it is for the API to refuse by name.
    return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


def secret_like_env(spec: dict[str, Any]) -> str | None:
    """The warning for plain ``env`` variables whose names look like secrets (``*_KEY``,
    ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``): a spec's env is shown to every member of
    the team (``ddpq status``, GET /jobs), where a secret's value is shown to no one."""
    env = spec.get("env")
    names = (
        sorted(k for k in env if isinstance(k, str) and secret_like(k))
        if isinstance(env, dict)
        else []
    )
    if not names:
        return None
    first = names[0]
    return (
        f"env {', '.join(names)[:200]} looks like a secret, and a job's env is shown to "
        "everyone who can list jobs. Keep it out of env: `ddpq secrets set "
        f"{first}` once, then `--secret {first}` (or `secrets: [{first}]` in a spec file)"
    )
