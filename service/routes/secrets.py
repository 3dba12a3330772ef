"""Secrets: each user sets, lists and deletes their own (user token; an admin lists
anyone's names); a Slurm attempt's nodes fetch their job's values (job token). No route
answers a value to a person (service.secrets)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from ddpq.rules import MAX_USER_SECRETS
from service import secrets
from service.auth import CurrentUser, JobAttempt, UserAuth
from service.deps import DB, JobId, Keys
from service.errors import not_utf8_json, responses
from service.schemas import JobSecrets, SecretIn, SecretPublic, SecretsPublic

router = APIRouter(dependencies=[UserAuth], tags=["secrets"])
job_router = APIRouter(tags=["secrets"])
# The variable's name (ddpq.rules.secret_name_problem says the rest, with service.secrets).
SecretName = Annotated[str, Path(min_length=1, max_length=128, description="the variable's name")]
NO_SECRET = {404: "the token's user has no secret of this name"}
# The body is read here, not by FastAPI: a 422 would echo it, value and all (app._invalid).
_VALUE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": SecretIn.model_json_schema()}},
    }
}


def _value(raw: bytes) -> str:
    """The value a PUT sends; a 422 naming what is wrong, never quoting it."""
    try:
        return SecretIn.model_validate_json(raw).value
    except ValidationError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise RequestValidationError([not_utf8_json(bad)]) from None
        errors = [
            {"loc": ("body", *e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        raise RequestValidationError(errors) from None


@router.put(
    "/secrets/{name}",
    response_model=SecretPublic,
    openapi_extra=_VALUE_BODY,
    responses=responses({409: f"the user keeps {MAX_USER_SECRETS} secrets, the most a user may"}),
)
async def set_secret(
    name: SecretName, request: Request, db: DB, me: CurrentUser, keys: Keys
) -> Any:
    """Set one of your secrets (created or replaced): its value is kept encrypted and
    reaches only the ranks of your jobs that name it (`secrets` in the spec)."""
    value = _value(await request.body())
    return await run_in_threadpool(secrets.put, db, keys, me, name, value)


@router.get(
    "/secrets",
    response_model=SecretsPublic,
    responses=responses({403: "a member asked for another user's secrets"}),
)
async def list_secrets(
    db: DB,
    me: CurrentUser,
    user: Annotated[
        str | None,
        Query(min_length=1, max_length=64, description="whose (admins): the token's user's"),
    ] = None,
) -> Any:
    """The names of your secrets and when each was set; never a value. An admin may list
    anyone's names (`user`)."""
    return {"items": await run_in_threadpool(secrets.listing, db, me, user)}


@router.delete("/secrets/{name}", status_code=204, responses=responses(NO_SECRET))
async def delete_secret(name: SecretName, db: DB, me: CurrentUser) -> Response:
    """Delete one of your secrets. A queued job that names it fails when a worker claims
    it, its reason naming the secret."""
    await run_in_threadpool(secrets.remove, db, me, name)
    return Response(status_code=204)


@job_router.get(
    "/jobs/{job_id}/secrets",
    response_model=JobSecrets,
    responses=responses(
        {
            409: "the token's attempt is no longer the job's current one, is not a Slurm "
            "bridge's, or a secret its spec names is gone"
        }
    ),
)
async def get_job_secrets(job_id: JobId, attempt: JobAttempt, db: DB, keys: Keys) -> Any:
    """The values of the secrets the job's spec names, for the ranks' environment: asked
    by each node of a Slurm attempt with its job token (the bridge keeps them out of the
    batch script, which Slurm stores)."""
    return {"values": await run_in_threadpool(secrets.for_attempt, db, keys, attempt)}
