"""What of a directory goes with a job as its code, and how it is sent.

What is sent: every regular file and every symlink that stays inside the directory,
except what a ``.gitignore`` or a ``.ddpqignore`` (gitignore syntax, at any level;
``.ddpqignore`` wins where both speak) leaves out, and never ``.git`` (nor ``.hg``,
``.svn``, in any case, a directory or a submodule's ``.git`` file), ``__pycache__`` or a
virtualenv (a directory holding ``pyvenv.cfg``). A symlink pointing outside, directly or
through other links at any step, or into ``.git``, or in a loop of links, is skipped
(its target would not exist on the worker, and the API refuses it) and said so.

How: every file is read once, hashed as it is read (in a few threads) and kept in
memory up to KEEP_BYTES; the API is asked which contents it lacks, and only those are
uploaded, so sending the same tree again after a one-line change uploads one file
(ddpq.snapshot). What is uploaded goes in packs (ddpq.pack): many contents a request,
each compressed with zstd where that pays, a few requests at once; an API older than
packs gets one uncompressed PUT a content, as before.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock

import pathspec

from ddpq import pack
from ddpq.errors import CodeError
from ddpq.snapshot import (
    MAX_LINKS,
    Entry,
    Limits,
    human_bytes,
    is_vcs,
    limit_problem,
    link_problems,
    path_problem,
    symlink_problem,
)

NEVER = frozenset({".git", "__pycache__", ".hg", ".svn"})
CHECKPOINT_LIKE = (".pt", ".ckpt", ".safetensors")
IGNORE_FILES = (".gitignore", ".ddpqignore")  # later ones win where both match
UPLOAD_THREADS = 4  # requests in flight; compressing and hashing run in them too
# The contents read while hashing stay in memory up to this many bytes, so a first submit
# reads each file once; past it, a content is read again when it is sent (and checked).
KEEP_BYTES = 256 * 1024 * 1024
# Sizing what stays home walks it; a huge tree (a dataset of a million files) is sized
# only this far and said to be "more than" that.
SIZE_WALK_ENTRIES = 20_000
# The program's sources read for names of what stays home: the first bytes of each .py.
SCAN_BYTES = 256 * 1024


@dataclass
class LeftOut:
    """Something of the directory that stays home, and why: a user must know that
    ``data/`` did not go, or the job fails on a path that is not there."""

    path: str
    is_dir: bool
    bytes: int
    why: str  # ".gitignore", ".ddpqignore", "a virtualenv"
    partial: bool = False  # too big to size in full: ``bytes`` is a floor

    @property
    def shown(self) -> str:
        return f"{self.path}/" if self.is_dir else self.path

    def words(self) -> str:
        size = ("more than " if self.partial else "") + human_bytes(self.bytes)
        return f"{self.shown} ({size}, {self.why})"


@dataclass
class Collected:
    entries: list[Entry]
    sources: dict[str, Path]  # a file's path in the snapshot -> where it is here
    skipped: list[str] = field(default_factory=list)  # what was left out that a user expects
    left_out: list[LeftOut] = field(default_factory=list)  # what stays home, largest first

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)


@dataclass
class Pushed:
    """A snapshot sent: its id, files and bytes, and what this push uploaded."""

    id: str
    files: int
    bytes: int
    new: int
    sent: int
    skipped: list[str]
    left_out: list[LeftOut] = field(default_factory=list)
    named: list[tuple[str, str]] = field(default_factory=list)  # (source, what stays home)
    # Files that look like checkpoints (CHECKPOINT_LIKE), with their sizes: a program
    # that resumes from a file in its directory resumes from these (docs/outputs.md).
    checkpoints: list[tuple[str, int]] = field(default_factory=list)


# (the directory they apply below, the ignore file's name, its rules)
Specs = tuple[tuple[str, str, pathspec.PathSpec], ...]


def _with_ignore_files(specs: Specs, directory: Path, rel_dir: str) -> Specs:
    """The ignore rules below ``directory``: those from above, then its own files'."""
    own = []
    for name in IGNORE_FILES:
        f = directory / name
        if f.is_file():
            lines = f.read_text(errors="replace").splitlines()
            own.append((rel_dir, name, pathspec.GitIgnoreSpec.from_lines(lines)))
    return specs + tuple(own)


def _ignored(specs: Specs, rel: str, is_dir: bool) -> str | None:
    """gitignore's verdict: the last pattern that matches decides, and a deeper
    directory's files come after the ones above. The ignore file that left ``rel`` out
    (its path from the root), or None if it goes."""
    verdict: str | None = None
    for base, name, spec in specs:
        if base and not rel.startswith(base + "/"):
            continue
        sub = rel[len(base) + 1 :] if base else rel
        result = spec.check_file(sub + "/" if is_dir else sub)
        if result.include is not None:
            verdict = (f"{base}/{name}" if base else name) if result.include else None
    return verdict


