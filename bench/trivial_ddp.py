"""The trivial 2-rank job of bench/overhead.py: a gloo process group formed, one barrier,
and gone. Its wall time is start-up and tear-down only."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
