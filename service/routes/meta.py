"""Health and the recipe list."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ddpq.catalog import catalog
from service import gpus, queue
from service.auth import UserAuth
from service.deps import DB
from service.schemas import (
    Health,
    RecipeArg,
    RecipePublic,
    RecipesPublic,
    WorkerPublic,
    WorkersPublic,
)

router = APIRouter(tags=["meta"])


@router.get(
    "/healthz",
    responses={
        200: {"model": Health, "description": "the API and its database answer"},
        503: {"model": Health, "description": "the database is unreachable"},
    },
)
async def get_health(db: DB) -> JSONResponse:
    """Liveness and database reachability (no token needed)."""
    try:
        await run_in_threadpool(db.ping)
    except Exception:
        return JSONResponse(
            {"status": "degraded", "database": "unreachable"},
            status_code=503,
            headers={"Retry-After": "2"},
        )
    return JSONResponse({"status": "ok", "database": "ok"})


@router.get("/workers", response_model=WorkersPublic, dependencies=[UserAuth])
def list_workers(db: DB) -> WorkersPublic:
    """Registered workers: their slots, what is free, what runs on them, their last
    heartbeat; their GPUs as NVML names them, each with its holder and use."""
    items = gpus.worker_gpus(db, queue.workers_overview(db))
    return WorkersPublic(items=[WorkerPublic(**w) for w in items])


@router.get("/recipes", response_model=RecipesPublic, dependencies=[UserAuth])
def list_recipes() -> RecipesPublic:
    """The built-in training programs and their arguments."""
    items = [
        RecipePublic(
            name=name,
            description=entry["description"],
            args=[RecipeArg(**a) for a in entry["args"]],
        )
        for name, entry in sorted(catalog().items())
    ]
    return RecipesPublic(items=items)
