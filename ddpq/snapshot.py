"""A code snapshot: the files a job's program runs among, as a manifest of contents.

A manifest lists each file by its path, size, sha256 digest and executable bit, and
each symlink by its path and target. The contents (blobs) are stored once by digest,
so a snapshot that changes one file of a thousand costs one upload. The snapshot's id
is the sha256 of its canonical manifest: the same tree is the same snapshot.

The rules a manifest keeps are here once, for the three places that apply them: the
CLI before it uploads, the API before it stores, and the worker before it writes a
single file (it never trusts what it is sent). Standard library only.

- A path is relative and normalised: "/"-separated parts, none empty, ".", "..",
  or holding a NUL or another control character; no two entries share a path.
- A symlink's target is relative and, resolved from the link's own directory, stays
  inside the snapshot. Nothing is ever under a symlink (no entry's parent is a link),
  so writing the snapshot out never writes through one.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIGEST = re.compile(r"[0-9a-f]{64}")  # sha256, lower-case hex; use fullmatch
MAX_PATH_CHARS = 1024
MAX_PATH_PARTS = 64


@dataclass(frozen=True)
class Limits:
    """What one snapshot may hold (the API's DDPQ_CODE_MAX_* settings)."""

    max_files: int
    max_bytes: int
    max_file_bytes: int


@dataclass(frozen=True)
class Entry:
    """A file (digest, size, executable) or a symlink (target) at ``path``."""

    path: str
    digest: str | None = None
    size: int = 0
    executable: bool = False
    symlink: str | None = None

    def wire(self) -> dict[str, Any]:
        if self.symlink is not None:
            return {"path": self.path, "symlink": self.symlink}
        return {
            "path": self.path,
            "digest": self.digest,
            "size": self.size,
            "executable": self.executable,
        }

    @classmethod
    def of(cls, item: Mapping[str, Any]) -> Entry:
        """An entry from its wire form (checked with ``entry_problem`` first)."""
        if item.get("symlink") is not None:
            return cls(path=item["path"], symlink=item["symlink"])
        return cls(
            path=item["path"],
            digest=item["digest"],
            size=int(item["size"]),
            executable=bool(item.get("executable", False)),
        )


def path_problem(path: object) -> str | None:
    """What is wrong with a manifest path, or None."""
    if not isinstance(path, str) or not path:
        return "a path is a non-empty string"
    if len(path) > MAX_PATH_CHARS:
        return f"a path has at most {MAX_PATH_CHARS} characters"
    if any(not ch.isprintable() for ch in path):
        return f"{path[:100]!r} holds a control character"
    if path.startswith("/"):
        return f"{path[:100]!r} is absolute; paths are relative to the snapshot"
    parts = path.split("/")
    if len(parts) > MAX_PATH_PARTS:
        return f"{path[:100]!r} is more than {MAX_PATH_PARTS} directories deep"
    if any(p in ("", ".", "..") for p in parts):
        return f"{path[:100]!r} is not normalised (an empty, '.' or '..' part)"
    return None


def symlink_problem(path: str, target: object) -> str | None:
    """What is wrong with a symlink at ``path`` pointing to ``target``, or None."""
    if not isinstance(target, str) or not target:
        return f"symlink {path[:100]!r} has an empty target"
    if len(target) > MAX_PATH_CHARS or any(not ch.isprintable() for ch in target):
        return f"symlink {path[:100]!r} has a target that is too long or holds a control character"
    if target.startswith("/"):
        return f"symlink {path[:100]!r} points to an absolute path"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if resolved == ".." or resolved.startswith("../"):
        return f"symlink {path[:100]!r} points outside the snapshot ({target[:100]!r})"
    return None


def entry_problem(item: object) -> str | None:
    """What is wrong with one manifest entry in its wire form, or None."""
    if not isinstance(item, Mapping):
        return "an entry is an object"
    problem = path_problem(item.get("path"))
    if problem:
        return problem
    path = item["path"]
    if item.get("symlink") is not None:
        if item.get("digest") is not None or item.get("size") is not None:
            return f"{path[:100]!r} is a file (digest, size) or a symlink, not both"
        return symlink_problem(path, item["symlink"])
    digest, size = item.get("digest"), item.get("size")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        return f"{path[:100]!r}: digest is 64 lower-case hex characters (sha256)"
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"{path[:100]!r}: size is a whole number of bytes"
    return None


def manifest_problem(entries: list[Entry]) -> str | None:
    """What is wrong with a whole manifest (its entries each checked already), or None:
    a path given twice, or an entry under a file or a symlink."""
    paths: set[str] = set()
    for e in entries:
        if e.path in paths:
            return f"{e.path[:100]!r} is listed twice"
        paths.add(e.path)
    for e in entries:
        parent = posixpath.dirname(e.path)
        while parent:
            if parent in paths:
                return f"{e.path[:100]!r} is under {parent[:100]!r}, which is a file or a symlink"
            parent = posixpath.dirname(parent)
    return None


def limit_problem(entries: list[Entry], limits: Limits) -> str | None:
    """Over a limit: which, and the largest files, with how to leave them out."""
    files = [e for e in entries if e.symlink is None]
    total = sum(e.size for e in files)
    over = None
    if len(entries) > limits.max_files:
        over = f"{len(entries)} files, over the limit of {limits.max_files} (DDPQ_CODE_MAX_FILES)"
    elif total > limits.max_bytes:
        over = (
            f"{human_bytes(total)}, over the limit of {human_bytes(limits.max_bytes)} "
            "(DDPQ_CODE_MAX_BYTES)"
        )
    else:
        big = [e for e in files if e.size > limits.max_file_bytes]
        if big:
            over = (
                f"{len(big)} file(s) over the per-file limit of "
                f"{human_bytes(limits.max_file_bytes)} (DDPQ_CODE_MAX_FILE_BYTES)"
            )
    if over is None:
        return None
    largest = sorted(files, key=lambda e: e.size, reverse=True)[:5]
    named = ", ".join(f"{e.path} ({human_bytes(e.size)})" for e in largest)
    return (
        f"the code is {over}. Largest: {named}. Leave data, checkpoints and environments "
        "out with a .ddpqignore (gitignore syntax), or use --no-code"
    )


class Refused(ValueError):
    """A manifest that breaks a rule above: nothing of it is written."""


def checked(manifest: Iterable[Mapping[str, Any]]) -> list[Entry]:
    """A manifest from the wire as entries, every rule checked (Refused names the first
    one broken): what writes a snapshot out never trusts where it came from."""
    entries = []
    for item in manifest:
        problem = entry_problem(item)
        if problem:
            raise Refused(problem)
        entries.append(Entry.of(item))
    problem = manifest_problem(entries)
    if problem:
        raise Refused(problem)
    return entries


def write_out(entries: list[Entry], dest: Path, fill: Callable[[Entry, int], None]) -> None:
    """Write a checked snapshot into ``dest``, which must not exist: each file created
    with O_EXCL|O_NOFOLLOW and handed to ``fill(entry, fd)`` to write its content, links
    made after every file (so nothing is ever written through one), all under a
    temporary name that becomes ``dest`` only when whole."""
    staging = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
    staging.mkdir(mode=0o755)
    try:
        for e in entries:
            if e.symlink is None:
                target = _inside(staging, e.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                mode = 0o755 if e.executable else 0o644
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
                try:
                    fill(e, fd)
                    os.fchmod(fd, mode)  # the umask does not decide a program's mode
                finally:
                    os.close(fd)
        for e in entries:
            if e.symlink is not None:
                target = _inside(staging, e.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(e.symlink, target)
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _inside(root: Path, rel: str) -> Path:
    """``root/rel``, refusing (again) anything that would land outside ``root`` or go
    through a link."""
    target = Path(os.path.normpath(root / rel))
    if not target.is_relative_to(root) or target == root:
        raise Refused(f"{rel[:100]!r} lands outside the snapshot's directory")
    for parent in target.relative_to(root).parents:
        if (root / parent).is_symlink():
            raise Refused(f"{rel[:100]!r} goes through a link")
    return target


def snapshot_id(entries: Iterable[Entry]) -> str:
    """The sha256 of the canonical manifest: entries sorted by path, compact JSON."""
    canonical = json.dumps(
        [e.wire() for e in sorted(entries, key=lambda e: e.path)],
        separators=(",", ":"),
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def file_count(n: int) -> str:
    """'1 file', '2 files'."""
    return f"{n} file" + ("" if n == 1 else "s")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
