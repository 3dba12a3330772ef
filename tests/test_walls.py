"""Walls between jobs: one job attacks the job beside it and the jobs after it, the way a
hostile program would (tests/hostile_job.py), on a walled and on an unwalled worker.

The walled worker runs as root with only the capabilities the compose worker has
(`setpriv --bounding-set`: CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETUID, SETGID; no
SYS_PTRACE, so it finds a job's processes by uid, not by reading their environment),
and gives each attempt a uid of its own. The unwalled worker is root without any
capability: a plain user, as one person's `make run` is, whose jobs share its uid.

Walled, every attack is refused by the kernel. Unwalled, a job can write what its user
can (docs/security.md says what): but what a later job runs is still what its owner
sent, since the worker checks what it copies out of its cache against the digest, seals
the environments it builds, and never takes a directory it did not make this run.

These are host tests, not database tests: SQLite only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import site
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpq.client import Client
from tests.conftest import (
    REPO,
    Server,
    _child_env,
    start_server,
    stop_process,
    stop_server,
    terminal,
    wait_for,
    worker_argv,
)
from tests.helpers import make_wheel
from worker.edges import procs
from worker.walled.walls import Walls

# Minutes of real uids, pip builds and attacks: `make test-walls` runs these (CI does too),
# `make test` leaves them out for its 15 minutes.
pytestmark = pytest.mark.walls

# Not the default range (70000-70999): a `make run` worker on this host may be using it.
TEST_UIDS = "71000-71099"
COMPOSE_CAPS = "-all,+chown,+dac_override,+fowner,+kill,+setuid,+setgid"
# The content the attacker rewrites in the cache; the victim and the last job share it.
LIB = b'VALUE = "original"\n'
WHEEL = "wheels/ddpqtestpkg-0.1-py3-none-any.whl"
# The requirements of the job whose environment the attacker plants: an extra packaging
# lacks, so the worker builds an environment (one pip run, offline) it has not built yet.
PLANTED_PIP = ["packaging[ddpq-planted]"]


def open_the_way(path: Path) -> None:
    """Let other uids pass through every directory above ``path`` (o+x, never o+r): a
    walled job runs the Python and the checkout these tests run from, wherever CI put
    them (a clone under /root would be closed to every other user)."""
    for parent in reversed(Path(os.path.realpath(path)).parents):
        mode = os.stat(parent).st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(parent, stat.S_IMODE(mode) | stat.S_IXOTH)


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory job uids can reach (pytest's own are 0700)."""
    open_the_way(Path(sys.executable))
    open_the_way(REPO / "worker")
    base = Path(tempfile.mkdtemp(prefix="ddpq-walls-", dir="/var/tmp"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def start_host_worker(
    server: Server, base: Path, walled: bool, *extra: str
) -> tuple[subprocess.Popen[bytes], Path]:
    caps = COMPOSE_CAPS if walled else "-all"
    workspace, data = base / "workspace", base / "data"
    workspace.mkdir(exist_ok=True)
    argv = worker_argv(
        server, "host", workspace, data, "--cpu-slots", "2", "--gpus", "none",
        "--job-uids", TEST_UIDS if walled else "auto", *extra,
    )  # fmt: skip
    log = base / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["setpriv", f"--bounding-set={caps}", "--inh-caps=-all", "--", *argv],
            env=_child_env({"DDPQ_WORKER_TOKEN": server.worker_token, "PIP_NO_INDEX": "1"}),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=base,
        )
    return proc, log


def project(where: Path, files: dict[str, bytes]) -> Path:
    """A user's directory: the hostile program as main.py, and ``files``."""
    where.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "hostile_job.py", where / "main.py")
    for rel, data in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(data)
    return where


def submit(c: Client, root: Path, *args: str, **spec: Any) -> int:
    snap = c.push_code(root)
    job = c.submit({"entrypoint": "main.py", "args": list(args), "code": snap.id, **spec})
    return int(job["id"])


def log_of(c: Client, job_id: int) -> str:
    return c.logs(job_id)[0].decode(errors="replace")


