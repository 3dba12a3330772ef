"""The `ddpq` command with its modules imported ahead, which tests fork instead of starting
a new interpreter for each `ddpq serve` and each CLI call.

Starting `ddpq serve` spends most of its CPU importing (FastAPI, SQLAlchemy, pydantic,
uvicorn, alembic, the service's modules: about a second of CPU each start, hundreds of
starts a run), a CLI call most of its 0.3 s. The zygote imports them once, then on each
request forks a child that runs the very command line the test gave, with the test's
environment, working directory, input and output files: ``ddpq.cli`` run as `python -m
ddpq.cli` runs it (runpy), in a process of its own that tests signal, kill -9 and wait
for as they would a subprocess (Forked). tests/test_serve_and_cli.py holds a forked
command's output, errors and exit code to a new interpreter's.

What differs from a new interpreter, and why no test minds: the child's
/proc/PID/environ is the zygote's (os.environ is set after the fork; the kernel keeps the
environment a process was exec'd with), and the modules it imported ahead were imported
under the zygote's environment (none of ddpq's reads a setting at import: Settings() and
the CLI read them when the command runs). Workers, `ddpq up` and the commands a test
follows as they run (tests/test_cli.py's Run) start as plain subprocesses.

Protocol: one request per connection on a Unix socket, a JSON line {argv, env, cwd,
stdin, stdout, stderr} (the three are paths: the zygote opens them in the child);
the zygote answers {"pid": N}, then {"status": CODE} when the child ends (Popen's
returncode: negative for a signal). It exits when its stdin closes (the pytest process
that started it is gone), killing the servers it forked.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any


def _preload() -> None:
    """What every `ddpq serve` imports before it answers (python -X importtime), alembic's
    command for service.db.upgrade at every start."""
    import alembic.command  # noqa: F401
    import sqlalchemy.dialects.postgresql.psycopg
    import sqlalchemy.dialects.sqlite.pysqlite  # noqa: F401

    import ddpq.cli  # noqa: F401
    import service.main  # noqa: F401


def _child(request: dict[str, Any], zygotes: list[int]) -> None:
    """In the forked child: become the requested `ddpq` command, then exit with its code.
    ``zygotes``: the zygote's descriptors (its socket, its connections), closed first."""
    code = 1
    try:
        for fd in zygotes:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter's
        os.chdir(request["cwd"])
        for fd, path, flags in (
            (0, request["stdin"], os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        ):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["argv"]]  # runpy sets argv[0], as `python -m` does
        runpy.run_module("ddpq.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve(path: str) -> None:
    """Answer fork requests on ``path`` until stdin closes."""
    _preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pytest's ^C is pytest's to handle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}  # child pid: the connection to tell its end
    print("ready", flush=True)
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
                return
            if listener in ready:
                conn, _ = listener.accept()
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    mine = [listener.fileno(), conn.fileno()]
                    _child(request, [*mine, *(c.fileno() for c in waiting.values())])
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
            while waiting:
                try:
                    pid, raw = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                told = waiting.pop(pid, None)
                if told is not None:
                    with contextlib.suppress(OSError):  # nobody waits for it any more
                        told.sendall(json.dumps({"status": _status(raw)}).encode() + b"\n")
                    told.close()
    finally:
        for pid in waiting:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Forked:
    """A forked `ddpq` command, with the part of subprocess.Popen's interface tests use:
    its output goes to files (``stdout``, and ``stderr``, by default the same file)."""

    def __init__(
        self,
        socket_path: str,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        stdout: Path,
        stderr: Path | None = None,
        stdin: Path | None = None,
    ) -> None:
        self.args = argv
        self.returncode: int | None = None
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(socket_path)
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "stdin": str(stdin or os.devnull),
            "stdout": str(stdout),
            "stderr": str(stderr or stdout),
        }
        self.conn.sendall(json.dumps(request).encode() + b"\n")
        # Both answers may arrive in one read: kept here, not in a file's buffer.
        self.received = b""
        first = self._line(None)
        assert first is not None
        self.pid: int = first["pid"]

    def _line(self, timeout: float | None) -> dict[str, int] | None:
        """The zygote's next answer; None at a timeout, EOFError if the zygote is gone."""
        while b"\n" not in self.received:
            if timeout is not None and not select.select([self.conn], [], [], timeout)[0]:
                return None
            chunk = self.conn.recv(4096)
            if not chunk:
                raise EOFError("the zygote closed the connection")
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        answer: dict[str, int] = json.loads(line)
        return answer

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            try:
                answer = self._line(timeout)
            except EOFError:  # no status at all: the zygote is gone, and killed it going
                answer = {"status": -signal.SIGKILL}
            if answer is None:
                return None
            self.returncode = answer["status"]
            self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
