"""A user's caches across their jobs on a walled worker (issue 42), end to end: a user's
second job finds what the first wrote in TORCHINDUCTOR_CACHE_DIR and HF_HOME (under
another uid), another user's job can neither read nor plant into it, and `ddpq cache
ls` / `ddpq cache clear` see and clear it. A tiny program writes and reads the caches
(no torch.compile: what is tested is the directory's life, not inductor's timing).

Real uids and a worker with the compose worker's capabilities, as tests/test_walls.py:
`make test-walls` runs it, `make test` leaves it out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpq.client import Client
from tests.conftest import (
    REPO,
    Server,
    _child_env,
    run_ddpq,
    start_server,
    stop_process,
    stop_server,
    wait_for,
    worker_argv,
)
from tests.test_walls import COMPOSE_CAPS, open_the_way

pytestmark = [pytest.mark.walls, pytest.mark.torchrun]

# Not test_walls.py's (71000-71099) nor tests/test_caches.py's (72000-72019).
UIDS = "72020-72039"

PROGRAM = r"""
import os, sys
from pathlib import Path

if os.environ.get("RANK", "0") != "0":
    sys.exit(0)
what = sys.argv[1]
inductor, hub = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), Path(os.environ["HF_HOME"])
print("CACHE", json.dumps({k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR",
      "TRITON_CACHE_DIR", "HF_HOME", "TORCH_HOME", "MPLCONFIGDIR")}), "uid", os.getuid())
if what == "write":
    inductor.mkdir(parents=True, mode=0o700)  # as inductor makes its own
    (inductor / "kernel.py").write_text("compiled\n")
    (hub / "hub").mkdir(parents=True)
    (hub / "hub" / "model.bin").write_bytes(b"w" * 1000)
    print("WROTE")
elif what == "read":
    try:
        print("FOUND", (inductor / "kernel.py").read_text().strip(),
              (hub / "hub" / "model.bin").stat().st_size)
    except FileNotFoundError as exc:
        print("MISSING", exc)
elif what == "attack":
    target = Path(sys.argv[2])
    for name, act in (
        ("list", lambda: os.listdir(target)),
        ("read", lambda: (target / "inductor" / "kernel.py").read_text()),
        ("plant", lambda: (target / "inductor" / "planted.py").write_text("evil\n")),
    ):
        try:
            act()
            print("ATTACK", name, "done")
        except OSError as exc:
            print("ATTACK", name, "denied", exc.errno)
""".replace("import os, sys", "import json, os, sys")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    open_the_way(Path(sys.executable))
    open_the_way(REPO / "worker")
    base = Path(tempfile.mkdtemp(prefix="ddpq-caches-e2e-", dir="/var/tmp"))
    base.chmod(0o711)
    api = start_server(f"sqlite:///{tmp_path / 'ddpq.db'}", tmp_path / "api")
    try:
        yield api, base
    finally:
        stop_server(api)
        shutil.rmtree(base, ignore_errors=True)


def _worker(api: Server, base: Path) -> tuple[subprocess.Popen[bytes], Path]:
    (base / "workspace").mkdir()
    argv = worker_argv(
        api, "cachehost", base / "workspace", base / "data", "--cpu-slots", "2",
        "--gpus", "none", "--job-uids", UIDS, "--cache-gb", "1",
    )  # fmt: skip
    log = base / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["setpriv", f"--bounding-set={COMPOSE_CAPS}", "--inh-caps=-all", "--", *argv],
            env=_child_env({"DDPQ_WORKER_TOKEN": api.worker_token}),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=base,
        )
    return proc, log


def _run(c: Client, code: Path, *args: str) -> tuple[dict[str, Any], str]:
    snap = c.push_code(code)
    job = c.submit({"entrypoint": "main.py", "args": list(args), "code": snap.id})
    done = c.wait(int(job["id"]), timeout=300)
    return done, c.logs(int(job["id"]))[0].decode(errors="replace")


def test_a_users_second_job_finds_the_first_jobs_caches_and_no_one_else_does(
    host: tuple[Server, Path],
) -> None:
    api, base = host
    code = base / "code"
    code.mkdir()
    (code / "main.py").write_text(PROGRAM)
    with Client(api.url, api.api_token) as admin:
        tokens = {name: admin.add_user(name)["token"] for name in ("alice", "bob")}
    worker, log = _worker(api, base)
    cache = base / "data" / "caches" / "alice" / "cache"
    env = {"DDPQ_URL": api.url, "DDPQ_TOKEN": tokens["alice"]}
    try:
        wait_for(lambda: "jobs run walled" in log.read_text(), 60, "the worker to start")
        with Client(api.url, tokens["alice"]) as alice, Client(api.url, tokens["bob"]) as bob:
            first, first_log = _run(alice, code, "write")
            assert first["status"] == "succeeded" and "WROTE" in first_log, first_log
            seen = json.loads(first_log.split("CACHE ")[1].split(" uid")[0])
            assert seen["TORCHINDUCTOR_CACHE_DIR"] == f"{cache}/inductor", seen
            assert all(v and v.startswith(f"{cache}/") for v in seen.values()), seen
            # Reported with a heartbeat: `ddpq cache ls`.
            listed = wait_for(
                lambda: run_ddpq("cache", "ls", "--json", env=env).stdout.count('"files": 2'),
                30,
                "the worker to report alice's cache",
            )
            assert listed
            shown = run_ddpq("cache", "ls", env=env)
            assert "cachehost" in shown.stdout and "1.0 KB" in shown.stdout, shown

            # Another user's job, under another uid: nothing of alice's cache.
            attack, attack_log = _run(bob, code, "attack", str(cache))
            assert attack["status"] == "succeeded", attack_log
            tried = [line for line in attack_log.splitlines() if "ATTACK" in line]
            assert len(tried) == 3 and all(" denied 13" in t for t in tried), attack_log
            assert not (cache / "inductor" / "planted.py").exists()
            wait_for(lambda: bob.caches(), 30, "bob's own (empty) cache to be reported")
            assert all(c["user"] == "bob" and c["files"] == 0 for c in bob.caches())

            # Alice's next job, under whatever uid it gets, finds what the first wrote.
            second, second_log = _run(alice, code, "read")
            assert second["status"] == "succeeded", second_log
            assert "FOUND compiled 1000" in second_log, second_log

            # `ddpq cache clear`: the worker clears it at its next heartbeat.
            cleared = run_ddpq("cache", "clear", env=env)
            assert cleared.returncode == 0 and "cachehost" in cleared.stdout, cleared
            wait_for(lambda: alice.caches() == [], 30, "alice's cache to be cleared")
            assert not cache.exists()
            third, third_log = _run(alice, code, "read")
            assert third["status"] == "succeeded" and "MISSING" in third_log, third_log
            wait_for(lambda: alice.caches(), 30, "alice's new cache to be reported")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text()[-4000:]}") from None
    finally:
        stop_process(worker)
    assert os.stat(base / "data" / "caches").st_mode & 0o777 == 0o711
