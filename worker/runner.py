"""Runs one attempt of one job: torchrun under supervision, its output shipped live."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpq.rules import entrypoint_problem, env_problem
from worker import procs
from worker.api import Refused, Unavailable, WorkerAPI, retry

if TYPE_CHECKING:
    from worker.agent import Agent

log = logging.getLogger("ddpq.worker")

MONITOR_INTERVAL_S = 0.1  # torchrun's check of its ranks; the default 5 s delays every exit
POLL_S = 0.1
LOG_SEND_INTERVAL_S = 0.5
LOG_CHUNK_BYTES = 512 * 1024
LOG_BUFFER_MAX_BYTES = 64 * 1024 * 1024
TAIL_LINES = 60
# Variables of the worker's own environment that ranks must not inherit.
# What a job inherits from the worker's environment: what programs, Python, CUDA, NCCL
# and the usual libraries read, and nothing else. An allow-list, not a deny-list: the
# worker's environment may hold anything its operator put there (a database password
# from an env file, cloud credentials), and job code is not trusted with any of it.
# A job sets anything else it needs in its spec's `env`.
INHERITED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
        "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "PYTHONPATH", "SSL_CERT_FILE",
        "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY",
        "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    }
)  # fmt: skip
INHERITED_PREFIXES = (
    "LC_", "CUDA_", "NCCL_", "NVIDIA_", "OMP_", "MKL_", "OPENBLAS_", "GLOO_", "TORCH_",
    "PYTORCH_", "HF_", "TRANSFORMERS_", "XDG_",
)  # fmt: skip

# Lines that name why a program failed: an exception, or argparse's "prog: error: ...".
# Any number of "[rank1]:" prefixes go first: torchrun adds one, and after
# init_process_group PyTorch's own excepthook adds another ("[rank1]: [rank1]: ValueError").
ERROR_LINE = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)*((?:[\w.]+(?:Error|Exception|Interrupt)\b.*)|(?:\S+: error: .*))$"
)
# Errors that follow from another rank's failure, not its cause: the ranks still in a
# collective see their peer's connection close, and torchrun reports its child failed.
CONSEQUENCE = re.compile(
    r"ChildFailedError|SignalException|torch\.distributed\.elastic|DistBackendError|"
    r"DistNetworkError|DistStoreError|gloo|NCCL|[Cc]onnection (?:closed|reset|refused)|"
    r"[Bb]roken pipe|ProcessGroup"
)
TORCHRUN_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def _catalog_module(recipe: str) -> str | None:
    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        return None
    catalog = Path(next(iter(spec.submodule_search_locations))) / "catalog.json"
    entry = json.loads(catalog.read_text()).get(recipe)
    return None if entry is None else str(entry["module"])


def _root_cause(tail: list[str]) -> str | None:
    """The error line that says why an attempt failed: the last one that is not a
    consequence of another rank's failure (else the last of those)."""
    errors = [m.group(1) for line in tail for m in [ERROR_LINE.match(line)] if m]
    causes = [e for e in errors if not CONSEQUENCE.search(e)]
    found = (causes or errors or [None])[-1]
    return found[:500] if found else None


def _inside_job_dir(path: str, job_id: int) -> bool:
    """A registered checkpoint is a regular file that stays, symlinks resolved, inside
    the ``job-<id>`` directory its path names (the API checked the path's text when it
    was registered; only the host that holds the file can check its links)."""
    parts = os.path.normpath(path).split(os.sep)
    name = f"job-{job_id}"
    if not os.path.isabs(path) or name not in parts[:-1]:
        return False
    job_dir = os.sep.join(parts[: len(parts) - parts[::-1].index(name)])
    real_dir = os.path.realpath(job_dir)
    real = os.path.realpath(path)
    return real.startswith(real_dir + os.sep) and os.path.isfile(real)


class JobError(Exception):
    """The attempt cannot start (bad entrypoint, unknown recipe): fail it with this reason."""


