"""What an attempt starts as: its launch prepared one way for every executor (code
directory, program, resume checkpoint, the ranks' environment), its interpreter (a
virtualenv for its requirements), torchrun's command line and the launcher's around it,
the warm launcher's worker side, its output shipped as it runs, and how a stopped attempt
ends.

It may import ``files``, ``walled`` and ``edges``, and the entry modules it starts
processes as (``worker.entry``, ``worker.tee``, ``worker.zygote``); never ``executors``.
"""
