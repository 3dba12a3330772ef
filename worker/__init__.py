"""The agent on each GPU host: claims jobs over HTTP, runs torchrun, supervises it.

It never opens the database and never imports ``service``: everything it does
goes through the API with the worker token.

Its rooms, from the top down (each imports only the rooms below it; docs/architecture.md,
tests/test_architecture.py): ``executors`` (what claims attempts and sees them through),
``starting`` (what an attempt starts as: its launch, interpreter, command line, output),
``files`` (what of a job this host keeps on disk), ``walled`` (each attempt under a uid
of its own), ``edges`` (the worker's one way to each thing outside it: the API, NVML, the
kernel's processes and OOM records).

The entry modules stay here at the top: they are the command lines that running workers,
torchrun, containers and Slurm name (``python -m worker.entry``, ``worker.tee``,
``worker.zygote``, ``worker.launch``, ``worker.slurmnode``, ``worker.health``), and a
worker in the middle of an upgrade still starts them by those names.
"""
