"""ddpq checkpoints: a job's registered checkpoints and what retention made of each."""

from __future__ import annotations

from typing import Any

from ddpq.cli.base import (
    JsonOpt,
    _age,
    _client,
    _fit_table,
    _print_json,
    _print_table,
    _say,
    _text,
    client_command,
)
from ddpq.snapshot import human_bytes


def _state(c: dict[str, Any]) -> str:
    """kept, kept (keep=True), pruning, pruned or refused."""
    state = str(c.get("state") or "kept")
    return f"{state} (keep)" if c.get("keep") and state == "kept" else state


@client_command()
def checkpoints(job_id: int, as_json: JsonOpt = False) -> None:
    """List a job's checkpoints, oldest first.

    Step, size, when saved, whether it is kept (keep: saved with keep=True), pruning,
    pruned or refused (its worker would not delete it), and its path on the worker (a
    directory a framework wrote ends with /).
    Only the job's newest keep_last stay while it runs; an ended job's go after the
    server's checkpoint retention (docs/checkpoints.md).

    --json prints {"items": [Checkpoint]}.
    """
    with _client() as client:
        items = client.checkpoints(job_id)
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
