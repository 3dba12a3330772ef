"""The start check of a walled worker: a job's uid must be able to use what jobs use
(run the worker's Python and find torch and ddpq with it, pass through the directories
where its own are, read the shared ones, open the device nodes of the worker's GPUs:
``gpu_devices``) and unable to change what every later job runs (the worker's code and
environment: ``protected_paths``, looked at whole by ``exposed``). ``probe`` runs the
look under a job's uid, ``verdict`` says what is wrong and how to fix it; worker.walled.walls
picks the uid and refuses to start on the verdict."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CHECK_TIMEOUT_S = 60.0


def probe(
    python: str,
    uid: int,
    gid: int,
    reachable: list[Path],
    readable: list[Path],
    protected: list[Path],
    devices: Sequence[Path] = (),
) -> subprocess.CompletedProcess[str] | None:
    """Run ``python`` as ``uid``:``gid`` to look at what that uid can use of the
    worker's environment (``_CHECK``), ``devices`` (``gpu_devices``) among it; None when
    the uid may not execute it at all."""
    plan = {
        "modules": ["torch", "worker.tee", "worker.entry", "ddpq.train"],
        "reachable": [str(p) for p in reachable],
        "readable": [str(p) for p in readable],
        "protected": [str(p) for p in protected],
        "devices": [str(p) for p in devices],
    }
    try:
        return subprocess.run(
            [python, "-I", "-c", _CHECK, json.dumps(plan)],
            user=uid,
            group=gid,
            extra_groups=[],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
        )
    except PermissionError:
        return None


def verdict(
    python: str,
    uid: int,
    done: subprocess.CompletedProcess[str] | None,
    protected: list[Path],
    pool: range,
    skip: Sequence[Path] = (),
) -> str | None:
    """What keeps jobs from running walled, in words with the fix, from ``probe``'s
    answer (``done``) and a look at ``protected`` whole (what is under ``skip``, the
    worker's data, is the worker's to set); None when nothing does."""
    if done is None:
        return _cannot_run(python, uid)
    if done.returncode != 0:
        if "Permission denied" in done.stderr or done.returncode == 126:
            return _cannot_run(python, uid)
        return f"a job's uid ({uid}) cannot start {python}: {done.stderr.strip()[-500:]}"
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return (
            f"a job's uid ({uid}) ran {python} but it said nothing readable: "
            f"{(done.stdout + done.stderr).strip()[-500:]}"
        )
    problems = []
    if found["missing"]:
        problems.append(f"cannot import {', '.join(found['missing'])}")
    if found["unreadable"]:
        problems.append(f"cannot read {', '.join(found['unreadable'][:5])}")
    if problems:
        return (
            f"jobs run under their own uids (from {uid}), which {'; '.join(problems)} "
            f"with {python}. Make every directory on the way readable by others "
            "(chmod o+rX), install ddpq where every user can read it, "
            "or run jobs unwalled with --job-uids off"
        )
    if found["closed_devices"]:
        return _cannot_open(uid, found["closed_devices"])
    writable = found["writable"] or exposed(protected, pool, skip)
    if writable:
        return (
            f"a job's uid ({uid}) could change {', '.join(writable[:5])}: jobs could "
            "change the code every later job runs. Make it writable by its owner only "
            "(chmod -R go-w), or run jobs unwalled with --job-uids off"
        )
    return None


def _cannot_run(python: str, uid: int) -> str:
    blocked = _blocked_dir(Path(python))
    where = f" ({blocked} is closed to other users)" if blocked else ""
    return (
        f"jobs run under their own uids (from {uid}), which cannot execute {python}{where}. "
        "Make the worker's environment from a Python every user can run (for example "
        "/usr/bin/python3 -m venv /opt/ddpq && /opt/ddpq/bin/pip install ddpq, or `make "
        "venv`, which prefers Debian's python3.11), or run jobs unwalled with --job-uids off"
    )


def _cannot_open(uid: int, devices: list[str]) -> str:
    # Jobs get no supplementary group (a group would be shared by every job): a device
    # group such as video does not help them, the mode for others does.
    seen = []
    for d in devices[:5]:
        try:
            st = os.stat(d)
            seen.append(f"{d} ({stat.filemode(st.st_mode)} {_owner(st)})")
        except OSError:
            seen.append(d)
    return (
        f"jobs run under their own uids (from {uid}), which cannot open {', '.join(seen)}: "
        "their GPUs would be unusable. Jobs get no supplementary group, so make the NVIDIA "
        "device nodes readable and writable by every user (chmod 0666, the driver's "
        "default: the nvidia module's option NVreg_DeviceFileMode=0666, or a udev rule), "
        "or run jobs unwalled with --job-uids off"
    )


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


# The device nodes CUDA opens for a GPU (besides the GPU's own /dev/nvidia<minor>).
GPU_SHARED_NODES = ("nvidiactl", "nvidia-uvm")


def gpu_devices(gpus: Sequence[int], dev_dir: Path = Path("/dev")) -> list[Path]:
    """The device nodes a job using ``gpus`` (NVML indices) opens, of those that exist in
    ``dev_dir``: none without GPUs, and none on a host without NVIDIA's nodes (the fake
    GPUs of the tests), where there is nothing to check. A GPU's own node is named by its
    minor number (worker.edges.nvml), by its index where NVML cannot say."""
    if not gpus:
        return []
    from worker.edges import nvml

    names = [*GPU_SHARED_NODES]
    for index in sorted(set(gpus)):
        minor = nvml.minor_number(index)
        names.append(f"nvidia{index if minor is None else minor}")
    return [dev_dir / n for n in names if os.path.lexists(dev_dir / n)]


def _blocked_dir(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that others cannot enter: on the way to
    it as named (a venv's python is a link, and its directory must be passed through
    too), then to where its links lead."""
    named = Path(os.path.abspath(path))
    for way in (named, Path(os.path.realpath(path))):
        for parent in reversed(way.parents):
            with contextlib.suppress(OSError):
                if not os.stat(parent).st_mode & stat.S_IXOTH:
                    return parent
    return None


