"""The warm launcher, the worker's side (docs/jobs.md#the-warm-launcher): which launcher
an attempt uses, the warm processes (worker.zygote) this worker keeps, one per
(interpreter, environment), and how an attempt's supervisor (worker.launch) asks one for
its torchrun.

A job's spec says ``launcher: torchrun`` or ``warm``; without one, the worker's
``DDPQ_LAUNCHER`` decides: ``warm`` since it passed every test both kinds of worker (local
and Slurm bridge) run, with the probe of tests/test_warm.py seeing nothing it could tell
apart from torchrun beyond what docs/jobs.md lists. A job whose own ``env`` sets a variable
the interpreter or torch reads as it starts (PYTHON*, OMP_*, ...) runs under a cold torchrun
anyway: a warm process read those long before the job existed.

Each warm process holds torch in memory (a few hundred MB), so a worker keeps at most
``keep`` of them with no attempt running (its --max-envs, plus one for its own interpreter):
past that, the least recently used idle one stops. Their sockets live in directories named
after the worker's pid, so a worker killed without its clean-up (kill -9) leaves nothing
the next one does not sweep.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from ddpq.jobspec import ClaimedSpec
from worker import zygote
from worker.files.caches import CACHE_VARS
from worker.starting import torchrun

log = logging.getLogger("ddpq.worker")

LAUNCHERS = ("torchrun", "warm")
START_TIMEOUT_S = 120.0  # a zygote's own import of torch, on a loaded host
# A warm process handed to an attempt this recently is not idle yet: its attempt's
# supervisor may not have connected (and so have no fork of it) when another asks.
IDLE_AFTER_S = 60.0
DIR_PREFIX = "ddpq-warm-"
# Variables of a job's own env that a warm process would have read before the job: the
# interpreter's, the C libraries' thread pools and allocators, torch's, its compiler's
# (torch._dynamo and inductor read theirs into their configs as the warm process imports
# them: TORCHINDUCTOR_FREEZING set by a job was ignored), the locale. Not where the
# caches are (CACHE_VARS): read when a program first uses them.
READ_AT_START = (
    "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_", "LD_",
    "MALLOC_", "LC_", "LANG", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TRITON_",
)  # fmt: skip
# What the ranks' environment has that differs from one attempt to the next (never in a
# warm process's: ddpq's own, the job's scratch and identity, its GPUs).
# worker.starting.torchrun.environment sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE for the agent (read
# when it starts its rendezvous, not at import): the same warm process with it or without.
# Nor where the owner's caches are (worker.files.caches; read when a program first uses them).
PER_ATTEMPT = frozenset(
    {
        "TMPDIR", "HOME", "USER", "LOGNAME", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", *CACHE_VARS,
    }
)  # fmt: skip


def choose(spec: ClaimedSpec, default: str) -> tuple[str, str | None]:
    """The launcher an attempt uses, and when it is not the one asked for, why."""
    asked = spec.launcher or default
    if asked != "warm":
        return "torchrun", None
    own = _own_names(spec)
    read = sorted(k for k in own if k.startswith(READ_AT_START) and k not in CACHE_VARS)
    if read:
        return "torchrun", f"its env sets {', '.join(read)[:200]}, read as the interpreter starts"
    return "warm", None


def _own_names(spec: ClaimedSpec) -> set[str]:
    """The variables a job sets itself: its spec's env and its secrets (by name)."""
    return set(spec.env) | set(torchrun.secret_names(spec))


def zygote_env(env: Mapping[str, str], spec: ClaimedSpec, nproc: int) -> dict[str, str]:
    """A warm process's environment for ranks whose environment is ``env``: what of it the
    worker gives every job (the allow-list, the interpreter activated), never ddpq's own
    (the job's token), the job's own (its env, its secrets: a secret named HF_TOKEN would
    pass the allow-list, and a warm process's memory is every later job's) or the
    attempt's; OMP_NUM_THREADS as torchrun sets it for the ranks (before torch is
    imported: torch sizes its pool then)."""
    own = _own_names(spec)
    base = {
        k: v
        for k, v in env.items()
        if torchrun.inherited(k) and k not in own and k not in PER_ATTEMPT
    }
    if "OMP_NUM_THREADS" not in base and nproc > 1:
        base["OMP_NUM_THREADS"] = "1"
    base["PYTHONUNBUFFERED"] = "1"
    base[zygote.LAUNCH_ID_VAR] = zygote.PLACEHOLDER
    return base


def default_zygote_env(nproc: int = 2) -> dict[str, str]:
    """The warm process's environment for a job of the worker's own interpreter with no
    env of its own (what a worker with the warm launcher on starts ahead)."""
    inherited = {k: v for k, v in os.environ.items() if torchrun.inherited(k)}
    return zygote_env(inherited, ClaimedSpec(), nproc)


