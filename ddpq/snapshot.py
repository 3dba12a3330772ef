"""A code snapshot: the files a job's program runs among, as a manifest of contents.

A manifest lists each file by its path, size, sha256 digest and executable bit, and
each symlink by its path and target. The contents (blobs) are stored once by digest,
so a snapshot that changes one file of a thousand costs one upload. The snapshot's id
is the sha256 of its canonical manifest: the same tree is the same snapshot.

The rules a manifest keeps are here once, for the three places that apply them: the
CLI before it uploads, the API before it stores, and the worker before it writes a
single file (it never trusts what it is sent). Standard library only.

- A path is relative and normalised: "/"-separated parts, none empty, ".", "..",
  or holding a NUL or another control character; no two entries share a path. It fits
  the filesystems it is written to: at most 4096 bytes (PATH_MAX), each part at most
  255 (NAME_MAX), in UTF-8.
- No part is a version-control directory (.git, .hg, .svn, in any case): a snapshot
  written out and then met by a plain `git status` must not run the commands a
  .git/config may name (core.fsmonitor, core.pager, hooks).
- A symlink's target is relative, at most 4096 bytes, names no version-control
  directory, and stays inside the snapshot when resolved as the kernel would: part by
  part from the link's own directory, through the other links of the manifest (at most
  40 of them, as the kernel's ELOOP), never climbing above the snapshot's root at any
  step. A loop of links is refused. Nothing is ever under a symlink (no entry's parent
  is a link), so writing the snapshot out never writes through one.
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

from ddpq.errors import SnapshotError

DIGEST = re.compile(r"[0-9a-f]{64}")  # sha256, lower-case hex; use fullmatch
# What Linux takes (PATH_MAX, NAME_MAX), in UTF-8 bytes as the kernel counts them: past
# them no worker could write the path at all. (The directory a snapshot is written under
# adds to the whole path: near the limit, a write can still fail there, as an OSError.)
MAX_PATH_BYTES = 4096  # a whole path, or a symlink's target
MAX_NAME_BYTES = 255  # one part of a path
MAX_PATH_PARTS = 64
MAX_LINKS = 40  # the most links the kernel follows in one lookup (MAXSYMLINKS, then ELOOP)
# Compared case-folded: on macOS (and Windows) ".GIT" is the same directory as ".git".
# HFS+ also ignores some invisible code points (".g\u200cit"); those are refused anyway,
# as every format character is (str.isprintable).
VCS_DIRS = frozenset({".git", ".hg", ".svn"})


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
    if _bytes(path) > MAX_PATH_BYTES:
        return f"{path[:100]!r}... is over {MAX_PATH_BYTES} bytes (UTF-8), the longest path"
    if any(not ch.isprintable() for ch in path):
        return f"{path[:100]!r} holds a control character"
    if path.startswith("/"):
        return f"{path[:100]!r} is absolute; paths are relative to the snapshot"
    parts = path.split("/")
    if len(parts) > MAX_PATH_PARTS:
        return f"{path[:100]!r} is more than {MAX_PATH_PARTS} directories deep"
    if any(p in ("", ".", "..") for p in parts):
        return f"{path[:100]!r} is not normalised (an empty, '.' or '..' part)"
    for p in parts:
        if _bytes(p) > MAX_NAME_BYTES:
            return (
                f"{path[:100]!r} has a name over {MAX_NAME_BYTES} bytes (UTF-8), the longest "
                f"a filesystem takes: {p[:40]!r}..."
            )
    vcs = _vcs_part(parts)
    if vcs is not None:
        return f"{path[:100]!r} is in {vcs!r}: {_VCS_WHY}"
    return None


_VCS_WHY = (
    "a version-control directory is never part of a snapshot (its config can run "
    "commands, core.fsmonitor, on a plain `git status` wherever the snapshot is written)"
)


def is_vcs(name: str) -> bool:
    """Whether a path's part is a version-control directory (.git, .hg, .svn, any case)."""
    return name.casefold() in VCS_DIRS


def _vcs_part(parts: list[str]) -> str | None:
    return next((p for p in parts if is_vcs(p)), None)


def _bytes(text: str) -> int:
    # surrogatepass: a lone surrogate is counted here and refused as a control character
    return len(text.encode("utf-8", "surrogatepass"))


