"""Per-job Python requirements: a virtualenv layered on the worker's own environment.

A job whose code has a requirements.txt at its top, or whose spec lists ``pip``
requirements, runs under a virtualenv made for exactly those requirements and this
worker's Python, built once and shared by every job that needs the same (DATA_DIR/venvs,
at most ``max_envs`` kept, least recently used first out).

The new environment sees the worker's packages through a .pth file that adds the
worker's site-packages after its own (``python -m venv --system-site-packages`` run from
a venv would expose the *base* interpreter's packages, not the worker's: torch would be
missing). So torch stays the worker's pinned build: pip finds it installed, and a
constraints file pins it (and torchvision, torchaudio) to the worker's versions, so a
requirement for another torch fails the build instead of installing a second one.

pip runs with the allow-listed environment jobs get plus the worker's PIP_* settings
(the package index comes from the worker's configuration), in the job's directory, and
its output goes to the job's log. A failed build fails the job with pip's error.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from worker.torchrun import JobError

log = logging.getLogger("ddpq.worker")

READY = ".ddpq-ready"
PINNED = ("torch", "torchvision", "torchaudio")  # never replaced by a job's requirements
PIP_TIMEOUT_S = 3600.0


def _pins() -> list[str]:
    pins = []
    for name in PINNED:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            pins.append(f"{name}=={importlib.metadata.version(name)}")
    return pins


class Venvs:
    def __init__(self, root: Path, max_envs: int) -> None:
        self.root = root
        self.max_envs = max_envs
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._in_use: Counter[str] = Counter()
        self.pins = _pins()

    def key(self, requirements: bytes, pip: list[str]) -> str:
        """One environment per distinct requirements and worker Python."""
        basis = {
            "python": sys.version,
            "prefix": sys.prefix,
            "site": site.getsitepackages(),
            "pins": self.pins,
            "requirements": hashlib.sha256(requirements).hexdigest(),
            "pip": pip,
        }
        return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def using(
        self,
        requirements: Path | None,
        pip: list[str],
        cwd: Path,
        environ: Mapping[str, str],
        say: Callable[[str], None],
        stop: threading.Event,
    ) -> Iterator[Path]:
        """The Python of an environment with these requirements, built if need be; it is
        not evicted while the block runs."""
        key = self.key(requirements.read_bytes() if requirements else b"", pip)
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
            self._in_use[key] += 1
        try:
            with building:  # a second job needing the same environment waits for one build
                env_dir = self.root / key
                if (env_dir / READY).is_file():
                    os.utime(env_dir / READY)
                    say(f"[ddpq] requirements: reusing environment {key[:12]}\n")
                else:
                    self._build(env_dir, requirements, pip, cwd, environ, say, stop)
            self._trim()
            yield env_dir / "bin" / "python"
        finally:
            with self._lock:
                self._in_use[key] -= 1

    def _build(
        self,
        env_dir: Path,
        requirements: Path | None,
        pip: list[str],
        cwd: Path,
        environ: Mapping[str, str],
        say: Callable[[str], None],
        stop: threading.Event,
    ) -> None:
        shutil.rmtree(env_dir, ignore_errors=True)  # what a crashed build left
        what = " and ".join(
            x for x in ("requirements.txt" if requirements else "", " ".join(pip)) if x
        )
        say(f"[ddpq] requirements: building an environment for {what[:300]}\n")
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(env_dir)],
            check=True,
            capture_output=True,
        )
        where = "import sysconfig; print(sysconfig.get_path('purelib'))"
        purelib = Path(
            subprocess.run(
                [str(env_dir / "bin" / "python"), "-c", where],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        # addsitedir, not a bare path line: the worker's own .pth files (editable
        # installs among them) are processed too.
        lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
        (purelib / "_ddpq_worker_site.pth").write_text("\n".join(lines) + "\n")
        constraints = env_dir / "ddpq-constraints.txt"
        constraints.write_text("".join(f"{p}\n" for p in self.pins))
        argv = [
            sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
            "install", "--no-input", "--disable-pip-version-check", "--progress-bar", "off",
            "-c", str(constraints),
        ]  # fmt: skip
        if requirements is not None:
            argv += ["-r", str(requirements)]
        argv += pip
        self._pip(argv, cwd, environ, say, stop)
        (env_dir / READY).touch()

    def _pip(
        self,
        argv: list[str],
        cwd: Path,
        environ: Mapping[str, str],
        say: Callable[[str], None],
        stop: threading.Event,
    ) -> None:
        env = {**environ, **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        # A cancel (or a shutdown) while pip runs stops pip and what it spawned.
        watcher = threading.Thread(target=_kill_on, args=(stop, proc), daemon=True)
        watcher.start()
        errors: list[str] = []
        with proc.stdout:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                say(f"[pip] {line}\n")
                if line.startswith("ERROR:"):
                    errors.append(line.removeprefix("ERROR:").strip())
        code = proc.wait(timeout=PIP_TIMEOUT_S)
        if stop.is_set():
            raise Stopped()
        if code != 0:
            why = errors[0] if errors else f"pip exited with code {code}"
            raise JobError(f"installing the job's requirements failed: {why[:400]}")

    def _trim(self) -> None:
        """Keep at most max_envs built environments: the least recently used go first,
        never one a job is using."""
        built = []
        for d in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                built.append(((d / READY).stat().st_mtime, d))
        with self._lock:
            busy = {k for k, n in self._in_use.items() if n > 0}
        extra = len(built) - self.max_envs
        for _, d in sorted(built):
            if extra <= 0:
                break
            if d.name not in busy:
                shutil.rmtree(d, ignore_errors=True)
                extra -= 1


class Stopped(Exception):
    """The attempt was asked to stop while its requirements were being installed."""


def python_for(
    venvs: Venvs,
    spec: Mapping[str, Any],
    cwd: Path,
    env: Mapping[str, str],
    say: Callable[[str], None],
    stop: threading.Event,
) -> contextlib.AbstractContextManager[str]:
    """The interpreter a job runs under, held while the block runs: this process's own,
    or one with the job's requirements (requirements.txt at the top of its code, or the
    spec's pip list), built if need be."""
    pip = list(spec.get("pip") or [])
    requirements = cwd / "requirements.txt" if spec.get("code") else None
    if requirements is not None and not requirements.is_file():
        requirements = None
    if requirements is None and not pip:
        return contextlib.nullcontext(sys.executable)
    return _as_str(venvs.using(requirements, pip, cwd, env, say, stop))


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


def _kill_on(stop: threading.Event, proc: subprocess.Popen[bytes]) -> None:
    while proc.poll() is None:
        if stop.wait(0.2):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
