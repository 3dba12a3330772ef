"""The built-in recipes' metadata, recipes/catalog.json, found in one way for everyone.

The service lists and validates recipes from it, the worker maps a recipe to its
module, and each recipe builds its argument parser from its entry. find_spec locates
the recipes package without importing it: the API process never imports torch code.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path
from typing import Any


def catalog_path() -> Path:
    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the recipes package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "catalog.json"


@cache
def catalog() -> dict[str, dict[str, Any]]:
    """Every recipe's entry, by name (read once per process)."""
    data: dict[str, dict[str, Any]] = json.loads(catalog_path().read_text())
    return data


def recipe_names() -> list[str]:
    return sorted(catalog())
