"""A job's code on this worker: contents fetched once into a shared cache, and a working
directory of its own for each job, written from its snapshot's manifest.

- The cache (DATA_DIR/code-cache) holds contents by sha256, shared by every job. A
  content is fetched into a temporary file, checked against its digest and size, and
  renamed into place: a damaged or forged content is refused, never used; two jobs
  needing the same content wait for one fetch. Past its size cap, the contents used
  least recently go (never those a job is being written from).
- What is copied out of the cache is checked against its digest every time, after the
  copy, in the job's own file: a job of the same user (an unwalled worker, see
  worker.walled.walls) can rewrite a cached file, and the next job holding that content must
  run what was uploaded, not what the other job wrote. A content that fails is fetched
  again. Walled, the cache is the worker's alone (0700) as well.
- A job's directory (DATA_DIR/jobs/job-ID-RANDOM) is written by copying from the cache
  (a reflink where the filesystem can), never by hard links, through which a program
  could rewrite the cache and so every later job. Its name is made here, unguessable,
  and the directory is created by this process: a directory a job planted under a name
  it could predict is never taken for another job's. It is written under a temporary
  name and renamed when whole, kept across the job's attempts on this worker while this
  process lives (nothing on disk says which directory is whose, so a restarted worker
  writes a new one), and removed once the service says its retention is over
  (service.outputs: a period after the job ended, none for its owner's newest jobs). A
  new job never runs in an old one's directory: `ddpq resubmit --resume` gets a fresh
  one written from the snapshot its worker sent of the old one (worker.files.outputs).
- A retry runs in its job's directory as the last attempt left it (what the program
  wrote there is still there) only if nothing changed it since: the worker seals it
  (worker.walled.seal) when the attempt ends, once its processes are gone, and on the retry
  checks that seal and every file and link of the snapshot against the manifest (by its
  digest, through directory descriptors, following no link). Unwalled, every job can
  write every other's directory, between attempts as well; and the program's own code
  may have been changed while it ran. A directory that fails either check is not
  repaired in place (which would mean writing where a job may have put links) but
  replaced by a fresh one written from the snapshot: what the last attempt wrote there
  was sent to the API as it ended (worker.files.outputs), and checkpoints live elsewhere.
- Nothing from the wire is trusted: every path and link of the manifest is checked
  again here (ddpq.snapshot), files are created with O_EXCL|O_NOFOLLOW, and links
  are made last, so no write ever goes through one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ddpq.errors import ApiRefused, ApiUnavailable, JobError, SnapshotError, Stopped
from ddpq.snapshot import Entry, checked, file_count, human_bytes, write_out
from worker.edges.api import WorkerAPI, retry
from worker.walled.seal import seal

T = TypeVar("T")
log = logging.getLogger("ddpq.worker")

FICLONE = 0x40049409  # ioctl: share the source's blocks (btrfs, XFS); else a plain copy
LEGACY_MARK = ".snapshot"  # what an older worker left beside a job's directory

# Streams a content's bytes: fetch(digest) yields chunks.
Fetch = Callable[[str], Iterator[bytes]]


class BlobCache:
    """Contents by digest, fetched once, checked, size-capped."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._pinned: Counter[str] = Counter()
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        for stale in (root / "tmp").iterdir():  # a fetch cut off by a crash
            stale.unlink(missing_ok=True)

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    @contextlib.contextmanager
    def pinned(self, digests: set[str]) -> Iterator[None]:
        """While a job is written from these contents, trimming leaves them be."""
        with self._lock:
            self._pinned.update(digests)
        try:
            yield
        finally:
            with self._lock:
                self._pinned.subtract(digests)
                self._pinned = +self._pinned

    def ensure(self, digest: str, size: int, fetch: Fetch) -> bool:
        """Have ``digest`` in the cache; True if it was fetched now."""
        with self._lock:
            one = self._fetching.setdefault(digest, threading.Lock())
        with one:
            path = self.path(digest)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_size == size:
                    os.utime(path, follow_symlinks=False)  # used now: trimming goes by use
                    return False
            self.drop(digest)  # a link or a device a job put in its place, or a damaged one
            tmp = self.root / "tmp" / f"{digest}.{uuid.uuid4().hex}"
            try:
                h = hashlib.sha256()
                got = 0
                with open(tmp, "wb") as f:
                    # Arriving decompressed where the API sent zstd (httpx decodes it):
                    # more than the manifest's size is refused as it comes, not on disk.
                    for chunk in fetch(digest):
                        got += len(chunk)
                        if got > size:
                            raise JobError(
                                f"code content {digest[:16]} from the API is longer than "
                                f"its {size} bytes: refused"
                            )
                        h.update(chunk)
                        f.write(chunk)
                got = tmp.stat().st_size
                if h.hexdigest() != digest or got != size:
                    raise JobError(
                        f"code content {digest[:16]} from the API does not match its digest "
                        f"(sha256 {h.hexdigest()[:16]}, {got} bytes): refused"
                    )
                tmp.chmod(0o444)
                path.parent.mkdir(exist_ok=True)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            return True

    def drop(self, digest: str) -> None:
        """Forget a content (it failed its digest after a copy): fetched again when next needed."""
        path = self.path(digest)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()

    def trim(self) -> None:
        """Remove the least recently used contents until the cache fits its cap."""
        with self._lock:
            pinned = set(self._pinned)
        files = []
        for sub in self.root.iterdir():
            if sub.name == "tmp" or not sub.is_dir():
                continue
            for p in sub.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p.name in pinned:
                continue
            p.unlink(missing_ok=True)
            total -= size


