"""Generated input: schemathesis against a live `ddpq serve`'s own /openapi.json, and
Hypothesis properties of the job spec validator and the metric value encoding."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ddpq.rules import (
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
    entrypoint_problem,
    reserved_env,
    unsafe_char,
    visible,
)
from service.schemas import JobSpec, MetricsIn, metric_in, metric_out
from tests.conftest import REPO, start_server, stop_server

# Enough to reach every operation in every phase (coverage, fuzzing, stateful) and
# finish in about half a minute on a shared 2-core machine.
MAX_EXAMPLES = int(os.environ.get("DDPQ_FUZZ_EXAMPLES", "25"))
SEED = os.environ.get("DDPQ_FUZZ_SEED", "7")  # fixed, so CI is repeatable


@pytest.mark.long  # about 45 s: `make test-long` runs it (CI does too)
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(
    db_url: str, tmp_path: Path
) -> None:
    beside = Path(sys.executable).parent / "st"
    st_bin = str(beside) if beside.exists() else shutil.which("st")
    assert st_bin, "schemathesis is in the dev extras"
    # Claims are long polls; a fuzzer asking for wait_s=60 must not hold the run.
    server = start_server(db_url, tmp_path / "api", DDPQ_MAX_CLAIM_WAIT_S="0.5")
    # The admin routes get an admin of their own: one the fuzzer rotates or revokes
    # (with a name it happened to guess) leaves the user routes' token working.
    admin = server.client().post("/users", json={"name": "fuzz-admin", "role": "admin"})
    try:
        r = subprocess.run(
            [
                st_bin,
                "--config-file",
                str(REPO / "tests" / "schemathesis.toml"),
                "run",
                f"{server.url}/openapi.json",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                SEED,
                "--no-color",
                "--output-truncate",
                "true",
                # The server-sent events stream (if the API has one) never ends while
                # a job lives; follow=true on the log is dropped by the hooks module.
                "--exclude-path-regex",
                "/events$",
                "--generation-database",
                "none",
            ],
            env={
                **os.environ,
                "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
                "PYTHONPATH": str(REPO),
                "DDPQ_FUZZ_USER_TOKEN": server.api_token,
                "DDPQ_FUZZ_WORKER_TOKEN": server.worker_token,
                "DDPQ_FUZZ_ADMIN_TOKEN": admin.json()["token"],
            },
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=280,
        )
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
        assert re.search(r"Tested: (\d+)", out) and "Selected: " in out, out[-3000:]
        selected = re.search(r"Selected: (\d+)/(\d+)", out)
        assert selected and int(selected.group(1)) >= 15, out[-3000:]
        assert "Traceback" not in server.log(), server.log()[-4000:]
    finally:
        stop_server(server)  # closes the client that made the admin, then the server


# ---- properties of the validator ----------------------------------------------------

SAFE_SEGMENT = st.text(
    alphabet=st.characters(
        categories=("L", "N"), include_characters="_-.", exclude_characters="/\\%"
    ),
    min_size=1,
    max_size=20,
).filter(lambda s: s not in (".", ".."))
SAFE_PATH = st.lists(SAFE_SEGMENT, min_size=1, max_size=5).map("/".join)


@given(SAFE_PATH)
def test_plain_relative_paths_are_accepted(path: str) -> None:
    if entrypoint_problem(path) is None:  # NFKC may turn a segment into ".." etc.
        assert JobSpec(entrypoint=path).entrypoint == path


@given(
    st.lists(SAFE_SEGMENT, max_size=3),
    st.sampled_from(["..", "/", "~", "\\", "%2e", "\x00", "\n", "\uff0e\uff0e"]),
    st.lists(SAFE_SEGMENT, max_size=3),
)
def test_no_spelling_of_a_way_out_is_accepted(
    before: list[str], trick: str, after: list[str]
) -> None:
    if trick in ("/", "~"):
        path = trick + "/".join(before + after)  # absolute or home-relative
    elif trick in ("..", "\uff0e\uff0e"):
        path = "/".join([*before, trick, *after])
    else:
        path = "/".join(before) + trick + "/".join(after)
    with pytest.raises(ValidationError):
        JobSpec(entrypoint=path)


@given(
    st.one_of(
        st.sampled_from(sorted(RESERVED_ENV_NAMES)),
        st.tuples(
            st.sampled_from(RESERVED_ENV_PREFIXES),
            st.from_regex(r"[A-Z0-9_]{0,10}", fullmatch=True),
        ).map("".join),
        st.from_regex(r"[A-Z]{1,8}_VISIBLE_DEVICES", fullmatch=True),
    ),
    st.booleans(),
)
def test_reserved_variables_are_refused_in_any_case(name: str, lower: bool) -> None:
    name = name.lower() if lower else name
    assert reserved_env(name)
    with pytest.raises(ValidationError):
        JobSpec(recipe="toy-regression", env={name: "1"})


@given(st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True), st.text()))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_env_is_accepted_exactly_when_no_rule_forbids_it(env: dict[str, str]) -> None:
    forbidden = any(reserved_env(k) or _bad_text(v) for k, v in env.items())
    spec = _spec(env=env)
    assert (spec is None) == forbidden
    assert spec is None or spec.env == env


@given(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True),
    st.sampled_from(["\n", "\r\n", "\r", " ", "\t", "=", "-", "\u00e9"]),
)
def test_an_env_name_is_matched_whole(name: str, tail: str) -> None:
    """Not "^...$" with match(): "$" also matches before a final newline ("PATH\\n")."""
    with pytest.raises(ValidationError, match="variable name"):
        JobSpec(recipe="toy-regression", env={name + tail: "1"})


@given(st.text(max_size=40))
def test_a_job_name_is_accepted_exactly_when_a_terminal_shows_it_as_text(name: str) -> None:
    spec = _spec(name=name)
    assert (spec is None) == (unsafe_char(name) is not None)
    assert spec is None or visible(name) == name


def _bad_text(s: str) -> bool:
    """What no string field takes: a NUL (Postgres refuses it) or a lone surrogate."""
    return "\x00" in s or any("\ud800" <= c <= "\udfff" for c in s)


def _spec(**fields: Any) -> JobSpec | None:
    """The spec of a toy-regression job with ``fields``, or None if it is refused."""
    try:
        return JobSpec(recipe="toy-regression", **fields)
    except ValidationError:
        return None


@given(st.lists(st.text(max_size=50), max_size=20))
def test_args_are_kept_verbatim(args: list[str]) -> None:
    bad = any(_bad_text(a) for a in args)
    spec = _spec(args=args)
    assert (spec is None) == bad
    if spec is not None:
        assert spec.args == args
        assert json.loads(spec.model_dump_json())["args"] == args


@given(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["world_size", "nnodes", "max_restarts", "max_attempts", "priority"]),
)
def test_integer_fields_are_bounded_and_never_coerced(a: int, b: int, field: str) -> None:
    for value in (a, b, str(a), float(a), True):
        try:
            spec = JobSpec(recipe="toy-regression", **{field: value})
        except ValidationError:
            continue
        assert type(value) is int and getattr(spec, field) == value
        assert abs(value) <= 2**63  # fits Postgres bigint


METRIC_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),
)


@given(st.dictionaries(st.text(min_size=1, max_size=200), METRIC_VALUE, min_size=1, max_size=5))
def test_metric_values_round_trip_as_strict_json(values: dict[str, Any]) -> None:
    body = {"items": [{"step": 1, "values": values}]}
    printable = all(k.isprintable() and not _bad_text(k) for k in values)
    finite_or_named = all(isinstance(v, str) or math.isfinite(v) for v in values.values())
    try:
        parsed = MetricsIn.model_validate(body)
    except ValidationError:
        assert not (printable and finite_or_named)
        return
    assert printable and finite_or_named
    for name, value in parsed.items[0].values.items():
        out = metric_out(metric_in(value))
        text = json.dumps(out, allow_nan=False)  # every answer is valid JSON
        original = values[name]
        if isinstance(original, str):
            assert out == original
        else:
            assert json.loads(text) == original
