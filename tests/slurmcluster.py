"""A real one-node Slurm cluster for the tests: `ensure()` installs Debian's packages when
they are missing, writes /etc/slurm/slurm.conf, starts munged, slurmctld and slurmd when
they are not running, and waits until the node takes jobs. `Cluster` holds what the tests
use to submit, watch and cancel jobs.

Our slurm.conf carries MARKER; a slurm.conf without it is someone else's: it is never
overwritten, only used when the cluster it describes answers. Several pytest-xdist workers
may call `ensure()` at once: the set-up runs under an exclusive flock.

No slurmdbd: `sacct` knows nothing; ended jobs stay visible to `scontrol show job` for
MinJobAge (10 minutes).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "# written by ddpq tests/slurmcluster.py"
SLURM_CONF = Path("/etc/slurm/slurm.conf")
MUNGE_KEY = Path("/etc/munge/munge.key")
LOCK_FILE = Path("/run/ddpq-slurm.lock")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PARTITION = "debug"
STATE_SAVE = Path("/var/spool/slurmctld")
SLURMD_SPOOL = Path("/var/spool/slurmd")
LOG_DIR = Path("/var/log/slurm")
SLURMCTLD_PID = Path("/run/slurmctld.pid")
SLURMD_PID = Path("/run/slurmd.pid")
# Daemons and the Slurm commands live in sbin too, which a non-login PATH may lack.
SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"]
)
READY_STATES = {"idle", "mixed", "allocated", "completing"}
# Node states `scontrol update state=resume` gets out of (ReturnToService=2 handles plain
# "down" on its own once slurmd registers, but not a drain).
RESUMABLE = ("drain", "down", "fail")
TERMINAL = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
}  # fmt: skip


class SlurmSetupError(RuntimeError):
    """The one-node cluster could not be set up or reached."""


def _run(*argv: str, timeout: float = 30, check: bool = False) -> subprocess.CompletedProcess[str]:
    exe = shutil.which(argv[0], path=SEARCH_PATH) or argv[0]
    proc = subprocess.run(
        [exe, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise SlurmSetupError(
            f"{' '.join(argv)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _try(*argv: str, timeout: float = 15) -> subprocess.CompletedProcess[str] | None:
    """Run a command that may fail (daemon down, binary missing): None if it could not run."""
    try:
        return _run(*argv, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _poll(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Call ``predicate`` until it returns something truthy, which is returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise SlurmSetupError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# ---- installing -------------------------------------------------------------------------


def _missing_programs() -> list[str]:
    return [
        p
        for p in ("sbatch", "slurmctld", "slurmd", "munged")
        if not shutil.which(p, path=SEARCH_PATH)
    ]


def _install() -> None:
    if not _missing_programs():
        return
    if os.geteuid() != 0:
        raise SlurmSetupError(
            f"Slurm is not installed ({', '.join(_missing_programs())} missing) and installing "
            f"it needs root: apt-get install -y {' '.join(PACKAGES)}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        # A stale or absent package index: refresh it once and try again.
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SlurmSetupError(f"{' '.join(install)} failed:\n{proc.stdout}\n{proc.stderr}")
    if missing := _missing_programs():
        raise SlurmSetupError(f"installed {' '.join(PACKAGES)} but still missing: {missing}")


# ---- configuration ----------------------------------------------------------------------


def _real_memory_mb() -> int:
    """A bit less than MemTotal: slurmd drains a node that has less than RealMemory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return max(int(int(line.split()[1]) / 1024 * 0.95), 1)
    except (OSError, ValueError, IndexError):
        pass
    return 20000


