"""The metric ingest's fast reading of a body (service.ingest.parse_points) against the
models' (MetricsIn, then points_of): where it reads a body at all, it must read what the
models read, and it must leave every body the models refuse to them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from service import ingest
from service.schemas import MetricsIn

ACCEPTED: list[bytes] = [
    # ddpq.train's shape
    json.dumps(
        {
            "items": [
                {"step": s, "epoch": s / 7, "values": {"loss": 1 / (s + 1), "acc": 0.5}}
                for s in range(1000)
            ]
        }
    ).encode(),
    # ints as values and epochs, the non-finite names, a null epoch, a unicode name
    b'{"items":[{"step":0,"epoch":3,"values":{"loss":2,"gnorm":"Infinity"}},'
    b'{"step":1,"epoch":null,"values":{"\xe6\x90\x8d\xe5\xa4\xb1":"NaN","b":"-Infinity"}}]}',
    # total_steps on a point, a point with only the total, dropped alone and alongside
    b'{"items":[{"step":1,"total_steps":10,"values":{"a":1}},{"step":2,"total_steps":12}]}',
    b'{"dropped":5}',
    b'{"items":[{"step":4,"values":{"a":1.5}}],"dropped":3}',
    # a duplicate key keeps its last value, as model_validate_json does
    b'{"items":[{"step":1,"values":{"a":"bad","a":3}}]}',
    b'{"items":[{"step":"x","step":1,"values":{"a":3}}]}',
    # a name with quotes, backslashes, commas and braces (the array literal's specials)
    json.dumps({"items": [{"step": 1, "values": {'a"b\\c,{d}': 1.25}}]}).encode(),
    # an int value past 2**53 (rounded as pydantic rounds it)
    b'{"items":[{"step":1,"values":{"a":1234567890123456789}}]}',
]
# Valid, but left to the models (steps that repeat or fall, total_steps among the values,
# ints past what float() may take alike).
LEFT: list[bytes] = [
    b'{"items":[{"step":5,"values":{"a":1}},{"step":5,"values":{"a":2,"b":1}}]}',
    b'{"items":[{"step":5,"values":{"a":1}},{"step":4,"values":{"a":2}}]}',
    b'{"items":[{"step":3,"values":{"loss":0.5,"total_steps":120.0}}]}',
    b'{"items":[{"step":1,"values":{"a":%d}}]}' % 10**30,
]


def _fields(points: ingest.Points) -> dict[str, Any]:
    return {k: getattr(points, k) for k in ingest.Points.__slots__}


def _same(a: Any, b: Any) -> bool:
    # NaN != NaN: compare as JSON would show it
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


@pytest.mark.parametrize("raw", ACCEPTED + LEFT)
def test_the_fast_reading_reads_what_the_models_read(raw: bytes) -> None:
    models = _fields(ingest.points_of(MetricsIn.model_validate_json(raw)))
    fast = ingest.parse_points(raw)
    if raw in LEFT:
        assert fast is None
        return
    assert fast is not None, raw
    assert _same(_fields(fast), models), (raw[:100], _fields(fast), models)


def test_every_body_the_models_refuse_is_left_to_them() -> None:
    from tests.test_api import REFUSED_METRICS

    bodies = [raw for raw, _, _ in REFUSED_METRICS] + [
        b'{"items":[{"step":1,"values":{"loss":NaN}}]}',
        b'{"items":[{"step":1,"values":{"l\xff":1}}]}',
        b"not json",
        b"[]",
        b'{"items":[]}',
        b'{"items":null}',
        b'{"items":[{"step":1,"values":{}}]}',
        b'{"items":[{"step":-1,"values":{"a":1}}]}',
        b'{"items":[{"step":1.0,"values":{"a":1}}]}',
        b'{"items":[{"step":1,"total_steps":0,"values":{"a":1}}]}',
        b'{"items":[{"step":1,"total_steps":true,"values":{"a":1}}]}',
        b'{"items":[{"step":1,"values":{"a":1}}],"dropped":2147483648}',
        b'{"items":[{"step":1,"values":%s}]}'
        % json.dumps({f"m{i}": 1 for i in range(101)}).encode(),
    ]
    for raw in bodies:
        with pytest.raises(ValidationError):
            MetricsIn.model_validate_json(raw)
        assert ingest.parse_points(raw) is None, raw[:100]