def _size_of(directory: Path) -> tuple[int, bool]:
    """Bytes of the regular files below ``directory`` (links not followed), and whether
    the walk stopped at SIZE_WALK_ENTRIES before the end."""
    total, seen = 0, 0
    stack = [directory]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    seen += 1
                    if seen > SIZE_WALK_ENTRIES:
                        return total, True
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total, False


def collect(root: Path) -> Collected:
    """The files and links of ``root`` that go with a job (not hashed yet)."""
    root = root.resolve()
    entries: list[Entry] = []
    sources: dict[str, Path] = {}
    skipped: list[str] = []
    left_out: list[LeftOut] = []
    links = Counter[str]()  # why symlinks were left out -> how many
    for rel, path, st in _walk(root, (), "", skipped, left_out):
        problem = path_problem(rel)
        if problem:
            raise CodeError(f"cannot send {rel!r}: {problem} (leave it out with .ddpqignore)")
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            if any(is_vcs(part) for part in target.split("/")):
                links[_INTO_VCS] += 1
            elif symlink_problem(rel, target) or not _stays_inside(root, path):
                links[_OUTSIDE] += 1
            else:
                entries.append(Entry(path=rel, symlink=target))
        else:
            entries.append(
                Entry(path=rel, size=st.st_size, executable=bool(st.st_mode & stat.S_IXUSR))
            )
            sources[rel] = path
    # Where a link ends (realpath) is not all: a chain may leave the directory on its way
    # and come back, or loop, and the API would refuse the whole snapshot. A link that goes
    # through one refused is refused too, so what remains passes the API's check.
    refused = {p.path: p for p in link_problems(entries)}
    if refused:
        entries = [e for e in entries if e.path not in refused]
        links.update(_OUTSIDE if p.leaves else _LOOPING for p in refused.values())
    skipped.extend(f"{n} symlink(s) {why}" for why, n in links.items())
    left_out.sort(key=lambda o: (-o.bytes, o.path))
    return Collected(entries, sources, skipped, left_out)


_OUTSIDE = "pointing outside the directory"
_INTO_VCS = "pointing into a version-control directory (.git, .hg, .svn)"
_LOOPING = f"in a loop of links, or a chain of more than {MAX_LINKS}"


def _walk(
    directory: Path, specs: Specs, rel_dir: str, skipped: list[str], left_out: list[LeftOut]
) -> Iterator[tuple[str, Path, os.stat_result]]:
    specs = _with_ignore_files(specs, directory, rel_dir)
    try:
        names = sorted(os.listdir(directory))
    except PermissionError:
        skipped.append(f"{rel_dir or '.'}/ (not readable)")
        return
    for name in names:
        path = directory / name
        rel = f"{rel_dir}/{name}" if rel_dir else name
        if is_vcs(name):
            # In any case (macOS's .GIT is .git), and a file or link too: a submodule's
            # or a worktree's .git file names a repository that would be read from there.
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise CodeError(f"cannot send {rel!r}: its name is not UTF-8") from None
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode):
            if name in NEVER:
                continue
            why = "a virtualenv" if (path / "pyvenv.cfg").exists() else None
            why = why or _ignored(specs, rel, is_dir=True)
            if why:
                size, partial = _size_of(path)
                left_out.append(LeftOut(rel, True, size, why, partial))
            else:
                yield from _walk(path, specs, rel, skipped, left_out)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            why = _ignored(specs, rel, is_dir=False)
            if why:
                size = st.st_size if stat.S_ISREG(st.st_mode) else 0
                left_out.append(LeftOut(rel, False, size, why))
            else:
                yield rel, path, st


def named_in_sources(found: Collected) -> list[tuple[str, str]]:
    """(a sent .py file, what stays home) for each thing left out whose path that source
    names, as ``open("data/train.csv")`` names ``data/``: the job would look for it in its
    directory on the worker, where it is not. Only what an ignore file left out counts (a
    virtualenv is named by no program); each source's first SCAN_BYTES are read."""
    wanted = [o for o in found.left_out if o.why != "a virtualenv"]
    if not wanted:
        return []
    named: list[tuple[str, str]] = []
    for rel, path in sorted(found.sources.items()):
        if not rel.endswith(".py"):
            continue
        try:
            with open(path, "rb") as f:
                text = f.read(SCAN_BYTES).decode("utf-8", errors="replace")
        except OSError:
            continue
        for o in wanted:
            if _names(text, o):
                named.append((rel, o.shown))
    return named


def _names(text: str, o: LeftOut) -> bool:
    """Whether source text names the path: ``data/...`` or ``"data"`` for a directory,
    the path itself for a file."""
    if o.is_dir:
        return f"{o.path}/" in text or f'"{o.path}"' in text or f"'{o.path}'" in text
    return o.path in text