def attacks(log: str) -> dict[str, str]:
    """ATTACK lines of a job's log: what -> 'done ...' or 'denied ...'."""
    found = {}
    for line in log.splitlines():
        if "ATTACK " in line:
            what, _, result = line.split("ATTACK ", 1)[1].partition(" ")
            found[what] = result
    return found


def run_scenario(
    url: str, admin_token: str, base: Path, signal: str, done: Callable[[], None], hop: bool
) -> dict[str, Any]:
    """Victim, attacker, then a job sharing the victim's content and environment, on the
    API at ``url``, whose admin (``admin_token``) makes two users: the victim's owner, who
    also sends the later job, and the attacker, each with a member token of its own. The
    jobs meet in ``signal`` (a directory every uid may write, where the workers are),
    where ``done()`` tells the victim the attacker is through. ``hop``: the attacker
    leaves a pid-hopping process behind (only where walls must kill it)."""
    with Client(url, admin_token) as admin:
        tokens = [admin.add_user(name)["token"] for name in ("victim", "attacker")]
    with Client(url, tokens[0]) as victim, Client(url, tokens[1]) as attacker:
        return _scenario(victim, attacker, base, signal, done, hop)


def _scenario(
    c: Client, them: Client, base: Path, signal: str, done: Callable[[], None], hop: bool
) -> dict[str, Any]:
    """``c`` is the victim's owner, ``them`` the attacker."""

    def ended(job_id: int) -> dict[str, Any]:
        return c.wait(job_id, timeout=300)

    # One wheel in both: a zip records when it was made, and the same content is the point.
    wheel = make_wheel(base / "wheel").read_bytes()
    reqs = {"requirements.txt": f"./{WHEEL}\n".encode(), WHEEL: wheel}
    victim_code = project(base / "victim", {"lib.py": LIB, **reqs})
    # Its owner's secret reaches its ranks' environment, and no other job's (issue 41).
    secret = f"victim-secret-{os.urandom(8).hex()}"
    c.set_secret("VICTIM_SECRET", secret)
    victim = submit(
        c, victim_code, "victim", signal, max_attempts=2, retry_on_error=True,
        secrets=["VICTIM_SECRET"],
    )  # fmt: skip

    def started() -> dict[str, Any] | None:
        job = c.job(victim)
        finished = job["status"] in ("failed", "cancelled", "succeeded")
        return job if finished or "VICTIM ready" in log_of(c, victim) else None

    job = wait_for(started, 300, "the victim to start", interval=0.5)
    assert "VICTIM ready" in log_of(c, victim), (job, log_of(c, victim))

    later = project(base / "later", {"lib.py": LIB, "other.txt": b"not the victim's\n", **reqs})
    plan = {
        "victim": victim,
        "next": victim + 2,
        "digest": hashlib.sha256(LIB).hexdigest(),
        "signal": signal,
        "next_snapshot": c.push_code(later).id,
        "hop": hop,
        "planted_pip": PLANTED_PIP,
    }
    # Its own requirement (so pip runs for it), and modules named as the worker's.
    hijack = (
        f"import os; open({signal!r} + '/hijacked-{{}}-{{}}'.format(__name__, os.getuid()), 'w')\n"
    )
    own_wheel = make_wheel(base / "attacker-wheel", name="ddpqattackpkg").read_bytes()
    attacker_files = {
        "requirements.txt": b"./wheels/ddpqattackpkg-0.1-py3-none-any.whl\n",
        "wheels/ddpqattackpkg-0.1-py3-none-any.whl": own_wheel,
        "worker/__init__.py": b"",
        "worker/launch.py": hijack.encode(),
        "pip/__init__.py": b"",
        "pip/__main__.py": hijack.encode(),
    }
    attacker = submit(them, project(base / "attacker", attacker_files), "attack", json.dumps(plan))
    attacker_job = them.wait(attacker, timeout=300)
    done()
    victim_job = ended(victim)
    assert (victim_job["owner"], attacker_job["owner"]) == ("victim", "attacker")
    checked = submit(c, later, "check", signal)
    assert checked == victim + 2
    own = submit(c, project(base / "own", {}), "own", signal, pip=PLANTED_PIP)
    attacker_log = log_of(them, attacker)
    return {
        "secret": secret,
        "victim": victim_job,
        "victim_log": log_of(c, victim),
        "victim_metrics": c.metrics(victim),
        "attacker": attacker_job,
        "attacks": {k: v for k, v in attacks(attacker_log).items() if k != "hopper"},
        "hopper": attacks(attacker_log).get("hopper"),
        "attacker_log": attacker_log,
        "checked": ended(checked),
        "checked_log": log_of(c, checked),
        "own": ended(own),
        "own_log": log_of(c, own),
    }


