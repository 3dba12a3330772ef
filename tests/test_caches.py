"""Each user's caches on a worker (worker.files.caches), without a worker: lent to an attempt's
uid and taken back (nothing a job planted reaches the worker or another user), two
attempts of one user at once, the cap (least recently used files first), what is
discarded, clear orders and the reports a heartbeat carries. Real uids (root): a few
seconds, so `make test` runs them."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpq.messages import CacheClearOrder
from worker.files import caches as caches_
from worker.files.caches import Caches, Lease
from worker.walled.walls import Held, JobUser, Walls

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="hands directories to other uids")

# Not test_walls.py's (71000-71099) nor the default range (70000-70999).
UIDS = (72000, 72019)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory job uids can pass through (pytest's own are 0700)."""
    where = Path(tempfile.mkdtemp(prefix="ddpq-caches-", dir="/var/tmp"))
    where.chmod(0o711)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def scratch(base: Path, name: str) -> Path:
    """An attempt's scratch (its TMPDIR), as the runner makes it."""
    where = base / name
    where.mkdir(exist_ok=True)
    return where


def walled(base: Path, cap: int = 10**9) -> Caches:
    caches = Caches(base / "caches", cap, Walls(UIDS, base / "locks"))
    caches.start()
    return caches


def as_uid(held: Held, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by /bin/sh under the attempt's uid, as its ranks would."""
    assert held.user is not None
    return subprocess.run(
        ["/bin/sh", "-c", script],
        user=held.user.uid,
        group=held.user.gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        cwd="/",
        check=False,
    )


def test_a_cache_is_lent_to_its_users_attempt_and_taken_back_clean(base: Path) -> None:
    caches = walled(base)
    outside = base / "root-only"
    outside.write_text("the worker's\n")
    outside.chmod(0o600)
    with caches.walls.attempt(1) as held:
        lease, words = caches.lend("alice", held, scratch(base, "scratch-1"), 1, 1)
        assert words is None and lease.kept and lease.path == caches.path("alice")
        env = lease.env()
        assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{lease.path}/inductor"
        assert env["HF_HOME"] == f"{lease.path}/huggingface"
        assert held.user is not None
        gate = os.stat(caches.gate("alice"))
        assert (gate.st_uid, gate.st_gid, stat.S_IMODE(gate.st_mode)) == (0, held.user.gid, 0o710)
        assert os.stat(lease.path).st_uid == held.user.uid
        # inductor's own directory in TMPDIR (its precompiled headers) leads into the cache.
        link = scratch(base, "scratch-1") / f"torchinductor_{held.user.name}"
        assert os.readlink(link) == str(lease.path / caches_.INDUCTOR_TMP)
        assert os.lstat(link).st_uid == os.stat(link).st_uid == held.user.uid
        # What a job writes, and what a hostile one plants, in its own cache.
        done = as_uid(
            held,
            f"""set -e
            cd {lease.path}
            mkdir -p inductor/fx huggingface/hub
            echo kernel > inductor/fx/graph.py
            echo weights > huggingface/hub/model.bin
            mkfifo inductor/pipe
            echo x > setuid && chmod 4777 setuid
            ln -s {outside} link-out
            chmod 777 {lease.path}
            """,
        )
        assert done.returncode == 0, done.stderr
        os.link(outside, lease.path / "hard")  # as fs.protected_hardlinks=0 would let it
        (lease.path / "foreign").write_text("not the job's\n")
        os.chown(lease.path / "foreign", 65534, 65534)
        # Another attempt (another uid) cannot reach in, though the job opened its cache.
        with caches.walls.attempt(2) as other:
            peek = as_uid(other, f"ls {lease.path} || echo DENIED; touch {lease.path}/x")
            assert "DENIED" in peek.stdout and "Permission denied" in peek.stderr
            assert not (lease.path / "x").exists()
    # Taken back as the attempt ended (worker.walled.walls: Held.end, before its uid was free).
    assert stat.S_IMODE(os.stat(caches.gate("alice")).st_mode) == 0o700
    left = {p.relative_to(lease.path).as_posix(): p for p in lease.path.rglob("*")}
    assert set(left) == {
        "inductor", "inductor/fx", "inductor/fx/graph.py", "huggingface", "huggingface/hub",
        "huggingface/hub/model.bin", "setuid", "link-out", caches_.INDUCTOR_TMP,
    }, left  # fmt: skip
    assert all(os.lstat(p).st_uid == 0 for p in [lease.path, *left.values()])
    assert stat.S_IMODE(os.stat(left["setuid"]).st_mode) == 0o755
    assert os.readlink(left["link-out"]) == str(outside)
    assert outside.read_text() == "the worker's\n" and os.stat(outside).st_nlink == 1
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o600
    usage = caches.usage()["alice"]
    assert (usage.files, usage.bytes) == (3, len("kernel\nweights\nx\n"))
    # The user's next attempt finds it, under whatever uid it gets.
    with caches.walls.attempt(7) as held:
        lease, _ = caches.lend("alice", held, scratch(base, "scratch-2"), 7, 1)
        read = as_uid(held, f"cat {lease.path}/inductor/fx/graph.py && touch {lease.path}/new")
        assert read.stdout == "kernel\n" and read.returncode == 0, read.stderr
    assert caches.usage()["alice"].files == 4


def test_a_second_attempt_of_the_user_runs_with_an_empty_cache_of_its_own(base: Path) -> None:
    caches = walled(base)
    with caches.walls.attempt(1) as first, caches.walls.attempt(2) as second:
        lease, _ = caches.lend("alice", first, scratch(base, "s1"), 1, 1)
        cold, words = caches.lend("alice", second, scratch(base, "s2"), 2, 1)
        assert lease.kept and not cold.kept and cold.path == base / "s2" / "cache"
        assert second.user is not None
        assert not (base / "s2" / f"torchinductor_{second.user.name}").exists()
        assert words is not None and "in use by job 1 (attempt 1)" in words
        other, words = caches.lend("bob", second, scratch(base, "s2"), 2, 1)
        assert other.kept and words is None  # another user's: their own cache
    with caches.walls.attempt(3) as third:
        assert caches.lend("alice", third, scratch(base, "s3"), 3, 1)[0].kept  # free again


def test_the_least_recently_used_files_go_when_a_cache_is_over_its_cap(base: Path) -> None:
    caches = walled(base, cap=250)
    with caches.walls.attempt(1) as held:
        lease, _ = caches.lend("alice", held, scratch(base, "s"), 1, 1)
        for i, used in enumerate([500, 100, 400, 300]):  # seconds ago
            f = lease.path / f"d{i}" / "f"
            f.parent.mkdir()
            f.write_bytes(b"x" * 100)
            then = os.stat(f).st_mtime - used
            os.utime(f, (then, then))
    assert sorted(p.parent.name for p in lease.path.rglob("f")) == ["d1", "d3"]
    assert (caches.usage()["alice"].bytes, caches.usage()["alice"].files) == (200, 2)


def test_what_cannot_be_taken_back_safely_is_discarded(base: Path) -> None:
    caches = walled(base)
    # Its attempt's processes survived the sweep: one may still hold a file open.
    held = Held(caches.walls, JobUser(UIDS[1], UIDS[1]))
    lease, _ = caches.lend("alice", held, scratch(base, "s"), 1, 1)
    (lease.path / "f").write_text("x")
    assert held.end(clean=False), "discarded: the uid may go on"  # as worker.walled.walls ends it
    assert not caches.gate("alice").exists() and "alice" not in caches.usage()
    # Deeper than a cache goes.
    with caches.walls.attempt(2) as held:
        lease, _ = caches.lend("bob", held, scratch(base, "s"), 2, 1)
        deep = lease.path.joinpath(*["d"] * (caches_.MAX_DEPTH + 2))
        deep.mkdir(parents=True)
    assert not caches.gate("bob").exists()
    # Lent by a worker that died: the next start discards it, keeps the others.
    with caches.walls.attempt(3) as held:
        caches.lend("carol", held, scratch(base, "s"), 3, 1)
    with caches.walls.attempt(4) as held:
        lease, _ = caches.lend("dave", held, scratch(base, "s"), 4, 1)
        (lease.path / "kept").write_text("x")
        (caches.root / caches_.LENT / "carol").touch()  # as if carol's were still out
    again = walled(base)
    assert set(again.usage()) == {"dave"} and not again.gate("carol").exists()
    assert again.wait_purged(30), os.listdir(again.root / caches_.DISCARD)


def test_clear_orders_and_the_reports_a_heartbeat_carries(base: Path) -> None:
    caches = walled(base)
    version, items = caches.report() or (None, [])
    assert items == []
    caches.answered(version, [])
    assert caches.report() is None, "unchanged: nothing to send"
    with caches.walls.attempt(1) as held:
        lease, _ = caches.lend("alice", held, scratch(base, "s"), 1, 1)
        (lease.path / "f").write_text("xyz")
        # A clear while its attempt holds it waits for the attempt's end.
        caches.clear([CacheClearOrder(id=5, user="alice"), CacheClearOrder(id=6, user="zoe")])
        assert caches.cleared() == [{"id": 6, "outcome": "missing"}]
    assert {"id": 5, "outcome": "cleared"} in caches.cleared()
    assert not caches.gate("alice").exists()
    with caches.walls.attempt(1) as held:
        lease, _ = caches.lend("alice", held, scratch(base, "s"), 1, 2)
        (lease.path / "g").write_text("ab")
    version, items = caches.report() or (None, [])
    assert [(i["user"], i["bytes"], i["files"]) for i in items] == [("alice", 2, 1)]
    assert 0 <= items[0]["idle_s"] < 60
    caches.answered(version, caches.cleared())
    assert caches.cleared() == [] and caches.report() is None
    # An order done is not done again (another API process may still send it).
    caches.clear([CacheClearOrder(id=5, user="alice")])
    assert caches.gate("alice").exists() and caches.cleared() == []
    caches.clear([CacheClearOrder(id=7, user="alice")])
    assert caches.cleared() == [{"id": 7, "outcome": "cleared"}]
    assert [i["user"] for i in (caches.report() or (0, []))[1]] == []
    caches.registered()  # the API may have forgotten: sent again
    assert caches.report() is not None


def test_unwalled_caches_are_per_user_and_not_handed_over(base: Path) -> None:
    caches = Caches(base / "caches", 10**6, Walls(None))
    caches.start()
    with caches.walls.attempt(1) as held:
        lease, _ = caches.lend("alice", held, scratch(base, "s"), 1, 1)
        assert lease.kept and os.stat(lease.path).st_uid == os.geteuid()
        (lease.path / "inductor").mkdir()
        (lease.path / "inductor" / "k").write_text("k")
    assert caches.usage()["alice"].files == 1
    off = Caches(base / "off", 0, Walls(None))
    off.start()
    with off.walls.attempt(1) as held:
        lease, _ = off.lend("alice", held, scratch(base, "s"), 1, 1)
        assert not lease.kept and not (base / "off").exists()


def test_a_lease_names_every_cache_variable() -> None:
    env = Lease("alice", Path("/c"), True).env()
    assert set(env) == set(caches_.CACHE_VARS) and all(v.startswith("/c/") for v in env.values())
