# Written by notebooks/07_capstone_flowers.ipynb - edit it there; running the notebook rewrites this file.
"""When DDP sends rank 0's BatchNorm running statistics to the other ranks, and when it does not.

Each rank takes one training step on its own batch, so each updates its running mean differently. Then
the ranks evaluate in the ways a script might, and after each the largest difference between any rank's
running mean and rank 0's is recorded. DDP sends rank 0's buffers at the start of a forward through the
wrapper when the forward before it ran with gradients (torch/nn/parallel/distributed.py, _pre_forward).

    torchrun --standalone --nproc-per-node=2 scripts/ddp_buffers.py
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.args import repo_path
from course.errors import record
from course.hardware import backend_for, pick_device
from course.runlog import RunLog


def spread(bn, world_size):
    """Largest |running_mean of any rank - rank 0's|, the same number on every rank."""
    means = [torch.zeros_like(bn.running_mean) for _ in range(world_size)]
    dist.all_gather(means, bn.running_mean)
    return max((m - means[0]).abs().max().item() for m in means)


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=repo_path, default="runs/ddp_buffers")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = RunLog(args.run_dir, enabled=rank == 0, script="ddp_buffers", world_size=world_size)
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
    bn = model[1]
    ddp = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)  # broadcasts rank 0's
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)                          # parameters and buffers
    torch.manual_seed(1 + rank)
    x = torch.randn(16, 8, device=device) + rank  # each rank its own batch, with its own mean
    seen = {"at the start": spread(bn, world_size)}

    ddp(x).square().mean().backward()  # a training forward: each rank updates its own running mean
    optimizer.step()
    seen["after one training step"] = spread(bn, world_size)

    ddp.eval()
    with torch.no_grad():
        ddp.module(x)  # the plain model: DDP's forward, and its buffer sync, never run
        seen["after evaluating ddp.module"] = spread(bn, world_size)
        ddp(x)  # the first forward through DDP after a training forward: rank 0's buffers are sent first
        seen["after a no_grad forward through ddp"] = spread(bn, world_size)
        bn.running_mean += rank  # make the ranks differ again, by hand
        ddp(x)  # the forward before this one ran without gradients: nothing is sent
        seen["made to differ (+rank), then no_grad ddp again"] = spread(bn, world_size)
    log.finish(spread=seen)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
