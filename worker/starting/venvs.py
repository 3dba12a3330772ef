"""Per-job Python requirements: a virtualenv layered on the worker's own environment.

A job whose code has a requirements.txt at its top, or whose spec lists ``pip``
requirements, runs under a virtualenv made for exactly those requirements and this
worker's Python, built once and shared by every job that needs the same (DATA_DIR/venvs,
at most ``max_envs`` kept, least recently used first out). What a job may ask pip for
is worker.starting.requirements' to decide; "the same" means the same content: names and
version specifiers as written, and a wheel or directory of the job's code by its
digest, never by its path (two jobs naming ./dist/x.whl may hold different wheels).

An environment is shared, so no job may change what the next one runs in it. Walled
(worker.walled.walls), pip runs under the building attempt's uid, and the environment then
becomes the worker's, read-only to every job. Walled or not, the worker seals it when
built (worker.walled.seal: every entry's inode, mode, owner, size and ctime, which no process
can set back) and checks the seal each time a job is to use it: one a job changed is put
aside and built again. An environment's name is its key, which any job can work out, so
what is on disk under it is trusted only through a seal no job could have made: the
seal is kept in memory, and on disk only keyed (HMAC) with a key no job can read.
Walled, that key is a file of the worker's alone (KEY_FILE, 0600; jobs run under other
uids), so a restarted worker trusts what it built before. Unwalled, no file of the
worker's is out of a job's reach (nor is the worker's token, in var/worker-token under
`ddpq up`), so nothing on disk is trusted: an environment from before the worker started
is built again when first used (a rebuild per restart, which costs a pip run; trusting
one would let a job plant the interpreter the next job with those requirements runs).

The new environment sees the worker's packages through a .pth file that adds the
worker's site-packages after its own (``python -m venv --system-site-packages`` run from
a venv would expose the *base* interpreter's packages, not the worker's: torch would be
missing). So torch stays the worker's pinned build: pip finds it installed, and a
constraints file pins it (and torchvision, torchaudio) to the worker's versions, so a
requirement for another torch fails the build instead of installing a second one.

pip runs with the allow-listed environment jobs get plus the worker's PIP_* settings
(the package index comes from the worker's configuration), in the job's directory. The
job's log gets one line of it, what pip installed, unless the build fails: then all of
pip's output, and the job fails with pip's error.

Requirements the worker's own environment already satisfies (project names whose
installed versions their specifiers allow: ``torch>=1.11``) build nothing: pip would
install nothing, and the job runs under the worker's interpreter (``satisfied``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import hmac
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import signal
import site
import stat
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as Pep508
from packaging.version import InvalidVersion

from ddpq.errors import JobError, RequirementsRefused, Stopped
from ddpq.jobspec import ClaimedSpec
from worker.edges import procs
from worker.starting import launcher, requirements
from worker.starting.requirements import Requirement
from worker.starting.torchrun import inherited
from worker.walled.seal import seal as seal_tree
from worker.walled.walls import Walls

log = logging.getLogger("ddpq.worker")

READY = ".ddpq-ready"
SEAL = ".ddpq-seal"
KEY_FILE = ".ddpq-seal-key"  # walled: what the seals on disk are keyed with, the worker's alone
STALE = ".stale-"  # an environment a job changed, put aside until no job uses it
PINNED = ("torch", "torchvision", "torchaudio")  # never replaced by a job's requirements
PIP_TIMEOUT_S = 3600.0
PIP_GRACE_S = 10.0  # SIGTERM to SIGKILL when a build is stopped
PIP_LOG_LINES = 2000  # of pip's output, shown in the job's log when the build fails

# How a build's directory is lent to the uid pip runs under, for the build: the context
# gives that uid (None: the worker's own). Walled, the attempt's Held.lend (worker.walled.walls)
# gives it, kills what pip left and takes it back; unwalled, nothing changes.
Lend = Callable[[Path], contextlib.AbstractContextManager[int | None]]


def unwalled(path: Path) -> contextlib.AbstractContextManager[int | None]:
    """A build under the worker's own uid: nothing is lent."""
    return contextlib.nullcontext(None)


