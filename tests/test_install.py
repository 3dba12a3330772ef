"""What `pip install ddpq` gives, by role (pyproject.toml's extras; issue 29).

- every third-party module each room imports is declared in the set of its role: the base
  (ddpq/, the CLI, the client, ddpq.train), server (service/, migrations/), worker
  (worker/), recipes (recipes/); ddpq.integrations' frameworks in frameworks (imported
  when first used); tests and bench in dev; the CLI's table of what each
  extra gives (ddpq/cli/extras.py) names modules of that extra;
- the sdist and wheel build (`python -m build`) and pass `twine check`;
- a fresh venv with a plain install of the wheel (its light dependencies, at the lock's
  versions, from a wheel cache kept between runs) has no torch, FastAPI, SQLAlchemy,
  NumPy or scikit-learn, and runs `ddpq --help`; `ddpq serve`, `ddpq worker` and
  `ddpq up` each say which extra to install (exit 2, no traceback); `ddpq login` and
  `ddpq submit` of a directory work against a real API (started from the suite's
  environment), and so does a script calling ddpq.train.report() there, whose points
  are stored.
"""

from __future__ import annotations

import ast
import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ddpq.cli.extras import MODULES
from tests.conftest import Server, free_port, start_server, stop_process, stop_server, wait_for
from tests.helpers import submit_and_claim

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCK = REPO / "requirements" / "all.txt"
# Wheels of the light dependencies, kept between runs (a rerun installs offline).
WHEELHOUSE = Path(os.environ.get("DDPQ_TEST_WHEELHOUSE", Path.home() / ".cache/ddpq-wheelhouse"))
# (pydantic is not among them: typer >= 0.29 depends on it.)
HEAVY = ("torch", "torchvision", "fastapi", "sqlalchemy", "alembic", "sklearn", "numpy", "uvicorn")


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _declared(*sets: str) -> set[str]:
    """The distributions of the base and of the named extras (``all`` expanded)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    todo = list(sets)
    while todo:
        extra = todo.pop()
        for r in extras[extra]:
            if r.startswith("ddpq["):
                todo.extend(r[len("ddpq[") : -1].split(","))
            else:
                names.add(_name(r))
    return names


def _third_party(path: Path) -> set[str]:
    """The top-level names of modules ``path`` imports, its own project's and the standard
    library's left out."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    own = {"ddpq", "service", "worker", "recipes", "migrations", "tests", "bench"}
    return found - own - set(sys.stdlib_module_names)


DISTRIBUTIONS = importlib.metadata.packages_distributions()


def _dists(module: str) -> set[str]:
    return {_name(d) for d in DISTRIBUTIONS.get(module, [])}


