# Reference solution of exercise 6c of notebooks/09_build_it_yourself.ipynb: look after you have tried.
"""Exercise 6c (debugging lab): DDP with gradient accumulation: a larger batch than fits in memory at once.

    torchrun --standalone --nproc-per-node=2 scripts/ex6c_debug.py --batch-size 8 --accum 4

Each optimizer step accumulates the gradients of --accum micro-batches of --batch-size per process; DDP
all-reduces only on the last micro-batch (no_sync before). It should train exactly like --accum 1 with
batches of 4 x 8 = 32 per process.
Bug report: "With --accum 4 the loss jumps around and the run diverges, unless I divide the learning rate
by 4."
"""
import argparse
import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course.exercise_tasks import Trace, lab_datasets, mlp
from course.hardware import backend_for, pick_device


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch, per process")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex6c")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a rank waits for the others")
    return parser.parse_args()


def main():
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)
    train_set, _ = lab_datasets()
    model = DDP(mlp(8, 32, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(train_set, seed=args.seed)
    batches = iter(DataLoader(train_set, args.batch_size, sampler=sampler))  # after the model: draws a seed
    trace = Trace(args.out, rank, model.module)  # for the checker: the parameters after every step

    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.accum):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            last = micro == args.accum - 1
            with nullcontext() if last else model.no_sync():  # all-reduce once, on the last micro-batch
                loss = nn.functional.mse_loss(model(x), y)
                # The fix: backward() adds to .grad, so accum backward passes add up accum mean losses;
                # dividing each by accum makes the sum the mean over the accum x batch-size samples.
                (loss / args.accum).backward()
        optimizer.step()
        trace.step(model.module, loss)
        if rank == 0:
            print(f"step {step}: loss of the last micro-batch {loss.item():.4f}", flush=True)
    trace.save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
