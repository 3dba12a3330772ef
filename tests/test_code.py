"""Code sent with a job: the upload protocol, its limits and hostile manifests (both
databases), what of a directory is sent, how a worker writes a job's directory, and real
jobs run from a user's directory (a helper module, a requirements file naming a wheel
built here, one-line re-submits, private working directories, two nodes).

A test of the upload protocol that looks only at what it sent (contents no other test here
sends, what its requests added to the lists) runs on the module's server of its database
(``api``: what a test leaves active is ended after it, helpers.its_turn); one with limits
of its own, a database changed by hand, or a worker has a server of its own (``server``)."""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import importlib.util
import os
import posixpath
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, update

from ddpq.codepack import collect, named_in_sources
from ddpq.jobspec import ClaimedSpec
from ddpq.snapshot import (
    MAX_LINKS,
    Entry,
    entry_problem,
    link_problems,
    manifest_problem,
    path_problem,
    symlink_problem,
)
from service.models import CodeBlob, CodeSnapshot
from tests.conftest import Server, run_ddpq, start_server, stop_server, wait_for
from tests.helpers import make_wheel
from worker.files.code import BlobCache, Workdirs, write_tree
from worker.starting.torchrun import JobError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(server: Server, data: bytes, digest: str | None = None) -> int:
    r = server.client().put(f"/code/blobs/{digest or sha(data)}", content=data)
    return r.status_code


def snapshot(server: Server, files: dict[str, bytes], **extra: Any) -> dict[str, Any]:
    """Upload ``files`` and create their snapshot; the answer's JSON."""
    for data in files.values():
        assert put(server, data) == 204
    manifest = [
        {"path": p, "digest": sha(d), "size": len(d), "executable": False} for p, d in files.items()
    ]
    r = server.client().post("/code/snapshots", json={"files": manifest, **extra})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def rows(db_url: str, table: Any) -> int:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(table)) or 0)
    finally:
        engine.dispose()


# ---- the upload protocol -----------------------------------------------------------------


def test_only_missing_contents_are_sent_and_a_snapshot_is_its_manifest(api: Server) -> None:
    server = api
    c = server.client()
    # Contents no other test on the module's server sends (the store is by content).
    files = {"train.py": b"print('hi')\n", "lib/helper.py": b"HELPER = 1\n"}
    digests = sorted(sha(d) for d in files.values())
    assert c.post("/code/missing", json={"digests": digests}).json()["missing"] == digests
    first = snapshot(server, files)
    assert first["files"] == 2 and first["bytes"] == sum(len(d) for d in files.values())
    assert c.post("/code/missing", json={"digests": digests}).json()["missing"] == []
    assert snapshot(server, files)["id"] == first["id"], "the same tree is the same snapshot"

    changed = {**files, "lib/helper.py": b"HELPER = 2\n"}
    missing = c.post("/code/missing", json={"digests": [sha(d) for d in changed.values()]})
    assert missing.json()["missing"] == [sha(b"HELPER = 2\n")], "one line changed: one content"
    second = snapshot(server, changed)
    assert second["id"] != first["id"]

    got = c.get(f"/code/snapshots/{first['id']}").json()
    assert {e["path"] for e in got["manifest"]} == set(files)
    assert c.get(f"/code/blobs/{sha(files['train.py'])}").content == files["train.py"]
    w = server.client("worker")
    assert w.get(f"/workers/code/snapshots/{first['id']}").json()["id"] == first["id"]
    helper = sha(b"HELPER = 1\n")
    assert w.get(f"/workers/code/blobs/{helper}").content == b"HELPER = 1\n"

    job = c.post("/jobs", json={"entrypoint": "train.py", "code": first["id"]})
    assert job.status_code == 201, job.text
    assert job.json()["code"] == {"id": first["id"], "files": 2, "bytes": first["bytes"]}
    listed = c.get("/jobs").json()["items"][0]
    assert listed["code"]["id"] == first["id"]


def test_a_damaged_upload_is_refused_and_stores_nothing(api: Server) -> None:
    server = api
    data = b"the real content\n"
    r = server.client().put(f"/code/blobs/{sha(b'something else')}", content=data)
    assert r.status_code == 422 and "sha256" in r.text, r.text
    missing = server.client().post("/code/missing", json={"digests": [sha(b"something else")]})
    assert missing.json()["missing"] == [sha(b"something else")]
    # Creating a snapshot of contents never uploaded names them.
    manifest = [{"path": "a.py", "digest": sha(data), "size": len(data)}]
    r = server.client().post("/code/snapshots", json={"files": manifest})
    assert r.status_code == 422 and "a.py" in r.text and "not uploaded" in r.text, r.text


