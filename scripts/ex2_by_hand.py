# Written by notebooks/09_build_it_yourself.ipynb - edit it there; running the notebook rewrites this file.
# ruff: noqa: F401, PIE790, RUF059 - a stub: `...` marks the gaps you fill in; some names are used then
"""Exercise 2: data parallelism by hand, without DistributedDataParallel.

    torchrun --standalone --nproc-per-node=2 scripts/ex2_by_hand.py

Every rank trains a copy of a small MLP on its share of each global batch. For the copies to stay identical,
and equal to one process training on the whole batch, (a) they must start from the same weights and (b) each
step must apply the same gradient: the average over the ranks of their gradients.
Fill in the gaps marked `...  # TODO`; the check compares both ranks with one process after every step.
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="global: split between the ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex2")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a rank waits for the others")
    return parser.parse_args()


def start_from_the_same_weights(model):
    """(a) Make every rank's parameters equal to rank 0's."""
    ...  # TODO (a): every rank's parameters equal to rank 0's


def average_gradients(model, world_size):
    """(b) After backward(): replace every gradient by its average over the ranks."""
    ...  # TODO (b): every gradient replaced by its average over the ranks


def main():
    args = parse_args()
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = ...  # TODO (c): its accelerator number local_rank if each process has one, else the CPU
    ...  # TODO (c): join the group: that device's backend, timeout=timedelta(seconds=args.timeout)
    data = regression_data(args.steps * args.batch_size, seed=args.seed)
    torch.manual_seed(args.seed + rank)  # each rank seeds differently (as for augmentation): its own weights
    model = mlp(8, 32, 32, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    start_from_the_same_weights(model)
    trace = Trace(args.out, rank, model)  # for the checker: the parameters after every step
    for step in range(args.steps):
        x, y = data[step * args.batch_size:(step + 1) * args.batch_size]  # the global batch of this step
        x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)  # this rank's share
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        average_gradients(model, world_size)
        optimizer.step()
        trace.step(model, loss)
    trace.save()
    if rank == 0:
        print(f"{args.steps} steps on {world_size} ranks, last loss (rank 0's share) {loss.item():.4f}")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
