"""The warm launcher's process (docs/training.md): ``python -u -P -m worker.zygote SOCKET PARENT``.

A process with torch imported that forks each attempt's torchrun instead of the worker
exec'ing a cold one: a trivial 2-rank torchrun spends almost all of its 3.7-4.1 s in
three ``import torch`` (torchrun's, then each rank's). The worker (worker.starting.warm) starts one
per (interpreter, environment) with an environment scrubbed to the ranks' allow-list
(worker.starting.torchrun.INHERITED_ENV): it never holds a secret, since every fork inherits its
memory. It imports torch and what torchrun's agent imports, starts no thread and leaves
CUDA alone (each rank makes its own context after the fork), then answers on SOCKET.

One attempt, as this process and its forks run it:

- ``worker.launch`` (the attempt's supervisor, as for a cold torchrun) connects and sends
  the attempt's request (torchrun's arguments, the ranks' environment, working directory,
  uid:gid when walled) with its stdin, stdout and stderr. This process never reads it (the
  request carries the job's token, and this memory is every later job's): it forks, and
  tells the supervisor the child's pid, later the child's exit status (as waitpid gives it).
- The child, the attempt's **agent**, reads the request, takes its fds, drops to the job's
  uid when walled (groups, gid, uid, no_new_privs, before any job code), writes the attempt's
  launch id into the environment the kernel shows (/proc/PID/environ: how worker.edges.procs finds
  an attempt's processes, which a fork cannot otherwise change), takes the job's environment
  and directory, and runs ``worker.tee``'s torchrun: torch's own elastic agent, so restarts
  (max_restarts), rendezvous (c10d, multi-node), error files, exit codes and the log's whole
  prefixed lines stay torchrun's code. Only how a rank starts differs.
- Before torchrun's agent starts a thread, the agent forks a **template**: the pristine
  state (torch imported, nothing of torchrun's agent run). Where torchrun would Popen
  ``python -u -P -m worker.entry PROGRAM`` (torch's SubprocessHandler), the agent asks the
  template for a rank instead: it forks, the fork forks the rank and exits, and the rank,
  an orphan, becomes the agent's child (the agent is a child subreaper), so torchrun's
  agent polls, signals and reaps it as it does a Popen'd rank. The rank starts a session
  of its own (as torchrun's ``start_new_session``), takes its output files, the
  environment torchrun gives it, reseeds what a fresh interpreter seeds, and runs the
  program through worker.entry, which ends it by os._exit.

What a rank can tell apart from one torchrun exec'd is listed in docs/training.md
(the warm launcher) and checked by tests/test_warm.py with tests/launcher_probe.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

# The placeholder a zygote's environment carries in the launch id's variable
# (worker.edges.procs.LAUNCH_ID_VAR), overwritten in place in each agent (worker.edges.procs finds
# an attempt's processes by it in /proc). Long enough for any launch id; it never starts like
# one (worker.edges.procs.launch_prefix: a worker's name, then @).
LAUNCH_ID_VAR = "DDPQ_LAUNCH_ID"
PLACEHOLDER = "@" * 512
# The modules imported before any fork: torch and what torchrun's agent and the usual
# training program import (a job needing another module just imports it). torch._dynamo
# too: every optimizer's first add_param_group imports it (torch._disable_dynamo), which
# took a forked rank 1.1 s (sympy and all) of every job that trains (bench/sweep.py).
WARM_MODULES = (
    "torch",
    "torch._dynamo",
    "torch.nn",
    "torch.nn.functional",
    "torch.optim",
    "torch.utils.data",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.run",
    "torch.distributed.elastic.multiprocessing.errors",
    "ddpq.train",
)
READY = b"ready\n"
MAX_REQUEST = 16 << 20
RANK_ENTRY = ("-u", "-P", "-m", "worker.entry")  # worker.starting.torchrun.RANK_ENTRY

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


# ---- the zygote ------------------------------------------------------------------------


def main() -> None:
    path, parent = sys.argv[1], int(sys.argv[2])
    # It dies with the worker thread that started it (worker.starting.warm keeps one for it); its
    # agents then get SIGTERM (their own death signal) and stop their ranks as torchrun does.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)
    from worker import tee  # noqa: F401  the agent's code, imported here once

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.write(1, READY)
    serve(listener)


def serve(listener: socket.socket) -> None:
    """Fork an agent per connection; tell each its agent's pid, then its exit status.

    Each agent's end is waited on by a pidfd in the same select as the listener: an exit is
    told the moment it happens (a poll's interval would be added to every attempt)."""
    agents: dict[int, tuple[socket.socket, int]] = {}  # pid: (its connection, its pidfd)
    while True:
        pidfds = {fd: pid for pid, (_, fd) in agents.items()}
        ready, _, _ = select.select([listener.fileno(), *pidfds], [], [], 1.0)
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                try:
                    for _, fd in agents.values():  # nothing of another attempt goes with it
                        os.close(fd)
                    _agent(conn, [listener, *(c for c, _ in agents.values())])
                finally:
                    os._exit(70)
            agents[pid] = (conn, os.pidfd_open(pid))
            with contextlib.suppress(OSError):
                conn.sendall(b"pid %d\n" % pid)
        while agents:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in agents:
                conn, fd = agents.pop(pid)
                os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
                conn.close()


# ---- an attempt's agent (a fork of the zygote) -----------------------------------------


def _agent(conn: socket.socket, others: list[socket.socket]) -> None:
    for other in others:
        other.close()
    request, fds = _receive(conn)
    conn.close()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    uid, gid = request.get("uid"), request.get("gid")
    if (
        uid is not None and gid is not None
    ):  # walled: the job's identity before any of its code runs
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_DUMPABLE, 1)  # as after an exec: its /proc files are its own
    # Set after the uid changes (which clear it): the zygote's death (the worker's) stops it.
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _show_launch_id(str(request["env"].get(LAUNCH_ID_VAR, "")))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    template = _Template.fork()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    status = _torchrun(request["argv"], template)
    _flush()
    os._exit(status)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) != 4 or len(fds) != 3:
        raise SystemExit("worker.zygote: a request without its header or its 3 fds")
    (size,) = struct.unpack("!I", head)
    if size > MAX_REQUEST:
        raise SystemExit("worker.zygote: request too large")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise SystemExit("worker.zygote: request cut short")
        body += chunk
    request: dict[str, Any] = json.loads(body)
    return request, list(fds)