HOSTILE = {
    "parent": [{"path": "../evil.py"}],
    "absolute": [{"path": "/etc/cron.d/evil"}],
    "inner parent": [{"path": "a/../../evil.py"}],
    "empty part": [{"path": "a//b.py"}],
    "dot part": [{"path": "./a.py"}],
    "control character": [{"path": "a\x1b[2J.py"}],
    "link out": [{"path": "data", "symlink": "../../etc"}],
    "absolute link": [{"path": "data", "symlink": "/etc"}],
    "under a link": [{"path": "data", "symlink": "lib"}, {"path": "data/x.py"}],
    "under a file": [{"path": "a.py"}, {"path": "a.py/b.py"}],
    "twice": [{"path": "a.py"}, {"path": "a.py"}],
    "file and link": [{"path": "a.py", "symlink": "b.py", "file": True}],
    "bad digest": [{"path": "a.py", "digest": "XYZ"}],
    "negative size": [{"path": "a.py", "size": -1}],
    # Inside by its text, outside on disk: l is the root, so x climbs above it.
    "chained escape": [
        {"path": "a/b/c/l", "symlink": "../../.."},
        {"path": "x", "symlink": "a/b/c/l/../../../outside"},
    ],
    # The same, deep enough to reach / from any worker's data dir: the host's files.
    "chained escape to /etc": [
        {"path": "a/b/c/d/e/f/g/h/l", "symlink": "../" * 7 + ".."},
        {"path": "hostname", "symlink": "a/b/c/d/e/f/g/h/l/" + "../" * 8 + "etc/hostname"},
    ],
    "link loop": [{"path": "a", "symlink": "b"}, {"path": "b", "symlink": "a"}],
    "git config": [{"path": ".git/config"}],
    "git in any case": [{"path": "sub/.GIT/hooks/x"}],
    "link to git config": [{"path": "cfg", "symlink": ".git/config"}],
    "name over 255 bytes": [{"path": "a/" + "n" * 256}],
    "path over 4096 bytes": [{"path": "/".join(["é" * 120] * 18)}],  # 2177 characters
}


def _wire(entries: list[dict[str, Any]], data: bytes) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        if "symlink" in e and not e.get("file"):
            out.append({"path": e["path"], "symlink": e["symlink"]})
            continue
        item = {"path": e["path"], "digest": sha(data), "size": len(data)}
        item.update({k: v for k, v in e.items() if k in ("digest", "size", "symlink")})
        out.append(item)
    return out


def test_hostile_manifests_are_refused_by_name_and_change_nothing(api: Server) -> None:
    server, db_url = api, api.db_url
    before = rows(db_url, CodeSnapshot)  # the module's other tests' snapshots
    data = b"x = 1\n"
    assert put(server, data) == 204
    for case, entries in HOSTILE.items():
        r = server.client().post("/code/snapshots", json={"files": _wire(entries, data)})
        assert r.status_code == 422, (case, r.status_code, r.text)
        assert "files" in r.text, (case, r.text)
    assert rows(db_url, CodeSnapshot) == before


def test_download_writes_links_refuses_what_breaks_a_rule_and_says_a_write_error_in_a_line(
    tmp_path: Path,
) -> None:
    db_url = f"sqlite:///{tmp_path / 'ddpq.db'}"
    server = start_server(db_url, tmp_path / "api")
    try:
        c = server.client()

        def job_of(files: dict[str, bytes], links: dict[str, str] | None = None) -> int:
            for data in files.values():
                assert put(server, data) == 204
            manifest = [{"path": p, "digest": sha(d), "size": len(d)} for p, d in files.items()]
            manifest += [{"path": p, "symlink": t} for p, t in (links or {}).items()]
            made = c.post("/code/snapshots", json={"files": manifest})
            assert made.status_code == 201, made.text
            job = c.post("/jobs", json={"entrypoint": "train.py", "code": made.json()["id"]})
            assert job.status_code == 201, job.text
            return int(job.json()["id"])

        def download(job_id: int, name: str) -> tuple[int, str]:
            env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
            out = run_ddpq("code", str(job_id), "--download", str(tmp_path / name), env=env)
            assert "Traceback" not in out.stderr, out.stderr
            return out.returncode, out.stderr

        # Links that stay inside through each other are written as links.
        kept = job_of({"train.py": b"print(1)\n"}, {"pkg/up": "..", "again.py": "pkg/up/train.py"})
        assert download(kept, "kept") == (0, "")
        assert os.readlink(tmp_path / "kept" / "again.py") == "pkg/up/train.py"
        assert (tmp_path / "kept" / "again.py").read_text() == "print(1)\n"

        # A path the rules allow, too long for this machine under the directory asked for.
        deep = "/".join(["d" * 254] * 16) + "/x.py"  # 4084 bytes
        code, said = download(job_of({"train.py": b"print(2)\n", deep: b"deep\n"}), "long")
        assert code == 2 and "File name too long" in said and said.count("\n") == 1, said
        assert said.startswith(f"error: cannot write the snapshot into {tmp_path / 'long'}")

        # What the API refuses to store, served anyway (put in its database by hand).
        hostile = job_of({"train.py": b"print(3)\n"})
        sid = c.get(f"/jobs/{hostile}").json()["code"]["id"]

        def stored_as(manifest: list[dict[str, Any]]) -> None:
            engine = create_engine(db_url)
            try:
                with engine.begin() as conn:
                    conn.execute(
                        update(CodeSnapshot).where(CodeSnapshot.id == sid).values(manifest=manifest)
                    )
            finally:
                engine.dispose()

        stored_as(_wire([{"path": "train.py"}, *HOSTILE["chained escape"]], b"print(3)\n"))
        code, said = download(hostile, "hostile")
        assert code == 1 and said.count("\n") == 1, said
        assert "breaks a rule: symlink 'x' points outside the snapshot" in said, said
        # One entry that breaks a rule made after it was stored: served as it is (never a
        # 500), and refused where it would be written.
        stored_as(_wire([{"path": "train.py"}, {"path": "sub/.GIT/config"}], b"print(3)\n"))
        assert c.get(f"/code/snapshots/{sid}").status_code == 200
        code, said = download(hostile, "hostile")
        assert code == 1 and "version-control" in said, said
        left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("api", "kept"))
        assert [n for n in left if not n.startswith("ddpq.db")] == [], "nothing else written"
    finally:
        stop_server(server)