def assert_walls_held(seen: dict[str, Any], uids: range) -> None:
    """Every attack refused by the kernel, and every job ran what its owner sent."""
    tried = seen["attacks"]
    assert seen["attacker"]["status"] == "succeeded", seen["attacker_log"]
    assert set(tried) == {
        "cache", "envs", "planted-env", "plant", "token", "secret", "victim-dir", "retry-dir",
        "victim-checkpoints", "worker-code",
    }, seen["attacker_log"]  # fmt: skip
    assert seen["secret"] not in seen["attacker_log"]
    # The victim held its owner's secret, and the kernel refused the attacker's read of
    # the victim's environment itself: not a search that came back empty.
    digest = hashlib.sha256(seen["secret"].encode()).hexdigest()
    assert f"secret_sha256={digest}" in seen["victim_log"], seen["victim_log"]
    assert digest not in seen["attacker_log"], seen["attacker_log"]
    assert tried["secret"] == (
        "denied PermissionError: reading the victim's environ: Permission denied"
    ), tried
    assert "hijacked=[]" in seen["checked_log"], "the worker ran a job's module as its own"
    refused = {what: result for what, result in tried.items() if result.startswith("denied")}
    # 1. the content cache, 2. the shared environment, 3. the jobs' directory
    # 4. the victim's token and its owner's secret, 5. its directory and checkpoints,
    # 6. the worker's code
    assert refused == tried, f"walled, these attacks got through: {tried}"
    # A process that forks and exits over and over (never long at one pid) died with its
    # attempt: it no longer beats when a later job looks.
    assert seen["hopper"] and seen["hopper"].startswith("done"), seen["attacker_log"]
    quiet = json.loads(seen["checked_log"].split("hoppers_quiet_s=")[1].split(" cwd=")[0])
    assert quiet and min(quiet) > 1.0, f"the hopper still ran: quiet for {quiet} s"
    victim_log = seen["victim_log"]
    assert "VICTIM intact" in victim_log and "tampered" not in victim_log, victim_log
    assert seen["victim"]["status"] == "succeeded", victim_log
    # Its retry ran in the directory its first attempt left, which no other job could reach.
    assert seen["victim"]["attempt"] == 2 and "from an earlier attempt" in victim_log, victim_log
    assert "OWN interpreter ran" in seen["own_log"], seen["own_log"]
    assert not any(m["step"] == 999 for m in seen["victim_metrics"]), "posted as the victim"
    ran_as = [
        int(line.split("uid=")[1].split()[0])
        for line in seen["victim_log"].splitlines()
        if "VICTIM ready" in line
    ]
    assert ran_as and all(u in uids for u in ran_as), seen["victim_log"]
    checked = seen["checked_log"]
    assert seen["checked"]["status"] == "succeeded", checked
    assert "CHECK value=original magic=42" in checked and "PLANTED" not in checked, checked
    assert "reusing environment" in checked, "the walled environment was never touched"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Server]:
    # The victim's retry (hostile_job.py) need not wait out a backoff.
    db = f"sqlite:///{tmp_path / 'ddpq.db'}"
    s = start_server(db, tmp_path / "api", DDPQ_RETRY_BACKOFF_S="0")
    yield s
    stop_server(s)


