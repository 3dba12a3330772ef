"""Attempt supervisor: ``python -m worker.launch PARENT_PID GRACE_S UID:GID|- --|WARM ARGV...``.

Runs ARGV (torchrun) as its child, under UID:GID when given (a walled attempt: see
worker.walled.walls; this process stays the worker's, so it can always stop the child), and
makes sure nothing of the attempt outlives the worker. It sets PR_SET_PDEATHSIG, so it
gets SIGTERM when the worker thread that started it dies (a killed worker); it then
SIGTERMs torchrun, which stops its ranks. torchrun does not always exit after that
(2.14 can hang joining its log-tee threads), and a SIGKILLed torchrun leaves its ranks
running as orphans, so after GRACE_S this process SIGKILLs torchrun and every process
carrying the attempt's DDPQ_LAUNCH_ID (walled: every process of the attempt's uid). It
exits with torchrun's status (128 + N for death by signal N); once it was told to stop,
with the signal that stopped the attempt: 143 (SIGTERM) when torchrun ended within the
grace period, 137 (SIGKILL) when it had to be killed, not the 1 torchrun exits with
after its SignalException.

The worker stops an attempt (cancel, timeout, shutdown) by sending SIGTERM to
this process, which forwards it, and SIGKILLs the whole process group if that
takes longer than its grace period. Setting the death signal here rather than in
``preexec_fn`` keeps the multi-threaded worker's fork safe.

It is not dumpable: its environment is the job's (the job token) or, under `ddpq up`,
the worker's (the worker token), and another process of its user must not read it.
Walled, it sets no_new_privs before it starts the child: nothing the job runs, a
set-uid file it made among them, gains a privilege by exec.

With ``--warm=SOCKET`` instead of ``--`` (the warm launcher), the child is not exec'd: a warm
process (worker.zygote) forks it, and this process holds it as it holds a Popen
(worker.zygote.WarmChild), the rest as above.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from worker import zygote
from worker.edges import procs

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38


def main() -> None:
    procs.make_undumpable()
    parent = int(sys.argv[1])
    grace_s = float(sys.argv[2])
    uid = gid = None
    if sys.argv[3] != "-":
        uid, gid = (int(x) for x in sys.argv[3].split(":"))
    warm_socket = sys.argv[4].removeprefix("--warm=") if sys.argv[4] != "--" else None
    argv = sys.argv[5:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if uid is not None and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    stop_at: list[float] = []
    started: list[subprocess.Popen[bytes] | zygote.WarmChild] = []
    killed: list[bool] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Forwarded once: torchrun answers a second SIGTERM by abandoning its cleanup.
        if not stop_at:
            stop_at.append(time.monotonic())
            signal.setitimer(signal.ITIMER_REAL, max(grace_s, 0.001))  # then on_alarm
            if started:
                started[0].send_signal(signal.SIGTERM)

    def on_alarm(_signum: int, _frame: object) -> None:
        # The grace period is over: torchrun is killed (its ranks go below).
        if started:
            killed.append(True)
            started[0].kill()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGALRM, on_alarm)
    if os.getppid() != parent:  # the worker died before prctl took effect
        sys.exit(128 + signal.SIGTERM)
    # extra_groups=[]: none of the worker's supplementary groups goes with the job.
    walled: dict[str, object] = (
        {} if uid is None else {"user": uid, "group": gid, "extra_groups": []}
    )
    child: subprocess.Popen[bytes] | zygote.WarmChild
    if warm_socket is not None:  # the warm process's fork drops to uid:gid itself
        child = zygote.WarmChild(warm_socket, argv, uid, gid)
    else:
        child = subprocess.Popen(argv, **walled)  # type: ignore[call-overload]
    started.append(child)
    if stop_at:  # stopped while starting: the alarm may have gone off before the child was
        child.send_signal(signal.SIGTERM)
        left = grace_s - (time.monotonic() - stop_at[0])
        signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))
    # A blocking wait, not a poll: the attempt's end is seen the moment torchrun exits (a
    # poll's interval would be added to every job). Signals interrupt it, run their
    # handlers above, and it goes on waiting (PEP 475).
    code = child.wait()
    signal.setitimer(signal.ITIMER_REAL, 0)
    # Ranks run in sessions of their own: whatever torchrun left behind goes now.
    launch_id = os.environ.get(procs.LAUNCH_ID_VAR)
    if uid is not None:
        procs.kill_uid(uid)
    elif launch_id:
        procs.kill_all(launch_id)
    if stop_at:
        sys.exit(128 + (signal.SIGKILL if killed else signal.SIGTERM))
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
