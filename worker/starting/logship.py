"""Ships an attempt's output to the API in order, as it comes, and never twice; and runs
the process that writes it (torchrun, on a worker or a Slurm node) with a thread that
passes its output on line by line."""

from __future__ import annotations

import collections
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ddpq.errors import ApiRefused, ApiUnavailable
from ddpq.wire import Backoff

log = logging.getLogger("ddpq.worker")

LOG_SEND_INTERVAL_S = 0.5
LOG_CHUNK_BYTES = 512 * 1024
LOG_BUFFER_MAX_BYTES = 64 * 1024 * 1024
OUTPUT_POLL_S = 0.05  # how often the ranks' output file is read just after it was written
# ... and at least how often while it stays quiet: the read backs off to this (a loop that
# prints nothing costs the worker two wake-ups a second, not twenty, which on a host the
# ranks fill are taken from them). The exit wakes the wait at once.
OUTPUT_QUIET_POLL_S = 0.5
TAIL_LINES = 60  # of the output, kept to say why an attempt failed


class LogSink(Protocol):
    """Where an attempt's stream goes: the worker's API client, or a Slurm node's."""

    def append_log(self, job_id: int, attempt: int, offset: int, data: bytes) -> int: ...


class LogShipper(threading.Thread):
    """Sends an attempt's output to the API in order, resending after failures."""

    def __init__(self, api: LogSink, job_id: int, attempt: int) -> None:
        super().__init__(name=f"logs-{job_id}.{attempt}", daemon=True)
        self.api = api
        self.job_id = job_id
        self.attempt = attempt
        self._buf = bytearray()
        self._sent = 0  # bytes of this attempt's stream the API has stored
        self._dropped = 0
        self._cond = threading.Condition()
        self._closing = False
        self._dead = False

    def write(self, data: bytes) -> None:
        with self._cond:
            if self._dead:
                return
            if len(self._buf) + len(data) > LOG_BUFFER_MAX_BYTES:
                self._dropped += len(data)
                return
            if self._dropped:
                note = f"[ddpq] {self._dropped} bytes of output dropped: the API was unreachable\n"
                self._buf += note.encode()
                self._dropped = 0
            self._buf += data
            if len(self._buf) >= LOG_CHUNK_BYTES or len(self._buf) == len(data):
                self._cond.notify_all()  # a full chunk, or the first bytes to send

    def close(self, timeout_s: float) -> None:
        """Send what is left (retrying while the API is away) and stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.join(timeout_s)

    def run(self) -> None:
        backoff = Backoff()
        while True:
            with self._cond:
                # Asleep while there is nothing to send (a quiet job costs no wake-up);
                # then what comes within LOG_SEND_INTERVAL_S goes in one request.
                while not self._buf and not self._closing:
                    self._cond.wait()
                deadline = time.monotonic() + LOG_SEND_INTERVAL_S
                while (
                    not self._closing
                    and len(self._buf) < LOG_CHUNK_BYTES
                    and (left := deadline - time.monotonic()) > 0
                ):
                    self._cond.wait(left)
                if not self._buf:
                    if self._closing:
                        return
                    continue
                chunk = bytes(self._buf[:LOG_CHUNK_BYTES])
            try:
                self._sent = self.api.append_log(self.job_id, self.attempt, self._sent, chunk)
            except ApiUnavailable:
                backoff.wait()
                continue
            except ApiRefused as exc:
                log.warning("job %s: log refused (%s); no more output is sent", self.job_id, exc)
                with self._cond:
                    self._dead = True
                    self._buf.clear()
                return
            backoff.reset()
            with self._cond:
                del self._buf[: len(chunk)]


def pump(
    exited: threading.Event,
    output: Path,
    write: Callable[[bytes], None],
    tail: collections.deque[str],
    skip: Callable[[bytes], bool] | None = None,
) -> None:
    """Pass torchrun's output file on line by line as it is written, to the end (once
    ``exited`` is set), keeping the last lines in ``tail``; lines ``skip`` says are noise
    are dropped. The exit wakes the wait between reads: the end is read at once."""
    pending = b""
    pause = OUTPUT_POLL_S
    with open(output, "rb") as f:
        while True:
            done = exited.is_set()  # before the read: then the read sees all there is
            chunk = f.read(1 << 16)
            if chunk:
                pause = OUTPUT_POLL_S
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if skip is not None and skip(line):
                        continue
                    write(line + b"\n")
                    tail.append(line.decode(errors="replace").rstrip())
            elif done:  # read to the end after the exit: nothing more comes
                break
            else:
                exited.wait(pause)
                pause = min(pause * 2, OUTPUT_QUIET_POLL_S)
    if pending:
        write(pending + b"\n")
        tail.append(pending.decode(errors="replace").rstrip())


class Tailed:
    """A process started in its own process group (signalled as one), its output going to
    ``output``, which a thread passes on to ``write`` line by line (pump), keeping the last
    lines. A file, not a pipe: were this process killed, writes to a pipe with no reader
    would fail and torchrun's log-tee threads hang forever instead of letting it exit
    (seen with 2.14)."""

    def __init__(
        self,
        argv: list[str],
        output: Path,
        write: Callable[[bytes], None],
        *,
        env: dict[str, str],
        cwd: Path | None = None,
        skip: Callable[[bytes], bool] | None = None,
        name: str = "output",
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        with open(output, "xb") as sink:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # Set the moment the process exits (a thread blocked in waitpid, not a poll): its
        # supervisor (``on_exit``) and the reader learn of the end without a poll's delay.
        self.exited = threading.Event()
        self._on_exit = on_exit
        threading.Thread(target=self._wait, name=f"{name}-exit", daemon=True).start()
        self._reader = threading.Thread(
            target=pump, args=(self.exited, output, write, self.tail, skip), name=name, daemon=True
        )
        self._reader.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.exited.set()
        if self._on_exit is not None:
            self._on_exit()

    def exit_code(self) -> int:
        """Wait for the process: its exit code, 128 + N when signal N killed it (as a shell
        says)."""
        code = self.proc.wait()
        return code if code >= 0 else 128 - code

    def drain(self) -> list[str]:
        """Wait (a while) for the output to be passed on to its end: its last lines."""
        self._reader.join(timeout=30.0)
        return list(self.tail)