# Each room and the sets its imports must come from.
ROOMS = {
    "ddpq": (),
    "service": ("server",),
    "migrations": ("server",),
    "worker": ("worker",),
    "recipes": ("recipes",),
}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_every_import_of_a_room_is_declared_in_its_role(room: str) -> None:
    allowed = _declared(*ROOMS[room])
    undeclared = []
    for path in sorted((REPO / room).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for module in sorted(_third_party(path)):
            ok = allowed
            if rel == "ddpq/train.py" and module == "torch":
                ok = _declared("worker")  # deferred: only checkpoints touch torch
            if rel.startswith("ddpq/integrations/"):  # each its framework, when first used
                ok = allowed | _declared("frameworks", "worker")
                if module == "lightning":  # the unified package, when a program uses it:
                    continue  # the same Lightning as the extra's pytorch-lightning
            # The worker protocol and the job spec it carries: the API and the worker.
            if rel in ("ddpq/messages.py", "ddpq/jobspec.py"):
                ok = _declared("server") & _declared("worker")
            dists = _dists(module)
            if not dists or not dists & ok:
                undeclared.append(f"{rel}: {module} ({', '.join(sorted(dists)) or '?'})")
    assert not undeclared, f"imports not declared for {room}:\n" + "\n".join(undeclared)


def test_tests_and_bench_import_only_what_dev_and_all_declare() -> None:
    allowed = _declared("all", "dev")
    undeclared = [
        f"{path.relative_to(REPO)}: {module}"
        for room in ("tests", "bench")
        for path in sorted((REPO / room).rglob("*.py"))
        for module in sorted(_third_party(path))
        if (dists := _dists(module)) and not dists & allowed  # unknown: the tests' own
    ]
    assert not undeclared, "\n".join(undeclared)


def test_the_base_never_names_torch_or_the_server() -> None:
    base = _declared()
    for heavy in ("torch", "torchvision", "fastapi", "sqlalchemy", "scikit-learn", "pydantic"):
        assert heavy not in base
    assert "torch" in _declared("worker") and "fastapi" in _declared("server")


@pytest.mark.parametrize("extra", sorted(MODULES))
def test_the_clis_table_of_extras_names_their_modules(extra: str) -> None:
    for module in MODULES[extra]:
        assert _dists(module) & _declared(extra), (extra, module)


# ---- the built distributions and a plain install ----------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would lead a child to the checkout or the suite's
    venv (PYTHONPATH, VIRTUAL_ENV) or to a ddpq server (DDPQ_*)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DDPQ_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(extra)
    return env


def _run(*argv: str | Path, timeout: float = 300, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw
    )  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel of the checkout's committed and working files, built in a copy (the
    checkout stays free of build/ and egg-info)."""
    base = tmp_path_factory.mktemp("dist")
    src = base / "src"
    files = _run("git", "ls-files", "-co", "--exclude-standard", cwd=REPO).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = base / "out"
    r = _run(sys.executable, "-m", "build", "--outdir", out, src, env=_clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_the_distributions_pass_twine_check(dist: Path) -> None:
    built = sorted(p.name for p in dist.iterdir())
    assert any(n.endswith(".whl") for n in built) and any(n.endswith(".tar.gz") for n in built)
    r = _run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    assert r.returncode == 0, r.stdout + r.stderr


def _lock_pins(path: Path) -> str:
    """The lock as constraints: name==version lines (pip refuses hashes in constraints)."""
    pins = re.findall(r"^([A-Za-z0-9._-]+==[^\s\\;]+)", LOCK.read_text(), flags=re.M)
    path.write_text("\n".join(pins) + "\n")
    return str(path)


def _python() -> str:
    return "/usr/bin/python3.11" if Path("/usr/bin/python3.11").exists() else sys.executable


def _install(venv: Path, wheel: Path, constraints: str) -> None:
    """`pip install` of the wheel into ``venv``, its dependencies from WHEELHOUSE."""
    pip = [venv / "bin" / "python", "-m", "pip", "--disable-pip-version-check", "-q"]
    offline = [*pip, "install", "--no-index", "--find-links", WHEELHOUSE, "-c", constraints]
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    with open(WHEELHOUSE / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # one filler at a time (xdist workers)
        r = _run(*offline, wheel, env=_clean_env())
        if r.returncode != 0:  # the cache lacks a dependency: fill it once from the index
            got = _run(*pip, "download", "-d", WHEELHOUSE, "-c", constraints, wheel,
                       env=_clean_env())  # fmt: skip
            assert got.returncode == 0, got.stdout + got.stderr
            for own in WHEELHOUSE.glob("ddpq-*"):  # the wheel under test is never cached
                own.unlink()
            r = _run(*offline, wheel, env=_clean_env())
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def light(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding `pip install ddpq` (the wheel) and nothing else: its bin/."""
    base = tmp_path_factory.mktemp("light")
    venv = base / "venv"
    r = _run(_python(), "-m", "venv", venv, env=_clean_env())
    assert r.returncode == 0, r.stderr
    _install(venv, next(dist.glob("*.whl")), _lock_pins(base / "constraints.txt"))
    return venv / "bin"


def test_a_plain_install_has_no_torch_and_no_server(light: Path) -> None:
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    r = _run(light / "python", "-c", probe, *HEAVY, env=_clean_env(), cwd=light)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = _run(light / "ddpq", "--help", env=_clean_env(), cwd=light)
    assert r.returncode == 0 and "submit" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve"], "ddpq serve: the API needs the server extra: pip install 'ddpq[server]'"),
        (["worker"], "ddpq worker: a worker needs the worker extra: pip install 'ddpq[worker]'"),
        (
            ["up"],
            "ddpq up: the API with a local worker needs the server and worker extras: "
            "pip install 'ddpq[server,worker]'",
        ),
    ],
)
def test_a_command_names_the_extra_it_lacks(light: Path, argv: list[str], said: str) -> None:
    r = _run(light / "ddpq", *argv, env=_clean_env(COLUMNS="300"), cwd=light, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert said in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Server]:
    """A real API, run by the suite's own environment (which has the server extra)."""
    s = start_server(f"sqlite:///{tmp_path / 'ddpq.db'}", tmp_path / "api")
    yield s
    stop_server(s)


