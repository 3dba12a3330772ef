"""ddpq checkpoints: a job's registered checkpoints and what retention made of each."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ddpq.cli.base import (
    EXIT_API,
    EXIT_USAGE,
    JsonOpt,
    _age,
    _client,
    _fail,
    _fit_table,
    _print_json,
    _print_table,
    _say,
    _text,
    client_command,
    err,
)
from ddpq.cli.code import _download, manifest_of
from ddpq.client import Client
from ddpq.snapshot import file_count, human_bytes

SEND_WAIT_S = 600.0  # for its worker to send it (a heartbeat, then the upload)


def _state(c: dict[str, Any]) -> str:
    """kept, kept (keep=True), pruning, pruned or refused."""
    state = str(c.get("state") or "kept")
    return f"{state} (keep)" if c.get("keep") and state == "kept" else state


@client_command()
def checkpoints(
    job_id: int,
    download: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="fetch a kept checkpoint (the newest, or --step's) into this new directory, "
            "from whichever worker holds it",
        ),
    ] = None,
    step: Annotated[
        int | None, typer.Option(metavar="STEP", help="with --download: the one of this step")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List a job's checkpoints, oldest first, or --download one.

    Step, size, when saved, whether it is kept (keep: saved with keep=True), pruning,
    pruned or refused (its worker would not delete it), and its path on the worker (a
    directory a framework wrote ends with /).
    Only the job's newest keep_last stay while it runs; an ended job's go after the
    server's checkpoint retention (docs/checkpoints.md).

    --json prints {"items": [Checkpoint]}.
    """
    if step is not None and download is None:
        _fail("--step picks the checkpoint --download fetches: give --download DIR too", EXIT_USAGE)
    with _client() as client:
        items = client.checkpoints(job_id)
        if download is not None:
            _fetch(client, job_id, items, step, download, as_json)
            return
    if as_json:
        _print_json({"items": items})
        return
    if not items:
        _say(f"job {job_id} has registered no checkpoint")
        return
    rows = [
        [
            str(c["step"]),
            "" if c.get("bytes") is None else human_bytes(c["bytes"]),
            f"{_age(c['created_at'])} ago",
            _state(c),
            c["path"] + ("/" if c.get("kind") == "dir" else ""),  # a framework's directory
        ]
        for c in items
    ]
    _print_table(_fit_table(["STEP", "SIZE", "SAVED", "STATE", "PATH"], rows, caps={}))
    expiring = sorted({c["expires_at"] for c in items if c.get("expires_at")})
    if expiring:
        _say(_text(f"kept until {expiring[0]} (the job ended; checkpoint retention)", "dim"))
    for ck in items:
        if ck.get("state") == "refused":
            _say(_text(f"step {ck['step']}: {ck.get('note') or 'not deleted'}", "dim"))


def _fetch(
    c: Client,
    job_id: int,
    items: list[dict[str, Any]],
    step: int | None,
    dest: Path,
    as_json: bool,
) -> None:
    """Ask for the checkpoint to be sent, wait for its worker to send it, write it."""
    kept = [ck for ck in items if ck.get("state") == "kept"]
    if step is not None:
        kept = [ck for ck in kept if ck["step"] == step]
    if not kept:
        at = f" at step {step}" if step is not None else ""
        _fail(f"job {job_id} has no checkpoint{at} kept (`ddpq checkpoints {job_id}`)", EXIT_API)
    ck = max(kept, key=lambda k: (k["step"], k["id"]))
    ck = c.send_checkpoint(job_id, ck["id"])
    deadline = time.monotonic() + SEND_WAIT_S
    told = False
    while ck.get("snapshot") is None and ck.get("send_problem") is None:
        if time.monotonic() > deadline:
            _fail(
                f"worker {ck.get('worker')} has not sent job {job_id}'s checkpoint at step "
                f"{ck['step']} in {SEND_WAIT_S:.0f} s: is it running? (`ddpq workers`)",
                EXIT_API,
            )
        if not told:
            err.print(
                _text(f"waiting for worker {ck.get('worker')} to send it..."), highlight=False
            )
            told = True
        time.sleep(1.0)  # its worker sends it at its next heartbeat, every few seconds
        ck = next((k for k in c.checkpoints(job_id) if k["id"] == ck["id"]), ck)
    if ck.get("snapshot") is None:
        _fail(f"job {job_id}'s checkpoint at step {ck['step']}: {ck['send_problem']}", EXIT_API)
    # A file, or a directory's files, under its name as it was on its worker.
    manifest = manifest_of(c.code(ck["snapshot"])["manifest"])
    _download(c, manifest, dest)
    if as_json:
        _print_json(ck)
        return
    _say(
        f"job {job_id}'s checkpoint at step {ck['step']}: {file_count(len(manifest))} "
        f"written to {dest}"
    )
