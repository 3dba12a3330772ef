"""The executors: what claims attempts and sees them through, on this host (the agent, a
runner per attempt) or through Slurm (the bridge), under one loop of register, claim,
heartbeat and finish; the worker's settings; each attempt's trace.

The top room: it may import ``starting``, ``files``, ``walled`` and ``edges``, and of the
entry modules ``worker.health`` (whose heartbeat file the loop writes). Nothing of the
worker imports it but ``worker.slurmnode`` (an entry module) and the ``ddpq worker``
command.
"""
