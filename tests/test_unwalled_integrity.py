"""Issue 26, "integrity that does not depend on walls": on an unwalled worker every job
can write whatever the worker's user can, and still cannot change what a later job (or
a later attempt) runs. The parts, without a worker: a retry's directory and a planted
environment. tests/test_walls.py runs the same attacks as jobs (tests/hostile_job.py).

Host tests, no database."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import make_wheel
from tests.test_code import Store, _manifest
from worker.files import code
from worker.files.code import Workdirs
from worker.starting import requirements, venvs
from worker.walled.walls import Walls


def _planted_module(d: Path) -> None:
    (d / "pkg" / "helper.py").write_text("print('PLANTED')\n")  # imported before pkg/mod.py


def _rewritten(d: Path) -> None:
    (d / "main.py").write_text("print('PLANTED')\n")


def _linked_out(d: Path) -> None:
    os.rename(d / "pkg", d / "pkg.orig")
    os.symlink(str(d / "pkg.orig"), d / "pkg")  # the same files, through a link


def _hard_linked(d: Path) -> None:
    os.link(d / "main.py", d.parent / "a-second-name")  # to rewrite it through later


@pytest.mark.parametrize(
    ("when", "tamper", "why"),
    [
        ("between", _rewritten, "changed after its last attempt ended"),
        ("between", _planted_module, "changed after its last attempt ended"),
        ("between", _linked_out, "changed after its last attempt ended"),
        ("during", _rewritten, "no longer holds its code as sent ('main.py')"),
        ("during", _linked_out, "no longer holds its code as sent ('pkg/mod.py')"),
        ("during", _hard_linked, "no longer holds its code as sent ('main.py')"),
        ("unsealed", lambda d: None, "was not sealed as its last attempt ended"),
    ],
)
def test_a_retry_never_runs_in_a_directory_changed_since_or_holding_other_code(
    tmp_path: Path, when: str, tamper: Any, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: unwalled, every job can write every other's directory. A retry reuses
    its directory (what its first attempt wrote) only as that attempt left it and with
    the code its owner sent; anything else, done between the attempts or while the first
    ran (by another job or the program itself), gets a fresh one written from the
    snapshot."""
    # "unsealed": the first attempt never ends, so the retry waits out its wait for it
    # (120 s by default) before it writes afresh: a second is as good a wait here.
    monkeypatch.setattr(code, "EARLIER_ATTEMPT_WAIT_S", 1.0)
    files = {"main.py": b"print('sent')\n", "pkg/mod.py": b"X = 1\n"}
    store = Store(files)
    dirs = Workdirs(tmp_path / "data", cache_bytes=10**9, keep_s=0)
    manifest = _manifest(files)
    first, _ = dirs.prepare(1, "s" * 64, lambda: manifest, store.fetch)
    (first / "out.txt").write_text("attempt 1's output\n")
    if when == "during":
        tamper(first)
    if when != "unsealed":
        dirs.attempt_ended(1)
    if when == "between":
        tamper(first)
    again, written = dirs.prepare(1, "s" * 64, lambda: manifest, store.fetch)
    assert not written.reused and again != first and not first.exists()
    assert written.why_fresh == why
    assert sorted(str(p.relative_to(again)) for p in again.rglob("*")) == [
        "main.py", "pkg", "pkg/mod.py",
    ]  # fmt: skip
    assert (again / "main.py").read_bytes() == b"print('sent')\n"
    assert not (again / "pkg").is_symlink()


PLANTED = "#!/bin/sh\necho PLANTED interpreter\n"


def _plant(root: Path, key: str, mac_key: bytes | None) -> None:
    """What a job of the worker's user can do: put an environment under the name a job
    with these requirements will look for, with the seal it can make."""
    env = root / key
    if env.exists():
        os.rename(env, root.parent / f"gone-{os.urandom(4).hex()}")
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text(PLANTED)
    (env / "bin" / "python").chmod(0o755)
    (env / venvs.READY).touch()
    if mac_key is not None:
        mac = hmac.new(mac_key, venvs.seal(env).encode(), hashlib.sha256).hexdigest()
        (env / venvs.SEAL).write_text(mac + "\n")


@pytest.mark.parametrize("walled", [False, True])
def test_a_planted_environment_is_never_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, walled: bool
) -> None:
    """Environments are named by a key any job can work out. A job that can read every
    file of the worker's user (unwalled: the worker's token in var/worker-token, any key
    file) plants one under that name, sealed with whatever it found; the next worker
    process builds its own. Walled, the seals' key is the worker's alone: a restarted
    worker trusts what it built, and what a job without the key planted it does not."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    make_wheel(tmp_path / "code" / "wheels")
    (tmp_path / "code" / "requirements.txt").write_text(
        "./wheels/ddpqtestpkg-0.1-py3-none-any.whl\n"
    )
    reqs = requirements.read(tmp_path / "code", [])
    root = tmp_path / "venvs"
    walls = Walls((71140, 71149), tmp_path / "locks") if walled else None
    said: list[str] = []

    def run(v: venvs.Venvs) -> str:
        with v.using(reqs, tmp_path, dict(os.environ), said.append, threading.Event()) as py:
            return py.read_text(errors="replace")

    first = venvs.Venvs(root, max_envs=2, walls=walls)
    key = first.key(reqs)
    run(first)
    key_file = root / venvs.KEY_FILE
    if walled:
        st = key_file.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        # A restarted walled worker trusts the environment it built.
        said.clear()
        assert PLANTED not in run(venvs.Venvs(root, max_envs=2, walls=walls))
        assert any("reusing environment" in line for line in said), said
        found = None  # walled, a job's uid cannot read the key file
    else:
        assert not key_file.exists(), "unwalled, no key a job could read is kept"
        found = b"the-worker-token-read-from-var"
    _plant(root, key, found)
    # Within the worker's life, the seal in memory catches it...
    said.clear()
    assert PLANTED not in run(first)
    assert any("building it again" in line for line in said), said
    # ...and a restarted worker never trusts a seal a job could have made.
    _plant(root, key, found)
    said.clear()
    assert PLANTED not in run(venvs.Venvs(root, max_envs=2, walls=walls))
    assert any("without a seal this worker can check" in line for line in said), said
    if walled:
        # An unwalled run on this data directory (its jobs could read the key) drops it.
        venvs.Venvs(root, max_envs=2)
        assert not key_file.exists()