@dataclass
class Written:
    """What writing a job's directory took: contents fetched, and how long."""

    fetched: int
    fetched_bytes: int
    files: int
    seconds: float
    reused: bool = False
    why_fresh: str | None = None  # an earlier attempt's directory was not reused: why


def write_tree(
    manifest: list[dict[str, Any]], cache: BlobCache, dest: Path, fetch: Fetch
) -> Written:
    """Write the snapshot's files (copied from the cache) and links into ``dest``, which
    must not exist yet; a manifest that breaks a rule is refused before anything is."""
    started = time.monotonic()
    try:
        entries = checked(manifest)
    except SnapshotError as exc:
        raise JobError(f"code snapshot refused: {exc}") from None
    files = [e for e in entries if e.digest is not None]
    fetched = fetched_bytes = 0

    def fill(e: Entry, fd: int) -> None:
        nonlocal fetched, fetched_bytes
        assert e.digest is not None
        for _ in range(2):
            if cache.ensure(e.digest, e.size, fetch):
                fetched += 1
                fetched_bytes += e.size
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)  # copy_file_range writes at the file's offset
            _copy(cache.path(e.digest), fd)
            if _digest_of(fd) == e.digest:
                return
            # Changed in the cache since it was fetched (another job of this user
            # rewrote it): fetched again, and the copy made again.
            log.warning("code content %s in the cache was altered; fetching it again", e.digest)
            cache.drop(e.digest)
        raise JobError(f"code content {e.digest[:16]} ({e.path}) keeps changing in the cache")

    with cache.pinned({e.digest for e in files if e.digest}):
        try:
            write_out(entries, dest, fill)
        except SnapshotError as exc:
            raise JobError(f"code snapshot refused: {exc}") from None
        except OSError as exc:  # a path the rules allow, too long under this data dir; a full disk
            where = f" ({str(exc.filename)[-200:]})" if exc.filename else ""
            raise JobError(f"its code cannot be written here: {exc.strerror}{where}") from None
    cache.trim()
    return Written(fetched, fetched_bytes, len(files), time.monotonic() - started)


