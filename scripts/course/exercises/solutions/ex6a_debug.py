# Reference solution of exercise 6a of notebooks/09_build_it_yourself.ipynb: look after you have tried.
"""Exercise 6a (debugging lab): train a small MLP with DDP and validate it after every epoch.

    torchrun --standalone --nproc-per-node=2 scripts/ex6a_debug.py

Bug report: "With one process it works. With two it hangs after the first epoch, until the timeout."
"""
import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.exercise_tasks import lab_datasets, mlp
from course.hardware import backend_for, pick_device


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex6a")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a rank waits for the others")
    return parser.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    """Mean squared error over the whole validation set: each rank sums over its part, the sums are added."""
    sums = torch.zeros(2, device=device)  # [sum of squared errors, number of samples]
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        sums += torch.stack([nn.functional.mse_loss(model(x), y, reduction="sum"),
                             torch.tensor(float(len(y)), device=device)])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item(), int(sums[1].item())


def main():
    args = parse_args()
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)
    train_set, val_set = lab_datasets()
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 64)
    model = DDP(mlp(8, 32, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        # The fix: every rank evaluates its part (evaluate() all-reduces the sums: every rank must call it);
        # only printing and saving stay on rank 0.
        val_mse, count = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: validation MSE {val_mse:.4f} over {count} samples", flush=True)
            history.append({"epoch": epoch, "mse": val_mse, "count": count})
            torch.save(model.module.state_dict(), out / "model.pt")
        dist.barrier()  # the others wait until rank 0 has saved
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps({"val": history}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
