"""What sending code with a job costs, on SQLite and on Postgres, beside Ray Jobs.

``--tree text`` (the default, issue 33): 1,982 source-like files, 78 MB in all (sizes
spread as a project's are: most a few KB to tens of KB, a few of MBs), text that
compresses as a real mixed tree did (deflate, as Ray zips it: 0.56; code with data
literals, tables and hashes). ``ddpq submit`` (the CLI, a process of its own, as a user
runs it) sends it to a real ``ddpq serve``, and where Ray is installed (``--ray
PATH/bin``: a venv holding ``ray[default]``) ``ray job submit --working-dir`` sends the
same tree to a local Ray head, each with a fresh tree per round (nothing cached):

1. the first submit; 2. the same tree again; 3. after a one-line change to one file:
wall time of the command, and bytes sent (ddpq's own count; Ray's: the size of the tree
zipped with deflate, as Ray packs it). Medians over ``--rounds``, ddpq and Ray
alternating.

``--tree random``: a tree of 2,000 files and 100 MB (1,980 source-sized files of 5 KB,
20 of 4.5 MB, all random, so nothing compresses away) is sent with
``Client.push_code`` as ``ddpq submit`` does, to a real ``ddpq serve``:

1. the first submit: wall time and bytes sent;
2. a re-submit after a one-line change to one file: bytes sent (goal: <= 1 % of the
   first) and wall time (hashing the tree again is most of it);
3. the worker's side: writing the job's directory with its cache empty (every content
   fetched from the API, checked and copied) and again with the cache warm (copies
   only, each checked against its digest), as ``worker.files.code.Workdirs`` does for a job;
4. what walls between jobs cost (``--walls``, SQLite): the same job, a 300-step 2-rank
   ``examples/ddp_plain.py`` sent as code with a requirements.txt naming a wheel, run
   on a walled worker (each job under a uid of its own, its directories given and taken
   back, the environment's seal checked, the uid swept after) and on an unwalled one,
   each with its cache and environment warm, alternating, POST to ``finished_at``:
   the median ratio walled / unwalled (goal: at most 1.05). Needs root.

    .venv/bin/python bench/code.py [--backend sqlite|postgres|both] [--rounds 3] [--ray DIR]
    .venv/bin/python bench/code.py --tree random [--files 2000] [--mb 100]
    .venv/bin/python bench/code.py --walls [--pairs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from _harness import Api, backends, child_env, database, free_port, run_job, serve

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ddpq.client import Client  # noqa: E402
from ddpq.snapshot import human_bytes  # noqa: E402
from worker.edges.api import WorkerAPI  # noqa: E402
from worker.files.code import Workdirs  # noqa: E402

BIG_FILES = 20
KEYWORDS = [
    "def",
    "class",
    "return",
    "if",
    "else",
    "elif",
    "for",
    "while",
    "in",
    "import",
    "from",
    "as",
    "with",
    "try",
    "except",
    "finally",
    "raise",
    "yield",
    "lambda",
    "self",
    "None",
    "True",
    "False",
    "and",
    "or",
    "not",
    "is",
    "pass",
    "break",
    "continue",
]
TEXT_FILES, TEXT_MB = 1982, 78


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


def _text(rng: random.Random, vocab: list[str], n: int) -> bytes:
    """Source-like text: half lines of code (keywords and a project's identifiers), half
    data literals (floats, base64, hex keys), which compresses as issue 33's tree did."""
    lines: list[str] = []
    size = 0
    alphabet = string.ascii_letters + string.digits + "+/"
    while size < n:
        indent = " " * (4 * rng.randrange(4))
        kind = rng.random()
        if kind < 1 / 6:
            floats = ", ".join(f"{rng.uniform(-1, 1):.6f}" for _ in range(rng.randrange(4, 10)))
            line = f"{indent}[{floats}],"
        elif kind < 2 / 6:
            line = f"{indent}{''.join(rng.choices(alphabet, k=rng.randrange(40, 90)))!r},"
        elif kind < 3 / 6:
            line = f"{indent}{rng.getrandbits(128):032x}: {rng.randrange(10**9)},"
        else:
            words = [
                rng.choice(KEYWORDS) if rng.random() < 0.3 else rng.choice(vocab)
                for _ in range(rng.randrange(3, 10))
            ]
            tail = rng.choice(["", ":", "(", ")", " = 0", "  # " + " ".join(rng.sample(vocab, 4))])
            line = indent + " ".join(words) + tail
        lines.append(line)
        size += len(line) + 1
    return ("\n".join(lines) + "\n").encode()[:n]


def make_text_tree(root: Path, files: int, total_mb: int, seed: int) -> None:
    """``files`` source-like files of ``total_mb`` MB in all: sizes log-normal (median
    ~12 KB) plus 1 % of large generated files, scaled to the total. The text comes from a
    pool of 16 MB, each file a slice of it at its own offset under a line of its own, so
    no two files are alike and making the tree costs seconds, not minutes."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase + "_"
    vocab = ["".join(rng.choices(letters, k=rng.randrange(3, 14))) for _ in range(3000)]
    pool = _text(rng, vocab, 16_000_000)
    sizes = [rng.lognormvariate(9.4, 1.2) for _ in range(files)]
    for i in rng.sample(range(files), max(1, files // 100)):
        sizes[i] = rng.uniform(1e6, 4e6)
    scale = total_mb * 1_000_000 / sum(sizes)
    for i, raw in enumerate(sizes):
        n = max(100, min(int(raw * scale), len(pool) - 1))
        d = root / f"pkg{i % 40}" / f"sub{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        start = rng.randrange(len(pool) - n)
        head = f"# module {i} of tree {seed}\n".encode()
        (d / f"mod{i}.py").write_bytes(head + pool[start : start + n - len(head)])
    (root / "main.py").write_text("print('hello')\n")


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


SENT = re.compile(r"\((\d+) new, ([\d.]+) (B|KB|MB|GB) sent\)")
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
STEPS = ("first submit", "identical resubmit", "one-line change")


def ddpq_submit(api: Api, tree: Path) -> tuple[float, float]:
    """`ddpq submit` of ``tree`` (a job left queued): wall time, and bytes sent as it says."""
    argv = [sys.executable, "-m", "ddpq.cli", "submit", "--entrypoint", "main.py"]
    env = child_env(DDPQ_URL=api.url, DDPQ_TOKEN=api.api_token)
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t
    m = SENT.search(r.stdout + r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"ddpq submit failed ({r.returncode}): {r.stdout}{r.stderr}")
    return took, float(m.group(2)) * UNITS[m.group(3)]


@contextlib.contextmanager
def ray_head(bin_dir: Path) -> Iterator[str]:
    """A local Ray head (``ray start --head --block``, stopped by its own pid): its
    dashboard's address, where `ray job submit` goes."""
    tmp = Path(tempfile.mkdtemp(prefix="hray-", dir="/tmp"))  # Ray's socket paths are short
    port, dash = free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    argv = [
        str(bin_dir / "ray"), "start", "--head", "--block", f"--port={port}",
        f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", f"--temp-dir={tmp}",
        "--num-cpus=2", "--disable-usage-stats",
    ]  # fmt: skip
    log = open(tmp / "head.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/version", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Ray head did not start: see {tmp / 'head.log'}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def ray_submit(bin_dir: Path, url: str, tree: Path) -> float:
    """`ray job submit --working-dir` of ``tree``, not waiting for the job; then waits
    (untimed) for the job to end, so it does not run beside the next measurement."""
    argv = [
        str(bin_dir / "ray"), "job", "submit", "--address", url, "--working-dir", str(tree),
        "--no-wait", "--", "python", "main.py",
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t
    m = re.search(r"(raysubmit_\w+)", r.stdout + r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"ray job submit failed ({r.returncode}): {r.stdout}{r.stderr}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/api/jobs/{m.group(1)}", timeout=10).json()
        if job.get("status") in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(0.2)
    return took


def zipped_size(tree: Path) -> int:
    """The tree zipped with deflate, as Ray packs a working_dir: what Ray sends."""
    with tempfile.TemporaryFile() as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(tree.rglob("*")):
                if path.is_file():
                    z.write(path, path.relative_to(tree))
        return f.tell()


def one_line_change(tree: Path) -> None:
    one = tree / "pkg0" / "sub0" / "mod0.py"
    one.write_bytes(one.read_bytes() + b"learning_rate = 3e-4\n")


def text_rounds(api: Api, backend: str, rounds: int, ray: tuple[Path, str] | None) -> None:
    """Steps 1-3 of the text tree, ``rounds`` times, ddpq and Ray alternating first."""
    times: dict[tuple[str, str], list[float]] = {}
    sent: dict[tuple[str, str], list[float]] = {}
    # Each side's first request of all is left out: a fresh Ray head sets up its
    # package store on its first job (seconds), a fresh API its connections.
    warm = Path(tempfile.mkdtemp(prefix="ddpq-bench-warm-"))
    (warm / "main.py").write_text(f"print('warm {backend}')\n")
    ddpq_submit(api, warm)
    if ray is not None:
        ray_submit(ray[0], ray[1], warm)
    shutil.rmtree(warm, ignore_errors=True)
    for r in range(rounds):
        tmp = Path(tempfile.mkdtemp(prefix="ddpq-bench-code-"))
        seed = (1000 if backend == "postgres" else 0) + r + 1  # nothing cached from before
        make_text_tree(tmp / "ddpq", TEXT_FILES, TEXT_MB, seed)
        shutil.copytree(tmp / "ddpq", tmp / "ray", symlinks=True)
        order = ["ddpq", "ray"] if r % 2 == 0 else ["ray", "ddpq"]
        for who in order:
            if who == "ray" and ray is None:
                continue
            tree = tmp / who
            for step in STEPS:
                if step == "one-line change":
                    one_line_change(tree)
                if who == "ddpq":
                    took, n = ddpq_submit(api, tree)
                else:
                    assert ray is not None
                    took = ray_submit(ray[0], ray[1], tree)
                    n = zipped_size(tree) if step != "identical resubmit" else 0
                times.setdefault((who, step), []).append(took)
                sent.setdefault((who, step), []).append(n)
            print(
                f"{backend}: round {r + 1}: {who}: "
                + ", ".join(f"{st} {times[(who, st)][-1]:.2f} s" for st in STEPS)
            )
        shutil.rmtree(tmp, ignore_errors=True)
    for (who, step), values in times.items():
        where = f"{who} ({backend})" if who == "ddpq" else "ray"
        print(
            f"{backend}: {where}: {step}: median {statistics.median(values):.2f} s "
            f"(rounds {', '.join(f'{v:.2f}' for v in values)}), "
            f"{human_bytes(statistics.median(sent[(who, step)]))} sent"
        )
    if ray is not None:
        for step in STEPS:
            ratios = [
                d / y for d, y in zip(times[("ddpq", step)], times[("ray", step)], strict=True)
            ]
            print(
                f"{backend}: {step}: ddpq / ray median {statistics.median(ratios):.2f} "
                f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})"
            )


@contextlib.contextmanager
def worker(api: Api, base: Path, job_uids: str) -> Iterator[None]:
    """A 2-slot CPU worker on ``api``, walled or not as ``--job-uids`` says."""
    base.mkdir(mode=0o711)
    (base / "workspace").mkdir()
    argv = [
        sys.executable, "-m", "ddpq.cli", "worker", "--url", api.url, "--name", base.name,
        "--workspace", str(base / "workspace"), "--data-dir", str(base / "data"),
        "--cpu-slots", "2", "--gpus", "none", "--job-uids", job_uids, "--log-level", "warning",
    ]  # fmt: skip
    env = child_env(DDPQ_WORKER_TOKEN=api.worker_token, PIP_NO_INDEX="1")
    proc = subprocess.Popen(argv, env=env, cwd=base)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def walls(pairs: int) -> None:
    """Step 4: a walled and an unwalled worker, each on an API of its own, the same job
    on each in turn."""
    if os.geteuid() != 0:
        raise SystemExit("--walls runs a walled worker: run it as root")
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import make_wheel  # the tests' wheel, built offline

    tmp = Path(tempfile.mkdtemp(prefix="ddpq-bench-walls-", dir="/var/tmp"))
    tmp.chmod(0o711)
    code = tmp / "code"
    code.mkdir()
    shutil.copy(REPO / "examples" / "ddp_plain.py", code / "train.py")
    make_wheel(code / "wheels")
    (code / "requirements.txt").write_text("./wheels/ddpqtestpkg-0.1-py3-none-any.whl\n")
    times: dict[str, list[float]] = {"walled": [], "unwalled": []}
    with contextlib.ExitStack() as stack:
        specs, clients = {}, {}
        for how, uids in (("walled", "72000-72099"), ("unwalled", "off")):
            url = stack.enter_context(database("sqlite"))
            api = stack.enter_context(serve(url))
            stack.enter_context(worker(api, tmp / how, uids))
            with Client(api.url, api.api_token) as c:
                snap = c.push_code(code).id
            specs[how] = {
                "entrypoint": "train.py", "code": snap, "world_size": 2, "device": "cpu",
                "args": ["--steps", "300"],
            }  # fmt: skip
            clients[how] = stack.enter_context(api.client())
            took, job = run_job(clients[how], specs[how])  # warm-up: cache and environment
            assert job["status"] == "succeeded", job
        retried = 0
        while len(times["walled"]) < pairs:
            i = len(times["walled"])
            order = ("walled", "unwalled") if i % 2 == 0 else ("unwalled", "walled")
            pair = {}
            for how in order:
                took, job = run_job(clients[how], specs[how])
                assert job["status"] == "succeeded", job
                pair[how] = (took, job["attempt"])
            if any(attempt > 1 for _, attempt in pair.values()):
                # torch 2.14 aborts at exit now and then (issue 31): the job ran twice.
                retried += 1
                continue
            for how, (took, _) in pair.items():
                times[how].append(took)
            print(
                f"walls: pair {i + 1}: walled {times['walled'][-1]:.2f} s, "
                f"unwalled {times['unwalled'][-1]:.2f} s"
            )
    ratios = [w / u for w, u in zip(times["walled"], times["unwalled"], strict=True)]
    print(
        f"walls: a 300-step 2-rank job with code and requirements, warm, POST to finished_at: "
        f"walled {statistics.median(times['walled']):.2f} s, unwalled "
        f"{statistics.median(times['unwalled']):.2f} s; walled / unwalled median "
        f"{statistics.median(ratios):.3f} (pairs {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"{retried} pair(s) left out: a job of it ran twice)"
    )
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--tree", choices=["text", "random"], default="text")
    ap.add_argument("--rounds", type=int, default=3, help="text tree: rounds, alternating")
    ap.add_argument("--ray", type=Path, help="text tree: a venv's bin/ with ray[default]")
    ap.add_argument("--files", type=int, default=2000, help="random tree")
    ap.add_argument("--mb", type=int, default=100, help="random tree")
    ap.add_argument("--walls", action="store_true", help="step 4 only: what walls cost")
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    if args.walls:
        walls(args.pairs)
        return
    if args.tree == "random":
        for backend in backends(args.backend):
            with database(backend) as url, serve(url) as api:
                run(api, backend, args.files, args.mb)
        return
    with contextlib.ExitStack() as stack:
        ray = None
        if args.ray is not None:
            ray = (args.ray, stack.enter_context(ray_head(args.ray)))
        else:
            print("ray: not measured (--ray DIR: a venv's bin/ holding ray[default])")
        for backend in backends(args.backend):
            with database(backend) as url, serve(url) as api:
                text_rounds(api, backend, args.rounds, ray)


if __name__ == "__main__":
    main()
