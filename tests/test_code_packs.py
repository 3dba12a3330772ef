"""Code sent in packs (ddpq.pack, POST /code/packs): many contents a request, each
compressed with zstd where that pays, still named by the sha256 of the uncompressed
bytes (issue 33). Round trips on both databases (stored compressed, served compressed
to a worker that takes zstd and plain to one that does not), every hostile frame refused
by the field it lies in with nothing stored, old clients' single PUTs, and the worker's
files byte-identical to the user's."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard
from sqlalchemy import create_engine, select

from ddpq import pack
from ddpq.client import Client
from service.models import CodeBlob
from tests.conftest import Server, start_server, stop_server
from tests.test_code import rows
from worker.edges.api import WorkerAPI
from worker.files.code import BlobCache, Workdirs
from worker.starting.torchrun import JobError

TEXT = b"".join(b"def f%d(x):\n    return x * %d  # a line of code\n" % (i, i) for i in range(400))
NOISE = random.Random(1).randbytes(20_000)  # does not compress: sent as it is


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def zstd(data: bytes, **kw: Any) -> bytes:
    return zstandard.ZstdCompressor(level=3, **kw).compress(data)


def body(*frames: tuple[str, str, int, bytes]) -> bytes:
    """A pack of (digest, encoding, size, payload) frames, each as told (lies too)."""
    return b"".join(pack.frame(d, e, n, p) + p for d, e, n, p in frames)


def post(server: Server, data: bytes) -> httpx.Response:
    return server.client().post(
        "/code/packs", content=data, headers={"Content-Type": pack.MEDIA_TYPE}
    )


def encodings(db_url: str) -> dict[str, str | None]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(select(CodeBlob.digest, CodeBlob.encoding)).all())  # type: ignore[arg-type]
    finally:
        engine.dispose()


def test_a_pack_round_trips_compressed_and_plain_on_both_databases(
    server: Server, db_url: str
) -> None:
    limits = server.client().get("/code/packs").json()
    assert limits["encodings"] == ["identity", "zstd"] and limits["max_content_bytes"] > 0
    empty = b""
    r = post(
        server,
        body(
            (sha(TEXT), "zstd", len(TEXT), zstd(TEXT)),
            (sha(NOISE), "identity", len(NOISE), NOISE),
            (sha(empty), "identity", 0, empty),
            (sha(TEXT), "zstd", len(TEXT), zstd(TEXT)),  # twice in one pack: stored once
        ),
    )
    assert r.status_code == 200 and r.json() == {"stored": 3, "known": 0}, r.text
    assert post(server, body((sha(TEXT), "zstd", len(TEXT), zstd(TEXT)))).json() == {
        "stored": 0,
        "known": 1,
    }
    stored = encodings(db_url)
    assert stored == {sha(TEXT): "zstd", sha(NOISE): None, sha(empty): None}
    missing = server.client().post("/code/missing", json={"digests": list(stored)})
    assert missing.json()["missing"] == []
    # An asker that takes zstd gets the stored frame; one that does not, the content.
    for accept, encoded in (("zstd", "zstd"), ("gzip, deflate", None), ("identity", None)):
        got = server.client().get(f"/code/blobs/{sha(TEXT)}", headers={"Accept-Encoding": accept})
        assert got.status_code == 200 and got.content == TEXT, accept
        assert got.headers.get("content-encoding") == encoded, accept
        assert "Accept-Encoding" in got.headers["vary"]
    manifest = [
        {"path": "a.py", "digest": sha(TEXT), "size": len(TEXT)},
        {"path": "noise.bin", "digest": sha(NOISE), "size": len(NOISE)},
    ]
    assert server.client().post("/code/snapshots", json={"files": manifest}).status_code == 201


def _bomb() -> bytes:
    return zstd(bytes(50 * 1024 * 1024), write_content_size=False)  # 50 MB of zeros


BAD = {
    "wrong digest": (
        lambda: body((sha(b"other"), "zstd", len(TEXT), zstd(TEXT))),
        "frames[1].digest",
    ),
    "declared size smaller than the frame's": (
        lambda: body((sha(TEXT), "zstd", len(TEXT) - 1, zstd(TEXT))),
        "frames[1].size",
    ),
    "declared size larger, no size in the frame": (
        lambda: body((sha(TEXT), "zstd", len(TEXT) + 1, zstd(TEXT, write_content_size=False))),
        "frames[1].size",
    ),
    "a zstd bomb declared small": (
        lambda: body((sha(TEXT), "zstd", 1000, _bomb())),
        "frames[1].size",
    ),
    "a bomb whose frame says its size": (
        lambda: body((sha(TEXT), "zstd", 1000, zstd(bytes(50 * 1024 * 1024)))),
        "frames[1].size",
    ),
    "declared over the largest file": (
        lambda: body((sha(TEXT), "zstd", 10**15, zstd(TEXT))),
        "frames[1].size",
    ),
    "truncated frame": (
        lambda: body((sha(TEXT), "zstd", len(TEXT), zstd(TEXT)[:-7])),
        "frames[1].size",
    ),
    "bytes after the frame": (
        lambda: body((sha(TEXT), "zstd", len(TEXT), zstd(TEXT) + b"xx")),
        "frames[1].size",
    ),
    "unknown encoding": (
        lambda: body((sha(TEXT), "br", len(TEXT), TEXT)),
        "frames[1].encoding",
    ),
    "identity of another length": (
        lambda: body((sha(TEXT), "identity", len(TEXT) + 5, TEXT)),
        "frames[1].size",
    ),
    "length past the body": (
        lambda: body((sha(TEXT), "identity", len(TEXT), TEXT))[:-10],
        "frames[1].length",
    ),
    "no header": (lambda: b"x" * 500, "frames[1]"),
    "negative size": (
        lambda: f"{sha(TEXT)} identity -1 0\n".encode(),
        "frames[1].size",
    ),
}


def test_every_lying_frame_is_refused_by_its_field_and_nothing_is_stored(
    db_url: str, tmp_path: Path
) -> None:
    # Files of at most 100 kB: the pack's body limit is then its floor (8 MiB and the
    # headers), small enough to go over here.
    server = start_server(db_url, tmp_path / "api", DDPQ_CODE_MAX_FILE_BYTES="100000")
    try:
        good = body((sha(NOISE), "identity", len(NOISE), NOISE))  # frames[0], before the lie
        for name, (make, field) in BAD.items():
            r = post(server, good + make())
            assert r.status_code == 422, (name, r.status_code, r.text)
            loc = r.json()["detail"][0]["loc"]
            assert loc == ["body", field], (name, loc, r.text)
        assert rows(db_url, CodeBlob) == 0  # the good frame went with the bad one's pack
        assert post(server, b"").status_code == 422
        over = random.Random(3).randbytes(100_001)  # over the largest file
        r = post(server, body((sha(over), "identity", len(over), over)))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "frames[0].size"]
        # The body limit holds for what is sent, compressed or not.
        lim = server.client().get("/code/packs").json()
        assert lim["max_content_bytes"] == pack.CONTENT_BYTES
        big = bytes(lim["max_body_bytes"] + 1)
        assert post(server, big).status_code == 413
        assert rows(db_url, CodeBlob) == 0
    finally:
        stop_server(server)


def _tree(root: Path) -> dict[str, bytes]:
    rng = random.Random(4)
    files = {
        "train.py": TEXT,
        "pkg/util.py": TEXT.replace(b"def", b"async def"),
        "data/noise.bin": NOISE,
        "data/big.bin": rng.randbytes(5 * 1024 * 1024),  # incompressible, over a pack
        "empty.txt": b"",
    }
    files |= {f"pkg/m{i}.py": b"x = %d\n" % i * (i + 1) for i in range(300)}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.mark.parametrize("how", ["packs", "one PUT a content (an API older than packs)"])
def test_the_worker_gets_the_users_files_byte_for_byte(
    server: Server, tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _tree(tmp_path / "tree")
    if how != "packs":
        monkeypatch.setattr(Client, "_pack_limits", lambda self: None)
    with Client(server.url, server.api_token) as c:
        pushed = c.push_code(tmp_path / "tree")
        assert pushed.new == len(set(files.values()))
        if how == "packs":  # compressed: far less than the tree's bytes went
            assert pushed.sent < pushed.bytes - 100_000
        again = c.push_code(tmp_path / "tree")
        assert again.id == pushed.id and again.new == 0 and again.sent == 0
    worker = WorkerAPI(server.url, server.worker_token, "w")
    try:
        dirs = Workdirs(tmp_path / "worker", cache_bytes=10**9, keep_s=0)
        manifest = worker.snapshot(pushed.id).manifest
        path, written = dirs.prepare(1, pushed.id, lambda: manifest, worker.blob)
    finally:
        worker.close()
    assert written.fetched == len(set(files.values()))
    for rel, data in files.items():
        assert (path / rel).read_bytes() == data, rel


def test_the_worker_refuses_a_content_longer_than_its_size_as_it_arrives(
    tmp_path: Path,
) -> None:
    cache = BlobCache(tmp_path / "cache", 10**9)
    sent: list[int] = []

    def endless(digest: str) -> Any:
        while True:  # a decompressed stream that never ends
            sent.append(1)
            yield bytes(1 << 20)

    with pytest.raises(JobError, match="longer than"):
        cache.ensure(sha(TEXT), len(TEXT), endless)
    assert len(sent) == 1 and not cache.path(sha(TEXT)).exists()


def test_compress_skips_what_does_not_shrink() -> None:
    assert pack.compress(NOISE)[0] == "identity"
    assert pack.compress(random.Random(5).randbytes(600_000))[0] == "identity"  # a sample
    encoding, payload = pack.compress(TEXT)
    assert encoding == "zstd" and pack.decompress(payload, len(TEXT)) == TEXT
    assert pack.compress(b"tiny") == ("identity", b"tiny")