def scenario_on(
    api: Server, base: Path, walled: bool, started: str, *extra: str
) -> tuple[dict[str, Any], str]:
    # Where `ddpq up` keeps the worker's token, its user's alone (0600; the worker itself
    # gets it in its environment here): an unwalled job can read it, a walled one cannot.
    (base / "var").mkdir(mode=0o700)
    (base / "var" / "worker-token").write_text(api.worker_token + "\n")
    (base / "var" / "worker-token").chmod(0o600)
    worker, worker_log = start_host_worker(api, base, walled, *extra)
    signal = base / "signal"
    signal.mkdir()
    signal.chmod(0o1777)  # every job uid writes its markers here
    try:
        wait_for(lambda: started in worker_log.read_text(), 60, "the worker to start")
        seen = run_scenario(
            api.url, api.api_token, base, str(signal), (signal / "attacker-done").touch, walled
        )
        return seen, worker_log.read_text()
    except AssertionError as exc:
        jobs = api.client().get("/jobs").json()["items"]
        logs = "\n".join(api.client().get(f"/jobs/{j['id']}/logs").text[-2000:] for j in jobs)
        raise AssertionError(f"{exc}\n{jobs}\n{logs}\n{worker_log.read_text()[-4000:]}") from None
    finally:
        stop_process(worker)


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "launcher", ["warm", pytest.param("torchrun", marks=pytest.mark.launchers)]
)
def test_walled_jobs_cannot_read_change_or_pose_as_each_other(
    api: Server, host_dir: Path, launcher: str
) -> None:
    # Warm: the ranks are forks of a warm process the worker started as its own user,
    # each dropped to its job's uid before any job code ran (worker.zygote).
    seen, log = scenario_on(api, host_dir, True, "jobs run walled", "--launcher", launcher)
    assert_walls_held(seen, range(71000, 71100))
    assert "killed" not in log and "survived" not in log, log


@pytest.mark.torchrun
def test_unwalled_jobs_cannot_change_what_later_jobs_run(api: Server, host_dir: Path) -> None:
    # A cold torchrun: its ranks show their environment in /proc/PID/environ. A warm one's
    # show the warm process's start instead, which hides the token from this attack but
    # is no wall (the rank's memory is its user's to read): the docs' worst case is this.
    seen, log = scenario_on(
        api, host_dir, False, "NOT walled from each other", "--launcher", "torchrun"
    )
    warning = [line for line in log.splitlines() if "NOT walled" in line]
    assert len(warning) == 1 and "docs/security.md" in warning[0], warning
    tried = seen["attacks"]
    # What docs/security.md ("An unwalled worker") says a job can do there, it did: read
    # the victim's token (and its owner's secret) from /proc and post as it (item 4), read
    # and write its directory
    # and checkpoints while it runs (5), write into the worker's code (6, a checkout its
    # user owns), and write the user's files the worker keeps (the cache, environments,
    # the jobs' directory, the worker's token in var/)...
    for what in (
        "cache", "envs", "planted-env", "plant", "token", "secret", "victim-dir", "retry-dir",
        "victim-checkpoints", "worker-code",
    ):  # fmt: skip
        assert tried[what].startswith("done"), (what, seen["attacker_log"])
    assert tried["token"] == "done posted as the victim: 202", tried
    digest = hashlib.sha256(seen["secret"].encode()).hexdigest()
    assert f"secret_sha256={digest}" in seen["victim_log"], seen["victim_log"]
    assert tried["secret"] == f"done read the victim's secret (sha256 {digest})", tried
    assert any(m["step"] == 999 for m in seen["victim_metrics"]), seen["victim_metrics"]
    assert (
        "VICTIM tampered out=\"the attacker's output\\n\" extra=['planted.bin']"
        in (seen["victim_log"])
    ), seen["victim_log"]
    # ...but no later job runs anything but what its owner sent: 1. the cached content is
    # checked after each copy, 2. the environment's seal is broken so it is built again,
    # a planted one is never trusted (a seal on disk is keyed with nothing a job can
    # read), 3. the planted directory is never taken for the job's, and the victim's retry
    # gets a fresh directory, its program having been rewritten.
    victim_log = seen["victim_log"]
    assert seen["victim"]["status"] == "succeeded", (seen["victim"]["reason"], victim_log[-6000:])
    assert seen["victim"]["attempt"] == 2, victim_log
    assert "HIJACKED" not in victim_log, victim_log
    assert "directory no longer holds its code as sent ('main.py')" in victim_log, victim_log
    assert "changed since it was built; building it again" in victim_log, victim_log
    checked = seen["checked_log"]
    assert seen["checked"]["status"] == "succeeded", (checked, log[-3000:])
    assert "CHECK value=original magic=42" in checked, checked
    assert "PLANTED" not in checked, checked
    ran = checked.split("pth=")[1].split("]")[0]
    for job in (seen["victim"], seen["checked"]):
        assert f"pth-ran-{job['id']}" not in ran, checked
    assert "was altered; fetching it again" in log, log[-3000:]
    own = seen["own_log"]
    assert seen["own"]["status"] == "succeeded" and "OWN interpreter ran" in own, own
    assert "PLANTED" not in own and "without a seal this worker can check" in own, own