def test_limits_are_named_with_the_largest_files(db_url: str, tmp_path: Path) -> None:
    limits = {
        "DDPQ_CODE_MAX_FILES": "4",
        "DDPQ_CODE_MAX_BYTES": "3000",
        "DDPQ_CODE_MAX_FILE_BYTES": "1500",
    }
    server = start_server(db_url, tmp_path / "api", **limits)
    try:
        c = server.client()
        assert c.get("/code/limits").json() == {
            "max_files": 4,
            "max_bytes": 3000,
            "max_file_bytes": 1500,
        }
        big = b"b" * 2000
        r = c.put(f"/code/blobs/{sha(big)}", content=big)
        assert r.status_code == 413 and "1500" in r.text, r.text
        five = {f"f{i}.py": bytes([65 + i]) * 10 for i in range(5)}
        for d in five.values():
            assert put(server, d) == 204
        manifest = [{"path": p, "digest": sha(d), "size": len(d)} for p, d in five.items()]
        r = c.post("/code/snapshots", json={"files": manifest})
        assert r.status_code == 413, r.text
        detail = r.json()["detail"][0]["msg"]
        assert "DDPQ_CODE_MAX_FILES" in detail and ".ddpqignore" in detail, detail
        assert rows(db_url, CodeSnapshot) == 0

        # The CLI says the same before it uploads anything: the largest files, by name.
        work = tmp_path / "work"
        work.mkdir()
        (work / "train.py").write_text("print(1)\n")
        (work / "weights.bin").write_bytes(b"w" * 2500)
        env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
        out = run_ddpq("submit", "--entrypoint", "train.py", env=env, cwd=work)
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert "weights.bin (2.5 KB)" in out.stderr and ".ddpqignore" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        missing = c.post("/code/missing", json={"digests": [sha(b"w" * 2500)]}).json()
        assert missing["missing"] == [sha(b"w" * 2500)], "nothing was uploaded"
        assert c.get("/jobs").json()["items"] == []
    finally:
        stop_server(server)


def test_a_job_naming_unknown_code_or_an_entrypoint_outside_it_is_refused(api: Server) -> None:
    server = api
    c = server.client()
    before = c.get("/jobs", params={"limit": 500}).json()["items"]
    r = c.post("/jobs", json={"entrypoint": "train.py", "code": "0" * 64})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "code"], r.text
    snap = snapshot(server, {"train.py": b"pass\n"})
    r = c.post("/jobs", json={"entrypoint": "other.py", "code": snap["id"]})
    assert r.status_code == 422 and "other.py" in r.text, r.text
    r = c.post(
        "/jobs", json={"entrypoint": "train.py", "code": snap["id"], "pip": ["--index-url=x"]}
    )
    assert r.status_code == 422 and "pip" in r.text, r.text
    assert c.get("/jobs", params={"limit": 500}).json()["items"] == before


def test_collection_keeps_what_a_queued_job_needs(db_url: str, tmp_path: Path) -> None:
    server = start_server(db_url, tmp_path / "api", DDPQ_CODE_RETENTION_S="0")
    try:
        c = server.client()
        kept = snapshot(server, {"train.py": b"kept\n"})
        job = c.post("/jobs", json={"entrypoint": "train.py", "code": kept["id"]}).json()
        dropped = snapshot(server, {"train.py": b"dropped\n"})
        assert put(server, b"never linked\n") == 204

        def gone(path: str) -> bool:
            return c.get(path).status_code == 404

        dropped_blob, loose, kept_blob = sha(b"dropped\n"), sha(b"never linked\n"), sha(b"kept\n")
        wait_for(lambda: gone(f"/code/snapshots/{dropped['id']}"), 30, "the unused snapshot to go")
        wait_for(lambda: gone(f"/code/blobs/{dropped_blob}"), 30, "its content to go")
        wait_for(lambda: gone(f"/code/blobs/{loose}"), 30, "a loose content")
        assert c.get(f"/code/snapshots/{kept['id']}").status_code == 200
        assert c.get(f"/code/blobs/{kept_blob}").content == b"kept\n"
        assert c.get(f"/jobs/{job['id']}").json()["code"]["id"] == kept["id"]

        c.post(f"/jobs/{job['id']}/cancel")  # ended: nothing needs it after the retention
        wait_for(lambda: gone(f"/code/snapshots/{kept['id']}"), 30, "the ended job's snapshot")
        assert c.get(f"/jobs/{job['id']}").json()["code"] is None
        assert rows(db_url, CodeBlob) == 0
    finally:
        stop_server(server)


@pytest.mark.postgres
def test_every_api_process_serves_the_same_code(pg_url: str, tmp_path: Path) -> None:
    a = start_server(pg_url, tmp_path / "a")
    b = start_server(pg_url, tmp_path / "b", tokens=(a.api_token, a.worker_token))
    try:
        content = b"print('from a')\n"
        snap = snapshot(a, {"train.py": content})
        w = b.client("worker")
        assert w.get(f"/workers/code/snapshots/{snap['id']}").status_code == 200
        assert w.get(f"/workers/code/blobs/{sha(content)}").content == content
    finally:
        stop_server(a)
        stop_server(b)


# ---- the manifest's rules (no server) ----------------------------------------------------


def _link(path: str, target: str) -> Entry:
    return Entry(path=path, symlink=target)


def _file(path: str) -> Entry:
    return Entry(path=path, digest="0" * 64, size=1)


def _chain(n: int) -> list[Entry]:
    """l0 -> l1 -> ... -> l{n-1} -> f: opening l0 follows n links."""
    return [_link(f"l{i}", f"l{i + 1}") for i in range(n - 1)] + [_link(f"l{n - 1}", "f")]


