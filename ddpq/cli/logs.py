"""ddpq logs: a job's output, stored and live, with the log's offsets kept straight."""

from __future__ import annotations

import codecs
import sys
from collections.abc import Iterable, Iterator
from typing import Annotated

import typer

from ddpq.cli.base import _client, _print_json_line, client_command
from ddpq.client import Client
from ddpq.rules import visible
from ddpq.wire import marker_resume


def _stored_log(c: Client, job_id: int, offset: int) -> Iterator[tuple[int, bytes]]:
    """What is stored from ``offset`` now; the API answers it in pieces of bounded size."""
    while True:
        data, next_offset, _ = c.logs(job_id, offset)
        if not data:
            return
        yield offset, data
        # Not offset + len(data): a cut marker in the answer counts for no offset.
        offset = next_offset


def _log_lines(chunks: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    """Whole lines (without the newline) and the byte offset each starts at; chunks
    may cut a line, or a UTF-8 character, anywhere."""
    pending = b""
    start = 0
    for offset, chunk in chunks:
        if not pending:
            start = offset
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield start, line
            # After a cut marker the output goes on at the offset it names.
            resume = marker_resume(line)
            start = resume if resume is not None else start + len(line) + 1
    if pending:
        yield start, pending


@client_command()
def logs(
    job_id: int,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream until the job ends")
    ] = False,
    offset: Annotated[int, typer.Option(min=0, help="start at this byte of the log")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help='JSON lines: {"offset": byte, "text": line}')
    ] = False,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="the bytes as the program wrote them, terminal escape sequences and "
            "carriage returns included (a progress bar redraws itself)",
        ),
    ] = False,
) -> None:
    """Print a job's combined output; -f follows it until the job ends.

    Control characters other than newline and tab are shown escaped (ESC as \\x1b)
    unless --raw: a program's output must not drive the terminal of whoever reads it.
    """
    with _client() as c:
        chunks = c.follow_logs(job_id, offset) if follow else _stored_log(c, job_id, offset)
        if as_json:
            for at, line in _log_lines(chunks):
                _print_json_line({"offset": at, "text": line.decode("utf-8", "replace")})
        elif raw:
            for _, chunk in chunks:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
        else:
            # A chunk may end inside a UTF-8 character; bytes that are not UTF-8
            # show as \xNN too. A carriage return is escaped as well: it would let a
            # line overwrite its own [rankN] prefix with, say, a forged [ddpq] line.
            decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
            for _, chunk in chunks:
                sys.stdout.buffer.write(visible(decoder.decode(chunk), keep="\n\t").encode())
                sys.stdout.flush()
            rest = decoder.decode(b"", final=True)
            sys.stdout.buffer.write(visible(rest, keep="\n\t").encode())
