# The two set-up commands of the README: `make run` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch and torchvision come from this machine's disk through pip (uv/poetry would download 3 GB).
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: venv run test test-fast lint fmt bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PINS)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

run: venv
	$(BIN)/ddpq up

test: venv
	$(BIN)/pytest

lint: venv
	$(BIN)/ruff check service worker ddpq recipes migrations tests bench
	$(BIN)/ruff format --check service worker ddpq recipes migrations tests bench
	$(BIN)/mypy

fmt: venv
	$(BIN)/ruff format service worker ddpq recipes migrations tests bench
	$(BIN)/ruff check --fix service worker ddpq recipes migrations tests bench

bench: venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/claim.py
	$(BIN)/python bench/recipes.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
