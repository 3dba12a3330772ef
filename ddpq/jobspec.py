"""A job's spec as it is stored and read: the API's answers show it (JobSpecPublic) and
a claim carries it to the worker (ClaimedSpec), which reads it through that model, never
as a raw dict.

The fields are the submit body's (service.schemas.jobs.JobSpec, which holds a spec to
its limits when it is submitted) without its checks: a spec that passed them must still
be read after a rule tightens. tests/test_jobspec.py checks, from the models, that the
two agree on every field's name and type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from ddpq.rules import INT64, MAX_PARAM_TEXT

# A parameter's value (a sweep's trial's: ddpq.rules.params_problem has the rule): a JSON
# scalar, never coerced ("2" stays a string, true a bool).
ParamValue = (
    Annotated[str, Field(strict=True, max_length=MAX_PARAM_TEXT)]
    | Annotated[int, Field(strict=True, ge=INT64[0], le=INT64[1])]
    | Annotated[float, Field(strict=True, allow_inf_nan=False)]
    | Annotated[bool, Field(strict=True)]
    | None
)


class ForkFromPublic(BaseModel):
    job: int
    step: int | None = None


class DependencyPublic(BaseModel):
    job: int
    when: Literal["ok", "any"] = "ok"


class JobSpecPublic(BaseModel):
    """A job's spec as stored (JobSpec at its submission), in answers.

    The fields of JobSpec without its validators: a spec that passed them when it was
    submitted must still be shown after a rule tightens (a recipe removed, a variable
    newly reserved). Unknown keys are kept, as stored (a spec written by a newer API
    process during a rolling upgrade); a key missing from an older spec shows its default.
    """

    # Every field is in every answer: required in the document, so a generated client
    # types them without "unset".
    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)

    name: str | None = None
    recipe: str | None = None
    entrypoint: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    world_size: int = 1
    nnodes: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_restarts: int = 0
    max_attempts: int = 3
    retry_on_error: bool = False
    priority: int = 0
    timeout_s: int | None = None
    code: str | None = None
    pip: list[str] = []
    keep_last: int | None = None
    launcher: str | None = None
    secrets: list[str] = []
    params: dict[str, ParamValue] = {}
    after: list[DependencyPublic] = []
    array_index: int | None = None
    from_checkpoint: ForkFromPublic | None = None
    rungs: list[int] = []


class ClaimedSpec(JobSpecPublic):
    """A job's spec as a claim carries it (ClaimedJob.spec): JobSpecPublic's fields,
    which the worker reads as attributes (a key the stored spec lacks reads as its
    default), serialised with the keys the stored spec had and no others. So the claim's
    JSON is the stored dict's, as it was when the spec travelled as one: a spec stored
    before a field existed gains no key, and no null, on the wire."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=False)

    # Its document (the return type's) is an object of any keys, as when it was a dict:
    # which keys it has are the stored spec's, which the fields' schema would not say.
    @model_serializer(mode="wrap")
    def _as_stored(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _given_keys(self, handler(self))


def _given_keys(model: BaseModel, dumped: dict[str, Any]) -> dict[str, Any]:
    """Of ``model`` dumped, the keys its input gave (its nested models' too): what the
    defaults filled in is left out."""
    given = model.model_fields_set | set(model.model_extra or {})
    kept: dict[str, Any] = {}
    for key, value in dumped.items():
        if key not in given:
            continue
        field = getattr(model, key, None)
        if isinstance(field, BaseModel) and isinstance(value, dict):
            value = _given_keys(field, value)
        elif isinstance(field, list) and isinstance(value, list):
            value = [
                _given_keys(f, v) if isinstance(f, BaseModel) and isinstance(v, dict) else v
                for f, v in zip(field, value, strict=True)
            ]
        kept[key] = value
    return kept
