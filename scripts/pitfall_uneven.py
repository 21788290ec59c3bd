# Written by notebooks/04_pitfalls.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 7 of notebook 04: one rank has one batch more than the others.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_uneven.py --timeout 10      # hangs, times out
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_uneven.py --fix drop-last  # equal shards
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_uneven.py --fix join       # Join handles it
"""
import argparse
import contextlib
import copy
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset

from course.args import positive_float, positive_int
from course.errors import record
from course.hardware import backend_for, pick_device


def share_of_own_gradient(model, x, y) -> float:
    """How much of this rank's own gradient DDP applied: DDP's (averaged) gradient projected on the
    gradient of this rank's batch alone (computed on a plain copy of the model)."""
    alone = copy.deepcopy(model.module)
    alone.zero_grad()  # the copy came with DDP's gradients
    nn.functional.cross_entropy(alone(x), y).backward()
    own = torch.cat([p.grad.flatten() for p in alone.parameters()])
    applied = torch.cat([p.grad.flatten() for p in model.module.parameters()])
    return (applied @ own / (own @ own)).item()


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", choices=["none", "drop-last", "join"], default="none")
    parser.add_argument("--samples", type=positive_int, default=65, help="65 on 2 ranks: 33 + 32 samples")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--timeout", type=positive_float, default=60, help="process-group timeout, seconds")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=args.timeout))
    world_size = dist.get_world_size()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 20), torch.randint(0, 2, (args.samples,)))
    # Each rank takes every world_size-th sample (like per-rank files): 33 and 32 samples, 5 and 4 batches.
    end = world_size * (len(data) // world_size) if args.fix == "drop-last" else len(data)  # fix: drop the rest
    loader = DataLoader(Subset(data, range(rank, end, world_size)), args.batch_size)
    model = DDP(nn.Linear(20, 2).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    print(f"rank {rank}: {len(loader.dataset)} samples, {len(loader)} batches", flush=True)  # the diagnosis
    fewest = torch.tensor(len(loader), device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # the steps that every rank takes

    start = time.monotonic()
    # Join: a rank that has run out of batches answers the others' all_reduces, with zero gradients,
    # until every rank is done. DDP still divides by the initial world size.
    with Join([model]) if args.fix == "join" else contextlib.nullcontext():
        for step, (x, y) in enumerate(loader, 1):
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP's gradient all_reduce: every rank must get here equally often
            if step > fewest:  # only this rank still has data
                print(f"rank {rank} step {step}: the others have joined; DDP applied "
                      f"{share_of_own_gradient(model, x, y):.2f} x this batch's own gradient", flush=True)
            optimizer.step()
    print(f"rank {rank}: trained on all its batches; waiting for the others", flush=True)
    dist.barrier()  # e.g. before rank 0 saves a checkpoint
    print(f"rank {rank}: done in {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
