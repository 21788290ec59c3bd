# Written by notebooks/09_build_it_yourself.ipynb - edit it there; running the notebook rewrites this file.
# ruff: noqa: F401, PIE790, RUF059 - a stub: `...` marks the gaps you fill in; some names are used then
"""Exercise 5: shard the optimizer state across the ranks (ZeRO stage 1).

    torchrun --standalone --nproc-per-node=2 scripts/ex5_zero1.py

Adam keeps two extra tensors per parameter (exp_avg and exp_avg_sq): twice the parameters' memory, held by
every rank in plain data parallelism. Here each parameter has one owner rank. Every rank still averages all
gradients (as in exercise 2), but only the owner keeps Adam's state for a parameter and updates it; then the
owner sends the updated parameter to the other ranks. The result is exactly plain data-parallel Adam, with
each rank holding about 1/world_size of the optimizer state.
Fill in the gaps marked `...  # TODO`; the check compares both ranks with one process running Adam after
every step, and measures the optimizer state each rank holds.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from course.exercise_tasks import Trace, mlp, regression_data


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="global: split between the ranks")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex5")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a rank waits for the others")
    return parser.parse_args()


def assign_owners(params, world_size):
    """Each parameter's owner rank: the biggest first, each to the rank that owns the fewest elements."""
    load, owner = [0] * world_size, {}
    for p in sorted(params, key=lambda p: -p.numel()):
        rank = load.index(min(load))
        owner[p] = rank
        load[rank] += p.numel()
    return owner


def average_gradients(model, world_size):
    """As in exercise 2: every gradient replaced by its average over the ranks."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def main():
    args = parse_args()
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = ...  # TODO (d): its accelerator number local_rank if each process has one, else the CPU
    ...  # TODO (d): join the group: that device's backend, timeout=timedelta(seconds=args.timeout)
    data = regression_data(args.steps * args.batch_size, dim_in=32, dim_out=32, seed=args.seed)
    torch.manual_seed(args.seed)
    model = mlp(32, 32, 32, 32, 32).to(device)  # 4 layers of the same size: they split evenly
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # every rank starts from rank 0's weights
    owner = assign_owners(list(model.parameters()), world_size)

    mine = ...  # TODO (a): the parameters this rank owns (a list)
    optimizer = ...  # TODO (b): Adam (lr=args.lr) that keeps state for this rank's parameters only

    trace = Trace(args.out, rank, model)  # for the checker
    for step in range(args.steps):
        x, y = data[step * args.batch_size:(step + 1) * args.batch_size]  # the global batch of this step
        x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)  # this rank's share
        loss = nn.functional.mse_loss(model(x), y)
        model.zero_grad()  # every gradient: the optimizer only knows this rank's parameters
        loss.backward()
        average_gradients(model, world_size)
        optimizer.step()  # updates this rank's parameters only
        ...  # TODO (c): every rank must end the step with every parameter's updated value
        trace.step(model, loss)
    trace.save()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    print(f"rank {rank}: owns {len(mine)} of {len(owner)} parameters, Adam state {state} bytes", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
