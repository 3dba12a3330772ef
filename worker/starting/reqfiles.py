"""The files a job's requirements name, read on this worker: a file opened in a
directory without following a link (the requirements.txt at the top of a job's code),
a file's sha256, a directory tree's digest (its links followed; one that leaves the
job's code refused unless told otherwise), each bounded. It reads and hashes; what a
policy allows and the words of a refusal are worker.starting.requirements'.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path

from ddpq.errors import WorkerError

MAX_TREE_ENTRIES = 100_000  # what one directory requirement may hold, to hash it
MAX_HASHED_BYTES = 8 * 2**30  # what one path requirement may hold, to hash it


class Unreadable(WorkerError):
    """A file that is not read: why, in words that follow its name ("is a named pipe,
    not a regular file")."""


def read_text(directory: Path, name: str, max_bytes: int) -> str | None:
    """The text of the file ``name`` in ``directory``, or None when there is none.
    Opened in the directory without following a link; Unreadable when it is a link,
    not a regular file, over ``max_bytes`` or not UTF-8 (a BOM is dropped)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Unreadable(
                    "is a symbolic link; this worker reads only a regular file there "
                    "(put the file itself in the job's code)"
                ) from None
            raise Unreadable(f"cannot be read: {e.strerror}") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise Unreadable(f"is {file_type(mode)}, not a regular file")
            chunks = []
            size = 0
            while size <= max_bytes and (chunk := os.read(fd, 1 << 20)):
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    if size > max_bytes:
        raise Unreadable(f"is larger than {max_bytes // 1000} kB")
    data = b"".join(chunks)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise Unreadable(f"is not UTF-8 text (line {line}, byte {e.start})") from None


def file_digest(real: str) -> str:
    """The sha256 of the regular file ``real`` (not followed if a link), at most
    MAX_HASHED_BYTES of it (TooBig)."""
    return _file_digest(real, _Budget())


def tree_digest(top: str, root: str | None, follow_out: bool) -> tuple[str, list[str]]:
    """The digest of the directory tree ``top`` (see _tree_digest), and the links in it
    that leave ``root`` (followed only when ``follow_out``; LinkOut otherwise), at most
    MAX_TREE_ENTRIES entries and MAX_HASHED_BYTES (TooBig)."""
    leaves: list[str] = []
    return _tree_digest(top, root, follow_out, _Budget(), leaves), leaves


class LinkOut(WorkerError):
    """A directory requirement holds a link out of the job's code (its relative path)."""


class TooBig(WorkerError):
    """A path requirement holds more than may be hashed (what, in words)."""


class _Budget:
    def __init__(self) -> None:
        self.entries = 0
        self.bytes = 0

    def entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_TREE_ENTRIES:
            raise TooBig(f"more than {MAX_TREE_ENTRIES} files")

    def read(self, n: int) -> None:
        self.bytes += n
        if self.bytes > MAX_HASHED_BYTES:
            raise TooBig(f"more than {MAX_HASHED_BYTES // 2**30} GiB")


def _file_digest(real: str, budget: _Budget) -> str:
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", real)
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            budget.read(len(chunk))
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _tree_digest(
    top: str, root: str | None, follow_out: bool, budget: _Budget, leaves: list[str]
) -> str:
    """A digest over a directory's sorted relative paths, each file's executable bit
    and content. Links are followed, each walked directory once on a path (a link back
    to one is noted, not walked again); one that resolves outside ``root`` raises
    LinkOut unless ``follow_out``, when it is followed and its name put in ``leaves``."""
    h = hashlib.sha256()

    def record(*item: object) -> None:
        h.update(json.dumps(item).encode() + b"\n")

    def walk(real_dir: str, rel: str, stack: frozenset[str]) -> None:
        with os.scandir(real_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            budget.entry()
            name = rel + e.name
            st = os.lstat(e.path)
            real = os.path.join(real_dir, e.name)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(e.path)
                if root is None or not Path(real).is_relative_to(root):
                    if not follow_out:
                        raise LinkOut(name)
                    leaves.append(name)
                try:
                    st = os.stat(real)
                except OSError:
                    record("dangling", name, os.readlink(e.path))
                    continue
            if stat.S_ISDIR(st.st_mode):
                if real in stack:
                    record("loop", name)
                    continue
                record("dir", name)
                walk(real, name + "/", stack | {real})
            elif stat.S_ISREG(st.st_mode):
                executable = bool(st.st_mode & stat.S_IXUSR)
                record("file", name, executable, _file_digest(real, budget))
            else:
                record("other", name, stat.S_IFMT(st.st_mode))

    walk(top, "", frozenset({top}))
    return h.hexdigest()


def file_type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"