@pytest.mark.parametrize(
    "entries",
    [
        [_file("a/x.py"), _link("a/y.py", "x.py")],  # a sibling
        [_file("c.py"), _link("a", "b/../c.py")],  # through a name it does not hold
        [_file("pkg/m.py"), _link("pkg/up", ".."), _link("m.py", "pkg/up/pkg/up/pkg/m.py")],
        [_file("d/f"), _link("l1", "l2"), _link("l2", "d/f")],  # a chain, each inside
        [_link("a/b/c/l", "../../.."), _link("x", "a/b/c/l/a/b/c/l/")],  # the root, twice
        [_link("here", "."), _link("data", "missing/../dir/")],  # dangling: still inside
        [*_chain(MAX_LINKS), _file("f")],  # as many links as the kernel follows
        [_file(".gitignore"), _file(".github/ci.yml"), _link("ignore", ".gitignore")],
    ],
)
def test_links_that_stay_inside_through_the_manifest_are_kept(entries: list[Entry]) -> None:
    assert manifest_problem(entries) is None
    assert link_problems(entries) == []


@pytest.mark.parametrize(
    ("case", "refused", "said"),
    [
        ("chained escape", "x", "points outside the snapshot: 'a/b/c/l/../../../outside' climbs"
         " above it through symlink 'a/b/c/l'"),
        ("chained escape to /etc", "hostname", "through symlink 'a/b/c/d/e/f/g/h/l'"),
        ("link loop", "a", "symlink 'a' is in a loop of links: 'a' -> 'b' -> 'a'"),
    ],
)  # fmt: skip
def test_a_link_leaving_through_another_or_looping_is_refused_by_name(
    case: str, refused: str, said: str
) -> None:
    entries = [Entry.of(e) for e in _wire(HOSTILE[case], b"x")]
    for e in entries:
        assert entry_problem(e.wire()) is None, "each is fine on its own: the whole is not"
    problem = manifest_problem(entries)
    assert problem is not None and said in problem, problem
    assert link_problems(entries)[0].path == refused


def test_what_goes_through_a_refused_link_is_refused_with_its_cause() -> None:
    loop = [_link("c", "a/x"), _link("a", "b"), _link("b", "a"), _link("self", "self/x")]
    by_path = {p.path: p for p in link_problems(loop)}
    assert set(by_path) == {"a", "b", "c", "self"}
    assert by_path["c"].why == (
        "symlink 'c' goes through symlink 'a': symlink 'a' is in a loop of links: 'a' -> 'b' -> 'a'"
    )
    assert "loop of links: 'self' -> 'self'" in by_path["self"].why
    assert not any(p.leaves for p in by_path.values())

    out = [_link("d/up", "../.."), _link("y", "d/up/x"), _link("z", "y")]
    by_path = {p.path: p for p in link_problems(out)}
    assert set(by_path) == {"d/up", "y", "z"} and all(p.leaves for p in by_path.values())
    assert by_path["z"].why.startswith("symlink 'z' goes through symlink 'y': symlink 'd/up'")

    too_long = link_problems(_chain(MAX_LINKS + 1))
    assert [p.path for p in too_long] == ["l0"], "l1 on follows 40: the kernel's limit"
    assert f"more than {MAX_LINKS} links" in too_long[0].why
    # A chain too deep to resolve in one go: each link is judged by its own length.
    assert [p.path for p in link_problems(_chain(3 * MAX_LINKS))] == [
        f"l{i}" for i in range(2 * MAX_LINKS)
    ]


def _under_another(path: str, paths: dict[str, Entry]) -> bool:
    parent = posixpath.dirname(path)
    while parent:
        if parent in paths:
            return True
        parent = posixpath.dirname(parent)
    return False


def test_the_resolver_agrees_with_the_kernel(tmp_path: Path) -> None:
    """Random manifests written to disk: a link the resolver keeps resolves inside (and
    never with ELOOP); one it says leaves resolves outside. The snapshot's own name is one
    no target says, so a chain that climbed above it cannot come back."""
    rng = random.Random(26)
    names = ["a", "b", "l", "m"]
    compared = 0
    for i in range(1000):
        entries: dict[str, Entry] = {}
        for _ in range(rng.randint(1, 8)):
            path = "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.6:
                parts = [rng.choice([*names, "..", "..", "."]) for _ in range(rng.randint(1, 6))]
                entries[path] = _link(path, "/".join(parts))
            else:
                entries[path] = _file(path)
        listed = list(entries.values())
        if any(entry_problem(e.wire()) or _under_another(e.path, entries) for e in listed):
            continue  # refused before links are resolved
        root = tmp_path / str(i) / "o" / "o" / "o" / "o" / "SNAPSHOT"
        for e in sorted(listed, key=lambda e: e.symlink is not None):
            (root / e.path).parent.mkdir(parents=True, exist_ok=True)
            if e.symlink is None:
                (root / e.path).touch()
            else:
                (root / e.path).symlink_to(e.symlink)
        refused = {p.path: p for p in link_problems(listed)}
        for e in listed:
            if e.symlink is None:
                continue
            problem = refused.get(e.path)
            real = os.path.realpath(root / e.path)
            inside = real == str(root) or real.startswith(f"{root}/")
            if problem is None or problem.leaves:
                assert inside == (problem is None), ([x.wire() for x in listed], e.path, real)
                compared += 1
            if problem is None:
                try:
                    os.stat(root / e.path)
                except OSError as exc:
                    assert exc.errno != errno.ELOOP, ([x.wire() for x in listed], e.path)
    assert compared > 300  # links compared (most manifests are refused before)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        (".git/config", "is in '.git': a version-control directory is never part"),
        ("sub/.GIT/hooks/post-checkout", "is in '.GIT'"),
        ("a/.Hg/hgrc", "is in '.Hg'"),
        ("vendor/.svn/entries", "is in '.svn'"),
        (".git", "is in '.git'"),  # a worktree's or a submodule's .git file names a repository
        ("a/" + "n" * 256, "has a name over 255 bytes"),
        ("a/" + "é" * 128, "has a name over 255 bytes"),  # 128 characters, 256 bytes
        ("/".join(["é" * 120] * 18), "is over 4096 bytes"),
    ],
)
def test_version_control_directories_and_names_too_long_are_refused(path: str, said: str) -> None:
    problem = path_problem(path)
    assert problem is not None and said in problem, problem