def _show_launch_id(launch_id: str) -> None:
    """Write ``launch_id`` over the placeholder in this process's initial environment, the
    bytes /proc/PID/environ shows (between env_start and env_end of /proc/PID/stat)."""
    if not launch_id:
        return
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    env_start = int(fields[47])  # field 50 of stat; fields[0] is field 3
    with open("/proc/self/environ", "rb") as f:
        shown = f.read()
    needle = f"{LAUNCH_ID_VAR}={PLACEHOLDER}".encode()
    at = shown.find(needle)
    value = launch_id.encode()
    if at < 0 or len(value) > len(PLACEHOLDER):
        raise SystemExit("worker.zygote: no room for the launch id in the environment")
    start = env_start + at + len(LAUNCH_ID_VAR) + 1
    ctypes.memmove(start, value + b"\0" * (len(PLACEHOLDER) - len(value)), len(PLACEHOLDER))


def _torchrun(argv: list[str], template: _Template) -> int:
    """worker.tee's torchrun with the ranks forked by ``template``; its exit status."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    from worker import tee

    popen = subprocess_handler.SubprocessHandler._popen

    def fork_rank(handler: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        if tuple(args[1:5]) != RANK_ENTRY:  # not a rank of ddpq's: as torchrun would
            return popen(handler, args, env)
        out = handler._stdout.fileno() if handler._stdout else 1
        err = handler._stderr.fileno() if handler._stderr else 2
        return template.rank(list(args[5:]), env, out, err)

    subprocess_handler.SubprocessHandler._popen = fork_rank  # type: ignore[method-assign,assignment]
    sys.argv = ["torchrun", *argv]
    try:
        tee.main()
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        sys.stderr.write(f"{code}\n")
        return 1
    except BaseException:  # what the interpreter does with an uncaught one
        import traceback

        traceback.print_exc()
        return 1
    return 0


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _Template:
    """The agent's pristine fork (no thread, nothing of torchrun run), which forks ranks."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    @classmethod
    def fork(cls) -> _Template:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                _template_loop(theirs)
            finally:
                os._exit(0)
        theirs.close()
        return cls(pid, ours)

    def rank(self, args: list[str], env: dict[str, str], out: int, err: int) -> ForkedRank:
        body = json.dumps({"args": args, "env": env}).encode()
        socket.send_fds(self.sock, [struct.pack("!I", len(body))], [out, err])
        self.sock.sendall(body)
        line = b""
        while not line.endswith(b"\n"):
            chunk = self.sock.recv(64)
            if not chunk:
                raise OSError("worker.zygote: the rank template is gone")
            line += chunk
        return ForkedRank(int(line), args)


def _template_loop(sock: socket.socket) -> None:
    while True:
        try:
            request, fds = _receive_rank(sock)
        except (OSError, SystemExit):
            return
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:  # forks the rank and leaves it to the agent (the subreaper)
            os.close(read_end)
            middle = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                sock.close()
                while os.getppid() == middle:  # until it is the agent's (its first act)
                    time.sleep(0.0005)
                _rank(request, fds)
            os.write(write_end, b"%d\n" % pid)
            os._exit(0)
        os.close(write_end)
        for fd in fds:
            os.close(fd)
        with os.fdopen(read_end, "rb") as pipe:
            pid_line = pipe.readline()
        os.waitpid(middle, 0)  # once it is reaped, the rank is the agent's child
        sock.sendall(pid_line or b"-1\n")


def _receive_rank(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, 4, 2)
    if len(head) != 4:
        raise SystemExit
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise SystemExit
        body += chunk
    return json.loads(body), list(fds)