class WarmPool:
    """This worker's warm processes, started on first use (or ahead, by ``prestart``), each
    by a thread of its own that lives as long as it does (its death signal follows that
    thread), so the warm processes die with the worker. At most ``keep`` stay without an
    attempt: the least recently used idle ones stop when a new one starts."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self._lock = threading.Lock()
        # Least recently used first.
        self._zygotes: OrderedDict[tuple[str, tuple[tuple[str, str], ...]], _Zygote] = OrderedDict()
        sweep_stale(tempfile.gettempdir())

    def socket_for(self, python: str, env: dict[str, str]) -> str:
        """The socket of the warm process for ``python`` with ``env`` (worker.zygote),
        started if it is not running; waits for its imports."""
        key = (python, tuple(sorted(env.items())))
        with self._lock:
            z = self._zygotes.pop(key, None)
            if z is None or z.dead():
                z = _Zygote(python, env)
            z.used_at = time.monotonic()
            self._zygotes[key] = z
            self._trim()
        return z.ready()

    def _trim(self) -> None:
        """Stop the least recently used idle warm processes past ``keep`` (never the one
        just asked for, the last; one with an attempt's agent is not idle)."""
        over = len(self._zygotes) - self.keep
        for key, z in list(self._zygotes.items())[:-1]:
            if over <= 0:
                return
            if z.dead() or z.idle():
                z.stop()
                del self._zygotes[key]
                over -= 1

    def __len__(self) -> int:
        with self._lock:
            return sum(not z.dead() for z in self._zygotes.values())

    def prestart(self, python: str, env: dict[str, str]) -> None:
        threading.Thread(
            target=lambda: self._quietly(python, env), name="warm-prestart", daemon=True
        ).start()

    def _quietly(self, python: str, env: dict[str, str]) -> None:
        try:
            self.socket_for(python, env)
        except OSError as exc:
            log.warning("warm launcher: could not start (%s)", exc)

    def stop(self) -> None:
        with self._lock:
            for z in self._zygotes.values():
                z.stop()
            self._zygotes.clear()


def sweep_stale(tmp: str) -> None:
    """Remove the socket directories of warm processes whose worker is gone (killed
    without its clean-up: the warm process died with it, by its death signal), this
    user's only."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        pid = name[len(DIR_PREFIX) :].split("-", 1)[0]
        if not name.startswith(DIR_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(tmp, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid != os.geteuid():
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, "s"))
            os.rmdir(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _children(pid: int) -> bool:
    """Whether any process has ``pid`` for its parent (an attempt's agent is a fork of its
    warm process)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The parent's pid is the second field after the command's closing parenthesis
        # (a command may hold spaces and parentheses of its own).
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            return True
    return False


class _Zygote:
    def __init__(self, python: str, env: dict[str, str]) -> None:
        # A short path (a socket's has at most 107 bytes), in a directory of its own.
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        self.used_at = time.monotonic()
        os.chmod(self._dir, 0o700)
        self.path = os.path.join(self._dir, "s")
        self._python = python
        self._env = env
        self._ready = threading.Event()
        self._error: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="warm-zygote", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        argv = [self._python, "-u", "-P", "-m", "worker.zygote", self.path, str(os.getpid())]
        try:
            # cwd /: a warm process holds no job's directory; its forks move to theirs.
            self.proc = subprocess.Popen(
                argv, env=self._env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
            )
        except OSError as exc:
            self._error = str(exc)
            self._ready.set()
            return
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != zygote.READY:
            self._error = f"it exited with {self.proc.wait()} before it was ready"
        self._ready.set()
        self.proc.wait()  # this thread lives as long as the process: its death signal
        self.proc.stdout.close()  # (a worker outlives many: no fd per stopped one)
        self._remove()

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def ready(self) -> str:
        if not self._ready.wait(START_TIMEOUT_S) or self._error:
            raise OSError(f"the warm launcher did not start: {self._error or 'timed out'}")
        return self.path

    def dead(self) -> bool:
        return self._ready.is_set() and (self.proc is None or self.proc.poll() is not None)

    def idle(self) -> bool:
        """Ready, not handed out lately, and with no attempt's agent (no child)."""
        if not self._ready.is_set() or self.proc is None:
            return False
        if time.monotonic() - self.used_at < IDLE_AFTER_S:
            return False
        return not _children(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self._remove()


def python_version_ok() -> bool:
    """pidfds (Linux 5.3, Python 3.9) and socket fd passing the supervisor needs."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


def socket_for_attempt(
    pool: WarmPool | None,
    default: str,
    spec: ClaimedSpec,
    nproc: int,
    python: str,
    env: Mapping[str, str],
    say: Callable[[str], None],
) -> str | None:
    """The warm process's socket an attempt's torchrun is forked from, or None for a cold
    torchrun (the launcher chosen, or the warm one unavailable: the job's log says why)."""
    launcher, why = choose(spec, default)
    if launcher != "warm" or pool is None:
        if why:
            say(f"[ddpq] launcher: torchrun, not warm: {why}\n")
        return None
    try:
        return pool.socket_for(python, zygote_env(env, spec, nproc))
    except OSError as exc:
        log.warning("warm launcher unavailable: %s", exc)
        say(f"[ddpq] launcher: torchrun, not warm: {exc}\n")
        return None