def _stays_inside(root: Path, link: Path) -> bool:
    try:
        return Path(os.path.realpath(link)).is_relative_to(root)
    except OSError:
        return False


def digest_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def hashed(found: Collected) -> list[Entry]:
    """The entries with their digests (and sizes as read: a file may change meanwhile)."""
    return read_hashed(found, 0)[0]


def read_hashed(found: Collected, keep_bytes: int = KEEP_BYTES) -> tuple[list[Entry], Kept]:
    """The entries with their digests, each file read once (in UPLOAD_THREADS threads:
    reading and sha256 let go of the GIL), and the contents read, by digest, while
    their sum stays within ``keep_bytes`` (smaller files first, as they come)."""
    kept: Kept = {}
    room = keep_bytes
    lock = Lock()

    def one(e: Entry) -> Entry:
        nonlocal room
        if e.symlink is not None:
            return e
        src = found.sources[e.path]
        h = hashlib.sha256()
        with open(src, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with lock:
                keep = size <= room
                if keep:
                    room -= size
            if keep:
                data = f.read()
                h.update(data)
            else:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        digest = h.hexdigest()
        if keep:
            if len(data) != size:  # changed while read: sized as read
                size = len(data)
            kept[digest] = data
        return Entry(path=e.path, digest=digest, size=size, executable=e.executable)

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        return list(pool.map(one, found.entries)), kept


Kept = dict[str, bytes]


def checkpoint_like(entries: list[Entry]) -> list[tuple[str, int]]:
    """The files sent that look like checkpoints, largest first."""
    found = [(e.path, e.size) for e in entries if e.symlink is None]
    found = [(p, n) for p, n in found if p.lower().endswith(CHECKPOINT_LIKE)]
    return sorted(found, key=lambda x: (-x[1], x[0]))


def check_limits(found: Collected, limits: Limits) -> None:
    problem = limit_problem(found.entries, limits)
    if problem:
        raise CodeError(problem)


def upload(
    entries: list[Entry],
    sources: dict[str, Path],
    missing: set[str],
    put: Callable[[str, bytes], None],
    progress: Callable[[int], None] | None = None,
) -> tuple[int, int]:
    """Upload the contents in ``missing``, each once: (contents sent, bytes sent)."""
    todo: dict[str, Path] = {}
    for e in entries:
        if e.digest in missing and e.digest not in todo:
            todo[e.digest] = sources[e.path]

    def send(item: tuple[str, Path]) -> int:
        digest, src = item
        data = src.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise CodeError(f"{src} changed while it was being sent; submit again")
        put(digest, data)
        if progress is not None:
            progress(len(data))
        return len(data)

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        sent = sum(pool.map(send, todo.items()))
    return len(todo), sent


def upload_packs(
    entries: list[Entry],
    sources: dict[str, Path],
    missing: set[str],
    kept: Kept,
    post: Callable[[bytes], None],
    max_body: int,
    max_content: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, int]:
    """Upload the contents in ``missing``, each once, in packs (ddpq.pack) of at most
    ``max_content`` bytes uncompressed and ``max_body`` on the wire, UPLOAD_THREADS at
    once: (contents sent, bytes sent on the wire)."""
    todo: dict[str, tuple[int, Path]] = {}
    for e in entries:
        if e.digest is not None and e.digest in missing and e.digest not in todo:
            todo[e.digest] = (e.size, sources[e.path])
    target = min(pack.TARGET_BYTES, max_content)
    groups: list[list[str]] = []
    group: list[str] = []
    filled = 0
    # The largest first, so the last requests in flight are small ones.
    for digest, (size, _) in sorted(todo.items(), key=lambda kv: -kv[1][0]):
        if group and (filled + size > target or len(group) >= pack.MAX_FRAMES):
            groups.append(group)
            group, filled = [], 0
        group.append(digest)
        filled += size
    if group:
        groups.append(group)

    def content(digest: str) -> bytes:
        data = kept.get(digest)
        if data is not None:
            return data
        src = todo[digest][1]
        data = src.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise CodeError(f"{src} changed while it was being sent; submit again")
        return data

    def send(digests: list[str]) -> int:
        parts: list[bytes] = []
        raw = 0
        for digest in digests:
            data = content(digest)
            raw += len(data)
            encoding, payload = pack.compress(data)
            parts += [pack.frame(digest, encoding, len(data), payload), payload]
        body = b"".join(parts)
        if len(body) > max_body:  # only headers could make it so: the API's limits moved
            raise CodeError(f"a pack of {len(body)} bytes is over the API's {max_body}")
        post(body)
        if progress is not None:
            progress(raw)
        return len(body)

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        sent = sum(pool.map(send, groups))
    return len(todo), sent
