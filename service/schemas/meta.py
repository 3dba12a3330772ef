"""What the API says of itself: its health, and the built-in recipes a job may run."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class RecipeArg(BaseModel):
    name: str
    type: Literal["int", "float", "str"]  # recipes._common parses these three
    default: int | float | str | None
    help: str
    # Bounds and choices the recipe enforces (its arguments fail the job otherwise).
    min: int | float | None = None
    max: int | float | None = None
    choices: list[str] | None = None


class RecipePublic(BaseModel):
    name: str
    description: str
    args: list[RecipeArg]


class RecipesPublic(BaseModel):
    items: list[RecipePublic]


class Health(BaseModel):
    """GET /healthz: liveness, and whether the database answers."""

    status: Literal["ok", "degraded"]
    database: Literal["ok", "unreachable"]