def test_names_that_fit_and_links_into_version_control_directories() -> None:
    for fits in ("a/" + "n" * 255, "a/" + "é" * 127, "/".join(["n" * 255] * 16), ".gitignore"):
        assert path_problem(fits) is None, fits
    for target in (".git/config", "../.GIT", "sub/.hg/../x"):
        problem = symlink_problem("sub/link", target)
        assert problem is not None and "version-control directory" in problem, (target, problem)
    assert "over 4096 bytes" in (symlink_problem("l", "a/" * 2049) or "")
    assert symlink_problem("l", "a/" * 2047 + "b") is None


def test_the_worker_refuses_a_chained_escape_and_writes_nothing(tmp_path: Path) -> None:
    data = b"x = 1\n"
    cache = BlobCache(tmp_path / "cache", 10**9)
    dest = tmp_path / "jobs" / "job-1"
    dest.parent.mkdir()
    manifest = _wire([{"path": "train.py"}, *HOSTILE["chained escape"]], data)
    with pytest.raises(JobError, match="symlink 'x' points outside the snapshot"):
        write_tree(manifest, cache, dest, Store({"x": data}).fetch)
    assert list(dest.parent.iterdir()) == []
    assert not list((tmp_path / "cache").rglob(sha(data))), "refused before a fetch"


# ---- what of a directory is sent ---------------------------------------------------------


def test_what_is_sent_honours_ignore_files_and_never_sends_git_or_environments(
    tmp_path: Path,
) -> None:
    root = tmp_path / "proj"
    for rel, text in {
        "train.py": "x",
        "pkg/model.py": "x",
        "pkg/__pycache__/model.cpython-311.pyc": "x",
        ".git/HEAD": "x",
        ".venv/pyvenv.cfg": "x",
        "env2/pyvenv.cfg": "x",
        "env2/lib/big.so": "x",
        "data/train.bin": "x",
        "logs/run.log": "x",
        "logs/keep.log": "x",
        "pkg/.gitignore": "*.tmp\n",
        "pkg/scratch.tmp": "x",
        ".gitignore": "logs/*.log\n!logs/keep.log\ndata/\n",
        ".ddpqignore": "notes.md\n",
        "notes.md": "x",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "latest.py").symlink_to("pkg/model.py")
    (root / "outside").symlink_to(tmp_path)
    found = collect(root)
    paths = {e.path for e in found.entries}
    assert paths == {
        "train.py",
        "pkg/model.py",
        "pkg/.gitignore",
        "logs/keep.log",
        ".gitignore",
        ".ddpqignore",
        "run.sh",
        "latest.py",
    }, paths
    by_path = {e.path: e for e in found.entries}
    assert by_path["run.sh"].executable and not by_path["train.py"].executable
    assert by_path["latest.py"].symlink == "pkg/model.py"
    assert any("outside" in s for s in found.skipped), found.skipped


