# Written by notebooks/04_pitfalls.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 2 of notebook 04: DistributedSampler without set_epoch(epoch) repeats one order every epoch.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_set_epoch.py              # never calls set_epoch
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_set_epoch.py --fix        # calls it every epoch
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_set_epoch.py --compare 3  # both, 3 seeds each
Each rank prints the first indices its sampler gives, per epoch (the diagnosis), then the val accuracy;
metrics.json keeps rank 0's whole orders compared with its first epoch's (seed 0): the same order? new samples?
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.args import nonnegative_int, positive_float, positive_int, repo_path
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.measure import compare
from course.models import build_model
from course.runlog import RunLog


def compared_with_first(orders: list[list[int]]) -> dict:
    """Each later epoch's order of this rank against its first: identical? which share of its samples is new?"""
    first = set(orders[0])
    return {"same_order": [order == orders[0] for order in orders[1:]],
            "new_samples": [sum(i not in first for i in order) / len(order) for order in orders[1:]],
            "per_epoch": len(orders[0])}


def train(args, call_set_epoch: bool, seed: int, train_set, val_part, num_classes, device,
          orders: dict | None = None) -> float:
    """Train the MLP from scratch; return the val accuracy over the whole validation set. ``orders``: where to
    keep this rank's sample orders, compared with its first epoch's (compared_with_first)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    sampler = DistributedSampler(train_set, seed=seed)  # shuffles with seed + epoch
    loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    model = DDP(build_model("mlp", num_classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    case = "with set_epoch" if call_set_epoch else "without set_epoch"
    seen = []
    for epoch in range(args.epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)  # the fix: a new permutation each epoch, the same one on every rank
        seen.append(list(sampler))  # this epoch's order of this rank's samples
        print(f"[{case}, seed {seed}] rank {rank} epoch {epoch}: first indices {seen[-1][:6]}",
              flush=True)  # the diagnosis
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        counts = sum(torch.stack([(model(x.to(device)).argmax(1) == y.to(device)).sum(),
                                  torch.tensor(len(y), device=device)]) for x, y in DataLoader(val_part, 1000))
    dist.all_reduce(counts)  # exact accuracy over the whole validation set (see pitfall 8)
    accuracy = counts[0].item() / counts[1].item()
    if orders is not None:
        orders[case] = compared_with_first(seen)
    if rank == 0:
        print(f"[{case}, seed {seed}] val accuracy {accuracy:.4f} after {args.epochs} epochs "
              f"({world_size} ranks)", flush=True)
    return accuracy


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", action="store_true", help="call sampler.set_epoch every epoch")
    parser.add_argument("--compare", type=nonnegative_int, default=0,
                        help="run both versions, interleaved, with this many seeds each (0: one run)")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--train-samples", type=nonnegative_int, default=0, help="the first N samples (0: all)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per rank")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=repo_path, default="runs/04_pitfalls/set_epoch")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):  # a missing dataset or a busy run directory: one line, before any collective
        train_set, val_set, num_classes = build_datasets("mnist")
        log = RunLog(args.run_dir, enabled=rank == 0, epochs=args.epochs, train_samples=args.train_samples)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=60))
    world_size = dist.get_world_size()
    if args.train_samples:
        train_set = Subset(train_set, range(args.train_samples))
    val_part = Subset(val_set, range(rank, len(val_set), world_size))  # no padding: each image once
    data = train_set, val_part, num_classes, device

    orders = {}  # rank 0's orders of seed 0, compared with its first epoch's, "without"/"with set_epoch"
    if args.compare:
        seeds = {case: iter(range(args.compare)) for case in (False, True)}  # round k: seed k for both

        def run(case):
            seed = next(seeds[case])
            return train(args, case, seed, *data, orders=orders if seed == 0 else None)

        result = compare({f"{'with' if case else 'without'} set_epoch": (lambda case=case: run(case))
                          for case in (False, True)}, repeats=args.compare, unit="val accuracy")
        log.finish(comparison=result.to_dict(), orders=orders, world_size=world_size)
    else:
        accuracy = train(args, args.fix, args.seed, *data, orders=orders)
        log.finish(val_accuracy=accuracy, set_epoch=args.fix, orders=orders, world_size=world_size)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
