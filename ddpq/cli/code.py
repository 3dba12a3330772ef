"""A job's code (the snapshot it runs) and its outputs (what it wrote in its directory):
list them, or download them."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC
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
    _parse_time,
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


@client_command(name="outputs")
def outputs(
    job_id: int,
    download: Annotated[
        Path | None,
        typer.Option(metavar="DIR", help="write what the job wrote into this new directory"),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List what a job wrote in its directory beyond its code, or --download it.

    Its worker sends the directory as each attempt ends; it is kept for
    DDPQ_WORKDIR_RETENTION after the job ends, and while the job is one of its
    owner's newest (docs/outputs.md).
    """
    with _client() as c:
        outs = c.outputs(job_id)
        if download is not None:
            if outs["directory"] is None:
                _fail(f"job {job_id} has no outputs kept: {_none_why(c.job(job_id))}", EXIT_API)
            entries = manifest_of(outs["items"])
            if not entries:
                _fail(f"job {job_id} wrote nothing beyond its code", EXIT_API)
            _download(c, entries, download)
        elif outs["directory"] is None and not as_json:
            _say(f"job {job_id}: no outputs kept: {_none_why(c.job(job_id))}")
            return
    if as_json:
        _print_json(outs)
        return
    files = [i for i in outs["items"] if i.get("symlink") is None]
    if download is not None:
        _say(f"job {job_id}: {file_count(len(outs['items']))} written to {download}")
    else:
        rows = [
            [
                i["path"],
                human_bytes(i["size"]) if i.get("symlink") is None else f"-> {i['symlink']}",
                i["change"],
            ]
            for i in outs["items"]
        ]
        if rows:
            _print_table(_fit_table(["PATH", "SIZE", "CHANGE"], rows, caps={}))
        _say(
            f"job {job_id} wrote {file_count(len(files))}, {human_bytes(outs['bytes'])} "
            f"beyond its code (attempt {outs['attempt']}, {outs['worker']}:{outs['workdir']})"
        )
    for x in outs["left"]:
        size = f", {human_bytes(x['size'])}" if x.get("size") is not None else ""
        _say(f"  not kept here: {x['path']} ({x['why']}{size}): on its worker only")
    _say(_kept_words(outs))


def _none_why(job: dict[str, Any]) -> str:
    if not job["spec"].get("code"):
        return "it ran no code of its own (a recipe, or --no-code), so it had no directory"
    if job["status"] in ("queued", "running", "cancelling") and not job.get("attempt"):
        return "it has not run yet"
    return (
        "no attempt of it has ended yet on a worker that sends them, or they were "
        "collected after their retention (DDPQ_WORKDIR_RETENTION)"
    )


def _kept_words(outs: dict[str, Any]) -> str:
    if outs["kept_newest"]:
        return "kept for as long as it is one of its owner's newest ended jobs"
    if outs["kept_until"] is None:
        return "kept while the job runs, and for its retention after it ends"
    until = _parse_time(outs["kept_until"]).astimezone(UTC)
    return f"kept until {until:%Y-%m-%d %H:%M} UTC"


def manifest_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A listing's files and links (GET /jobs/{id}/outputs, /code/snapshots/{id}) as the
    manifest a download writes: a link its path and target, a file its content's."""
    return [
        {"path": i["path"], "symlink": i["symlink"]}
        if i.get("symlink") is not None
        else {k: i[k] for k in ("path", "digest", "size", "executable")}
        for i in items
    ]


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
