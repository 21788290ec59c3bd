# Written by notebooks/04_pitfalls.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfalls 5 and 6 of notebook 04: how processes find each other, and which rank each one is.

Two nodes (on real machines use node 0's address instead of 127.0.0.1; same command on every node):
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        scripts/pitfall_rendezvous.py
Add --bug on both to use LOCAL_RANK as the global rank, as some tutorials do.
"""
import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from course.args import positive_float
from course.errors import record
from course.hardware import backend_for, pick_device


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", action="store_true", help="use LOCAL_RANK as the global rank")
    parser.add_argument("--timeout", type=positive_float, default=60, help="process-group timeout, seconds")
    args = parser.parse_args()
    local_rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    # RANK is unique across all nodes; LOCAL_RANK restarts at 0 on every node and only picks the device.
    rank = local_rank if args.bug else int(os.environ["RANK"])  # BUG when --bug
    print(f"node {os.environ['GROUP_RANK']} ({socket.gethostname()}): RANK={os.environ['RANK']} "
          f"LOCAL_RANK={local_rank} WORLD_SIZE={world_size} MASTER_ADDR={os.environ['MASTER_ADDR']} "
          f"MASTER_PORT={os.environ['MASTER_PORT']} -> joining as rank {rank}", flush=True)
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    ranks = torch.tensor([float(rank)], device=device)
    dist.all_reduce(ranks)
    print(f"rank {rank}: all_reduce of the ranks = {ranks.item():.0f} "
          f"(expected {world_size * (world_size - 1) // 2})", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