def _pins() -> list[str]:
    pins = []
    for name in PINNED:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            pins.append(f"{name}=={importlib.metadata.version(name)}")
    return pins


class Venvs:
    def __init__(
        self,
        root: Path,
        max_envs: int,
        walls: Walls | None = None,
        policy: requirements.Policy | None = None,
    ) -> None:
        self.root = root
        self.max_envs = max_envs
        self.walls = walls or Walls(None)
        self.policy = policy or requirements.Policy()
        self.root.mkdir(parents=True, exist_ok=True)
        # What a seal on disk is keyed with (None, unwalled: no seal on disk is trusted).
        self.seal_key = _seal_key(self.root / KEY_FILE, self.walls.walled)
        for stale in [*self.root.glob(f"{STALE}*"), *self.root.glob(".inputs-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._in_use: Counter[str] = Counter()
        self._seals: dict[str, str] = {}  # key -> the seal of what was built
        self.pins = _pins()

    def key(self, reqs: list[Requirement]) -> str:
        """One environment per distinct content to install and worker Python."""
        basis = {
            "python": sys.version,
            "prefix": sys.prefix,
            "site": site.getsitepackages(),
            "pins": self.pins,
            "requirements": requirements.basis(reqs),
        }
        return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def using(
        self,
        reqs: list[Requirement],
        cwd: Path,
        environ: Mapping[str, str],
        say: Callable[[str], None],
        stop: threading.Event,
        lend: Lend = unwalled,
    ) -> Iterator[Path]:
        """The Python of an environment with these requirements, built if need be (pip
        under the uid ``lend`` lends its directory to, walled); it is not evicted while
        the block runs."""
        key = self.key(reqs)
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
            self._in_use[key] += 1
        try:
            with building:  # a second job needing the same environment waits for one build
                env_dir = self.root / key
                if (env_dir / READY).is_file() and self._intact(key, env_dir, say):
                    os.utime(env_dir / READY)
                    say(f"[ddpq] requirements: reusing environment {key[:12]}\n")
                else:
                    self._build(key, env_dir, reqs, cwd, environ, say, stop, lend)
            self._trim()
            yield env_dir / "bin" / "python"
        finally:
            with self._lock:
                self._in_use[key] -= 1

    def _intact(self, key: str, env_dir: Path, say: Callable[[str], None]) -> bool:
        """The environment is as it was built; if not, it is put aside (a job may still
        run in it) for a new build."""
        actual = seal(env_dir)
        known = self._seals.get(key)
        mac = self._mac(actual)
        if known is None and mac and _read(env_dir / SEAL) == mac:
            known = actual  # built before this process started: its seal on disk holds
        if known == actual:
            self._seals[key] = actual
            return True
        why = "changed since it was built" if known else "without a seal this worker can check"
        say(f"[ddpq] requirements: environment {key[:12]} is {why}; building it again\n")
        if known:
            log.warning("environment %s was changed after it was built: rebuilt", key)
        _put_aside(env_dir)
        return False

    def _build(
        self,
        key: str,
        env_dir: Path,
        reqs: list[Requirement],
        cwd: Path,
        environ: Mapping[str, str],
        say: Callable[[str], None],
        stop: threading.Event,
        lend: Lend,
    ) -> None:
        self._seals.pop(key, None)
        _put_aside(env_dir)  # what a crashed or refused build left
        what = ", ".join(r.text for r in reqs)
        say(f"[ddpq] requirements: building an environment for {what[:300]}\n")
        # pip reads the worker's own copy of what was asked, never the job's file (it
        # would follow -r, -c and options written there), beside the pins and the wheels
        # it names, where the build (walled: under the job's uid) can read and not change
        # them; pip runs there too, not in the job's directory.
        inputs = self.root / f".inputs-{key}-{secrets.token_hex(4)}"
        inputs.mkdir()
        inputs.chmod(0o755)  # read by the build (walled: the job's uid); the umask may be 077
        try:
            constraints = inputs / "constraints.txt"
            constraints.write_text("".join(f"{p}\n" for p in self.pins))
            wanted = inputs / "requirements.txt"
            wanted.write_text("".join(f"{line}\n" for line in _frozen(reqs, inputs)))
            for f in (constraints, wanted):
                f.chmod(0o644)
            self._new_env(env_dir)
            # -I: pip must import the worker's pip, never a pip/ or a .pth of the job's.
            argv = [
                sys.executable, "-I", "-m", "pip", "--python", str(env_dir / "bin" / "python"),
                "install", "--no-input", "--disable-pip-version-check", "--progress-bar", "off",
                "-c", str(constraints), "-r", str(wanted),
            ]  # fmt: skip
            # Walled, nothing pip started may stay behind to change the environment later:
            # the lend ends with the uid's processes killed and the directory taken back.
            with lend(env_dir) as uid:
                self._pip(argv, inputs, _pip_env(environ), say, stop, uid)
        finally:
            shutil.rmtree(inputs, ignore_errors=True)
        _read_only(env_dir)
        (env_dir / READY).touch()
        sealed = seal(env_dir)
        (env_dir / SEAL).write_text(self._mac(sealed) + "\n")
        self._seals[key] = sealed

    def _new_env(self, env_dir: Path) -> None:
        """A virtualenv of this worker's Python that also sees the worker's packages."""
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(env_dir)],
            check=True,
            capture_output=True,
        )
        where = "import sysconfig; print(sysconfig.get_path('purelib'))"
        purelib = Path(
            subprocess.run(
                [str(env_dir / "bin" / "python"), "-I", "-c", where],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        # addsitedir, not a bare path line: the worker's own .pth files (editable
        # installs among them) are processed too.
        lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
        (purelib / "_ddpq_worker_site.pth").write_text("\n".join(lines) + "\n")

    def _mac(self, sealed: str) -> str:
        """The seal as written to disk: keyed with what no job can read (_seal_key), so a
        job that changed or planted an environment cannot write the seal that would match
        ("" unwalled: no seal on disk is trusted)."""
        if self.seal_key is None:
            return ""
        return hmac.new(self.seal_key, sealed.encode(), hashlib.sha256).hexdigest()

    def _pip(
        self,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        say: Callable[[str], None],
        stop: threading.Event,
        uid: int | None,
    ) -> None:
        # Through the launcher, as torchrun: under the job's uid when walled, without
        # gaining a privilege by exec, and with nothing it started left after it.
        proc = subprocess.Popen(
            launcher.launcher_argv(argv, PIP_GRACE_S, uid, uid),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        # A cancel (or a shutdown) while pip runs stops pip and what it spawned.
        watcher = threading.Thread(target=_stop_on, args=(stop, proc), daemon=True)
        watcher.start()
        errors: list[str] = []
        # Kept, not passed on: the log gets pip's summary, or all of it when it fails.
        output: collections.deque[str] = collections.deque(maxlen=PIP_LOG_LINES)
        installed = ""
        with proc.stdout:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                output.append(line)
                if line.startswith("ERROR:"):
                    errors.append(line.removeprefix("ERROR:").strip())
                elif line.startswith("Successfully installed "):
                    installed = line
        code = proc.wait(timeout=PIP_TIMEOUT_S)
        if stop.is_set():
            raise Stopped()
        if code != 0:
            say("".join(f"[pip] {line}\n" for line in output))
            why = errors[0] if errors else f"pip exited with code {code}"
            raise JobError(f"installing the job's requirements failed: {why[:400]}")
        say(f"[pip] {installed or 'nothing to install: every requirement already satisfied'}\n")

    def _trim(self) -> None:
        """Keep at most max_envs built environments: the least recently used go first,
        never one a job is using (nor one put aside while its key is in use)."""
        with self._lock:
            busy = {k for k, n in self._in_use.items() if n > 0}
        built = []
        for d in self.root.iterdir():
            if d.name.startswith(STALE):
                if d.name.removeprefix(STALE).split(".")[0] not in busy:
                    shutil.rmtree(d, ignore_errors=True)
                continue
            if d.name.startswith("."):  # a build's inputs, the seals' key
                continue
            with contextlib.suppress(FileNotFoundError):
                built.append(((d / READY).stat().st_mtime, d))
        extra = len(built) - self.max_envs
        for _, d in sorted(built):
            if extra <= 0:
                break
            if d.name not in busy:
                shutil.rmtree(d, ignore_errors=True)
                self._seals.pop(d.name, None)
                extra -= 1


def seal(env_dir: Path) -> str:
    """What an environment is (worker.walled.seal), but the marks the worker itself touches."""
    return seal_tree(env_dir, skip=(READY, SEAL))


def _seal_key(path: Path, walled: bool) -> bytes | None:
    """The key of the seals on disk: walled, a random one in a file only the worker
    may read (made now if there is none, or if what is there is not the worker's alone:
    then every seal from before fails and what it sealed is built again). Unwalled,
    none: every job could read such a file, as it could the worker's token in
    var/worker-token. A key left by a walled run on this data directory goes before any
    job runs here unwalled, which could read it and plant what a later walled run would
    trust."""
    if not walled:
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            key = f.read(64)
        mine = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        if mine and not st.st_mode & 0o077 and len(key) == 32:
            return key
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(key)
    return key


def _frozen(reqs: list[Requirement], inputs: Path) -> list[str]:
    """pip's lines, each file of the job's code it names copied first beside them and
    checked against the digest the environment is keyed by: a job of the same user
    could otherwise swap the wheel between the hashing and pip, and every later job
    keyed by the first wheel would run the second."""
    frozen = []
    for n, r in enumerate(reqs):
        if r.path is not None and r.digest is not None and r.key.startswith("file "):
            copy = inputs / str(n) / r.path.name
            copy.parent.mkdir()
            copy.parent.chmod(0o755)  # read by the build
            h = hashlib.sha256()
            with open(r.path, "rb") as src, open(copy, "wb") as dst:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
            copy.chmod(0o644)
            if h.hexdigest() != r.digest:
                raise JobError(f"{r.where}: {r.path.name} changed while its environment was built")
            r = dataclasses.replace(r, line=str(copy) + r.line[len(str(r.path)) :])
        frozen.append(r)
    return requirements.pip_lines(frozen)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_only(env_dir: Path) -> None:
    """Readable by every job, writable by none but the worker."""
    for root, dirs, files in os.walk(env_dir):
        for name in [*dirs, *files]:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    continue
                mode = stat.S_IMODE(st.st_mode) & ~0o022 | 0o444
                if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o100:
                    mode |= 0o111
                os.chmod(path, mode)
    os.chmod(env_dir, 0o755)  # noqa: S103 - every job reads it, none writes


def _put_aside(env_dir: Path) -> None:
    """Move an environment out of the way (a job may still run in it; it goes once no
    job of its key does)."""
    if os.path.lexists(env_dir):
        aside = env_dir.with_name(f"{STALE}{env_dir.name}.{secrets.token_hex(4)}")
        os.rename(env_dir, aside)


def python_for(
    venvs: Venvs,
    spec: ClaimedSpec,
    cwd: Path,
    env: Mapping[str, str],
    say: Callable[[str], None],
    stop: threading.Event,
    lend: Lend = unwalled,
) -> contextlib.AbstractContextManager[str]:
    """The interpreter a job runs under, held while the block runs: this process's own,
    or one with the job's requirements (requirements.txt at the top of its code, or the
    spec's pip list), built if need be. Requirements this worker does not install are
    refused (JobError) before pip runs."""
    try:
        reqs = requirements.read(cwd if spec.code else None, list(spec.pip), venvs.policy)
    except RequirementsRefused as exc:
        raise JobError(f"requirements refused: {exc}") from None
    if not reqs:
        return contextlib.nullcontext(sys.executable)
    if satisfied(reqs):
        what = ", ".join(r.text for r in reqs)
        say(
            f"[ddpq] requirements: the worker's environment already has {what[:300]}; "
            "no environment built\n"
        )
        return contextlib.nullcontext(sys.executable)
    return _as_str(venvs.using(reqs, cwd, env, say, stop, lend))


# Distributions of the worker's own environment (ddpq's CLI's) that change what a job does
# by being installed: Lightning, seeing rich, draws a Rich progress bar, which writes nothing
# to a log until the run ends. A job's importlib.metadata does not find them unless its
# requirements name them (worker.entry hides them; an import of one still works). ddpq's
# other packages (typer, httpx, PyYAML, pathspec) change nothing a framework does: seen.
HIDDEN_UNLESS_ASKED = ("rich",)


def hidden_distributions(spec: ClaimedSpec, cwd: Path, policy: requirements.Policy) -> list[str]:
    """Which of HIDDEN_UNLESS_ASKED a job's ranks do not see installed: those its
    requirements (requirements.txt, the spec's pip list) do not name."""
    try:
        reqs = requirements.read(cwd if spec.code else None, list(spec.pip), policy)
    except RequirementsRefused:
        return list(HIDDEN_UNLESS_ASKED)  # the job will not start: python_for says why
    asked = set()
    for r in reqs:
        if r.kind != "name":
            continue
        try:
            asked.add(_canonical(Pep508(r.line).name))
        except InvalidRequirement:
            continue
    return [d for d in HIDDEN_UNLESS_ASKED if _canonical(d) not in asked]


def _canonical(name: str) -> str:
    return "-".join(name.lower().replace("_", "-").replace(".", "-").split("-"))


def satisfied(reqs: list[Requirement]) -> bool:
    """Whether the worker's own environment already satisfies every requirement, as pip
    would find it: each a project name (no file, URL, option, hash or extras) that is
    installed at a version its specifiers allow (pre-releases too, as pip allows an
    installed one), or whose marker leaves it out here. Then pip would install nothing."""
    for r in reqs:
        if r.kind != "name" or "--hash" in r.line:
            return False
        try:
            req = Pep508(r.line)
            if req.marker is not None and not req.marker.evaluate():
                continue
            if req.extras:  # what an extra pulls in is not checked here: pip decides
                return False
            version = importlib.metadata.version(req.name)
            if not req.specifier.contains(version, prereleases=True):
                return False
        except (InvalidRequirement, UndefinedEnvironmentName, InvalidVersion):
            return False
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


@contextlib.contextmanager
def _as_str(paths: contextlib.AbstractContextManager[Path]) -> Iterator[str]:
    with paths as path:
        yield str(path)


def activate(env: dict[str, str], python: str) -> None:
    """Put a job's environment into ``env`` as if activated (nothing for this process's
    own interpreter)."""
    if python != sys.executable:
        venv = str(Path(python).parent.parent)
        env.update(VIRTUAL_ENV=venv, PATH=f"{venv}/bin:{env.get('PATH', '')}")


def _stop_on(stop: threading.Event, proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (it stops pip, then whatever pip left) once ``stop`` is set;
    SIGKILL its group if that takes longer than its grace."""
    while proc.poll() is None:
        if stop.wait(0.2):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(timeout=PIP_GRACE_S + 5)
            except subprocess.TimeoutExpired:
                procs.signal_group(proc.pid, signal.SIGKILL)
            return


def _pip_env(job: Mapping[str, str]) -> dict[str, str]:
    """pip's environment: the worker's allow-listed variables (proxies, CA bundles,
    locale) and its PIP_* settings (the index is the operator's), and of the job's only
    where it runs (HOME, TMPDIR, its user's name, the launch id that finds its processes):
    never a PIP_INDEX_URL or PIP_CONFIG_FILE of the job's spec, which would get around
    the requirements policy."""
    env = {k: v for k, v in os.environ.items() if inherited(k) or k.startswith("PIP_")}
    env.update({k: job[k] for k in _PIP_FROM_JOB if k in job})
    return env


_PIP_FROM_JOB = ("HOME", "TMPDIR", "USER", "LOGNAME", procs.LAUNCH_ID_VAR)