MAGIC = "import ddpqtestpkg\nprint('MAGIC', ddpqtestpkg.MAGIC, flush=True)\n"


@pytest.mark.torchrun
def test_requirements_are_kept_to_names_and_the_jobs_own_files_and_keyed_by_content(
    api: Server, host_dir: Path
) -> None:
    """Items 10-12: a direct URL and a pip option are refused before pip runs, with the
    way to allow them; two jobs naming the same wheel path with different wheels each run
    their own (walled: pip runs under the job's uid)."""
    worker, worker_log = start_host_worker(api, host_dir, walled=True)
    c = Client(api.url, api.api_token)
    try:
        wait_for(lambda: "jobs run walled" in worker_log.read_text(), 60, "the worker to start")
        url = c.submit(
            {"recipe": "toy-regression", "pip": ["ddpqtestpkg @ http://elsewhere.invalid/x.whl"]}
        )
        optioned = host_dir / "optioned"
        optioned.mkdir()
        (optioned / "main.py").write_text(MAGIC)
        (optioned / "requirements.txt").write_text(
            "--index-url http://evil.invalid/simple\nddpqtestpkg\n"
        )
        option = submit(c, optioned)
        magics = []
        for magic in (42, 43):
            proj = host_dir / f"wheel-{magic}"
            proj.mkdir()
            (proj / "main.py").write_text(MAGIC)
            (proj / "requirements.txt").write_text(f"./{WHEEL}\n")
            make_wheel(proj / "wheels", magic=magic)
            magics.append(submit(c, proj))
        ended = {j: terminal(api.client(), j) for j in (url["id"], option, *magics)}
    finally:
        c.close()
        stop_process(worker)
    refused = ended[url["id"]]
    assert refused["status"] == "failed" and refused["attempt"] == 1, refused
    assert "pip[0]" in refused["reason"] and "--pip-allow url" in refused["reason"], refused
    refused = ended[option]
    assert refused["status"] == "failed" and refused["attempt"] == 1, refused
    assert "requirements.txt line 1" in refused["reason"], refused["reason"]
    assert "--pip-allow option" in refused["reason"], refused["reason"]
    for magic, job in zip((42, 43), magics, strict=True):
        log = api.client().get(f"/jobs/{job}/logs").text
        assert ended[job]["status"] == "succeeded", log
        assert f"[rank0]: MAGIC {magic}" in log and "building an environment" in log, log


# ---- the parts, without a worker ----------------------------------------------------------


def test_a_uid_is_one_attempts_at_a_time_on_the_whole_host(tmp_path: Path) -> None:
    """Two workers on one host (two Walls on one lock directory) never hand out the same
    uid at once; a job gets the uid its id points at when it is free."""
    first, second = (Walls((71100, 71109), tmp_path / "locks") for _ in range(2))
    with first.attempt(3) as a, second.attempt(3) as b:
        assert a.user is not None and b.user is not None
        assert a.user.uid == 71103 and b.user.uid == 71104
    with second.attempt(3) as again:
        assert again.user is not None and again.user.uid == 71103


SHM_PROGRAM = """
import ctypes, os, pathlib, sys, time
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
pathlib.Path(sys.argv[1]).write_text("left behind")
print(shmid, flush=True)
if os.fork() == 0:  # a daemon that outlives its parent
    os.setsid()
    time.sleep(600)
time.sleep(600)
"""