def slurm_conf(node: str, cpus: int, memory_mb: int) -> str:
    """The slurm.conf the tests run with (one node, one partition, no accounting)."""
    return f"""\
{MARKER}
# A one-node cluster for ddpq's tests; rewritten by ensure() when this file carries the
# line above. Delete that line to keep your own changes.
ClusterName=ddpq-test
SlurmctldHost={node}
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# A submitted job starts at once (the default batch_sched_delay=3 may hold it 3 s).
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
# scancel: SIGTERM, then SIGKILL 3 s later.
KillWait=3
# No accounting storage (no sacct): ended jobs stay in `scontrol show job` for 10 minutes.
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
StateSaveLocation={STATE_SAVE}
SlurmdSpoolDir={SLURMD_SPOOL}
SlurmctldPidFile={SLURMCTLD_PID}
SlurmdPidFile={SLURMD_PID}
SlurmctldLogFile={LOG_DIR}/slurmctld.log
SlurmdLogFile={LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
NodeName={node} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _wanted_conf() -> str:
    return slurm_conf(
        socket.gethostname().split(".")[0], len(os.sched_getaffinity(0)), _real_memory_mb()
    )


def _write_conf() -> tuple[bool, bool]:
    """(ours, changed): write our slurm.conf unless a foreign one is there."""
    try:
        current: str | None = SLURM_CONF.read_text()
    except FileNotFoundError:
        current = None
    if current is not None and MARKER not in current:
        return False, False
    if os.geteuid() != 0:  # cannot write it; a running cluster may still do
        return True, False
    wanted = _wanted_conf()
    if current == wanted:
        return True, False
    SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
    tmp = SLURM_CONF.with_name(".slurm.conf.ddpq-tmp")
    tmp.write_text(wanted)
    tmp.chmod(0o644)
    tmp.replace(SLURM_CONF)
    return True, True


def _prepare_dirs() -> None:
    for d in (STATE_SAVE, SLURMD_SPOOL, LOG_DIR):
        d.mkdir(parents=True, exist_ok=True)
    munge = pwd.getpwnam("munge")
    run_munge = Path("/run/munge")
    run_munge.mkdir(parents=True, exist_ok=True)
    os.chown(run_munge, munge.pw_uid, munge.pw_gid)
    for d in (Path("/var/log/munge"), Path("/var/lib/munge")):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, munge.pw_uid, munge.pw_gid)
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        os.chown(MUNGE_KEY.parent, munge.pw_uid, munge.pw_gid)
        MUNGE_KEY.parent.chmod(0o700)
        if shutil.which("mungekey", path=SEARCH_PATH):
            _run("mungekey", "--create", "--keyfile", str(MUNGE_KEY), check=True)
        else:  # dd if=/dev/urandom, readable by nobody else from the start
            fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(1024))
        os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
        MUNGE_KEY.chmod(0o400)


# ---- daemons ----------------------------------------------------------------------------


def _munge_up() -> bool:
    proc = _try("munge", "-n", timeout=5)
    return proc is not None and proc.returncode == 0


def _slurmctld_up() -> bool:
    proc = _try("scontrol", "ping", timeout=15)
    return proc is not None and proc.returncode == 0 and "is UP" in proc.stdout


def _slurmd_up() -> bool:
    proc = _try("scontrol", "show", "slurmd", timeout=15)
    return proc is not None and proc.returncode == 0 and "Slurmd PID" in proc.stdout


def _daemon_env() -> dict[str, str]:
    return {"PATH": SEARCH_PATH, "LANG": "C.UTF-8"}


def _start(argv: list[str], user: str | None = None) -> None:
    """Start a daemon that forks into the background; its early errors go to a temporary
    file, not a pipe (the daemon's child could hold a pipe open)."""
    exe = shutil.which(argv[0], path=SEARCH_PATH) or argv[0]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.run(
            [exe, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_daemon_env(),
            cwd="/",
            start_new_session=True,
            timeout=60,
            user=user,
            group=user,
            extra_groups=[] if user else None,
        )
        if proc.returncode != 0:
            out.seek(0)
            text = out.read().decode(errors="replace").strip()
            raise SlurmSetupError(f"{' '.join(argv)} exited {proc.returncode}: {text}")


def _pids(name: str) -> list[int]:
    """The live processes called ``name`` (not zombies: this machine's init may be slow to
    reap the parent a daemon leaves behind when it forks into the background)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, _, rest = text.partition("(")[2].rpartition(")")
        if comm == name and rest.split()[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _stop(name: str, timeout: float = 20) -> None:
    """SIGTERM a daemon (found by its exact name, then signalled by pid) and wait for it."""
    pids = _pids(name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)

    def gone() -> bool:
        return not set(pids) & set(_pids(name))

    _poll(gone, timeout, f"{name} to exit")


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start_daemons(restart: bool) -> None:
    if os.geteuid() != 0:
        raise SlurmSetupError("the Slurm daemons are not running and starting them needs root")
    _prepare_dirs()
    if restart:  # our slurm.conf changed under running daemons
        _stop("slurmd")
        _stop("slurmctld")
    if not _munge_up():
        if not _pids("munged"):
            _start(["munged"], user="munge")
        _poll(_munge_up, 20, "munged to answer (munge -n)")
    if not _slurmctld_up():
        if not _pids("slurmctld"):
            _start(["slurmctld", "-i"])
        try:
            _poll(_slurmctld_up, 30, "slurmctld to answer scontrol ping", interval=0.2)
        except SlurmSetupError as exc:
            raise SlurmSetupError(
                f"{exc}\n{LOG_DIR}/slurmctld.log:\n{_log_tail(LOG_DIR / 'slurmctld.log')}"
            ) from None
    if not _slurmd_up():
        if not _pids("slurmd"):
            _start(["slurmd"])
        try:
            _poll(_slurmd_up, 30, "slurmd to answer scontrol show slurmd", interval=0.2)
        except SlurmSetupError as exc:
            raise SlurmSetupError(
                f"{exc}\n{LOG_DIR}/slurmd.log:\n{_log_tail(LOG_DIR / 'slurmd.log')}"
            ) from None


# ---- the node ---------------------------------------------------------------------------


def _nodes() -> list[tuple[str, str, int, str]]:
    """(node, partition, cpus, state) per node and partition; partition ends in * if default."""
    proc = _try("sinfo", "-h", "-N", "-o", "%N|%P|%c|%T", timeout=15)
    if proc is None or proc.returncode != 0:
        return []
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            rows.append((parts[0], parts[1], int(parts[2]), parts[3]))
    return rows


def _base_state(state: str) -> str:
    """'idle*' (not responding), 'drained~' ... -> the state word."""
    return state.rstrip("*~#!%$@^-+").lower()


def _wait_ready(node_name: str | None, timeout: float) -> tuple[str, str, int]:
    """Poll until the node takes jobs; resume it when an earlier run left it down or drained."""
    last_resume = 0.0
    seen: list[tuple[str, str, int, str]] = []

    def ready() -> tuple[str, str, int] | None:
        nonlocal last_resume, seen
        seen = [r for r in _nodes() if node_name is None or r[0] == node_name]
        if not seen:
            return None
        default = [r for r in seen if r[1].endswith("*")] or seen
        node, partition, cpus, state = default[0]
        base = _base_state(state)
        if base in READY_STATES and not state.endswith("*"):
            return node, partition.rstrip("*"), cpus
        if any(word in base for word in RESUMABLE) and time.monotonic() - last_resume > 2:
            last_resume = time.monotonic()
            _try("scontrol", "update", f"nodename={node}", "state=resume")
        return None

    try:
        result: tuple[str, str, int] = _poll(ready, timeout, "the Slurm node to be idle", 0.2)
    except SlurmSetupError as exc:
        reason = _try("sinfo", "-R")
        raise SlurmSetupError(
            f"{exc}: sinfo says {seen}; {reason.stdout.strip() if reason else ''}\n"
            f"{LOG_DIR}/slurmd.log:\n{_log_tail(LOG_DIR / 'slurmd.log')}"
        ) from None
    return result


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    path = (
        LOCK_FILE
        if os.access(LOCK_FILE.parent, os.W_OK)
        else Path(tempfile.gettempdir()) / LOCK_FILE.name
    )
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure(timeout: float = 90) -> Cluster:
    """The running one-node cluster: installed, configured and started as needed."""
    with _lock():
        _install()
        ours, changed = _write_conf()
        if not ours:
            # Someone else's slurm.conf: use their cluster if it answers, never touch it.
            if not (_munge_up() and _slurmctld_up()):
                raise SlurmSetupError(
                    f"{SLURM_CONF} was not written by ddpq's tests (no line {MARKER!r}) and "
                    "the cluster it describes does not answer `scontrol ping`: start that "
                    f"cluster, or move {SLURM_CONF} away to let the tests write their own"
                )
            node, partition, cpus = _wait_ready(None, timeout)
            return Cluster(node, partition, cpus)
        node_name = socket.gethostname().split(".")[0]
        if changed or not (_munge_up() and _slurmctld_up() and _slurmd_up()):
            _start_daemons(restart=changed)
        node, partition, cpus = _wait_ready(node_name, timeout)
        return Cluster(node, partition, cpus)


# ---- jobs -------------------------------------------------------------------------------

_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


def parse_fields(line: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {field: value} (values may hold spaces)."""
    matches = list(_FIELD.finditer(line))
    out: dict[str, str] = {}
    for m, nxt in zip(matches, [*matches[1:], None], strict=True):
        out[m.group(1)] = line[m.end() : nxt.start() if nxt else len(line)].strip()
    return out


@dataclass
class Cluster:
    node: str
    partition: str
    cpus: int

    @property
    def user(self) -> str:
        return pwd.getpwuid(os.getuid()).pw_name

    def sbatch_wrap(self, cmd: str, *extra_args: str) -> str:
        """Submit ``cmd`` as a batch job; returns its id. Its output goes to /dev/null
        unless ``extra_args`` name an --output (the later option wins)."""
        proc = _run("sbatch", "--parsable", "--output=/dev/null", *extra_args, f"--wrap={cmd}")
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str] | None:
        """`scontrol show job -o` as {field: value}; None once Slurm forgot the job."""
        proc = _run("scontrol", "show", "job", "-o", str(job_id))
        if proc.returncode != 0 or not proc.stdout.strip():
            if "Invalid job id" in proc.stderr:
                return None
            raise RuntimeError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
        return parse_fields(proc.stdout.splitlines()[0])

    def state(self, job_id: str) -> str | None:
        fields = self.job(job_id)
        return fields.get("JobState") if fields else None

    def wait_state(self, job_id: str, states: str | Iterable[str], timeout: float = 30) -> str:
        """Poll until the job is in one of ``states``; fail at once if it ended otherwise."""
        wanted = {states} if isinstance(states, str) else set(states)
        last: list[str | None] = [None]

        def reached() -> str | None:
            state = last[0] = self.state(job_id)
            if state in wanted:
                return state
            if state in TERMINAL:
                raise AssertionError(
                    f"job {job_id} ended {state}, not {sorted(wanted)}: {self.job(job_id)}"
                )
            return None

        deadline = time.monotonic() + timeout
        while True:
            if state := reached():
                return state
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"job {job_id} not {sorted(wanted)} after {timeout:g}s (last: {last[0]})"
                )
            time.sleep(0.1)

    def scancel(self, job_id: str, *extra_args: str) -> None:
        _run("scancel", *extra_args, str(job_id), check=True)

    def ids_by_name(self, name: str) -> list[str]:
        """The ids of the queued or running jobs called ``name`` (squeue forgets ended ones)."""
        proc = _run("squeue", "-h", "-n", name, "-o", "%i", check=True)
        return proc.stdout.split()

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job of this user and wait until squeue lists none."""
        _run("scancel", "-u", self.user, check=True)

        def empty() -> bool:
            return not _run("squeue", "-h", "-u", self.user, "-o", "%i", check=True).stdout.strip()

        _poll(empty, timeout, f"squeue -u {self.user} to be empty", 0.1)
