"""What a rank can see of how it was started (tests/test_warm.py runs it under both
launchers and compares): ``launcher_probe.py OUT_DIR [EXIT_CODE] [--compile]``.

With ``--compile``, also what torch.compile does in the rank: the compilers' settings as
the rank sees them (a warm process imported them long before the job), a DDP step of a
compiled module (its loss and gradient, to the bit), and whether its compiled graph came
from the job owner's cache (the worker's TORCHINDUCTOR_CACHE_DIR) or was compiled here."""

import json
import logging
import os
import random
import signal
import sys
import threading

import torch
import torch.distributed as dist

args = [a for a in sys.argv[1:] if a != "--compile"]
out = args[0]
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


def compiled_step() -> tuple[dict, dict]:
    """What a compiled DDP step gives, and how its graph was had (cache hits and misses)."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    def shown(value: object) -> str:
        # A set's order is the string hash seed's, which differs from rank to rank.
        is_set = isinstance(value, (set, frozenset))
        return repr(sorted(value, key=repr)) if is_set else repr(value)

    # Settings many of which torch reads from the environment as it imports the module.
    config = {
        f"{name}.{key}": shown(value)
        for name, module in (
            ("dynamo", torch._dynamo.config),
            ("inductor", torch._inductor.config),
            ("functorch", torch._functorch.config),
        )
        for key, value in sorted(module.get_config_copy().items())
    }
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model = DDP(torch.compile(net, dynamic=False))  # as examples/frameworks/train_compile.py
    loss = model(torch.arange(32.0).reshape(8, 4) / 32).pow(2).mean()
    loss.backward()
    result = {
        "config": config,
        "loss": loss.item().hex(),
        "grad": [g.hex() for g in net.weight.grad.flatten().tolist()],
        "graphs": counters["stats"]["unique_graphs"],
    }
    cache = {k: counters["aot_autograd"][f"autograd_cache_{k}"] for k in ("hit", "miss")}
    return result, cache


dist.init_process_group("gloo")
if "--compile" in sys.argv:
    seen["compiled"], seen["compile_cache"] = compiled_step()
dist.barrier()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
if len(args) > 1 and rank == "1":
    sys.exit(int(args[1]))