def test_a_swept_uid_leaves_no_process_file_or_shared_memory(tmp_path: Path) -> None:
    walls = Walls((71110, 71119), tmp_path / "locks")
    leftover = Path(tempfile.mkdtemp(dir="/var/tmp")) / "x"
    leftover.parent.chmod(0o1777)
    with walls.attempt(0) as held:
        user = held.user
        assert user is not None
        proc = subprocess.Popen(
            [sys.executable, "-c", SHM_PROGRAM, str(leftover)],
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert proc.stdout is not None
        shmid = int(proc.stdout.readline())
        assert shmid >= 0 and leftover.exists()
        wait_for(lambda: len(procs.find_by_uid(user.uid)) == 2, 10, "the daemon to fork")
    proc.wait(timeout=10)
    proc.stdout.close()
    assert procs.find_by_uid(user.uid) == [], "processes outlived the attempt"
    assert not leftover.exists(), "a file in a world-writable directory outlived it"
    shm = Path("/proc/sysvipc/shm").read_text().split()
    assert str(shmid) not in shm[shm.index("swap") + 1 :: 16], "its shared memory outlived it"
    leftover.parent.rmdir()


def test_taking_back_a_directory_never_hands_over_another_file(tmp_path: Path) -> None:
    """A hard link a job made to a file of someone else's (where fs.protected_hardlinks is
    off) is left alone when the worker gives the directory to the next uid."""
    walls = Walls((71120, 71129), tmp_path / "locks")
    job_dir = tmp_path / "job"
    (job_dir / "sub").mkdir(parents=True)
    (job_dir / "sub" / "mine.txt").write_text("the job's\n")
    secret = tmp_path / "root-only"
    secret.write_text("root's\n")
    os.link(secret, job_dir / "sub" / "linked")
    os.symlink("/etc/shadow", job_dir / "sub" / "link")
    with walls.attempt(0) as held:
        assert held.user is not None
        held.own(job_dir)
        assert (job_dir / "sub" / "mine.txt").stat().st_uid == held.user.uid
        assert os.lstat(job_dir / "sub" / "link").st_uid == held.user.uid
        assert secret.stat().st_uid == 0, "a hard-linked file was handed over"
        assert os.stat("/etc/shadow").st_uid == 0
    assert (job_dir / "sub" / "mine.txt").stat().st_uid == 0, "taken back"
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700


def python_behind(closed: Path) -> Path:
    """A Python with this environment's packages whose path runs through ``closed``: a
    venv there (its python a link to the interpreter every uid may run) whose site
    takes in this one's."""
    venv = closed / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    lib = next(venv.glob("lib/python*/site-packages"))
    (lib / "ddpq-tests.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
    )
    return venv / "bin" / "python"


def test_a_walled_worker_refuses_to_start_where_a_job_could_not_run_or_could_change_code(
    api: Server, tmp_path: Path, host_dir: Path
) -> None:
    """The start check: a workspace its jobs' uids cannot reach (pytest's directories are
    0700), then one holding a file any of them could rewrite, then a worker whose Python
    is behind a directory they cannot pass: the worker exits at once, naming the path
    and the fix, before it takes a job."""
    closed = tmp_path / "closed"
    closed.mkdir()
    opened = host_dir / "shared"
    opened.mkdir()
    (opened / "train.py").write_text("print('every job runs me')\n")
    (opened / "train.py").chmod(0o666)
    fine = host_dir / "fine"
    fine.mkdir()
    python = python_behind(closed)  # the way to it: pytest's tmp_path, 0700
    cases = [
        (closed, "cannot read", Path(sys.executable), closed),
        (opened, "could change", Path(sys.executable), opened),
        (fine, "cannot execute", python, python),
    ]
    for workspace, said, interpreter, named in cases:
        _, *args = worker_argv(
            api, "checked", workspace, host_dir / f"data-{said[:5]}",
            "--gpus", "none", "--job-uids", TEST_UIDS,
        )  # fmt: skip
        argv = [str(interpreter), *args]
        done = subprocess.run(
            ["setpriv", f"--bounding-set={COMPOSE_CAPS}", "--inh-caps=-all", "--", *argv],
            env=_child_env({"DDPQ_WORKER_TOKEN": api.worker_token}),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert said in done.stderr and str(named) in done.stderr, done.stderr
        assert said != "cannot execute" or "closed to other users" in done.stderr, done.stderr
        assert "--job-uids off" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert api.client().get("/workers").json()["items"] == [], "it never registered"
