"""What every recipe shares: its arguments from catalog.json, and DDP set-up."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

CATALOG_PATH = Path(__file__).with_name("catalog.json")
_TYPES = {"int": int, "float": float, "str": str}


def load_catalog() -> dict[str, dict]:
    return json.loads(CATALOG_PATH.read_text())


def parse_args(recipe: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the recipe's arguments as catalog.json declares them, bounds included."""
    entry = load_catalog()[recipe]
    parser = argparse.ArgumentParser(prog=recipe, description=entry["description"])
    for arg in entry["args"]:
        parser.add_argument(
            arg["name"], type=_TYPES[arg["type"]], default=arg["default"], help=arg["help"]
        )
    ns = parser.parse_args(argv)
    for arg in entry["args"]:
        value = getattr(ns, arg["name"].lstrip("-").replace("-", "_"))
        if "min" in arg and value < arg["min"]:
            parser.error(f"argument {arg['name']}: must be at least {arg['min']}, got {value}")
        if "max" in arg and value > arg["max"]:
            parser.error(f"argument {arg['name']}: must be at most {arg['max']}, got {value}")
    return ns


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        """Rank 0 does the logging and the checkpointing."""
        return self.rank == 0


def setup() -> Dist:
    """Join the process group torchrun describes: nccl on a GPU, gloo on the CPU.

    ddpq's worker sets ``CUDA_VISIBLE_DEVICES`` to the GPUs the job holds and
    ``DDPQ_DEVICE`` to ``cuda`` or ``cpu``; a plain ``torchrun`` run picks CUDA
    when it is there.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    wanted = os.environ.get("DDPQ_DEVICE", "auto")
    use_cuda = wanted != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
