# Reference solution of exercise 6b of notebooks/09_build_it_yourself.ipynb: look after you have tried.
"""Exercise 6b (debugging lab): train a small MLP with DDP for a few epochs.

    torchrun --standalone --nproc-per-node=2 scripts/ex6b_debug.py

Bug report: "It trains, but the losses of epoch 1 go up and down exactly like those of epoch 0, step by step."
"""
import argparse
import os
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
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex6b")
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
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    model = DDP(mlp(8, 32, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trace = Trace(args.out, rank, model.module)  # for the checker: the parameters after every step

    for epoch in range(args.epochs):
        # The fix: the sampler's order comes from seed + epoch, so its epoch must be set *before* the loop
        # that reads this epoch's data (it was called after it, so that epoch 1 repeated epoch 0's order).
        sampler.set_epoch(epoch)
        losses = []
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trace.step(model.module, loss)
            losses.append(round(loss.item(), 3))
        if rank == 0:
            print(f"epoch {epoch}: losses of rank 0's first steps {losses[:6]}", flush=True)
    trace.save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