def _copy(src: Path, out: int) -> None:
    """A private copy into ``out`` (a reflink where the filesystem shares blocks): never
    a hard link, through which a program could rewrite the cache. Never through a link,
    and never from a FIFO or a device a job put in the cache's place (it would block or
    read forever): what is not a regular file copies as nothing, and fails its digest."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.ioctl(out, FICLONE, f.fileno())
            return
        except OSError:
            pass
        size = os.fstat(f.fileno()).st_size
        copied = 0
        while copied < size:
            n = os.copy_file_range(f.fileno(), out, size - copied)
            if n == 0:
                break
            copied += n


def _digest_of(fd: int) -> str:
    """The sha256 of what ``fd`` holds (read from its start; the page cache has it)."""
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def fetched(call: Callable[[], T], what: str, stop: threading.Event, failed: str) -> T:
    """``call`` (a fetch through the API for an attempt), waiting out an API that is away
    (Stopped once ``stop`` is set); a refusal fails the attempt (JobError: ``failed``,
    then the refusal)."""
    try:
        result: T = retry(call, what=what, stop=stop)
    except ApiRefused as exc:
        raise JobError(f"{failed}: {exc}") from None
    except ApiUnavailable:  # only once a stop was asked for: the API is waited out
        raise Stopped() from None
    return result


# How long a job's next attempt waits for an earlier one on this worker to end (its
# processes killed after the grace, its outputs sent) before writing a new directory.
EARLIER_ATTEMPT_WAIT_S = 120.0


class Workdirs:
    """The jobs' working directories on this worker, and when each may go."""

    def __init__(self, data_dir: Path, cache_bytes: int, keep_s: float) -> None:
        self.root = data_dir / "jobs"
        self.root.mkdir(parents=True, exist_ok=True)
        for partial in self.root.glob(".job-*"):  # a write cut off by a crash
            _remove(partial)
        for mark in self.root.glob(f"job-*{LEGACY_MARK}"):
            mark.unlink(missing_ok=True)
        self.cache = BlobCache(data_dir / "code-cache", cache_bytes)
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._jobs: dict[int, threading.Condition] = {}
        # job id -> its directory, as this process made it and its last attempt left it.
        # Nothing on disk is trusted to say it.
        self._made: dict[int, _Made] = {}
        self._ended: dict[int, float] = {}  # job id -> when the service said it ended

    def prepare(
        self, job_id: int, snapshot_id: str, manifest: Callable[[], list[dict[str, Any]]],
        fetch: Fetch,
    ) -> tuple[Path, Written]:  # fmt: skip
        """The job's directory holding snapshot ``snapshot_id``: the one this process
        wrote for an earlier attempt if it is as that attempt left it and holds the
        snapshot's code, else a new one written now."""
        with self._lock:
            one = self._jobs.setdefault(job_id, threading.Condition())
            self._ended.pop(job_id, None)
        with one:
            made = self._made.get(job_id)
            # An earlier attempt still being stopped here (lost to the service, or
            # replaced, while its processes run): its end seals the directory for this one.
            if made is not None and made.running:
                one.wait_for(lambda: not made.running, timeout=EARLIER_ATTEMPT_WAIT_S)
            why = None
            if made is not None and made.snapshot_id == snapshot_id:
                why = made.changed()
                if why is None:
                    made.sealed = None  # this attempt's now: sealed again as it ends
                    made.running = True
                    return made.path, Written(0, 0, 0, 0.0, reused=True)
                log.warning("job %s: its directory %s %s: written afresh", job_id, made.path, why)
            if made is not None:
                _remove(made.path)
            dest = self.root / f"job-{job_id}-{secrets.token_hex(8)}"
            raw = manifest()
            written = write_tree(raw, self.cache, dest, fetch)
            written.why_fresh = why
            # Checked by write_tree: kept to check the directory again on a retry.
            self._made[job_id] = _Made(
                dest, snapshot_id, [Entry.of(item) for item in raw], running=True
            )
            return dest, written

    def attempt_ended(self, job_id: int) -> None:
        """An attempt of the job ended here and no process of it runs: its directory is
        sealed as it left it, for the retry to check (a job that ends goes anyway)."""
        with self._lock:
            one = self._jobs.get(job_id)
        if one is None:
            return
        with one:
            made = self._made.get(job_id)
            if made is not None and _is_real_dir(made.path):
                made.sealed = seal(made.path)
            if made is not None:
                made.running = False
                one.notify_all()

    def fetch(
        self, api: WorkerAPI, job_id: int, snapshot_id: str, stop: threading.Event
    ) -> tuple[Path, Written]:
        """The job's directory of its code snapshot, fetched through ``api`` if need be: an
        API that is away is waited for (Stopped once ``stop`` is set), a refusal fails the
        attempt (JobError)."""
        workdir, written = fetched(
            lambda: self.prepare(
                job_id, snapshot_id, lambda: api.snapshot(snapshot_id).manifest, api.blob
            ),
            f"fetch the code of job {job_id}",
            stop,
            "its code could not be fetched",
        )
        return Path(workdir), written

    def path_of(self, job_id: int) -> Path | None:
        """The directory this process made for the job, if it is still there."""
        with self._lock:
            made = self._made.get(job_id)
        return made.path if made is not None and _is_real_dir(made.path) else None

    def kept(self) -> list[int]:
        """The jobs whose directories are here (this process's, an earlier one's, or
        what a job made under such a name: each goes once its job has ended)."""
        return sorted({j for j, _ in self._on_disk()})

    def _on_disk(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.root.glob("job-*"):
            name = p.name.removeprefix("job-").partition("-")[0]
            if name.isdigit():
                out.append((int(name), p))
        return out

    def ended(self, job_ids: list[int], running: set[int]) -> None:
        """The service says these jobs ended: remove their directories once the
        retention period has passed (unless an attempt of one runs here again)."""
        now = time.monotonic()
        with self._lock:
            for job_id in job_ids:
                self._ended.setdefault(job_id, now)
            due = [j for j, t in self._ended.items() if now - t >= self.keep_s and j not in running]
        for job_id in due:
            with self._lock:
                one = self._jobs.setdefault(job_id, threading.Condition())
            with one:
                for j, path in self._on_disk():
                    if j == job_id:
                        _remove(path)
            with self._lock:
                self._ended.pop(job_id, None)
                self._jobs.pop(job_id, None)
                self._made.pop(job_id, None)


@dataclass
class _Made:
    """A job's directory this process wrote: where, from which snapshot (its checked
    entries), and its seal as its last attempt left it (None: not ended yet, or never
    sealed: not to be reused)."""

    path: Path
    snapshot_id: str
    entries: list[Entry]
    sealed: str | None = None
    running: bool = False  # an attempt runs in it (prepared, not ended yet)

    def changed(self) -> str | None:
        """Why this directory may not be reused, or None."""
        if self.sealed is None or not _is_real_dir(self.path):
            return "was not sealed as its last attempt ended"
        if seal(self.path) != self.sealed:
            return "changed after its last attempt ended"
        wrong = _first_unlike(self.path, self.entries)
        if wrong is not None:
            return f"no longer holds its code as sent ({wrong[:200]!r})"
        return None


def _first_unlike(root: Path, entries: list[Entry]) -> str | None:
    """The first path of the snapshot that ``root`` does not hold as the manifest says
    (a file of another content, mode or with a second name, a link elsewhere, anything
    else in its place, a parent that is not a directory), or None. Read through
    directory descriptors, following no link."""
    dirs: dict[str, int] = {}

    def dir_fd(rel: str) -> int:
        if rel not in dirs:
            parent, _, name = rel.rpartition("/")
            at = dir_fd(parent) if name else None
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            dirs[rel] = os.open(name if name else root, flags, dir_fd=at)
        return dirs[rel]

    try:
        for e in entries:
            parent, _, name = e.path.rpartition("/")
            try:
                at = dir_fd(parent)
                if e.symlink is not None:
                    if os.readlink(name, dir_fd=at) != e.symlink:
                        return e.path
                    continue
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=at)
            except OSError:
                return e.path
            try:
                st = os.fstat(fd)
                executable = bool(st.st_mode & stat.S_IXUSR)
                if (
                    not stat.S_ISREG(st.st_mode)
                    or st.st_nlink != 1
                    or st.st_size != e.size
                    or executable != e.executable
                    or _digest_of(fd) != e.digest
                ):
                    return e.path
            finally:
                os.close(fd)
    finally:
        for fd in dirs.values():
            os.close(fd)
    return None


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove(dest: Path) -> None:
    """Remove a job's directory (or whatever a job put under such a name), whatever its
    program left in it."""
    if not _is_real_dir(dest):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            dest.unlink()
        return
    # A program may have made parts of its directory read-only or unreadable.
    with contextlib.suppress(OSError):
        dest.chmod(0o700)
    for top, dirs, _ in os.walk(dest):  # top-down: a directory is opened after this
        for d in dirs:
            with contextlib.suppress(OSError):
                if not os.path.islink(os.path.join(top, d)):
                    os.chmod(os.path.join(top, d), 0o700)
    shutil.rmtree(dest, ignore_errors=True)


def describe(snapshot_id: str, workdir: Path, w: Written) -> str:
    """The job log's line about its code."""
    if w.reused:
        return f"[ddpq] code {snapshot_id[:12]}: reusing {workdir} from an earlier attempt\n"
    fresh = f"; the earlier attempt's directory {w.why_fresh}" if w.why_fresh else ""
    return (
        f"[ddpq] code {snapshot_id[:12]}: {file_count(w.files)} in {workdir} "
        f"({w.fetched} fetched, {human_bytes(w.fetched_bytes)}; {w.seconds:.1f} s){fresh}\n"
    )
