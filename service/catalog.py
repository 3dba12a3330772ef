"""The built-in recipes, read from recipes/catalog.json.

The service lists and validates recipes from this metadata alone: it never
imports recipe code (that would pull torch into the API process).
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path
from typing import Any


def _catalog_path() -> Path:
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the recipes package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "catalog.json"


@cache
def recipes() -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads(_catalog_path().read_text())
    return data


def recipe_names() -> list[str]:
    return sorted(recipes())
