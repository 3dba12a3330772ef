"""What a directory tree is, as no process can forge it: the worker seals what it made
(a requirements environment, worker.starting.venvs; a job's directory as an attempt leaves it,
worker.files.code) and uses it again only while the seal holds.

Each entry's path, type and mode, owner, size, inode and ctime: any write, chmod,
chown, link or rename sets an inode's ctime to now and nothing sets it back (only the
clock: root could, no job can), so a tree whose seal matches is the tree that was
sealed, whoever else could write it."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Collection
from pathlib import Path


def seal(root: Path, skip: Collection[str] = ()) -> str:
    """The seal of everything under ``root`` (not following links), but the paths in
    ``skip`` (relative to ``root``: marks the worker itself touches)."""
    h = hashlib.sha256()
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root)
            if rel in skip:
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                h.update(
                    f"{rel}\0{st.st_mode}\0{st.st_uid}\0{st.st_size}\0{st.st_ino}\0"
                    f"{st.st_ctime_ns}\n".encode(errors="surrogateescape")
                )
    return h.hexdigest()