def symlink_problem(path: str, target: object) -> str | None:
    """What is wrong with a symlink at ``path`` pointing to ``target``, or None: on its
    own (``manifest_problem`` resolves it through the manifest's other links)."""
    if not isinstance(target, str) or not target:
        return f"symlink {path[:100]!r} has an empty target"
    if _bytes(target) > MAX_PATH_BYTES:
        return f"symlink {path[:100]!r} has a target over {MAX_PATH_BYTES} bytes (UTF-8)"
    if any(not ch.isprintable() for ch in target):
        return f"symlink {path[:100]!r} has a target that holds a control character"
    if target.startswith("/"):
        return f"symlink {path[:100]!r} points to an absolute path"
    vcs = _vcs_part(target.split("/"))
    if vcs is not None:
        return f"symlink {path[:100]!r} points into {vcs!r} ({target[:100]!r}): {_VCS_WHY}"
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
    a path given twice, an entry under a file or a symlink, or a symlink that, resolved
    through the others, leaves the snapshot or never ends (``link_problems``)."""
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
    for problem in link_problems(entries):
        return problem.why
    return None


@dataclass(frozen=True)
class LinkProblem:
    """A symlink that cannot be kept: why, and whether it leads outside (else it loops,
    or needs more links than the kernel follows)."""

    path: str
    why: str
    leaves: bool


def link_problems(entries: Iterable[Entry]) -> list[LinkProblem]:
    """The symlinks of a manifest (its entries each checked already, none under a link)
    that, resolved as the kernel would, climb above the snapshot's root at some step,
    loop, or need more than MAX_LINKS links; in the manifest's order.

    Checking each target on its own is not enough: ``a/b/c/l -> ../../..`` is the root,
    so ``x -> a/b/c/l/../../../outside`` is inside by its text but outside on disk. A
    name that is no link of the manifest (a file, a directory, or nothing it holds) is
    taken as a plain directory, so a ``..`` after it is lexical: that may refuse what
    the kernel would stop at (a file is no directory), never accept what leaves. Each
    link is resolved once (memoised), over a tree of the links' directories only: linear
    in the manifest, however many files it lists."""
    return _Links(entries).problems()


class _Dir:
    """A directory on the way to a link (or the link itself): the names under it that
    lead to links. A name not among them leads to no link, so it is walked by count."""

    __slots__ = ("children", "link", "parent")

    def __init__(self, parent: _Dir | None) -> None:
        self.parent = parent
        self.children: dict[str, _Dir] = {}
        self.link: Entry | None = None


# Where a walk is: a directory of the tree, then ``depth`` plain names below it.
_Place = tuple[_Dir, int]


@dataclass
class _Failed:
    """Why a link's resolution failed: its problem, the cause another link going
    through it names, and the loop being unwound (its links and their names: each of
    those links is in the loop; a link outside it only goes through)."""

    problem: LinkProblem
    cause: str
    loop: frozenset[_Dir] = frozenset()
    cycle: str = ""


class _LinkFailed(SnapshotError):
    """A link that does not resolve (why: ``failed``); caught within _Links."""

    def __init__(self, failed: _Failed) -> None:
        super().__init__(failed.problem.why)
        self.failed = failed


class _TooDeep(SnapshotError):
    """Resolving went MAX_LINKS links deep: the link it started from needs more."""


class _Links:
    def __init__(self, entries: Iterable[Entry]) -> None:
        self.root = _Dir(None)
        self.links: list[_Dir] = []
        for e in entries:
            if e.symlink is None:
                continue
            node = self.root
            for name in e.path.split("/"):
                child = node.children.get(name)
                if child is None:
                    child = node.children[name] = _Dir(node)
                node = child
            node.link = e
            self.links.append(node)
        # A link's resolution: where it leads and how many links that took; or why not.
        # (Plain records, not exceptions: a raised one would keep its frames alive.)
        self.done: dict[_Dir, tuple[_Place, int] | _Failed] = {}
        self.active: list[_Dir] = []  # the links being resolved, outermost first

    def problems(self) -> list[LinkProblem]:
        out = []
        for node in self.links:
            try:
                self.resolve(node)
            except _LinkFailed as exc:
                out.append(exc.failed.problem)
            except _TooDeep:
                # Not remembered for the links on the way: each may be fine on its own.
                out.append(self._fail(node, self._too_many(node), leaves=False).problem)
        return out

    def resolve(self, node: _Dir) -> tuple[_Place, int]:
        known = self.done.get(node)
        if isinstance(known, _Failed):
            raise _LinkFailed(known)
        if known is not None:
            return known
        if node in self.active:
            cycle = [*self.active[self.active.index(node) :], node]
            names = " -> ".join(repr(_path(n)[:100]) for n in cycle)
            problem = LinkProblem(_path(node), names, leaves=False)
            raise _LinkFailed(_Failed(problem, names, frozenset(cycle), names))
        if len(self.active) >= MAX_LINKS:
            raise _TooDeep()
        self.active.append(node)
        try:
            found = self._walk(node)
        finally:
            self.active.pop()
        self.done[node] = found
        return found

    def _walk(self, node: _Dir) -> tuple[_Place, int]:
        link = node.link
        assert link is not None and link.symlink is not None and node.parent is not None
        at, depth = node.parent, 0
        followed, via = 0, None
        for name in link.symlink.split("/"):
            if name in ("", "."):
                continue
            if name == "..":
                if depth:
                    depth -= 1
                elif at.parent is not None:
                    at = at.parent
                else:
                    through = f" through symlink {_path(via)[:100]!r}" if via else ""
                    why = (
                        f"symlink {link.path[:100]!r} points outside the snapshot: "
                        f"{link.symlink[:100]!r} climbs above it{through}"
                    )
                    raise _LinkFailed(self._fail(node, why, leaves=True))
                continue
            child = None if depth else at.children.get(name)
            if child is None:
                depth += 1
            elif child.link is None:
                at = child
            else:
                try:
                    (at, depth), cost = self.resolve(child)
                except _LinkFailed as exc:
                    raise _LinkFailed(self._through(node, child, exc.failed)) from None
                followed += 1 + cost
                via = child
                if followed >= MAX_LINKS:  # opening the link itself follows one more
                    raise _LinkFailed(self._fail(node, self._too_many(node), leaves=False))
        return (at, depth), followed

    def _through(self, node: _Dir, child: _Dir, failed: _Failed) -> _Failed:
        """``node``'s failure, its resolution having failed at ``child``."""
        if node in failed.loop:
            why = f"symlink {_path(node)[:100]!r} is in a loop of links: {failed.cycle}"
            own = self._fail(node, why, leaves=False)
            own.loop, own.cycle = failed.loop, failed.cycle
            return own
        why = f"symlink {_path(node)[:100]!r} goes through symlink {_path(child)[:100]!r}: "
        return self._fail(node, why + failed.cause, failed.problem.leaves, cause=failed.cause)

    def _fail(self, node: _Dir, why: str, leaves: bool, cause: str | None = None) -> _Failed:
        failed = _Failed(LinkProblem(_path(node), why, leaves), cause or why)
        self.done[node] = failed
        return failed

    @staticmethod
    def _too_many(node: _Dir) -> str:
        return (
            f"symlink {_path(node)[:100]!r} needs more than {MAX_LINKS} links to resolve "
            "(the kernel follows no more: ELOOP)"
        )


def _path(node: _Dir | None) -> str:
    return node.link.path if node is not None and node.link is not None else ""


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


def checked(manifest: Iterable[Mapping[str, Any]]) -> list[Entry]:
    """A manifest from the wire as entries, every rule checked (SnapshotError names the
    first one broken): what writes a snapshot out never trusts where it came from."""
    entries = []
    for item in manifest:
        problem = entry_problem(item)
        if problem:
            raise SnapshotError(problem)
        entries.append(Entry.of(item))
    problem = manifest_problem(entries)
    if problem:
        raise SnapshotError(problem)
    return entries


def write_out(entries: list[Entry], dest: Path, fill: Callable[[Entry, int], None]) -> None:
    """Write a checked snapshot into ``dest``, which must not exist: each file created
    with O_EXCL|O_NOFOLLOW and handed to ``fill(entry, fd)`` to write its content (the fd
    reads too: the worker checks what it wrote against the digest), links
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
                fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
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
        raise SnapshotError(f"{rel[:100]!r} lands outside the snapshot's directory")
    for parent in target.relative_to(root).parents:
        if (root / parent).is_symlink():
            raise SnapshotError(f"{rel[:100]!r} goes through a link")
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
