"""Pitfall 2 of notebook 04: DistributedSampler without set_epoch(epoch) repeats one order every epoch.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_set_epoch.py         # set_epoch each epoch
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_set_epoch.py --bug   # never calls it
"""
import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.data import build_datasets
from course.hardware import backend_for, pick_device
from course.models import build_model
from course.runlog import RunLog


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", action="store_true", help="never call sampler.set_epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-samples", type=int, default=0, help="train on the first N samples (0: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--run-dir", default="runs/04_pitfalls/set_epoch")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=60))
    world_size = dist.get_world_size()
    torch.manual_seed(0)

    train_set, val_set, num_classes = build_datasets("mnist")
    if args.train_samples:
        train_set = Subset(train_set, range(args.train_samples))
    sampler = DistributedSampler(train_set, seed=0)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 1000)
    model = DDP(build_model("mlp", num_classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    log = RunLog(args.run_dir, enabled=rank == 0, set_epoch=not args.bug, world_size=world_size)

    for epoch in range(args.epochs):
        if not args.bug:
            sampler.set_epoch(epoch)  # the fix: a new permutation each epoch, the same one on every rank
        print(f"rank {rank} epoch {epoch}: first indices {list(sampler)[:6]}", flush=True)  # the diagnosis
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            counts = sum(torch.stack([(model(x.to(device)).argmax(1) == y.to(device)).sum(),
                                      torch.tensor(len(y), device=device)]) for x, y in val_loader)
        model.train()
        dist.all_reduce(counts)  # exact accuracy over the whole validation set (see pitfall 8)
        accuracy = counts[0].item() / counts[1].item()
        log.scalar("val/accuracy", accuracy, epoch + 1)
        if rank == 0:
            print(f"epoch {epoch}: val accuracy {accuracy:.4f}", flush=True)
    log.finish(val_accuracy=accuracy, epochs=args.epochs)
    # Free DDP before its process group: otherwise gloo sometimes aborts at exit (torch 2.14, CPU) with
    # "terminate called without an active exception". DDP holds reference cycles, so collect them too.
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
