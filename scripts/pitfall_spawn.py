# Written by notebooks/04b_pitfalls_reference.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 11 (notebook 04b): a worker for torch.multiprocessing.spawn, in an importable file.

    python scripts/pitfall_spawn.py   # 2 processes started with mp.spawn, no torchrun
Spawned processes re-import their function by module and name; a notebook's functions live in the
kernel's __main__, which they cannot import, so a worker started from a notebook must come from a file.
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course.launcher import free_port


def worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # what torchrun would set for us
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"spawned rank {rank} of {world_size} (pid {os.getpid()}): all_reduce sum {total.item():.0f}", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(worker, args=(world_size, free_port()), nprocs=world_size)
