# The two set-up commands of the README: `make run` and `make test`.
# Debian's python3.11 when there is one: every user may run it, so a worker running as root can
# start jobs under uids of their own from this venv (pyenv's lives under /root, mode 700).
PY ?= $(firstword $(wildcard /usr/bin/python3.11) python3.11)
VENV := .venv
BIN := $(VENV)/bin
# torch and torchvision come from this machine's disk through pip (uv/poetry would download 3 GB).
TORCH_PINS := requirements/torch.txt
# The lock: every package of .[all,dev] at the version the suite passed with, with hashes
# (make lock refreshes it; requirements/server.txt and worker.txt are the two images' parts).
LOCK := requirements/all.txt
PIP_COMPILE_FLAGS := -q --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links --constraint $(TORCH_PINS)
# Pinned: tests/test_openapi_client.py asserts the generated code's names and shapes.
OPENAPI_GENERATOR := openapi-python-client==0.29.1

.PHONY: venv lock browser slurm run test test-slurm test-launchers test-walls test-teardown test-long test-frameworks gpu-check gpu-check-compose test-learning compose-test docs lint fmt bench clean

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
	# Each image's part: all's pins are the preferences, so a part's pins are all's.
	cp $(LOCK) requirements/server.txt
	$(LOCKER)/pip-compile $(PIP_COMPILE_FLAGS) --extra server -o requirements/server.txt pyproject.toml
	cp $(LOCK) requirements/worker.txt
	$(LOCKER)/pip-compile $(PIP_COMPILE_FLAGS) --extra worker --extra recipes \
		-o requirements/worker.txt pyproject.toml
	$(LOCKER)/python requirements/unself.py $(LOCK) requirements/server.txt requirements/worker.txt

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

# Everything but the slow suites that have targets of their own (CI runs them all).
# --durations: the slowest tests named at the end, so a slow day shows where the time went.
test: venv browser
	$(BIN)/pytest -n 3 --dist worksteal --durations=25 -m 'not exclusive and not learning and not slurm and not gpu and not teardown and not launchers and not walls and not long and not frameworks'
	$(BIN)/pytest -m exclusive

# The two launchers against each other (tests/test_warm.py): the warm launcher's probe
# against a cold torchrun, and the cold side of every test that runs both ways (cancel,
# timeout, kill -9, restart, multi-node, walls; `make test` runs their warm side, the
# default). Its own target, which CI runs after `make test` (inside it they took 2 minutes).
test-launchers: venv
	$(BIN)/pytest -n 3 --dist worksteal -m 'launchers and not slurm and not gpu and not frameworks'

# The walls between jobs (tests/test_walls.py, docs/security.md): a hostile job's attacks
# on a walled worker (real uids) and an unwalled one, each launcher. Its own target, which
# CI runs after `make test` (inside it they took about a minute).
test-walls: venv
	$(BIN)/pytest -n 3 --dist worksteal -m 'walls and not launchers'

# The long end-to-end suites (marked `long`: the database outages, the schema fuzz, the 2x2
# job, kill -9 resumes, an API restart, a job's pip install, the README's path, every route
# against every wrong token): about 5 minutes of a 3-process run. Their own target, which CI
# runs after `make test` (with them, make test took 22 minutes on a slow day of this VM).
test-long: venv
	$(BIN)/pytest -n 3 --dist worksteal -m 'long and not launchers and not slurm and not gpu'

# The frameworks people train with: a Lightning, accelerate, ignite, Hugging Face Trainer
# and torch.compile program (examples/frameworks/) as jobs under both launchers, each killed
# once after its first checkpoint and resumed, against a bare torchrun (tests/test_frameworks.py:
# about 5-6 minutes here, one server and worker for them all, one at a time on 2 cores). Its
# own target, which CI runs after `make test`.
test-frameworks: venv
	$(BIN)/pytest -m frameworks

# The Slurm executor against a real one-node cluster (tests/slurmcluster.py). The tests
# share that cluster, so they run one at a time: their own target, which CI runs after
# `make test` (inside it they took 2.5 minutes).
test-slurm: venv slurm
	$(BIN)/pytest -m slurm

# Everything ddpq promises about GPUs, on a host that has them (tests/gpu/: under 10
# minutes; it prints a table to paste into an issue). Without a CUDA device it skips, in
# one line. DDPQ_GPU_CHECK_TUTORIAL / DDPQ_GPU_CHECK_NANOGPT: checkouts of the DDP
# tutorial series and nanoGPT to run as jobs too.
gpu-check: venv
	$(BIN)/pytest -p no:cacheprovider -rs tests/gpu; rc=$$?; test $$rc -eq 5 || exit $$rc  # 5: skipped whole

# docker-compose.yml on this host's GPUs (the NVIDIA Container Toolkit, docs/deployment.md):
# up with the real images, a 2-GPU recipe job through it, down.
gpu-check-compose: venv
	DDPQ_GPU_CHECK_COMPOSE=1 $(BIN)/pytest -p no:cacheprovider -rs tests/gpu/test_gpu_compose.py; \
		rc=$$?; test $$rc -eq 5 || exit $$rc

# The recipes trained until they learn (minutes of CPU each): CI runs these after `make test`.
test-learning: venv
	$(BIN)/pytest -n 2 --dist worksteal -m learning

# The documentation site (mkdocs.yml, docs/): the reference pages generated from the code
# first, then the build into site/ with warnings as errors (a broken link or anchor, a page
# missing from nav). CI runs it after make test.
docs: venv
	$(BIN)/python docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# torch's abort in the interpreter's teardown, counted over many torchrun runs
# (tests/test_entry_rounds.py: minutes of CPU, both databases): through worker.entry it
# never happens; bare, the control sees it (or skips, saying so: how often torch aborts
# depends on the machine and its load).
test-teardown: venv
	$(BIN)/pytest -n 2 --dist worksteal -m teardown

# docker compose up for real (slow: builds images; cached in /var/cache/ddpq-compose-test).
compose-test: venv
	bash tests/compose/run.sh

lint: venv
	$(BIN)/ruff check service worker ddpq recipes migrations tests bench requirements docs
	$(BIN)/ruff format --check service worker ddpq recipes migrations tests bench requirements docs
	$(BIN)/mypy

fmt: venv
	$(BIN)/ruff format service worker ddpq recipes migrations tests bench requirements docs
	$(BIN)/ruff check --fix service worker ddpq recipes migrations tests bench requirements docs

bench: venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/claim.py
	$(BIN)/python bench/transitions.py
	$(BIN)/python bench/recipes.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/jobcost.py
	$(BIN)/python bench/code.py
	$(BIN)/python bench/code.py --tree random
	$(BIN)/python bench/slurm.py
	$(BIN)/python bench/sweep.py

clean:
	rm -rf $(VENV) var site .pytest_cache .mypy_cache .ruff_cache