def _rank(request: dict[str, Any], fds: list[int]) -> None:
    """One rank: what Popen(start_new_session=True, env=..., stdout=, stderr=) and
    ``python -u -P -m worker.entry PROGRAM`` give it, then the program."""
    try:
        os.setsid()
        for target, fd in zip((1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        _exec_dispositions()
        _reseed()
        _compiler_paths()
        from worker import entry

        sys.argv = [entry.__file__, *request["args"]]
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    entry.main()
    os._exit(0)  # entry.main leaves by os._exit


def _exec_dispositions() -> None:
    """The signal dispositions an exec from torchrun's agent gives a rank. The agent
    handles TORCHELASTIC_SIGNALS_TO_HANDLE (torch's PContext.start), and exec resets a
    handled signal to its default, so a Popen'd rank starts with them at SIG_DFL (SIGINT:
    Python's KeyboardInterrupt) even where the worker was started with them ignored (a
    `nohup`, a background job of a script: SIGHUP, SIGINT, SIGQUIT). This fork of the
    template inherited the ignoring instead: undo it as the exec would have."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(
                    sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                )


def _reseed() -> None:
    """What a fresh interpreter seeds from the system's entropy, seeded again: every fork
    of one zygote would otherwise draw the same numbers."""
    random = sys.modules.get("random")
    if random is not None:
        random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:  # its CPU generator (CUDA's is seeded as CUDA starts, after this)
        torch.random.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def _compiler_paths() -> None:
    """The paths torch's compiler settles from the working directory as its config modules
    are imported (this process's, not the job's, which the rank's import would have
    seen), settled again: where inductor's debug traces and the minifier's repros go
    (``./torch_compile_debug``) and inductor's XPU CUTLASS directory. The expressions are
    torch's own (torch/_dynamo/config.py, torch/_inductor/config.py)."""
    dynamo: Any = sys.modules.get("torch._dynamo.config")
    if dynamo is not None and hasattr(dynamo, "default_debug_dir_root"):
        dynamo.debug_dir_root = dynamo.default_debug_dir_root()
    inductor = sys.modules.get("torch._inductor.config")
    xpu = getattr(inductor, "xpu", None)
    if xpu is not None and hasattr(xpu, "cutlass_dir"):
        xpu.cutlass_dir = os.path.realpath(os.environ.get("TORCHINDUCTOR_CUTLASS_DIR", ""))


class _Signalled:
    """``send_signal``, ``terminate`` and ``kill`` as a Popen has them, for a process
    held by other means (``_signal``): nothing once it has ended, nothing if it is gone."""

    returncode: int | None

    def _signal(self, sig: int) -> None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedRank(_Signalled):
    """A forked rank as torch's SubprocessHandler holds a Popen: pid, poll, wait."""

    def __init__(self, pid: int, args: list[str]) -> None:
        if pid <= 0:
            raise OSError("worker.zygote: the rank could not be forked")
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its status unknown
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def _signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


# ---- the supervisor's side (worker.launch) -----------------------------------------------


def strip_tee(argv: list[str]) -> list[str]:
    """torchrun's arguments out of worker.starting.torchrun.argv's command line (``PYTHON -P -m
    worker.tee ARGS``)."""
    if argv[1:4] != ["-P", "-m", "worker.tee"]:
        raise ValueError(
            "the warm launcher runs worker.starting.torchrun.argv's command lines only"
        )
    return argv[4:]


class WarmChild(_Signalled):
    """An attempt's torchrun forked by a warm process, as worker.launch holds a Popen:
    ``wait(timeout)``, ``send_signal``, ``kill``. Its exit status comes from the warm
    process (its parent); if that dies first, from the agent's end (pidfd)."""

    def __init__(
        self, path: str, argv: list[str], uid: int | None = None, gid: int | None = None
    ) -> None:
        request = {
            "argv": strip_tee(argv),
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "uid": uid,
            "gid": gid,
        }
        body = json.dumps(request).encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        socket.send_fds(self._sock, [struct.pack("!I", len(body))], [0, 1, 2])
        self._sock.sendall(body)
        self._buf = b""
        first = self._line(None)
        if not first or not first.startswith(b"pid "):
            raise OSError("the warm launcher did not fork the attempt")
        self.pid = int(first.split()[1])
        self._pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> bytes | None:
        """The next line from the warm process; b"" when it is gone, None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], left)
            if not ready:
                return None
            chunk = self._sock.recv(256)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        line = self._line(timeout)
        if line is None:
            raise subprocess.TimeoutExpired("warm", timeout or 0)
        if line.startswith(b"exit "):
            self.returncode = int(line.split()[1])
        else:  # the warm process died: wait for the agent itself
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("warm", timeout or 0)
            self.returncode = -signal.SIGKILL
        return self.returncode

    def _signal(self, sig: int) -> None:
        signal.pidfd_send_signal(self._pidfd, sig)  # by its pidfd: never a reused pid


if __name__ == "__main__":
    main()