class LogShipper(threading.Thread):
    """Sends an attempt's output to the API in order, resending after failures."""

    def __init__(self, api: WorkerAPI, job_id: int, attempt: int) -> None:
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
            if len(self._buf) >= LOG_CHUNK_BYTES:
                self._cond.notify_all()

    def close(self, timeout_s: float) -> None:
        """Send what is left (retrying while the API is away) and stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.join(timeout_s)

    def run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                if not self._buf and not self._closing:
                    self._cond.wait(LOG_SEND_INTERVAL_S)
                if not self._buf:
                    if self._closing:
                        return
                    continue
                chunk = bytes(self._buf[:LOG_CHUNK_BYTES])
            try:
                self._sent = self.api.append_log(self.job_id, self.attempt, self._sent, chunk)
            except Unavailable:
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            except Refused as exc:
                log.warning("job %s: log refused (%s); no more output is sent", self.job_id, exc)
                with self._cond:
                    self._dead = True
                    self._buf.clear()
                return
            backoff = 0.5
            with self._cond:
                del self._buf[: len(chunk)]


CLAIM_HANDBACK_WAIT_S = 30.0
GANG_POLL_S = 2.0  # one long-poll on a forming gang; a stop request waits at most this
OUTPUT_POLL_S = 0.05  # how often the ranks' output file is read while it is quiet


@dataclass
class Outcome:
    exit_code: int | None
    outcome: str  # exited, cancelled, timeout, requeue, error
    reason: str | None = None


@dataclass
class JobRunner:
    agent: Agent
    claim: dict[str, Any]
    stop_reason: str | None = None
    stop_requested: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    # Set once the worker has signalled the attempt to stop: from then on torchrun's own
    # output (its SignalException traceback, 30 lines of it) is not the user's business;
    # the ranks' lines still are, and one [ddpq] line says what happened.
    stopping_since: float | None = None

    @property
    def job_id(self) -> int:
        return int(self.claim["job_id"])

    @property
    def attempt(self) -> int:
        return int(self.claim["attempt"])

    @property
    def launch_id(self) -> str:
        return f"{self.agent.launch_prefix}{self.job_id}/{self.attempt}"

    def start(self) -> None:
        # This thread starts torchrun and lives until it is gone: the parent-death
        # signal (worker.launch) fires when the starting *thread* ends.
        self.thread = threading.Thread(target=self._main, name=f"job-{self.job_id}", daemon=True)
        self.thread.start()

    def request_stop(self, why: str) -> None:
        """why: cancelled (by a user), abandoned (no longer ours), shutdown, timeout."""
        if self.stop_reason is None:
            self.stop_reason = why
        self.stop_requested.set()

    # ---- the attempt ------------------------------------------------------------------

    def _main(self) -> None:
        if self.claim.get("nnodes", 1) > 1:
            gang = self._await_gang()
            if gang is None:  # released (gang timeout, cancel) or stopped while forming
                self.agent.release(self)
                return
            # Every node writes where node 0's worker does and resumes from the same files.
            self.claim.update(
                gang=gang, checkpoint_dir=gang["checkpoint_dir"], resume_from=gang["resume_from"]
            )
        shipper = LogShipper(self.agent.api, self.job_id, self.attempt)
        shipper.start()
        gpus = self.claim["gpus"]
        where = f"GPUs {','.join(map(str, gpus))}" if gpus else "CPU"
        node = ""
        if gang := self.claim.get("gang"):
            node = (
                f", node {gang['node_rank']} of {gang['nnodes']} "
                f"(rendezvous {gang['rdzv_endpoint']}, id {gang['rdzv_id']})"
            )
        shipper.write(
            f"[ddpq] attempt {self.attempt} on worker {self.agent.name}: "
            f"{self.claim['nproc_per_node']} rank(s) on {where}{node}\n".encode()
        )
        try:
            result = self._run(shipper)
        except JobError as exc:
            result = Outcome(None, "error", str(exc))
        except Exception as exc:
            log.exception("job %s attempt %s: worker error", self.job_id, self.attempt)
            result = Outcome(None, "error", f"worker error: {exc}")
        finally:
            # Whatever happened, no process of this attempt may outlive it.
            if not procs.kill_all(self.launch_id):
                log.error("job %s: processes survived SIGKILL", self.job_id)
        if result.outcome == "error":
            shipper.write(f"[ddpq] {result.reason}\n".encode())
        shipper.close(timeout_s=60.0)
        self._report(result)
        self.agent.release(self)

    def _await_gang(self) -> dict[str, Any] | None:
        """Hold this node slot until every node of the attempt is held: the rendezvous
        to start torchrun with, or None if the slot was released or we were stopped.
        The worker's claim loop goes on meanwhile with its other free slots."""
        api = self.agent.api
        log.info(
            "job %s attempt %s: holding node slot %s of %s; waiting for the other nodes",
            self.job_id,
            self.attempt,
            self.claim["node_rank"],
            self.claim["nnodes"],
        )
        while True:
            if self.stop_requested.is_set():
                if self.stop_reason != "abandoned":  # abandoned: already released
                    with contextlib.suppress(Unavailable, Refused):
                        left = api.gang(self.job_id, self.attempt, 0, leave=True)
                        if left["state"] == "ready":
                            # The gang completed before we left: end the attempt for
                            # every node now instead of leaving them to our lease.
                            self._report(self._never_started())
                return None
            try:
                reply = api.gang(self.job_id, self.attempt, GANG_POLL_S)
            except Unavailable as exc:
                log.warning("gang: API unavailable (%s)", exc)
                self.stop_requested.wait(1.0)
                continue
            except Refused as exc:
                log.warning("job %s: gang refused (%s); standing down", self.job_id, exc)
                return None
            if reply["state"] == "ready":
                return reply
            if reply["state"] == "released":
                log.info("job %s: node slot released: %s", self.job_id, reply.get("reason"))
                return None

    def _never_started(self) -> Outcome:
        """How an attempt stopped before its processes started ends (see _outcome)."""
        if self.stop_reason == "cancelled":
            return Outcome(None, "cancelled", "cancelled by user")
        return Outcome(None, "requeue", "worker shut down")

    def _report(self, result: Outcome) -> None:
        if self.stop_reason == "abandoned":
            return  # the service already moved the job on; nothing to report
        if result.outcome == "requeue":
            # Hand the job back only once our own claim long-poll has ended: answered
            # earlier, it would wake that very poll and this stopping worker would take
            # the job again.
            self.agent.claimer_done.wait(timeout=CLAIM_HANDBACK_WAIT_S)
        body = {
            "attempt": self.attempt,
            "exit_code": result.exit_code,
            "outcome": result.outcome,
            "reason": result.reason,
        }
        try:
            # An exit status is never dropped: retry until the API takes it.
            retry(
                lambda: self.agent.api.finish(self.job_id, body), what=f"finish job {self.job_id}"
            )
        except Refused as exc:
            log.warning("job %s: finish refused: %s", self.job_id, exc)

    def _program(self, spec: dict[str, Any]) -> list[str]:
        if spec.get("recipe"):
            module = _catalog_module(spec["recipe"])
            if module is None:
                raise JobError(f"this worker has no recipe {spec['recipe']!r}")
            return ["-m", module, *spec.get("args", [])]
        workspace = self.agent.workspace
        # The API checked the spec; the worker checks again, since it runs the file.
        problem = entrypoint_problem(str(spec["entrypoint"]))
        if problem:
            raise JobError(f"entrypoint {str(spec['entrypoint'])[:200]!r} {problem}")
        path = (workspace / spec["entrypoint"]).resolve()
        # resolve() follows symlinks, so a link pointing out of the workspace is caught here.
        if not path.is_relative_to(workspace) or path == workspace:
            raise JobError(
                f"entrypoint {spec['entrypoint']!r} resolves outside the worker's workspace"
            )
        if not path.is_file():
            raise JobError(
                f"entrypoint {spec['entrypoint']!r} is not a file in the worker's workspace"
            )
        return [str(path), *spec.get("args", [])]

    def _env(self, resume_from: str | None) -> dict[str, str]:
        c = self.claim
        env = {
            k: v
            for k, v in os.environ.items()
            if k in INHERITED_ENV or k.startswith(INHERITED_PREFIXES)
        }
        for name, value in c["spec"].get("env", {}).items():
            problem = env_problem(str(name), str(value))
            if problem:  # the API refuses these at submission; never trust the wire
                raise JobError(f"env: {problem}")
            env[name] = value
        env.update(
            {
                "DDPQ_URL": self.agent.url,
                "DDPQ_JOB_ID": str(self.job_id),
                "DDPQ_JOB_TOKEN": c["token"],
                "DDPQ_ATTEMPT": str(self.attempt),
                "DDPQ_CHECKPOINT_DIR": c["checkpoint_dir"],
                "DDPQ_DEVICE": c["device"],
                procs.LAUNCH_ID_VAR: self.launch_id,
                "PYTHONUNBUFFERED": "1",
                # torchrun 2.14 shares its rendezvous store with the ranks' process group
                # by default; after a restart (max_restarts) the new ranks then read the
                # dead ranks' addresses and init_process_group fails (pytorch#135712).
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                # The ranks see only the GPUs the job holds, as cuda:0..n-1; none on a CPU job.
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, c["gpus"])),
            }
        )
        if resume_from:
            env["DDPQ_RESUME_FROM"] = resume_from
        # The one DDPQ_* setting of the worker's own that ranks get (others stay
        # private): where ddpq.train writes TensorBoard runs. Absolute, since ranks
        # run in the workspace, not in the worker's directory.
        tensorboard_dir = os.environ.get("DDPQ_TENSORBOARD_DIR")
        if tensorboard_dir:
            env["DDPQ_TENSORBOARD_DIR"] = str(Path(tensorboard_dir).resolve())
        return env

    def _rendezvous(self) -> list[str]:
        gang = self.claim.get("gang")
        if not gang:
            return ["--standalone", "--nnodes", "1"]  # single node: a c10d store on a free port
        # Several nodes: c10d rendezvous on node 0's worker, which hosts the store (said
        # outright rather than guessed from host names: on one machine every node's
        # address is its own). --local-addr makes the address the ranks' process group
        # uses (MASTER_ADDR) one the other hosts reach.
        conf = f"is_host={1 if gang['rdzv_host'] else 0},join_timeout={int(gang['join_timeout_s'])}"
        return [
            "--nnodes",
            str(gang["nnodes"]),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            gang["rdzv_endpoint"],
            "--rdzv-id",
            gang["rdzv_id"],
            "--rdzv-conf",
            conf,
            "--local-addr",
            self.agent.advertise_addr,
        ]

    def _argv(self, program: list[str], log_dir: Path) -> list[str]:
        spec = self.claim["spec"]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *self._rendezvous(),
            "--nproc-per-node",
            str(self.claim["nproc_per_node"]),
            "--max-restarts",
            str(spec.get("max_restarts", 0)),
            "--monitor-interval",
            str(MONITOR_INTERVAL_S),
            "--log-dir",
            str(log_dir),
            "--tee",
            "3",
            "--log-line-prefix-template",
            "[rank${rank}]: ",
            *program,
        ]

    def _run(self, shipper: LogShipper) -> Outcome:
        c = self.claim
        program = self._program(c["spec"])
        checkpoint_dir = Path(c["checkpoint_dir"])
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        resume_from = next(
            (p for p in c.get("resume_from", []) if _inside_job_dir(p, self.job_id)), None
        )
        if resume_from:
            shipper.write(f"[ddpq] resuming from {resume_from}\n".encode())
        log_dir = (
            self.agent.data_dir / "torchrun-logs" / f"job-{self.job_id}-attempt-{self.attempt}"
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            return self._supervise(program, log_dir, resume_from, shipper)
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)

    def _supervise(
        self, program: list[str], log_dir: Path, resume_from: str | None, shipper: LogShipper
    ) -> Outcome:
        spec = self.claim["spec"]
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        # torchrun writes to a file that this worker tails, not to a pipe: were the
        # worker killed, writes to a pipe with no reader would fail and torchrun's
        # log-tee threads hang forever instead of letting it exit (seen with 2.14).
        output = log_dir / "output.log"
        with open(output, "wb") as sink:
            proc = subprocess.Popen(
                procs.launcher_argv(self._argv(program, log_dir), self.agent.kill_grace_s),
                cwd=self.agent.workspace,
                env=self._env(resume_from),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, signalled as one
            )

        def pump() -> None:
            pending = b""
            with open(output, "rb") as f:
                while True:
                    exited = proc.poll() is not None
                    chunk = f.read(1 << 16)
                    if chunk:
                        *lines, pending = (pending + chunk).split(b"\n")
                        for line in lines:
                            if self.stopping_since is not None and not line.startswith(b"[rank"):
                                continue
                            shipper.write(line + b"\n")
                            tail.append(line.decode(errors="replace").rstrip())
                    elif exited:  # read to the end after the exit: nothing more comes
                        break
                    else:
                        time.sleep(OUTPUT_POLL_S)
            if pending:
                shipper.write(pending + b"\n")
                tail.append(pending.decode(errors="replace").rstrip())

        reader = threading.Thread(target=pump, name=f"out-{self.job_id}", daemon=True)
        reader.start()
        timeout_s = spec.get("timeout_s")
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        while proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                self.request_stop("timeout")
            if self.stop_requested.wait(POLL_S):
                self._terminate(proc)
                break
        code = proc.wait()
        # Killed itself (the group's SIGKILL after the grace period): 128 + N, as a shell says.
        code = code if code >= 0 else 128 - code
        procs.kill_all(self.launch_id)
        reader.join(timeout=30.0)
        if self.stopping_since is not None:
            took = time.monotonic() - self.stopping_since
            how = "SIGKILL" if code == 128 + signal.SIGKILL else "SIGTERM"
            shipper.write(
                f"[ddpq] {self._stop_words()}: stopped the ranks with {how} in "
                f"{took:.1f} s\n".encode()
            )
        return self._outcome(code, list(tail))

    def _stop_words(self) -> str:
        """Why the worker stopped the attempt, as the log's last line says it."""
        why = self.stop_reason
        if why == "cancelled":
            return "cancelled by user"
        if why == "timeout":
            return f"timeout after {self.claim['spec'].get('timeout_s')} s"
        if why == "shutdown":
            return "the worker is shutting down; the job goes back to the queue"
        return "no longer this worker's to run"

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the supervisor, which forwards it to torchrun (which stops its ranks);
        SIGKILL the group after the grace period."""
        self.stopping_since = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.agent.kill_grace_s)
        except subprocess.TimeoutExpired:
            procs.signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def _outcome(self, code: int, tail: list[str]) -> Outcome:
        why = self.stop_reason
        if why == "cancelled":
            return Outcome(code, "cancelled", "cancelled by user")
        if why == "timeout":
            return Outcome(
                code, "timeout", f"timeout after {self.claim['spec'].get('timeout_s')} s"
            )
        if why == "shutdown":
            return Outcome(code, "requeue", "worker shut down")
        if why == "abandoned":
            return Outcome(code, "error", "abandoned")
        if code == 0:
            return Outcome(0, "exited")
        # torchrun exits 1 whenever a rank fails; the rank's own code is in its summary.
        rank_codes = [
            int(m.group(1)) for line in tail for m in [TORCHRUN_EXITCODE.search(line)] if m
        ]
        exit_code = code if code >= 0 else 128 - code
        if rank_codes:
            rc = rank_codes[0]
            exit_code = rc if rc >= 0 else 128 - rc
        # The service puts the exit status into words; it gets the program's error.
        return Outcome(exit_code, "exited", _root_cause(tail))