# Run as a job's uid by probe, with -I (no user site, no PYTHON* variables): what
# of the worker's environment that uid can use. Standard library only, and no torch
# import (2 s): finding its files is what decides.
_CHECK = r"""
import importlib.util, json, os, sys
plan = json.loads(sys.argv[1])
out = {"missing": [], "unreadable": [], "writable": [], "closed_devices": []}
for name in plan["modules"]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is None or not spec.origin or not os.access(spec.origin, os.R_OK):
        out["missing"].append(name)
for p in plan["reachable"]:
    if not os.access(p, os.X_OK):
        out["unreadable"].append(p)
for p in plan["readable"]:
    if not os.access(p, os.R_OK | os.X_OK):
        out["unreadable"].append(p)
for p in plan["protected"]:
    if os.path.exists(p) and os.access(p, os.W_OK):
        out["writable"].append(p)
# Opened as CUDA opens them, not os.access: a container's device cgroup refuses (EPERM)
# what the modes allow. Another error (no such device behind the node) is not this
# check's to judge: CUDA will say it to the job.
for p in plan["devices"]:
    try:
        os.close(os.open(p, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY))
    except PermissionError:
        out["closed_devices"].append(p)
    except OSError:
        pass
print(json.dumps(out))
"""


def protected_paths() -> list[Path]:
    """What a job must not be able to change: where the Python it runs finds its modules
    (this process's sys.path, site-packages among them) and the packages it and the
    worker import (ddpq, worker, recipes, torch), wherever they are installed."""
    import importlib.util
    import site

    paths = {Path(p) for p in site.getsitepackages()}
    # The first entry is this process's own directory (``python -m``): not the jobs'.
    paths.update(Path(p) for p in sys.path[1:] if p and os.path.isdir(p))
    for name in ("ddpq", "worker", "recipes", "torch"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            paths.add(Path(spec.origin).parent)
    return sorted(paths)


EXPOSED_LIMIT = 500_000  # entries looked at, at most


def exposed(trees: Sequence[Path], pool: range, skip: Sequence[Path] = ()) -> list[str]:
    """What of ``trees`` (whole, links not followed) and of the directories above them a
    job's uid could change: an entry writable by others (a sticky directory such as /tmp
    above a tree aside) or owned by a job uid. Looked at as this process, from the
    modes: one job uid's probe of the top alone would miss a writable module deep in
    site-packages."""
    skipped = {os.path.realpath(p) for p in skip}
    found: list[str] = []
    seen = 0

    def bad(st: os.stat_result, above: bool) -> bool:
        if st.st_uid in pool:
            return True
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & stat.S_IWOTH:
            return False
        return not (above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX)

    roots = sorted({os.path.realpath(t) for t in trees if os.path.isdir(t)})
    for root in roots:
        if any(root == r or root.startswith(r + os.sep) for r in roots if r != root):
            continue  # walked with the tree it is in
        for parent in Path(root).parents:
            with contextlib.suppress(OSError):
                if bad(os.lstat(parent), above=True):
                    found.append(str(parent))
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skipped]
            for name in [".", *dirs, *files]:
                path = os.path.normpath(os.path.join(top, name))
                seen += 1
                with contextlib.suppress(OSError):
                    if bad(os.lstat(path), above=False):
                        found.append(path)
            if seen > EXPOSED_LIMIT or len(found) > 20:
                return sorted(set(found))
    return sorted(set(found))
