# The two set-up commands of the README: `make run` and `make test`.
# Debian's python3.11 when there is one: every user may run it, so a worker running as root can
# start jobs under uids of their own from this venv (pyenv's lives under /root, mode 700).
PY ?= $(firstword $(wildcard /usr/bin/python3.11) python3.11)
VENV := .venv
BIN := $(VENV)/bin
# torch and torchvision come from this machine's disk through pip (uv/poetry would download 3 GB).
TORCH_PINS := requirements/torch.txt
# The lock: every package of .[all,dev] at the version the suite passed with, with hashes
# (make lock refreshes it; requirements/server.txt is the API image's part of it).
LOCK := requirements/all.txt
PIP_COMPILE_FLAGS := -q --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links --constraint $(TORCH_PINS)
# Pinned: tests/test_openapi_client.py asserts the generated code's names and shapes.
OPENAPI_GENERATOR := openapi-python-client==0.29.1

.PHONY: venv lock browser slurm run test test-learning test-teardown compose-test lint fmt bench clean

venv: $(VENV)/.installed

# torch first, from the disk (already there, pip checks no hash of it), then the rest of
# the lock, every file checked against its hash; ddpq itself last, editable, adding nothing
# (--no-deps). .venv/tools holds the OpenAPI client generator tests/test_openapi_client.py
# runs, apart from the rest: it pins its own (older) typer.
$(VENV)/.installed: pyproject.toml $(LOCK) $(TORCH_PINS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r $(TORCH_PINS)
	$(BIN)/pip install -q --require-hashes -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e '.[all,dev]'
	test -x $(VENV)/tools/bin/python || $(PY) -m venv $(VENV)/tools
	$(VENV)/tools/bin/pip install -q $(OPENAPI_GENERATOR)
	touch $@

# Refresh the lock from pyproject.toml's floors (the newest releases that fit, torch held to
# requirements/torch.txt), with pip-tools from a venv of its own (.venv/lock: the lock may
# not exist yet, and .venv is made from it). pip-compile lists ddpq itself (ddpq[all] names
# its own extras): requirements/unself.py drops that line, since ddpq is the checkout.
LOCKER := $(VENV)/lock/bin
lock:
	test -x $(LOCKER)/python || $(PY) -m venv $(VENV)/lock
	$(LOCKER)/pip install -q "pip-tools$$(sed -n 's/^pip-tools==\([^ ]*\).*/==\1/p' $(LOCK) 2>/dev/null)"
	$(LOCKER)/pip-compile $(PIP_COMPILE_FLAGS) --upgrade --extra all --extra dev -o $(LOCK) pyproject.toml
	cp $(LOCK) requirements/server.txt  # its pins are the preferences: server's are all's
	$(LOCKER)/pip-compile $(PIP_COMPILE_FLAGS) --extra server -o requirements/server.txt pyproject.toml
	$(LOCKER)/python requirements/unself.py $(LOCK) requirements/server.txt

run: venv
	$(BIN)/ddpq up

# The dashboard's browser test drives Debian's Chromium (Playwright cannot download a browser
# here): install the OS package only when it is missing, without prompts.
browser:
	test -x /usr/bin/chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

# The slurm tests run a one-node cluster from Debian's packages (tests/slurmcluster.py
# configures and starts it): install them only when they are missing, without prompts.
slurm:
	command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurmctld slurmd slurm-client munge; }

# The Slurm tests share one cluster: they run one at a time, after the others (beside
# them, on 2 cores, they saved a minute of 14 and slowed the rest by 3).
test: venv browser slurm
	$(BIN)/pytest -n 3 --dist worksteal -m 'not exclusive and not learning and not slurm and not teardown'
	$(BIN)/pytest -m exclusive
	$(BIN)/pytest -m slurm

# The recipes trained until they learn (minutes of CPU each): CI runs these after `make test`.
test-learning: venv
	$(BIN)/pytest -n 2 --dist worksteal -m learning

# torch's abort in the interpreter's teardown, counted over many torchrun runs (issue 31:
# minutes of CPU, both databases): bare it still happens, through worker.entry it never does.
test-teardown: venv
	$(BIN)/pytest -n 2 --dist worksteal -m teardown

# docker compose up for real (slow: builds images; cached in /var/cache/ddpq-compose-test).
compose-test: venv
	bash tests/compose/run.sh

lint: venv
	$(BIN)/ruff check service worker ddpq recipes migrations tests bench requirements
	$(BIN)/ruff format --check service worker ddpq recipes migrations tests bench requirements
	$(BIN)/mypy

fmt: venv
	$(BIN)/ruff format service worker ddpq recipes migrations tests bench requirements
	$(BIN)/ruff check --fix service worker ddpq recipes migrations tests bench requirements

bench: venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/claim.py
	$(BIN)/python bench/transitions.py
	$(BIN)/python bench/recipes.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/code.py
	$(BIN)/python bench/slurm.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
