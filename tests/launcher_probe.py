"""What a rank can see of how it was started (tests/test_warm.py runs it under both
launchers and compares): ``launcher_probe.py OUT_DIR [EXIT_CODE]``."""

import json
import logging
import os
import random
import signal
import sys
import threading

import torch
import torch.distributed as dist

out = sys.argv[1]
rank = os.environ["RANK"]
seen = {
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path": sys.path,
    "env": dict(os.environ),
    "flags": list(sys.flags),
    "executable": sys.executable,
    "main_file": __file__,
    "main_spec": repr(__spec__),
    "signals": {
        s.name: repr(signal.getsignal(s))
        for s in signal.valid_signals()
        if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)
    },
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "own_session": os.getsid(0) == os.getpid(),
    "own_group": os.getpgrp() == os.getpid(),
    "threads": threading.active_count(),
    "tasks": len(os.listdir("/proc/self/task")),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "modules": sorted(sys.modules),
    "logging_handlers": len(logging.root.handlers),
    "num_threads": torch.get_num_threads(),
    "cuda_initialized": torch.cuda.is_initialized(),
    "stdout_line_buffering": sys.stdout.line_buffering,
    "stdout_write_through": sys.stdout.write_through,
    "random": random.random(),
    "torch_seed": torch.initial_seed(),
    "uid": os.getuid(),
    "umask": os.umask(0o022),
}
dist.init_process_group("gloo")
dist.barrier()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
if len(sys.argv) > 2 and rank == "1":
    sys.exit(int(sys.argv[2]))