def test_a_plain_install_logs_in_and_submits_a_directory(
    light: Path, api: Server, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    env = _clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
    home.mkdir()
    r = _run(light / "ddpq", "login", api.url, "--token-stdin", input=api.api_token, env=env,
             cwd=home, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    code = tmp_path / "proj"
    code.mkdir()
    (code / "train.py").write_text("print('hello')\n")
    r = _run(light / "ddpq", "submit", "--entrypoint", "train.py", "--json", env=env,
             cwd=code, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = api.client().get(f"/jobs/{json.loads(r.stdout)['id']}").json()
    assert job["spec"]["entrypoint"] == "train.py" and job["status"] == "queued", job
    assert job["spec"]["code"] and job["code"], job  # the directory went with it


REPORTER = """
import sys
import ddpq
ddpq.report(0, total_steps=3)
for step in (1, 2, 3):
    ddpq.report(step, loss=1.0 / step, epoch=step // 2, ok=step)
assert ddpq.flush(timeout=60)
assert "torch" not in sys.modules
print("flushed")
"""


def test_report_from_a_plain_install_is_stored(light: Path, api: Server, tmp_path: Path) -> None:
    claim = submit_and_claim(api)
    env = _clean_env(
        DDPQ_URL=api.url,
        DDPQ_JOB_ID=str(claim["job_id"]),
        DDPQ_JOB_TOKEN=str(claim["token"]),
        RANK="0",
    )
    script = tmp_path / "reporter.py"
    script.write_text(REPORTER)
    r = _run(light / "python", script, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "flushed" in r.stdout, r.stdout + r.stderr
    user = api.client()
    items = user.get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
    assert [i["step"] for i in items] == [1, 2, 3], items
    assert items[0]["values"]["loss"] == 1.0 and items[2]["values"]["ok"] == 3.0, items
    assert user.get(f"/jobs/{claim['job_id']}").json()["total_steps"] == 3


def _pins(path: Path) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9._-]+)==([^\s\\;]+)", path.read_text(), flags=re.M)
    return {_name(n): v for n, v in found}


def test_the_lock_holds_every_declared_package_and_the_images_parts_agree() -> None:
    pins = _pins(LOCK)
    assert set(_declared("all", "dev")) <= set(pins), set(_declared("all", "dev")) - set(pins)
    torch = _pins(REPO / "requirements" / "torch.txt")
    assert {k: pins[k] for k in torch} == torch  # the .venv's torch is the lock's
    server = _pins(REPO / "requirements" / "server.txt")
    assert set(_declared("server")) <= set(server)
    assert "torch" not in server
    assert {k: pins[k] for k in server} == server
    worker = _pins(REPO / "requirements" / "worker.txt")  # the worker image's part
    assert set(_declared("worker", "recipes")) <= set(worker)
    assert {k: pins[k] for k in worker} == worker and {k: worker[k] for k in torch} == torch
    assert not {"fastapi", "sqlalchemy", "uvicorn"} & set(worker)
    for part in (LOCK, REPO / "requirements" / "server.txt", REPO / "requirements" / "worker.txt"):
        assert "ddpq @" not in part.read_text() and "file://" not in part.read_text(), part


HELP_LOADS = """
import sys
sys.argv = ["ddpq", "--help"]
from ddpq.cli import main
try:
    main()
except SystemExit:
    pass
import ddpq.train
heavy = ("torch", "fastapi", "starlette", "sqlalchemy", "uvicorn", "service", "worker", "numpy")
print("LOADED", sorted({m.split(".")[0] for m in sys.modules} & set(heavy)))
"""


def test_help_and_ddpq_train_import_neither_torch_nor_the_server() -> None:
    # In the suite's own environment, where all of them are installed.
    r = _run(sys.executable, "-c", HELP_LOADS, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "LOADED []", r.stdout[-500:]


# An older torch than the lock's, CPU-only (its file lies on this machine's disk): the
# venv holding it is kept between runs (a minute to make); ddpq's wheel is put in anew.
OLD_TORCH = "torch==2.13.0"
OLD_TORCH_VENV = WHEELHOUSE.parent / "ddpq-test-torch-2.13.0"

CHECKPOINTER = """
import sys
import torch
import ddpq
assert torch.__version__.startswith("2.13."), torch.__version__
loss = torch.tensor(0.5, requires_grad=True) * 2
ddpq.report(1, loss=loss, lr=torch.tensor([0.25]))
path = ddpq.save_checkpoint({"w": torch.arange(3.0)}, step=1)
assert path.name == "step-000000001.pt" and path.is_file()
assert ddpq.load_checkpoint()["w"].tolist() == [0.0, 1.0, 2.0]
assert ddpq.flush(timeout=60)
print("flushed", path)
"""


def test_train_under_an_older_torch(dist: Path, api: Server, tmp_path: Path) -> None:
    venv = OLD_TORCH_VENV
    OLD_TORCH_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(OLD_TORCH_VENV.parent / ".ddpq-old-torch.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not (venv / ".ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            assert _run(_python(), "-m", "venv", venv, env=_clean_env()).returncode == 0
            r = _run(venv / "bin" / "pip", "install", "-q", OLD_TORCH, env=_clean_env())
            if r.returncode != 0:
                pytest.skip(f"{OLD_TORCH} does not install here: {r.stderr[-500:]}")
            (venv / ".ready").touch()
        _install(venv, next(dist.glob("*.whl")), _lock_pins(tmp_path / "constraints.txt"))
    claim = submit_and_claim(api)
    env = _clean_env(
        DDPQ_URL=api.url,
        DDPQ_JOB_ID=str(claim["job_id"]),
        DDPQ_JOB_TOKEN=str(claim["token"]),
        DDPQ_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        RANK="0",
    )
    script = tmp_path / "checkpointer.py"
    script.write_text(CHECKPOINTER)
    r = _run(venv / "bin" / "python", "-W", "ignore", script, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "flushed" in r.stdout, r.stdout + r.stderr
    user = api.client()
    items = user.get(f"/jobs/{claim['job_id']}/metrics").json()["items"]
    assert items == [{**items[0], "step": 1, "values": {"loss": 1.0, "lr": 0.25}}], items
    # (its registration is refused: the hand-made worker's checkpoint root is /ckpt)


def test_the_server_lock_installs_and_serves(dist: Path, tmp_path: Path) -> None:
    """What the API needs, as requirements/server.txt locks it (hashes checked), plus the
    wheel: `ddpq serve` answers, with no torch installed."""
    venv = tmp_path / "venv"
    assert _run(_python(), "-m", "venv", venv, env=_clean_env()).returncode == 0
    pip = [venv / "bin" / "python", "-m", "pip", "--disable-pip-version-check", "-q"]
    lock = REPO / "requirements" / "server.txt"
    offline = [*pip, "install", "--no-index", "--find-links", WHEELHOUSE, "--require-hashes"]
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    with open(WHEELHOUSE / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = _run(*offline, "-r", lock, env=_clean_env())
        if r.returncode != 0:
            got = _run(*pip, "download", "-d", WHEELHOUSE, "--require-hashes", "-r", lock,
                       env=_clean_env())  # fmt: skip
            assert got.returncode == 0, got.stdout + got.stderr
            r = _run(*offline, "-r", lock, env=_clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(*pip, "install", "--no-deps", next(dist.glob("*.whl")), env=_clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    probe = "import importlib.util as u; print(u.find_spec('torch'))"
    assert _run(venv / "bin" / "python", "-c", probe, cwd=tmp_path).stdout.strip() == "None"
    port = free_port()
    data = tmp_path / "data"
    data.mkdir()
    env = _clean_env(
        DDPQ_DATA_DIR=str(data),
        DDPQ_DATABASE_URL=f"sqlite:///{data / 'ddpq.db'}",
        DDPQ_API_TOKEN="a" * 8 + "-install-test-token-" + "b" * 8,
        DDPQ_WORKER_TOKEN="c" * 8 + "-install-test-token-" + "d" * 8,
    )
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [venv / "bin" / "ddpq", "serve", "--port", str(port)],
            env=env, cwd=data, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).is_success
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, "ddpq serve from the server lock to answer")
    finally:
        stop_process(proc)
