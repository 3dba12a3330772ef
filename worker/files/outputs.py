"""What a job wrote in its working directory, kept once its attempt ends.

The worker keeps the directory itself (worker.files.code.Workdirs: removed only once the
service says its retention is over) and sends it to the API, so that what the job wrote
outlives this host: ``ddpq outputs`` lists and downloads it from any API process, and
``ddpq resubmit --resume`` runs a new job in a copy of it on any worker. It is sent as a
code snapshot (the contents the API lacks, then the manifest): the job's code and all it
wrote, within the outputs limits the service gives (GET /workers/outputs/limits).

The directory's contents are the job's, so hostile: it is read after the attempt's
processes are gone (walled, after it was taken back: worker.walled.walls), walked by directory
file descriptors (os.fwalk), every file opened with O_NOFOLLOW relative to its
directory, never through a path a job could swap a component of for a link. A link is
kept as a link (its target is never read) and only when it stays inside the directory
(ddpq.snapshot's rules, through the other links); a file with a second name (a hard
link, which may name a file outside), a special file, a name the snapshot rules refuse
(a control character, a version-control directory), a file over a limit: each is left,
and named with why in the job's outputs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpq.errors import ApiRefused
from ddpq.snapshot import (
    Entry,
    file_count,
    human_bytes,
    is_vcs,
    link_problems,
    path_problem,
    symlink_problem,
)
from worker.edges.api import WorkerAPI, retry

MAX_LEFT = 1000  # files named as left; more are counted (the API's limit)
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A left link's stand-in when the links kept are resolved: it climbs out from any depth.
OUT = "/".join([".."] * 65)


@dataclass(frozen=True)
class Limits:
    """GET /workers/outputs/limits."""

    max_files: int
    max_bytes: int
    max_file_bytes: int
    retention_s: float
    keep_newest: int


@dataclass
class Captured:
    """The directory as it is now: the entries to send (its code unchanged, and what the
    job wrote within the limits), what was left and why."""

    entries: list[Entry] = field(default_factory=list)
    written: list[Entry] = field(default_factory=list)  # the job's, to upload
    left: list[dict[str, Any]] = field(default_factory=list)
    left_more: int = 0

    def leave(self, path: str, size: int | None, why: str) -> None:
        if len(self.left) < MAX_LEFT:
            self.left.append({"path": _shown(path), "size": size, "why": why})
        else:
            self.left_more += 1


def _shown(path: str) -> str:
    """A path as the API takes it: printable (a name may hold anything but / and NUL)."""
    text = "".join(ch if ch.isprintable() else "?" for ch in path)
    return text[:4000]


# Python's bytecode caches, which importing the job's own modules writes: never the job's
# output (nor listed as left), as `ddpq submit` never sends them (ddpq.codepack.NEVER).
BYTECODE = "__pycache__"


def _walk(root_fd: int) -> Iterator[tuple[str, str, int]]:
    """(relative path, name, its directory's fd) of every entry under ``root_fd``, by
    directory fds, never following a link; a directory the snapshot rules refuse is not
    entered (yielded itself, to be left); a bytecode cache is passed over."""
    for top, dirs, files, dir_fd in os.fwalk(".", follow_symlinks=False, dir_fd=root_fd):
        base = "" if top == "." else top.removeprefix("./")
        keep = []
        for name in dirs:
            rel = f"{base}/{name}" if base else name
            if _is_link(name, dir_fd):
                files.append(name)  # a link to a directory: kept as a link
            elif name == BYTECODE:
                continue
            elif is_vcs(name) or path_problem(rel):
                yield rel, name, dir_fd
            else:
                keep.append(name)
        dirs[:] = keep
        for name in files:
            yield (f"{base}/{name}" if base else name), name, dir_fd


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_root(root: Path | int) -> int:
    """A directory fd of ``root``: a path opened without following a link at its end,
    or a new fd of a directory fd the caller opened safely (worker.files.checkpoints.walk_to),
    for a directory a job could swap a component of meanwhile."""
    return os.dup(root) if isinstance(root, int) else os.open(root, DIR_FLAGS)


def capture(root: Path | int, code: dict[str, Entry], limits: Limits) -> Captured:
    """Read the job's directory ``root`` (its attempt's processes gone): every file
    hashed, the job's own (not in its ``code``, or changed) kept smallest first within the
    limits. What is read is bounded too: past as many entries as its code and the
    outputs may hold, the rest are counted, not read; a file of its own larger than all
    the outputs may hold is not hashed."""
    out = Captured()
    mine: list[Entry] = []
    refused: list[Entry] = []  # links left, standing in as links that leave
    most = len(code) + limits.max_files
    seen = 0
    root_fd = open_root(root)
    try:
        for rel, name, dir_fd in _walk(root_fd):
            seen += 1
            if seen > most:
                out.left_more += 1
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            problem = path_problem(rel)
            if problem or any(is_vcs(p) for p in rel.split("/")):
                out.leave(rel, None, problem or "a version-control directory is never kept")
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dir_fd)
                why = symlink_problem(rel, target)
                if why:
                    out.leave(rel, None, why)
                    refused.append(Entry(path=rel, symlink=OUT))
                else:
                    e = Entry(path=rel, symlink=target)
                    (out.entries if code.get(rel) == e else mine).append(e)
            elif stat.S_ISDIR(st.st_mode):
                out.leave(rel, None, "a directory whose name the snapshot rules refuse")
            elif not stat.S_ISREG(st.st_mode):
                out.leave(rel, None, "not a regular file or a link")
            elif st.st_nlink > 1:
                out.leave(rel, st.st_size, "a hard link: its other name may be outside")
            elif st.st_size > limits.max_file_bytes:
                out.leave(
                    rel,
                    st.st_size,
                    f"over {human_bytes(limits.max_file_bytes)} (DDPQ_CODE_MAX_FILE_BYTES)",
                )
            elif st.st_size > limits.max_bytes and rel not in code:
                over = f"over {human_bytes(limits.max_bytes)} (DDPQ_OUTPUTS_MAX_BYTES)"
                out.leave(rel, st.st_size, over)
            else:
                digest = digest_under(name, dir_fd, st)
                if digest is None:
                    out.leave(rel, st.st_size, "not readable, or changed while it was read")
                    continue
                e = Entry(
                    path=rel,
                    digest=digest,
                    size=st.st_size,
                    executable=bool(st.st_mode & stat.S_IXUSR),
                )
                (out.entries if code.get(rel) == e else mine).append(e)
    finally:
        os.close(root_fd)
    _keep_within(out, mine, refused, limits)
    return out


def _keep_within(out: Captured, mine: list[Entry], refused: list[Entry], limits: Limits) -> None:
    """Keep the job's own files smallest first within the outputs' limits, then drop the
    links that leave through another link (ddpq.snapshot's rule)."""
    files = n_bytes = 0
    for e in sorted(mine, key=lambda e: (e.size, e.path)):
        if files + 1 > limits.max_files:
            out.leave(e.path, e.size, "over the outputs' file count (DDPQ_OUTPUTS_MAX_FILES)")
        elif n_bytes + e.size > limits.max_bytes:
            out.leave(
                e.path, e.size, f"over {human_bytes(limits.max_bytes)} (DDPQ_OUTPUTS_MAX_BYTES)"
            )
        else:
            files += 1
            n_bytes += e.size
            out.entries.append(e)
            if e.digest is not None:
                out.written.append(e)
    # A link kept must stay inside through the other links (ddpq.snapshot), those left
    # among them: a link through one that leaves leaves too.
    gone = {e.path for e in refused}
    for p in link_problems([*out.entries, *refused]):
        if p.path not in gone:
            out.leave(p.path, None, p.why)
            out.entries = [e for e in out.entries if e.path != p.path]


def digest_under(name: str, dir_fd: int, st: os.stat_result) -> str | None:
    """The sha256 of the file ``name`` is now, if it is still the one ``st`` describes."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def read_under(root: Path | int, rel: str, limit: int) -> bytes | None:
    """The content of ``root/rel`` read by directory fds, no link followed at any step
    (None if that is not a regular file any more, or over ``limit``)."""
    parts = rel.split("/")
    fd = open_root(root)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open(parts[-1], READ_FLAGS, dir_fd=fd)
    except OSError:
        os.close(fd)
        return None
    os.close(fd)
    with open(f, "rb") as file:
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return None
        data = file.read(limit + 1)
    return data if len(data) <= limit else None


def send(
    api: WorkerAPI, root: Path | int, captured: Captured, max_file_bytes: int, under: str = ""
) -> tuple[str | None, Captured]:
    """Send the captured directory to the API as a code snapshot: its id (None when there
    is nothing to send), and what was sent (a file that changed since it was hashed is
    left)."""
    digests = sorted({e.digest for e in captured.entries if e.digest is not None})
    missing = set(
        retry(lambda: api.missing_blobs(digests), what="outputs: ask what the API lacks")
        if digests
        else []
    )
    gone: set[str] = set()
    # What the job wrote, and any of its code the API no longer holds.
    for e in [*captured.written, *captured.entries]:
        if e.digest not in missing or e.path in gone:
            continue
        data = read_under(root, e.path, max_file_bytes)
        if data is None or hashlib.sha256(data).hexdigest() != e.digest:
            captured.leave(e.path, e.size, "changed while it was being sent")
            gone.add(e.path)
            continue
        digest = e.digest
        assert digest is not None
        retry(functools.partial(api.put_blob, digest, data), what=f"outputs: send {e.path[:100]}")
        missing.discard(digest)
    if gone:
        captured.entries = [e for e in captured.entries if e.path not in gone]
        captured.written = [e for e in captured.written if e.path not in gone]
    if not captured.entries:
        return None, captured
    # ``under``: the snapshot holds the files under this directory (a checkpoint's name).
    files = [
        {**e.wire(), "path": f"{under}/{e.path}" if under else e.path} for e in captured.entries
    ]
    made = retry(lambda: api.create_snapshot(files), what="outputs: send the directory")
    return str(made["id"]), captured


def keep(
    api: WorkerAPI,
    job_id: int,
    attempt: int,
    root: Path,
    code_manifest: Callable[[], list[dict[str, Any]]],
) -> str:
    """Capture and send the job's directory as its attempt ends; the job log's words."""
    lim = Limits(**retry(api.outputs_limits, what="outputs: ask the limits"))
    code = {e["path"]: Entry.of(e) for e in code_manifest()}
    captured = capture(root, code, lim)
    sid, captured = send(api, root, captured, lim.max_file_bytes)
    kept = ""
    if sid is not None:
        body = {
            "attempt": attempt,
            "directory": sid,
            "workdir": str(root),
            "left": captured.left,
            "left_more": captured.left_more,
        }
        try:
            retry(lambda: api.record_outputs(job_id, body), what="outputs: record them")
        except ApiRefused as exc:  # the attempt was replaced meanwhile: not ours to record
            return f"[ddpq] outputs not recorded: {exc}\n"
        n = sum(e.size for e in captured.written)
        links = sum(1 for e in captured.entries if e.symlink is not None and e.path not in code)
        written = f"{file_count(len(captured.written))}, {human_bytes(n)}"
        if links:
            written += f" and {links} link(s)"
        kept = (
            f"[ddpq] outputs: {written} written beyond its code, kept: `ddpq outputs {job_id}` "
            f"lists and downloads them, `ddpq resubmit --resume {job_id}` runs on in a copy "
            "of this directory\n"
        )
    left = ""
    if captured.left:
        named = ", ".join(f"{x['path']} ({x['why']})" for x in captured.left[:5])
        more = len(captured.left) - 5 + captured.left_more
        left = f"[ddpq] outputs left on this worker only: {named}" + (
            f" and {more} more\n" if more > 0 else "\n"
        )
    return kept + left + where(root, lim)


def where(root: Path, lim: Limits) -> str:
    """The job log's line on where its directory is and when it goes. True whether or
    not the job goes on (an attempt preempted or retried is no end of it)."""
    newest = (
        f", and for as long as the job is one of its owner's {lim.keep_newest} newest "
        "ended jobs (DDPQ_WORKDIR_KEEP_NEWEST)"
        if lim.keep_newest
        else ""
    )
    return (
        f"[ddpq] its directory {root} stays on this worker (closed to other jobs): a later "
        "attempt of the job here goes on in it, and once the job has ended it stays "
        f"{duration(lim.retention_s)} (DDPQ_WORKDIR_RETENTION){newest}\n"
    )


def duration(seconds: float) -> str:
    """'7 d', '3 h', '90 s'."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"
