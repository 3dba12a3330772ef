"""A job's spec, one model both ways: the API's submit body (service.schemas.JobSpec) and
the stored spec's view the API answers with and the worker reads a claim through
(ddpq.jobspec) agree field by field, and a claim's spec serialises as the stored dict
did when it travelled as one. The (job, attempt) key the worker keeps attempts by."""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from ddpq.jobspec import ClaimedSpec, JobSpecPublic
from ddpq.messages import AttemptKey, ClaimedJob
from service.schemas import JobSpec


def shape(tp: Any) -> Any:
    """A type as the values it holds: its constraints and checks dropped (Annotated),
    a Literal as its values' type, a model as its fields' shapes."""
    origin = get_origin(tp)
    if origin is Annotated:
        return shape(get_args(tp)[0])
    if origin is Literal:
        return frozenset(type(v) for v in get_args(tp))
    if origin in (Union, types.UnionType):
        members: set[Any] = set()
        for arg in get_args(tp):
            sub = shape(arg)
            members |= sub if isinstance(sub, frozenset) else {sub}
        return frozenset(members)
    if origin is not None:
        return (origin, tuple(shape(a) for a in get_args(tp)))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return ("model", fields_of(tp))
    return frozenset({tp})


def fields_of(model: type[BaseModel]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((n, shape(f.annotation)) for n, f in model.model_fields.items()))


@pytest.mark.parametrize("view", [JobSpecPublic, ClaimedSpec])
def test_the_submit_body_and_the_spec_read_agree_on_every_field(view: type[BaseModel]) -> None:
    submitted, read = dict(fields_of(JobSpec)), dict(fields_of(view))
    assert set(submitted) == set(read)
    assert {n: (submitted[n], read[n]) for n in submitted if submitted[n] != read[n]} == {}


def test_the_shape_sees_a_type_that_differs() -> None:
    assert shape(int | None) != shape(str | None)
    assert shape(list[Annotated[int, "x"]]) == shape(list[int])
    assert shape(dict[str, int]) != shape(dict[str, str])
    assert shape(Literal["a", "b"] | None) == shape(str | None)

    class A(BaseModel):
        n: int

    class B(BaseModel):
        n: Annotated[str, "x"]

    assert shape(list[A]) != shape(list[B])


class OldClaimedJob(ClaimedJob):
    """The claim as it was when its spec travelled as a dict."""

    spec: dict[str, Any]  # type: ignore[assignment]


FULL = JobSpec(
    entrypoint="train.py",
    args=["--lr", "0.1"],
    env={"A": "1"},
    world_size=4,
    nnodes=2,
    timeout_s=3600,
    secrets=["HF_TOKEN"],
    params={"lr": 1e-7, "n": 2, "on": True, "tag": "x", "none": None, "f": 1.0},
    after=[{"job": 3}],  # type: ignore[list-item]
    from_checkpoint={"job": 2, "step": 10},  # type: ignore[arg-type]
    rungs=[10, 20],
).model_dump(mode="json")

STORED = [
    FULL,
    # Stored before later fields existed: none of them (no null) on the wire.
    {"entrypoint": "train.py", "world_size": 1, "env": {}},
    {"recipe": "mnist", "args": []},
    # Written by a newer API during an upgrade: its unknown keys go as they are.
    {**FULL, "newer": {"x": [1, 2]}, "later": None},
    # Nested as stored, without what a default would add.
    {"entrypoint": "t.py", "from_checkpoint": {"job": 2}, "after": [{"job": 5}]},
    {},
]


def canonical(text: str | bytes) -> str:
    """JSON compared key order aside (1 and 1.0 still differ)."""
    return json.dumps(json.loads(text), sort_keys=True)


@pytest.mark.parametrize("stored", STORED)
def test_a_claims_spec_serialises_as_the_stored_dict_did(stored: dict[str, Any]) -> None:
    fields = {
        "job_id": 7,
        "attempt": 1,
        "token": "ddpqj_x",
        "spec": stored,
        "device": "cpu",
        "nproc_per_node": 1,
        "gpus": [],
        "checkpoint_dir": "/c",
        "resume_from": [],
    }
    old, new = OldClaimedJob(**fields), ClaimedJob(**fields)
    assert canonical(new.model_dump_json()) == canonical(old.model_dump_json())
    # The claim a bridge writes into a Slurm job's plan (a Python dump), and read back.
    assert new.model_dump() == old.model_dump()
    again = ClaimedJob.model_validate_json(new.model_dump_json())
    assert canonical(again.model_dump_json()) == canonical(old.model_dump_json())
    assert ClaimedJob.model_validate(new.model_dump()).model_dump() == old.model_dump()


def test_a_claims_spec_reads_typed_with_the_defaults() -> None:
    spec = ClaimedSpec.model_validate({"entrypoint": "t.py", "from_checkpoint": {"job": 2}})
    assert spec.timeout_s is None and spec.env == {} and spec.max_restarts == 0
    assert spec.from_checkpoint is not None and spec.from_checkpoint.job == 2
    assert ClaimedSpec.model_validate({"x": 1}).model_extra == {"x": 1}


def test_an_attempt_key_is_the_tuple_it_replaced() -> None:
    key = AttemptKey(12, 3)
    assert key == (12, 3) and hash(key) == hash((12, 3))
    assert {(12, 3): "a"}[key] == "a" and {key: "a"}[(12, 3)] == "a"
    job_id, attempt = key
    assert (job_id, attempt) == (key.job_id, key.attempt) == (12, 3)
