"""Runs a framework example (examples/frameworks/) as a job's program for
tests/test_frameworks.py and bench/frameworks.py.

``driver.py PROGRAM [ARGS]`` runs PROGRAM as ``__main__``, as ``python PROGRAM`` would, with
two things around ddpq.train (which the integrations call through the module):

- with ``--crash-once`` on a job's first attempt (``DDPQ_ATTEMPT=1``), rank 0 leaves with
  exit status 137, as after a kill -9, right after its first checkpoint is registered and
  sent (a framework's through ``register_checkpoint``, a plain program's through
  ``save_checkpoint``), so the job is retried and must resume from that checkpoint;
- at exit rank 0 prints the last values it reported, in full (``ddpq-last {json}``), for
  the final loss to be compared with a bare torchrun's.
"""

import atexit
import json
import os
import runpy
import sys

from ddpq import train

real_report = train.report
real_register = train.register_checkpoint
real_save = train.save_checkpoint
last: dict = {}
crash = sys.argv[1] == "--crash-once"
if crash:
    del sys.argv[1]


def report(step, *, epoch=None, total_steps=None, **values):
    if values:
        last.update({k: float(v) for k, v in values.items()}, step=step)
    return real_report(step, epoch=epoch, total_steps=total_steps, **values)


def crash_after(checkpoint, step):
    if checkpoint is not None and crash and os.environ.get("DDPQ_ATTEMPT") == "1":
        train.flush()
        print(f"driver: exit 137 after the checkpoint of step {step}", flush=True)
        os._exit(137)
    return checkpoint


def register_checkpoint(path, **kwargs):
    return crash_after(real_register(path, **kwargs), kwargs["step"])


def save_checkpoint(state, **kwargs):
    return crash_after(real_save(state, **kwargs), kwargs["step"])


def said() -> None:
    if last and train.is_master():
        print("ddpq-last " + json.dumps(last), flush=True)


train.report = report
train.register_checkpoint = register_checkpoint
train.save_checkpoint = save_checkpoint
atexit.register(said)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
