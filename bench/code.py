"""What sending code with a job costs, on SQLite and on Postgres.

A tree of 2,000 files and 100 MB (1,980 source-sized files of 5 KB, 20 of 4.5 MB, all
random, so nothing compresses away) is sent with ``Client.push_code`` as
``ddpq submit`` does, to a real ``ddpq serve``:

1. the first submit: wall time and bytes sent;
2. a re-submit after a one-line change to one file: bytes sent (goal: <= 1 % of the
   first) and wall time (hashing the tree again is most of it);
3. the worker's side: writing the job's directory with its cache empty (every content
   fetched from the API, checked and copied) and again with the cache warm (copies
   only), as ``worker.code.Workdirs`` does for a job.

    .venv/bin/python bench/code.py [--backend sqlite|postgres|both] [--files 2000] [--mb 100]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _harness import Api, backends, database, serve

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ddpq.client import Client  # noqa: E402
from worker.api import WorkerAPI  # noqa: E402
from worker.code import Workdirs  # noqa: E402

BIG_FILES = 20


def make_tree(root: Path, files: int, total_mb: int) -> None:
    """``files`` files of ``total_mb`` MB: a few large ones carry 90 % of the bytes."""
    rng = random.Random(0)
    small_n = files - BIG_FILES
    small = 5_000
    big = (total_mb * 1_000_000 - small_n * small) // BIG_FILES
    for i in range(small_n):
        d = root / f"pkg{i % 40}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_bytes(rng.randbytes(small))
    (root / "data").mkdir()
    for i in range(BIG_FILES):
        (root / "data" / f"shard{i}.bin").write_bytes(rng.randbytes(big))


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def run(api: Api, backend: str, files: int, total_mb: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ddpq-bench-code-"))
    root = tmp / "tree"
    make_tree(root, files, total_mb)
    with Client(api.url, api.api_token, timeout=600) as c:
        t = time.perf_counter()
        first = c.push_code(root)
        first_s = time.perf_counter() - t
        print(
            f"{backend}: first submit: {first.files} files, {mb(first.bytes)}: {mb(first.sent)} "
            f"sent in {first_s:.2f} s ({first.sent / first_s / 1e6:.0f} MB/s)"
        )
        one = root / "pkg0" / "mod0.py"
        one.write_bytes(one.read_bytes()[:-20] + b"\nlearning_rate = 3e-4\n")
        t = time.perf_counter()
        again = c.push_code(root)
        again_s = time.perf_counter() - t
        share = again.sent / first.sent
        print(
            f"{backend}: re-submit after a one-line change: {again.new} content(s), "
            f"{again.sent} bytes sent ({share:.4%} of the first) in {again_s:.2f} s"
        )
    worker = WorkerAPI(api.url, api.worker_token, "bench")
    manifest = worker.snapshot(again.id).manifest
    dirs = Workdirs(tmp / "worker", cache_bytes=10 * 1000**3, keep_s=0)
    for job_id, how in ((1, "cache empty, every content fetched"), (2, "cache warm")):
        t = time.perf_counter()
        _, written = dirs.prepare(job_id, again.id, lambda: manifest, worker.blob)
        took = time.perf_counter() - t
        print(
            f"{backend}: worker writes a job's directory ({how}): {took:.2f} s "
            f"({again.bytes / took / 1e6:.0f} MB/s; {written.fetched} fetched)"
        )
    worker.close()
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=int, default=100)
    args = ap.parse_args()
    for backend in backends(args.backend):
        with database(backend) as url, serve(url) as api:
            run(api, backend, args.files, args.mb)


if __name__ == "__main__":
    main()
