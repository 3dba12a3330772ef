"""A job's code: list the snapshot it runs, or download it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from ddpq.cli.base import (
    EXIT_API,
    EXIT_USAGE,
    JsonOpt,
    _client,
    _fail,
    _failed,
    _fit_table,
    _print_json,
    _print_table,
    _say,
    client_command,
)
from ddpq.client import Client
from ddpq.errors import SnapshotError
from ddpq.snapshot import Entry, checked, file_count, human_bytes, write_out


@client_command(name="code")
def code(
    job_id: int,
    download: Annotated[
        Path | None,
        typer.Option(help="write the snapshot's files into this new directory"),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the code a job runs (its snapshot), or --download it."""
    with _client() as c:
        job = c.job(job_id)
        summary = job.get("code")
        if summary is None:
            why = (
                "is no longer kept (collected after its retention period)"
                if job["spec"].get("code")
                else "was sent with none (a recipe, or --no-code)"
            )
            _fail(f"job {job_id}'s code {why}", EXIT_API)
        snap = c.code(summary["id"])
        if download is not None:
            _download(c, snap["manifest"], download)
    if as_json:
        _print_json(snap)
        return
    if download is not None:
        _say(f"job {job_id}: {file_count(snap['files'])} written to {download}")
        return
    rows = [
        [e["path"], human_bytes(e["size"]) if "digest" in e else f"-> {e['symlink']}"]
        for e in snap["manifest"]
    ]
    _print_table(_fit_table(["PATH", "SIZE"], rows, caps={}))
    _say(f"code {snap['id'][:12]}: {file_count(snap['files'])}, {human_bytes(snap['bytes'])}")


def _download(c: Client, manifest: list[dict[str, Any]], dest: Path) -> None:
    """Write the snapshot into ``dest`` by the rules the worker keeps (ddpq.snapshot):
    nothing is written of a manifest that breaks one (a link out, a .git directory), and
    what this machine refuses (a name too long here, a full disk) is one line, not a
    traceback."""
    try:
        if dest.exists():
            _fail(f"--download {dest} exists: name a new directory", EXIT_USAGE)
    except OSError as exc:  # a name too long here, a directory not readable
        _fail(f"cannot write the snapshot into {dest}: {_why(exc, dest)}", EXIT_USAGE)
    try:
        entries = checked(manifest)
    except SnapshotError as exc:
        _failed(exc, f"the API sent a manifest that breaks a rule: {exc}")

    def fill(e: Entry, fd: int) -> None:
        assert e.digest is not None
        data = c.code_blob(e.digest)
        if hashlib.sha256(data).hexdigest() != e.digest:
            _fail(f"the API sent {e.path} with another content than its digest", EXIT_API)
        with open(fd, "wb", closefd=False) as f:
            f.write(data)

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_out(entries, dest.resolve(), fill)
    except SnapshotError as exc:
        _failed(exc, f"the API sent a manifest that breaks a rule: {exc}")
    except OSError as exc:  # write_out has removed what it wrote
        _fail(f"cannot write the snapshot into {dest}: {_why(exc, dest)}", EXIT_USAGE)


def _why(exc: OSError, dest: Path) -> str:
    """An OSError in a line: its reason, and the snapshot's path it was writing (the
    file it names is under write_out's temporary directory beside ``dest``)."""
    why = exc.strerror or str(exc)
    if exc.filename is None:
        return why
    name = Path(os.fsdecode(exc.filename))
    if name.is_relative_to(dest.resolve().parent):
        parts = name.relative_to(dest.resolve().parent).parts[1:]
        name = Path(*parts) if parts else dest
    shown = str(name)
    return f"{why} ({shown[:200]}{'...' if len(shown) > 200 else ''})"