def _new_users_project(root: Path) -> Path:
    """The new user's project of issue 30: data in .gitignore, named by the program."""
    for rel, data in {
        "train.py": b"import pandas\ndf = open('data/train.csv')\n",
        "model.py": b"X = 1\n",
        ".gitignore": b"data/\nwandb/\n*.log\n",
        "data/train.csv": b"x" * 300_000,
        "data/raw/more.csv": b"y" * 100_000,
        "wandb/run.json": b"{}",
        "train.log": b"z" * 5_000,
        ".venv/pyvenv.cfg": b"home = /usr\n",
        ".venv/lib/big.so": b"v" * 600_000,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_what_stays_home_is_said_largest_first_with_why_and_names_in_the_source(
    tmp_path: Path,
) -> None:
    found = collect(_new_users_project(tmp_path / "proj"))
    assert {e.path for e in found.entries} == {"train.py", "model.py", ".gitignore"}
    said = [o.words() for o in found.left_out]
    assert said == [
        ".venv/ (600.0 KB, a virtualenv)",
        "data/ (400.0 KB, .gitignore)",
        "train.log (5.0 KB, .gitignore)",
        "wandb/ (2 B, .gitignore)",
    ], said
    # train.py opens data/train.csv; nothing names the rest (a venv never counts).
    assert named_in_sources(found) == [("train.py", "data/")]


def test_submit_says_what_stayed_home_and_warns_when_the_program_names_it(
    api: Server, tmp_path: Path
) -> None:
    server = api
    proj = _new_users_project(tmp_path / "proj")
    env = {"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}
    out = run_ddpq("submit", "--entrypoint", "train.py", env=env, cwd=proj, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("code: 3 files"), lines
    assert lines[1] == (
        "  left out: .venv/ (600.0 KB, a virtualenv); data/ (400.0 KB, .gitignore);"
        " train.log (5.0 KB, .gitignore); wandb/ (2 B, .gitignore)"
    ), lines
    assert "warning: train.py names data/, which was left out" in out.stderr, out.stderr
    assert "where data goes" in out.stderr
    # --json: stdout stays one Job; the warning still reaches the user.
    out = run_ddpq("submit", "--entrypoint", "train.py", "--json", env=env, cwd=proj)
    assert out.returncode == 0 and '"id"' in out.stdout and "left out" not in out.stdout
    assert "warning: train.py names data/" in out.stderr


def test_links_that_leave_on_their_way_or_loop_and_version_control_are_not_sent(
    tmp_path: Path,
) -> None:
    root = tmp_path / "proj"
    (root / "a").mkdir(parents=True)
    (root / "train.py").write_text("x")
    (root / "a" / "l").symlink_to("..")  # the directory itself: kept
    (root / "kept.py").symlink_to("a/l/a/l/train.py")
    # Ends inside (realpath), but through proj's parent: on a worker that is another name.
    (root / "back.py").symlink_to("a/l/../proj/train.py")
    (root / "p").symlink_to("q")
    (root / "q").symlink_to("p")
    (root / "hooks").symlink_to(".git/hooks")
    (root / ".git" / "hooks").mkdir(parents=True)
    (root / "sub").mkdir()
    (root / "sub" / ".git").write_text("gitdir: ../.git/modules/sub\n")  # a submodule's
    (root / "sub" / ".GIT").mkdir()  # macOS's .git
    (root / "sub" / ".GIT" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")
    (root / "sub" / "m.py").write_text("x")
    found = collect(root)
    by_path = {e.path: e for e in found.entries}
    assert set(by_path) == {"train.py", "a/l", "kept.py", "sub/m.py"}, sorted(by_path)
    assert sorted(found.skipped) == [
        "1 symlink(s) pointing into a version-control directory (.git, .hg, .svn)",
        "1 symlink(s) pointing outside the directory",
        f"2 symlink(s) in a loop of links, or a chain of more than {MAX_LINKS}",
    ], found.skipped
    assert manifest_problem(found.entries) is None, "what is sent, the API takes"


# ---- how a worker writes a job's directory -----------------------------------------------


class Store:
    """Contents a fake API serves (the worker's fetch), counting fetches."""

    def __init__(self, contents: dict[str, bytes]) -> None:
        self.contents = {sha(d): d for d in contents.values()}
        self.fetched: list[str] = []
        self.lock = threading.Lock()

    def fetch(self, digest: str) -> Iterator[bytes]:
        with self.lock:
            self.fetched.append(digest)
        data = self.contents[digest]
        yield data[: len(data) // 2]
        yield data[len(data) // 2 :]


def _manifest(files: dict[str, bytes]) -> list[dict[str, Any]]:
    return [Entry(path=p, digest=sha(d), size=len(d)).wire() for p, d in files.items()]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_worker_refuses_a_hostile_manifest_and_writes_nothing(
    tmp_path: Path, case: str
) -> None:
    """What the API would refuse, sent to the worker anyway (a forged answer)."""
    data = b"x = 1\n"
    store = Store({"x": data})
    cache = BlobCache(tmp_path / "cache", 10**9)
    dest = tmp_path / "jobs" / "job-1"
    dest.parent.mkdir()
    with pytest.raises(JobError, match="refused"):
        write_tree(_wire(HOSTILE[case], data), cache, dest, store.fetch)
    assert list(dest.parent.iterdir()) == [], "nothing written, not even a partial directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "jobs"]


def test_the_worker_refuses_content_that_does_not_match_its_digest(tmp_path: Path) -> None:
    files = {"train.py": b"the real one\n"}
    store = Store(files)
    store.contents[sha(b"the real one\n")] = b"a forged one\n"
    cache = BlobCache(tmp_path / "cache", 10**9)
    with pytest.raises(JobError, match="does not match its digest"):
        write_tree(_manifest(files), cache, tmp_path / "job-1", store.fetch)
    assert not (tmp_path / "job-1").exists()
    assert not cache.path(sha(b"the real one\n")).exists()


def test_job_directories_are_private_copies_and_one_content_is_fetched_once(
    tmp_path: Path,
) -> None:
    files = {f"f{i}.py": b"shared content\n" for i in range(3)} | {"own.py": b"own\n"}
    store = Store(files)
    dirs = Workdirs(tmp_path / "data", cache_bytes=10**9, keep_s=0)
    manifest = _manifest(files)
    results: dict[int, Path] = {}

    def prepare(job_id: int) -> None:
        results[job_id], _ = dirs.prepare(job_id, "s" * 64, lambda: manifest, store.fetch)

    threads = [threading.Thread(target=prepare, args=(j,)) for j in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(store.fetched) == sorted({sha(d) for d in files.values()}), store.fetched
    one, two = results[1], results[2]
    cached = dirs.cache.path(sha(b"shared content\n"))
    for d in (one, two):
        st = (d / "f0.py").stat()
        assert st.st_nlink == 1 and st.st_ino != cached.stat().st_ino, "a copy, not a link"
    (one / "f0.py").write_text("rewritten by job 1\n")
    (one / "state.txt").write_text("job 1 was here\n")
    assert cached.read_bytes() == b"shared content\n"
    assert (two / "f0.py").read_bytes() == b"shared content\n"
    assert not (two / "state.txt").exists()

    # A second attempt of job 1 finds what its first left (its code as sent: below);
    # job 1 ending removes it.
    (one / "f0.py").write_bytes(b"shared content\n")
    dirs.attempt_ended(1)
    again, written = dirs.prepare(1, "s" * 64, lambda: manifest, store.fetch)
    assert written.reused and again == one and (again / "state.txt").exists()
    assert dirs.kept() == [1, 2]
    dirs.ended([1], running=set())
    assert dirs.kept() == [2] and not one.exists()


def test_the_cache_keeps_to_its_cap_by_least_recent_use(tmp_path: Path) -> None:
    contents = {f"c{i}": bytes([i]) * 1000 for i in range(5)}
    store = Store(contents)
    cache = BlobCache(tmp_path / "cache", max_bytes=2500)
    for data in contents.values():
        cache.ensure(sha(data), len(data), store.fetch)
        os.utime(cache.path(sha(data)), (0, len(store.fetched)))  # distinct use times
    cache.trim()
    left = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert left == sorted(sha(d) for d in list(contents.values())[-2:])


# ---- real jobs from a user's directory -----------------------------------------------------


TRAIN = r"""
import os, pathlib
import torch
import torch.distributed as dist
import ddpq.train as ddpq_train
import ddpqtestpkg
import helper

dist.init_process_group("gloo")
rank = dist.get_rank()
state = pathlib.Path("state.txt")  # in the working directory, as the DDP tutorial's snapshot
found = "found" if state.exists() else "fresh"
dist.barrier()
if rank == 0:
    print(f"state {found} magic {ddpqtestpkg.MAGIC} scale {helper.SCALE}", flush=True)
    state.write_text("written by job " + os.environ["DDPQ_JOB_ID"])
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(rank))
y = x.sum(dim=1, keepdim=True) * helper.SCALE
for step in range(1, 31):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    ddpq_train.report(step, loss=loss.detach())
ddpq_train.flush()
dist.destroy_process_group()
"""


def _project(root: Path, requirement: str = "./wheels/ddpqtestpkg-0.1-py3-none-any.whl") -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text(TRAIN)
    (root / "helper.py").write_text("# shared by the training script\nSCALE = 1.0\n")
    (root / "requirements.txt").write_text(requirement + "\n")
    make_wheel(root / "wheels")
    (root / ".ddpqignore").write_text("data/\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(os.urandom(300_000))  # left out: .ddpqignore
    (root / ".git" / "objects").mkdir(parents=True)
    (root / ".git" / "objects" / "pack").write_bytes(os.urandom(300_000))  # never sent
    return root


def _cli(server: Server, root: Path, *args: str) -> tuple[str, int]:
    out = run_ddpq(
        *args, env={"DDPQ_URL": server.url, "DDPQ_TOKEN": server.api_token}, cwd=root, timeout=240
    )
    assert out.returncode in (0, 4), (args, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout, out.returncode


def _job_id(stdout: str) -> int:
    return (
        int(stdout.split(" · job ", 1)[1].split()[0])
        if " · job " in stdout
        else int(stdout.split("job ", 1)[1].split()[0])
    )


@pytest.mark.long  # a pip install into a job's environment: about 35 s each (make test-long)
@pytest.mark.torchrun
def test_a_users_directory_runs_with_its_requirements_and_resubmits_send_one_file(
    server: Server, start_worker: Any, tmp_path: Path
) -> None:
    worker = start_worker(server, cpu_slots=2)
    proj = _project(tmp_path / "my-model")
    c = server.client()

    first, code = _cli(
        server, proj, "submit", "--entrypoint", "train.py", "--world-size", "2", "--wait"
    )
    assert code == 0, first
    # train.py, helper.py, requirements.txt, the wheel, .ddpqignore: not data/ nor .git.
    assert first.startswith("code: 5 files,") and "(5 new," in first, first
    one = _job_id(first)
    log = c.get(f"/jobs/{one}/logs").text
    assert "Successfully installed ddpqtestpkg" in log and "[pip]" in log, log
    assert "[rank0]: state fresh magic 42 scale 1.0" in log, log
    losses = [i["values"]["loss"] for i in c.get(f"/jobs/{one}/metrics").json()["items"]]
    assert len(losses) == 30 and losses[-1] < losses[0], losses

    # One rank from here on: what is tested now is what is sent and where it runs.
    (proj / "helper.py").write_text("# shared by the training script\nSCALE = 2.0\n")
    second, code = _cli(server, proj, "submit", "--entrypoint", "train.py", "--wait")
    assert code == 0, second
    assert second.startswith("code: 5 files,") and "(1 new," in second, second
    two = _job_id(second)
    log = c.get(f"/jobs/{two}/logs").text
    assert "reusing environment" in log and "[rank0]: state fresh magic 42 scale 2.0" in log, log

    # The same code and spec again: a job of its own, in a directory of its own.
    third, code = _cli(server, proj, "resubmit", str(two), "--wait")
    assert code == 0, third
    three = _job_id(third)
    assert c.get(f"/jobs/{three}").json()["code"] == c.get(f"/jobs/{two}").json()["code"]
    assert "[rank0]: state fresh" in c.get(f"/jobs/{three}/logs").text, (
        c.get(f"/jobs/{three}").json(),
        third,
        worker.log()[-3000:],
    )

    listing, _ = _cli(server, proj, "code", str(two))
    assert "helper.py" in listing and "5 files" in listing, listing
    _cli(server, tmp_path, "code", str(two), "--download", "copy")
    assert (tmp_path / "copy" / "helper.py").read_text() == (proj / "helper.py").read_text()
    assert not (tmp_path / "copy" / "data").exists()

    # Ended jobs' directories stay: each is one of its owner's newest (service.outputs;
    # tests/test_outputs.py sees them go).
    kept = {p.name.split("-")[1] for p in (worker.data_dir / "jobs").glob("job-*")}
    assert kept == {str(one), str(two), str(three)}, kept


@pytest.mark.torchrun
def test_a_failed_requirements_build_fails_the_job_with_pips_error_once(
    server: Server, start_worker: Any, tmp_path: Path
) -> None:
    start_worker(server, cpu_slots=2)
    # A wheel pip cannot read: what the worker's rules allow (a file of the job's code)
    # still fails in pip, and the job says pip's error.
    proj = _project(tmp_path / "p", requirement="./wheels/broken-0.1-py3-none-any.whl")
    (proj / "wheels" / "broken-0.1-py3-none-any.whl").write_bytes(b"not a zip file\n")
    out, code = _cli(server, proj, "submit", "--entrypoint", "train.py", "--wait")
    assert code == 4, out
    job = server.client().get(f"/jobs/{_job_id(out)}").json()
    assert job["status"] == "failed" and job["attempt"] == 1, job
    assert "installing the job's requirements failed" in job["reason"], job["reason"]
    assert "broken" in job["reason"], job["reason"]


TWO_NODES = r"""
import os, pathlib
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"node {os.environ['GROUP_RANK']} rank {dist.get_rank()} read "
      f"{pathlib.Path('data.txt').read_text().strip()} in {pathlib.Path.cwd().name}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.torchrun
def test_a_two_node_job_runs_its_code_on_both_workers(
    server: Server, start_worker: Any, tmp_path: Path
) -> None:
    # Ports of its own: another multi-node test may run at the same time on this host.
    local = ("--advertise-addr", "127.0.0.1", "--rdzv-ports", "30400-30999")
    for name in ("a", "b"):
        start_worker(server, *local, name=name, cpu_slots=1)
    proj = tmp_path / "two"
    proj.mkdir()
    (proj / "main.py").write_text(TWO_NODES)
    (proj / "data.txt").write_text("from the snapshot\n")
    out, code = _cli(
        server, proj, "submit", "--entrypoint", "main.py", "--nnodes", "2", "--world-size", "2",
        "--wait",
    )  # fmt: skip
    jid = _job_id(out)
    log = server.client().get(f"/jobs/{jid}/logs").text
    assert code == 0, log
    for node in (0, 1):
        assert f"node {node} rank {node} read from the snapshot in job-{jid}" in log, log


def test_one_environment_is_built_for_two_jobs_and_torch_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.starting import requirements
    from worker.starting.venvs import Venvs

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the wheel is local: pip needs no index
    make_wheel(tmp_path / "wheels")
    (tmp_path / "requirements.txt").write_text("./wheels/ddpqtestpkg-0.1-py3-none-any.whl\n")
    reqs = requirements.read(tmp_path, [])
    venvs = Venvs(tmp_path / "venvs", max_envs=1)
    said: list[str] = []
    pythons: list[str] = []

    def job() -> None:
        with venvs.using(reqs, tmp_path, dict(os.environ), said.append, threading.Event()) as py:
            pythons.append(str(py))

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(pythons)) == 1 and len(pythons) == 2
    assert sum("building an environment" in line for line in said) == 1, said
    assert sum("reusing environment" in line for line in said) == 1, said
    # pip's output is one line in the log when the build succeeds (issue 30).
    assert [line for line in said if line.startswith("[pip]")] == [
        "[pip] Successfully installed ddpqtestpkg-0.1\n"
    ], said
    out = subprocess.run(
        [
            pythons[0],
            "-c",
            "import ddpqtestpkg, torch, ddpq; print(ddpqtestpkg.MAGIC, torch.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    assert out.strip() == f"42 {spec.origin}", "the worker's own torch, not another"

    # Another torch than the worker's fails the build (the constraints pin it).
    bad = requirements.read(None, ["torch==1.0.0"])
    building = venvs.using(bad, tmp_path, dict(os.environ), said.append, threading.Event())
    said.clear()
    with pytest.raises(JobError, match="requirements failed"), building:
        pass
    assert len([d for d in (tmp_path / "venvs").iterdir() if (d / ".ddpq-ready").exists()]) == 1
    # A failed build shows all of pip's output.
    shown = "".join(line for line in said if line.startswith("[pip]"))
    assert shown.count("\n") > 1 and "[pip] ERROR:" in shown, said


def test_requirements_the_worker_already_satisfies_build_no_environment(tmp_path: Path) -> None:
    # Issue 30: a requirements.txt of only `torch>=1.11.0`, which the worker has, built an
    # environment and put ~30 lines of `Requirement already satisfied` in the job's log.
    from worker.starting import requirements
    from worker.starting.venvs import Venvs, python_for, satisfied

    venvs = Venvs(tmp_path / "venvs", max_envs=1)
    (tmp_path / "requirements.txt").write_text("torch>=1.11.0\n")
    said: list[str] = []
    spec = ClaimedSpec(code="0" * 64, pip=["Packaging", "absent-pkg; python_version < '3'"])
    with python_for(venvs, spec, tmp_path, dict(os.environ), said.append, threading.Event()) as py:
        assert py == sys.executable
    assert said == [
        "[ddpq] requirements: the worker's environment already has torch>=1.11.0, Packaging, "
        "absent-pkg; python_version < '3'; no environment built\n"
    ]
    assert list((tmp_path / "venvs").iterdir()) == []

    def sat(*pip: str) -> bool:
        return satisfied(requirements.read(None, list(pip)))

    torch_version = importlib.metadata.version("torch")
    assert sat(f"torch=={torch_version}", "torch<99", "TORCH >= 1")
    assert not sat("torch>=99")  # another version: pip decides (here, the pins refuse it)
    assert not sat("packaging", "absent-pkg")  # one missing is enough to build
    assert not sat("torch[an-extra]")  # what an extra pulls in is pip's to judge
    digest = "sha256:" + "0" * 64
    assert not sat(f"torch --hash={digest}")
    (tmp_path / "w.whl").write_bytes(b"x")
    assert not satisfied(requirements.read(tmp_path, ["./w.whl"]))
